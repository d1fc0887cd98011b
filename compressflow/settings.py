"""The `COMPRESSFLOW_*` environment, read in one place.

Settings describe the worker, not a run: where outputs and caches go, how long to wait for
another writer, which modules user code may be imported from. They are read when used (not at
import), so a deployment's `job_variables.env` or a test's environment takes effect.
"""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Where `make vllm-env` builds the vLLM environment, beside the project's own .venv; its stamp is
# written once vLLM imports, so a half-built environment is not taken for one.
PROJECT_VLLM = Path(__file__).resolve().parent.parent / ".venv-vllm"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COMPRESSFLOW_", extra="ignore")

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
        default=6 * 3600, gt=0, description="How long a run waits for another writer of its output."
    )
    allowed_imports: str = Field(
        default="",
        description="Comma-separated module prefixes user loaders and collators may come from.",
    )
    tracking: bool = Field(default=True, description="0 turns ClearML tracking off everywhere.")
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
        default=900, gt=0, description="How long vLLM may take to load and score both models."
    )

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


def settings() -> Settings:
    return Settings()


def cache_root() -> Path:
    """Where compressflow keeps built datasets: $COMPRESSFLOW_CACHE_DIR or ~/.cache/compressflow."""
    return settings().cache_dir.expanduser()
