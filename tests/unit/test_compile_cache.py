"""A process of ours compiles in a cache of its own, seeded from the kept one, and only one that
ended well adds to the kept cache (compressflow.model.compile_cache).

A vLLM child stands in here as a small Python script run by `serving.run_child`, the real
boundary: it writes a "compiled" file into TORCHINDUCTOR_CACHE_DIR and then ends well, or is
killed mid-write. The matrix's AutoRound run checks that real compiles leave the host's cache
alone (tests/matrix/test_auto_round.py).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from compressflow.model import compile_cache, serving

CHILD = """
import json, os, signal, sys
name = os.path.basename(sys.argv[0])
folder = os.environ["TORCHINDUCTOR_CACHE_DIR"]
compiled = os.path.join(folder, "ab")
seen = sorted(os.listdir(compiled)) if os.path.isdir(compiled) else []
os.makedirs(compiled, exist_ok=True)
os.makedirs(os.path.join(folder, "locks"), exist_ok=True)
open(os.path.join(folder, "locks", "cab.lock"), "w").close()
with open(os.path.join(compiled, name.split("-")[-1] + ".so"), "wb") as out:
    out.write(b"x" * 1000)
    if "killed" in name:
        out.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # what a timeout or the OOM killer does mid-write
with open(sys.argv[2], "w") as result:
    json.dump({"seen": seen}, result)
"""


@pytest.fixture()
def kept(tmp_path, monkeypatch):
    """The kept cache in this test's folder, not the session's shared one."""
    monkeypatch.setenv("COMPRESSFLOW_COMPILE_CACHE_DIR", str(tmp_path / "kept"))
    return tmp_path / "kept"


@pytest.fixture()
def child(tmp_path, monkeypatch, kept):
    """Run a stand-in child named `name` (it writes `ab/<last part of name>.so`)."""

    def run(name: str) -> dict:
        script = tmp_path / name
        script.write_text(CHILD)
        monkeypatch.setattr(serving, "CHILD", script)
        output, _ = serving.run_child({}, False, sys.executable, timeout=60)
        return output

    return run


def test_a_child_that_ended_well_keeps_what_it_compiled_for_the_next(child):
    assert child("child-first") == {"seen": []}
    kept = compile_cache.kept_cache()
    assert sorted(p.name for p in (kept / "ab").iterdir()) == ["first.so"]
    assert not (kept / "locks").exists()  # torch's lock files stay with their process
    assert child("child-second") == {"seen": ["first.so"]}  # it started warm
    assert sorted(p.name for p in (kept / "ab").iterdir()) == ["first.so", "second.so"]


def test_a_killed_child_adds_nothing_to_the_kept_cache(child):
    assert child("child-first") == {"seen": []}
    assert child("child-killed-truncated") == {}
    kept = compile_cache.kept_cache()
    assert sorted(p.name for p in (kept / "ab").iterdir()) == ["first.so"]


def test_the_kept_cache_drops_its_oldest_files_past_its_size(tmp_path, kept, monkeypatch):
    private = compile_cache.seed(tmp_path / "private")
    (private / "ab").mkdir()
    for name in ["new", "middle", "old"]:
        (private / "ab" / f"{name}.so").write_bytes(b"x" * 1000)
    compile_cache.keep(private)
    kept = compile_cache.kept_cache() / "ab"
    for age, name in enumerate(["new", "middle", "old"]):
        os.utime(kept / f"{name}.so", (time.time() - 100 * age,) * 2)
    monkeypatch.setattr(compile_cache, "KEPT_BYTES", 2500)
    compile_cache.trim(compile_cache.kept_cache())
    assert sorted(p.name for p in kept.iterdir()) == ["middle.so", "new.so"]


def test_a_kept_cache_that_cannot_be_written_costs_a_warning_not_the_run(
    tmp_path, monkeypatch, caplog
):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the cache dir is a file: nothing can be made under it
    monkeypatch.setenv("COMPRESSFLOW_COMPILE_CACHE_DIR", str(blocked / "kept"))
    private = compile_cache.seed(tmp_path / "private")
    (private / "ab").mkdir()
    (private / "ab" / "lib.so").write_bytes(b"x")
    compile_cache.keep(private)
    assert "Could not keep compiled code" in caplog.text


def test_the_kept_cache_defaults_to_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPRESSFLOW_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path))
    assert compile_cache.kept_cache() == tmp_path / "torch-compile"


def test_a_folder_of_the_users_is_never_trimmed_nor_written(tmp_path, monkeypatch, caplog):
    """COMPRESSFLOW_COMPILE_CACHE_DIR pointed at a folder that holds the user's files: keeping
    trims the oldest files, so nothing is kept there and nothing of theirs is touched."""
    users = tmp_path / "users-folder"
    (users / "ab").mkdir(parents=True)
    (users / "ab" / "weights.safetensors").write_bytes(b"w" * 3000)
    monkeypatch.setenv("COMPRESSFLOW_COMPILE_CACHE_DIR", str(users))
    monkeypatch.setattr(compile_cache, "KEPT_BYTES", 10)
    private = compile_cache.seed(tmp_path / "private")
    assert not list(private.iterdir())  # nothing of theirs copied in either
    (private / "ab").mkdir()
    (private / "ab" / "lib.so").write_bytes(b"x" * 100)
    compile_cache.keep(private)
    assert sorted(p.name for p in users.rglob("*")) == ["ab", "weights.safetensors"]
    assert "holds files compressflow did not write" in caplog.text
    assert "COMPRESSFLOW_COMPILE_CACHE_DIR" in caplog.text


def test_trimming_never_follows_a_link_out_of_the_kept_cache(tmp_path, kept, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "old.bin").write_bytes(b"o" * 3000)
    os.utime(outside / "old.bin", (0, 0))  # the oldest file there is: first to go, if reached
    private = compile_cache.seed(tmp_path / "private")
    (private / "ab").mkdir()
    (private / "ab" / "lib.so").write_bytes(b"x" * 100)
    compile_cache.keep(private)
    (kept / "linked").symlink_to(outside, target_is_directory=True)
    (kept / "old.so").symlink_to(outside / "old.bin")
    monkeypatch.setattr(compile_cache, "KEPT_BYTES", 10)
    compile_cache.keep(private)
    assert (outside / "old.bin").read_bytes() == b"o" * 3000
    assert (kept / "linked").is_symlink() and (kept / "old.so").is_symlink()
