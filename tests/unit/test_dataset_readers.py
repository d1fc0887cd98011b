"""Local calibration files: every reader's failure is a DatasetError naming the field, the file
and the fix, and no more than the documented cap is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from datasets import Dataset

from compressflow.data.text_sources import load_source, sample_texts
from compressflow.data.tokenizer import tokenize
from compressflow.errors import DatasetError
from compressflow.params import DatasetArgs


def refusal(path: Path, **args) -> str:
    with pytest.raises(DatasetError) as raised:
        load_source(DatasetArgs(dataset_name=str(path), **args))
    return str(raised.value)


def arrow_file(folder: Path) -> Path:
    """A real Arrow stream file, as `save_to_disk` writes."""
    Dataset.from_dict({"text": [f"row {i}" for i in range(10)]}).save_to_disk(str(folder))
    return next(folder.glob("*.arrow"))


def truncated_arrow(path: Path) -> bytes:
    return arrow_file(path.parent / "saved").read_bytes()[:100]


CORRUPT = {
    "not.parquet": (lambda path: b"not a parquet file at all", "magic bytes"),
    "cut.arrow": (truncated_arrow, "ArrowInvalid"),
    "broken.jsonl": (lambda path: b'{"text": "a"}\n{"text": broken\n', "JSON parse error"),
    "broken.json": (lambda path: b'{"text": "a",', "JSON parse error"),
    "ragged.csv": (lambda path: b"text,other\n1,2\n3,4,5,6\n", "Expected 2 fields"),
    # Past the first MiB, which the up-front UTF-8 check reads.
    # Invalid UTF-8 past the first MiB: the whole file is checked (the fuzzer found a .jsonl
    # whose row failed only when read, as a bare UnicodeDecodeError).
    "late.txt": (lambda path: b"a" * (2 << 20) + b"\xff\n", "byte 2097152 cannot be decoded"),
}


@pytest.mark.parametrize("name", list(CORRUPT))
def test_a_corrupt_file_names_the_field_the_file_the_reader_and_the_fix(tmp_path, name):
    path = tmp_path / name
    content, said = CORRUPT[name]
    path.write_bytes(content(path))

    message = refusal(path)

    assert message.startswith("dataset.dataset_name: ")
    assert name in message and said in message and "Fix:" in message
    assert len(message.splitlines()) == 1  # the reader's complaint, one line of it


def test_an_arrow_file_is_read(tmp_path):
    dataset, source, _ = load_source(DatasetArgs(dataset_name=str(arrow_file(tmp_path / "d"))))

    assert len(dataset) == 10 and source.startswith("file:")


def test_a_folder_with_a_corrupt_file_is_refused_with_the_folder_named(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "part-0.parquet").write_bytes(b"not a parquet file at all")

    message = refusal(folder)

    assert message.startswith("dataset.dataset_name: ") and "shards" in message
    assert "magic bytes" in message and "Fix:" in message


def test_an_empty_folder_is_refused(tmp_path):
    folder = tmp_path / "nothing"
    folder.mkdir()

    message = refusal(folder)

    assert message.startswith("dataset.dataset_name: ") and "nothing" in message
    assert "holds no files" in message and "Fix:" in message


@pytest.mark.parametrize("name", ["header.csv", "zero.parquet", "empty.json"])
def test_a_file_without_rows_is_refused_as_such(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text("text\n")
    elif name.endswith(".parquet"):
        Dataset.from_dict({"text": []}).to_parquet(str(path))
    else:
        path.write_text("[]")

    message = refusal(path)

    assert message.startswith("dataset.dataset_name: ")
    assert f"{name}' holds no rows" in message and "Fix:" in message


def test_a_split_a_local_file_lacks_names_the_split(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")

    message = refusal(path, split="validation")

    assert message.startswith("dataset.split: ") and "rows.jsonl" in message
    assert "'validation'" in message and "Fix:" in message


def test_data_over_the_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "corpus.jsonl"
    path.write_text((json.dumps({"text": "x" * 1000}) + "\n") * 2100)  # about 2 MiB
    monkeypatch.setenv("COMPRESSFLOW_MAX_DATA_MB", "1")

    def no_reading(*args, **kwargs):
        raise AssertionError("the file was read")

    monkeypatch.setattr("datasets.load_dataset", no_reading)
    message = refusal(path)

    assert message.startswith("dataset.dataset_name: ") and "corpus.jsonl" in message
    assert "COMPRESSFLOW_MAX_DATA_MB" in message and "Fix: use fewer or smaller files" in message


def test_a_folder_counts_its_files_together_against_the_cap(tmp_path, monkeypatch):
    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.txt").write_text("y" * (600 << 10))  # 600 KiB each
    monkeypatch.setenv("COMPRESSFLOW_MAX_DATA_MB", "1")

    assert "COMPRESSFLOW_MAX_DATA_MB" in refusal(folder)


def test_a_readme_pointing_a_folder_at_files_outside_it_is_refused(tmp_path, monkeypatch):
    """A README.md's `configs` would read ../big past the cap: refused, before it is read."""
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "big.jsonl").write_text((json.dumps({"text": "x" * 999}) + "\n") * 2100)
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "row"}) + "\n")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        '    path: "../big/*.jsonl"\n---\n'
    )
    monkeypatch.setenv("COMPRESSFLOW_MAX_DATA_MB", "1")

    message = refusal(folder)

    assert message.startswith("dataset.dataset_name: ") and "README.md" in message
    assert "big.jsonl" in message and "Fix: move those files into the folder" in message


def test_a_readme_naming_the_folders_own_files_is_followed(tmp_path):
    folder = tmp_path / "hub-clone"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "calib.jsonl").write_text(json.dumps({"text": "kept"}) + "\n")
    (folder / "data" / "other.jsonl").write_text(json.dumps({"text": "not asked for"}) + "\n")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: data/calib.jsonl\n---\n"
    )

    dataset, _, _ = load_source(DatasetArgs(dataset_name=str(folder)))

    assert dataset["text"] == ["kept"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_pipe_or_device_is_refused_as_what_it_is_and_never_opened(tmp_path, kind):
    path = Path("/dev/zero")
    if kind == "fifo":
        path = tmp_path / "rows.jsonl"
        os.mkfifo(path)  # opening it would block this test for ever

    message = refusal(path)

    said = "a FIFO (named pipe)" if kind == "fifo" else "a device"
    assert message.startswith("dataset.dataset_name: ")
    assert f"'{path}' is not a regular file but {said}" in message and "Fix: name a " in message


def test_a_row_nested_over_a_thousand_deep_is_refused_as_such(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(
        json.dumps({"text": "row"}) + "\n" + '{"text": "a", "x": ' + "[" * 1200 + "]" * 1200 + "}\n"
    )

    message = refusal(path)

    assert message.startswith("dataset.dataset_name: ") and "deep.jsonl" in message
    assert "nested too deeply" in message and "Fix: write each row as a flat object" in message


def test_a_text_column_empty_in_every_row_names_text_column(tmp_path):
    dataset = Dataset.from_dict({"text": ["", "  ", ""], "body": ["a", "b", "c"]})

    with pytest.raises(DatasetError) as raised:
        sample_texts(dataset, lambda row: row["text"] or "", 2, 0, "file:/data/blank.csv")

    message = str(raised.value)
    assert message.startswith("dataset.text_column: ") and "blank.csv" in message
    assert "Fix: set text_column" in message


def test_a_giant_line_reaches_the_tokenizer_cut_to_what_max_seq_len_can_use():
    seen: list[int] = []

    def tokenizer(texts, **kwargs):
        seen.extend(len(text) for text in texts)
        return {"input_ids": [[1, 2] for _ in texts], "attention_mask": [[1, 1] for _ in texts]}

    tokenize(["short", "z" * 5_000_000], tokenizer, 16, add_special_tokens=True)

    assert seen[0] == 5 and seen[1] < 16 * 1000
