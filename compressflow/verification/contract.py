"""What a staged output may differ from its source by, as the recipe's kinds allow
(compressflow/recipes/kinds.py): the transforms its config.json's transform_config declares, and
the experts expert pruning dropped. The tensor names check (names.py) and the reload (reload.py)
hold the output to it; anything else is refused, naming the tensor."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from compressflow.model.modules import Modules
from compressflow.recipes.kinds import EXPERTS, Contract, contract_of
from compressflow.recipes.order import Touch, layers
from compressflow.results import RenderedRecipe

# Config keys of the expert count, as REAP reads them (reap/utils.py NUM_EXPERTS_CONFIG_KEYS).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts")
ROUTERS = ("gate", "router")  # REAP's ROUTER_ATTRS
_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<index>\d+)\.")


def recipe_contract(recipe: RenderedRecipe) -> Contract:
    """The rendered recipe's contract: from its YAML, else (no YAML kept) its modifiers' names."""
    found = contract_of(yaml.safe_load(recipe.yaml) or {})
    if found.kinds:
        return found
    return contract_of({"stage": {"default_modifiers": dict.fromkeys(recipe.modifiers, {})}})


def transform_of(name: str, declared: dict[str, list[dict]], modules: Modules) -> bool:
    """Whether tensor `name` is a transform's, `<module>.<group>_<location>.<param>`, of a source
    module the declaring entry's targets (less its ignore) match."""
    owner = name.rsplit(".", 1)[0]
    module, _, transform = owner.rpartition(".")
    for entry in declared.get(transform, []):
        touch = Touch("", "", _listed(entry.get("targets")), _listed(entry.get("ignore")))
        if module in modules and module in layers(touch, {module: modules[module]}):
            return True
    return False


def _listed(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value or ())


@dataclass
class Experts:
    """What expert pruning may have changed: each MoE layer's expert count before and after,
    and what is out of contract."""

    key: str | None = None  # config.json's expert count key
    kept: dict[str, int] = field(default_factory=dict)  # MoE layer -> experts kept
    before: dict[str, int] = field(default_factory=dict)  # MoE layer -> the source's
    problems: list[str] = field(default_factory=list)

    def dropped(self, name: str) -> bool:
        """Whether source tensor `name` belongs to an expert the output may lack."""
        match = _EXPERT.match(name)
        return bool(match) and int(match["index"]) >= self.kept.get(match["layer"], 1 << 30)

    def rows(self, name: str) -> int | None:
        """The first dimension a router tensor (or fused experts tensor) of a pruned layer must
        have: the kept experts; None for other tensors."""
        layer, _, leaf = name.rpartition(".")
        parent, _, holder = layer.rpartition(".")
        if holder in ROUTERS and parent in self.kept:
            return self.kept[parent]
        if leaf == "e_score_correction_bias" and layer in self.kept:
            return self.kept[layer]
        if holder == "experts" and parent in self.kept:  # fused: [experts, ...]
            return self.kept[parent]
        return None

    def summary(self) -> str:
        pruned = {layer for layer in self.kept if self.kept[layer] != self.before[layer]}
        counts = sorted({(self.before[x], self.kept[x]) for x in pruned})
        return (
            f"{len(pruned)} MoE layer(s) pruned "
            + ", ".join(f"{a} -> {b} experts" for a, b in counts)
            + f" (config.json {self.key})"
        )


def expert_pruning(
    contract: Contract, original: dict, saved: dict, source_config: dict, config: dict
) -> Experts:
    """The experts each MoE layer (a module holding `experts` and a router) may keep: the
    source's count less `int(count x share)` (REAP's; rounded to whole groups for a
    group-limited router) where expert pruning touched it, all of them elsewhere; and the
    output's config.json count, which must agree with every layer."""
    found = Experts()
    if EXPERTS not in contract.allows:
        return found
    source_text = source_config.get("text_config") or source_config
    text = config.get("text_config") or config
    found.key = next((k for k in EXPERT_COUNT_KEYS if isinstance(source_text.get(k), int)), None)
    counts: dict[str, int] = {}
    for name in original:
        if match := _EXPERT.match(name):
            counts[match["layer"]] = max(counts.get(match["layer"], 0), int(match["index"]) + 1)
    parts = [name.rsplit(".", 2) for name in original]
    routed = {p[0] for p in parts if len(p) == 3 and p[1] in ROUTERS}
    total = source_text.get(found.key) if found.key else None
    for layer in sorted(counts.keys() & routed):
        found.before[layer] = counts[layer]
        found.kept[layer] = counts[layer] - (
            dropped_experts(counts[layer], contract.expert_share, source_text.get("n_group"))
            if contract.prunes(layer)
            else 0
        )
    if found.key is None or total is None:
        found.problems.append(
            f"the source's config.json names no expert count ({', '.join(EXPERT_COUNT_KEYS)})"
        )
    elif found.kept and {text.get(found.key)} != set(found.kept.values()):
        found.problems.append(
            f"config.json {found.key} is {text.get(found.key)!r}, but the MoE layers keep "
            f"{sorted(set(found.kept.values()))} experts (of {total})"
        )
    return found


def dropped_experts(count: int, share: float, groups: Any) -> int:
    """How many experts REAP drops of `count` at `share` (reap/base.py on_initialize)."""
    drop = int(count * share)
    if isinstance(groups, int) and groups > 0:
        drop = round(drop / groups) * groups
    return drop
