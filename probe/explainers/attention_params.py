"""The parameters every attention explainer records: which stack, the target query, the heads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def attention_params(pm: ProbeModel, stack: str, **extra: Any) -> dict:
    """``params`` of an attention explainer's TokenScores on ``stack``, plus ``extra``."""
    info = pm.contract.stacks[stack]
    return {
        "stack": stack,
        "target_query": pm.task.target_query_note,
        "n_layers": info.n_layers,
        "n_heads": info.n_heads,
        "kv_head_of_query": list(info.kv_head_of_query),
        "implementation": pm.contract.implementation,
        "padding": "never scored (cut off)",
        **({"maps": info.maps} if not info.softmax else {}),
        **({"layer_maps": list(info.layer_maps), "layer_heads": list(info.layer_heads)} if info.layer_maps else {}),
        **extra,
    }
