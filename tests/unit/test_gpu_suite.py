"""The wheel set `benchmarks/gpu.sh prepare` carries to a GPU host that reaches no registry:
its list names only what is installed here, and the closure check finds a missing requirement."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_suite


def fake_wheel(folder: Path, name: str, requires: list[str]) -> None:
    meta = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
        + [f"Requires-Dist: {r}" for r in requires]
    )
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}-1.0.dist-info/METADATA", meta)


def test_the_list_pins_every_carried_package_from_this_environment():
    lists = gpu_suite.wheel_list()
    assert not set(lists["carry"]) & set(lists["provided"])
    assert "torch" in lists["provided"]  # the image's CUDA build, never a carried one
    pins = gpu_suite.pins()
    assert len(pins) == len(lists["carry"])
    assert "prefect==3.9.1" in pins and "llmcompressor==0.14.0.1" in pins


def test_the_closure_check_names_what_nothing_supplies(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_suite, "wheel_list", lambda: {"carry": ["alpha", "beta"], "provided": ["torch"]}
    )
    fake_wheel(tmp_path, "alpha", ["beta>=1", "torch", 'colorama; sys_platform == "win32"'])
    fake_wheel(tmp_path, "beta", [])
    assert gpu_suite.check_wheels(tmp_path) == []  # win32-only colorama does not count

    fake_wheel(tmp_path, "beta", ["gamma<2"])
    missing = gpu_suite.check_wheels(tmp_path)
    assert len(missing) == 1 and "needs gamma<2" in missing[0]

    (tmp_path / "beta-1.0-py3-none-any.whl").unlink()
    assert gpu_suite.check_wheels(tmp_path) == [
        f"alpha needs beta>=1 (add it to [carry] in {gpu_suite.WHEEL_LIST})",
        "no wheel downloaded for beta",
    ]


def test_the_closure_check_follows_the_extras_asked_for(tmp_path, monkeypatch):
    """prefect asks for sqlalchemy[asyncio]; greenlet comes only with that extra."""
    monkeypatch.setattr(
        gpu_suite, "wheel_list", lambda: {"carry": ["alpha", "beta"], "provided": []}
    )
    fake_wheel(tmp_path, "alpha", ["beta[fast]"])
    fake_wheel(tmp_path, "beta", ['speedup; extra == "fast"', 'unused; extra == "slow"'])
    assert gpu_suite.check_wheels(tmp_path) == [
        f'beta needs speedup; extra == "fast" (add it to [carry] in {gpu_suite.WHEEL_LIST})'
    ]


def test_a_work_folder_holding_a_users_files_is_refused_and_left_alone(tmp_path):
    """The suite empties --work before each run, and a model build writes over its folder: both
    only where a benchmark wrote its marker (or the folder is new or empty)."""
    import argparse

    from benchmarks.common import RANDOM_MODELS, build_random_llama

    (tmp_path / "config.json").write_text("a user's model")
    args = argparse.Namespace(work=str(tmp_path), out=None, smoke=True, budget_s=1)
    with pytest.raises(SystemExit, match="holds files a benchmark did not write"):
        gpu_suite.run_suite(args)
    with pytest.raises(SystemExit, match="no random_llama.json"):
        build_random_llama(tmp_path, RANDOM_MODELS["smoke"])
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "a user's model"
