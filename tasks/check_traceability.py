"""Check traceability: traces the model on the meta device before any weights are loaded."""

from __future__ import annotations

from pydantic import BaseModel


class TraceReport(BaseModel):
    checked: bool
    subgraphs: int | None = None
    seconds: float = 0.0
    reason: str = ""
