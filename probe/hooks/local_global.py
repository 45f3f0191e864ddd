"""LongT5's local and transient-global encoder attention read exactly as the model runs it.

``LongT5LocalAttention`` splits the sequence, padded by the layer to a multiple of ``block_len`` =
r + 1 (r = ``local_radius``), into nb blocks. Each query block scores the 3 ``block_len`` keys of
its own block and both neighbours (HF's zero-padding outside the sequence), and the mask the stack
hands every layer keeps the keys within r of the query (|i - j| <= r) that are real. The layer's
probabilities come as ``[batch, nb, head, block_len, 3 block_len]``.

``LongT5TransientGlobalAttention`` adds G = length // g side keys (g = ``global_block_size``): the
tokens of each global block are summed, layer-normed and projected with the layer's own key and
value projections (HF's ``_make_global_fixed_block_ids``: padding belongs to no block; the tokens
after the last full block join the block before it, and an input shorter than g has none). A
real query scores every side key of a block its row has; the probabilities come as
``[batch, nb, head, block_len, 3 block_len + G]``.

As for Longformer (:mod:`probe.hooks.banded`), the layer computes its probabilities the same way
whether or not ``output_attentions`` is asked: while a :class:`LocalGlobalReader` is open it asks
each watched layer for them and hands the layer's output on stripped of what the caller did not
ask for, so the model's output is the one it gives without the reader.

:meth:`LocalGlobalCall.local` scatters the local weights onto their keys over the input's
positions (the layer's padding cropped); :meth:`LocalGlobalCall.side` keeps the side weights as
they ran, unfolded, so that ``local @ V + side @ V_side`` is the layer's attention output before
its output projection. A side key is no token: :meth:`LocalGlobalCall.dense` folds each side weight
evenly onto the real tokens of its global block (an attribution convention, not the layer's
arithmetic: the side value is the projection of the block's layer-normed sum, not a mean of the
tokens' values), so the map probe reports is ``[query, key]`` over real tokens and its real rows
still sum to one. A side key of a block with no real token (possible only with left padding or a
mask with holes: HF numbers blocks by absolute position) has a zero value; its weight has no
token to fold onto and is dropped.

Architecture knowledge is the table :data:`LOCAL_GLOBAL_ATTENTION_CLASSES`, keyed by module class;
the global blocks are HF's own (the ``_make_global_fixed_block_ids`` of the module's defining
module, called on the mask the layer was handed).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from probe.errors import CaptureError
from probe.hooks.layer_calls import LayerCallReader

#: module classes whose forward computes LongT5's blocked local attention, with side keys or without
LOCAL_GLOBAL_ATTENTION_CLASSES = frozenset({"LongT5LocalAttention", "LongT5TransientGlobalAttention"})


def is_local_global(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes LongT5's local (or transient-global) attention."""
    return type(module).__name__ in LOCAL_GLOBAL_ATTENTION_CLASSES and isinstance(getattr(module, "block_len", None), int)


def global_block_size(module: torch.nn.Module) -> int | None:
    """g for a transient-global layer, None for a local one."""
    size = getattr(module, "global_block_size", None)
    return int(size) if type(module).__name__ == "LongT5TransientGlobalAttention" and isinstance(size, int) else None


def pattern(module: torch.nn.Module) -> str:
    """The layer's sparse pattern in a few words, for one-line messages."""
    r, g = int(module.block_len) - 1, global_block_size(module)
    side = f" plus one side key per global block of {g} tokens" if g else ""
    return f"local attention (keys i-{r}..i+{r} in blocks of {r + 1}){side}"


def describe_layers(modules: Mapping[int, torch.nn.Module]) -> str:
    """The structure of a stack's LongT5 layers in one line, for the contract."""
    module = modules[min(modules)]
    r, g = int(module.block_len) - 1, global_block_size(module)
    local = (f"each query attends to keys i-{r}..i+{r} (local_radius {r}, blocks of {r + 1}; the layer's padding to "
             "a block multiple is cropped)")
    if g is None:
        return f"local (LongT5): {local}; probe scatters the layer's own blocked probabilities onto their keys (zero off the window)"
    return (f"transient-global (LongT5): {local} and to one side key per global block of {g} tokens (the block's "
            "tokens summed and layer-normed; tokens after the last full block join the block before it, padding "
            "belongs to none); probe folds each side weight evenly onto the real tokens of its block, so the map is a "
            "[query, key] matrix over real tokens whose real rows still sum to one (a convention: the side value is "
            "not the mean of the tokens' values), and keeps the unfolded side weights on the call "
            "(local @ V + side @ V_side is the layer's output)")


def _block_ids_function(module: torch.nn.Module) -> Callable:
    found = getattr(inspect.getmodule(type(module)), "_make_global_fixed_block_ids", None)
    if not callable(found):
        raise CaptureError(f"{type(module).__name__}: its module has no _make_global_fixed_block_ids, the global "
                           "blocks probe reads transient-global attention with")
    return found


@dataclass(frozen=True)
class LocalGlobalStructure:
    """What one call of a LongT5 encoder layer ran, in words."""

    radius: int  # r: keys i - r .. i + r
    global_block_size: int | None  # g, None for local attention
    global_blocks: tuple[int, ...]  # per example, the global blocks it has (side keys it scores)
    length: int

    def describe(self) -> str:
        local = f"local: keys i-{self.radius}..i+{self.radius}"
        if self.global_block_size is None:
            return local
        return (f"{local}, plus side keys of global blocks of {self.global_block_size} "
                f"({', '.join(map(str, self.global_blocks))} per example), folded evenly onto their tokens")


@dataclass(frozen=True)
class LocalGlobalCall:
    """One call of a LongT5 encoder layer as the reader saw it.

    ``weights`` [batch, nb, head, block_len, 3 block_len + G] are the layer's own probabilities (G =
    0 for local attention), ``real`` [batch, length] the real positions, ``block_ids``
    [batch, length] the global block of each position (-1: none) and ``live`` [batch, G] the side
    keys a real query may score (HF's ``global_segment_ids``); both None for local attention."""

    weights: torch.Tensor
    real: torch.Tensor
    block_len: int
    length: int
    block_ids: torch.Tensor | None = None
    live: torch.Tensor | None = None
    global_block_size: int | None = None

    @property
    def batch(self) -> int:
        return int(self.weights.shape[0])

    @property
    def heads(self) -> int:
        return int(self.weights.shape[2])

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def n_global(self) -> int:
        return int(self.weights.shape[-1]) - 3 * self.block_len

    def structure(self) -> LocalGlobalStructure:
        blocks = tuple(int(n) for n in self.live.sum(-1).tolist()) if self.live is not None else ()
        return LocalGlobalStructure(self.block_len - 1, self.global_block_size, blocks, self.length)

    def _rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is None:
            return torch.arange(self.length, device=self.device).expand(self.batch, self.length)
        return rows.to(self.device)

    def _picked(self, rows: torch.Tensor) -> torch.Tensor:
        """The layer's weights of the query rows asked for: [batch, head, R, 3 block_len + G] fp32."""
        batch, nb, heads, bl, width = self.weights.shape
        per_query = self.weights.float().permute(0, 2, 1, 3, 4).reshape(batch, heads, nb * bl, width)
        return per_query.gather(2, rows[:, None, :, None].expand(batch, heads, rows.shape[1], width))

    def local(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, R, length] fp32, structure [batch, R, length] bool: |i - j| <= r,
        real query and real key). Slots over HF's own padding (outside [0, length)) are dropped and
        padded query rows are 0; nothing else is masked, so the weights off the structure are the
        layer's own (HF's mask makes them exactly 0)."""
        rows = self._rows(rows)
        bl, length = self.block_len, self.length
        picked = self._picked(rows)[..., :3 * bl]  # [batch, head, R, 3 bl]
        batch, heads, n_rows, _ = picked.shape
        # slot k of query p (in block p // bl) is key (p // bl - 1) bl + k
        keys = (rows - rows % bl - bl)[:, :, None] + torch.arange(3 * bl, device=self.device)  # [batch, R, 3 bl]
        inside = (keys >= 0) & (keys < length)
        real = self.real.to(self.device)
        real_query = real.gather(1, rows)  # [batch, R]
        kept = picked * (inside & real_query[:, :, None])[:, None]
        dense = picked.new_zeros(batch, heads, n_rows, length)
        dense.scatter_add_(-1, keys.clamp(0, length - 1)[:, None].expand(batch, heads, n_rows, 3 * bl), kept)
        near = (rows[:, :, None] - torch.arange(length, device=self.device)).abs() < bl  # [batch, R, length]
        structure = near & real_query[:, :, None] & real[:, None, :]
        return dense, structure

    def side(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, R, G] fp32: the side keys' weights as the layer ran them, padded
        query rows 0; structure [batch, R, G] bool: the side keys a real query may score)."""
        rows = self._rows(rows)
        picked = self._picked(rows)[..., 3 * self.block_len:]
        real_query = self.real.to(self.device).gather(1, rows)  # [batch, R]
        live = self.live.to(self.device).bool() if self.live is not None else \
            torch.zeros(self.batch, 0, dtype=torch.bool, device=self.device)
        structure = real_query[:, :, None] & live[:, None, :]
        return picked * real_query[:, None, :, None], structure

    def fold(self) -> torch.Tensor:
        """[batch, G, length] fp32: each side key's weight shared evenly among the real tokens of its block."""
        g = torch.arange(self.n_global, device=self.device)
        member = (self.block_ids.to(self.device)[:, None, :] == g[None, :, None]) & self.real.to(self.device)[:, None]
        return member.float() / member.sum(-1, keepdim=True).clamp(min=1)

    def dense(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, R, length] fp32, structure [batch, R, length] bool): the local map,
        plus for transient-global attention each side weight folded evenly onto the real tokens of
        its block (see the module docstring); the structure adds those tokens."""
        weights, structure = self.local(rows)
        if self.n_global == 0:
            return weights, structure
        side, side_structure = self.side(rows)
        share = self.fold()  # [batch, G, length]
        weights = weights + side @ share[:, None]
        structure = structure | ((side_structure.float() @ (share > 0).float()) > 0)
        return weights, structure


def _real_positions(module, mask, length: int) -> torch.Tensor:
    """[batch, length] bool from the mask the stack hands the layer: a 2-D padding mask
    (transient-global) or, for local attention, the blocked mask [batch, 1, nb, bl, 3 bl], whose
    entry (query, its own key) is the query's realness."""
    if mask is None:
        raise CaptureError(f"{type(module).__name__} was called without a mask, which LongT5's stack always hands it: "
                           "probe reads the layer as the stack runs it")
    if mask.dim() == 2:
        return (mask != 0)[:, :length]
    bl = int(module.block_len)
    own = torch.diagonal(mask[:, 0, :, :, bl:2 * bl], dim1=-2, dim2=-1)  # [batch, nb, bl]
    return own.reshape(own.shape[0], -1)[:, :length].bool()


def call_from(module: torch.nn.Module, weights: torch.Tensor, mask: torch.Tensor, length: int) -> LocalGlobalCall:
    """The :class:`LocalGlobalCall` of ``weights`` (the layer's probabilities, its own or HF's
    ``output_attentions``) for an input of ``length`` positions under ``mask`` (what the layer was
    handed, or the model's 2-D attention mask)."""
    real = _real_positions(module, mask, length)
    bl, g = int(module.block_len), global_block_size(module)
    n_global = int(weights.shape[-1]) - 3 * bl
    if weights.dim() != 5 or weights.shape[3] != bl or n_global < 0 or (g is None and n_global) \
            or (g is not None and n_global != length // g):
        raise CaptureError(f"{type(module).__name__} returned probabilities of shape {tuple(weights.shape)} where "
                           f"probe "
                           f"reads [batch, blocks, head, {bl}, {3 * bl}" + (f" + {length // g}]" if g else "]"))
    if g is None:
        return LocalGlobalCall(weights=weights, real=real, block_len=bl, length=length)
    block_ids, live = _block_ids_function(module)(mask[:, :length], g)  # [batch, length], [batch, G]
    return LocalGlobalCall(weights=weights, real=real, block_len=bl, length=length, block_ids=block_ids.long(),
                           live=live.bool(), global_block_size=g)


def dense_from_output_attentions(attentions: torch.Tensor, module: torch.nn.Module,
                                 attention_mask: torch.Tensor) -> torch.Tensor:
    """HF's own ``output_attentions`` of a LongT5 encoder layer ([batch, nb, head, bl, 3 bl + G])
    as the dense map probe reports: an oracle independent of the reader's hooks. attention_mask
    [batch, length] is the model's. Returns [batch, head, length, length] fp32."""
    length = int(attention_mask.shape[1])
    mask = attention_mask.to(attentions.device)
    if global_block_size(module) is None:  # the stack's blocked mask, rebuilt from the 2-D one
        bl = int(module.block_len)
        own = torch.nn.functional.pad(mask, (0, -length % bl)).bool()  # [batch, nb bl]
        mask = torch.zeros(*attentions.shape[:2], bl, 3 * bl, dtype=torch.bool, device=mask.device)
        mask[:, :, torch.arange(bl), bl + torch.arange(bl)] = own.view(own.shape[0], -1, bl)
        mask = mask[:, None]
    return call_from(module, attentions, mask, length).dense()[0]


class LocalGlobalReader(LayerCallReader):
    """Hooks that read the LongT5 encoder layers of ``model`` while it runs: for each call of a
    watched module, ``handle(module, LocalGlobalCall)``. The model's output is its own (see the
    module docstring); :meth:`close` removes exactly these hooks."""

    def _read(self, module, args, kwargs, output):
        asked = self._was_asked()
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        hidden = bound["hidden_states"]
        if not isinstance(output, tuple) or len(output) < 3:
            raise CaptureError(f"{type(module).__name__} returned {len(output) if isinstance(output, tuple) else 1} "
                               "outputs with output_attentions=True where probe reads 3 (output, bias, probabilities)")
        self.handle(module, call_from(module, output[2], bound.get("mask"), int(hidden.shape[1])))
        return output if asked else output[:2]
