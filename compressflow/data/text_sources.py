"""Text sources: how rows are loaded, sampled and turned into text.

Shared by the calibration dataset (compressflow/data/build.py) and the held-out evaluation text
(tasks/build_held_out.py), so evaluation can rebuild exactly the rows calibration drew and leave
them out. The tokenizer that renders chat rows and tokenizes the texts is
`compressflow.data.tokenizer`.

Sources, tried in this order:
1. `dataset_loader` (`module:function`, imported, called with the DatasetArgs, must return a
   `datasets.Dataset`);
2. a shortcut from `compressflow.registries.datasets` (e.g. `python_docs`, `gsm8k`);
3. a local file or folder: `.txt` (one sample per paragraph, i.e. blocks separated by blank
   lines, so samples are coherent text rather than single lines), `.jsonl`/`.json`, `.parquet`,
   `.csv`, `.arrow` (as `save_to_disk` writes), or a folder of such files. At most
   `COMPRESSFLOW_MAX_DATA_MB` (1 GiB by default) is read, and a file no reader can read is
   refused with the reader's own complaint;
4. anything else is a hub dataset id for `datasets.load_dataset`, which honours HF_HUB_OFFLINE
   and the local cache under HF_HOME.
"""

from __future__ import annotations

import codecs
import difflib
import json
import re
import string
from pathlib import Path
from typing import Any, Callable

from compressflow.data.tokenizer import render_messages
from compressflow.data.user_code import import_callable
from compressflow.errors import DatasetError, interpreting
from compressflow.limits import not_regular
from compressflow.params import DatasetArgs
from compressflow.registries.datasets import ALIASES, SHORTCUTS, lookup
from compressflow.settings import settings

# Suffixes read as local files, and the `datasets` builder for each (.txt is read here).
FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}


FILE_SUFFIXES = {*FILE_BUILDERS, ".txt"}

# What to do about a file its reader refuses, by suffix.
UNREADABLE_FIXES = {
    ".parquet": "re-export it as Parquet (e.g. pandas DataFrame.to_parquet); a partial copy, or "
    "a file of another format named .parquet, reads like this",
    ".arrow": "name an Arrow stream file such as datasets' save_to_disk writes (data-*.arrow), "
    "or re-export it",
    ".csv": "fix the CSV (a header row, the same number of fields on every line, every quote "
    "closed, UTF-8 text), or convert it to .jsonl",
    ".json": 'fix the JSON where the message points (a list of {"text": ...} objects), or '
    "convert it to .jsonl",
    ".jsonl": 'fix the line the message points at: one JSON object per line, e.g. {"text": "..."}',
    ".txt": "convert it to UTF-8 text, or name the right file",
}
FOLDER_FIX = (
    "find the unreadable file among the folder's data files (one bad file fails the folder), "
    "then re-export or remove it"
)


def load_source(args: DatasetArgs):
    """(dataset, readable source, registry entry or None) for the DatasetArgs."""
    import datasets

    if args.dataset_loader:
        return call_loader(args.dataset_loader, args), f"loader:{args.dataset_loader}", None

    name = args.dataset_name
    entry = lookup(name)
    if entry is not None:
        shortcut = ALIASES.get(name, name)
        if entry["format"] == "audio":
            raise DatasetError(
                "dataset.dataset_name",
                f"'{name}' is an audio dataset; compressflow builds text and image samples only",
                "pick a text dataset, or pass a dataset_loader returning processor-ready rows",
            )
        if "local_rows" in entry:
            rows = import_callable(
                entry["local_rows"], "dataset.dataset_name", DatasetError, trusted=True
            )()
            return datasets.Dataset.from_dict({"text": rows}), f"shortcut:{shortcut}", entry
        split = args.split or entry["split"]
        split = entry.get("split_aliases", {}).get(split, split)
        config = args.dataset_config_name or entry.get("config")
        dataset = load_hub(entry["hub_id"], config, split, entry.get("data_files"), shortcut)
        return dataset, f"shortcut:{shortcut} ({entry['hub_id']}, split {split})", entry

    if (path := local_source(args)) is not None:
        return load_local(path, args.split or "train"), f"file:{path.resolve()}", None
    split = args.split or "train"
    dataset = load_hub(name, args.dataset_config_name, split)
    config = f", config {args.dataset_config_name}" if args.dataset_config_name else ""
    return dataset, f"hub:{name} (split {split}{config})", None


def local_source(args: DatasetArgs) -> Path | None:
    """The local file or folder `dataset_name` names; None for a loader, a shortcut or a hub id.
    A name that looks like a path but does not exist is refused, not sent to the hub."""
    name = args.dataset_name
    if args.dataset_loader or lookup(name) is not None:
        return None
    path = Path(name).expanduser()
    if path.exists():
        return path
    if looks_like_path(name):
        raise DatasetError(
            "dataset.dataset_name",
            f"local file '{name}' does not exist (looked at {path.resolve()})",
            "fix the path (relative paths start from the worker's working directory), "
            f"or use a shortcut: {', '.join(SHORTCUTS)}",
        )
    return None


def looks_like_path(name: str) -> bool:
    """A known file suffix, a leading ./ / ~, a backslash or more than one '/' mean a file path.

    `owner/name` and bare names are hub ids.
    """
    return (
        Path(name).suffix.lower() in FILE_SUFFIXES
        or name.startswith((".", "/", "~"))
        or "\\" in name
        or name.count("/") > 1
    )


def _blank(path: Path) -> bool:
    """Whether the file holds only whitespace, read a MiB at a time: not held whole."""
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            if chunk.strip():
                return False
    return True


def check_text_file(path: Path) -> None:
    """Refuse an empty file, or a text format that is not UTF-8 text, before `datasets` reads it."""
    if path.stat().st_size == 0 or (path.suffix.lower() != ".parquet" and _blank(path)):
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' is empty",
            "point it at a file with calibration text (one sample per paragraph or JSON line)",
        )
    if path.suffix.lower() in (".txt", ".jsonl", ".json", ".csv"):
        # The whole file, a MiB at a time: pyarrow's JSON reader takes invalid UTF-8 past its
        # first block, and the row holding it failed only when read, as a bare UnicodeDecodeError.
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with path.open("rb") as handle:
            while True:
                chunk, pending = handle.read(1 << 20), len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as exc:
                    raise DatasetError(
                        "dataset.dataset_name",
                        f"'{path}' is not UTF-8 text (byte {offset - pending + exc.start} cannot "
                        "be decoded): a binary or differently encoded file",
                        "convert it to UTF-8 text, or name the right file",
                    ) from None
                if not chunk:
                    break
                offset += len(chunk)


def check_local(path: Path) -> None:
    """Refuse, before any reader imports, a local data path no reader can use: not a file or
    folder, a suffix compressflow cannot read, more data than the cap, an empty file, or a text
    format that is not UTF-8 text. No library is needed: the flow checks this in its own process
    before any child starts (flows/checks.py `precheck`), and load_local again."""
    suffix = path.suffix.lower()
    if not path.is_file() and not path.is_dir():  # before any open: a FIFO's open blocks
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' is not a regular file but {not_regular(path)}",
            f"name a {'/'.join(sorted(FILE_SUFFIXES))} file or a folder of them; copy what a pipe "
            "or device gives into a file first",
        )
    if path.is_file() and suffix not in FILE_SUFFIXES:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' has the suffix '{path.suffix}', which compressflow cannot read",
            f"convert it to one of {', '.join(sorted(FILE_SUFFIXES))}",
        )
    try:
        if path.is_file():
            path.open("rb").close()
        else:
            next(path.iterdir(), None)
    except OSError as exc:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' cannot be read by this worker ({exc.strerror})",
            "make it readable by the user the worker runs as (chmod a+r), or copy it to a "
            "folder that user owns",
        ) from None
    check_size(path)
    if path.is_file():
        check_text_file(path)


def load_local(path: Path, split: str):
    """A local file or folder of data files as a Dataset; every reader failure a DatasetError."""
    check_local(path)
    suffix = path.suffix.lower()
    builder = FILE_BUILDERS.get(suffix)
    fix = FOLDER_FIX if path.is_dir() else UNREADABLE_FIXES[suffix]
    # The clauses below word what the readers are known to raise; anything else they raise
    # reading it is the file's fault too, never a defect of the stage.
    reading = interpreting(
        "dataset.dataset_name", path, DatasetError, "'{source}' cannot be read", fix, reader_said
    )
    with reading:
        dataset = _read_local(path, split, suffix, builder, fix)
    if len(dataset) == 0:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' holds no rows",
            "point it at a file with calibration text (one sample per paragraph or JSON line)",
        )
    return dataset


def _read_local(path: Path, split: str, suffix: str, builder: str | None, fix: str):
    """`load_local`'s read, with what the readers are known to raise worded."""
    import datasets

    try:
        if path.is_dir():
            dataset = load_folder(path, split)
        elif suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text)]
            dataset = datasets.Dataset.from_dict({"text": [p for p in paragraphs if p]})
        else:
            dataset = datasets.load_dataset(builder, data_files=str(path), split=split)
    except DatasetError:  # load_folder's own, a ValueError the clause below would rewrap
        raise
    except read_errors() as exc:
        if not (suffix == ".parquet" and _parquet_rows(path) == 0):
            raise DatasetError(
                "dataset.dataset_name", f"'{path}' cannot be read: {reader_said(exc)}", fix
            ) from exc
        dataset = []  # no rows and no columns: pyarrow says "BatchSize must be greater than 0"
    except RecursionError:  # datasets infers a type per level of a deeply nested value
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' holds a value nested too deeply to read (thousands of levels of lists "
            "or objects)",
            'write each row as a flat object, e.g. {"text": "..."} or {"messages": [...]}',
        ) from None
    except ValueError as exc:  # datasets' own: a split the files lack, a split with no rows...
        said = reader_said(exc)
        if "unknown split" in said.lower():
            raise DatasetError(
                "dataset.split",
                f"'{path}' has no split {split!r}: {said}",
                "set split to one the message lists, or leave it empty (a file's rows are 'train')",
            ) from exc
        if "corresponds to no data" not in said:
            raise DatasetError(
                "dataset.dataset_name", f"'{path}' cannot be read: {said}", fix
            ) from exc
        dataset = []  # e.g. a CSV with only its header row
    return dataset


def _parquet_rows(path: Path) -> int | None:
    """The rows a Parquet file's footer declares; None when it has no readable footer."""
    import pyarrow.parquet

    try:
        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError, pyarrow.ArrowException):
        return None


def load_folder(path: Path, split: str):
    """A folder as `datasets` reads it (a split per file name such as test.jsonl included), from
    the files check_size counted and nothing else.

    A README.md's front matter may name `configs` whose data_files point anywhere
    (`../big/*.jsonl`): past the cap, and outside the cache's stat signature of the folder. Such a
    folder is refused rather than its README ignored, since ignoring it would silently read other
    files or splits than the README says.
    """
    import datasets

    builder = datasets.load_dataset_builder(str(path))
    counted = {file.resolve() for file in data_files(path)}
    named = [name for files in (builder.config.data_files or {}).values() for name in files]
    if outside := [name for name in named if Path(name).resolve() not in counted]:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' has a README.md whose `configs` name data files that are not among the "
            f"folder's own files (e.g. '{outside[0]}'), which escape the size cap",
            "move those files into the folder (not hidden), or remove `configs` from the "
            "README.md front matter to read the folder's own files",
        )
    builder.download_and_prepare()
    return builder.as_dataset(split=split)


def read_errors() -> tuple[type[Exception], ...]:
    """What the readers raise for a file they cannot read (datasets wraps most in its own)."""
    import pyarrow
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DatasetsError
    from pandas.errors import ParserError

    return (
        DatasetsError,
        EmptyDatasetError,  # a folder of files no reader knows
        pyarrow.ArrowException,
        json.JSONDecodeError,
        UnicodeDecodeError,
        ParserError,
    )


def reader_said(exc: BaseException) -> str:
    """The reader's own complaint on one line, from under datasets' generic wrapper."""
    from datasets.exceptions import DatasetsError

    while isinstance(exc, DatasetsError) and exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else 'no detail'}"


def data_files(path: Path) -> list[Path]:
    """The file itself, or a folder's files but hidden ones (which `datasets` skips too)."""
    if path.is_file():
        return [path]
    return sorted(
        f
        for f in path.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
    )


def check_size(path: Path) -> None:
    """Refuse an empty folder, or more data than the cap, before a byte is read.

    Readers hold a .txt file whole and `datasets` converts every file to Arrow first, so a
    corpus-sized file would exhaust memory or disk long before a few hundred samples are drawn.
    """
    files = data_files(path)
    if not files:
        raise DatasetError(
            "dataset.dataset_name",
            f"the folder '{path}' holds no files",
            f"put calibration files in it ({', '.join(sorted(FILE_SUFFIXES))}), or name a file",
        )
    cap_mb = settings().max_data_mb
    size = sum(f.stat().st_size for f in files)
    if size > cap_mb * 2**20:
        raise DatasetError(
            "dataset.dataset_name",
            f"'{path}' holds {size / 2**20:,.0f} MiB of data, over the {cap_mb:,} MiB cap on "
            "local calibration data (COMPRESSFLOW_MAX_DATA_MB)",
            "use fewer or smaller files: calibration draws hundreds of samples, so a slice of "
            "the corpus does; or raise COMPRESSFLOW_MAX_DATA_MB on a worker with the memory",
        )


def load_hub(
    name: str, config: str | None, split: str, data_files=None, shortcut: str | None = None
):
    """`datasets.load_dataset` with its failures turned into messages that say what to do."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    nearest = ", ".join(nearest_shortcuts(name))
    try:
        return datasets.load_dataset(name, config, split=split, data_files=data_files)
    except ConnectionError as exc:  # offline (HF_HUB_OFFLINE) or unreachable, and not cached
        if shortcut:
            fix = (
                "run once where the hub is reachable to fill the cache, or use 'python_docs' "
                "(works offline) or a local file"
            )
        else:
            fix = f"check the name; nearest shortcuts: {nearest}; or use a local file"
        raise DatasetError(
            "dataset.dataset_name",
            f"the Hugging Face Hub is unreachable for dataset '{name}' ({exc}) and the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}) lacks it",
            fix,
        ) from exc
    except (DatasetNotFoundError, FileNotFoundError) as exc:
        raise DatasetError(
            "dataset.dataset_name",
            f"dataset '{name}' was not found: {exc}",
            f"check the hub id and your access to it; nearest shortcuts: {nearest}",
        ) from exc
    except ValueError as exc:  # unknown split or configuration
        field = "dataset.split" if "split" in str(exc).lower() else "dataset.dataset_config_name"
        raise DatasetError(
            field,
            f"dataset '{name}' rejects split={split!r}, config={config!r}: {exc}",
            f"set {field.split('.')[1]} to one that the message lists",
        ) from exc


def nearest_shortcuts(name: str) -> list[str]:
    """Shortcut names closest to `name` (all of them when none is close)."""
    candidates = [*SHORTCUTS, *ALIASES]
    close = difflib.get_close_matches(name.split("/")[-1].lower(), candidates, n=3, cutoff=0.5)
    return close or list(SHORTCUTS)


def call_loader(spec: str, args: DatasetArgs):
    """Import `module:function`, call it with `args`, and check it returned a datasets.Dataset."""
    import datasets

    field = "dataset.dataset_loader"
    result = import_callable(spec, field, DatasetError, call_with=(args,))(args)
    if not isinstance(result, datasets.Dataset):
        raise DatasetError(
            field,
            f"'{spec}' returned a {type(result).__name__}, not a datasets.Dataset",
            "return a datasets.Dataset (from a DatasetDict, return one split, e.g. dd['train'])",
        )
    return result


def row_formatter(dataset, args: DatasetArgs, entry: dict | None, tokenizer, source: str):
    """(function turning a row into one text sample, whether a chat template renders them)."""
    columns = dataset.column_names
    if entry is not None and entry["format"] == "template" and not args.text_column:
        templates = entry["templates"]
        fields = [[f for _, f, _, _ in string.Formatter().parse(t) if f] for t in templates]
        require_columns(fields[-1], columns, source)  # the fallback template must always fit
        return (lambda row: _fill_template(row, templates, fields)), False

    column = args.text_column or (entry or {}).get("column")
    if column is None:
        column = next((c for c in ("text", "messages") if c in columns), "text")
    require_columns([column], columns, source)
    if _holds_messages(dataset, column, source):
        has_template = getattr(tokenizer, "chat_template", None) is not None
        return (lambda row: render_messages(row[column], tokenizer)), has_template
    return (lambda row: _text_value(row[column], column, source)), False


def _text_value(value: Any, column: str, source: str) -> str:
    """A row's text; a value of another type (judged by the first row, a later one can differ)
    is refused, naming the column."""
    if value is None or isinstance(value, str):
        return value or ""
    raise DatasetError(
        "dataset.text_column",
        f"column '{column}' of {source} holds a {type(value).__name__} in some rows "
        f"({value!r:.60}), not text",
        "set text_column to a column whose every value is a string, or fix those rows",
    )


def require_columns(needed: list[str], columns: list[str], source: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise DatasetError(
            "dataset.text_column",
            f"column {', '.join(repr(c) for c in missing)} is not in {source}; its columns are: "
            f"{', '.join(columns)}",
            "set text_column to the column holding the text or chat messages",
        )


def _holds_messages(dataset, column: str, source: str) -> bool:
    """True for chat messages (a list of dicts), False for text, judged by the first value set."""
    value = next((v for v in dataset.select(range(min(len(dataset), 100)))[column] if v), "")
    if isinstance(value, str):
        return False
    if isinstance(value, list) and isinstance(value[0], dict):
        return True
    raise DatasetError(
        "dataset.text_column",
        f"column '{column}' of {source} holds {type(value).__name__} values, not text or "
        "chat messages",
        "set text_column to a column of strings or of [{role, content}, ...] lists",
    )


def _fill_template(row: dict[str, Any], templates: list[str], fields: list[list[str]]) -> str:
    """The first template whose fields are all non-empty in `row`; the last one otherwise."""
    index = next((i for i, names in enumerate(fields) if all(row.get(n) for n in names)), -1)
    return templates[index].format(**{name: row.get(name) or "" for name in fields[index]})


def sample_texts(dataset, format_row: Callable, n: int, seed: int, source: str) -> list[str]:
    """`n` non-empty texts from rows in a seeded random order: same seed, same samples."""
    if n > len(dataset):
        raise DatasetError(
            "dataset.text_samples",
            f"text_samples={n} but {source} holds only {len(dataset)} rows",
            f"set text_samples to at most {len(dataset)}, or pick a larger dataset or split",
        )
    texts: list[str] = []
    # Rows are rendered lazily: only as many as needed, skipping empty ones (e.g. wikitext's).
    for row in dataset.shuffle(seed=seed, keep_in_memory=True):
        text = format_row(row)
        if text.strip():
            texts.append(text)
            if len(texts) == n:
                return texts
    if not texts:  # the column is there but blank: no text_samples value would help
        raise DatasetError(
            "dataset.text_column",
            f"every row of {source} is empty in the column read as text",
            "set text_column to the column holding the text or chat messages",
        )
    raise DatasetError(
        "dataset.text_samples",
        f"text_samples={n} but {source} holds only {len(texts)} non-empty rows of {len(dataset)}",
        f"set text_samples to at most {len(texts)}, or pick a larger dataset or split",
    )
