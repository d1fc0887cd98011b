"""The parameter groups `validate` takes, on the tiny model's weightless variants (the `models`
fixture), for the unit tests of the checks and the CLI's own process."""

from __future__ import annotations


def params(models, tmp_path, model=None, dataset=None, recipe=None, output=None, target=None):
    return dict(
        model={"model_id": models["plain"], **(model or {})},
        dataset={
            "dataset_name": "python_docs",
            "text_samples": 8,
            "max_seq_len": 64,
            **(dataset or {}),
        },
        recipe={"recipe": "W4A16", **(recipe or {})},
        output={"save_directory": str(tmp_path / "out"), **(output or {})},
        **({"target": target} if target else {}),
    )
