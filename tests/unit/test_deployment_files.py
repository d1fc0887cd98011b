"""The deployment files without a server: prefect.yaml's opening comment repeats the README's
deploy commands (which tests/support/prefect_stack.py runs), and an empty block name is no block
reference. The deployments themselves, on a real stack: tests/e2e/test_deployments.py.
"""

from __future__ import annotations

from support.prefect_stack import ROOT


def test_an_empty_block_name_references_no_block():
    from compressflow.blocks.check_deployments import references

    config = {"deployments": [{"name": "d", "parameters": {"model": {"hub_token_block": ""}}}]}
    assert references(config) == []


def test_prefect_yaml_lists_the_readme_commands():
    """prefect.yaml's opening comment repeats the README's commands: the two cannot drift."""
    from support.prefect_stack import readme_commands

    def command(line: str) -> str:
        return line.split(" #")[0].strip()

    readme = [command(line) for block in readme_commands().values() for line in block]
    header = (ROOT / "prefect.yaml").read_text().split("\n\n")[0].splitlines()
    listed = [command(line.removeprefix("#")) for line in header if line.startswith("#   ")]
    assert listed == readme


def test_a_deploy_checks_its_blocks_once_for_all_its_deployments(tmp_path, monkeypatch):
    from compressflow.blocks import check_deployments

    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text("deployments: []\n")
    checked = []
    monkeypatch.setattr(
        check_deployments, "missing_blocks", lambda file: checked.append(file) or []
    )
    for _ in range(3):  # as `prefect deploy --all` runs the build step, once per deployment
        check_deployments.main([str(prefect_file), "--once-per-deploy"])
    assert checked == [prefect_file]
    check_deployments.main([str(prefect_file)])  # by hand: always checked
    prefect_file.write_text("deployments: [{name: edited}]\n")  # another text: checked again
    check_deployments.main([str(prefect_file), "--once-per-deploy"])
    assert checked == [prefect_file] * 3
    check_deployments.deploy_mark(prefect_file).unlink()


def test_the_evaluate_trigger_reads_the_upload_uri_where_the_model_was_uploaded():
    """evaluate-model's trigger fills `compressed` with the published event's `upload_uri` when
    compress-model uploaded the model (another host then reads it from the store), else with its
    `path`; rendered as Prefect's server renders an automation's parameters."""
    import json

    import yaml
    from prefect.events.schemas.events import Event
    from prefect.server.utilities.user_templates import (
        render_user_template_sync,
        validate_user_template,
    )

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (evaluate,) = [d for d in config["deployments"] if d["name"] == "evaluate"]
    (trigger,) = evaluate["triggers"]
    template = trigger["parameters"]["compressed"]["model_id"].strip()
    # The server (RunDeployment in prefect.server.events.actions) renders a parameter that is
    # one {{ expression }} as "{{ expression | tojson }}" and parses the result as JSON; the
    # filter binds tighter than `or`, so an unbracketed `a or b` sent a bare URI, refused as
    # InvalidJSON, and no evaluation started.
    assert template.startswith("{{") and template.endswith("}}") and template.count("{{") == 1
    server_side = "{{ " + template[2:-2].strip() + " | tojson }}"
    validate_user_template(server_side)

    def rendered(payload: dict) -> str:
        event = Event(
            event="compressflow.model.published",
            resource={"prefect.resource.id": "compressflow.model." + "k" * 64},
            payload=payload,
        )
        return json.loads(render_user_template_sync(server_side, {"event": event}))

    assert rendered({"path": "/models/m", "upload_uri": "s3://models/m"}) == "s3://models/m"
    assert rendered({"path": "/models/m", "upload_uri": ""}) == "/models/m"
    assert rendered({"path": "/models/m"}) == "/models/m"  # an event from before upload_uri


def test_a_deployment_parameter_given_twice_stops_the_deploy_naming_both_lines(tmp_path, capsys):
    """Prefect keeps the second of two values silently; the check-blocks build step refuses."""
    import pytest

    from compressflow.blocks import check_deployments

    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(
        "deployments:\n"
        "  - name: nightly\n"
        "    parameters:\n"
        "      model: {model_id: acme/a}\n"
        "      recipe: {recipe: W4A16}\n"
        "      model: {model_id: acme/b}\n"
    )
    with pytest.raises(SystemExit) as exited:
        check_deployments.main([str(prefect_file)])  # refused before asking the server
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        f"prefect_file: {prefect_file} sets `deployments[0].parameters.model` twice: line 4, "
        "column 7 and line 6, column 7; YAML allows a key once in a mapping, and the second "
        "would silently replace the first. Fix: keep one of them: delete the other, or rename "
        "it if it meant another key\n"
    )


def test_the_projects_prefect_yaml_reads_as_the_build_step_reads_it():
    from compressflow.blocks.check_deployments import read_prefect_file

    names = [d["name"] for d in read_prefect_file(ROOT / "prefect.yaml")["deployments"]]
    assert "compress" in names and "evaluate" in names
