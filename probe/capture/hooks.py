"""Read (and, for interventions, write) attention per layer and head, whatever the implementation.

How: transformers 5 attention modules fetch their attention function from the shared registry
``ALL_ATTENTION_FUNCTIONS`` on every call, by the name of the implementation the model was loaded
with. While a capture is open, probe puts a thin wrapper under that name in the registry's local
mapping. The wrapper calls the model's own function unchanged, with the same arguments and the
same mask, so outputs with capture equal outputs without it. The weights come from the function
itself when it returns them (eager), or are recomputed from the query and key it was handed
(sdpa, flash): only the query rows asked for, so a row capture never holds T x T per layer.
Modules of other models pass straight through. Everything is undone in ``finally``.

A second path serves modules that compute attention inline (bloom, deberta, xlnet, ...): where the
contract found a child module whose output is the layer's probabilities (``probe.capture.sites``),
a forward hook on that child reads them and, for interventions, returns edited ones in their place.
A third path serves inline attention that hands its probabilities to no module (xlm, xglm, fsmt,
mvp, ...): while such a module runs, a torch function mode takes the result of its first softmax
over [batch, head, query, key] (``probe.capture.modes.SoftmaxWatch``) and treats it the same way.
A module the model calls several times in one forward (a shared layer) is one layer per call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from probe.capture import math as amath
from probe.capture.modes import ModuleModes, SoftmaxWatch
from probe.errors import CaptureError

_MISSING = object()
_LOCK = threading.RLock()
_SESSIONS: list["_Session"] = []
_SAVED: dict[str, object] = {}  # implementation name -> what the local mapping held before us

QuerySpec = None | str | Sequence[int] | torch.Tensor


def _registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _generic_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scores = amath.attention_scores(query, key, scaling=scaling, position_bias=kwargs.get("position_bias"))
    if attention_mask is not None:
        scores = scores + attention_mask.float() if attention_mask.dtype != torch.bool else scores.masked_fill(
            ~attention_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    return amath.attention_output(weights, value), weights


def original_attention_function(name: str, module) -> Callable:
    """The function the module would have used had no capture been open."""
    saved = _SAVED.get(name, _MISSING)
    if saved is not _MISSING:
        return saved
    if name == "eager":
        # Every transformers 5 modeling file defines its own eager function; use that one.
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward", _generic_eager)
    return type(_registry())._global_mapping[name]


def _make_wrapper(name: str) -> Callable:
    def probe_attention(module, query, key, value, attention_mask, *args, **kwargs):
        original = original_attention_function(name, module)
        for session in reversed(_SESSIONS):
            place = session.where.get(id(module))
            if place is not None:
                return session.call(place, original, module, query, key, value, attention_mask, *args, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    probe_attention.__probe_wrapper__ = True
    return probe_attention


def _install(name: str) -> None:
    registry = _registry()
    current = registry._local_mapping.get(name, _MISSING)
    if getattr(current, "__probe_wrapper__", False):
        return
    _SAVED[name] = current
    registry._local_mapping[name] = _make_wrapper(name)


def _uninstall_all() -> None:
    registry = _registry()
    for name, previous in list(_SAVED.items()):
        if previous is _MISSING:
            registry._local_mapping.pop(name, None)
        else:
            registry._local_mapping[name] = previous
        del _SAVED[name]


def installed_wrappers() -> list[str]:
    """Names under which a probe wrapper sits in the registry now (empty when no capture is open)."""
    return [k for k, v in _registry()._local_mapping.items() if getattr(v, "__probe_wrapper__", False)]


@dataclass
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
    with :mod:`probe.capture.math` (``allowed_keys``, ``head_mean_weights``): nothing is computed
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


class _Session:
    def __init__(self, model, contract, queries, layers, heads, stacks, masks, editors, keep_grad, observers=None,
                 readers=None):
        self.contract = contract
        modules = dict(model.named_modules())
        self.modules = modules
        sites = getattr(contract, "sites", None) or {}
        # module id -> the (stack, layer) of each of its calls in one forward, in call order
        self.where: dict[int, tuple[str, int]] = {}
        self._places: dict[int, list[tuple[str, int]]] = {}
        self._probability_places: dict[str, list[tuple[str, int]]] = {}
        self._softmax_places: dict[str, list[tuple[str, int]]] = {}
        self._sites = sites
        for place, path in sorted(contract.module_paths.items(), key=lambda item: (item[0][0], item[0][1])):
            site = sites.get(place)
            if site is not None and site.kind == "probabilities":
                self._probability_places.setdefault(site.probability_path, []).append(place)
                continue
            if site is not None and site.kind == "softmax":
                self._softmax_places.setdefault(path, []).append(place)
                continue
            self._places.setdefault(id(modules[path]), []).append(place)
        for module_id, places in self._places.items():
            self.where[module_id] = places[0]
        self._module_calls: dict[object, int] = {}
        self._handles: list = []
        self._modes = None  # probe.capture.modes.ModuleModes of the softmax path, while attached
        self.stacks = tuple(stacks)
        self.layers = layers
        self.heads = heads
        self.queries = queries
        self.masks = masks
        self.editors = dict(editors or {})
        self.observers = dict(observers or {})
        self.readers = dict(readers or {})
        self.keep_grad = keep_grad
        self.records: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.calls: dict[tuple[str, int], int] = {}
        # where the model's inputs live (its first parameter): records and editors work there, so a
        # model spread over devices (device_map="auto") gives maps on one device and editors whose
        # own tensors (gates, replacement rows) meet the weights on the device they were made on
        self.home = next(model.parameters()).device

    def _wants(self, stack: str, layer: int) -> bool:
        if stack not in self.stacks:
            return False
        chosen = self.layers.get(stack) if isinstance(self.layers, Mapping) else self.layers
        return chosen is None or layer in chosen

    def _rows(self, stack: str, batch: int, q_len: int, device) -> torch.Tensor | None:
        spec = self.queries.get(stack) if isinstance(self.queries, Mapping) else self.queries
        if spec is None or (isinstance(spec, str) and spec == "all"):
            return None
        if isinstance(spec, str):
            if spec == "first":
                return torch.zeros(batch, 1, dtype=torch.long, device=device)
            if spec == "last":
                mask = self.masks.get(stack)
                if mask is None or mask.shape[1] != q_len:
                    return torch.full((batch, 1), q_len - 1, dtype=torch.long, device=device)
                return (mask.sum(dim=1).long() - 1).clamp(min=0).view(batch, 1).to(device)
            raise CaptureError(f"unknown query selection {spec!r}: use all, first, last, a list of positions or a tensor")
        rows = torch.as_tensor(spec, dtype=torch.long, device=device)
        if rows.dim() == 1:
            rows = rows.view(1, -1).expand(batch, -1)
        if rows.shape[0] != batch:
            raise CaptureError(f"query positions are given for {rows.shape[0]} examples but the batch has {batch}")
        if bool((rows >= q_len).any()) or bool((rows < 0).any()):
            raise CaptureError(f"query position out of range: the sequence has {q_len} positions")
        return rows

    def _next_place(self, key, places):
        """The layer of this call of a module: shared modules step through their layers call by call."""
        count = self._module_calls.get(key, 0)
        self._module_calls[key] = count + 1
        return places[count % len(places)]

    def attach(self) -> None:
        """Forward hooks on the probability modules of inline-attention layers (removed by :meth:`detach`)."""
        for path, places in self._probability_places.items():
            def hook(module, args, output, path=path, places=places):
                return self.on_probabilities(self._next_place(path, places), output)

            self._handles.append(self.modules[path].register_forward_hook(hook))
        if self._softmax_places:
            self._modes = ModuleModes()
            for path, places in self._softmax_places.items():
                folded = bool(self._sites[places[0]].folded_heads)

                def make(path=path, places=places, folded=folded):
                    place = self._next_place(path, places)
                    return SoftmaxWatch(lambda t: t.dim() == (3 if folded else 4) and t.is_floating_point(),
                                        lambda t, place=place: self._on_softmax(place, t, folded))

                self._modes.watch(self.modules[path], make)

    def _on_softmax(self, place, probabilities: torch.Tensor, folded: bool):
        """The softmax path: [batch, head, query, key], or [batch * head, query, key] unfolded with the
        layer's head count and folded back after an edit."""
        if not folded:
            return self.on_probabilities(place, probabilities)
        stack, layer = place
        info = self.contract.stacks[stack]
        heads = info.layer_heads[layer] if layer < len(info.layer_heads) else info.n_heads
        rows, q_len, k_len = probabilities.shape
        if rows % heads:
            raise CaptureError(f"{stack} layer {layer}: softmax over {rows} rows is not batch x {heads} heads")
        replaced = self.on_probabilities(place, probabilities.view(rows // heads, heads, q_len, k_len))
        return None if replaced is None else replaced.reshape(rows, q_len, k_len)

    def detach(self) -> None:
        if self._modes is not None:
            self._modes.close()
            self._modes = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _allowed_from_mask(self, stack: str, batch: int, q_len: int, k_len: int, device) -> torch.Tensor | None:
        """[B, 1, Q, K] bool from the stack's 2-D padding mask and its mask kind, for the probability path."""
        key_stack = "encoder" if stack == "cross" else stack
        mask = self.masks.get(key_stack)
        allowed = None
        if mask is not None and mask.dim() == 2 and mask.shape[1] == k_len and mask.shape[0] == batch:
            allowed = mask.bool().to(device)[:, None, None, :].expand(batch, 1, q_len, k_len)
        info = self.contract.stacks.get(stack)
        if info is not None and info.mask_kind.startswith(("causal", "sliding")) and q_len == k_len:
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()[None, None]
            allowed = causal.expand(batch, 1, q_len, k_len) if allowed is None else allowed & causal
        return allowed

    def on_probabilities(self, place, probabilities):
        """The probability path: ``probabilities`` [batch, head, query, key] are the layer's own."""
        stack, layer = place
        self.calls[place] = self.calls.get(place, 0) + 1
        editor = self.editors.get(place)
        observer = self.observers.get(place) if editor is None else None
        wants = self._wants(stack, layer)
        if editor is None and observer is None and not wants:
            return None
        if not isinstance(probabilities, torch.Tensor) or probabilities.dim() != 4:
            raise CaptureError(f"{stack} layer {layer}: its probability module handed {type(probabilities).__name__} "
                               f"of shape {tuple(getattr(probabilities, 'shape', ()))}, not [batch, head, query, key]")
        batch, _, q_len, k_len = probabilities.shape
        device = probabilities.device
        rows = self._rows(stack, batch, q_len, device)
        module = self.modules[self.contract.module_paths[place]]
        replaced = None
        weights = probabilities.float()
        padding = self._allowed_from_mask(stack, batch, q_len, k_len, device)
        has_keys = weights.detach().sum(-1) > 0.5  # [batch, head, query]
        if padding is not None:
            # Padded query rows of some models spread over every key (deberta): what the capture
            # records follows the maps' rule, blocked keys 0 and padded query rows flagged and 0;
            # the model's own output is untouched.
            weights = weights * padding
            query_mask = self.masks.get(stack)
            if stack != "cross" and query_mask is not None and query_mask.dim() == 2 and query_mask.shape == (batch, q_len):
                has_keys = has_keys & query_mask.bool().to(device)[:, None, :]
                weights = weights * has_keys[..., None]
        if editor is not None:
            if module.training:
                raise CaptureError("attention interventions run in eval mode: call model.eval() first")
            allowed = self._allowed_from_mask(stack, batch, q_len, k_len, device)
            context = self._context(place, module, rows, allowed, batch, q_len, device)
            weights = editor(probabilities.float().to(self.home), context).to(device)
            replaced = weights.to(probabilities.dtype)
        elif observer is not None:
            allowed = self._allowed_from_mask(stack, batch, q_len, k_len, device)
            with torch.no_grad():
                observer(weights.detach().mean(dim=1).to(self.home),
                         self._context(place, module, rows, allowed, batch, q_len, device))
        if wants:
            self._store(place, amath.gather_rows(weights, rows), amath.gather_rows(has_keys[..., None], rows)[..., 0], rows, q_len)
        return replaced

    def call(self, place, original, module, query, key, value, attention_mask, *args, **kwargs):
        places = self._places.get(id(module))
        if places is not None and len(places) > 1:
            place = self._next_place(id(module), places)
        stack, layer = place
        self.calls[place] = self.calls.get(place, 0) + 1
        reader = self.readers.get(place)
        if reader is not None:
            causal = kwargs.get("is_causal")
            reader(AttentionInputs(query=query.detach(), key=key.detach(), attention_mask=attention_mask,
                                   is_causal=bool(getattr(module, "is_causal", False)) if causal is None else bool(causal),
                                   scaling=kwargs.get("scaling"), position_bias=kwargs.get("position_bias"),
                                   softcap=kwargs.get("softcap")))
        editor = self.editors.get(place)
        observer = self.observers.get(place) if editor is None else None
        wants = self._wants(stack, layer)
        if editor is None and observer is None and not wants:
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        batch, _, q_len, _ = query.shape
        k_len = key.shape[2]
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = bool(getattr(module, "is_causal", False))
        scaling = kwargs.get("scaling")
        rows = self._rows(stack, batch, q_len, query.device)
        position_bias = kwargs.get("position_bias")
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # attention-sink logits [head] (gpt-oss and kin)
        sinks = sinks if isinstance(sinks, torch.Tensor) else None

        if editor is not None:
            if module.training:
                raise CaptureError("attention interventions run in eval mode: call model.eval() first")
            allowed = amath.allowed_keys(attention_mask, batch=batch, q_len=q_len, k_len=k_len,
                                         is_causal=is_causal, rows=None, device=query.device)
            scores = amath.attention_scores(query, key, scaling=scaling, position_bias=position_bias, softcap=softcap)
            weights, has_keys = amath.masked_softmax(scores, allowed, sinks=sinks)
            context = self._context(place, module, rows, allowed, batch, q_len, query.device)
            weights = editor(weights.to(self.home), context).to(query.device)
            output = amath.attention_output(weights, value)
            if wants:
                self._store(place, amath.gather_rows(weights, rows), amath.gather_rows(has_keys[..., None], rows)[..., 0], rows, q_len)
            return output, None

        output, returned = original(module, query, key, value, attention_mask, *args, **kwargs)
        if observer is not None:
            with torch.no_grad():
                allowed = amath.allowed_keys(attention_mask, batch=batch, q_len=q_len, k_len=k_len,
                                             is_causal=is_causal, rows=None, device=query.device)
                mean = amath.head_mean_weights(query, key, allowed, scaling=scaling, position_bias=position_bias,
                                               softcap=softcap, sinks=sinks)
                observer(mean.to(self.home), self._context(place, module, rows, allowed, batch, q_len, query.device))
                del mean, allowed
        if not wants:
            return output, returned
        allowed = amath.allowed_keys(attention_mask, batch=batch, q_len=q_len, k_len=k_len,
                                     is_causal=is_causal, rows=rows, device=query.device)
        if returned is not None and returned.dim() == 4 and returned.shape[-1] == k_len:
            picked = amath.gather_rows(returned, rows).float()
            has_keys = allowed.any(dim=-1) if allowed is not None else torch.ones(picked.shape[:-1], dtype=torch.bool, device=picked.device)
            picked = torch.where(has_keys[..., None], picked, torch.zeros((), device=picked.device))
        else:
            scores = amath.attention_scores(query, key, scaling=scaling, rows=rows, position_bias=position_bias, softcap=softcap)
            row_sinks = amath.gather_rows(sinks, rows) if sinks is not None and sinks.dim() == 4 else sinks
            picked, has_keys = amath.masked_softmax(scores, allowed, sinks=row_sinks)
        self._store(place, picked, has_keys, rows, q_len)
        return output, returned

    def _context(self, place, module, rows, allowed, batch: int, q_len: int, device) -> EditContext:
        """What an editor or observer is told, on the model's input device."""
        query_index = rows if rows is not None else torch.arange(q_len, device=device).expand(batch, q_len)
        return EditContext(stack=place[0], layer=place[1], module=module, query_index=query_index.to(self.home),
                           allowed=allowed.to(self.home) if allowed is not None else None)

    def _store(self, place, picked, has_keys, rows, q_len):
        # picked [batch, head, rows, key]; has_keys [batch|1, head|1, rows]
        heads = self.heads.get(place[0]) if isinstance(self.heads, Mapping) else self.heads
        if heads is not None:
            picked = picked[:, list(heads)]
        if not self.keep_grad:
            picked = picked.detach()
        batch = picked.shape[0]
        has_keys = has_keys.expand(batch, *has_keys.shape[1:]).any(dim=1)  # [batch, rows]
        if rows is None:
            rows = torch.arange(q_len, device=picked.device).expand(batch, q_len)
        self.records[place] = (picked.to(self.home), rows.to(self.home), has_keys.to(self.home))


class Capture:
    """Handle returned by :func:`capture_attention`; read it after the forward pass."""

    def __init__(self, session: _Session):
        self._session = session

    @property
    def calls(self) -> dict[tuple[str, int], int]:
        """How many times each (stack, layer) attention ran while the capture was open."""
        return dict(self._session.calls)

    def clear(self) -> None:
        self._session.records.clear()
        self._session.calls.clear()
        self._session._module_calls.clear()

    def maps(self, stack: str | None = None) -> AttentionMaps:
        session = self._session
        stack = stack or session.contract.primary_stack
        layers = sorted(layer for (s, layer) in session.records if s == stack)
        if not layers:
            seen = sorted({s for s, _ in session.calls})
            raise CaptureError(
                f"no attention was captured for stack {stack!r} (stacks that ran: {seen or 'none'}); "
                "run the model's forward inside the capture and ask for a stack it has"
            )
        shapes = {tuple(session.records[(stack, layer)][0].shape) for layer in layers}
        if len(shapes) > 1:
            raise CaptureError(
                f"the {stack} layers have different head counts or key lengths ({', '.join(map(str, sorted(shapes)))}), "
                "so their maps cannot stack: read them one layer at a time with Capture.layer_maps"
            )
        weights = torch.stack([session.records[(stack, layer)][0] for layer in layers], dim=1)
        has_keys = torch.stack([session.records[(stack, layer)][2] for layer in layers], dim=1)
        rows = session.records[(stack, layers[0])][1]
        heads = session.heads.get(stack) if isinstance(session.heads, Mapping) else session.heads
        n_heads = session.contract.stacks[stack].n_heads
        return AttentionMaps(
            stack=stack, layers=tuple(layers), heads=tuple(heads) if heads is not None else tuple(range(n_heads)),
            weights=weights, query_index=rows, row_has_keys=has_keys,
        )


    def layer_maps(self, stack: str | None = None) -> dict[int, AttentionMaps]:
        """One :class:`AttentionMaps` per captured layer (``layer`` axis of length 1), for stacks whose
        layers differ in heads or key length."""
        session = self._session
        stack = stack or session.contract.primary_stack
        out = {}
        for (s, layer), (weights, rows, has_keys) in sorted(session.records.items()):
            if s != stack:
                continue
            heads = session.heads.get(stack) if isinstance(session.heads, Mapping) else session.heads
            out[layer] = AttentionMaps(stack=stack, layers=(layer,),
                                       heads=tuple(heads) if heads is not None else tuple(range(weights.shape[1])),
                                       weights=weights[:, None], query_index=rows, row_has_keys=has_keys[:, None])
        if not out:
            raise CaptureError(f"no attention was captured for stack {stack!r}")
        return out


def _validate(contract, stacks, layers, heads):
    for stack in stacks:
        if stack not in contract.stacks:
            raise CaptureError(f"model has no {stack!r} attention: its stacks are {', '.join(contract.stacks)}")
    for stack in stacks:
        info = contract.stacks[stack]
        chosen_layers = layers.get(stack) if isinstance(layers, Mapping) else layers
        for layer in chosen_layers or ():
            if not 0 <= layer < info.n_layers:
                raise CaptureError(f"layer {layer} does not exist in the {stack}: it has layers 0..{info.n_layers - 1}")
        chosen_heads = heads.get(stack) if isinstance(heads, Mapping) else heads
        for head in chosen_heads or ():
            if not 0 <= head < info.n_heads:
                raise CaptureError(f"head {head} does not exist in the {stack}: it has heads 0..{info.n_heads - 1}")


@contextmanager
def capture_attention(
    probe_model,
    *,
    queries: QuerySpec | Mapping[str, QuerySpec] = None,
    layers: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    heads: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    stacks: Sequence[str] | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder_attention_mask: torch.Tensor | None = None,
    editors: Mapping[tuple[str, int], Editor] | None = None,
    keep_grad: bool = False,
    observers: Mapping[tuple[str, int], Observer] | None = None,
    readers: Mapping[tuple[str, int], Reader] | None = None,
):
    """Record attention of ``probe_model`` during the forward passes run inside the block.

    queries: ``None``/"all" every row, "first" ([CLS]), "last" (last real token, needs the padding
    mask), a list of positions, or a long tensor ``[batch, rows]``; or a dict per stack.
    editors: ``{(stack, layer): fn}`` replaces that layer's attention weights (all rows) by
    ``fn(weights, context)`` before they mix the values: the hook interventions use.
    observers: ``{(stack, layer): fn}`` calls ``fn(head_mean, context)`` with the head mean of that
    layer's full attention [batch, query, key] (fp32), computed one head at a time, while
    the model's own kernel computes the output (a layer with an editor shows the editor instead).
    readers: ``{(stack, layer): fn}`` calls ``fn(AttentionInputs)`` with that layer's query, keys and
    mask as the attention function received them (rollout in memory linear in the length).
    """
    contract = probe_model.contract
    model = probe_model.model
    stacks = tuple(stacks) if stacks is not None else tuple(contract.stacks)
    _validate(contract, stacks, layers, heads)
    for stack, layer in (editors or {}):
        if (stack, layer) not in contract.module_paths:
            raise CaptureError(f"cannot edit {stack} layer {layer}: the model has no such attention module")
    for stack, layer in (observers or {}):
        if (stack, layer) not in contract.module_paths:
            raise CaptureError(f"cannot observe {stack} layer {layer}: the model has no such attention module")
    # The 2-D padding mask that tells where each stack's query rows end ("last").
    if contract.task == "seq2seq":
        masks = {"encoder": attention_mask, "decoder": decoder_attention_mask, "cross": decoder_attention_mask}
    else:
        masks = {stack: attention_mask for stack in contract.stacks}
    for stack, layer in (readers or {}):
        if (stack, layer) not in contract.module_paths:
            raise CaptureError(f"cannot read {stack} layer {layer}: the model has no such attention module")
    session = _Session(model, contract, queries, layers, heads, stacks, masks, editors, keep_grad, observers,
                       readers)
    implementation = str(getattr(model.config, "_attn_implementation", None) or "eager")
    with _LOCK:
        _install(implementation)
        _SESSIONS.append(session)
    try:
        session.attach()
        yield Capture(session)
    finally:
        session.detach()
        with _LOCK:
            _SESSIONS.remove(session)
            if not _SESSIONS:
                _uninstall_all()
