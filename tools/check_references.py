"""Stale references: every repository path or compressflow module named in code or docs exists.

Comments, docstrings and docs name files (`tasks/verify.py`) and modules
(`compressflow.reporting.tracking`, `tasks.render_recipe.render_recipe`); a move that forgets
one leaves a newcomer looking for a file that is gone. This reads every tracked text file and
prints each path or module reference that resolves to nothing; it exits 1 when there is one.

The Markdown pages (README.md, docs/, docs/benchmarks/, benchmarks/) link to each other: every
relative link `[text](path)` or `[text](path#heading)` outside code blocks must name an existing
file, and its anchor a heading of that page, as GitHub spells anchors (`## GPU hosts: one
calibration per GPU` is `#gpu-hosts-one-calibration-per-gpu`).

A comment or page that cites a figure names the page and, on the same line, its section:
`docs/benchmarks/verify.md, "Reads on the model-free path"` or
`docs/benchmarks/verify.md#reads-on-the-model-free-path`; that heading must be on the page.

    python tools/check_references.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = (
    "compressflow",
    "tasks",
    "flows",
    "blocks",
    "tests",
    "tools",
    "benchmarks",
    "demo",
    "deploy",
)
PATH = re.compile(
    rf"(?<![\w./-])(?:{'|'.join(TOP_FOLDERS)}|docs|\.ci)/[A-Za-z0-9_./-]*[A-Za-z0-9_]"
)
# Dotted names of our modules, as the installed package (`compressflow.tasks.verify`) or as the
# folder (`tasks.verify`); a name after the module must be defined in it.
PACKAGE_DIRS = {
    "compressflow.flows": "flows",
    "compressflow.tasks": "tasks",
    "compressflow.blocks": "blocks",
    "compressflow.demo": "demo",
    "compressflow": "compressflow",
    "tasks": "tasks",
    "flows": "flows",
}
DOTTED = re.compile(r"(?<![\w./-])(?:compressflow|tasks|flows)(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# Dotted strings that are names of something else: Prefect event and resource names, labels.
NOT_MODULES = (
    "compressflow.model.published",
    "compressflow.scheme",
    "compressflow.reused",
    "compressflow.auto_evaluate",
    "compressflow.output_dir",
    "compressflow.layers",
)
MARKDOWN_PAGES = ("README.md", "docs/*.md", "docs/benchmarks/*.md", "benchmarks/*.md")
# A Markdown page cited with its section: `page.md#anchor` or `page.md, "Heading"`.
CITATION = re.compile(
    rf"(?<![\w./-])((?:{'|'.join(TOP_FOLDERS)}|docs)/[A-Za-z0-9_./-]*\.md)"
    r'(?:#([\w-]+)|,\s*"([^"]+)")'
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
LINK_TARGET = re.compile(r"\]\([^)\s]+\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # https:, mailto: ...: not a repository path


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files = []
    for name in names:
        file = ROOT / name
        if file.suffix in (".png", ".jpg", ".ico") or not file.is_file():
            continue
        files.append(file)
    return files


def missing_path(reference: str) -> str | None:
    path = reference.rstrip(".")
    return None if (ROOT / path).exists() else f"{path} does not exist"


def _defines(file: Path, name: str) -> bool:
    pattern = (
        rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^(?:from|import)\s.*\b{name}\b"
        rf"|^from\s+\S+\s+import\s*\([^)]*\b{name}\b"  # a parenthesized, wrapped import
    )
    return re.search(pattern, file.read_text(), re.M) is not None


def missing_module(reference: str) -> str | None:
    """Why `reference` names nothing, or None when its module (and name, if any) exists."""
    if reference.startswith(NOT_MODULES):
        return None
    parts = reference.split(".")
    prefix = max(
        (p for p in PACKAGE_DIRS if parts[: p.count(".") + 1] == p.split(".")),
        key=len,
    )
    folder, rest = ROOT / PACKAGE_DIRS[prefix], parts[prefix.count(".") + 1 :]
    while rest and (folder / rest[0]).is_dir():
        folder, rest = folder / rest[0], rest[1:]
    if not rest:
        return None
    module = folder / f"{rest[0]}.py"
    if not module.exists():
        return f"{reference}: no module {module.relative_to(ROOT)}"
    if len(rest) > 1 and not _defines(module, rest[1]):
        return f"{reference}: {module.relative_to(ROOT)} defines no {rest[1]}"
    return None


def missing_section(page: str, anchor: str, heading: str) -> str | None:
    """Why a citation of `page`'s section names no heading there, or None when it does."""
    file = ROOT / page
    if not file.is_file():
        return None  # missing_path says so
    found = anchors(file)
    if anchor:
        return None if anchor in found else f"{page} has no heading #{anchor}"
    wanted = slug(heading)  # a quoted heading may be its start: "GPU hosts"
    if any(a == wanted or a.startswith(f"{wanted}-") for a in found):
        return None
    return f'{page} has no heading "{heading}"'


def stale(file: Path) -> list[str]:
    # A page's link targets are relative to its folder, and broken_links reads them.
    linked = file in markdown_pages()
    found = []
    for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
        if linked:
            line = LINK_TARGET.sub("]()", line)
        problems = [missing_path(m) for m in PATH.findall(line)]
        problems += [missing_module(m) for m in DOTTED.findall(line)]
        problems += [missing_section(*m) for m in CITATION.findall(line)]
        found += [f"{file.relative_to(ROOT)}:{number}: {p}" for p in problems if p]
    return found


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """The numbered lines of a Markdown page outside its fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: set[str] = set()
    for _, line in prose_lines(page):
        if match := HEADING.match(line):
            base = slug(match.group(1))
            anchor, n = base, 0
            while anchor in seen:
                n += 1
                anchor = f"{base}-{n}"
            seen.add(anchor)
    return seen


def broken_link(page: Path, target: str) -> str | None:
    """Why the link `target` on `page` leads nowhere, or None when its file (and heading) exist."""
    if SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.is_relative_to(ROOT):
        return f"link {target}: outside the repository"
    if not file.exists():
        return f"link {target}: no file {path}"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"link {target}: {file.relative_to(ROOT)} has no heading #{anchor}"
    return None


def broken_links(page: Path) -> list[str]:
    found = []
    for number, line in prose_lines(page):
        problems = [broken_link(page, target) for target in LINK.findall(line)]
        found += [f"{page.relative_to(ROOT)}:{number}: {p}" for p in problems if p]
    return found


def markdown_pages() -> list[Path]:
    return sorted({page for pattern in MARKDOWN_PAGES for page in ROOT.glob(pattern)})


def main() -> int:
    found = [problem for file in tracked_text_files() for problem in stale(file)]
    found += [problem for page in markdown_pages() for problem in broken_links(page)]
    for line in found:
        print(line)
    print(f"references: {len(found)} stale" if found else "references: all resolve")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
