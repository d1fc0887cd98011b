"""The repository's own checks (in `make lint`) hold on this checkout and catch what they exist for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checkout_keeps_its_layers_and_names_no_stale_paths():
    assert _tool("check_layers").main() == 0
    assert _tool("check_references").main() == 0


def test_stale_paths_and_modules_are_found(tmp_path):
    refs = _tool("check_references")
    gone = "tasks" + "/events.py"  # spelt in two parts so the check does not flag this file
    assert refs.missing_path(gone) == f"{gone} does not exist"
    assert refs.missing_path("tasks/verify.py") is None
    assert "no module tasks" + "/evaluation.py" in refs.missing_module(
        "compressflow.tasks" + ".evaluation"
    )
    assert "defines no Nope" in refs.missing_module("compressflow.params" + ".Nope")
    assert refs.missing_module("compressflow.reporting.tracking.open_run") is None
    assert refs.missing_module("tasks.render_recipe.render_recipe") is None
    # Imported there in a wrapped `from ... import (...)`.
    assert refs.missing_module("compressflow.flows.checks.needs_accelerator") is None


def test_markdown_links_lead_to_a_file_and_a_heading(tmp_path, monkeypatch):
    refs = _tool("check_references")
    monkeypatch.setattr(refs, "ROOT", tmp_path)
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "page.md").write_text("# Page\n\n## GPU hosts: one per `gpu:N`\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n[ok](guide/page.md#gpu-hosts-one-per-gpun) [web](https://example.com)\n"
        "[gone](guide/gone.md) [bad anchor](guide/page.md#gpu-hosts) [here](#title)\n"
        "```bash\n[in code](nowhere.md)\n```\n"
    )
    assert refs.slug("Verification: nothing broken is published") == (
        "verification-nothing-broken-is-published"
    )
    assert refs.broken_links(readme) == [
        "README.md:4: link guide/gone.md: no file guide/gone.md",
        "README.md:4: link guide/page.md#gpu-hosts: guide/page.md has no heading #gpu-hosts",
    ]


def test_a_cited_section_must_be_a_heading_of_its_page(tmp_path, monkeypatch):
    refs = _tool("check_references")
    monkeypatch.setattr(refs, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## GPU hosts: one per GPU\n")
    page = "docs" + "/page.md"  # spelt in two parts: the check reads this file too
    source = tmp_path / "code.py"
    source.write_text(
        f'# ({page}, "GPU hosts: one per GPU") ({page}, "GPU hosts") {page}#gpu-hosts-one-per-gpu\n'
        f'# ({page}, "GPU nodes") {page}#gpu-hosts\n'
    )
    assert refs.stale(source) == [
        f'code.py:2: {page} has no heading "GPU nodes"',
        f"code.py:2: {page} has no heading #gpu-hosts",
    ]


def test_private_library_names_are_refused_outside_the_adapter(tmp_path):
    layers = _tool("check_layers")
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch.fx._symbolic_trace\n"
        "from llmcompressor.pipelines.sequential.helpers import trace_subgraphs\n"
        "from llmcompressor import oneshot\n"
        "mapping = model._no_split_modules\n"
        "self._mine = 1\n"
    )
    found = layers.internals_reached(source, ["llmcompressor.pipelines"])
    assert found == [
        "1: internal module torch.fx._symbolic_trace",
        "2: internal module llmcompressor.pipelines.sequential.helpers",
        "4: private attribute ._no_split_modules",
    ]


def test_sibling_groups_of_the_bottom_layer_do_not_import_each_other():
    layers = _tool("check_layers")
    config = {
        "layers": [
            "compressflow.tasks",
            ["compressflow.store", "compressflow.model"],
            "compressflow",
        ]
    }
    assert layers.layer_of("compressflow.store.locks", config["layers"]) == (
        1,
        "compressflow.store",
    )
    assert layers.layer_of("compressflow.params", config["layers"]) == (2, "compressflow")


def test_an_import_circle_is_found_even_through_a_function_level_import(tmp_path, monkeypatch):
    layers = _tool("check_layers")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "keys.py").write_text("from pkg.cache import signature\n")
    (package / "cache.py").write_text("def signature():\n    from pkg import keys\n")
    (package / "alone.py").write_text("import pkg.cache\n")
    assert layers.circles({"pkg": "pkg"}) == ["pkg/cache.py: import circle: pkg.cache <-> pkg.keys"]


def test_a_task_taking_more_than_six_parameters_is_refused_and_a_flow_is_not(tmp_path, monkeypatch):
    layers = _tool("check_layers")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "stage.py").write_text(
        "@task\ndef calibrate(a, b, c, d, e, f, g):\n    ...\n\n"
        "@flow(name='x')\ndef compress(a, b, c, d, e, f, g, h):\n    ...\n\n"
        "class Runner:\n    def run(self, a, b, c, d, e, f):\n        ...\n"
    )
    config = {"narrow": ["pkg.tasks"], "max_parameters": 6}
    assert layers.wide_signatures(config, {"pkg.tasks": "tasks"}) == [
        f"{Path('tasks', 'stage.py')}:2: calibrate takes 7 parameters (at most 6): hand it the inputs bundle"
    ]


def test_a_shared_layer_imports_itself_freely_and_still_points_down(tmp_path, monkeypatch):
    layers = _tool("check_layers")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    for folder, text in {
        "pkg/__init__.py": "",
        "pkg/params.py": "from pkg.model.args import ModelArgs\n",
        "pkg/model/__init__.py": "",
        "pkg/model/args.py": "from pkg.data.args import DataArgs\n",
        "pkg/model/load.py": "from pkg.params import ModelArgs\n",
        "pkg/data/__init__.py": "",
        "pkg/data/args.py": "from pkg.model.load import load\n",
    }.items():
        (tmp_path / folder).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / folder).write_text(text)
    config = {
        "layers": [
            ["pkg.model", "pkg.data"],
            {"shared": ["pkg", "pkg.model.args", "pkg.data.args"]},
        ]
    }
    assert layers.violations(config, {"pkg": "pkg"}) == [
        f"{Path('pkg', 'data', 'args.py')}:1: pkg.data.args (pkg.data.args) imports "
        "pkg.model.load (pkg.model), a higher layer"
    ]


def test_every_package_folder_is_installed():
    """A normal (non-editable) install takes only the packages pyproject.toml lists."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"compressflow": "compressflow", **tool["package-dir"]}
    found = {
        ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
        for name, folder in folders.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found - set(tool["packages"]) == set()


def test_a_hash_outside_the_keys_module_is_refused_unless_listed_with_why(tmp_path, monkeypatch):
    layers = _tool("check_layers")
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    for name in ("__init__", "keys", "cache", "names"):
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / f"{name}.py").write_text(
            "import hashlib\n" if name != "__init__" else ""
        )
    config = {"keys": "pkg.keys", "hashes_elsewhere": {"pkg.names": "an artifact's name"}}
    assert [line.split(":")[0] for line in layers.hashes_outside_keys(config, {"pkg": "pkg"})] == [
        str(Path("pkg", "cache.py"))
    ]
