"""Which GPUs this host has, and the Prefect concurrency slots that share them between runs.

Runs that share a GPU host each take a slot from a Prefect global concurrency limit per device
(`<host>:gpu:0`, `<host>:gpu:1`..., limit 1 each; the host's name keeps hosts sharing one server
apart) from their first calibration to the end of verify, and their processes see only those
GPUs: two runs on a one-GPU host run one after the other, and a run on a host with a free GPU
takes that one. A host's worker takes one run per GPU (`worker_limit`), so the pool spreads runs
over the hosts with free GPUs. Detection does not import torch (the flow's own process stays
light): an operator's COMPRESSFLOW_GPU_DEVICES, else CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`.
A host with none takes no slot, and neither does a run whose GPUs a scheduler gave it alone
(COMPRESSFLOW_GPU_SLOTS=false: a Kubernetes pod).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from compressflow.errors import CalibrationError
from compressflow.logs import run_logger
from compressflow.settings import HELD_GPUS as HELD
from compressflow.settings import settings

POLL_SECONDS = 2.0  # between rounds of trying every slot while all are busy
_NVIDIA_SMI_GPU = re.compile(r"^GPU (\d+):", re.M)


def devices() -> list[str]:
    """The GPU indices (or UUIDs) calibrations on this host may use; empty on a CPU host."""
    configured = settings().gpu_devices.strip()
    if configured:
        return [] if configured.lower() == "none" else _listed(configured)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _listed(visible)
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):  # no NVIDIA driver: a CPU host
        return []
    return _NVIDIA_SMI_GPU.findall(listing.stdout) if listing.returncode == 0 else []


def _listed(text: str) -> list[str]:
    listed = [part.strip() for part in text.split(",") if part.strip()]
    # CUDA stops at the first invalid entry (-1 is the usual way to hide every GPU).
    return listed[: listed.index("-1")] if "-1" in listed else listed


def slot_name(device: str) -> str:
    """`<prefix>gpu:<device>`; the prefix is the host's name unless the operator set one."""
    return f"{settings().gpu_slot_prefix}gpu:{device}"


def worker_limit() -> int:
    """How many runs this host's worker takes at once (`prefect worker start --limit`): one per
    GPU, so a full host leaves further runs in the pool's queue for a host with a free GPU
    instead of taking them to wait on its slots. One on a host with none: CPU calibrations
    beside each other fight for its cores (a demo calibration took 18 s alone, 232 s beside
    another run on 2 cores)."""
    return max(len(devices()), 1)


def refuse_too_few(gpus: int, host: list[str] | None = None) -> None:
    """CalibrationError when this host has fewer GPUs than calibration.gpus asks for."""
    host = devices() if host is None else host
    if gpus <= 1 or len(host) >= gpus:
        return
    has = f"{len(host)} ({', '.join(host)})" if host else "none"
    raise CalibrationError(
        "calibration.gpus",
        f"calibration.gpus is {gpus}, but this host's GPUs for calibration are {has}",
        f"set calibration.gpus to {max(len(host), 1)} or less, or run on a host with {gpus} GPUs "
        "(COMPRESSFLOW_GPU_DEVICES or CUDA_VISIBLE_DEVICES may be hiding some)",
    )


def refuse_fewer_samples(gpus: int, samples: int | None) -> None:
    """CalibrationError when calibration.gpus ranks cannot each have a calibration sample: each
    rank calibrates on its own share (compressflow.calibration.ranks.rank_share)."""
    if gpus <= 1 or samples is None or samples >= gpus:
        return
    raise CalibrationError(
        "calibration.gpus",
        f"calibration.gpus is {gpus}, but the dataset has {samples} sample(s): each GPU "
        "calibrates on its own share of them, and a GPU with none has nothing to calibrate on",
        f"set calibration.gpus to {samples} or less, or calibrate on more samples "
        "(dataset.text_samples)",
    )


def ensure_limits(host: list[str]) -> None:
    """Create a limit of 1 for each device's slot that the Prefect server does not have yet.

    An operator's own limit (created beforehand, or changed since) is left as it is.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        for device in host:
            try:
                client.read_global_concurrency_limit_by_name(slot_name(device))
            except ObjectNotFound:
                try:
                    limit = GlobalConcurrencyLimitCreate(name=slot_name(device), limit=1)
                    client.create_global_concurrency_limit(limit)
                except ObjectAlreadyExists:  # another run on this host created it just now
                    pass


def _free(host: list[str]) -> list[str]:
    """The devices whose slot looks free now: only those are tried (Prefect logs every refusal
    as an error, which would fill the worker's log every few seconds while a run waits)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limits = [client.read_global_concurrency_limit_by_name(slot_name(d)) for d in host]
    return [d for d, limit in zip(host, limits, strict=True) if limit.active_slots < limit.limit]


def _take(stack: ExitStack, device: str) -> bool:
    """Hold `device`'s slot in `stack` if it is free now; False without waiting if another run
    took it since `_free` looked."""
    import httpx
    from prefect.concurrency.sync import concurrency

    try:
        stack.enter_context(
            concurrency(
                slot_name(device),
                occupy=1,
                max_retries=0,  # busy: answer now, the caller tries the next device
                strict=True,  # a missing limit is an error, not a slot for everyone
                raise_on_lease_renewal_failure=False,  # a lost API call must not end hours of work
            )
        )
    except Exception as exc:  # Prefect wraps the API's answer; 423 Locked: the slot is taken
        answer = exc.__cause__
        if isinstance(answer, httpx.HTTPStatusError) and answer.response.status_code == 423:
            return False
        raise
    return True


@contextmanager
def shown_to_children(held: list[str]) -> Iterator[None]:
    """While the block runs, this process's children see only `held`: CUDA_VISIBLE_DEVICES in
    its environment, which every stage's child gets (compressflow.runtime.isolation), and
    `HELD` for a `gpu_slots` inside the block. A flow process runs one flow run (the process
    worker starts one per run), so its environment is the run's; the flow process itself never
    starts CUDA."""
    before = {name: os.environ.get(name) for name in (HELD, "CUDA_VISIBLE_DEVICES")}
    os.environ[HELD] = os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(held)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def gpu_slots(
    gpus: int, timeout_seconds: float | None, purpose: str = "calibration"
) -> Iterator[list[str]]:
    """Hold `gpus` free devices' slots while the block runs; the devices held (none on a CPU host).

    Every device is tried without waiting; when fewer than `gpus` are free, what was taken is
    given back (two runs holding half each would wait for each other) and all are tried again
    every few seconds, for at most `timeout_seconds` (None: no limit). The slots are released
    when the block ends, however it ends; a process that dies loses its lease in 5 minutes.
    While they are held, every stage's child sees only these devices (`shown_to_children`): a
    verification or an evaluation never loads onto a GPU another run calibrates on. Inside a
    block that holds them already (the compress flow holds its GPUs from the first calibration
    to the end of verify; its calibrate task asks again), the held devices are the answer.
    """
    if (held := os.environ.get(HELD)) is not None:
        yield _listed(held)[:gpus]
        return
    host = devices()
    if not host:
        yield []
        return
    refuse_too_few(gpus, host)
    if not settings().gpu_slots:  # the run's GPUs are its own (a pod's): nothing to share
        with shown_to_children(host[:gpus]):
            yield host[:gpus]
        return
    ensure_limits(host)
    log = run_logger(__name__)
    names = ", ".join(slot_name(device) for device in host)
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    waiting = False
    while True:
        with ExitStack() as held_slots:
            chosen: list[str] = []
            for device in _free(host):
                if len(chosen) < gpus and _take(held_slots, device):
                    chosen.append(device)
            if len(chosen) == gpus:
                taken = ", ".join(slot_name(device) for device in chosen)
                log.info(
                    "Holding %s for %s (CUDA_VISIBLE_DEVICES=%s)", taken, purpose, ",".join(chosen)
                )
                try:
                    with shown_to_children(chosen):
                        yield chosen
                finally:
                    held_slots.close()
                    log.info("Released %s", taken)  # after the release: a waiting run may start
                return
        if not waiting:
            bound = f"at most {timeout_seconds / 60:g} min" if timeout_seconds else "no limit"
            log.info("Waiting for %d free slot(s) of %s (%s)", gpus, names, bound)
            waiting = True
        if deadline is not None and time.monotonic() > deadline:
            raise CalibrationError(
                "calibration.timeout_minutes",
                f"no {gpus} of {names} came free within {timeout_seconds / 60:g} min: other "
                "runs on this host held them",
                "run again later, raise calibration.timeout_minutes, or add GPU hosts to the "
                "work pool",
            )
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":  # the worker line's `--limit "$(python -m compressflow.runtime.gpus)"`
    print(worker_limit())
