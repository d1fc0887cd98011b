"""The complete-load contract: a source model loads whole from its files, or is refused.

transformers fills a tensor the checkpoint's files do not hold with fresh random values and only
warns: a sharded checkpoint whose index placed one tensor in the wrong shard was calibrated,
verified against a base loaded the same way, and published. Refused now: at fetch, without torch,
when the index and the shards disagree (compressflow/model/folder_checks/weights.py
`check_index`); before calibration, from the headers, when the model class needs a tensor the
files do not hold (compressflow/model/loading.py `check_loads_completely`); and at every load of
weights (`load_complete`), the only `from_pretrained` of weights there is.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from support.parameters import params

from compressflow.demo.zoo import VISION_BUILDERS, ZOO, build_tiny, model_class
from compressflow.errors import InputError, ModelFetchError
from compressflow.params import ModelArgs
from compressflow.results import FetchedModel

ROOT = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
LOST = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture()
def sharded(sharded_tiny_model) -> Path:
    """The tiny Llama saved by transformers in two shards, with their index."""
    assert len(set(weight_map(sharded_tiny_model).values())) == 2
    return sharded_tiny_model


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def copy_of(folder: Path, tmp_path: Path, name: str = "model") -> Path:
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def set_weight_map(folder: Path, changes: dict[str, str | None]) -> None:
    data = json.loads((folder / INDEX).read_text())
    for name, shard in changes.items():
        if shard is None:
            del data["weight_map"][name]
        else:
            data["weight_map"][name] = shard
    (folder / INDEX).write_text(json.dumps(data))


def edit_shard(file: Path, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def fetched(folder: Path, name: str = "llama") -> FetchedModel:
    return FetchedModel.model_construct(
        path=str(folder),
        model_id=str(folder),
        model_class=model_class(name),
        trust_remote_code=False,
    )


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


# --- (a) the case: refused at fetch, without torch ---------------------------------------


def test_an_index_that_places_a_tensor_in_the_wrong_shard_is_refused_at_fetch(sharded, tmp_path):
    from compressflow.tasks.fetch_model import fetch

    folder = copy_of(sharded, tmp_path)
    shards = sorted(set(weight_map(folder).values()))
    moved = next(name for name, shard in weight_map(folder).items() if shard == shards[1])
    set_weight_map(folder, {moved: shards[0]})
    before = snapshot(folder)
    started = time.perf_counter()
    with pytest.raises(ModelFetchError) as raised:
        fetch(ModelArgs(model_id=str(folder)))
    seconds = time.perf_counter() - started
    assert raised.value.field == "model.model_id"
    assert f"places 1 tensor(s) in shards that do not hold them: {moved} in {shards[0]} (it " in (
        raised.value.problem
    )
    assert f"is in {shards[1]})" in raised.value.problem
    assert "download the model again" in raised.value.fix
    assert snapshot(folder) == before and seconds < 2
    # Decided from the files alone: the flow's own process, which never imports torch, refuses it.
    code = (
        "import sys; from pathlib import Path\n"
        "from compressflow.model.folder_checks.weights import check_weight_files\n"
        "from compressflow.errors import ModelFetchError\n"
        "try:\n"
        f"    check_weight_files(Path({str(folder)!r}))\n"
        "except ModelFetchError as exc:\n"
        "    print('refused' if 'torch' not in sys.modules else 'torch imported', exc.problem)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("refused") and moved in out.stdout


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("dropped", "does not list 1 tensor(s) its shards hold"),
        ("nowhere", "(no file holds it)"),
        ("twice", "are in more than one shard"),
        ("single beside shards", "holds two checkpoints"),
        ("parent", "not files inside"),
        ("absolute", "not files inside"),
        ("missing subfolder", "lacks shards its index lists"),
        ("config names the weights", "names its weights file (transformers_weights"),
        ("no file transformers looks for", "but neither model.safetensors nor"),
    ],
)
def test_an_index_that_disagrees_with_its_shards_is_refused_naming_tensor_and_file(
    sharded, tiny_model, tmp_path, case, words
):
    from compressflow.model.folder_checks.weights import check_weight_files

    folder = copy_of(sharded, tmp_path)
    shards = sorted(set(weight_map(folder).values()))
    first = next(name for name, shard in weight_map(folder).items() if shard == shards[0])
    named = first  # what the refusal must name besides the index
    if case == "dropped":
        set_weight_map(folder, {first: None})
    elif case == "nowhere":
        named = "model.layers.9.mlp.up_proj.weight"
        set_weight_map(folder, {named: shards[0]})
    elif case == "twice":
        tensor = load_file(folder / shards[0])[first]
        edit_shard(folder / shards[1], lambda tensors: tensors.update({first: tensor}))
    elif case == "single beside shards":
        named = "model.safetensors and the 2 shard(s)"
        shutil.copy(Path(tiny_model) / "model.safetensors", folder)  # another revision's
    elif case == "parent":
        named = f"../{shards[0]}"
        set_weight_map(folder, {first: named})
    elif case == "absolute":
        named = str(folder / shards[0])
        set_weight_map(folder, {first: named})
    elif case == "missing subfolder":
        named = f"sub/{shards[0]}"
        set_weight_map(folder, {first: named})
    elif case == "config names the weights":
        named = shards[0]  # transformers would load this shard alone
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": named}))
    elif case == "no file transformers looks for":
        named = shards[0]
        (folder / INDEX).unlink()
    with pytest.raises(ModelFetchError) as raised:
        check_weight_files(folder)
    assert words in raised.value.problem and named in raised.value.problem
    assert raised.value.field == "model.model_id" and raised.value.fix


def test_a_consistent_sharded_checkpoint_passes(sharded):
    from compressflow.model.folder_checks.weights import check_weight_files
    from compressflow.model.loading import check_loads_completely

    assert LOST in check_weight_files(sharded)
    assert check_loads_completely(fetched(sharded)).endswith("are in its 2 file(s)")


# --- (b), (c): refused before calibration, from the headers -------------------------------------


def test_a_tensor_missing_from_its_shard_is_refused_before_calibration(sharded, tmp_path):
    from compressflow.flows.validate import validate

    folder = copy_of(sharded, tmp_path)
    shard = weight_map(folder)[LOST]
    edit_shard(folder / shard, lambda tensors: tensors.pop(LOST))
    set_weight_map(folder, {LOST: None})  # the index agrees: fetch has nothing to say
    started = time.perf_counter()
    with pytest.raises(InputError) as raised:
        validate(**params({"plain": str(folder)}, tmp_path))
    seconds = time.perf_counter() - started
    assert raised.value.field == "model.model_id"
    assert raised.value.problem.startswith(f"the source model at {folder} does not load completely")
    assert f"missing keys ['{LOST}']" in raised.value.problem
    assert f"{INDEX} lists none of them" in raised.value.problem
    assert "random values" in raised.value.problem
    assert "model.model_class" in raised.value.fix
    assert not (tmp_path / "out").exists()
    assert seconds < 30, seconds


def test_the_check_before_calibration_takes_well_under_a_second(sharded):
    """In the flow it runs in a warm child; here, with the class's code imported once."""
    from compressflow.flows.checks import check_weights
    from compressflow.model.loading import check_loads_completely

    check_loads_completely(fetched(sharded))
    started = time.perf_counter()
    check_loads_completely(fetched(sharded))
    assert time.perf_counter() - started < 0.5
    assert check_weights.__doc__  # what validate's "weights" row runs


def test_a_renamed_key_is_refused_naming_the_missing_one(tiny_model, tmp_path):
    from compressflow.model.loading import check_loads_completely

    folder = copy_of(tiny_model, tmp_path)
    edit_shard(
        folder / "model.safetensors",
        lambda tensors: tensors.update({f"{LOST}s": tensors.pop(LOST)}),
    )
    with pytest.raises(InputError) as raised:
        check_loads_completely(fetched(folder))
    problem = raised.value.problem
    assert f"missing keys ['{LOST}']" in problem and "model.safetensors holds none" in problem
    assert f"the files hold 1 tensor(s) it does not load: ['{LOST}s']" in problem


def test_a_tensor_of_another_shape_is_refused(tiny_model, tmp_path):
    from compressflow.model.loading import check_loads_completely

    folder = copy_of(tiny_model, tmp_path)
    edit_shard(folder / "model.safetensors", lambda t: t.update({LOST: t[LOST][:-1].clone()}))
    with pytest.raises(InputError) as raised:
        check_loads_completely(fetched(folder))
    assert f"mismatched keys ['{LOST} [511, 256] in the files, [512, 256] in the model']" in (
        raised.value.problem
    )


# --- (d) no false positive: every architecture the zoo builds --------------------------------------


@pytest.mark.parametrize("name", [*ZOO, *VISION_BUILDERS])
def test_every_zoo_architecture_loads_completely(zoo_root, name):
    """Tied weights, `_keys_to_ignore_on_load_missing` and non-persistent buffers are not in
    transformers' report: nothing a real checkpoint leaves out by design is refused."""
    import transformers

    from compressflow.model.loading import check_loads_completely, load_complete

    path = build_tiny(name, zoo_root)
    assert "tensors the model loads" in check_loads_completely(fetched(path, name))
    load_complete(getattr(transformers, model_class(name)), path, "the source model")


# --- (e) the loader itself, and every path through it --------------------------------------------


def test_the_loader_refuses_a_folder_missing_a_tensor_naming_tensor_and_file(sharded, tmp_path):
    """Called directly, past fetch's checks: the index lists the tensor, its shard lacks it."""
    import transformers

    from compressflow.model.loading import load_complete

    folder = copy_of(sharded, tmp_path)
    shard = weight_map(folder)[LOST]
    edit_shard(folder / shard, lambda tensors: tensors.pop(LOST))
    with pytest.raises(InputError) as raised:
        load_complete(transformers.AutoModelForCausalLM, folder, "the source model", field="f")
    assert raised.value.field == "f"
    assert f"missing keys ['{LOST}']" in raised.value.problem
    assert f"{INDEX} places them in ['{shard}']" in raised.value.problem


def test_calibration_and_the_offloaded_load_refuse_it_too(tiny_model, tmp_path):
    """In memory, and under compressed-tensors' `load_offloaded_model` (disk placement, and a
    multi-GPU rank's load), which expects `from_pretrained` to return the model alone."""
    from compressflow.calibration.run import load_for_calibration
    from compressflow.model.offload import load_offloaded
    from compressflow.results import MemoryPlan

    folder = copy_of(tiny_model, tmp_path)
    edit_shard(folder / "model.safetensors", lambda tensors: tensors.pop(LOST))
    model = fetched(folder)
    for placement in ("cpu", "disk"):
        plan = MemoryPlan.model_construct(
            path="classic",
            placement=placement,
            weights_in_memory_bytes=0,
            offload_folder=str(tmp_path / "offload"),
        )
        with pytest.raises(InputError, match=f"missing keys \\['{LOST}'\\]"):
            load_for_calibration(model, plan)
    with pytest.raises(InputError, match=LOST):
        load_offloaded(model, plan)


def test_a_streamed_source_missing_a_tensor_is_refused_not_streamed(tiny_model, tmp_path):
    from compressflow.model.streaming import streamed_model

    folder = copy_of(tiny_model, tmp_path)
    edit_shard(folder / "model.safetensors", lambda tensors: tensors.pop(LOST))
    with pytest.raises(InputError, match=f"missing keys \\['{LOST}'\\]"):
        streamed_model(fetched(folder), folder)


def test_the_output_reload_fails_its_check_naming_the_tensor(tiny_model, tmp_path):
    from compressflow.results import MemoryPlan
    from compressflow.verification.reload import reload

    folder = copy_of(tiny_model, tmp_path)
    edit_shard(folder / "model.safetensors", lambda tensors: tensors.pop(LOST))
    plan = MemoryPlan.model_construct(path="classic", placement="cpu")
    for weights in (True, False):
        loaded, check = reload(folder, fetched(folder), plan, weights=weights)
        assert loaded is None and not check.passed
        assert f"missing keys ['{LOST}']" in check.detail


# --- no warning-only load path remains --------------------------------------------------------------

# Classes whose from_pretrained reads no weights: configs, tokenizers, processors.
NOT_WEIGHTS = ("Config", "Tokenizer", "TokenizerFast", "Processor", "FeatureExtractor")
LOADER = ROOT / "compressflow" / "model" / "loading.py"


def weight_loads(files) -> list[str]:
    """file:line of each `X.from_pretrained(...)` call whose X is not a config, tokenizer or
    processor class."""
    found = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_pretrained"
            ):
                continue
            receiver = node.func.value
            name = getattr(receiver, "attr", None) or getattr(receiver, "id", "")
            if not name.endswith(NOT_WEIGHTS):
                where = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file.name
                found.append(f"{where}:{node.lineno}")
    return found


def test_every_load_of_weights_goes_through_the_one_loader():
    files = [
        file
        for folder in ("compressflow", "tasks", "flows", "blocks")
        for file in sorted((ROOT / folder).rglob("*.py"))
        if file != LOADER
    ]
    assert not weight_loads(files), (
        "load weights with compressflow.model.loading.load_complete, which refuses an incomplete "
        "load; these call from_pretrained themselves"
    )
    assert weight_loads([LOADER])  # the search finds what it looks for


def test_the_search_names_file_and_line(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(
        "import transformers\n"
        "config = transformers.AutoConfig.from_pretrained('x')\n"
        "tokenizer = AutoTokenizer.from_pretrained('x')  # from_pretrained( in a comment\n"
        "model = getattr(transformers, 'AutoModelForCausalLM').from_pretrained('x')\n"
        "model = cls.from_pretrained(None, state_dict={})\n"
    )
    assert weight_loads([module]) == ["probe.py:4", "probe.py:5"]
