"""The capture's public types: what a capture returns (:class:`AttentionMaps`), what an editor,
observer or reader is handed (:class:`EditContext`, :class:`AttentionInputs`), and the shapes of
the options of :func:`probe.hooks.capture.capture_attention` (re-exported there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

QuerySpec = None | str | Sequence[int] | torch.Tensor


@dataclass(repr=False)
class AttentionMaps:
    """Captured attention of one stack::

        weights        [batch, layer, head, query, key]  fp32; rows sum to 1 over allowed keys, blocked keys 0
        query_index    [batch, query] long               position of each kept query row (all rows: arange)
        row_has_keys   [batch, layer, query] bool        False where every key was masked (weights are 0 there)
        attention_mask [batch, key] bool or None         True at a real token, False at padding (the capture's
                                                         2-D mask, else the one the forward was handed)
        tokens         per batch row, the tokenizer's string at each key position, or None
        query_mask     [batch, position] bool or None    the query side's mask where its positions are not
                                                         the keys' (cross-attention: the decoder's); None:
                                                         the keys' (self-attention)
        query_tokens   per batch row, the query side's token strings where they are not the keys'; None:
                       the keys'

    The capture fills the mask and the tokens where the model's forward was handed ``input_ids``
    (and a mask) of the maps' batch and key length; None where it could not (``inputs_embeds``, a
    cached prefix). :meth:`plot` and :meth:`to_bertviz` leave out the padding positions the mask marks.
    """

    stack: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    weights: torch.Tensor
    query_index: torch.Tensor
    row_has_keys: torch.Tensor
    attention_mask: torch.Tensor | None = None
    tokens: tuple[tuple[str, ...], ...] | None = None
    query_mask: torch.Tensor | None = None
    query_tokens: tuple[tuple[str, ...], ...] | None = None

    def real_keys(self, example: int) -> list[int]:
        """The key positions of batch row ``example`` that hold real tokens (every one without a mask)."""
        n_keys = self.weights.shape[-1]
        if self.attention_mask is None:
            return list(range(n_keys))
        return [k for k in range(n_keys) if bool(self.attention_mask[example, k])]

    def real_rows(self, example: int) -> list[int]:
        """The captured query rows of batch row ``example`` whose positions hold real tokens
        (padding rows left out; every row without a mask)."""
        mask = self.attention_mask if self.query_mask is None else self.query_mask
        positions = [int(q) for q in self.query_index[example].tolist()]
        if mask is None:
            return list(range(len(positions)))
        return [r for r, q in enumerate(positions) if 0 <= q < mask.shape[-1] and bool(mask[example, q])]

    def _labels(self, example: int, tokens: Sequence[str] | None, n: int, stored) -> list[str] | None:
        """``n`` labels of batch row ``example``'s positions: ``tokens`` as given (a list as long as
        the row's real positions is spread over them, a shorter one padded with ''), else the stored
        ones, else None."""
        from probe.display import clean_token

        if tokens is None:
            return None if stored is None else [clean_token(t) for t in stored[example]]
        labels = [clean_token(t) for t in tokens]
        real = self.real_keys(example)
        if len(labels) != n and len(labels) == len(real):  # the row's tokens, padding excluded
            spread = [""] * n
            for k, label in zip(real, labels):
                spread[k] = label
            return spread
        return labels[:n] + [""] * max(n - len(labels), 0)

    @property
    def shape(self) -> dict[str, int]:
        b, n_layers, h, q, k = self.weights.shape
        return {"batch": b, "layer": n_layers, "head": h, "query": q, "key": k}

    def __repr__(self) -> str:
        from probe.display import name_list

        shape = " x ".join(f"{k} {v}" for k, v in self.shape.items())
        return (f"<AttentionMaps {self.stack}: {shape}; layers {name_list(map(str, self.layers), 6)}, "
                f"heads {name_list(map(str, self.heads), 6)}>")

    def _repr_html_(self) -> str:
        import pandas as pd

        from probe.display import block_html, frame_html

        rows = [("weights", "[batch, layer, head, query, key]", " x ".join(map(str, self.weights.shape)),
                 str(self.weights.dtype).removeprefix("torch.")),
                ("query_index", "[batch, query]", " x ".join(map(str, self.query_index.shape)), "long"),
                ("row_has_keys", "[batch, layer, query]", " x ".join(map(str, self.row_has_keys.shape)), "bool")]
        frame = pd.DataFrame(rows, columns=["field", "axes", "shape", "dtype"])
        empty = int((~self.row_has_keys).sum())
        return "<div>" + block_html(repr(self), frame_html(frame), f"{empty} query rows with every key masked") + "</div>"

    def plot(self, layer: int, head: int, example: int = 0, tokens: Sequence[str] | None = None) -> Figure:
        """The ``[query, key]`` map of ``layer`` and ``head`` (the model's indices, as captured;
        negative ones count from the last captured, as Python's do) for batch row ``example``, as a
        heatmap of its real tokens: the padding keys and query rows that ``attention_mask`` marks
        are left out. ``tokens`` (that row's token strings, with its padding or without) label the
        axes; by default the tokens the capture kept do. Returns a :class:`matplotlib.figure.Figure`."""
        from probe.errors import InputError
        from probe.plots import attention_figure

        if isinstance(layer, int) and not isinstance(layer, bool) and -len(self.layers) <= layer < 0:
            layer = self.layers[layer]
        if isinstance(head, int) and not isinstance(head, bool) and -len(self.heads) <= head < 0:
            head = self.heads[head]
        if layer not in self.layers:
            raise InputError(f"layer {layer!r} was not captured: these maps hold layers {list(self.layers)}")
        if head not in self.heads:
            raise InputError(f"head {head!r} was not captured: these maps hold heads {list(self.heads)}")
        if isinstance(example, bool) or not isinstance(example, int) or not 0 <= example < self.weights.shape[0]:
            raise InputError(f"example={example!r} is not a batch row: use 0..{self.weights.shape[0] - 1}")
        keys, rows = self.real_keys(example), self.real_rows(example)
        weights = self.weights[example, self.layers.index(layer), self.heads.index(head)]  # [query, key]
        weights = weights[rows][:, keys]  # [real query rows, real keys]
        n_keys = self.weights.shape[-1]
        key_labels = self._labels(example, tokens, n_keys, self.tokens)
        positions = [int(self.query_index[example, r]) for r in rows]
        if self.query_tokens is None and self.query_mask is None:  # self-attention: the queries are the keys
            query_labels = key_labels
        else:
            query_labels = self._labels(example, None, 0, self.query_tokens)
        labels = query_text = None
        if key_labels is not None:
            labels = [key_labels[k] for k in keys]
            query_text = [query_labels[q] if query_labels is not None and 0 <= q < len(query_labels) else str(q)
                          for q in positions]
        return attention_figure(weights.detach().cpu().double().numpy(), positions, labels,
                                title=f"{self.stack} L{layer}.H{head}, example {example}", query_tokens=query_text)

    def to_bertviz(self, example: int = 0, tokens: Sequence[str] | None = None, *, view: str = "head") -> Any:
        """Batch row ``example`` in bertviz's ``head_view`` or ``model_view`` (``view``), as the HTML
        object a notebook displays. bertviz needs every query row (capture with ``queries=None``)
        and numbers the captured layers from 0. Padding never appears: the positions shown are the
        real ones ``attention_mask`` marks (left or right padding alike), labelled by ``tokens``
        (that row's token strings, with its padding or without) or else the tokens the capture
        kept; maps without a mask show the first ``len(tokens)`` positions (all without
        ``tokens``). Needs bertviz (``pip install bertviz``)."""
        import re
        import uuid

        from probe.document import script_json
        from probe.errors import InputError

        if view not in ("head", "model"):
            raise InputError(f"view={view!r}: bertviz shows view='head' or view='model'")
        if isinstance(example, bool) or not isinstance(example, int) or not 0 <= example < self.weights.shape[0]:
            raise InputError(f"example={example!r} is not a batch row: use 0..{self.weights.shape[0] - 1}")
        n_keys = self.weights.shape[-1]
        if self.weights.shape[-2] != n_keys or not torch.equal(self.query_index[example].cpu(),
                                                              torch.arange(n_keys)):
            raise InputError("bertviz shows every query row: capture with queries=None (all rows), not a subset")
        if self.attention_mask is not None:
            keep = self.real_keys(example)
            if tokens is not None and len(tokens) not in (n_keys, len(keep)):
                raise InputError(f"{len(tokens)} tokens given for a row of {len(keep)} real positions "
                                 f"({n_keys} with padding): give that row's tokens")
        else:
            n = n_keys if tokens is None else len(tokens)
            if not 0 < n <= n_keys:
                raise InputError(f"{n} tokens given for maps of {n_keys} positions: give that row's tokens, padding "
                                 "excluded")
            keep = list(range(n))
        if not keep:
            raise InputError(f"batch row {example} has no real token: its attention mask is all padding")
        try:
            import bertviz
        except ImportError:
            raise InputError("to_bertviz needs bertviz: pip install bertviz") from None
        full = self._labels(example, tokens, n_keys, self.tokens)
        labels = [full[k] for k in keep] if full is not None else [str(k) for k in keep]
        index = torch.tensor(keep)
        weights = self.weights[example].detach().cpu().float()[:, :, index][:, :, :, index]  # [layer, head, query, key]
        attention = tuple(weights[i].unsqueeze(0) for i in range(weights.shape[0]))  # bertviz: per layer [1, H, Q, K]
        show = bertviz.head_view if view == "head" else bertviz.model_view
        # bertviz writes the tokens with json.dumps into a <script> element, where a token holding
        # "</script>" would end it and run what follows: it is handed placeholders, each then replaced
        # by its token as script-safe JSON (probe.document.script_json)
        marker = f"probe-token-{uuid.uuid4().hex}-"
        page = show(attention, [f"{marker}{i}" for i in range(len(keep))], html_action="return")
        html = re.sub(rf'"{marker}(\d+)"', lambda m: script_json(labels[int(m.group(1))]), page.data)
        if marker in html:
            raise InputError("bertviz wrote the tokens where probe cannot escape them (a bertviz version probe does "
                             "not know): pip install 'bertviz>=1.4,<2'")
        return type(page)(html)

    def to_pandas(self) -> pd.DataFrame:
        """One row per (batch, layer, head, query row, key): ``layer`` and ``head`` as captured (the
        model's indices), ``query`` the row's position (``query_index``), ``weight``. B x L x H x Q x K rows."""
        import pandas as pd

        b, _, _, q, k = self.weights.shape
        index = pd.MultiIndex.from_product([range(b), self.layers, self.heads, range(q), range(k)],
                                           names=["batch", "layer", "head", "row", "key"])
        weights = self.weights.detach().cpu().double().reshape(-1).numpy()
        frame = pd.DataFrame({"weight": weights}, index=index).reset_index()
        frame.insert(4, "query", self.query_index.cpu().numpy()[frame["batch"], frame["row"]])
        return frame.drop(columns="row")


@dataclass(frozen=True)
class EditContext:
    """What an attention editor is told about the call it edits."""

    stack: str
    layer: int
    module: object
    query_index: torch.Tensor  # [batch, rows] the rows the session targets
    allowed: torch.Tensor | None  # bool [B|1, 1|H, Q, K] keys each query may attend to, None = all


# An editor takes full weights [batch, head, query, key] (fp32) and returns edited ones.
Editor = Callable[[torch.Tensor, EditContext], torch.Tensor]
# An observer is shown the head mean of the full weights [batch, query, key] (fp32); the model's
# own attention kernel computes the output, and only one head's map exists at a time.
Observer = Callable[[torch.Tensor, EditContext], None]


@dataclass(frozen=True)
class AttentionInputs:
    """What one attention call was given, for a reader to recompute any block of its weights later
    with :mod:`probe.hooks.math` (``allowed_keys``, ``head_mean_weights``): nothing is computed
    during the forward pass, and a reader that keeps these holds memory linear in the length."""

    query: torch.Tensor  # [batch, head, query, head_dim] as the attention function received it
    key: torch.Tensor  # [batch, kv_head, key, head_dim]
    attention_mask: torch.Tensor | None  # the mask the model passed ([B|1, 1|H, Q, K]) or None
    is_causal: bool
    scaling: float | None
    position_bias: torch.Tensor | None
    softcap: float | None


# A reader is handed a layer's AttentionInputs (detached); the model's own kernel runs unchanged.
Reader = Callable[[AttentionInputs], None]

#: a layer of a stack: (stack, layer index)
Place = tuple[str, int]


class Probed(Protocol):
    """What a capture needs of a loaded model (:class:`probe.models.core.ProbeModel` is one): the
    transformers module, its attention contract and, for the maps' token strings, its tokenizer."""

    model: torch.nn.Module
    #: :class:`probe.models.core.AttentionContract`
    contract: Any


class ReaderSession(Protocol):
    """What a read path (a row of ``probe.hooks.readers.READERS``) may use of the capture session
    it serves (:class:`probe.hooks.capture._Session` is the one that exists): the model and its
    modules, the sites and the contract, and the session's bookkeeping of each layer's calls, what
    it wants recorded and where editors and observers apply. A reader hooks the modules of its
    places (``attach``) and, on each call, hands the layer's probabilities to
    :meth:`on_probabilities`, or records what it computed itself through :meth:`store`."""

    model: torch.nn.Module
    #: every module of the model by its dotted path
    modules: Mapping[str, torch.nn.Module]
    #: the attention contract (:class:`probe.models.core.AttentionContract`)
    contract: Any
    #: each layer's site (:class:`probe.hooks.sites.Site`): its reader, folded heads, ...
    sites: Mapping[Place, Any]
    #: calls seen per layer in this forward
    calls: dict[Place, int]
    observers: Mapping[Place, Observer]
    #: the device of the model's inputs: records, editors and observers work there
    home: torch.device
    #: records keep their graph (gradient methods read attention through them)
    keep_grad: bool

    def next_place(self, key: object, places: Sequence[Place]) -> Place:
        """The layer of this call of a module shared by several layers (call by call)."""
        ...

    def wants(self, stack: str, layer: int) -> bool:
        """Whether the session records this layer."""
        ...

    def query_rows(self, stack: str, batch: int, q_len: int, device: torch.device) -> torch.Tensor | None:
        """The query rows recorded (``[batch, rows]``), None for every row."""
        ...

    def batch_mask(self, stack: str) -> torch.Tensor | None:
        """The stack's 2-D padding mask (the capture's, else the forward's)."""
        ...

    def on_probabilities(self, place: Place, probabilities: torch.Tensor) -> torch.Tensor | None:
        """A layer's own ``[batch, head, query, key]`` probabilities: recorded, observed or edited;
        the edited ones to return in their place, or None."""
        ...

    def context(self, place: Place, module: torch.nn.Module, rows: torch.Tensor | None,
                allowed: torch.Tensor | None, batch: int, q_len: int, device: torch.device) -> EditContext:
        """What an editor or observer is told."""
        ...

    def store(self, place: Place, picked: torch.Tensor, has_keys: torch.Tensor, rows: torch.Tensor | None,
              q_len: int) -> None:
        """Record a layer's rows: ``picked`` [batch, head, rows, key], ``has_keys`` [batch|1, head|1, rows]."""
        ...


_Option = TypeVar("_Option")


def for_stack(option: _Option | Mapping[str, _Option], stack: str) -> _Option | None:
    """A capture option (queries, layers, heads) for one stack: its entry when given per stack."""
    return option.get(stack) if isinstance(option, Mapping) else option


def python_layer(layer: object, n_layers: int) -> int | None:
    """``layer`` as an index 0..n_layers-1, negative ones counted from the last as Python does
    (-1 = the last layer); None where it is not a whole number in -n_layers..n_layers-1.
    (The stored tables' -1 means "no layer" and never comes here.)"""
    if isinstance(layer, bool) or not isinstance(layer, int):
        try:
            import operator

            layer = operator.index(layer)  # numpy and torch integers
        except TypeError:
            return None
    if not -n_layers <= layer < n_layers:
        return None
    return layer + n_layers if layer < 0 else layer
