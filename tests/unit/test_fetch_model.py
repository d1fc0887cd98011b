"""Fetch model: local folders, the hub code path over a local cache, and early refusals."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from support.models import HUB_SHA as SHA

from compressflow.errors import ModelFetchError
from compressflow.params import ModelArgs
from compressflow.store.identity import changed_since, content_hash, stat_signature
from compressflow.tasks.fetch_model import fetch


def copy_model(tiny_model: Path, tmp_path: Path, **config_changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_local_folder_gets_a_content_identity(tiny_model):
    fetched = fetch(ModelArgs(model_id=str(tiny_model)))
    assert fetched.source == "local"
    assert fetched.identity.startswith("sha256:") and len(fetched.identity) == 7 + 64
    assert fetched.size_bytes > 1_000_000
    assert fetched.exists()
    assert fetch(ModelArgs(model_id=str(tiny_model))).identity == fetched.identity


def test_the_identity_hashes_files_in_name_order_whatever_thread_hashed_them(tmp_path):
    # Hashed on threads since; the identity must stay the one earlier runs recorded and cached.
    import hashlib

    for name in ["b.safetensors", "a/z.json", "a/b.txt", "c"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode() * 1000)
    digest = hashlib.sha256()
    for name in ["a/b.txt", "a/z.json", "b.safetensors", "c"]:
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((tmp_path / name).read_bytes()).digest())
    assert content_hash(tmp_path) == digest.hexdigest()


def test_editing_a_local_folder_changes_identity_and_cache_signature(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path)
    before = (fetch(ModelArgs(model_id=str(folder))).identity, stat_signature(folder))
    (folder / "generation_config.json").write_text("{}")
    after = (fetch(ModelArgs(model_id=str(folder))).identity, stat_signature(folder))
    assert before[0] != after[0] and before[1] != after[1]


def test_a_fetched_folder_tells_which_of_its_files_changed_since(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    fetched = fetch(ModelArgs(model_id=str(folder)))
    assert changed_since(folder, fetched.files) == [] and "model.safetensors" in fetched.files
    assert "files" not in fetched.model_dump()  # the run's record, not the model's
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")  # written
    (folder / "tokenizer.json").unlink()
    # Replaced with the same bytes (a copy renamed over it): a new file all the same.
    shutil.copy(folder / "generation_config.json", tmp_path / "copy.json")
    os.replace(tmp_path / "copy.json", folder / "generation_config.json")
    (folder / "extra.bin").write_text("another run's download: not read by this one")
    assert changed_since(folder, fetched.files) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ]


def test_hub_id_resolves_to_the_cached_commit_sha(hub_cache):
    fetched = fetch(ModelArgs(model_id="acme/tiny-llama"))
    assert fetched.source == "hub"
    assert fetched.revision_resolved == SHA
    assert fetched.identity == f"hub:acme/tiny-llama@{SHA}"
    assert Path(fetched.path) == hub_cache / "snapshots" / SHA


def test_hub_commit_sha_revision_is_honoured(hub_cache):
    fetched = fetch(ModelArgs(model_id="acme/tiny-llama", revision=SHA))
    assert fetched.revision_requested == SHA and fetched.revision_resolved == SHA


def test_uncached_hub_revision_says_the_cache_lacks_it(hub_cache):
    with pytest.raises(ModelFetchError, match="not in the local hub cache") as error:
        fetch(ModelArgs(model_id="acme/tiny-llama", revision="v2"))
    assert "acme/tiny-llama@v2" in str(error.value)


def test_a_sharded_hub_model_validates_from_its_config_files_alone(sharded_tiny_model, test_root):
    """Validation fetches a hub model's JSON and tokenizer files, not its shards: the index
    naming shards that are not there is no refusal then; the run, which downloads them, checks."""
    from compressflow.flows.validate import validate

    repo = test_root / "hf" / "hub" / "models--acme--tiny-sharded"
    snapshot = repo / "snapshots" / SHA
    if not repo.exists():
        snapshot.mkdir(parents=True)
        for file in sharded_tiny_model.iterdir():
            if file.suffix != ".safetensors":  # what HUB_CONFIG_PATTERNS downloads
                shutil.copy(file, snapshot / file.name)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(SHA)
    assert fetch(ModelArgs(model_id="acme/tiny-sharded"), weights=False).source == "hub"
    report = validate(
        model={"model_id": "acme/tiny-sharded"},
        dataset={"dataset_name": "python_docs", "text_samples": 4, "max_seq_len": 32},
        recipe={"recipe": "W4A16"},
        output={"save_directory": str(test_root / "never-written")},
    )
    assert "not checked" in next(c for c in report.checks if c.name == "weights").detail
    with pytest.raises(ModelFetchError, match="lacks shards its index lists"):
        fetch(ModelArgs(model_id="acme/tiny-sharded"))  # a run needs them


def test_uncached_hub_model_says_the_cache_lacks_it():
    with pytest.raises(ModelFetchError, match="not in the local hub cache"):
        fetch(ModelArgs(model_id="acme/never-downloaded"))


def test_missing_local_folder_is_named():
    with pytest.raises(ModelFetchError, match=r"local folder \./no/such/model does not exist"):
        fetch(ModelArgs(model_id="./no/such/model"))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelFetchError, match="no config.json"):
        fetch(ModelArgs(model_id=str(tmp_path)))


def test_remote_code_model_needs_trust_remote_code(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path, auto_map={"AutoModelForCausalLM": "modeling.Custom"})
    with pytest.raises(ModelFetchError, match="trust_remote_code: true"):
        fetch(ModelArgs(model_id=str(folder)))
    # Trusted, its class is built from the folder's own code at fetch: without that code the
    # folder is refused there, naming the file, not as a defect of the memory plan.
    with pytest.raises(ModelFetchError, match="cannot build the model class.*modeling.py"):
        fetch(ModelArgs(model_id=str(folder), trust_remote_code=True))
    (folder / "modeling.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass Custom(LlamaForCausalLM):\n    pass\n"
    )
    assert fetch(ModelArgs(model_id=str(folder), trust_remote_code=True)).trust_remote_code


def test_already_quantized_model_is_refused(tiny_model, tmp_path):
    folder = copy_model(tiny_model, tmp_path, quantization_config={"quant_method": "gptq"})
    with pytest.raises(ModelFetchError, match=r"already quantized \(gptq\).*unquantized base"):
        fetch(ModelArgs(model_id=str(folder)))


def refused_within(call, seconds: float = 10.0) -> ModelFetchError:
    """call()'s ModelFetchError, failing instead of hanging when it blocks on a file."""
    import threading

    outcome: dict = {}

    def run():
        try:
            call()
        except Exception as exc:  # kept for the assertion below, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    assert isinstance(outcome.get("error"), ModelFetchError), outcome
    return outcome["error"]


@pytest.mark.parametrize(
    ("name", "make", "kind"),
    [
        ("extra.safetensors", os.mkfifo, "a FIFO"),
        ("tokenizer.json", os.mkfifo, "a FIFO"),
        ("extra.safetensors", os.mkdir, "a folder"),
        ("zero.safetensors", lambda file: os.symlink("/dev/zero", file), "a device"),
    ],
)
def test_a_fifo_device_or_folder_named_as_a_model_file_is_refused_unopened(
    tiny_model, tmp_path, name, make, kind
):
    # A FIFO blocked validate forever; a folder raised IsADirectoryError, which fetch retries.
    folder = copy_model(tiny_model, tmp_path)
    (folder / name).unlink(missing_ok=True)
    make(folder / name)
    error = refused_within(lambda: fetch(ModelArgs(model_id=str(folder))))
    assert error.field == "model.model_id"
    assert f"{folder / name} is {kind}" in error.problem
    assert name in error.fix


def write_safetensors(file: Path, header: bytes, data: bytes = b"") -> Path:
    file.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return file


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
        (b"[]", "is a JSON list, not an object"),
        (b'{"w": [1, 2]}', "tensor 'w' is a JSON list"),
        (b'{"w": {"dtype": "F32", "shape": [1]}}', "data_offsets None"),
        (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}', "data_offsets"),
        (b'{"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}', "shape '1'"),
        (b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "shape [-1]"),
        (b'{"__metadata__": [], "w": {"shape": [1], "data_offsets": [0, 4]}}', "__metadata__"),
    ],
)
def test_a_malformed_safetensors_header_is_refused_naming_the_file(tmp_path, header, problem):
    from compressflow.model.folder_checks.weights import check_weight_files

    file = write_safetensors(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(ModelFetchError) as raised:
        check_weight_files(tmp_path)
    assert f"{file} is not a readable safetensors file" in raised.value.problem
    assert problem in raised.value.problem
    assert "download the model again" in raised.value.fix


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[]", "is not a shard index"),
        ('{"metadata": {}}', "is not a shard index"),
        ('{"weight_map": ["model.safetensors"]}', "is not a shard index"),
        ('{"weight_map": {"w": ["model.safetensors"]}}', "is not a shard index"),
        ("{weight_map", "is not valid JSON"),
    ],
)
def test_a_malformed_shard_index_is_refused_naming_it(tmp_path, text, problem):
    from compressflow.model.folder_checks.weights import check_weight_files

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(ModelFetchError) as raised:
        check_weight_files(tmp_path)
    assert f"{index} {problem}" in raised.value.problem
    assert "model.safetensors.index.json" in raised.value.fix


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"num_hidden_layers": 5000}, "num_hidden_layers to 5000; it must be a whole number"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers to '2'"),
        ({"num_hidden_layers": True}, "num_hidden_layers to True"),
        ({"head_dim": 268_435_456}, "head_dim to 268435456; it must be a whole number from 1"),
        ({"hidden_size": 0}, "hidden_size to 0"),
        ({"num_attention_heads": 0}, "num_attention_heads to 0"),
        ({"vocab_size": -5}, "vocab_size to -5"),
        ({"text_config": {"intermediate_size": 2.5}}, "text_config.intermediate_size to 2.5"),
        ({"num_hidden_layers": 3}, "num_hidden_layers to 3 but the checkpoint's weights hold 2"),
    ],
)
def test_config_sizes_no_model_has_are_refused_before_the_model_is_built(
    tiny_model, tmp_path, changes, problem
):
    # Built on the meta device these took minutes (5,000 layers), gigabytes (head_dim's rotary
    # buffer is real) or failed as ZeroDivisionError and AssertionError naming no field.
    folder = copy_model(tiny_model, tmp_path, **changes)
    with pytest.raises(ModelFetchError) as raised:
        fetch(ModelArgs(model_id=str(folder)))
    assert raised.value.field == "model.model_id"
    assert f"{folder / 'config.json'} sets {problem}" in raised.value.problem
    assert "config.json" in raised.value.fix


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        ({"auto_map": 5}, "model.trust_remote_code", "in its own code (auto_map: 5)"),
        ({"quantization_config": "yes"}, "model.model_id", "is already quantized (unknown)"),
        ({"model_type": "no-such-model"}, "model.model_id", "transformers cannot read"),
        ({"architectures": "LlamaForCausalLM"}, "model.model_id", "transformers cannot read"),
    ],
)
def test_a_config_json_transformers_cannot_read_is_refused_naming_it(
    tiny_model, tmp_path, changes, field, problem
):
    folder = copy_model(tiny_model, tmp_path, **changes)  # raw TypeErrors and ValueErrors before
    with pytest.raises(ModelFetchError) as raised:
        fetch(ModelArgs(model_id=str(folder)))
    assert raised.value.field == field and problem in raised.value.problem


def test_real_config_shapes_pass_the_size_check(tmp_path):
    from compressflow.model.folder_checks.config import check_sizes

    names = {"model.language_model.layers.1.mlp.up_proj.weight", "vision.layers.26.fc.weight"}
    # Per-layer sizes (Gemma 3n), unset head_dim (older Mistral), the text model's own config.
    config = {
        "head_dim": None,
        "text_config": {"intermediate_size": [512, 512], "num_hidden_layers": 2},
        "vision_config": {"num_hidden_layers": 27},
    }
    check_sizes(tmp_path, config, names)
    check_sizes(tmp_path, {"num_hidden_layers": 61}, set())  # no weights to count: validation


class TwoArgumentError(Exception):
    """Pickles, but loading it calls __init__ with its args alone: as transformers'
    StrictDataclassFieldValidationError does."""

    def __init__(self, message: str, cause: Exception):
        super().__init__(message)
        self.cause = cause


def raises_two_argument_error():
    raise TwoArgumentError("num_hidden_layers must be an int", ValueError("'2'"))


def test_a_child_error_that_cannot_be_loaded_arrives_as_its_own_text():
    # It used to arrive as "TypeError: ... missing 1 required positional argument: 'cause'".
    from compressflow.runtime.isolation import in_child

    with pytest.raises(RuntimeError) as raised:
        in_child(raises_two_argument_error)
    assert str(raised.value) == "TwoArgumentError: num_hidden_layers must be an int"


def test_an_early_hash_is_taken_only_while_the_files_are_the_ones_it_read(tmp_path, monkeypatch):
    # The flow hashes a local model while it waits for the forkserver; fetch takes that hash.
    # A file rewritten since, even with its size and mtime put back, is hashed again.
    from compressflow.store import identity

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"a" * 3_000_000)
    (folder / "config.json").write_text("{}")
    expected = content_hash(folder)
    hashed = []
    real = identity.hash_folder
    monkeypatch.setattr(
        identity, "hash_folder", lambda *a, **k: hashed.append(a[0]) or real(*a, **k)
    )

    with identity.hashing_early(folder):
        assert content_hash(folder) == expected
    assert len(hashed) == 1  # the early one, taken

    weights = folder / "model.safetensors"
    with identity.hashing_early(folder):
        identity.EARLY_HASHES[folder.resolve()].result()
        before, signature = weights.stat(), stat_signature(folder)
        weights.write_bytes(b"b" * 3_000_000)  # same size
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same mtime
        assert stat_signature(folder) != signature  # the stage caches' key sees it too
        changed = content_hash(folder)
    assert changed != expected and len(hashed) == 3  # the early one, then a fresh one
    assert not identity.EARLY_HASHES


def test_an_early_hash_nobody_takes_stops_at_the_blocks_end(tmp_path, monkeypatch):
    from compressflow.store import identity

    (tmp_path / "big.bin").write_bytes(b"x" * (4 << 20))
    real = identity.file_sha256

    def slow(file, stop=None):  # still reading when the block ends
        assert stop is not None and stop.wait(10)
        return real(file, stop)

    monkeypatch.setattr(identity, "file_sha256", slow)
    started = time.monotonic()
    with identity.hashing_early(tmp_path):
        early = identity.EARLY_HASHES[tmp_path.resolve()]
    assert time.monotonic() - started < 5  # stopped at its next chunk, not waited for
    assert not early.is_alive() and early.digest is None and not identity.EARLY_HASHES
    with identity.hashing_early(None):  # a hub model: nothing to hash
        assert not identity.EARLY_HASHES
