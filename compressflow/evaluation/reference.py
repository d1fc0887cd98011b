"""The base model's reference logits: the texts they are taken on, and the refusal of a source
whose logits are not finite.

Calibrate captures them before oneshot changes the model in place; on the model-free path, which
leaves the source as it is, verify takes them in the same forward as the compressed model's
(compressflow/verification/logits.py). Either way a source with NaN or inf is refused, naming the
tensor, rather than the compression being blamed for it.
"""

from __future__ import annotations

from pathlib import Path

from compressflow.data.local_text import verification_texts
from compressflow.errors import ModelFetchError
from compressflow.params import VerifyArgs
from compressflow.results import FetchedModel


def reference_samples(processor, verify: VerifyArgs) -> list[list[int]]:
    """The token ids of the verification texts, each cut to `verify.max_seq_len`."""
    tokenizer = getattr(processor, "tokenizer", processor)
    return [
        ids[: verify.max_seq_len]
        for ids in tokenizer(verification_texts(verify.samples))["input_ids"]
    ]


def first_non_finite(tensors) -> str | None:
    """The name of the first (name, tensor) holding NaN or inf, in slices (no full-size mask)."""
    import torch

    for name, tensor in tensors:
        if tensor.is_floating_point() and not all(
            torch.isfinite(part).all() for part in tensor.detach().reshape(-1).split(1 << 24)
        ):
            return name
    return None


def source_tensors(folder: Path):
    """Every tensor of a safetensors checkpoint, one at a time."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def non_finite_source(
    model: FetchedModel, tensor: str | None, found: str = "before calibration"
) -> ModelFetchError:
    where = f"in tensor {tensor}" if tensor else "in its logits on the verification texts"
    return ModelFetchError(
        "model.model_id",
        f"the SOURCE model {model.model_id} has non-finite values (NaN or inf) {where}, found "
        f"{found}; no compression of it can work",
        "use another checkpoint or revision of the model (download it again if the file may be "
        "damaged)",
    )


def refuse_non_finite(logits: list, source: FetchedModel, found: str = "before calibration"):
    """Raise `non_finite_source` when the base model's logits hold NaN or inf; the checkpoint
    (read again only then) names the tensor."""
    import torch

    if not all(torch.isfinite(rows).all() for rows in logits):
        tensor = first_non_finite(source_tensors(Path(source.path)))
        raise non_finite_source(source, tensor, found)
