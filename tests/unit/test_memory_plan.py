"""The memory plan: where calibration keeps the weights, and what it refuses before any load.

These feed `make_plan` the shape of a real 8B model (tests/support/plans.py) and made-up
workers; tests/e2e/test_memory.py runs the flow down each path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from support.plans import BF16_BYTES, LLAMA_8B, Config, data, model_8b

from compressflow.errors import ResourceError
from compressflow.flows.validate import validate
from compressflow.model.memory import GIB, make_plan, model_free_spec, truncated_share
from compressflow.model.offload import stage_offload_folder
from compressflow.params import GPU_SHARE, CalibrationArgs, RecipeArgs
from compressflow.recipes.render import render
from compressflow.reporting.model_card import memory_line


def plan(tmp_path, cpu_gib, gpu_gib=0, recipe="W4A16", dataset=None, **args):
    return make_plan(
        model_8b(tmp_path),
        render(RecipeArgs(recipe=recipe)),
        dataset if dataset is not None else data(),
        CalibrationArgs(**args),
        LLAMA_8B,
        Config(),
        tmp_path / "out",
        int(cpu_gib * GIB),
        int(gpu_gib * GIB),
    )


def test_an_8b_model_on_a_gpu_host_keeps_weights_in_cpu_memory_and_computes_on_the_gpu(tmp_path):
    result = plan(tmp_path, cpu_gib=120, gpu_gib=78)
    assert (result.path, result.placement, result.device) == ("classic", "gpu", "cuda")
    assert result.weight_bytes == BF16_BYTES
    # 256 x 2048 tokens x 4096 wide, in and out, bfloat16: 8 GiB between layers, on the CPU.
    assert result.activation_bytes == 2 * 256 * 2048 * 4096 * 2
    assert result.state_bytes > (6 * 4096**2 + 14336**2) * 4
    assert result.batch_size == 16 and result.sequential_prefetch
    assert result.gpu_needed_bytes <= result.gpu_available_bytes


def test_weights_that_do_not_fit_under_the_cap_are_read_from_disk(tmp_path):
    result = plan(tmp_path, cpu_gib=120, max_cpu_memory_gb=14)
    assert result.placement == "disk" and result.device == "cpu"
    assert result.cpu_needed_bytes <= 14 * GIB < BF16_BYTES
    assert 0 <= result.weights_in_memory_bytes <= 14 * GIB - result.cpu_needed_bytes
    assert result.offload_folder == str(tmp_path / f".out.offload-{__import__('os').getpid()}")
    assert any("read from disk layer by layer" in note for note in result.notes)


def test_each_stage_reads_from_disk_through_a_fresh_folder_of_its_own(tmp_path):
    """compressed-tensors names offloaded files by id(), which children of one forkserver reuse:
    calibration and verify (and each round of a target search) must not share a folder."""
    users = tmp_path / "users-offload"
    users.mkdir()
    (users / "keep.bin").write_text("not ours")
    disk = plan(tmp_path, cpu_gib=120, max_cpu_memory_gb=14).model_copy(
        update={"offload_folder": str(users)}
    )
    with (
        stage_offload_folder(disk, "calibrate") as first,
        stage_offload_folder(disk, "verify") as second,
    ):
        folders = [Path(first.offload_folder), Path(second.offload_folder)]
        assert folders[0] != folders[1] and all(f.parent == users and f.is_dir() for f in folders)
        assert [f.name[:7] for f in folders] == ["calibra", "verify-"]
        (folders[0] / "ct_disk_cache_0_1.safetensors").write_text("offloaded")
    assert sorted(p.name for p in users.iterdir()) == ["keep.bin"]
    in_memory = plan(tmp_path, cpu_gib=120)
    with stage_offload_folder(in_memory, "verify") as same:
        assert same is in_memory


def test_a_plan_that_fits_nowhere_is_refused_with_the_numbers_and_the_fix(tmp_path):
    with pytest.raises(ResourceError) as raised:
        plan(tmp_path, cpu_gib=6, max_cpu_memory_gb=6)
    message = str(raised.value)
    assert message.startswith("calibration.max_cpu_memory_gb: calibrating meta-llama/Llama-3.1-8B")
    assert "cached activations 8.00 GiB for 524288 tokens" in message
    assert "but the plan may use 6.00 GiB" in message
    assert "Fix: fewer calibration tokens (dataset.text_samples, dataset.max_seq_len)" in message


def test_without_a_cap_the_refusal_points_at_the_calibration_data(tmp_path):
    with pytest.raises(ResourceError, match=r"^dataset\.text_samples: .* needs 13\.15 GiB"):
        plan(tmp_path, cpu_gib=8, batch_size=1)


def test_fewer_tokens_make_the_same_worker_fit(tmp_path):
    result = plan(tmp_path, cpu_gib=8, dataset=data(samples=64, tokens=512))
    assert result.placement == "disk"


def test_the_automatic_batch_never_cuts_more_than_2_percent_of_the_tokens(tmp_path):
    uneven = [64 + (i * 37) % 1984 for i in range(256)]  # 64 to 2047 tokens, all different
    result = make_plan(
        model_8b(tmp_path),
        render(RecipeArgs(recipe="W4A16")),
        data(),
        CalibrationArgs(),
        LLAMA_8B,
        Config(),
        tmp_path / "out",
        120 * GIB,
        78 * GIB,
        uneven,
    )
    chosen = result.batch_size
    assert 1 < chosen < 16
    assert truncated_share(uneven, chosen) <= 0.02 < truncated_share(uneven, 2 * chosen)
    assert truncated_share([256] * 64, 16) == 0.0


def test_the_batch_shrinks_to_what_the_gpu_holds_and_a_users_batch_is_kept(tmp_path):
    small_gpu = plan(tmp_path, cpu_gib=120, gpu_gib=12)
    assert small_gpu.batch_size < 16 and small_gpu.gpu_needed_bytes <= 12 * GIB
    assert plan(tmp_path, cpu_gib=120, gpu_gib=78, batch_size=3).batch_size == 3
    assert not plan(
        tmp_path, cpu_gib=120, gpu_gib=78, sequential_prefetch="off"
    ).sequential_prefetch


@pytest.mark.parametrize(
    "recipe, scheme",
    [
        ("FP8_DYNAMIC", "FP8_DYNAMIC"),
        (
            "- QuantizationModifier: {targets: Linear, scheme: FP8_BLOCK, ignore: [lm_head]}",
            "FP8_BLOCK",
        ),
        ("W4A16", None),  # GPTQ calibrates on data
        ("- QuantizationModifier: {targets: Linear, scheme: FP8}", None),  # static activations
        # Data-free, but int8 from model_free_ptq does not reload: it failed verification.
        ("- QuantizationModifier: {targets: Linear, scheme: W8A8}", None),
        (
            "- QuantizationModifier: {targets: Linear, scheme: FP8_DYNAMIC, kv_cache_scheme: "
            "{num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}}",
            None,
        ),
    ],
)
def test_model_free_runs_only_what_it_can_run_as_written(recipe, scheme):
    found, _, why_not = model_free_spec(render(RecipeArgs(recipe=recipe)))
    assert found == scheme
    assert bool(why_not) == (scheme is None)


def test_forcing_model_free_on_a_recipe_that_needs_data_is_refused(tmp_path):
    with pytest.raises(ResourceError, match=r"^calibration.path: .*calibrates on data"):
        plan(tmp_path, cpu_gib=120, path="model_free")


def test_validate_shows_the_plan_for_this_machine(tiny_model):
    report = validate(model={"model_id": str(tiny_model)}, recipe={"recipe": "FP8_DYNAMIC"})
    row = next(check for check in report.checks if check.name == "memory")
    assert row.detail.startswith("model_free path: FP8_DYNAMIC shard by shard on cpu")


def test_a_cap_nothing_fits_under_is_refused_by_validate_without_weights(tiny_model, tmp_path):
    with pytest.raises(ResourceError) as raised:
        validate(
            model={"model_id": str(tiny_model)},
            dataset={"text_samples": 16, "max_seq_len": 64},
            output={"save_directory": str(tmp_path / "out")},
            calibration={"max_cpu_memory_gb": 1},
        )
    message = str(raised.value)
    assert message.startswith("calibration.max_cpu_memory_gb: calibrating ")
    assert "but the plan may use 1.00 GiB" in message and "Fix:" in message
    assert not (tmp_path / "out").exists()


def test_a_cpu_worker_calibrates_one_sample_per_batch_unless_asked(tmp_path):
    """Batching buys no speed on CPU and costs memory (docs/benchmarks/memory-plan.md); asked for,
    it runs."""
    automatic = plan(tmp_path, cpu_gib=120)
    assert (automatic.device, automatic.batch_size) == ("cpu", 1)
    assert any("computed on CPU" in note for note in automatic.notes)
    assert plan(tmp_path, cpu_gib=120, batch_size=8).batch_size == 8


# Llama-3.1-8B, 256 x 2048 tokens, GPTQ, batches prefetched: batch 16 plans 27.23 GiB of GPU
# memory, batch 8 15.11 GiB, batch 1 4.50 GiB (CUDA context, a layer, its Hessians, two batches).


def test_a_gpu_cap_lowers_the_batch_and_the_notes_say_what_it_costs(tmp_path):
    free = plan(tmp_path, cpu_gib=120, gpu_gib=78.7)
    capped = plan(tmp_path, cpu_gib=120, gpu_gib=78.7, max_gpu_memory_gb=20)
    assert (free.batch_size, capped.batch_size) == (16, 8)
    assert capped.gpu_needed_bytes <= capped.gpu_budget_bytes == 20 * GIB and capped.gpu_capped
    assert capped.gpu_batch_one_bytes == free.gpu_batch_one_bytes < capped.gpu_needed_bytes
    cap = "the 20.00 GiB cap (calibration.max_gpu_memory_gb, below 90% of the 78.70 GiB free)"
    assert capped.notes[-2:] == [
        f"batch 16 would need 27.23 GiB of GPU memory, over {cap}",
        f"batch 8: 15.11 GiB planned GPU peak, +10.61 GiB over batch 1, within {cap}",
    ]
    assert free.notes[-1] == (
        "batch 16: 27.23 GiB planned GPU peak, +22.73 GiB over batch 1, within 90% of the "
        "78.70 GiB free"
    )
    assert "GPU 15.11 GiB of 20.00 GiB; batch 8" in capped.summary()
    assert memory_line(capped) == (
        "- **Calibration memory**: classic path, weights on gpu, computed on cuda; "
        f"{capped.notes[-1]}\n"
    )


def test_without_a_cap_the_plan_keeps_to_its_share_of_the_free_gpu_memory(tmp_path):
    """Batch 16 (27.23 GiB) fits in 29 GiB free, not in 90% of it: batch 8 is planned."""
    assert GPU_SHARE == 0.9
    result = plan(tmp_path, cpu_gib=120, gpu_gib=29)
    assert result.batch_size == 8 and not result.gpu_capped
    assert result.gpu_needed_bytes <= result.gpu_budget_bytes == int(GPU_SHARE * 29 * GIB)
    assert "batch 16 would need 27.23 GiB of GPU memory, over 90% of the 29.00 GiB free" in (
        result.notes
    )
    above = plan(tmp_path, cpu_gib=120, gpu_gib=29, max_gpu_memory_gb=29)
    assert above.batch_size == 8 and not above.gpu_capped
    assert above.notes[0] == (
        "calibration.max_gpu_memory_gb (29.00 GiB) is above 90% of the 29.00 GiB free: the plan "
        "keeps to 26.10 GiB"
    )


def test_a_gpu_cap_not_even_batch_1_fits_under_is_refused_with_the_need_and_the_fix(tmp_path):
    with pytest.raises(ResourceError) as raised:
        plan(tmp_path, cpu_gib=120, gpu_gib=78.7, max_gpu_memory_gb=4)
    error = raised.value
    assert error.field == "calibration.max_gpu_memory_gb"
    assert "at batch 1 needs 4.50 GiB of GPU memory (CUDA context 1.00 GiB" in error.problem
    assert error.problem.endswith(
        "but the plan may fill the 4.00 GiB cap (calibration."
        "max_gpu_memory_gb, below 90% of the 78.70 GiB free)"
    )
    assert error.fix.startswith("raise calibration.max_gpu_memory_gb to 4.6 or more; or set ")
    assert "calibration.sequential_prefetch to off" in error.fix
    # A batch the user fixed is refused at that batch, pointing at a smaller one too.
    with pytest.raises(ResourceError) as raised:
        plan(tmp_path, cpu_gib=120, gpu_gib=78.7, max_gpu_memory_gb=5, batch_size=4)
    assert "at batch 4 needs 9.05 GiB" in raised.value.problem
    assert "set calibration.batch_size lower, or to 0" in raised.value.fix
    # Without a cap, a GPU too small for batch 1 asks for a bigger one.
    with pytest.raises(ResourceError) as raised:
        plan(tmp_path, cpu_gib=120, gpu_gib=4)
    assert raised.value.field == "dataset.max_seq_len"
    assert raised.value.fix.startswith("run where the GPU has 5.00 GiB free or more")


def test_a_gpu_cap_on_a_worker_without_a_gpu_is_noted_and_nonsense_is_refused(tmp_path):
    """One deployment's parameters run on every worker of its pool: a GPU cap is met on a CPU
    worker, so it is noted there rather than refused. 0 is no cap (as for CPU memory: a form
    field is never `X | None`); below 0, inf or nan is refused before any check runs."""
    result = plan(tmp_path, cpu_gib=120, max_gpu_memory_gb=4)
    assert (result.device, result.gpu_budget_bytes) == ("cpu", 0)
    assert result.notes[0].startswith("calibration.max_gpu_memory_gb does not apply: this worker")
    assert memory_line(result).endswith("computed on cpu; batch 1\n")
    assert plan(tmp_path, cpu_gib=120, gpu_gib=78.7, max_gpu_memory_gb=0).gpu_budget_bytes == int(
        GPU_SHARE * 78.7 * GIB
    )
    for nonsense in (-2, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="calibration.max_gpu_memory_gb"):
            validate(model={"model_id": "m"}, calibration={"max_gpu_memory_gb": nonsense})


def test_model_free_computes_on_cpu_when_the_gpu_budget_is_too_small(tmp_path):
    result = plan(tmp_path, cpu_gib=120, gpu_gib=78.7, recipe="FP8_DYNAMIC", max_gpu_memory_gb=0.5)
    assert (result.path, result.device, result.gpu_needed_bytes) == ("model_free", "cpu", 0)
    assert result.notes[0].startswith("model_free computes on cpu: 1.00 GiB (the CUDA context and")
    on_gpu = plan(tmp_path, cpu_gib=120, gpu_gib=78.7, recipe="FP8_DYNAMIC")
    assert on_gpu.device == "cuda"
    assert on_gpu.notes[-1].startswith("shard by shard: 1.00 GiB planned GPU peak, within 90%")
