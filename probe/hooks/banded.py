"""Banded attention (a sliding window plus global tokens) read exactly as the model runs it.

Longformer's self-attention, and LED's encoder self-attention (a copy of it), never form a
[query, key] map: each query scores the 2w + 1 keys of its window (w = ``one_sided_attn_window_size``,
half the layer's ``attention_window``) in a chunked layout, and the model pads the sequence to a
multiple of the window before the first layer. With global tokens (``global_attention_mask``, a
classifier's first token by default) every query also scores the global keys, which then leave the
window, and each global query scores every key with its own projections (``query_global``,
``key_global``, ``value_global``).

The layer computes its probabilities the same way whether or not ``output_attentions`` is asked;
the flag only adds them to what the layer returns. While a :class:`BandedReader` is open it asks
each watched layer for them (a forward pre-hook) and hands its own output on unchanged, stripped of
what the caller did not ask for (a forward hook), so the model's output is the one it gives without
the reader. The layer returns

``local``   [batch, seq, head, G + 2w + 1]  per query: its weights on the G global keys of its row
            (the batch's most, in position order; missing slots 0), then on keys i - w .. i + w
            (0 outside the sequence, at padding and at global keys); 0 for global queries
``global``  [batch, head, G, seq]           the global queries' weights over every key

over the padded length ``seq``. :func:`dense_from_banded` scatters them into a dense
``[batch, head, query, key]`` map over the input's positions (the internal padding cropped) and
gives the structure the model allows (:class:`BandStructure`: band, global rows and columns).

Architecture knowledge is the table :data:`BANDED_ATTENTION_CLASSES`, keyed by module class.

The same site kind ("banded": read densified, never edited) serves BigBird's block-sparse
attention (:mod:`probe.hooks.blocksparse`) and LongT5's local and transient-global encoder
attention (:mod:`probe.hooks.local_global`): one row of :data:`probe.hooks.readers.READERS` per
family, each with its own reader, words and dense map; :func:`is_banded` and
:func:`refuse_hooks` take any of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from probe.errors import CaptureError
from probe.hooks import blocksparse, local_global
from probe.hooks.layer_calls import LayerCallReader

#: module classes whose forward computes banded (sliding-window + global) attention, Longformer's way
BANDED_ATTENTION_CLASSES = frozenset({"LongformerSelfAttention", "LEDEncoderSelfAttention"})


def is_longformer_band(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes Longformer-style banded attention (see the module docstring)."""
    return type(module).__name__ in BANDED_ATTENTION_CLASSES and isinstance(
        getattr(module, "one_sided_attn_window_size", None), int)


def is_banded(module: torch.nn.Module) -> bool:
    """Whether probe reads ``module`` through the banded path: Longformer's band, BigBird's blocks or
    LongT5's local (and transient-global) blocks."""
    return is_longformer_band(module) or blocksparse.is_block_sparse_layer(module) or local_global.is_local_global(module)


def pattern(module: torch.nn.Module) -> str:
    """The layer's sparse pattern in a few words, for one-line messages."""
    w = one_sided_window(module)
    return f"banded attention (keys i-{w}..i+{w} plus global tokens)"


def one_sided_window(module: torch.nn.Module) -> int:
    """w: a query at position i attends to keys i - w .. i + w."""
    return int(module.one_sided_attn_window_size)


@dataclass(frozen=True)
class BandStructure:
    """Which entries of a banded layer's [query, key] map exist, in words."""

    one_sided_window: int  # w: keys i - w .. i + w
    global_positions: tuple[tuple[int, ...], ...]  # per example, the positions with global attention
    length: int  # the input's positions (the model's internal padding to a window multiple cropped)

    def describe(self) -> str:
        shown = sorted({p for row in self.global_positions for p in row})
        where = f"global tokens at {shown}" if shown else "no global tokens"
        return f"sliding window of keys i-{self.one_sided_window}..i+{self.one_sided_window}, {where}"


@dataclass(frozen=True)
class BandedCall:
    """One call of a banded layer as the reader saw it (padded length ``seq``)."""

    local: torch.Tensor  # [batch, seq, head, G + 2w + 1]
    global_: torch.Tensor | None  # [batch, head, G, seq], None without global tokens
    is_global: torch.Tensor  # [batch, seq] bool
    is_masked: torch.Tensor  # [batch, seq] bool: padding (the user's and the model's own)
    window: int  # w
    length: int  # the input's positions (<= seq)

    @property
    def batch(self) -> int:
        return int(self.local.shape[0])

    @property
    def device(self) -> torch.device:
        return self.local.device

    def structure(self) -> BandStructure:
        positions = tuple(tuple(int(p) for p in row.nonzero().flatten().tolist() if p < self.length)
                          for row in self.is_global.cpu())
        return BandStructure(self.window, positions, self.length)

    def dense(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, rows, length] fp32, structure [batch, rows, length] bool)."""
        return dense_from_banded(self.local, self.global_, self.is_global, self.is_masked, self.window,
                                 self.length, rows)


def dense_from_banded(local: torch.Tensor, global_: torch.Tensor | None, is_global: torch.Tensor,
                      is_masked: torch.Tensor, window: int, length: int,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense map of one banded layer and the structure it lives on.

    local [batch, seq, head, G + 2w + 1], global_ [batch, head, G, seq] or None, is_global and
    is_masked [batch, seq] bool, window w, length (<= seq) the positions kept, rows [batch, R] long
    (query positions < length; None = all). Returns weights [batch, head, R, length] (fp32) and
    structure [batch, R, length] bool: key within the window, or a global key, or a global query;
    real query and real key. Every weight outside the structure is 0."""
    batch, seq, heads, width = local.shape
    n_global = width - (2 * window + 1)
    device = local.device
    if rows is None:
        rows = torch.arange(length, device=device).expand(batch, length)
    rows = rows.to(device)
    n_rows = rows.shape[1]
    picked = local.gather(1, rows[:, :, None, None].expand(batch, n_rows, heads, width))  # [batch, R, head, width]
    picked = picked.permute(0, 2, 1, 3).float()  # [batch, head, R, width]
    dense = picked.new_zeros(batch, heads, n_rows, seq)  # [batch, head, R, seq]
    offsets = torch.arange(-window, window + 1, device=device)
    keys = rows[:, :, None] + offsets  # [batch, R, 2w + 1]
    inside = (keys >= 0) & (keys < seq)
    band = picked[..., n_global:] * inside[:, None]
    dense.scatter_add_(-1, keys.clamp(0, seq - 1)[:, None].expand(batch, heads, n_rows, 2 * window + 1), band)
    is_global = is_global.to(device)
    global_row = is_global.gather(1, rows)  # [batch, R]
    if n_global > 0:
        slot = is_global.long().cumsum(1) - 1  # [batch, seq] the rank of each global position in its row
        # [batch, G] the key position of each global slot (missing slots: position 0, weight 0)
        slot_keys = torch.zeros(batch, n_global, dtype=torch.long, device=device)
        slot_exists = torch.zeros(batch, n_global, dtype=torch.bool, device=device)
        where = is_global.nonzero(as_tuple=True)
        slot_keys[where[0], slot[where]] = where[1]
        slot_exists[where[0], slot[where]] = True
        prefix = picked[..., :n_global] * slot_exists[:, None, None, :]
        dense.scatter_add_(-1, slot_keys[:, None, None, :].expand(batch, heads, n_rows, n_global), prefix)
        if global_ is not None:
            # a global query's row is its own softmax over every key (the local one is 0 there)
            row_slot = slot.gather(1, rows).clamp(min=0)  # [batch, R]
            global_rows = global_.float().gather(2, row_slot[:, None, :, None].expand(batch, heads, n_rows, seq))
            dense = torch.where(global_row[:, None, :, None], global_rows, dense)
    dense = dense[..., :length]  # [batch, head, R, length]
    real = ~is_masked.to(device)
    real_query = real.gather(1, rows)  # [batch, R]
    in_window = (rows[:, :, None] - torch.arange(length, device=device)).abs() <= window  # [batch, R, length]
    structure = (in_window | is_global[:, None, :length] | global_row[:, :, None]) \
        & real[:, None, :length] & real_query[:, :, None]  # [batch, R, length]
    return dense, structure


def describe_layers(modules: Mapping[int, torch.nn.Module]) -> str:
    """The structure of a stack's banded layers in one line, for the contract."""
    windows = [one_sided_window(modules[layer]) for layer in sorted(modules) if is_longformer_band(modules[layer])]
    w = windows[0] if len(set(windows)) == 1 else None
    band = f"keys i-{w}..i+{w} (attention_window {2 * w})" if w is not None else \
        f"keys i-w..i+w (w per layer: {', '.join(map(str, windows))})"
    return (f"banded: each query attends to {band} plus the global tokens, whose rows attend to every key "
            "(global_attention_mask, per input); the model's padding to a window multiple is cropped; probe "
            "densifies the layer's own probabilities (zero off the structure)")


def refuse_hooks(places: Mapping[str, list[tuple[str, int]]], modules: Mapping[str, torch.nn.Module],
                 hooked: tuple[Mapping, ...], pattern: Callable[[torch.nn.Module], str] = pattern) -> None:
    """One line for an editor or reader asked of a banded layer: probe reads those layers as they run
    (observers see them too) but puts nothing back into them, and their queries and keys are not
    handed to an attention function a reader could recompute from. ``pattern`` names the layer's
    sparse pattern (its family's: Longformer's band by default)."""
    for path, layer_places in places.items():
        for place in layer_places:
            if any(place in hooks for hooks in hooked):
                stack, layer = place
                raise CaptureError(
                    f"cannot edit or recompute {stack} layer {layer}: {type(modules[path]).__name__} computes "
                    f"{pattern(modules[path])} in its own chunked layout, which probe reads but has no exact way to "
                    "write an edited [query, key] map back into")


class BandedReader(LayerCallReader):
    """Hooks that read the banded layers of ``model`` while it runs: for each call of a watched
    module, ``handle(module, BandedCall)``. The model's output is its own (see the module docstring);
    :meth:`close` removes exactly these hooks."""

    reads_input = True

    def _read(self, module, args, kwargs, output):
        asked = self._was_asked()
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        is_global = bound["is_index_global_attn"]
        global_ = output[2] if bool(bound.get("is_global_attn")) and len(output) > 2 else None
        local = output[1]
        seq = int(local.shape[1])
        length = self.length if self.length is not None and self.length <= seq else seq
        self.handle(module, BandedCall(local=local, global_=global_, is_global=is_global,
                                       is_masked=bound["is_index_masked"], window=one_sided_window(module),
                                       length=length))
        return output if asked else output[:1]


def dense_from_output_attentions(local: torch.Tensor, global_: torch.Tensor | None, attention_mask: torch.Tensor,
                                 window: int) -> torch.Tensor:
    """HF's own ``output_attentions`` of a banded layer as a dense map: an oracle independent of the
    reader's hooks. local [batch, head, length, G + 2w + 1] (``attentions``: query rows cropped to
    the input), global_ [batch, head, seq, G] (``global_attentions``, over the padded length) or
    None, attention_mask [batch, length]. HF leaves a global query's local row 0, so a real row whose
    local weights sum to 0 is a global token's. Returns [batch, head, length, length]."""
    length = int(local.shape[2])
    real = attention_mask.to(local.device).bool()[:, :length]
    is_global = real & (local.float().sum(dim=(1, 3)) < 0.5)  # [batch, length]
    global_rows = None if global_ is None else global_.transpose(2, 3)[..., :length]  # [batch, head, G, length]
    weights, _ = dense_from_banded(local.transpose(1, 2), global_rows, is_global, ~real, window, length)
    return weights
