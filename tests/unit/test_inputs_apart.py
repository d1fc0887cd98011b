"""Every input is a source (issue 55): the output may not be, lie inside or contain a file or folder
the run reads (the model, the calibration data, the recipe file, the held-out text), nor may an
offload folder or an upload land among them. Refused by `precheck` before any child starts, and
again by `resolve_inputs` for the default output folder, naming the parameter, both paths and the
fix; an output beside an input, or merely named alike, passes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from compressflow.errors import InputError, PublishError, SettingsError
from compressflow.flows import checks
from compressflow.flows.checks import precheck, resolve_inputs, sources_read
from compressflow.flows.sweep import check_points_apart
from compressflow.inputs import RunArgs
from compressflow.params import (
    CalibrationArgs,
    DatasetArgs,
    HeldOutArgs,
    ModelArgs,
    OutputArgs,
    RecipeArgs,
    TargetArgs,
)
from compressflow.results import Point
from compressflow.store.output import check_apart, check_upload_apart

RECIPE = "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {targets: Linear, scheme: W4A16}\n"


@pytest.fixture()
def inputs(tiny_model, tmp_path) -> dict[str, Path]:
    """A model folder, a data folder with a file, a recipe file and a held-out file, apart."""
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "corpus" / "data").mkdir(parents=True)
    data = tmp_path / "corpus" / "data"
    (data / "calib.jsonl").write_text('{"text": "def f(): return 1"}\n' * 20)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "w4.yaml").write_text(RECIPE)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "held.jsonl").write_text('{"text": "x = 1"}\n' * 20)
    return {
        "model": tmp_path / "model",
        "data": data,
        "data file": data / "calib.jsonl",
        "recipe": tmp_path / "recipes" / "w4.yaml",
        "held-out": tmp_path / "eval" / "held.jsonl",
    }


def run_args(inputs: dict[str, Path], data: Path, output: str, **groups) -> RunArgs:
    """A run reading every input: `data` as dataset_name, the recipe file, held-out text for a
    perplexity target."""
    return RunArgs(
        model=ModelArgs(model_id=str(inputs["model"])),
        dataset=DatasetArgs(dataset_name=str(data), text_samples=8, max_seq_len=64),
        recipe=RecipeArgs(recipe=str(inputs["recipe"])),
        output=OutputArgs(save_directory=output),
        target=TargetArgs(
            max_perplexity_ratio=1.5, held_out=HeldOutArgs(dataset_name=str(inputs["held-out"]))
        ),
        **groups,
    )


@pytest.fixture()
def no_children(monkeypatch):
    """resolve_inputs with the forkserver and every stage forbidden: the refusal is precheck's."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the forkserver or a stage was needed before the refusal")

    monkeypatch.setattr(checks, "warm_up", forbidden)
    monkeypatch.setattr(checks, "in_child", forbidden)
    return lambda args: resolve_inputs(forbidden, args)


OVERLAPS = {
    # (the input given as dataset_name, the output, how it overlaps, the input the refusal names)
    "output inside the data folder": ("data", lambda i: i["data"] / "out", "lies inside", "data"),
    "output is the data folder": ("data", lambda i: i["data"], "is", "data"),
    "output holds the data folder": ("data", lambda i: i["data"].parent, "contains", "data"),
    "output holds the data file": ("data file", lambda i: i["data"], "contains", "data file"),
    "output is the data file": ("data file", lambda i: i["data file"], "is", "data file"),
    "output holds the recipe file": ("data", lambda i: i["recipe"].parent, "contains", "recipe"),
    "output is the recipe file": ("data", lambda i: i["recipe"], "is", "recipe"),
    "output holds the held-out": ("data", lambda i: i["held-out"].parent, "contains", "held-out"),
    "output in the held-out file": ("data", lambda i: i["held-out"], "is", "held-out"),
}
NAMED = {
    "data": "the calibration data (dataset.dataset_name)",
    "data file": "the calibration data (dataset.dataset_name)",
    "recipe": "the recipe file (recipe.recipe)",
    "held-out": "the held-out text (target.held_out.dataset_name)",
}


@pytest.mark.parametrize("case", OVERLAPS)
def test_an_output_on_in_or_around_an_input_is_refused_before_any_child(inputs, no_children, case):
    data, where, how, named = OVERLAPS[case]
    output = where(inputs)
    with pytest.raises(PublishError) as raised:
        no_children(run_args(inputs, inputs[data], str(output)))
    refusal = raised.value
    assert refusal.field == "output.save_directory"
    assert f"{output.resolve()} {how} {NAMED[named]}: {inputs[named].resolve()}" in refusal.problem
    assert f"outside {inputs[named].resolve()}" in refusal.fix
    assert not (inputs["data"] / "out").exists()


def test_a_link_to_the_data_folder_inside_the_output_counts(inputs, no_children, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.move(inputs["data"], out / "data")
    (tmp_path / "data-link").symlink_to(out / "data")  # the run is given the link
    with pytest.raises(PublishError, match=r"contains the calibration data .*symlinks resolved"):
        no_children(run_args(inputs, tmp_path / "data-link", str(out)))


@pytest.mark.parametrize(
    "output",
    [
        lambda t: t / "compressed",  # beside every input
        lambda t: t / "corpus" / "data2",  # named as the data folder, and more
        lambda t: t / "corpus" / "dat",
        lambda t: t / "recipes" / "w4",  # beside the recipe file, its name without the suffix
        lambda t: t / "eval" / "held.jsonl.out",
    ],
    ids=["sibling", "data2", "dat", "beside the recipe", "beside the held-out"],
)
def test_an_output_beside_the_inputs_passes_the_precheck(inputs, tmp_path, output):
    precheck(run_args(inputs, inputs["data"], str(output(tmp_path))))


def test_an_input_the_run_does_not_read_is_no_source(inputs, tmp_path):
    args = RunArgs(
        model=ModelArgs(model_id="acme/tiny-llama"),  # a hub id: no local folder yet
        dataset=DatasetArgs(dataset_name="python_docs"),  # a shortcut, not a path
        recipe=RecipeArgs(recipe=RECIPE),  # text, not a file
        target=TargetArgs(held_out=HeldOutArgs(dataset_name=str(inputs["held-out"]))),  # no target
    )
    assert sources_read(args, None) == []
    read = sources_read(run_args(inputs, inputs["data file"], ""), inputs["model"])
    assert [what for what, _ in read] == [
        "the source model's folder (model.model_id)",
        NAMED["data file"],
        NAMED["recipe"],
        NAMED["held-out"],
    ]


def test_an_offload_folder_inside_an_input_is_refused(inputs, no_children, tmp_path):
    args = run_args(
        inputs,
        inputs["data"],
        str(tmp_path / "out"),
        calibration=CalibrationArgs(offload_folder=str(inputs["data"] / "offload")),
    )
    with pytest.raises(InputError, match="calibration.offload_folder: .* lies inside the calib"):
        no_children(args)
    assert not (inputs["data"] / "offload").exists()


def test_an_upload_inside_an_input_is_refused(inputs, tmp_path):
    sources = sources_read(run_args(inputs, inputs["data"], ""), inputs["model"])
    for place, uri, how in [
        ("data", f"file://{inputs['data']}/upload", "lies inside"),
        ("recipe", f"file://{inputs['recipe'].parent}", "contains"),
        ("held-out", f"file://{inputs['held-out'].parent}", "contains"),
    ]:
        with pytest.raises(InputError, match=re.escape(f"{how} {NAMED[place]}, ")):
            check_upload_apart(uri, sources)
    check_upload_apart(f"file://{tmp_path}/upload", sources)


def test_the_default_output_inside_the_data_names_the_setting(inputs, monkeypatch):
    # COMPRESSFLOW_OUTPUT_DIR is the data folder: the output is only known after fetch and render.
    monkeypatch.setenv("COMPRESSFLOW_OUTPUT_DIR", str(inputs["data"]))

    def run(stage, *args):
        return stage.fn(*args)

    with pytest.raises(SettingsError) as raised:
        resolve_inputs(run, run_args(inputs, inputs["data"], ""), weights=False)
    assert raised.value.field == "COMPRESSFLOW_OUTPUT_DIR"
    assert "lies inside the calibration data (dataset.dataset_name)" in raised.value.problem
    assert list(inputs["data"].iterdir()) == [inputs["data file"]]


def test_a_sweep_root_inside_an_input_is_refused_before_any_point(inputs, tmp_path):
    points = [Point(recipe_args={"x": x}, text_samples=8) for x in (1, 2)]
    args = run_args(inputs, inputs["data"], "").model_copy(update={"target": TargetArgs()})
    held_out = HeldOutArgs(dataset_name=str(inputs["held-out"].parent))  # a folder of texts
    with pytest.raises(PublishError, match="output_root: .* lies inside the calibration data"):
        check_points_apart(inputs["data"] / "sweep", points, args, held_out)
    with pytest.raises(PublishError, match=r"output_root: .* lies inside the held-out text \(held"):
        check_points_apart(inputs["held-out"].parent / "sweep", points, args, held_out)
    check_points_apart(tmp_path, points, args, held_out)  # the points beside the inputs
    check_points_apart(tmp_path / "corpus", points, args, held_out)  # beside the data folder


def test_check_apart_keeps_a_new_input_to_one_line(tmp_path):
    sources = [("the source model's folder", tmp_path / "m"), ("a new input (x.y)", tmp_path / "x")]
    with pytest.raises(PublishError, match=r"lies inside a new input \(x.y\)"):
        check_apart(tmp_path / "x" / "out", sources)
    check_apart(tmp_path / "x-out", sources)


def test_validate_refuses_an_output_inside_the_data_and_passes_one_beside_it(inputs, tmp_path):
    from compressflow.flows.validate import validate

    params = {
        "model": {"model_id": str(inputs["model"])},
        "dataset": {"dataset_name": str(inputs["data"]), "text_samples": 8, "max_seq_len": 64},
        "recipe": {"recipe": str(inputs["recipe"])},
    }
    with pytest.raises(PublishError, match="lies inside the calibration data"):
        validate(**params, output={"save_directory": str(inputs["data"] / "w4a16")})
    assert list(inputs["data"].iterdir()) == [inputs["data file"]]
    beside = tmp_path / "corpus" / "data-w4a16"  # the known failure's fix: a sibling
    report = validate(**params, output={"save_directory": str(beside)})
    assert report.output_path == str(beside)
