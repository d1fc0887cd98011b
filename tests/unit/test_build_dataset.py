"""The build-dataset stage: every source, sampling, templating, truncation, caching and errors.

Everything runs offline on the session's tiny Llama. Hub ids are tested for real: a test writes
a dataset into the `datasets` cache under HF_HOME in the layout a download leaves, and
`datasets.load_dataset` (with HF_HUB_OFFLINE=1) resolves the hub-style name from there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from datasets import Dataset, load_from_disk
from transformers import AutoTokenizer

from compressflow.demo.assets import CHAT_TEMPLATE, write_calibration_jsonl
from compressflow.errors import DatasetError
from compressflow.params import DatasetArgs
from compressflow.registries.datasets import SHORTCUTS, lookup
from compressflow.results import FetchedModel
from compressflow.store.identity import dataset_fingerprint, tokenizer_identity
from compressflow.tasks.build_dataset import build_dataset

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
    }
    for i in range(12)
]


def fetched(path: Path) -> FetchedModel:
    return FetchedModel(
        path=str(path), source="local", model_id=path.name, identity="sha256:test", size_bytes=0
    )


def args(**overrides) -> DatasetArgs:
    return DatasetArgs(**{"text_samples": 8, "max_seq_len": 128, **overrides})


def build(dataset_args: DatasetArgs, model: FetchedModel, needs_data: bool = True):
    return build_dataset.fn(dataset_args, model, needs_data=needs_data)


def decoded(built, model_path: Path) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.decode(ids) for ids in load_from_disk(built.path)["input_ids"]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def cache_hub_dataset(repo_id: str, rows: dict[str, list], config: str = "default") -> None:
    """Put `rows` where `load_dataset(repo_id, config)` finds them offline, as after a download."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    work = Path(datasets.config.HF_DATASETS_CACHE).parent / "staging" / repo_id.replace("/", "--")
    work.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict(rows).to_parquet(str(work / "train.parquet"))
    name = repo_id.split("/")[-1]
    data_files = {"train": str(work / "train.parquet")}
    builder = Parquet(
        cache_dir=str(work / "built"), dataset_name=name, data_files=data_files, hash="offline"
    )
    builder.download_and_prepare()
    # The hub layout: <cache>/<owner>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow
    target = Path(datasets.config.HF_DATASETS_CACHE, repo_id.replace("/", "___"), config)
    target = target / "0.0.0" / "offline"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(builder.cache_dir, target)
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": config}))


@pytest.fixture(scope="module")
def model(tiny_model) -> FetchedModel:
    return fetched(tiny_model)


@pytest.fixture(scope="module")
def model_with_bos(tiny_model, tmp_path_factory) -> FetchedModel:
    """The tiny model's tokenizer made to add <s> itself, and a chat template writing <s> too."""
    from tokenizers import processors

    path = tmp_path_factory.mktemp("bos-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = "<s>" + CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    shutil.copy(tiny_model / "config.json", path)
    return fetched(path)


@pytest.fixture(scope="module")
def model_without_template(tiny_model, tmp_path_factory) -> FetchedModel:
    path = tmp_path_factory.mktemp("no-template-model")
    shutil.copy(tiny_model / "config.json", path)
    shutil.copy(tiny_model / "tokenizer.json", path)
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return fetched(path)


# --- loaders used through `dataset_loader` ------------------------------------------------------


def tiny_loader(dataset_args: DatasetArgs) -> Dataset:
    rows = [f"loader row {i} for seed {dataset_args.seed}" for i in range(10)]
    return Dataset.from_dict({"text": rows})


def dict_loader(dataset_args: DatasetArgs):
    return {"text": ["not a Dataset"]}


NOT_CALLABLE = 42


# --- sources ------------------------------------------------------------------------------------


def test_python_docs_are_the_same_whatever_the_process_imported():
    # Calibration and the held-out build that leaves its rows out run in different processes:
    # texts that changed with a process's imports (`email.utils` showing up in `email`) let
    # calibration rows into the held-out set.
    import subprocess
    import sys

    code = (
        "{}import hashlib; from compressflow.data.local_text import python_docs; "
        "print(hashlib.sha256(repr(python_docs()).encode()).hexdigest())"
    )
    plain, busy = (
        subprocess.run(
            [sys.executable, "-c", code.format(imports)], capture_output=True, text=True, check=True
        ).stdout
        for imports in ("", "import email.mime.text, logging.handlers, unittest.mock; ")
    )
    assert plain and plain == busy


def test_python_docs_shortcut(model, test_root):
    built = build(args(dataset_name="python_docs"), model)

    assert built.source == "shortcut:python_docs"
    assert built.num_samples == 8 and built.exists()
    assert Path(built.path) == test_root / "cache" / "datasets" / built.fingerprint
    assert load_from_disk(built.path).column_names == ["input_ids", "attention_mask"]
    stats = built.token_stats
    assert 0 < stats["min"] <= stats["mean"] <= stats["max"] <= 128
    assert stats["total"] == sum(len(r) for r in load_from_disk(built.path)["input_ids"])


def test_txt_file_gives_one_sample_per_paragraph(model, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first paragraph,\nstill the first\n\n\nsecond one\n  \nthird\n")

    built = build(args(dataset_name=str(path), text_samples=3, seed=1), model)

    assert built.source == f"file:{path.resolve()}"
    paragraphs = ["first paragraph,\nstill the first", "second one", "third"]
    assert sorted(decoded(built, Path(model.path))) == paragraphs


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_structured_files(model, tmp_path, suffix):
    jsonl = write_calibration_jsonl(tmp_path / "c.jsonl", rows=20)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    path = tmp_path / f"calibration{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = jsonl

    built = build(args(dataset_name=str(path), text_samples=10), model)

    assert built.num_samples == 10 and built.source.startswith("file:")


def test_dataset_loader(model):
    built = build(args(dataset_loader=f"{__name__}:tiny_loader", text_samples=4, seed=3), model)

    assert built.source == f"loader:{__name__}:tiny_loader"
    assert all(text.endswith("for seed 3") for text in decoded(built, Path(model.path)))


def test_hub_id_from_the_local_cache(model):
    rows = [f"cached hub row {i}" for i in range(6)]
    cache_hub_dataset("compressflow-test/tiny_calib", {"text": rows})

    built = build(args(dataset_name="compressflow-test/tiny_calib", text_samples=6), model)

    assert built.source == "hub:compressflow-test/tiny_calib (split train)"
    assert sorted(decoded(built, Path(model.path))) == rows


def test_shortcut_formats_rows_from_the_cached_hub_dataset(model):
    rows = {"question": ["What is 2 + 2?"], "answer": ["4"]}
    cache_hub_dataset("openai/gsm8k", rows, config="main")

    built = build(args(dataset_name="gsm8k", text_samples=1), model)

    assert built.source == "shortcut:gsm8k (openai/gsm8k, split train)"
    assert decoded(built, Path(model.path)) == ["Question: What is 2 + 2?\nAnswer: 4"]


def test_registry_covers_llm_compressor_shortcuts():
    # Importing llm-compressor to list them takes ~13 s: its 0.14 names are copied here.
    llm_compressor_0_14 = [
        "c4",
        "cnn_dailymail",
        "evolcodealpaca",
        "gsm8k",
        "open_platypus",
        "perfectblend",
        "ultrachat_200k",
        "wikitext",
        "flickr",
        "peoples_speech",
    ]
    assert set(llm_compressor_0_14) | {"python_docs"} <= set(SHORTCUTS)
    assert lookup("ultrachat") is SHORTCUTS["ultrachat_200k"]
    assert lookup("flickr30k") is SHORTCUTS["flickr"]
    for name, entry in SHORTCUTS.items():
        assert entry["description"] and ("hub_id" in entry) != ("local_rows" in entry), name


# --- rows, sampling, tokens ---------------------------------------------------------------------


def test_chat_messages_get_the_chat_template(model, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)

    built = build(args(dataset_name=str(path), text_samples=4), model)

    assert built.chat_template_applied
    for text in decoded(built, Path(model.path)):
        assert text.startswith("<|user|>\nQuestion") and "<|assistant|>\nIt is" in text


def test_chat_messages_without_a_template_become_role_lines(model_without_template, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)

    built = build(args(dataset_name=str(path), text_samples=2), model_without_template)

    assert not built.chat_template_applied
    for text in decoded(built, Path(model_without_template.path)):
        assert text.startswith("user: Question") and "\nassistant: It is" in text


def test_bos_is_not_added_twice_when_the_template_writes_it(model_with_bos, tmp_path):
    bos = AutoTokenizer.from_pretrained(model_with_bos.path).bos_token_id
    path = write_jsonl(tmp_path / "c.jsonl", CHATS)
    chats = build(args(dataset_name=str(path), text_samples=3), model_with_bos)
    plain = build(args(dataset_name="python_docs", text_samples=3), model_with_bos)

    for built in (chats, plain):
        for ids in load_from_disk(built.path)["input_ids"]:
            assert ids[0] == bos and ids[1] != bos


def test_sampling_is_seeded(model):
    first = build(args(seed=7), model)
    again = build(args(seed=7), model)
    other = build(args(seed=8), model)

    assert (again.fingerprint, again.path) == (first.fingerprint, first.path)
    assert other.fingerprint != first.fingerprint
    assert load_from_disk(other.path)["input_ids"] != load_from_disk(first.path)["input_ids"]


def test_samples_are_truncated_to_max_seq_len(model):
    built = build(args(max_seq_len=16), model)

    assert built.token_stats["max"] == 16
    assert all(len(ids) <= 16 for ids in load_from_disk(built.path)["input_ids"])


def test_existing_folder_is_reused_and_no_temp_folder_is_left(model):
    first = build(args(seed=11), model)
    marker = Path(first.path, "reused-marker")
    marker.touch()

    again = build(args(seed=11), model)

    assert again.path == first.path and marker.exists()
    assert not [p for p in Path(first.path).parent.iterdir() if p.name.startswith(".")]


class Backend:
    def to_str(self) -> str:
        return '{"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}'


class FastTokenizer:
    backend_tokenizer = Backend()
    chat_template = "{{ messages[0]['content'] }}"


class SlowTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {"b": 1, "a": 0}


def test_dataset_keys_keep_their_values():
    """A saved dataset is found again by these keys: a change to either misses every cache."""
    tokens = Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5]], "attention_mask": [[1] * 3, [1] * 2]}
    )

    assert tokenizer_identity(FastTokenizer()) == (
        "50319c2cb41f79d6059a72a7bd26a7634d88383b0c3f19e45e7aa76e30507ab3"
    )
    assert tokenizer_identity(SlowTokenizer()) == (
        "9559c8f056429ad87032eeaf9ffe8b71f2007077c8f46938f6fe8df1ecea5c6f"
    )
    assert dataset_fingerprint(tokens, "tok", 16) == (
        "8c9151fcaeed267683ddc6f3dee60cbdd5a0932f7ceabbf3a06b75e44ec41d15"
    )


def test_no_dataset_when_the_recipe_needs_none(model):
    assert build(args(), model, needs_data=False) is None
    assert build(args(text_samples=0), model, needs_data=False) is None


# --- errors -------------------------------------------------------------------------------------


def test_zero_samples_when_data_is_needed(model):
    with pytest.raises(DatasetError, match="text_samples") as err:
        build(args(text_samples=0, vision_samples=0), model)
    assert "both 0" in str(err.value) and "Fix:" in str(err.value)


def test_more_samples_than_rows(model):
    with pytest.raises(DatasetError, match="text_samples") as err:
        build(args(dataset_loader=f"{__name__}:tiny_loader", text_samples=11), model)
    assert "11" in str(err.value) and "only 10 rows" in str(err.value)


def test_missing_column_lists_the_columns(model, tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "p", "reply": "r"}])
    with pytest.raises(DatasetError, match="text_column") as err:
        build(args(dataset_name=str(path), text_samples=1), model)
    assert "'text'" in str(err.value) and "prompt, reply" in str(err.value)


@pytest.mark.parametrize("name", ["missing.jsonl", "./data/missing", "data/sub/missing.parquet"])
def test_missing_local_file(model, name):
    with pytest.raises(DatasetError, match="dataset_name") as err:
        build(args(dataset_name=name), model)
    assert "does not exist" in str(err.value) and name.lstrip("./").split("/")[-1] in str(err.value)


def test_uncached_hub_id_says_hub_unreachable_and_suggests_shortcuts(model):
    with pytest.raises(DatasetError, match="dataset_name") as err:
        build(args(dataset_name="someone/wikitxt"), model)
    message = str(err.value)
    assert "unreachable" in message and "cache" in message and "lacks it" in message
    assert "wikitext" in message


def test_uncached_shortcut_says_how_to_fill_the_cache(model):
    with pytest.raises(DatasetError, match="unreachable") as err:
        build(args(dataset_name="ultrachat"), model)
    assert "HuggingFaceH4/ultrachat_200k" in str(err.value) and "python_docs" in str(err.value)


def two_argument_loader(args, extra):
    raise AssertionError("never called: the signature check refuses it first")


@pytest.mark.parametrize(
    "loader, words",
    [
        (f"{__name__}.no_such_module:load", ["cannot import", "no_such_module"]),
        ("os:getcwd", ["allow-list", "COMPRESSFLOW_ALLOWED_IMPORTS"]),
        (f"{__name__}:two_argument_loader", ["cannot be called with 1 argument"]),
        (f"{__name__}:missing_function", ["missing_function", "does not exist"]),
        (f"{__name__}:NOT_CALLABLE", ["NOT_CALLABLE", "of type int", "not a callable"]),
        (f"{__name__}:dict_loader", ["dict_loader", "returned a dict", "datasets.Dataset"]),
    ],
)
def test_bad_dataset_loader(model, loader, words):
    with pytest.raises(DatasetError, match="dataset_loader") as err:
        build(args(dataset_loader=loader), model)
    for word in words:
        assert word in str(err.value)


def test_max_seq_len_above_the_model_maximum(model):
    with pytest.raises(DatasetError, match="max_seq_len") as err:
        build(args(max_seq_len=4096), model)
    assert "4096" in str(err.value) and "2048" in str(err.value)


def test_vision_samples_need_a_processor(model):
    with pytest.raises(DatasetError, match="vision_samples") as err:
        build(args(vision_samples=2), model)
    assert "no processor" in str(err.value) and "vision_samples=0" in str(err.value)


def test_audio_shortcut_is_refused(model):
    with pytest.raises(DatasetError, match="audio"):
        build(args(dataset_name="peoples_speech"), model)
