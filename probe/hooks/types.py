"""The capture's public types: what a capture returns (:class:`AttentionMaps`), what an editor,
observer or reader is handed (:class:`EditContext`, :class:`AttentionInputs`), and the shapes of
the options of :func:`probe.hooks.capture.capture_attention` (re-exported there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    import pandas as pd

QuerySpec = None | str | Sequence[int] | torch.Tensor


@dataclass(repr=False)
class AttentionMaps:
    """Captured attention of one stack.

    weights      [batch, layer, head, query, key]  fp32; rows sum to 1 over allowed keys, blocked keys 0
    query_index  [batch, query] long               position of each kept query row (all rows: arange)
    row_has_keys [batch, layer, query] bool        False where every key was masked (weights are 0 there)
    """

    stack: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    weights: torch.Tensor
    query_index: torch.Tensor
    row_has_keys: torch.Tensor

    @property
    def shape(self) -> dict[str, int]:
        b, l, h, q, k = self.weights.shape
        return {"batch": b, "layer": l, "head": h, "query": q, "key": k}

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

    def plot(self, layer: int, head: int, example: int = 0, tokens: Sequence[str] | None = None):
        """The ``[query, key]`` map of ``layer`` and ``head`` (the model's indices, as captured;
        negative ones count from the last captured, as Python's do) for batch row ``example``, as a
        heatmap; ``tokens`` (that row's token strings) label the axes. Returns a
        :class:`matplotlib.figure.Figure`."""
        from probe.display import clean_token
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
        weights = self.weights[example, self.layers.index(layer), self.heads.index(head)]  # [query, key]
        labels = None
        if tokens is not None:
            labels = [clean_token(t) for t in tokens]
            if len(labels) < weights.shape[-1]:  # padding keys beyond the row's tokens
                labels += [""] * (weights.shape[-1] - len(labels))
        return attention_figure(weights.detach().cpu().double().numpy(),
                                [int(q) for q in self.query_index[example].tolist()], labels,
                                title=f"{self.stack} L{layer}.H{head}, example {example}")

    def to_bertviz(self, example: int = 0, tokens: Sequence[str] | None = None, *, view: str = "head"):
        """Batch row ``example`` in bertviz's ``head_view`` or ``model_view`` (``view``), as the HTML
        object a notebook displays. bertviz needs every query row (capture with ``queries=None``)
        and numbers the captured layers from 0; ``tokens`` (that row's token strings, padding
        excluded) set how many positions are shown, so padding keys never appear. Needs bertviz
        (``pip install bertviz``)."""
        import re
        import uuid

        from probe.display import clean_token
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
        n = n_keys if tokens is None else len(tokens)
        if not 0 < n <= n_keys:
            raise InputError(f"{n} tokens given for maps of {n_keys} positions: give that row's tokens, padding excluded")
        try:
            import bertviz
        except ImportError:
            raise InputError("to_bertviz needs bertviz: pip install bertviz") from None
        labels = [clean_token(t) for t in tokens] if tokens is not None else [str(i) for i in range(n)]
        weights = self.weights[example, :, :, :n, :n].detach().cpu().float()  # [layer, head, query, key]
        attention = tuple(weights[i].unsqueeze(0) for i in range(weights.shape[0]))  # bertviz: per layer [1, H, Q, K]
        show = bertviz.head_view if view == "head" else bertviz.model_view
        # bertviz writes the tokens with json.dumps into a <script> element, where a token holding
        # "</script>" would end it and run what follows: it is handed placeholders, each then replaced
        # by its token as script-safe JSON (probe.document.script_json)
        marker = f"probe-token-{uuid.uuid4().hex}-"
        page = show(attention, [f"{marker}{i}" for i in range(n)], html_action="return")
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
