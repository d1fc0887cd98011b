"""AutoRound with an automatic batch size publishes a verified model (it crashed the run), and
compiles into the run's own cache, never the host's shared one.

AutoRound compiles with torch.compile: about a minute, like the preset matrix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.processes import assert_compiled_code_kept, host_compile_cache, kept_compiled
from support.reload_check import assert_published_model_matches_base

from compressflow.errors import CompressflowError
from compressflow.params import RecipeArgs


@pytest.mark.usefixtures("prefect_harness")
def test_auto_round_with_many_samples_publishes_a_verified_model(tiny_model, tmp_path):
    from compressflow.flows.compress import compress
    from compressflow.params import DatasetArgs, ModelArgs, OutputArgs
    from compressflow.store.manifest import read_manifest

    before = host_compile_cache()
    kept = kept_compiled()
    try:
        published = compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(text_samples=32, max_seq_len=32),
            recipe=RecipeArgs(preset="W4A16_AUTOROUND", recipe_args={"iters": 2}),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
        )
    except SystemExit as exc:  # what auto-round's sys.exit did to the run before
        pytest.fail(f"calibration ended the run with SystemExit({exc.code})")
    except CompressflowError as exc:
        pytest.fail(f"refused: {exc}")
    manifest = read_manifest(Path(published.path))
    assert manifest.verification.passed and published.compression_ratio > 1.5
    # The preset's matrix cell (test_cpu_presets.py leaves it to this run): it reloads.
    assert_published_model_matches_base(Path(published.path), tiny_model, "LlamaForCausalLM")
    assert manifest.memory_plan.batch_size == 1
    # AutoRound compiled into the run's own cache, which went with the run: a run killed while
    # compiling can no longer leave the host's shared cache broken for every later run.
    assert host_compile_cache() == before
    # What it compiled is kept for the next run: whole files of a run that ended well.
    assert_compiled_code_kept(kept)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
