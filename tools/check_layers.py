"""The import-layers contract: imports point down, siblings stay apart, no module imports itself
back through others, internals go through compat.

The contract is data in pyproject.toml (`[tool.compressflow.layers]`):
- `layers`: a module may import modules of its own layer or of layers below it. A layer written
  as a list holds sibling packages that must not import one another (the bottom layer's groups);
  one written as a table `{ shared = [...] }` holds packages that share one vocabulary and import
  one another freely (the root modules and each slice's `args` and `result`).
- `independent`: a package whose modules must not import each other (stages share code through
  the bottom layer instead).
- `narrow` packages' functions take at most `max_parameters` (Prefect flows' own parameter
  groups excepted).
- No import circle between any two modules of the package (Tarjan's components of the import
  graph), whatever their layers.
- `keys`: the one module that hashes what decides reuse, resume or cache; another module that
  imports hashlib is refused unless `hashes_elsewhere` lists it with what its hash is for (an
  artifact's name, a checksum sent with an upload): a cache bug means reading one module.
- `adapter` and `internal_modules`: a private library name (an underscored attribute or module)
  or a module of `internal_modules` is reached only from the adapter module, so a library
  upgrade is one file's work. This rule covers every tracked Python file, tests included.

import-linter cannot check this repository: it finds a package's modules by walking the
package's folder, and `compressflow.flows`, `.tasks`, `.blocks` and `.demo` are mapped from
top-level folders (`[tool.setuptools.package-dir]`) so the repository keeps Prefect's layout.
This script reads the same mapping, parses every module (imports inside functions count too)
and prints each violation; it exits 1 when there is one.

    python tools/check_layers.py
"""

from __future__ import annotations

import ast
import subprocess
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


Layer = str | list[str] | dict[str, list[str]]


def packages_of(layer: Layer) -> list[str]:
    if isinstance(layer, str):
        return [layer]
    return layer["shared"] if isinstance(layer, dict) else layer


def layer_of(module: str, layers: list[Layer]) -> tuple[int, str] | None:
    """(index, package) of the most specific layer package `module` belongs to (0 is the top)."""
    matches = [
        (i, package)
        for i, layer in enumerate(layers)
        for package in packages_of(layer)
        if module == package or module.startswith(package + ".")
    ]
    return max(matches, key=lambda match: len(match[1])) if matches else None


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
            if own is None or target is None:
                continue
            if target[0] < own[0]:
                found.append(
                    f"{where}: {module} ({own[1]}) imports {name} ({target[1]}), a higher layer"
                )
            elif target[0] == own[0] and target[1] != own[1] and isinstance(layers[own[0]], list):
                found.append(
                    f"{where}: {module} ({own[1]}) imports {name} ({target[1]}); "
                    "sibling groups do not import one another"
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


def circles(package_dirs: dict[str, str]) -> list[str]:
    """Import circles between the package's modules, imports inside functions included: a
    function-level import that dodges a circle still ties two modules into one."""
    modules = module_files(package_dirs)
    graph = {
        module: {name for _, name in imported_names(file) if name in modules and name != module}
        for module, file in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for name in sorted(graph[module]):
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = []
            while (name := stack.pop()) != module:
                component.append(name)
            if component:
                circle = " <-> ".join(sorted([module, *component]))
                found.append(f"{modules[module].relative_to(ROOT)}: import circle: {circle}")

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def wide_signatures(config: dict, package_dirs: dict[str, str]) -> list[str]:
    """Functions of `narrow` packages taking more than `max_parameters`: the inputs travel as one
    bundle (compressflow.inputs), not unpacked again at every call. A Prefect flow's own
    parameter groups are its form in the UI: `@flow` functions are excepted."""
    limit, found = config.get("max_parameters"), []
    for module, file in sorted(module_files(package_dirs).items()):
        if not limit or not any(module.startswith(p + ".") for p in config.get("narrow", [])):
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
            if any(getattr(d, "id", getattr(d, "attr", "")) == "flow" for d in decorators):
                continue
            arguments = node.args
            names = [a.arg for a in [*arguments.posonlyargs, *arguments.args]]
            count = len(names) + len(arguments.kwonlyargs) - (names[:1] in (["self"], ["cls"]))
            if count > limit:
                found.append(
                    f"{file.relative_to(ROOT)}:{node.lineno}: {node.name} takes {count} "
                    f"parameters (at most {limit}): hand it the inputs bundle"
                )
    return found


def hashes_outside_keys(config: dict, package_dirs: dict[str, str]) -> list[str]:
    """Modules other than `keys` that import hashlib, less those `hashes_elsewhere` names."""
    allowed = {config["keys"], *config.get("hashes_elsewhere", {})}
    return [
        f"{file.relative_to(ROOT)}:{line}: {module} imports hashlib; compute the key in "
        f"{config['keys']} (or, for a name or a checksum, list it under hashes_elsewhere with why)"
        for module, file in sorted(module_files(package_dirs).items())
        if module not in allowed
        for line, name in imported_names(file)
        if name == "hashlib" or name.startswith("hashlib.")
    ]


# Underscored names that are public API (the standard library's): not library internals.
PUBLIC_UNDERSCORED = {"_exit", "_getframe", "_asdict", "_replace", "_fields", "_make"}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__") and part not in PUBLIC_UNDERSCORED


def internals_reached(file: Path, internal_modules: list[str]) -> list[str]:
    """Private library names and internal modules `file` reaches, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: private attribute .{node.attr}")
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name.startswith("compressflow"):
                continue
            internal = any(name == m or name.startswith(m + ".") for m in internal_modules)
            if internal or any(_private(part) for part in name.split(".")):
                found.append(f"{node.lineno}: internal module {name}")
                break
    return found


def internals_outside_adapter(config: dict, package_dirs: dict[str, str]) -> list[str]:
    adapter = module_files(package_dirs)[config["adapter"]].resolve()
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for relative in tracked:
        file = ROOT / relative
        if file.resolve() == adapter or not file.exists():
            continue
        for hit in internals_reached(file, config.get("internal_modules", [])):
            found.append(f"{relative}:{hit}; reach it through {config['adapter']}")
    return found


def main() -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = {
        "compressflow": "compressflow",
        **pyproject["tool"]["setuptools"]["package-dir"],
    }
    config = pyproject["tool"]["compressflow"]["layers"]
    found = (
        violations(config, package_dirs)
        + circles(package_dirs)
        + wide_signatures(config, package_dirs)
        + (hashes_outside_keys(config, package_dirs) if "keys" in config else [])
        + internals_outside_adapter(config, package_dirs)
    )
    for line in found:
        print(line)
    print(f"import layers: {len(found)} violation(s)" if found else "import layers: kept")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
