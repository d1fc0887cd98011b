"""The `COMPRESSFLOW_*` environment, read in one place.

Settings describe the worker, not a run: where outputs and caches go, how long to wait for
another writer, which modules user code may be imported from. They are read when used (not at
import), so a deployment's `job_variables.env` or a test's environment takes effect.

A worker's environment is an input like any parameter, typed by hand into a work pool's job
variables or a shell: `settings()` turns a value its field refuses into a SettingsError naming the
variable, and `check_settings` (the first of a run's checks) also refuses a COMPRESSFLOW_ name no
setting has, a misspelt one as a rule, and a cache folder no run could write. An empty folder
setting means unset, as `VAR=` does in a shell or a pod spec: not the current folder.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from compressflow.errors import SettingsError, closest

PREFIX = "COMPRESSFLOW_"
# The devices a process holds GPU slots of, set by compressflow.runtime.gpus for its children:
# never by hand, and no setting.
HELD_GPUS = f"{PREFIX}HELD_GPUS"
# What CUDA_VISIBLE_DEVICES takes: an index, or a GPU or MIG instance's UUID.
_DEVICE = re.compile(r"^(\d+|-1|(GPU|MIG)-[\w-]+)$")

# Where `make vllm-env` builds the vLLM environment, beside the project's own .venv; its stamp is
# written once vLLM imports, so a half-built environment is not taken for one.
PROJECT_VLLM = Path(__file__).resolve().parent.parent / ".venv-vllm"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore")

    output_dir: Path = Field(
        default=Path("outputs"),
        description="Root of default save directories (<output_dir>/<model>-<scheme>).",
    )
    cache_dir: Path = Field(
        default=Path("~/.cache/compressflow"), description="Where built datasets are kept."
    )
    compile_cache_dir: Path | None = Field(
        default=None,
        description="Where code torch compiled for a run that ended well is kept for the next "
        "(compressflow.model.compile_cache); unset: <cache_dir>/torch-compile.",
    )
    lock_timeout_seconds: float = Field(
        default=6 * 3600,
        gt=0,
        allow_inf_nan=False,
        description="How long a run waits for another writer of its output.",
    )
    allowed_imports: str = Field(
        default="",
        description="Comma-separated module prefixes user loaders and collators may come from.",
    )
    tracking: bool = Field(default=True, description="0 turns ClearML tracking off everywhere.")
    threads: int | None = Field(
        default=None,
        gt=0,
        le=1024,
        description="Threads every computing child runs; unset: this worker's CPUs shared among "
        "the children computing at the moment (compressflow.model.cpus).",
    )
    checkpoint_retention_days: float = Field(
        default=7,
        ge=0,
        allow_inf_nan=False,
        description="Calibration checkpoints nothing has saved into for this many days are "
        "deleted when a calibration starts: a crashed run that is never rerun would otherwise "
        "leave a copy of its model's weights in the cache for good.",
    )
    max_data_mb: int = Field(
        default=1024,
        gt=0,
        description="Most MiB of local calibration data (a file, or a folder's data files "
        "together) read before refusing: calibration draws hundreds of samples, not a corpus.",
    )

    gpu_devices: str = Field(
        default="",
        description="Comma-separated GPU indices this host's calibrations may use (e.g. 0,1), "
        "'none' for none; empty: CUDA_VISIBLE_DEVICES, else what `nvidia-smi -L` lists.",
    )
    gpu_slots: bool = Field(
        default=True,
        description="Take a gpu:N concurrency slot per GPU while calibrating; false where the "
        "scheduler already gives each run GPUs of its own (a Kubernetes pod, a container).",
    )
    gpu_slot_prefix: str = Field(
        # Per host by default: every host has a gpu:0, and hosts sharing one Prefect server must
        # not wait for each other's. A host's name never holds a character Prefect refuses.
        default_factory=lambda: f"{socket.gethostname()}:",
        pattern=r"^[^/%&><]*$",  # characters Prefect refuses in a limit's name
        description="Put before each GPU's concurrency-limit name (<prefix>gpu:0); default: "
        "this host's name and a colon, so hosts sharing one Prefect server keep their slots "
        "apart. Set the same prefix on hosts (or containers) that share GPUs; empty: gpu:0...",
    )

    vllm_python: str = Field(
        default="",
        description="Python of a vLLM environment (the serving image's, or the one `make "
        "vllm-env` builds) that verify and evaluate-model serve outputs with; empty: the "
        "project's .venv-vllm when it exists; 'off': none.",
    )
    vllm_timeout_seconds: float = Field(
        default=900,
        gt=0,
        allow_inf_nan=False,
        description="How long vLLM may take to load and score both models.",
    )

    @field_validator("output_dir", "cache_dir", "compile_cache_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value, info):
        if isinstance(value, str) and not value.strip():
            return cls.model_fields[info.field_name].get_default()
        return value

    @field_validator("gpu_devices")
    @classmethod
    def _devices(cls, value: str) -> str:
        listed = [part.strip() for part in value.split(",") if part.strip()]
        if value.strip().lower() != "none" and (bad := [p for p in listed if not _DEVICE.match(p)]):
            raise ValueError(
                f"{', '.join(map(repr, bad))} is not a GPU index (0, 1...) or UUID (GPU-..., "
                "MIG-...)"
            )
        return value

    def vllm_python_path(self) -> Path | None:
        """The vLLM environment's Python; None when none is configured or it is not there."""
        if self.vllm_python.lower() == "off":
            return None
        if not self.vllm_python:
            built = (PROJECT_VLLM / ".installed").exists()
            return PROJECT_VLLM / "bin" / "python" if built else None
        path = Path(self.vllm_python).expanduser()
        return path if path.is_file() else None

    def vllm_missing_reason(self) -> str:
        if self.vllm_python.lower() == "off":
            return "no vLLM environment (COMPRESSFLOW_VLLM_PYTHON is off)"
        if self.vllm_python:
            return (
                f"no vLLM environment (COMPRESSFLOW_VLLM_PYTHON={self.vllm_python} is not a file)"
            )
        return (
            "no vLLM environment configured: run `make vllm-env` (builds .venv-vllm) or set "
            "COMPRESSFLOW_VLLM_PYTHON to a vLLM environment's Python"
        )

    def allowed_import_prefixes(self) -> list[str]:
        return [p.strip() for p in self.allowed_imports.split(",") if p.strip()]


def variable(field: str) -> str:
    return f"{PREFIX}{field.upper()}"


def settings() -> Settings:
    """This worker's settings; a SettingsError naming every variable its field refuses."""
    try:
        return Settings()
    except ValidationError as error:
        wrong = {str(problem["loc"][0]): problem["msg"] for problem in error.errors()}
        values = {field: given(variable(field)) for field in wrong}
        raise SettingsError(
            ", ".join(map(variable, wrong)),
            "; ".join(
                f"{values[field] if len(wrong) == 1 else f'{variable(field)}={values[field]}'}: "
                f"{message}"
                for field, message in wrong.items()
            ),
            "in the worker's environment (the work pool's job_variables.env, or the shell that "
            "starts the worker), correct or unset " + "; ".join(map(described, wrong)),
        ) from None


def given(name: str) -> str:
    """The value a variable was set to, as read (case aside), shortened for a message."""
    value = next((v for k, v in os.environ.items() if k.upper() == name), "")
    return repr(value if len(value) <= 80 else f"{value[:60]}... ({len(value):,} characters)")


def described(field: str) -> str:
    """`COMPRESSFLOW_X` (what it sets; default D), for a fix."""
    info = Settings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    description = info.description.rstrip(".")
    if default in (None, ""):  # the description says what unset means where it means something
        return f"{variable(field)} ({description}{'' if 'unset' in description else '; default unset'})"
    return f"{variable(field)} ({description}; default {default})"


def check_settings() -> Settings:
    """The worker's settings, refused before a run does anything: a value a field refuses, a
    COMPRESSFLOW_ name no setting has (a misspelt name would be ignored: the run would go on
    with the default its user meant to change), and a cache folder no run could write."""
    found = settings()
    known = {variable(field) for field in Settings.model_fields}
    for name in sorted(os.environ):
        if name.upper().startswith(PREFIX) and name.upper() not in {*known, HELD_GPUS}:
            raise SettingsError(
                name,
                "no compressflow setting has this name, so its value would be ignored",
                f"{closest(name.upper(), sorted(known))}rename it to a setting docs/deployments.md "
                "lists (Worker settings), or unset it",
            )
    cache = found.cache_dir.expanduser().absolute()
    existing = next(folder for folder in (cache, *cache.parents) if os.path.lexists(folder))
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "may not be written by this user"
        raise SettingsError(
            variable("cache_dir"),
            f"{cache} {'' if existing == cache else f'lies under {existing}, which '}{what}: "
            "no dataset could be built there",
            f"set {variable('cache_dir')} to a folder this worker's user may write, or unset it "
            "for ~/.cache/compressflow",
        )
    check_temp_dir()
    return found


# The stages' children start from multiprocessing's forkserver, whose socket is
# <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX (32 bytes after the temporary folder), and a Unix socket's
# path holds at most 108 bytes: a longer TMPDIR failed the run at its start with a bare
# "OSError: AF_UNIX path too long".
UNIX_SOCKET_PATH_BYTES, FORKSERVER_SOCKET_BYTES = 108, 32


def check_temp_dir() -> None:
    """Refuse a temporary folder too long for the forkserver's socket, naming TMPDIR."""
    temp = tempfile.gettempdir()
    longest = UNIX_SOCKET_PATH_BYTES - FORKSERVER_SOCKET_BYTES
    if len(os.fsencode(temp)) > longest:
        raise SettingsError(
            "TMPDIR",
            f"the temporary folder {temp} is {len(os.fsencode(temp))} bytes long: the socket the "
            "stages' child processes start from lies in it, and a Unix socket's path may hold "
            f"{UNIX_SOCKET_PATH_BYTES} bytes",
            f"set TMPDIR to a folder of at most {longest} bytes (e.g. /tmp), or unset it",
        )


def cache_root() -> Path:
    """Where compressflow keeps built datasets: $COMPRESSFLOW_CACHE_DIR or ~/.cache/compressflow."""
    return settings().cache_dir.expanduser()
