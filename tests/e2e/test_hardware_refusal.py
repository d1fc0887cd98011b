"""What the worker's hardware cannot run (AWQ without an accelerator) is refused by the flow
before fetching or calibrating; `validate`'s refusal is in tests/unit/test_recipe_migrations.py.
"""

from __future__ import annotations

import pytest
from support.recipes import AWQ

from compressflow.errors import RecipeError
from compressflow.params import RecipeArgs


@pytest.mark.usefixtures("prefect_harness")
def test_the_flow_refuses_awq_before_fetching_or_calibrating(
    tiny_model, tmp_path, monkeypatch, no_accelerator
):
    from compressflow.flows import checks
    from compressflow.flows.compress import compress
    from compressflow.params import DatasetArgs, ModelArgs, OutputArgs

    reached = []
    monkeypatch.setattr(checks, "fetch_model", lambda *args: reached.append("fetch"))
    with pytest.raises(RecipeError, match="AWQModifier .* needs a CUDA GPU worker"):
        compress(
            model=ModelArgs(model_id=str(tiny_model)),
            dataset=DatasetArgs(dataset_name="python_docs", text_samples=8, max_seq_len=64),
            recipe=RecipeArgs(recipe=AWQ),
            output=OutputArgs(save_directory=str(tmp_path / "out")),
        )
    assert reached == [] and not (tmp_path / "out").exists()
