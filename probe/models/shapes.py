"""Random-weight models in the shapes of real 7-8B checkpoints, built from configurations written here,
so that nothing is downloaded (issue 64: what probe costs at the size people audit).

Each :data:`SHAPES` entry holds the numbers of one checkpoint's ``config.json`` (the checkpoint itself is
never read): Llama-3-8B, Mistral-7B v0.1 (its sliding window of 4,096 tokens; v0.3 has none and a
vocabulary of 32,768) and Qwen2-7B (biases on the query, key and value projections). The weights are
transformers' random initialisation, so the models predict nothing sensible: they are for seconds and
memory, never for a verdict.

:func:`shape_model` builds one on a device in a dtype (bf16 by default) as a :class:`ProbeModel`, through
:func:`probe.models.loading.wrap_model`, the path every in-memory model takes. Three things may be cut for a
machine that cannot hold the whole model, and each cut is written into the model's name and metadata:
``layers`` (fewer decoder layers of the true width), ``heads`` (fewer query heads at the true head width
and grouped-query ratio: the hidden size and the MLP shrink in proportion) and ``vocab`` (a smaller
vocabulary). The tokenizer is a word-level one over ``w<i>`` words whose special ids (pad 0, bos 1,
eos 2) replace the checkpoint's; every text :func:`shape_texts` makes reads as exactly the asked number
of tokens. :func:`parameter_count` counts a configuration's parameters without building it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING

from probe.errors import InputError

if TYPE_CHECKING:  # loading this module imports neither torch nor transformers
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

    from probe.models.core import ProbeModel

__all__ = ["SHAPES", "Shape", "parameter_count", "shape_config", "shape_label", "shape_model", "shape_texts"]

#: the word-level tokenizer's special tokens and their ids
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One checkpoint's architecture numbers, as its ``config.json`` gives them."""
    name: str
    checkpoint: str  # whose config.json these are; never loaded
    model_type: str  # transformers' model_type: llama, mistral, qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    sliding_window: int | None = None
    note: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def group(self) -> int:
        """Query heads per key/value head (the grouped-query ratio)."""
        return self.heads // self.kv_heads


SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama3-8b", "meta-llama/Meta-Llama-3-8B", "llama", hidden=4096, layers=32, heads=32,
                       kv_heads=8, intermediate=14336, vocab=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                       max_positions=8192),
    "mistral-7b": Shape("mistral-7b", "mistralai/Mistral-7B-v0.1", "mistral", hidden=4096, layers=32, heads=32,
                        kv_heads=8, intermediate=14336, vocab=32000, rope_theta=10000.0, rms_norm_eps=1e-5,
                        max_positions=32768, sliding_window=4096,
                        note="v0.1: a sliding window of 4,096 tokens (v0.3 has none and 32,768 tokens)"),
    "qwen2-7b": Shape("qwen2-7b", "Qwen/Qwen2-7B-Instruct", "qwen2", hidden=3584, layers=28, heads=28, kv_heads=4,
                      intermediate=18944, vocab=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      max_positions=32768, note="query, key and value projections with biases"),
}


def _shape(name: str) -> Shape:
    if name not in SHAPES:
        raise InputError(f"unknown model shape {name!r}: valid are {', '.join(SHAPES)}")
    return SHAPES[name]


def _bounded(value: int | None, full: int, what: str) -> int:
    if value is None:
        return full
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= full:
        raise InputError(f"{what} must be an integer from 1 to {full}, got {value!r}")
    return value


def shape_config(name: str, *, layers: int | None = None, heads: int | None = None,
                 vocab: int | None = None) -> PretrainedConfig:
    """The transformers configuration of shape ``name`` (a key of :data:`SHAPES`), optionally cut to
    ``layers`` decoder layers, ``heads`` query heads (a multiple of the grouped-query ratio; the head
    width stays, the hidden size and the MLP shrink with the heads) and a ``vocab`` of that many tokens."""
    from transformers import AutoConfig

    shape = _shape(name)
    n_layers = _bounded(layers, shape.layers, "layers")
    n_heads = _bounded(heads, shape.heads, "heads")
    if n_heads % shape.group:
        raise InputError(f"heads must be a multiple of {name}'s grouped-query ratio {shape.group}, got {n_heads}")
    hidden = n_heads * shape.head_dim
    window = {"sliding_window": shape.sliding_window} if shape.sliding_window is not None else {}
    return AutoConfig.for_model(
        shape.model_type, hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=n_heads // shape.group, head_dim=shape.head_dim,
        intermediate_size=round(shape.intermediate * n_heads / shape.heads),
        vocab_size=_bounded(vocab, shape.vocab, "vocab"), rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.max_positions, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": shape.rope_theta},
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, **window)


def parameter_count(config: PretrainedConfig) -> int:
    """The parameters of a Llama-layout decoder (llama, mistral, qwen2) with ``config``, counted from its
    numbers without building it: embedding, per layer the attention projections (with Qwen2's query, key
    and value biases, or Llama's ``attention_bias``), the gated MLP and two RMSNorms, the final norm and
    the output head (unless tied)."""
    d, vocab, inner = config.hidden_size, config.vocab_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = d * q + 2 * d * kv + q * d
    if config.model_type == "qwen2":
        attention += q + 2 * kv
    elif getattr(config, "attention_bias", False):
        attention += q + 2 * kv + d
    mlp = 3 * d * inner + (2 * inner + d if getattr(config, "mlp_bias", False) else 0)
    layer = attention + mlp + 2 * d
    head = 0 if config.tie_word_embeddings else vocab * d
    return vocab * d + config.num_hidden_layers * layer + d + head


def shape_label(name: str, *, layers: int | None = None, heads: int | None = None, vocab: int | None = None) -> str:
    """``shape:NAME`` with each cut said: ``shape:llama3-8b (2 of 32 layers; vocab 32,000 of 128,256)``."""
    shape = _shape(name)
    cuts = []
    if layers is not None and layers != shape.layers:
        cuts.append(f"{layers} of {shape.layers} layers")
    if heads is not None and heads != shape.heads:
        cuts.append(f"{heads} of {shape.heads} query heads, hidden {heads * shape.head_dim:,} of {shape.hidden:,}")
    if vocab is not None and vocab != shape.vocab:
        cuts.append(f"vocab {vocab:,} of {shape.vocab:,}")
    return f"shape:{name}" + (f" ({'; '.join(cuts)})" if cuts else "")


def _word_tokenizer(vocab: int, max_length: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=max_length)


def shape_model(name: str, *, layers: int | None = None, heads: int | None = None, vocab: int | None = None,
                device: str | None = "cpu", dtype: str | None = "bf16", attn_implementation: str = "eager",
                seed: int = 0) -> ProbeModel:
    """A random-weight causal LM of shape ``name`` (cut as :func:`shape_config` says), built directly on
    ``device`` in ``dtype`` with transformers' initialisation under ``seed``, as a :class:`ProbeModel`
    named by :func:`shape_label` (its metadata: the shape, the checkpoint, the cuts, the full shape's
    parameter count)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from probe.models.loading import check_dtype_on_device, resolve_device, resolve_dtype, wrap_model

    started = time.perf_counter()
    config = shape_config(name, layers=layers, heads=heads, vocab=vocab)
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    check_dtype_on_device(torch_dtype, torch_device)
    torch.manual_seed(seed)
    with torch.device(torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
    label = shape_label(name, layers=layers, heads=heads, vocab=vocab)
    pm = wrap_model(model, _word_tokenizer(config.vocab_size, config.max_position_embeddings), name=label,
                    task="causal_lm")
    shape = _shape(name)
    metadata = {"shape": name, "checkpoint": shape.checkpoint, "random_weights": True, "seed": seed,
                "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                "vocab": config.vocab_size, "parameters": parameter_count(config),
                "full_parameters": parameter_count(shape_config(name)), "note": shape.note}
    return dataclasses.replace(pm, metadata=metadata, load_seconds=time.perf_counter() - started)


def shape_texts(pm: ProbeModel, tokens: int, n: int = 1, seed: int = 0) -> list[str]:
    """``n`` texts of random words that ``pm``'s word-level tokenizer (a :func:`shape_model`'s) reads as
    exactly ``tokens`` ids, the begin-of-sequence token included."""
    if tokens < 2:
        raise InputError(f"tokens must be at least 2 (the begin-of-sequence token and a word), got {tokens}")
    draw = random.Random(seed)
    top = len(pm.tokenizer)
    return [" ".join(f"w{draw.randrange(len(SPECIAL_TOKENS), top)}" for _ in range(tokens - 1)) for _ in range(n)]
