"""What the forkserver imports and builds once, so that no stage's child does it again.

Imported only in the forkserver (`isolation.PRELOAD`), never in the flow's process: the libraries,
compressflow's modules whose functions children run, and llm-compressor's modifier registry. Not
Prefect: no child needs it, and every child would carry its 70 MB
(`tests/unit/test_calibration_runs.py` checks it stays out). The registry is filled lazily by the
first recipe a process parses: it walks every modifier package and imports auto-round with it
(about 150 modules, 0.4 s). Filled here, every child that renders or checks a recipe starts with
it; left to the children, each paid it again (a run forks a dozen).
"""

import datasets  # noqa: F401
import llmcompressor  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import compressflow.calibration.run  # noqa: F401
import compressflow.data.build  # noqa: F401
import compressflow.data.text_sources  # noqa: F401
import compressflow.data.tokenizer  # noqa: F401
import compressflow.data.vision  # noqa: F401
import compressflow.evaluation.quality  # noqa: F401
import compressflow.evaluation.sensitivity  # noqa: F401
import compressflow.model.folder_checks.registry  # noqa: F401
import compressflow.model.hardware  # noqa: F401
import compressflow.model.loading  # noqa: F401
import compressflow.model.memory  # noqa: F401
import compressflow.model.streaming  # noqa: F401
import compressflow.model.tracing  # noqa: F401
import compressflow.recipes.render  # noqa: F401
import compressflow.store.disk_space  # noqa: F401
from compressflow import compat

compat.modifier_classes()
