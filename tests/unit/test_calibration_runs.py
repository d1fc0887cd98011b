"""Calibration runs unattended: whatever ends its process ends the run Failed, with a fix.

The calibration process (compressflow.runtime.isolation) is ended by libraries in ways no
exception reports: auto-round calls `sys.exit(-1)`, native code aborts or segfaults, the kernel's
OOM killer sends SIGKILL. Each must reach the flow as a CalibrationError with the field, what
happened, the library's last words and a fix; never as a SystemExit that crashes the run. The
memory plan picks the batch size each algorithm and each kind of data can take, and text schemes
leave a vision-language model's vision tower and projector unquantized, decided from the model.
AutoRound's own exit in a flow: tests/e2e/test_auto_round_exit.py; AutoRound publishing with an
automatic batch size: tests/matrix/test_auto_round.py.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from compressflow.errors import CalibrationError, InputError
from compressflow.model.memory import GIB, has_images, make_plan
from compressflow.params import CalibrationArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.runtime import isolation
from compressflow.runtime.isolation import in_child, run_isolated

# --- Part A: the calibration process ends without a result ----------------------------------------
# Targets run in the forked child: module-level, called as target(*args, events=...).


def exits_like_auto_round(events):
    # auto-round's words and call when a calibration batch holds more samples than it batches.
    print(
        "ERROR this model has not been supported, please raise an issue or try to set the "
        "`batch_size` to 1 and `gradient_accumulate_steps` to your current batch size.",
        file=sys.stderr,
    )
    sys.exit(-1)


def aborts(events):
    logging.getLogger("compressflow").info("loaded the model; calibrating")
    os.abort()


def is_killed(events):
    print("about to run out of memory", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def leaves_quietly(events):
    os._exit(3)


def interrupted(events):
    raise KeyboardInterrupt


def returns(value, events):
    print("a progress line", file=sys.stderr)
    return value


def ended(target, *args) -> CalibrationError:
    with pytest.raises(CalibrationError) as raised:
        run_isolated(target, args, lambda kind, payload: None, "calibration")
    assert "Fix:" in str(raised.value)
    return raised.value


def test_a_library_calling_sys_exit_fails_the_run_with_its_last_words_and_a_fix():
    error = ended(exits_like_auto_round)
    assert error.field == "calibration.batch_size"
    assert "called sys.exit(-1) in" in error.problem
    assert "test_calibration_runs.py" in error.problem  # where it was called
    assert "try to set the `batch_size` to 1" in error.problem
    assert "set calibration.batch_size to 1" in error.fix


def test_an_abort_names_the_signal_and_the_last_logged_line():
    error = ended(aborts)
    assert "killed by SIGABRT (exit code -6)" in error.problem
    assert "loaded the model; calibrating" in error.problem
    assert "Fatal Python error: Aborted" in error.problem  # faulthandler's words on stderr
    assert error.field == "calibration" and "native code" in error.fix


def test_a_stage_child_that_dies_is_named_by_its_stage():
    from support.stand_ins import runs_out_of_memory

    with pytest.raises(CalibrationError) as raised:
        in_child(runs_out_of_memory)
    assert "the stand ins (runs_out_of_memory) process was killed by SIGKILL" in str(raised.value)


def test_inside_a_task_run_a_dead_child_is_named_by_the_task(monkeypatch):
    """The function's module is not the stage (functions live below the stages): inside a task
    run the message names the task a user sees in the run's graph."""
    from types import SimpleNamespace

    from prefect.context import TaskRunContext
    from support.stand_ins import runs_out_of_memory

    from compressflow.logs import stage_name

    assert stage_name() is None
    with TaskRunContext.model_construct(task=SimpleNamespace(name="build held-out text")):
        assert stage_name() == "build held-out text"
    # in_child's own logging needs a whole task run; the name is all this test is about
    monkeypatch.setattr(isolation, "stage_name", lambda: "build held-out text")
    with pytest.raises(CalibrationError) as raised:
        in_child(runs_out_of_memory)
    killed = "the build held-out text (runs_out_of_memory) process was killed by SIGKILL"
    assert killed in str(raised.value)


def test_a_sigkill_points_at_memory():
    error = ended(is_killed)
    assert "killed by SIGKILL (exit code -9)" in error.problem
    assert "about to run out of memory" in error.problem
    assert error.field == "calibration.max_cpu_memory_gb"
    assert "disk offload" in error.fix and "calibration.batch_size" in error.fix


def test_an_exit_without_a_result_and_an_interrupt_are_failures_too():
    assert "exited with code 3 without a result" in ended(leaves_quietly).problem
    assert "it printed nothing before" in ended(leaves_quietly).problem
    assert "was stopped by KeyboardInterrupt" in ended(interrupted).problem


def test_a_result_still_comes_back_and_stderr_is_passed_on(capsys):
    assert run_isolated(returns, (42,), lambda kind, payload: None, "calibration") == 42
    assert "a progress line" in capsys.readouterr().err


def environments(events):
    """This child's environment, and the one its forkserver (its parent) started with."""
    forkserver = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    return dict(os.environ), [entry.decode() for entry in forkserver]


def test_the_forkserver_asks_for_a_gpu_without_initializing_cuda():
    # llm-compressor asks torch for an accelerator when the forkserver imports it; asked the
    # usual way on a GPU host, every forked child then failed its first CUDA call (seen on an
    # H100). Through NVML the answer initializes nothing. The child and the task keep their own.
    child, forkserver = run_isolated(environments, (), lambda kind, payload: None, "calibration")
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in forkserver
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in child
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ


def modules_imported(events):
    """Which of Prefect and ClearML this child has imported."""
    return sorted(name for name in ("prefect", "clearml") if name in sys.modules)


def test_children_run_without_prefect_and_stage_modules_cannot_run_in_one():
    # Prefect is 70 MB resident: imported by the forkserver, it was in every child's memory,
    # the calibrating one's too, beside what a bare script holds. A stage module's function
    # pickled to a child would import it there again: refused, with where to put it instead.
    from compressflow.tasks.build_held_out import build_held_out

    assert run_isolated(modules_imported, (), lambda kind, payload: None, "plan") == []
    with pytest.raises(TypeError, match="bottom layer"):
        in_child(build_held_out.fn, None, None, None)


def test_no_stage_module_holds_a_function_its_children_run():
    # The refusal above for every call site at once, before any of them runs: a child's
    # function defined beside its task is only found by the run that reaches it.
    import ast

    root = Path(__file__).resolve().parents[2]
    for path in [*root.joinpath("tasks").glob("*.py"), *root.joinpath("flows").glob("*.py")]:
        tree = ast.parse(path.read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        defined |= {  # and a stage module's, imported (a flow's from its tasks)
            alias.asname or alias.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith(("compressflow.tasks", "compressflow.flows"))
            for alias in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("in_child", "run_isolated")
                and node.args
                and isinstance(node.args[0], ast.Name)
            ):
                assert node.args[0].id not in defined, f"{path.name}:{node.lineno}"


def _own_kb() -> int:
    """kB of this process's pages that are its own: written since the fork, by it or its parent."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("Private_Dirty:")[1].split()[0])


def copied_by_a_collection(events):
    """MB of the forkserver's pages a full GC in this child copies, and MB copied before it."""
    import gc

    before = _own_kb()
    gc.collect()
    return (_own_kb() - before) // 1024, before // 1024


def test_a_child_keeps_sharing_the_forkservers_libraries_when_it_collects():
    # Collected in the child, the forkserver's objects (torch, transformers, llm-compressor:
    # hundreds of thousands) were written to by the collector, and the ~100 MB of pages holding
    # them were copied into every child, counted twice in the worker's memory.
    # Measured across the collection alone: what the child's start and the forkserver's own
    # work since the fork copied (20 to 40 MB, with the load) is not the collector's.
    copied_mb, at_start_mb = run_isolated(
        copied_by_a_collection, (), lambda kind, payload: None, "plan"
    )
    assert copied_mb < 10, f"a collection copied {copied_mb} MB ({at_start_mb} MB before it)"


def makes_a_lock(events):
    """A named semaphore, as tqdm makes for its lock in every child that shows a bar: the
    names it added to /dev/shm."""
    import multiprocessing

    global LOCK
    before = set(os.listdir("/dev/shm"))
    LOCK = multiprocessing.RLock()
    return set(os.listdir("/dev/shm")) - before


def test_a_child_unlinks_the_semaphores_it_made_before_it_is_stopped():
    # Stopped as soon as its result came, a child never ran the finalizer that unlinks them:
    # each stayed in /dev/shm, and the task's process warned of "leaked semaphore objects".
    made = run_isolated(makes_a_lock, (), lambda kind, payload: None, "calibration")
    assert made and not made & set(os.listdir("/dev/shm"))


def hangs_in_its_exit(events):
    from multiprocessing import util

    util.Finalize(None, time.sleep, (600,), exitpriority=0)
    return "done"


def test_a_child_whose_exit_hangs_is_still_stopped():
    started = time.monotonic()
    assert run_isolated(hangs_in_its_exit, (), lambda kind, payload: None, "plan") == "done"
    assert time.monotonic() - started < isolation.EXIT_GRACE_SECONDS + 10


# --- Part B: the batch size each algorithm and each kind of data takes ----------------------------


def plan(tmp_path, recipe="W4A16", images=False, **args):
    """The plan for Llama-3.1-8B on a roomy GPU worker (tests/support/plans.py's shapes)."""
    from support.plans import LLAMA_8B, Config, data, model_8b

    return make_plan(
        model_8b(tmp_path),
        render(RecipeArgs(recipe=recipe)),
        data(samples=128, tokens=512),
        CalibrationArgs(**args),
        LLAMA_8B,
        Config(),
        tmp_path / "out",
        int(120 * GIB),
        int(78 * GIB),
        [512] * 128,
        images=images,
    )


def test_auto_round_and_image_calibration_are_planned_one_sample_per_batch(tmp_path):
    assert plan(tmp_path).batch_size == 16  # what the others get on this worker
    for chosen in (plan(tmp_path, "W4A16_AUTOROUND"), plan(tmp_path, images=True)):
        assert chosen.batch_size == 1
        assert "batch 1" in chosen.summary()
    assert any("AutoRoundModifier" in note for note in plan(tmp_path, "W4A16_AUTOROUND").notes)
    assert any("image+text" in note for note in plan(tmp_path, images=True).notes)
    assert plan(tmp_path, "W4A16_AUTOROUND", batch_size=1).batch_size == 1


@pytest.mark.parametrize("recipe, images", [("W4A16_AUTOROUND", False), ("W4A16", True)])
def test_a_batch_size_the_run_cannot_take_is_refused_before_weights_load(tmp_path, recipe, images):
    with pytest.raises(InputError) as raised:
        plan(tmp_path, recipe, images=images, batch_size=8)
    assert raised.value.field == "calibration.batch_size"
    assert "set calibration.batch_size to 0" in raised.value.fix


def test_image_rows_are_told_from_the_built_dataset(tmp_path):
    from datasets import Dataset

    from compressflow.results import BuiltDataset

    def built(columns) -> BuiltDataset:
        path = tmp_path / "-".join(columns)
        Dataset.from_dict({name: [[1, 2]] for name in columns}).save_to_disk(str(path))
        return BuiltDataset(
            path=str(path), fingerprint="f", source="t", num_samples=1, token_stats={}
        )

    assert has_images(built(["input_ids", "attention_mask", "pixel_values"]))
    assert not has_images(built(["input_ids", "attention_mask"]))
    assert not has_images(None)


# --- Part C: text schemes leave the vision tower and projector alone ------------------------------


@pytest.fixture(scope="module")
def zoo(test_root) -> Path:
    return test_root / "zoo"  # shared with tests/matrix/test_architectures.py


def quantize_ignores(recipe_yaml: str) -> list[list[str]]:
    from compressflow.recipes.tree import iter_modifiers

    return [
        kwargs.get("ignore") or []
        for _, _, kwargs in iter_modifiers(yaml.safe_load(recipe_yaml))
        if "scheme" in kwargs or "config_groups" in kwargs
    ]


@pytest.mark.parametrize(
    "name, vision",
    [
        ("gemma3", ["vision_tower"]),  # its projector holds no Linear
        ("llava", ["vision_tower", "multi_modal_projector"]),
        ("mllama", ["vision_model", "multi_modal_projector"]),
        ("llama", []),
    ],
)
def test_the_vision_modules_are_found_on_the_meta_model(zoo, name, vision):
    from transformers import AutoConfig

    from compressflow.demo.zoo import build_tiny, model_class
    from compressflow.model.tracing import meta_model, outside_text_model

    source = build_tiny(name, zoo)
    meta = meta_model(AutoConfig.from_pretrained(source), model_class(name))
    assert [path.rsplit(".", 1)[-1] for path in outside_text_model(meta)] == vision


def siglip_with_head(family: str):
    """A tiny config whose SigLIP tower has its attention-pool head, as SigLIP checkpoints do:
    the head's `out_proj` is a NonDynamicallyQuantizableLinear, which a `Linear` target matches.
    Every family calibrates it as plain nn.Linear (PLAIN_LINEAR_EVERYWHERE)."""
    import transformers as T

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    text.update(num_key_value_heads=1, head_dim=32, vocab_size=256)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, image_size=32)
    vision.update(num_attention_heads=2, patch_size=8, vision_use_head=True)
    if family == "gemma3":
        return T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return T.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **text),
        vision_config=dict(model_type="siglip_vision_model", projection_dim=64, **vision),
        projection_dim=64,
    )


@pytest.mark.parametrize("preset", ["W4A16", "W8A8", "FP8_DYNAMIC"])
@pytest.mark.parametrize(
    "family, model_class",
    [
        ("gemma3", "Gemma3ForConditionalGeneration"),
        ("paligemma", "PaliGemmaForConditionalGeneration"),
    ],
)
def test_text_schemes_leave_the_whole_vision_tower_unquantized(
    tmp_path, family, model_class, preset
):
    from compressed_tensors.utils import match_named_modules

    from compressflow.model.tracing import meta_model
    from compressflow.results import FetchedModel
    from compressflow.tasks.adapt_recipe import adapt_recipe

    config = siglip_with_head(family)
    config.save_pretrained(tmp_path)
    meta = meta_model(config, model_class)
    head = "model.vision_tower.head.attention.out_proj"
    assert type(meta.get_submodule(head)).__name__ == "NonDynamicallyQuantizableLinear"
    fetched = FetchedModel(
        path=str(tmp_path),
        source="local",
        model_id=family,
        identity=family,
        size_bytes=0,
        parameters=0,
        trust_remote_code=False,
        model_class=model_class,
    )
    adapted = adapt_recipe.fn(render(RecipeArgs(recipe=preset)), fetched)
    assert any("model.vision_tower" in note and "unquantized" in note for note in adapted.notes)
    [ignore] = quantize_ignores(adapted.yaml)
    quantized = [name for name, _ in match_named_modules(meta, ["Linear"], ignore)]
    assert quantized and all(".language_model." in name for name in quantized), quantized


def test_a_recipe_that_targets_the_vision_tower_keeps_it(zoo):
    from compressflow.demo.zoo import build_tiny
    from compressflow.params import ModelArgs
    from compressflow.tasks.adapt_recipe import adapt_recipe
    from compressflow.tasks.fetch_model import fetch

    fetched = fetch(ModelArgs(model_id=str(build_tiny("llava", zoo))))
    own = "- QuantizationModifier: {targets: ['re:.*vision_tower.*q_proj$'], scheme: FP8_DYNAMIC}"
    adapted = adapt_recipe.fn(render(RecipeArgs(recipe=own)), fetched)
    assert not any("vision_tower" in entry for entry in quantize_ignores(adapted.yaml)[0])


# --- Part D: the last logged line a failure quotes, among a crash's stack dumps -----------------


def test_other_threads_stacks_do_not_push_the_last_logged_line_out():
    from compressflow.runtime.isolation import _Tail

    tail = _Tail()
    dump = ["loaded the model; calibrating", "Fatal Python error: Aborted", ""]
    for n in range(5):  # as many threads as the process happened to start
        dump += [f"Thread 0x{n:04x} (most recent call first):", '  File "t.py", line 1 in run', ""]
    dump += ["Current thread 0x0001 (most recent call first):", '  File "a.py", line 9 in f']
    dump += ['  File "b.py", line 3 in g', '  File "c.py", line 1 in h', ""]
    tail.add("\n".join(dump) + "\n")
    text = tail.text()
    assert "loaded the model; calibrating" in text and "a.py" in text and "b.py" in text
    assert "t.py" not in text and "c.py" not in text


def test_a_line_logged_while_a_dump_is_half_read_is_kept():
    # CI's failure: the log line (its own pipe) arrived between two reads of faulthandler's dump
    # and was joined to the half-read frame line before it, then dropped with that frame.
    from compressflow.runtime.isolation import _Tail

    tail = _Tail()
    dump = "Fatal Python error: Aborted\n\nCurrent thread 0x0001 (most recent call first):\n"
    dump += '  File "a.py", line 9 in f\n  File "b.py", line 3 in g\n  File "c.py", line 1 in h\n'
    cut = dump.index("c.py")
    tail.add(dump[:cut])
    tail.logged("loaded the model; calibrating")
    tail.add(dump[cut:] + '  File "d.py", line 2 in main\n\nExtension modules: numpy (total: 1)\n')
    text = tail.text()
    assert "loaded the model; calibrating" in text and "a.py" in text and "b.py" in text
    assert "c.py" not in text and "d.py" not in text and "Extension" not in text
