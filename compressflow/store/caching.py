"""Cache policy for the stages worth reusing across runs: model fetch and dataset build.

Prefect's DEFAULT policy keys on the run id, so nothing is reused between runs. Keying on inputs
alone is wrong the other way for local sources: a model folder or data file edited in place keeps
its path. `LocalSourceAware` therefore keys on the inputs, the task's source, the code and
library identity and a cheap stat signature (path, size, mtime, ctime, inode) of every local
path found among the inputs (`compressflow.store.identity.cache_key`, where every key is
computed). A model in object storage is keyed by one listing of its prefix (each object's size
and etag), so a prefix written since is fetched again. The stage itself then records a content
identity (a hash), so a cache hit is still traceable in the manifest.

Cached results point at folders on disk; the flow's stage runner refreshes an entry whose folder
was deleted, so a cleaned cache never surfaces as a confusing error downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext

from compressflow.model.args import ModelArgs, is_store_uri
from compressflow.store.identity import cache_key
from compressflow.store.sources import listing_key

# Unpinned hub revisions ("main") are re-resolved after this long; pinned ones never change.
CACHE_EXPIRATION = timedelta(days=7)


@dataclass
class LocalSourceAware(CachePolicy):
    """INPUTS + TASK_SOURCE + `code_identity()`, plus the stat signature of local paths among
    the inputs. No fields: Prefect pickles the policy, and the identity is per process."""

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        base = (INPUTS + TASK_SOURCE).compute_key(task_ctx, inputs, flow_parameters, **kwargs)
        if base is None:
            return None
        stores = []
        for value in inputs.values():  # a model in object storage: keyed by what it holds now
            if isinstance(value, ModelArgs) and is_store_uri(value.model_id):
                key = listing_key(value.model_id, value.storage_credentials)
                if key is None:  # not listed: no cached result, the stage runs and says why
                    return None
                stores.append(key)
        return cache_key(base, inputs, tuple(stores))
