"""The `COMPRESSFLOW_*` environment, read in one place.

Settings describe the worker, not a run: where outputs and caches go, how long to wait for
another writer, which modules user code may be imported from. They are read when used (not at
import), so a deployment's `job_variables.env` or a test's environment takes effect.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COMPRESSFLOW_", extra="ignore")

    output_dir: Path = Field(
        default=Path("outputs"),
        description="Root of default save directories (<output_dir>/<model>-<scheme>).",
    )
    cache_dir: Path = Field(
        default=Path("~/.cache/compressflow"), description="Where built datasets are kept."
    )
    lock_timeout_seconds: float = Field(
        default=6 * 3600, gt=0, description="How long a run waits for another writer of its output."
    )
    allowed_imports: str = Field(
        default="",
        description="Comma-separated module prefixes user loaders and collators may come from.",
    )
    tracking: bool = Field(default=True, description="0 turns ClearML tracking off everywhere.")
    max_data_mb: int = Field(
        default=1024,
        gt=0,
        description="Most MiB of local calibration data (a file, or a folder's data files "
        "together) read before refusing: calibration draws hundreds of samples, not a corpus.",
    )

    def allowed_import_prefixes(self) -> list[str]:
        return [p.strip() for p in self.allowed_imports.split(",") if p.strip()]


def settings() -> Settings:
    return Settings()
