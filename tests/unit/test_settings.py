"""The worker's COMPRESSFLOW_* environment is refused as a parameter is: the variable named, the
value shown, the fix with the default; a misspelt name, a cache folder no run could write and an
empty value (unset, not the current folder) included. The fuzzer (tests/e2e/test_fuzz.py,
`test_worker_settings`) draws what these do not name."""

from __future__ import annotations

from pathlib import Path

import pytest

from compressflow.errors import SettingsError
from compressflow.settings import Settings, check_settings, settings, variable


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "15m", "valid number"),
        ("COMPRESSFLOW_VLLM_TIMEOUT_SECONDS", "inf", "finite number"),
        ("COMPRESSFLOW_LOCK_TIMEOUT_SECONDS", "0", "greater than 0"),
        ("COMPRESSFLOW_MAX_DATA_MB", "1e309", "valid integer"),
        ("COMPRESSFLOW_TRACKING", "maybe", "valid boolean"),
        ("COMPRESSFLOW_THREADS", "four", "valid integer"),
        ("COMPRESSFLOW_THREADS", "0", "greater than 0"),
        ("COMPRESSFLOW_GPU_DEVICES", "zero", "'zero' is not a GPU index"),
        ("COMPRESSFLOW_GPU_SLOT_PREFIX", "a/b", "pattern"),
    ],
)
def test_a_value_its_field_refuses_names_the_variable(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        settings()
    error = raised.value
    assert error.field == name
    assert repr(value) in error.problem and words in error.problem
    field = name.removeprefix("COMPRESSFLOW_").lower()
    assert f"{name} ({Settings.model_fields[field].description.rstrip('.')}" in error.fix
    assert "default" in error.fix or "unset:" in error.fix  # what unset means, either way


def test_every_wrong_variable_is_named_at_once(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_THREADS", "four")
    monkeypatch.setenv("COMPRESSFLOW_MAX_DATA_MB", "lots")
    with pytest.raises(SettingsError) as raised:
        settings()
    assert set(raised.value.field.split(", ")) == {
        "COMPRESSFLOW_THREADS",
        "COMPRESSFLOW_MAX_DATA_MB",
    }
    assert "COMPRESSFLOW_THREADS='four'" in raised.value.problem


def test_a_long_value_is_shortened_in_the_message(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_MAX_DATA_MB", "9" * 400 + "x")
    with pytest.raises(SettingsError) as raised:
        settings()
    assert "401 characters" in raised.value.problem and len(str(raised.value)) < 1200


@pytest.mark.parametrize("name", ["COMPRESSFLOW_OUTPUT_DIR", "COMPRESSFLOW_COMPILE_CACHE_DIR"])
def test_an_empty_value_is_unset_not_the_current_folder(monkeypatch, name):
    monkeypatch.setenv(name, "")
    field = Settings.model_fields[name.removeprefix("COMPRESSFLOW_").lower()]
    assert getattr(settings(), name.removeprefix("COMPRESSFLOW_").lower()) == field.default


def test_gpu_devices_take_indices_uuids_and_none(monkeypatch):
    for value in ["0", "0,1", "-1", "GPU-8e6a-11ef", "MIG-3b2c", "none", "NONE", " 1 , 2 "]:
        monkeypatch.setenv("COMPRESSFLOW_GPU_DEVICES", value)
        assert settings().gpu_devices == value


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("COMPRESSFLOW_VLLM_TIMEOUT", "COMPRESSFLOW_VLLM_TIMEOUT_SECONDS"),
        ("COMPRESSFLOW_OUTPUTDIR", "COMPRESSFLOW_OUTPUT_DIR"),
        ("COMPRESSFLOW_THREAD", "COMPRESSFLOW_THREADS"),
    ],
)
def test_a_misspelt_name_is_refused_with_the_one_meant(monkeypatch, typed, meant):
    monkeypatch.setenv(typed, "60")
    with pytest.raises(SettingsError) as raised:
        check_settings()
    assert raised.value.field == typed
    assert "would be ignored" in raised.value.problem
    assert f"did you mean {meant}" in raised.value.fix


def test_names_compressflow_sets_for_its_children_are_not_refused(monkeypatch):
    monkeypatch.setenv("COMPRESSFLOW_HELD_GPUS", "0")
    check_settings()


def test_a_lower_case_name_is_the_setting(monkeypatch):
    monkeypatch.setenv("compressflow_threads", "3")
    assert check_settings().threads == 3


@pytest.mark.parametrize("kind", ["file", "under a file", "on /proc"])
def test_a_cache_folder_no_run_could_write_is_refused(monkeypatch, tmp_path, kind):
    (tmp_path / "taken").write_text("a file")
    place = {
        "file": tmp_path / "taken",
        "under a file": tmp_path / "taken" / "cache",
        "on /proc": Path("/proc/self/cache"),  # refused even to root, unlike a mode bit
    }[kind]
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(place))
    with pytest.raises(SettingsError) as raised:
        check_settings()
    assert raised.value.field == variable("cache_dir") and str(place) in raised.value.problem
    assert not place.is_dir()


def test_a_temporary_folder_too_long_for_the_forkserver_socket_is_refused(monkeypatch, tmp_path):
    import multiprocessing.connection
    import tempfile

    from compressflow.settings import FORKSERVER_SOCKET_BYTES

    # The socket's name is the folder's plus FORKSERVER_SOCKET_BYTES, as multiprocessing makes it.
    probe = multiprocessing.connection.arbitrary_address("AF_UNIX")
    assert len(probe) == len(tempfile.gettempdir()) + FORKSERVER_SOCKET_BYTES
    deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(SettingsError) as raised:
        check_settings()
    assert raised.value.field == "TMPDIR" and "TMPDIR" in raised.value.fix
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    check_settings()


def test_every_setting_is_documented():
    """docs/deployments.md lists every setting, so the refusal's pointer leads somewhere."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deployments.md").read_text()
    missing = [variable(name) for name in Settings.model_fields if variable(name) not in text]
    assert not missing, f"docs/deployments.md (Worker settings) does not list {missing}"
