"""The import-layers contract: imports point down, and stages do not import one another.

The contract is data in pyproject.toml (`[tool.compressflow.layers]`). A module may import
modules of its own layer or of layers below it; a package listed as `independent` holds modules
that must not import each other (stages share code through the bottom layer instead).

import-linter cannot check this repository: it finds a package's modules by walking the
package's folder, and `compressflow.flows`, `.tasks`, `.blocks` and `.demo` are mapped from
top-level folders (`[tool.setuptools.package-dir]`) so the repository keeps Prefect's layout.
This script reads the same mapping, parses every module (imports inside functions count too)
and prints each violation; it exits 1 when there is one.

    python tools/check_layers.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def module_files(package_dirs: dict[str, str]) -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from the package-dir mapping."""
    modules = {}
    for package, folder in sorted(package_dirs.items(), key=lambda item: -len(item[0])):
        for file in (ROOT / folder).rglob("*.py"):
            relative = file.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            name = ".".join([package, *parts])
            modules.setdefault(name, file)  # the longest (most specific) mapping wins
    return modules


def imported_names(file: Path) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return names


def layer_of(module: str, layers: list[str]) -> int | None:
    """Index of the most specific layer `module` belongs to (0 is the top)."""
    matches = [
        i for i, layer in enumerate(layers) if module == layer or module.startswith(layer + ".")
    ]
    return max(matches, key=lambda i: len(layers[i])) if matches else None


def violations(config: dict, package_dirs: dict[str, str]) -> list[str]:
    layers, independent = config["layers"], config.get("independent", [])
    modules = module_files(package_dirs)
    found = []
    for module, file in sorted(modules.items()):
        own = layer_of(module, layers)
        for line, name in imported_names(file):
            if name not in modules or name == module:
                continue  # a third-party name, or `from x import function`
            target = layer_of(name, layers)
            where = f"{file.relative_to(ROOT)}:{line}"
            if own is not None and target is not None and target < own:
                found.append(
                    f"{where}: {module} ({layers[own]}) imports {name} ({layers[target]}), a higher layer"
                )
            for package in independent:
                inside = module.startswith(package + ".") and name.startswith(package + ".")
                if (
                    inside
                    and name.split(".")[: package.count(".") + 2]
                    != module.split(".")[: package.count(".") + 2]
                ):
                    found.append(
                        f"{where}: {module} imports {name}; modules of {package} are independent"
                    )
    return found


def main() -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = {
        "compressflow": "compressflow",
        **pyproject["tool"]["setuptools"]["package-dir"],
    }
    found = violations(pyproject["tool"]["compressflow"]["layers"], package_dirs)
    for line in found:
        print(line)
    print(f"import layers: {len(found)} violation(s)" if found else "import layers: kept")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
