"""Calibration text that needs no network: docstrings of the Python standard library.

It backs the `python_docs` dataset shortcut and the demo model's tokenizer, so that the demo and
the tests run on machines that cannot reach a dataset hub. The module list is fixed and sorted
so the same interpreter always yields the same text.
"""

from __future__ import annotations

import importlib
import inspect

MODULES = (
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "codecs",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "secrets",
    "shelve",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "weakref",
    "zipfile",
)


def python_docs(min_chars: int = 80) -> list[str]:
    """Every distinct public docstring of MODULES at least `min_chars` long, in a stable order.

    Submodules are left out: importing `email.utils` anywhere in the process puts `utils` in
    `email`'s namespace, so with them the texts depended on what the process had imported (a
    held-out build would not leave out the rows calibration drew in another process).
    """
    seen: set[str] = set()
    texts: list[str] = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        members = [module] + [
            member
            for name in sorted(vars(module))
            if not name.startswith("_")
            and not _submodule(member := getattr(module, name), module_name)
        ]
        for member in members:
            doc = inspect.getdoc(member)
            if doc and len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                texts.append(doc)
    return texts


def _submodule(member, package: str) -> bool:
    return inspect.ismodule(member) and member.__name__.startswith(package + ".")


def verification_texts(count: int, min_chars: int = 120) -> list[str]:
    """`count` docstrings of Python's builtins that `python_docs` never yields.

    The verify stage compares models on these: held out from the `python_docs` calibration
    shortcut by construction, and present on every machine.
    """
    import builtins

    calibration = set(python_docs())
    texts = []
    for name in sorted(vars(builtins)):
        doc = inspect.getdoc(getattr(builtins, name))
        if doc and len(doc) >= min_chars and doc not in calibration and doc not in texts:
            texts.append(doc)
            if len(texts) == count:
                break
    return texts
