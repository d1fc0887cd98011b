"""One rank of a multi-GPU calibration: what torchrun starts (`python -m compressflow.runtime.rank DIR`).

compressflow.runtime.distributed writes the job into DIR (a folder of its own) and listens on a
socket there. Each rank sends what it prints to DIR/rank-N.log (the launcher keeps its tail: a
rank's last words if it dies), joins the process group, and runs the job's function with the same
protocol as a single-process calibration (compressflow.runtime.isolation.serve): its logs and
events over the socket, then its result or its exception.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
from contextlib import AbstractContextManager, nullcontext
from multiprocessing.connection import Client
from pathlib import Path


def join_process_group() -> AbstractContextManager:
    """Join the job's process group as torchrun's RANK / LOCAL_RANK / WORLD_SIZE say; the context
    the job's model loads in.

    On a GPU host, what llm-compressor's distributed oneshot asks of each rank: compressed-tensors'
    `init_dist` (NCCL, this rank's GPU), and `load_offloaded_model`, under which the job's
    `from_pretrained` loads the weights once and shares them instead of once per rank. Without a
    GPU, gloo and a plain load: enough for the launch, not for oneshot (FIELD_NOTES).
    """
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        from compressed_tensors.offload import init_dist, load_offloaded_model

        init_dist()
        return load_offloaded_model()
    dist.init_process_group(backend="gloo")
    return nullcontext()


def main(folder: Path) -> None:
    rank = int(os.environ["RANK"])
    log = os.open(folder / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()  # a native crash's stack goes to the log before the signal ends it
    with open(folder / "job.pickle", "rb") as file:
        address, authkey = pickle.load(file)
        conn = Client(address, family="AF_UNIX", authkey=authkey)
        conn.send(("hello", (rank, os.getpid())))
        target, args = pickle.load(file)  # imports the target's module: after the hello

    from compressflow.runtime.isolation import serve

    loading = join_process_group()
    try:
        with loading:
            serve(conn, target, args)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
