"""Cheap checks first, in the flow's own process (issue 39): whatever the files decide without
torch is refused by `precheck` before the forkserver is needed, with the field, the problem and
the fix, and nothing written (no output folder, the source folder as it was).

Each refusal is asked of `resolve_inputs` with the forkserver and every stage forbidden, so it
cannot come from a child; one case runs `compressflow validate` in a fresh process, which must end
with no forkserver started. The timings: benchmarks/refusal_time.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compressflow.errors import DatasetError, ModelFetchError, PublishError, RecipeError
from compressflow.flows import checks
from compressflow.flows.checks import precheck, resolve_inputs
from compressflow.inputs import RunArgs
from compressflow.model.folder_checks import files as file_checks
from compressflow.model.folder_checks.registry import check_folder
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs

DATA = {"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64}
BAD_TEMPLATE = "{% for m in messages %}{{ m['content'] }{% endfor %}"
# transformers' own extensions: {% generation %} (assistant masks) and loop controls.
GOOD_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
    "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"
)
PLACEHOLDER = (
    "quant_stage:\n  quant_modifiers:\n    GPTQModifier: "
    "{targets: Linear, scheme: W4A16, dampening_frac: $damp}\n"
)


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def drop(data: dict, key: str) -> dict:
    return {k: v for k, v in data.items() if k != key}


def to_pickle(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def cut_tokenizer(folder: Path) -> None:
    file = folder / "tokenizer.json"
    file.write_bytes(file.read_bytes()[:-100])


# name -> (what is done to a copy of the tiny model, field, words of the problem, words of the fix)
FOLDERS = {
    "config.json not JSON": (
        lambda f: (f / "config.json").write_text('{"model_type": "llama",'),
        "model.model_id",
        ["config.json is not valid JSON", "line 1"],
        ["config.json"],
    ),
    "model_type not a name": (
        lambda f: edit_json(f / "config.json", model_type=5),
        "model.model_id",
        ["sets model_type to 5"],
        ["model_type"],
    ),
    "no model_type": (
        lambda f: (f / "config.json").write_text(
            json.dumps(drop(json.loads((f / "config.json").read_text()), "model_type"))
        ),
        "model.model_id",
        ["has no model_type", "AutoModelForCausalLM"],
        ['"model_type": "llama"'],
    ),
    "generation_config.json not JSON": (
        lambda f: (f / "generation_config.json").write_text("{'do_sample': True}"),
        "model.model_id",
        ["generation_config.json is not valid JSON"],
        ["generation_config.json"],
    ),
    "special_tokens_map.json a list": (
        lambda f: (f / "special_tokens_map.json").write_text("[]"),
        "model.model_id",
        ["special_tokens_map.json holds a JSON list, not an object"],
        ["special_tokens_map.json"],
    ),
    "tokenizer.json cut off": (
        cut_tokenizer,
        "model.model_id",
        ["tokenizer.json is not valid JSON"],
        ["tokenizer.json"],
    ),
    "chat_template syntax": (
        lambda f: edit_json(f / "tokenizer_config.json", chat_template=BAD_TEMPLATE),
        "model.model_id",
        ["chat_template in", "tokenizer_config.json is not a valid chat template", "line 1"],
        ["fix chat_template in tokenizer_config.json"],
    ),
    "chat_template.jinja syntax": (
        lambda f: (f / "chat_template.jinja").write_text("{% if messages %}\n{{ x }}\n"),
        "model.model_id",
        ["chat_template.jinja is not a valid chat template", "endif"],
        ["chat_template.jinja"],
    ),
    "named chat template not text": (
        lambda f: edit_json(
            f / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": 5}]
        ),
        "model.model_id",
        ["chat_template 'tool_use'", "is a JSON int, not the text of a template"],
        ["tokenizer_config.json"],
    ),
    "tokenizer auto_map": (
        lambda f: edit_json(
            f / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tok.Slow", "tok.Fast"]}
        ),
        "model.trust_remote_code",
        ["tokenizer_config.json loads its tokenizer from the repository's own code"],
        ["trust_remote_code: true", "delete auto_map from tokenizer_config.json"],
    ),
    "config auto_map": (
        lambda f: edit_json(f / "config.json", auto_map={"AutoModelForCausalLM": "m.Custom"}),
        "model.trust_remote_code",
        ["defines its architecture in its own code"],
        ["trust_remote_code: true"],
    ),
    "pickle-only weights": (
        to_pickle,
        "model.model_id",
        ["only as pickle files (pytorch_model.bin)", "torch.load", "execute code"],
        ["convert them to safetensors", "save_pretrained", "never switch that off"],
    ),
    "truncated shard": (
        lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:100_000]
        ),
        "model.model_id",
        ["model.safetensors is truncated"],
        ["download the model again"],
    ),
}


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """A copy of the tiny model per case, each broken its own way."""
    root = tmp_path_factory.mktemp("cheap")
    made = {}
    for name, (change, *_) in FOLDERS.items():
        folder = root / name.replace(" ", "-")
        shutil.copytree(tiny_model, folder)
        change(folder)
        made[name] = folder
    return made


@pytest.fixture()
def no_children(monkeypatch):
    """resolve_inputs as the flow and validate run it, with the forkserver and every stage
    forbidden: a refusal that arrives came from the flow's own process."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the forkserver or a stage was needed before the refusal")

    monkeypatch.setattr(checks, "warm_up", forbidden)
    monkeypatch.setattr(checks, "in_child", forbidden)
    return lambda args: resolve_inputs(forbidden, args)


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    }


def run_args(model: Path | str, tmp_path: Path, **groups) -> RunArgs:
    return RunArgs(
        model=ModelArgs(model_id=str(model), **groups.pop("model", {})),
        dataset=DatasetArgs(**{**DATA, **groups.pop("dataset", {})}),
        recipe=RecipeArgs(**groups.pop("recipe", {"recipe": "W4A16"})),
        output=OutputArgs(**{"save_directory": str(tmp_path / "out"), **groups.pop("output", {})}),
    )


@pytest.mark.parametrize("case", FOLDERS)
def test_a_broken_model_folder_is_refused_before_any_child(folders, no_children, tmp_path, case):
    _, field, problem, fix = FOLDERS[case]
    folder = folders[case]
    before = files(folder)
    with pytest.raises(ModelFetchError) as raised:
        no_children(run_args(folder, tmp_path))
    assert raised.value.field == field
    for words in problem:
        assert words in raised.value.problem
    for words in fix:
        assert words in raised.value.fix
    assert not (tmp_path / "out").exists()
    assert files(folder) == before


def test_the_tiny_model_and_its_template_pass_the_precheck(tiny_model, tmp_path):
    check_folder(tiny_model, ModelArgs(model_id=str(tiny_model)))
    precheck(run_args(tiny_model, tmp_path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change",
    [
        # transformers' {% generation %} and {% break %} parse as they do there.
        lambda f: edit_json(f / "tokenizer_config.json", chat_template=GOOD_TEMPLATE),
        lambda f: edit_json(
            f / "tokenizer_config.json",
            chat_template=[{"name": "default", "template": GOOD_TEMPLATE}],
        ),
        # Pickle files beside safetensors are never read.
        lambda f: (f / "training_args.pt").write_bytes(b"\x80\x04N."),
        # A JSON file no loader reads as settings may hold any JSON.
        lambda f: (f / "eval_results.json").write_text("[0.5, 0.25]"),
    ],
    ids=["generation tag", "named templates", "pickle beside safetensors", "other json"],
)
def test_what_transformers_loads_safely_passes(tiny_model, tmp_path, change):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    change(folder)
    check_folder(folder, ModelArgs(model_id=str(folder)))


def test_a_json_file_past_the_cap_is_checked_by_its_ends(tiny_model, tmp_path, monkeypatch):
    # A large tokenizer.json (Gemma's is 33 MB) is not parsed here, whole; cut off, it shows.
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    monkeypatch.setattr(
        file_checks, "MAX_JSON_BYTES", (folder / "tokenizer.json").stat().st_size // 2
    )
    check_folder(folder, ModelArgs(model_id=str(folder)))
    cut_tokenizer(folder)
    with pytest.raises(ModelFetchError, match="tokenizer.json is not valid JSON: it is cut off"):
        check_folder(folder, ModelArgs(model_id=str(folder)))


def test_trust_remote_code_lets_a_tokenizer_auto_map_through(folders):
    folder = folders["tokenizer auto_map"]
    check_folder(folder, ModelArgs(model_id=str(folder), trust_remote_code=True))


def test_a_file_named_as_the_model_is_refused(tiny_model, no_children, tmp_path):
    with pytest.raises(ModelFetchError, match="config.json is a file, not a model folder"):
        no_children(run_args(tiny_model / "config.json", tmp_path))


@pytest.fixture()
def unreadable(monkeypatch):
    """Files of the names given that this worker may not open, whoever it runs as (root reads
    files whatever their permissions)."""
    names: set[str] = set()
    real_open = Path.open

    def open_(self, *args, **kwargs):
        if self.name in names:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    return names


def test_a_file_this_worker_cannot_read_is_refused(tiny_model, no_children, tmp_path, unreadable):
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    unreadable.update({"tokenizer.json", "data.jsonl"})
    with pytest.raises(ModelFetchError) as raised:
        no_children(run_args(tiny_model, tmp_path))
    assert raised.value.problem.endswith(
        "tokenizer.json cannot be read by this worker (Permission denied)"
    )
    assert "chmod a+r" in raised.value.fix
    unreadable.remove("tokenizer.json")
    with pytest.raises(DatasetError, match="data.jsonl' cannot be read by this worker"):
        no_children(
            run_args(tiny_model, tmp_path, dataset={"dataset_name": str(tmp_path / "data.jsonl")})
        )


def test_fetch_refuses_the_same_folders(folders):
    # A hub or ClearML download is checked by fetch (the same check_folder), after it lands.
    from compressflow.tasks.fetch_model import fetch

    folder = folders["chat_template syntax"]
    with pytest.raises(ModelFetchError, match="not a valid chat template"):
        fetch(ModelArgs(model_id=str(folder)))


# --- The recipe, the output folder and the data file -----------------------------------------

OTHERS = {
    "unknown preset": (
        {"recipe": {"recipe": "W4A61"}},
        RecipeError,
        "recipe.recipe",
        ["'W4A61' is not a preset"],
    ),
    "placeholder without a value": (
        {"recipe": {"recipe": PLACEHOLDER}},
        RecipeError,
        "recipe.recipe_args",
        ["placeholders without a value: $damp"],
    ),
    "recipe_args the preset lacks": (
        {"recipe": {"preset": "W4A16", "recipe_args": {"dampening": 0.1}}},
        RecipeError,
        "recipe.recipe_args",
        ["preset W4A16 has no placeholder dampening"],
    ),
    "recipe text not YAML": (
        {"recipe": {"recipe": "quant_stage:\n  quant_modifiers: [Linear\n"}},
        RecipeError,
        "recipe.recipe",
        ["not valid YAML"],
    ),
    "recipe file missing": (
        {"recipe": {"recipe": "./no/such/recipe.yaml"}},
        RecipeError,
        "recipe.recipe",
        ["does not exist"],
    ),
    "missing local model": (
        {"model_id": "./no/such/model"},
        ModelFetchError,
        "model.model_id",
        ["local folder ./no/such/model does not exist"],
    ),
    "output inside the source": (
        {"output": {"save_directory": "{model}/compressed"}},
        PublishError,
        "output.save_directory",
        ["lies inside the source model's folder"],
    ),
    "output under a file": (
        {"output": {"save_directory": "{tmp}/binary.txt/out"}},
        PublishError,
        "output.save_directory",
        ["which is a file, not a folder"],
    ),
    "binary data file": (
        {"dataset": {"dataset_name": "{tmp}/binary.txt"}},
        DatasetError,
        "dataset.dataset_name",
        ["is not UTF-8 text"],
    ),
    "empty data file": (
        {"dataset": {"dataset_name": "{tmp}/empty.jsonl"}},
        DatasetError,
        "dataset.dataset_name",
        ["empty.jsonl' is empty"],
    ),
    "missing data file": (
        {"dataset": {"dataset_name": "{tmp}/none.jsonl"}},
        DatasetError,
        "dataset.dataset_name",
        ["none.jsonl' does not exist"],
    ),
}


def filled(value, model: Path, tmp: Path):
    """`value` with {model} and {tmp} in its strings replaced by those folders."""
    if isinstance(value, dict):
        return {k: filled(v, model, tmp) for k, v in value.items()}
    if isinstance(value, str):
        return value.replace("{model}", str(model)).replace("{tmp}", str(tmp))
    return value


@pytest.mark.parametrize("case", OTHERS)
def test_the_recipe_output_and_data_are_refused_before_any_child(
    tiny_model, no_children, tmp_path, case
):
    changes, error, field, problem = OTHERS[case]
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    changes = filled(changes, model=model, tmp=tmp_path)
    before = files(model)
    with pytest.raises(error) as raised:
        no_children(run_args(changes.pop("model_id", model), tmp_path, **changes))
    assert raised.value.field == field
    for words in problem:
        assert words in raised.value.problem
    assert raised.value.fix
    assert not (tmp_path / "out").exists() and not (model / "compressed").exists()
    assert files(model) == before


def test_a_data_free_preset_does_not_read_the_data_file(tiny_model, tmp_path):
    # FP8_DYNAMIC calibrates on no data: the flow never reads dataset_name, nor does the precheck.
    args = run_args(
        tiny_model,
        tmp_path,
        recipe={"preset": "FP8_DYNAMIC"},
        dataset={"dataset_name": str(tmp_path / "none.jsonl")},
    )
    precheck(args)


# --- In a fresh process, as a user runs it ----------------------------------------------------

HEAVY = ("torch", "transformers", "llmcompressor", "datasets", "compressed_tensors")
# `python -m compressflow.flows.cli validate FILE`; at exit, whether a forkserver was started and
# what the process imported.
SCRIPT = (
    "import atexit, json, runpy, sys; from multiprocessing import forkserver; "
    "out = sys.argv.pop(); atexit.register(lambda: open(out, 'w').write(json.dumps({"
    "'forkserver': forkserver._forkserver._forkserver_pid, "
    f"'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))); "
    "runpy.run_module('compressflow.flows.cli', run_name='__main__')"
)


def test_validate_refuses_in_a_fresh_process_without_starting_the_forkserver(folders, tmp_path):
    params = {
        "model": {"model_id": str(folders["chat_template syntax"])},
        "dataset": DATA,
        "recipe": {"preset": "W4A16"},
        "output": {"save_directory": str(tmp_path / "out")},
    }
    file = tmp_path / "params.yaml"
    file.write_text(json.dumps(params))
    seen = tmp_path / "seen.json"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, "validate", str(file), str(seen)],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: model.model_id: ")
    assert "is not a valid chat template" in run.stderr and "Fix: " in run.stderr
    assert json.loads(seen.read_text()) == {"forkserver": None, "heavy": []}
    assert not (tmp_path / "out").exists()
