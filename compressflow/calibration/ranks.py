"""Which samples one rank of a multi-GPU calibration takes, and which rank this process is.

torchrun starts the ranks (compressflow.runtime.rank, compressflow.runtime.distributed); what
each calibrates on is calibration's to say.
"""

from __future__ import annotations


def rank_share(samples: int, rank: int, world: int) -> range:
    """The calibration samples rank `rank` of `world` calibrates on: a contiguous share, the
    first `samples % world` ranks one more. llm-compressor's distributed oneshot reduces the
    modifiers' statistics (GPTQ's Hessians) across ranks, so every sample counts once; given
    all samples each, every rank would repeat the whole calibration."""
    size, extra = divmod(samples, world)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


def this_rank() -> tuple[int, int]:
    """(rank, world size) in a torchrun job; (0, 1) in a single calibration process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
