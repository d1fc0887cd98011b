"""Verification: proves a staged checkpoint is what a server will load, and still the base model.

It reloads the checkpoint from disk the way a server does and checks, cheapest first:

1. quantization config: `config.json` carries a compressed-tensors `quantization_config`, and
   its format is not `dense` when the recipe quantizes (a dense save means the weights were not
   packed: same size as the original, and vLLM reads it as unquantized); then the tokenizer fits:
   every id the saved tokenizer can produce is a row of the saved embedding (vocab.py);
2. tensor names: every saved tensor belongs to a module of the source checkpoint, and every
   source tensor is still there (vLLM's loaders map checkpoints by the source's names), except
   those transformers does not load (old `rotary_emb.inv_freq` buffers, tied copies); a tensor
   saved under a source name has the source's shape (read from the headers: a reload of a
   compressed-tensors checkpoint does not report a wrong-shaped norm or weight, and the
   model-free path's one pass uses the source's copies of the unquantized tensors);
3. reload: transformers loads it with no missing, unexpected or mismatched keys (a missing key is
   silently initialised at random);
4. logits: on held-out texts its next-token logits agree with the base model's, captured before
   calibration (or, on the model-free path, which leaves the source as it is, in the same
   forward as the compressed model's) (cosine, KL, top-1 against `verify` thresholds);
5. vllm: vLLM, the server it is made for, loads it and scores the same texts close to the base
   model served the same way (compressflow/model/serving.py); run last, it takes seconds to a
   minute. A host whose vLLM build lacks the scheme's kernel records "not checked here".

A model-free run is also checked weight by weight (6. weights: every quantized weight, dequantized,
is close to the source's). Its reference, weights and logits checks share one forward of the
source read from disk, each sample in it twice and each FP8 Linear computing the second copy with
the output's weight: the source and the output are read once each. Its reload then checks the keys
on the meta device, from the safetensors headers, reading no weight again (a full reload would read
the output a second time and, with a forward, decompress it to disk and read it back). A run whose
weights were read from disk reloads with its weights on disk the same way, so verifying needs no
more memory than calibrating.

A failure raises VerificationError naming the check, the numbers and the fix; the flow then
publishes nothing. Either way the results go to the log, ClearML and a Prefect artifact.

Each check is one module here holding its `CHECK`: its name, the field a failure blames, the fix,
and its function, which takes the verification's state (`Verifying`: the staged output, the
source, the plan and what earlier checks handed on) and returns what it found, or None where it
does not apply to this run. `registry.CHECKS` lists them in the order they run; `run.run_checks`
prepares the state and runs them in the verify stage's child process (tasks/verify.py is the
stage's Prefect face). A new check is a module beside these and one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The slices' own modules, not the params / results facades: those import this package's
# vocabulary, which runs this file first.
from compressflow.model.result import FetchedModel, MemoryPlan
from compressflow.recipes.result import RenderedRecipe
from compressflow.verification.args import VerifyArgs
from compressflow.verification.result import ServingCheck, VerificationCheck


@dataclass
class Verifying:
    """One verification: its inputs, and what a check hands on to the checks after it."""

    staging: Path  # the output, staged
    model: FetchedModel  # the source
    recipe: RenderedRecipe
    plan: MemoryPlan
    args: VerifyArgs
    reference: dict | None = None  # input_ids and the base's logits on them
    one_pass: Any = None  # model-free: the source's and the output's logits in one forward
    loaded: Any = None  # the reloaded output, until the logits check has read it
    figures: dict = field(default_factory=dict)  # the logits check's, for the result
    served: ServingCheck | None = None  # what vLLM's check measured
    checks: list[VerificationCheck] = field(default_factory=list)  # recorded so far


@dataclass(frozen=True)
class Check:
    """One verify check: the name its `VerificationCheck` carries, the parameter a failure points
    at ("recipe" stands for the one the user gave the recipe in: recipe.preset or recipe.recipe),
    what to do about it, and the function that runs it on a `Verifying` (None: not this run)."""

    name: str
    field: str
    fix: str
    function: Callable[[Verifying], VerificationCheck | None]
