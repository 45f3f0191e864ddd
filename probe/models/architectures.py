"""Every per-architecture fact probe keeps, in one place (house rule 4: knowledge as data).

Where each architecture keeps its attention modules (``ATTENTION_LAYOUTS``); where it keeps W_V
and W_O (``VALUE_OUTPUT_LAYOUTS``: attn_norm, ALTI, GlobEnc) and its LayerNorms
(``MIXING_LAYOUTS``: ALTI, GlobEnc); which encoder-decoders' encoders the context-mixing measures
read (``SEQ2SEQ_TYPES``); which model types are causal LMs when their config says no more
(``CAUSAL_LM_TYPES``); which config and module attributes hold a layer's head count, head size
and position window (``HEAD_COUNT_ATTRIBUTES`` ...); and, from a loaded model's structure alone,
which context-mixing method runs on it (the contract states it). Nothing here runs a model.

The words in a module path that name a cross-attention are the capture's
(``probe.hooks.sites.CROSS_ATTENTION_WORDS``: the capture sits below this package and reads
them in its watched forward pass); the fallback layout below reads the same tuple.

Each entry maps a model type to the attention stacks it has. A stack is a name (``encoder``,
``decoder``, ``cross``) and a regular expression over module paths whose first group is the layer
index. Paths are matched with ``re.search``, so the prefix a head class adds (``bert.``, ``model.``,
``transformer.``) does not matter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.hooks.sites import CROSS_ATTENTION_WORDS

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

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

#: model types read as causal LMs when neither the config's ``architectures`` nor ``is_decoder``
#: say so (and never taken for a headless encoder)
CAUSAL_LM_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")

#: where a layer's query-head count and head size are read: the attention module's attributes
#: first, then its config's (the module's own config, else the model's); the first one set wins
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_heads")
CONFIG_HEAD_COUNT_ATTRIBUTES = ("num_attention_heads", "n_head")
HEAD_DIM_ATTRIBUTES = ("head_dim", "attention_head_size", "key_value_proj_dim")
#: config attributes that bound the positions a model reads (the smallest positive one, and the
#: tokenizer's ``model_max_length``, bound the window)
MAX_POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length")
#: positions assumed where neither config nor tokenizer sets a window (T5: relative positions,
#: no hard window; 512 is what it was trained on)
DEFAULT_MAX_POSITIONS = 512


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
        if any(word in lowered for word in CROSS_ATTENTION_WORDS):
            stack = "cross"
        elif "encoder" in lowered:
            stack = "encoder"
        else:
            stack = "decoder"
        found.setdefault((stack, layer), path)
    return renumber(found)


def renumber(found: dict[tuple[str, int], str]) -> dict[tuple[str, int], str]:
    """Layers 0..n-1 per stack, in the order of the indices found; the stacks in the order first found
    (the model's module order: not a set's, which changes from process to process)."""
    out: dict[tuple[str, int], str] = {}
    for stack in dict.fromkeys(s for s, _ in found):
        for own, (_, layer) in enumerate(sorted(k for k in found if k[0] == stack)):
            out[(stack, own)] = found[(stack, layer)]
    return out


def find_attention_modules(model: torch.nn.Module) -> dict[tuple[str, int], str]:
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


# --------------------------------------------------------------------------- W_V, W_O and the norms


@dataclass(frozen=True)
class ValueOutputLayout:
    """Where an architecture keeps W_V and W_O, relative to the attention module of the contract.

    Paths are dotted, ``^`` steps up to the parent. ``value_chunk`` = (index, chunks) picks the
    value part of a fused projection (GPT-2's c_attn holds q, k, v). Whether a module is a Linear
    ([out, in] weight) or a transformers Conv1D ([in, out]) is read from the module itself.
    """

    value: str
    output: str
    value_chunk: tuple[int, int] = (0, 1)


_BERT_LIKE = ValueOutputLayout(value="value", output="^.output.dense")
_LLAMA_LIKE = ValueOutputLayout(value="v_proj", output="o_proj")
_BART_LIKE = ValueOutputLayout(value="v_proj", output="out_proj")

#: House rule 4: per-architecture knowledge is data. Same layout for every stack of a model type.
VALUE_OUTPUT_LAYOUTS: dict[str, ValueOutputLayout] = {
    "bert": _BERT_LIKE,
    "roberta": _BERT_LIKE,
    "xlm-roberta": _BERT_LIKE,
    "electra": _BERT_LIKE,
    "distilbert": ValueOutputLayout(value="v_lin", output="out_lin"),
    "gpt2": ValueOutputLayout(value="c_attn", output="c_proj", value_chunk=(2, 3)),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "bart": _BART_LIKE,
    "mbart": _BART_LIKE,
    "marian": _BART_LIKE,
    "t5": ValueOutputLayout(value="v", output="o"),
}


def relative_path(path: str, relative: str) -> str:
    parts = path.split(".")
    for step in relative.split("."):
        if step == "^":
            parts.pop()
        else:
            parts.append(step)
    return ".".join(parts)


@dataclass(frozen=True)
class MixingLayout:
    """Where a layer's LayerNorms sit, relative to the attention module of the contract (``^`` = parent).

    ``placement``: ``post`` (ln1 normalises x + attention output: BERT) or ``pre`` (ln1 normalises
    the attention's input, ln2 the FFN's input; the residual stream itself is not normalised).
    """

    placement: str
    ln1: str
    ln2: str


_BERT_NORMS = MixingLayout("post", ln1="^.output.LayerNorm", ln2="^.^.output.LayerNorm")
_LLAMA_NORMS = MixingLayout("pre", ln1="^.input_layernorm", ln2="^.post_attention_layernorm")

#: House rule 4: per-architecture knowledge is data. Model types whose layer ALTI and GlobEnc decompose.
MIXING_LAYOUTS: dict[str, MixingLayout] = {
    "bert": _BERT_NORMS,
    "roberta": _BERT_NORMS,
    "xlm-roberta": _BERT_NORMS,
    "electra": _BERT_NORMS,
    "distilbert": MixingLayout("post", ln1="^.sa_layer_norm", ln2="^.output_layer_norm"),
    "llama": _LLAMA_NORMS,
    "mistral": _LLAMA_NORMS,
    "qwen2": _LLAMA_NORMS,
    "qwen3": _LLAMA_NORMS,
    "gemma": _LLAMA_NORMS,
    "gpt2": MixingLayout("pre", ln1="^.ln_1", ln2="^.ln_2"),
    # encoder-decoder: the encoder stack (the cross-attention hop is raw, see the module docstring)
    "bart": MixingLayout("post", ln1="^.self_attn_layer_norm", ln2="^.final_layer_norm"),
    "marian": MixingLayout("post", ln1="^.self_attn_layer_norm", ln2="^.final_layer_norm"),
    "mbart": MixingLayout("pre", ln1="^.self_attn_layer_norm", ln2="^.final_layer_norm"),
    "t5": MixingLayout("pre", ln1="^.layer_norm", ln2="^.^.1.layer_norm"),
}

#: model types whose encoder value zeroing reads (every other seq2seq model is refused)
SEQ2SEQ_TYPES = ("bart", "marian", "mbart", "t5")


def refuse_seq2seq(pm: ProbeModel, method: str) -> None:
    if pm.task.encoder_decoder and pm.contract.model_type not in SEQ2SEQ_TYPES:
        raise InputError(f"{method} is not defined for encoder-decoder model {type(pm.model).__name__} (model type "
                         f"{pm.contract.model_type!r}): probe knows the encoder layers of "
                         f"{', '.join(SEQ2SEQ_TYPES)} only")


def mixing_layout(pm: ProbeModel, method: str = "alti") -> MixingLayout:
    """The layout of ``pm``'s layers, or a one-line InputError naming the model class and what is missing."""
    refuse_seq2seq(pm, method)
    model_type = pm.contract.model_type
    layout = MIXING_LAYOUTS.get(model_type)
    if layout is None or model_type not in VALUE_OUTPUT_LAYOUTS:
        raise InputError(f"{method} does not know the LayerNorms and value/output projections of "
                         f"{type(pm.model).__name__} (model type {model_type!r}): supported model types are "
                         f"{', '.join(sorted(MIXING_LAYOUTS))}")
    return layout


def context_mixing_support(pm: ProbeModel, method: str) -> str | None:
    """None when the decomposition ``method`` (ALTI, GlobEnc: they read the LayerNorms and the
    value/output projections) runs on ``pm``, else why not (one line)."""
    try:
        mixing_layout(pm, method)
    except InputError as error:
        return str(error)
    return None


def attn_norm_support(pm: ProbeModel, method: str) -> str | None:
    """None when the attention norms (``method``: they read each layer's value and output
    projections) run on ``pm``, else why not (one line)."""
    if pm.contract.model_type not in VALUE_OUTPUT_LAYOUTS:
        return (f"{method} does not know where model type {pm.contract.model_type!r} keeps W_V and W_O: "
                f"supported are {', '.join(sorted(VALUE_OUTPUT_LAYOUTS))}")
    return None


def value_zeroing_support(pm: ProbeModel, method: str) -> str | None:
    """None when value zeroing (it reads only each layer's block output) runs on ``pm``, else why not."""
    try:
        refuse_seq2seq(pm, method)
        block_modules(pm, pm.contract.primary_stack)
    except InputError as error:
        return str(error)
    return None


def block_modules(pm: ProbeModel, stack: str) -> dict[int, torch.nn.Module]:
    """``{layer: the transformer block holding that layer's attention}``: the nearest ancestor of the
    attention module that is an item of a ModuleList (read from the model's own structure)."""
    modules = dict(pm.model.named_modules())
    out = {}
    for (s, layer), path in sorted(pm.contract.module_paths.items()):
        if s != stack:
            continue
        parts = path.split(".")
        found = None
        for cut in range(len(parts) - 1, 0, -1):
            if isinstance(modules.get(".".join(parts[: cut - 1])), torch.nn.ModuleList) and parts[cut - 1].isdigit():
                found = modules[".".join(parts[:cut])]
                break
        if found is None:
            raise InputError(f"value_zeroing cannot find the layer block of {path} in {type(pm.model).__name__}: "
                             "no ancestor of the attention module is an item of a ModuleList")
        out[layer] = found
    return out
