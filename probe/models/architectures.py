"""Where each architecture keeps its attention modules (house rule 4: knowledge as data).

Each entry maps a model type to the attention stacks it has. A stack is a name (``encoder``,
``decoder``, ``cross``) and a regular expression over module paths whose first group is the layer
index. Paths are matched with ``re.search``, so the prefix a head class adds (``bert.``, ``model.``,
``transformer.``) does not matter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Stacks, in the order reports list them.
STACK_ORDER = ("encoder", "decoder", "cross")


@dataclass(frozen=True)
class StackPattern:
    stack: str
    pattern: str  # regex; group 1 is the layer index


_ENCODER_BERT = (StackPattern("encoder", r"(?:^|\.)layer\.(\d+)\.attention\.self$"),)
_DECODER_LLAMA = (StackPattern("decoder", r"(?:^|\.)layers\.(\d+)\.self_attn$"),)
_SEQ2SEQ_BART = (
    StackPattern("encoder", r"encoder\.layers\.(\d+)\.self_attn$"),
    StackPattern("decoder", r"decoder\.layers\.(\d+)\.self_attn$"),
    StackPattern("cross", r"decoder\.layers\.(\d+)\.encoder_attn$"),
)

ATTENTION_LAYOUTS: dict[str, tuple[StackPattern, ...]] = {
    "bert": _ENCODER_BERT,
    "roberta": _ENCODER_BERT,
    "xlm-roberta": _ENCODER_BERT,
    "electra": _ENCODER_BERT,
    "distilbert": (StackPattern("encoder", r"(?:^|\.)layer\.(\d+)\.attention$"),),
    "gpt2": (StackPattern("decoder", r"(?:^|\.)h\.(\d+)\.attn$"),),
    "llama": _DECODER_LLAMA,
    "mistral": _DECODER_LLAMA,
    "qwen2": _DECODER_LLAMA,
    "qwen3": _DECODER_LLAMA,
    "gemma": _DECODER_LLAMA,
    "phi3": _DECODER_LLAMA,
    "bart": _SEQ2SEQ_BART,
    "mbart": _SEQ2SEQ_BART,
    "marian": _SEQ2SEQ_BART,
    "t5": (
        StackPattern("encoder", r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention$"),
        StackPattern("decoder", r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention$"),
        StackPattern("cross", r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$"),
    ),
}

# Models whose attention cannot be read through the attention interface at all.
UNSUPPORTED: dict[str, str] = {}


def _generic_layout(named_modules) -> dict[tuple[str, int], str]:
    """Fallback for unknown model types: modules named like attention blocks with a layer index.

    A module qualifies when its class name ends in ``Attention`` and it has an integer
    ``layer_idx``; the stack is guessed from its path (``encoder``/``decoder`` prefix, cross-attention
    by the words ``cross`` or ``encoder_attn``).
    A module without an integer ``layer_idx`` (BART-like encoders, ALBERT) takes the last number in
    its path. Layers are then renumbered 0..n-1 per stack in that order, so a hybrid model's attention
    layers are keyed by their own index, not the model's.
    """
    found: dict[tuple[str, int], str] = {}
    for path, module in named_modules:
        if not type(module).__name__.endswith("Attention"):
            continue
        if any(other.startswith(path + ".") and type(m).__name__.endswith("Attention") for other, m in named_modules):
            continue  # keep the innermost attention module (BertAttention wraps BertSelfAttention)
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            numbers = re.findall(r"\.(\d+)(?:\.|$)", path)
            if not numbers:
                continue
            layer = int(numbers[-1])
        lowered = path.lower()
        if "cross" in lowered or "encoder_attn" in lowered or "encdec" in lowered:
            stack = "cross"
        elif "encoder" in lowered:
            stack = "encoder"
        else:
            stack = "decoder"
        found.setdefault((stack, layer), path)
    return renumber(found)


def renumber(found: dict[tuple[str, int], str]) -> dict[tuple[str, int], str]:
    """Layers 0..n-1 per stack, in the order of the indices found."""
    out: dict[tuple[str, int], str] = {}
    for stack in {s for s, _ in found}:
        for own, (_, layer) in enumerate(sorted(k for k in found if k[0] == stack)):
            out[(stack, own)] = found[(stack, layer)]
    return out


def find_attention_modules(model) -> dict[tuple[str, int], str]:
    """Return ``{(stack, layer): module path}`` for every attention module of ``model``."""
    model_type = getattr(model.config, "model_type", "")
    named = list(model.named_modules())
    patterns = ATTENTION_LAYOUTS.get(model_type)
    if patterns is None:
        return _generic_layout(named)
    found: dict[tuple[str, int], str] = {}
    for pattern in patterns:
        regex = re.compile(pattern.pattern)
        for path, _ in named:
            match = regex.search(path)
            if match:
                found[(pattern.stack, int(match.group(1)))] = path
    return renumber(found)
