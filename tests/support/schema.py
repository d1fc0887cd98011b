"""The deployments of prefect.yaml, and what the Prefect UI shows of a parameter's description:
read by the schema's unit tests and by the end-to-end tests against a server."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]


def with_required(schema: dict, parameters: dict) -> dict:
    """`parameters` plus a placeholder model for required ones the run or trigger supplies."""
    missing = {name: {"model_id": "org/model"} for name in schema.get("required", [])}
    return {**missing, **parameters}


def visible_text(markdown: str) -> str:
    """What the UI shows of a description: its markdown rendered, HTML tags dropped."""
    from markdown_it import MarkdownIt

    html = MarkdownIt().render(markdown)
    text = re.sub(r"<[^>]*>", "", html)
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&#39;", "'")):
        text = text.replace(entity, char)
    return " ".join(text.replace("&amp;", "&").split())


def plain_text(markdown: str) -> str:
    """The description's words, markdown markup removed: what must survive rendering."""
    text = re.sub(r"^- ", "", markdown, flags=re.M).replace("**", "").replace("`", "")
    return " ".join(text.split())
