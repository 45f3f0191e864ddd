"""The models layer's central types: :class:`ProbeModel` (a model, its tokenizer and its attention
contract), :class:`AttentionContract` and :class:`StackContract`, and the tokenisation a ProbeModel
does (:func:`encode_texts`).

At the bottom of :mod:`probe.models`: every other module here (and every layer above) may name
these types, and this module imports no other module of the package outside ``TYPE_CHECKING`` (but the
rank-0 :mod:`probe.errors` and :mod:`probe.tasks`), so
no annotation makes an import circle. Loading it imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from probe.errors import InputError, warn_at_caller
from probe.names import IMPLICIT_MAPS, SOFTMAX_MAPS
from probe.tasks import Task, task_named

if TYPE_CHECKING:  # imported for annotations only
    import torch
    from transformers import BatchEncoding, PreTrainedTokenizerBase

    from probe.hooks.sites import Site
    from probe.models.encoder import Pooling


@dataclass(frozen=True)
class StackContract:
    """One attention stack of a model (encoder, decoder or cross-attention) as probe reads it: its
    layers, query and key/value heads, head size, mask, and how its maps are reached."""

    stack: str  # encoder | decoder | cross
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int
    kv_head_of_query: tuple[int, ...]  # query head h reads key/value head kv_head_of_query[h]
    head_dim: int
    mask_kind: str  # bidirectional | causal | sliding_window(W) | cross (all encoder keys)
    module_class: str
    # how probe reaches the layers: "attention function" (the registry wrapper: reads any query rows,
    # recomputing them from query and key when the kernel returns none) or "probability module" (a
    # forward hook on the child that hands on the model's own [batch, head, query, key] probabilities:
    # full maps, as the model itself materialises them); both can edit
    capture_path: str = "attention function"
    can_edit: bool = True
    memory: str = "query rows asked for"
    sinks: bool = False  # an attention sink takes mass out of every row: rows sum to 1 minus it
    layer_heads: tuple[int, ...] = ()  # query heads per layer, where layers differ
    layer_head_dims: tuple[int, ...] = ()  # head dim per layer, where layers differ
    shared_layers: int = 0  # layers served by a module the model calls more than once per forward
    #: softmax (rows are probabilities) | implicit (a token mixer's matrix, probe.hooks.implicit: signed,
    #: rows need not sum to one, not editable) | hybrid (both, layer by layer: ``layer_maps``)
    maps: str = SOFTMAX_MAPS
    structure: str = ""  # a sparse pattern the maps live on (banded: window and global tokens), else ""
    #: softmax | implicit per layer, in model order, where a stack mixes them (a hybrid); () otherwise
    layer_maps: tuple[str, ...] = ()
    #: the class of the stack's implicit mixers (its module_class where every layer is one); "" for none
    mixer_class: str = ""

    def layer_kind(self, layer: int) -> str:
        """softmax | implicit: what layer ``layer``'s map is."""
        if self.layer_maps and 0 <= layer < len(self.layer_maps):
            return self.layer_maps[layer]
        return IMPLICIT_MAPS if self.implicit else SOFTMAX_MAPS

    @property
    def implicit(self) -> bool:
        """Every layer's map is a token mixer's implicit matrix (``maps`` implicit)."""
        return self.maps == IMPLICIT_MAPS

    @property
    def softmax(self) -> bool:
        """Every layer's map is a softmax (``maps`` softmax): no implicit matrix anywhere in the stack."""
        return maps_are_softmax(self.maps)

    def layer_implicit(self, layer: int) -> bool:
        """Layer ``layer``'s map is a token mixer's implicit matrix, not a softmax."""
        return self.layer_kind(layer) == IMPLICIT_MAPS

    def softmax_layers(self) -> tuple[int, ...]:
        """The layers of a hybrid (``layer_maps``) whose maps are a softmax; () for other stacks."""
        return tuple(i for i, kind in enumerate(self.layer_maps) if kind == SOFTMAX_MAPS)


def maps_are_softmax(maps: str | None) -> bool:
    """Whether a stack whose ``maps`` (the contract's word, as written to files; None: not given)
    are softmax rows in every layer."""
    return maps in (None, SOFTMAX_MAPS)


@dataclass(frozen=True, repr=False)
class AttentionContract:
    """What probe found out about a model's attention (``probe contract`` prints it): its task, each
    attention stack (:class:`~probe.models.core.StackContract`), the implementation, dtype, device and window, the
    special tokens, the weights left at random, and which context-mixing methods run on it.
    ``n_layers``, ``n_heads``, ``n_kv_heads`` and ``head_dim`` are those of the primary stack."""

    model_type: str
    task: Task
    stacks: dict[str, StackContract]
    implementation: str  # the attention implementation the model was loaded with
    dtype: str
    device: str
    max_positions: int
    padding_side: str
    special_tokens: tuple[str, ...]
    module_paths: dict[tuple[str, int], str] = field(repr=False, default_factory=dict)
    sites: dict[tuple[str, int], Site] = field(repr=False, default_factory=dict)  # how each layer is read
    unreadable: dict[str, str] = field(default_factory=dict)  # module path -> why probe cannot read it
    detected_by: str = "layout table"
    #: weights the checkpoint did not hold, left at random initialisation (missing or mismatched keys)
    random_weights: tuple[str, ...] = ()
    #: whether the user allowed explaining a model with random weights
    random_weights_allowed: bool = False
    #: a headless encoder's pooling (mode, normalize, source); None for other tasks
    pooling: dict | None = None
    #: context-mixing method -> None when it runs on this model, else why not (one line)
    context_mixing: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "task", task_named(self.task))  # a task's name is read as its Task

    def __repr__(self) -> str:
        stacks = "; ".join(f"{s.stack} {s.n_layers} layers x {s.n_heads} heads ({s.n_kv_heads} kv, head dim "
                           f"{s.head_dim}, {s.mask_kind})" for s in self.stacks.values())
        return (f"<AttentionContract {self.model_type} {self.task.name}: {stacks}; {self.implementation} "
                f"{self.dtype} on {self.device}>")

    @property
    def primary_stack(self) -> str:
        """The stack whose attention explains the prediction's inputs (encoder if there is one)."""
        return "encoder" if "encoder" in self.stacks else "decoder"

    @property
    def n_layers(self) -> int:
        return self.stacks[self.primary_stack].n_layers

    @property
    def n_heads(self) -> int:
        return self.stacks[self.primary_stack].n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.stacks[self.primary_stack].n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.stacks[self.primary_stack].head_dim

    def to_dict(self) -> dict:
        primary = self.stacks[self.primary_stack]
        return {
            "model_type": self.model_type,
            "task": self.task.name,
            "n_layers": primary.n_layers,
            "n_heads": primary.n_heads,
            "n_kv_heads": primary.n_kv_heads,
            "kv_head_of_query": list(primary.kv_head_of_query),
            "head_dim": primary.head_dim,
            "mask_kind": primary.mask_kind,
            "implementation": self.implementation,
            "dtype": self.dtype,
            "device": self.device,
            "max_positions": self.max_positions,
            "padding_side": self.padding_side,
            "special_tokens": list(self.special_tokens),
            "stacks": {name: {**asdict(s), "kv_head_of_query": list(s.kv_head_of_query),
                              "layer_heads": list(s.layer_heads), "layer_head_dims": list(s.layer_head_dims),
                              "layer_maps": list(s.layer_maps)}
                       for name, s in self.stacks.items()},
            "unreadable": dict(self.unreadable),
            "detected_by": self.detected_by,
            "context_mixing": {m: ("supported" if why is None else why) for m, why in self.context_mixing.items()},
            "random_weights": list(self.random_weights),
            "random_weights_allowed": self.random_weights_allowed,
            "pooling": self.pooling,
        }


class TruncationWarning(UserWarning):
    """A text was longer than the model's window and was cut."""


def encode_texts(pm: ProbeModel, texts: list[str], *, strict_length: bool = False, max_length: int | None = None) -> BatchEncoding:
    """Right-padded batch for ``pm``; refuses empty texts and over-long ones when ``strict_length``."""
    if isinstance(texts, str):
        texts = [texts]
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f"text #{i} is {type(text).__name__} {str(text)[:40]!r}, not a string: give texts as "
                             f"strings (e.g. {str(text)[:40]!r} in quotes)")
        if not text.strip():
            raise InputError(f"text #{i} is empty: give at least one word to explain")
    limit = min(max_length or pm.contract.max_positions, pm.contract.max_positions)
    tok = pm.tokenizer
    # verbose=False: an over-long text is said once, by probe's own warning below
    lengths = [len(ids) for ids in tok(list(texts), add_special_tokens=True, verbose=False)["input_ids"]]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if too_long:
        i, n = too_long[0]
        if strict_length:
            raise InputError(
                f"text #{i} has {n} tokens, more than the model's window of {limit}: shorten it, "
                "or drop --strict-length to truncate"
            )
        warn_at_caller(
            f"{len(too_long)} text(s) longer than the model's window of {limit} tokens were truncated (first: #{i}, "
            f"{n} tokens)",
            TruncationWarning,
        )
    batch = tok(list(texts), padding=True, truncation=True, max_length=limit, return_tensors="pt")
    if batch["input_ids"].shape[1] == 0 or bool((batch["attention_mask"].sum(dim=1) == 0).any()):
        raise InputError("a text tokenised to no tokens: give text the tokenizer can read")
    return batch.to(pm.device)


@dataclass(repr=False)
class ProbeModel:
    """A loaded model with its tokenizer and attention contract. Made only by :func:`load_model`
    (a model by name or folder) or :func:`~probe.wrap` (a model and tokenizer already in memory)."""

    name: str  # what the user asked for
    path: str  # a folder (or hub id) that ``from_pretrained`` loads; for a wrapped model, its config's name_or_path
    model: torch.nn.Module  # a transformers PreTrainedModel in eval mode
    tokenizer: PreTrainedTokenizerBase  # right padding, with a pad token
    task: Task  # what kind of prediction it makes (:mod:`probe.tasks`)
    contract: AttentionContract
    load_seconds: float
    metadata: dict = field(default_factory=dict)
    #: weights the checkpoint did not hold (missing or of another shape), left at random initialisation
    random_weights: tuple[str, ...] = ()
    #: the user said explicitly that a model with random weights may be explained
    allow_random_weights: bool = False
    #: a headless encoder's pooling; None for other tasks
    pooling: Pooling | None = None

    def __post_init__(self):
        self.task = task_named(self.task)  # a task's name is read as its Task

    def __repr__(self) -> str:
        c = self.contract
        kind = "MHA" if c.n_kv_heads == c.n_heads else "MQA" if c.n_kv_heads == 1 else "GQA"
        return (f"<ProbeModel {self.name}: {c.model_type} {self.task.name}, {c.n_layers} layers x {c.n_heads} heads "
                f"({kind}), {c.implementation} {c.dtype} on {c.device}>")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_length(self) -> int:
        return self.contract.max_positions

    def encode(self, texts: list[str], *, strict_length: bool = False, max_length: int | None = None) -> BatchEncoding:
        """Tokenise a batch, right-padded. Returns a BatchEncoding on the model's device.

        Right padding keeps real tokens at positions 0..n-1 in every model, so batch of one and
        batch of N agree (left padding shifts positions of models that derive them from the cache).
        Too-long texts are truncated with a warning, or refused when ``strict_length``.
        """
        return encode_texts(self, texts, strict_length=strict_length, max_length=max_length)
