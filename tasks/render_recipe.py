"""Render recipe: any accepted recipe form becomes one validated llm-compressor recipe.

The engine (load, placeholders, migrations, validation) is `compressflow.recipes`; this stage
runs it, caches the result across runs and logs what it rendered.
"""

from __future__ import annotations

from prefect import task

from compressflow.logs import run_logger
from compressflow.params import RecipeArgs
from compressflow.recipes.render import render
from compressflow.reporting import tracking
from compressflow.results import RenderedRecipe
from compressflow.runtime.isolation import in_child
from compressflow.store.caching import CACHE_EXPIRATION, LocalSourceAware


@task(
    name="render recipe",
    # Reused across runs (a warm rerun skips importing llm-compressor to re-validate); a recipe
    # file edited in place changes the key through its stat signature.
    cache_policy=LocalSourceAware(),
    cache_expiration=CACHE_EXPIRATION,
    persist_result=True,
)
def render_recipe(args: RecipeArgs) -> RenderedRecipe:
    """Render, validate and log the recipe; RecipeError says what to fix before any model loads."""
    rendered = in_child(render, args)  # validating imports llm-compressor
    log = run_logger(__name__)
    log.info(
        "Recipe from %s: %s, scheme %s, pipeline %s (sha256 %s)",
        rendered.source,
        ", ".join(rendered.modifiers),
        rendered.scheme,
        rendered.pipeline,
        rendered.sha256[:12],
    )
    for note in rendered.notes:
        log.warning("Recipe migrated: %s", note)
    tracking.log_result(rendered)
    return rendered
