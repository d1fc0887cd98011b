"""One set-up for the whole test session: isolated homes, one tiny model, one Prefect harness.

The folder decides a test's tier: tests/unit (no server, no calibration), tests/e2e (a Prefect
server, real calibrations), tests/matrix (architectures x presets, the longest drills). The
fixtures here serve every tier; what test files share besides fixtures is in tests/support.

Everything the tests write goes under one temporary folder, so persisted Prefect results, ClearML
offline sessions and compressflow caches never leak between sessions (stale results give false
cache hits). Nothing reaches a hub: HF_HUB_OFFLINE is set and the model is built locally.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors
from support.models import HUB_SHA, CountedOpen

_ROOT = Path(tempfile.mkdtemp(prefix="compressflow-tests-"))
# The demo's: it trains once for every test session, xdist worker and `make demo` of this
# checkout (keyed on its spec, code and library versions; demo/yardstick.py), not once a session.
YARDSTICK_ROOT = Path(__file__).resolve().parents[1] / ".demo" / "yardstick"
os.environ.update(
    PREFECT_HOME=str(_ROOT / "prefect"),
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
    PREFECT_LOGGING_TO_API_ENABLED="false",
    CLEARML_OFFLINE_MODE="1",
    CLEARML_CACHE_DIR=str(_ROOT / "clearml"),
    COMPRESSFLOW_CACHE_DIR=str(_ROOT / "cache"),
    # Compiled code, like the yardstick, outlives the session: a vLLM check compiles about 15 s
    # into an empty cache (docs/benchmarks/compile-cache.md).
    COMPRESSFLOW_COMPILE_CACHE_DIR=str(YARDSTICK_ROOT.parent / "torch-compile"),
    COMPRESSFLOW_OUTPUT_DIR=str(_ROOT / "outputs"),
    HF_HOME=str(_ROOT / "hf"),
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    # vLLM serves outputs only in the tests that ask for it (`with_vllm`): it adds ~15 s a run.
    COMPRESSFLOW_VLLM_PYTHON="off",
    # The test modules that define custom loaders and collators (their folders are on sys.path).
    COMPRESSFLOW_ALLOWED_IMPORTS="test_build_dataset,test_validate,test_compress_flow,test_architectures,test_memory",
)
# `make unit` and `make matrix` run two test processes (pytest-xdist): each computes its
# in-process tensors on one thread, so neither spins on the core the other holds (torch would take
# both in each). The stages' children size themselves on the host's ledger
# (compressflow.model.cpus) as in a run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A child re-counts its share only at its progress events, so for a while two children can
    # run four threads on two cores: waiting threads sleep instead of spinning on a held core.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def stage_children():
    """The forkserver the stages' children fork from, with their modules imported, as a run
    starts it: a child then imports nothing of its own (about 0.5 s a child here otherwise)."""
    from compressflow.runtime.isolation import warm_up

    warm_up()


@pytest.fixture(scope="session")
def test_root() -> Path:
    return _ROOT


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The project's vLLM environment (`make vllm-env`); CI builds it, so there it must exist."""
    from compressflow.settings import PROJECT_VLLM

    if (PROJECT_VLLM / ".installed").exists():
        return PROJECT_VLLM / "bin" / "python"
    if os.environ.get("CI"):
        pytest.fail("CI builds the vLLM environment first (make vllm-env); it is missing")
    pytest.skip("no vLLM environment: `make vllm-env` builds it")


@pytest.fixture()
def with_vllm(vllm_python, monkeypatch) -> Path:
    """Verify and evaluate-model serve outputs in the project's vLLM environment."""
    monkeypatch.setenv("COMPRESSFLOW_VLLM_PYTHON", str(vllm_python))
    return vllm_python


@pytest.fixture(scope="session")
def tiny_model(test_root) -> Path:
    """A 2-layer, 256-wide random Llama with a trained tokenizer; built once per session."""
    from compressflow.demo.assets import build_tiny_llama

    return build_tiny_llama(test_root / "tiny-llama")


@pytest.fixture(scope="session")
def sharded_tiny_model(tiny_model, test_root) -> Path:
    """`tiny_model` as transformers saves it in two shards, with model.safetensors.index.json."""
    import transformers

    folder = test_root / "tiny-llama-sharded"
    if not (folder / "model.safetensors.index.json").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)
        model.save_pretrained(folder, max_shard_size="5MB")
        for file in Path(tiny_model).iterdir():
            if not file.name.startswith("model") and not (folder / file.name).exists():
                shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="session")
def yardstick():
    """The learned-weights yardstick (demo/yardstick.py): a small Llama trained for a few CPU
    minutes, with calibration and held-out text; trained once per checkout."""
    return _build_yardstick()  # built already: pytest_collection_finish


def _build_yardstick():
    from compressflow.demo.yardstick import build_yardstick

    return build_yardstick(YARDSTICK_ROOT)


@pytest.fixture()
def hub_cache(tiny_model, test_root):
    """The tiny model laid out in HF_HOME exactly as huggingface_hub caches `acme/tiny-llama`."""
    import shutil

    repo = test_root / "hf" / "hub" / "models--acme--tiny-llama"
    if not repo.exists():
        shutil.copytree(tiny_model, repo / "snapshots" / HUB_SHA)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(HUB_SHA)
    return repo


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the session (it takes ~11 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@dataclass(frozen=True)
class SharedRun:
    """One finished compress run: its parameters, its Prefect state and what it published."""

    params: dict
    state: Any
    published: Any


@pytest.fixture(scope="session")
def w4a16_run(tiny_model, test_root, prefect_harness) -> SharedRun:
    """One W4A16 calibration of the tiny model, shared by every test that only reads a run.

    Its parameters carry what those tests look for (tags, a recipe argument, a ClearML task
    name, batch knobs), so naming, lineage, tracking, the manifest and evaluation are checked on
    one calibration instead of one each. A test that reruns `params` gets the reuse path.
    """
    from compressflow.flows.compress import compress
    from compressflow.params import (
        CalibrationArgs,
        DatasetArgs,
        ModelArgs,
        OutputArgs,
        RecipeArgs,
        TrackingArgs,
    )

    params = dict(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=16, max_seq_len=64),
        recipe=RecipeArgs(preset="W4A16", recipe_args={"dampening_frac": 0.02}),
        output=OutputArgs(
            save_directory=str(test_root / "shared-w4a16" / "W4A16"),
            tags=["nightly", "team-a", "w4a16"],
        ),
        tracking=TrackingArgs(task_name="tracking test"),
        calibration=CalibrationArgs(batch_size=4, moe_calibrate_all_experts=False),
    )
    # Without vLLM, as a worker without it publishes: test_vllm_served_runs.py serves it in a reuse.
    state = compress(**params, return_state=True)
    return SharedRun(params=params, state=state, published=state.result())


@pytest.fixture()
def clearml_params():
    """A real offline ClearML task open for one test; returns a reader of its hyperparameters."""
    import json

    from compressflow.reporting.tracking import open_run

    with open_run("compressflow-tests", "unit test", tags=[]) as tracker:
        session = Path(tracker.location)

        def read() -> dict[str, dict[str, str]]:
            task = json.loads((session / "task.json").read_text())
            return {
                section: {name: item["value"] for name, item in values.items()}
                for section, values in (task.get("hyperparams") or {}).items()
            }

        yield read


@pytest.fixture(scope="session")
def prefect_stack(request):
    """A real `prefect server`, pools, deployments from prefect.yaml and a worker (~40 s),
    started in the background when collection ended (pytest_collection_finish)."""
    from support.prefect_stack import StackInBackground

    started = request.config.stash.get(EARLY_STACK, None)
    started = started or StackInBackground(Path(tempfile.mkdtemp(dir=_ROOT, prefix="stack-")))
    try:
        yield started.wait()
    finally:
        started.close()


@pytest.fixture
def stack_client(prefect_stack):
    """A Prefect client talking to `prefect_stack`'s server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: prefect_stack.api_url}),
        get_client(sync_client=True) as client,
    ):
        yield client


@pytest.fixture()
def counted_reads(monkeypatch) -> Counter:
    CountedOpen.reads = Counter()
    monkeypatch.setattr(safetensors, "safe_open", CountedOpen)
    return CountedOpen.reads


@pytest.fixture(scope="module")
def stack(prefect_stack):
    """`prefect_stack`, as the deployment tests name it."""
    return prefect_stack


@pytest.fixture(scope="session")
def zoo_root(test_root) -> Path:
    """Where the zoo's tiny models are built, once a session for every test that builds one."""
    return test_root / "zoo"


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """Variants of the tiny model, without weights: validation must never need them."""
    root = tmp_path_factory.mktemp("models")

    def variant(name, **config_changes):
        folder = root / name
        shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return {
        "plain": variant("plain"),
        "remote_code": variant("remote", auto_map={"AutoModelForCausalLM": "modeling.Custom"}),
        "quantized": variant("quantized", quantization_config={"quant_method": "awq"}),
    }


@pytest.fixture()
def no_accelerator(monkeypatch):
    """A worker without a GPU, whatever this host has."""
    from compressflow.model import hardware

    monkeypatch.setattr(hardware, "accelerator", lambda: None)


@pytest.fixture()
def cache_in_tmp_path(tmp_path, monkeypatch):
    """Checkpoints are discarded only below the cache root's calibration-resume folder."""
    monkeypatch.setenv("COMPRESSFLOW_CACHE_DIR", str(tmp_path))


# The folder decides the tier; the markers follow it, so `-m e2e`, `-m matrix` and
# `-m "not e2e and not matrix"` select what `make` runs by folder.
TESTS = Path(__file__).resolve().parent
TIER_MARKERS = {"e2e": pytest.mark.e2e, "matrix": pytest.mark.matrix}
# What needs a Prefect server (the session harness or a real `prefect server` with a worker):
# never in tests/unit, which runs in about a minute without one.
SERVER_FIXTURES = {"prefect_harness", "prefect_stack", "stack_client", "stack", "w4a16_run"}


def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(item.path).resolve()
        tier = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
        if tier in TIER_MARKERS:
            item.add_marker(TIER_MARKERS[tier])
        elif tier == "unit" and (needs := SERVER_FIXTURES & set(item.fixturenames)):
            raise pytest.UsageError(f"{item.nodeid} needs a server ({', '.join(needs)}): tests/e2e")


STACK_FIXTURES = {"prefect_stack", "stack_client", "stack"}
EARLY_STACK = pytest.StashKey()
PASSED = pytest.StashKey()  # no test failed: the session's folder is removed


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    # What collection imported lives as long as the session: frozen, every collection skips it,
    # as in the stages' children (compressflow.runtime.isolation). Each full collection walked
    # the libraries' millions of objects, about 0.45 s, and verification collects after a pass.
    gc.freeze()
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    # The yardstick trains on two threads, which spin while another process holds their core
    # (four times slower beside a busy one): built before any server, worker or test starts.
    if "yardstick" in needed:
        _build_yardstick()
    # The real stack's ~40 s of start-up, all subprocesses, overlaps the tests before its first.
    # Every test process collects every test, and starts its own: early only where each process
    # will likely use one. With fewer files needing it than processes (make test: one file, two
    # processes), the others started a server, deploys and two workers that no test used, 40 s
    # of CPU taken from the tests; the process the file lands on then starts it when asked.
    stacked = {
        i.path for i in session.items if STACK_FIXTURES & set(getattr(i, "fixturenames", ()))
    }
    if stacked and len(stacked) >= int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")):
        from support.prefect_stack import StackInBackground

        home = Path(tempfile.mkdtemp(dir=_ROOT, prefix="stack-"))
        session.config.stash[EARLY_STACK] = StackInBackground(home)


def pytest_sessionfinish(session):
    # Stopped here too when no test that needs it ran (an interrupted or failed-fast session).
    if (started := session.config.stash.get(EARLY_STACK, None)) is not None:
        started.close()
    session.config.stash[PASSED] = not session.testsfailed


def pytest_unconfigure(config):
    """The session's folder goes once everything that wrote to it has stopped (100 MB to a few
    GB a session: left behind, 549 sessions filled 15 GB of /tmp here); a failed session's
    stays, to be looked into."""
    if config.stash.get(PASSED, False):
        shutil.rmtree(_ROOT, ignore_errors=True)
    elif _ROOT.exists():
        print(f"\nThe tests' files are kept in {_ROOT}")


def pytest_sessionstart(session):
    # The stages' forkserver imports the libraries (about 5 s). Started before collection, it
    # does so on the other core while pytest imports the test modules, not inside the first
    # test that forks a child. Not in pytest-xdist's controller: it runs no test, and its
    # forkserver's imports would take a core from the workers' start.
    if session.config.pluginmanager.hasplugin("dsession"):
        return
    from compressflow.runtime.isolation import warm_up

    warm_up()
