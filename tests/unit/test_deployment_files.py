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
