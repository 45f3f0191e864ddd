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
contract found a child module whose output is the layer's probabilities (``probe.hooks.sites``),
a forward hook on that child reads them and, for interventions, returns edited ones in their place.
A third path serves inline attention that hands its probabilities to no module (xlm, xglm, fsmt,
mvp, ...): while such a module runs, a torch function mode takes the result of its first softmax
over [batch, head, query, key] (``probe.hooks.modes.SoftmaxWatch``) and treats it the same way.
A module the model calls several times in one forward (a shared layer) is one layer per call.

The registry wrapper itself, the one piece of process-global state, is :mod:`probe.hooks.attention_functions`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from probe.errors import CaptureError, InputError
from probe.hooks import math as amath
from probe.hooks.attention_functions import (
    implementation_of,
    open_session,
    sink_logits,
)
from probe.hooks.readers import FUNCTION, ReadPath
from probe.hooks.stacked import LayerStacks, stack_slots
from probe.hooks.types import (
    AttentionInputs,
    AttentionMaps,
    EditContext,
    Editor,
    Observer,
    Probed,
    QuerySpec,
    Reader,
    for_stack,
    python_layer,
)


@dataclass(frozen=True)
class _Call:
    """One call of an attention function, as the session reads it."""

    query: torch.Tensor  # [batch, head, query, head_dim]
    key: torch.Tensor  # [batch, kv_head, key, head_dim]
    attention_mask: torch.Tensor | None  # as the model passed it ([B|1, 1|H, Q, K]) or None
    is_causal: bool
    scaling: float | None
    position_bias: torch.Tensor | None
    softcap: float | None
    sinks: torch.Tensor | None  # attention-sink logits [head] (gpt-oss and kin)
    rows: torch.Tensor | None  # [batch, rows] the query rows asked for; None = all

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def k_len(self) -> int:
        return self.key.shape[2]

    def allowed(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """bool [B|1, 1|H, Q or rows, K] keys each query may attend to (None = all)."""
        return amath.allowed_keys(self.attention_mask, batch=self.batch, q_len=self.q_len, k_len=self.k_len,
                                  is_causal=self.is_causal, rows=rows, device=self.query.device)


class _Session:
    def __init__(self, model, contract, queries, layers, heads, stacks, masks, editors, keep_grad, observers=None,
                 readers=None):
        self.contract = contract
        modules = dict(model.named_modules())
        self.modules = modules
        sites = getattr(contract, "sites", None) or {}
        # module id -> the (stack, layer) of each of its calls in one forward, in call order
        self.where: dict[int, tuple[str, int]] = {}
        self.sites = sites
        # read path -> its key (module path, probability module, ...) -> the layers it serves, in call order
        self._read_places: dict[ReadPath, dict[object, list[tuple[str, int]]]] = {}
        for place, path in sorted(contract.module_paths.items(), key=lambda item: (item[0][0], item[0][1])):
            reader = sites[place].reader if place in sites else FUNCTION
            key = reader.key(sites.get(place), path, modules)
            self._read_places.setdefault(reader, {}).setdefault(key, []).append(place)
        self._places = self._read_places.get(FUNCTION, {})  # module id -> its layers (the registry wrapper)
        for module_id, places in self._places.items():
            self.where[module_id] = places[0]
        self._module_calls: dict[object, int] = {}
        self._undo: list = []  # what removes the read paths' hooks (attach), while attached
        self.stacks = tuple(stacks)
        self.layers = layers
        self.heads = heads
        self.queries = queries
        self.masks = masks
        self.editors = dict(editors or {})
        self.observers = dict(observers or {})
        self.readers = dict(readers or {})
        self.keep_grad = keep_grad
        for reader, places in self._read_places.items():
            reader.refuse(places, self.modules, (self.editors, self.readers))
        self.records: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # each stack's maps written into one [batch, layer, head, rows, key] as its layers run: no second copy
        self.layer_stacks = LayerStacks(stack_slots(contract, self.stacks, self.wants))
        self.calls: dict[tuple[str, int], int] = {}
        # where the model's inputs live (its first parameter): records and editors work there, so a
        # model spread over devices (device_map="auto") gives maps on one device and editors whose
        # own tensors (gates, replacement rows) meet the weights on the device they were made on
        self.home = next(model.parameters()).device
        self.model = model
        # the 2-D masks the model's own forward was handed, read where "last" has no mask given
        self.forward_masks: dict[str, torch.Tensor | None] = {}
        # and the token ids it was handed ([batch, seq]), to tell a padded row handed over without its mask
        self.forward_ids: dict[str, torch.Tensor | None] = {}
        # the token strings of those ids, converted once per forward (every layer's maps share them)
        self._token_strings: dict[tuple[str, int, int], tuple | None] = {}
        # the tokenizer whose strings the maps show (capture_attention sets it), None: no strings
        self.tokenizer: Any = None

    def wants(self, stack: str, layer: int) -> bool:
        if stack not in self.stacks:
            return False
        chosen = for_stack(self.layers, stack)
        return chosen is None or layer in chosen

    def query_rows(self, stack: str, batch: int, q_len: int, device) -> torch.Tensor | None:
        spec = for_stack(self.queries, stack)
        if spec is None or (isinstance(spec, str) and spec == "all"):
            return None
        if isinstance(spec, str):
            if spec == "first":
                return torch.zeros(batch, 1, dtype=torch.long, device=device)
            if spec == "last":
                mask = self.batch_mask(stack)
                if mask is None and batch > 1:
                    # rows of different lengths end at different positions: without the mask the
                    # shorter ones' last row would be padding
                    raise InputError("queries='last' needs attention_mask=... (the padded batch's mask): pass "
                                     "attention_mask=batch['attention_mask'] to probe.capture or to the model")
                if mask is None:
                    self._refuse_trailing_padding(stack)
                    return torch.full((batch, 1), q_len - 1, dtype=torch.long, device=device)
                if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < q_len:
                    raise InputError(f"queries='last' reads each row's last real token from the attention mask, which "
                                     f"has shape {list(mask.shape)}, not [batch {batch}, length {q_len}]: pass the "
                                     "batch's own 2-D attention_mask (batch['attention_mask'])")
                mask = mask[:, -q_len:]  # a mask over cached keys too (decoding) ends with these rows' columns
                # the last position the mask keeps: with right padding its length - 1, and right with left padding too
                positions = torch.arange(q_len, device=mask.device).expand(batch, q_len)
                return (positions * mask.bool()).amax(dim=1).long().view(batch, 1).to(device)
            raise CaptureError(f"unknown query selection {spec!r}: use all, first, last, a list of positions or a "
                               f"tensor")
        rows = torch.as_tensor(spec, dtype=torch.long, device=device)
        if rows.dim() == 1:
            rows = rows.view(1, -1).expand(batch, -1)
        if rows.shape[0] != batch:
            raise CaptureError(f"query positions are given for {rows.shape[0]} examples but the batch has {batch}")
        if bool((rows >= q_len).any()) or bool((rows < 0).any()):
            raise CaptureError(f"query position out of range: the sequence has {q_len} positions")
        return rows

    def _refuse_trailing_padding(self, stack: str) -> None:
        """With no mask anywhere, "last" is the row's last position, and the model attends every position
        alike; refused when that position holds the pad token (a padded row handed over without its
        mask), unless the pad token doubles as a real one (bos, eos, sep)."""
        ids = self.forward_ids.get(stack)
        config = getattr(self.model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0 or pad is None:
            return
        real: set[object] = set()
        for name in ("bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
            value = getattr(config, name, None)
            real.update(value if isinstance(value, (list, tuple)) else [value])
        if pad not in real and bool((ids[:, -1] == pad).any()):
            raise InputError(f"queries='last' without an attention mask: the row ends in the pad token (id {pad}), so "
                             "its last position is padding: pass attention_mask=batch['attention_mask'] to "
                             "probe.capture or to the model")

    def next_place(self, key, places):
        """The layer of this call of a module: shared modules step through their layers call by call."""
        count = self._module_calls.get(key, 0)
        self._module_calls[key] = count + 1
        return places[count % len(places)]

    def batch_mask(self, stack: str) -> torch.Tensor | None:
        """The padding mask of ``stack``: the one given to the capture, else the one the model's forward got."""
        mask = self.masks.get(stack)
        return self.forward_masks.get(stack) if mask is None else mask

    def _side(self, side: str, batch: int, length: int) -> tuple[torch.Tensor | None, tuple | None]:
        """The padding mask (``[batch, length]`` bool) and the token strings of one side (a stack
        whose positions those are: encoder, decoder), where the forward's ids (and the mask given
        to the capture, else the forward's) fit ``batch`` x ``length``; None for what does not."""
        mask = self.batch_mask(side)
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == (batch, length)):
            mask = None
        if (side, batch, length) not in self._token_strings:
            ids = self.forward_ids.get(side)
            tokens = None
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            if (convert is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2
                    and tuple(ids.shape) == (batch, length)):
                tokens = tuple(tuple(str(t) for t in convert(row)) for row in ids.tolist())
            self._token_strings[(side, batch, length)] = tokens
        return (mask.bool().cpu() if mask is not None else None), self._token_strings[(side, batch, length)]

    def positions(self, stack: str, shape: Sequence[int]) -> dict:
        """:class:`AttentionMaps`' ``attention_mask`` and ``tokens`` (its keys') and, for
        cross-attention, ``query_mask`` and ``query_tokens`` (the decoder's), for maps of
        ``shape`` ``[batch, layer, head, query, key]``."""
        batch, n_keys = shape[0], shape[-1]
        if stack != "cross":
            mask, tokens = self._side(stack, batch, n_keys)
            return {"attention_mask": mask, "tokens": tokens}
        mask, tokens = self._side("encoder", batch, n_keys)
        decoder_ids = self.forward_ids.get("decoder")
        length = decoder_ids.shape[-1] if isinstance(decoder_ids, torch.Tensor) else -1
        query_mask, query_tokens = self._side("decoder", batch, length)
        return {"attention_mask": mask, "tokens": tokens, "query_mask": query_mask, "query_tokens": query_tokens}

    def _read_forward_masks(self, module, args, kwargs) -> None:
        """Pre-hook of the model's forward: keep the padding masks it was handed (keyword or positional)."""
        import inspect

        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        encoder, decoder = bound.get("attention_mask"), bound.get("decoder_attention_mask")
        encoder_ids, decoder_ids = bound.get("input_ids"), bound.get("decoder_input_ids")
        if self.contract.task.encoder_decoder:
            self.forward_masks = {"encoder": encoder, "decoder": decoder, "cross": decoder}
            self.forward_ids = {"encoder": encoder_ids, "decoder": decoder_ids, "cross": decoder_ids}
        else:
            self.forward_masks = {stack: encoder for stack in self.contract.stacks}
            self.forward_ids = {stack: encoder_ids for stack in self.contract.stacks}
        self._token_strings = {}

    def attach(self) -> None:
        """Forward hooks on the probability modules of inline-attention layers, and a pre-hook on the
        model's forward that keeps its masks and ids (removed by :meth:`detach`)."""
        # the forward's masks and ids: "last" and mask-blind mixers read them, and the maps keep them
        # (AttentionMaps.attention_mask, .tokens) to leave padding out of their pictures
        self._undo.append(self.model.register_forward_pre_hook(self._read_forward_masks, with_kwargs=True).remove)
        for reader, places in self._read_places.items():
            self._undo += reader.attach(self, places)

    def detach(self) -> None:
        while self._undo:
            self._undo.pop(0)()

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
        wants = self.wants(stack, layer)
        if editor is None and observer is None and not wants:
            return None
        if not isinstance(probabilities, torch.Tensor) or probabilities.dim() != 4:
            raise CaptureError(f"{stack} layer {layer}: its probability module handed {type(probabilities).__name__} "
                               f"of shape {tuple(getattr(probabilities, 'shape', ()))}, not [batch, head, query, key]")
        batch, _, q_len, k_len = probabilities.shape
        device = probabilities.device
        rows = self.query_rows(stack, batch, q_len, device)
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
            context = self.context(place, module, rows, allowed, batch, q_len, device)
            weights = editor(probabilities.float().to(self.home), context).to(device)
            replaced = weights.to(probabilities.dtype)
        elif observer is not None:
            allowed = self._allowed_from_mask(stack, batch, q_len, k_len, device)
            with torch.no_grad():
                observer(weights.detach().mean(dim=1).to(self.home),
                         self.context(place, module, rows, allowed, batch, q_len, device))
        if wants:
            self.store(place, amath.gather_rows(weights, rows), amath.gather_rows(has_keys[..., None], rows)[..., 0], rows, q_len)
        return replaced

    def call(self, place, original, module, query, key, value, attention_mask, *args, **kwargs):
        """The function path: one call of the model's attention function ``original``, read, observed
        or edited as the session asks (query [batch, head, query, dim], key/value [batch, kv_head, key, dim])."""
        places = self._places.get(id(module))
        if places is not None and len(places) > 1:
            place = self.next_place(id(module), places)
        stack, layer = place
        self.calls[place] = self.calls.get(place, 0) + 1
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = bool(getattr(module, "is_causal", False))
        reader = self.readers.get(place)
        if reader is not None:
            reader(AttentionInputs(query=query.detach(), key=key.detach(), attention_mask=attention_mask,
                                   is_causal=bool(is_causal), scaling=kwargs.get("scaling"),
                                   position_bias=kwargs.get("position_bias"), softcap=kwargs.get("softcap")))
        editor = self.editors.get(place)
        observer = self.observers.get(place) if editor is None else None
        wants = self.wants(stack, layer)
        if editor is None and observer is None and not wants:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        call = _Call(query, key, attention_mask, is_causal, kwargs.get("scaling"), kwargs.get("position_bias"),
                     kwargs.get("softcap"), sink_logits(kwargs), self.query_rows(stack, query.shape[0], query.shape[2], query.device))
        if editor is not None:
            return self._edited(place, module, call, value, editor, wants)
        output, returned = original(module, query, key, value, attention_mask, *args, **kwargs)
        if observer is not None:
            self._observe(place, module, call, observer)
        if wants:
            self._record(place, call, returned)
        return output, returned

    def _edited(self, place, module, call: _Call, value: torch.Tensor, editor: Editor, wants: bool):
        """The layer's output from its weights as ``editor`` changes them (all rows), recomputed from
        query and key; the model's own function does not run."""
        if module.training:
            raise CaptureError("attention interventions run in eval mode: call model.eval() first")
        query = call.query
        allowed = call.allowed(rows=None)
        scores = amath.attention_scores(query, call.key, scaling=call.scaling, position_bias=call.position_bias,
                                        softcap=call.softcap)
        weights, has_keys = amath.masked_softmax(scores, allowed, sinks=call.sinks)
        context = self.context(place, module, call.rows, allowed, call.batch, call.q_len, query.device)
        weights = editor(weights.to(self.home), context).to(query.device)
        output = amath.attention_output(weights, value)
        if wants:
            self.store(place, amath.gather_rows(weights, call.rows),
                        amath.gather_rows(has_keys[..., None], call.rows)[..., 0], call.rows, call.q_len)
        return output, None

    def _observe(self, place, module, call: _Call, observer: Observer) -> None:
        """Show ``observer`` the head mean of the layer's full weights, one head at a time."""
        with torch.no_grad():
            allowed = call.allowed(rows=None)
            mean = amath.head_mean_weights(call.query, call.key, allowed, scaling=call.scaling,
                                           position_bias=call.position_bias, softcap=call.softcap, sinks=call.sinks)
            observer(mean.to(self.home),
                     self.context(place, module, call.rows, allowed, call.batch, call.q_len, call.query.device))
            del mean, allowed

    def _record(self, place, call: _Call, returned) -> None:
        """Store the rows asked for: from the weights the function returned (eager) or recomputed
        from query and key (sdpa, flash)."""
        rows = call.rows
        allowed = call.allowed(rows=rows)
        if returned is not None and returned.dim() == 4 and returned.shape[-1] == call.k_len:
            picked = amath.gather_rows(returned, rows).float()
            has_keys = allowed.any(dim=-1) if allowed is not None else torch.ones(picked.shape[:-1], dtype=torch.bool, device=picked.device)
            picked = torch.where(has_keys[..., None], picked, torch.zeros((), device=picked.device))
        else:
            scores = amath.attention_scores(call.query, call.key, scaling=call.scaling, rows=rows,
                                            position_bias=call.position_bias, softcap=call.softcap)
            sinks = call.sinks
            row_sinks = amath.gather_rows(sinks, rows) if sinks is not None and sinks.dim() == 4 else sinks
            picked, has_keys = amath.masked_softmax(scores, allowed, sinks=row_sinks)
        self.store(place, picked, has_keys, rows, call.q_len)

    def context(self, place, module, rows, allowed, batch: int, q_len: int, device) -> EditContext:
        """What an editor or observer is told, on the model's input device."""
        query_index = rows if rows is not None else torch.arange(q_len, device=device).expand(batch, q_len)
        return EditContext(stack=place[0], layer=place[1], module=module, query_index=query_index.to(self.home),
                           allowed=allowed.to(self.home) if allowed is not None else None)

    def store(self, place, picked, has_keys, rows, q_len):
        # picked [batch, head, rows, key]; has_keys [batch|1, head|1, rows]
        heads = for_stack(self.heads, place[0])
        if heads is not None:
            picked = picked[:, list(heads)]
        if not self.keep_grad:
            picked = picked.detach()
        batch = picked.shape[0]
        has_keys = has_keys.expand(batch, *has_keys.shape[1:]).any(dim=1)  # [batch, rows]
        if rows is None:
            rows = torch.arange(q_len, device=picked.device).expand(batch, q_len)
        self.records[place] = (self.layer_stacks.put(place[0], place[1], picked, self.home), rows.to(self.home),
                               has_keys.to(self.home))


class Capture:
    """Handle returned by :func:`probe.capture` (``capture_attention``); read it after the forward pass."""

    def __init__(self, session: _Session):
        self._session = session

    @property
    def calls(self) -> dict[tuple[str, int], int]:
        """How many times each (stack, layer) attention ran while the capture was open."""
        return dict(self._session.calls)

    def clear(self) -> None:
        self._session.records.clear()
        self._session.layer_stacks.clear()
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
                f"the {stack} layers have different head counts or key lengths "
                f"({', '.join(map(str, sorted(shapes)))}), "
                "so their maps cannot stack: read them one layer at a time with Capture.layer_maps"
            )
        weights = session.layer_stacks.stacked(stack, tuple(layers))  # [batch, layer, head, rows, key]: no copy
        if weights is None:
            weights = torch.stack([session.records[(stack, layer)][0] for layer in layers], dim=1)
        has_keys = torch.stack([session.records[(stack, layer)][2] for layer in layers], dim=1)
        rows = session.records[(stack, layers[0])][1]
        heads = for_stack(session.heads, stack)
        n_heads = session.contract.stacks[stack].n_heads
        return AttentionMaps(
            stack=stack, layers=tuple(layers), heads=tuple(heads) if heads is not None else tuple(range(n_heads)),
            weights=weights, query_index=rows, row_has_keys=has_keys, **session.positions(stack, weights.shape),
        )


    def layer_maps(self, stack: str | None = None) -> dict[int, AttentionMaps]:
        """One :class:`~probe.hooks.types.AttentionMaps` per captured layer (``layer`` axis of length 1), for stacks whose
        layers differ in heads or key length."""
        session = self._session
        stack = stack or session.contract.primary_stack
        session.layer_stacks.lend(stack)  # its layers' maps are views of the stacked tensor: never written again
        out = {}
        for (s, layer), (weights, rows, has_keys) in sorted(session.records.items()):
            if s != stack:
                continue
            heads = for_stack(session.heads, stack)
            out[layer] = AttentionMaps(stack=stack, layers=(layer,),
                                       heads=tuple(heads) if heads is not None else tuple(range(weights.shape[1])),
                                       weights=weights[:, None], query_index=rows, row_has_keys=has_keys[:, None],
                                       **session.positions(stack, weights[:, None].shape))
        if not out:
            raise CaptureError(f"no attention was captured for stack {stack!r}")
        return out


def _python_layers(contract, stacks, layers):
    """``layers`` (validated) with negative indices counted from each stack's last layer: per stack
    where any is negative, else as given."""
    if layers is None:
        return None
    chosen = {stack: for_stack(layers, stack) for stack in stacks}
    if not any(layer < 0 for values in chosen.values() for layer in values or ()):
        return layers
    resolved = dict(layers) if isinstance(layers, Mapping) else {}
    for stack, values in chosen.items():
        if values is not None:
            resolved[stack] = [python_layer(layer, contract.stacks[stack].n_layers) for layer in values]
    return resolved


def _validate(contract, stacks, layers, heads, editors, observers, readers):
    """One line naming the first stack, layer, head or hooked layer the model does not have."""
    for stack in stacks:
        if stack not in contract.stacks:
            raise CaptureError(f"model has no {stack!r} attention: its stacks are {', '.join(contract.stacks)}")
    for stack in stacks:
        info = contract.stacks[stack]
        chosen_layers = for_stack(layers, stack)
        for layer in chosen_layers or ():
            if python_layer(layer, info.n_layers) is None:
                raise CaptureError(f"layer {layer} does not exist in the {stack}: it has layers 0..{info.n_layers - 1} "
                                   "(-1 is the last)")
        chosen_heads = for_stack(heads, stack)
        most = max(info.layer_heads or (info.n_heads,))
        for head in chosen_heads or ():
            if not 0 <= head < most:
                raise CaptureError(f"head {head} does not exist in the {stack}: it has heads 0..{most - 1}")
    for hooked, verb in ((editors, "edit"), (observers, "observe"), (readers, "read")):
        for stack, layer in (hooked or {}):
            if (stack, layer) not in contract.module_paths:
                raise CaptureError(f"cannot {verb} {stack} layer {layer}: the model has no such attention module")
            info = contract.stacks[stack]
            if info.layer_implicit(layer):
                mixer = info.mixer_class or info.module_class
                raise CaptureError(f"cannot {verb} {stack} layer {layer}: its maps are the implicit matrix of a "
                                   f"{mixer} (signed, not a softmax), which probe reads but cannot hand to "
                                   "editors, observers or readers" + (
                                       f"; this stack's softmax layers are {_softmax_layers(info)}"
                                       if info.layer_maps else ""))


def _softmax_layers(info) -> str:
    return ", ".join(str(i) for i in info.softmax_layers())


@contextmanager
def capture_attention(
    probe_model: Probed,
    *,
    queries: QuerySpec | Mapping[str, QuerySpec] = None,
    layers: Sequence[int] | Mapping[str, Sequence[int] | None] | None = None,
    heads: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    stacks: Sequence[str] | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder_attention_mask: torch.Tensor | None = None,
    editors: Mapping[tuple[str, int], Editor] | None = None,
    keep_grad: bool = False,
    observers: Mapping[tuple[str, int], Observer] | None = None,
    readers: Mapping[tuple[str, int], Reader] | None = None,
) -> Iterator[Capture]:
    """Record attention of ``probe_model`` during the forward passes run inside the block.

    queries: ``None``/"all" every row, "first" ([CLS]), "last" (last real token: read from
    ``attention_mask``, else from the mask the model's forward is handed; a batch of several rows
    with neither is refused), a list of positions, or a long tensor ``[batch, rows]``; or a dict per stack.
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
    _validate(contract, stacks, layers, heads, editors, observers, readers)
    layers = _python_layers(contract, stacks, layers)
    # The 2-D padding mask that tells where each stack's query rows end ("last").
    if contract.task.encoder_decoder:
        masks = {"encoder": attention_mask, "decoder": decoder_attention_mask, "cross": decoder_attention_mask}
    else:
        masks = {stack: attention_mask for stack in contract.stacks}
    session = _Session(model, contract, queries, layers, heads, stacks, masks, editors, keep_grad, observers,
                       readers)
    session.tokenizer = getattr(probe_model, "tokenizer", None)  # the maps' token strings, from the forward's ids
    with open_session(session, implementation_of(model)):
        try:
            session.attach()
            yield Capture(session)
        finally:
            session.detach()
