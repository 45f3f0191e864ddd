"""BigBird's block-sparse attention read exactly as the forward that ran computed it.

``BigBirdBlockSparseAttention`` (and BigBird-Pegasus's copy of it) splits the sequence, padded by
the model to a multiple of ``block_size`` b, into nb blocks. Query blocks 0 and nb - 1 are global:
they attend to every key. Every other query block q attends to key blocks 0 and nb - 1 (global),
q - 1, q, q + 1 (the window: blocks 0..2 for q = 1, nb - 3..nb - 1 for q = nb - 2) and r =
``num_random_blocks`` random blocks per head, drawn by HF on every call (``rand_attn``
[batch, head, nb - 2, r]). In eval mode HF draws none: every random slot points at block 0, which
the query then scores 1 + r times (and q = 1, nb - 2 score the global blocks inside their window
twice). The layer runs five softmaxes (q = 0, q = 1, the middle blocks, q = nb - 2, q = nb - 1)
over those key lists. The map it ran is their weights summed onto the key positions, duplicates
added: HF's own ``attention_probs`` assigns them instead (``scatter_``), so where a key appears
twice it keeps only one weight and the rows do not sum to one.

While a :class:`BlockSparseReader` is open, each watched layer's five softmax results are taken
as the layer computes them (a torch function mode active while the layer runs) and the random
blocks are taken from the layer's own gather of its random keys (``torch_gather_b2``, wrapped on
the instance for that call): nothing is regenerated. :meth:`BlockSparseCall.dense` scatters them
into a dense ``[batch, head, query, key]`` map over the input's positions (the model's padding to
a block multiple cropped) and gives the structure per head.

Short inputs: HF's forward runs full attention when the sequence (padded batch) has at most
(5 + 2r) b tokens, by swapping each layer's block-sparse module for a full-attention one
(``set_attention_type("original_full")``) and keeping it so for every later input. Such a call is
read from the full-attention module's own probabilities (its parent returns them) and says
``mode == "full"``. :class:`AttentionTypeGuard` puts the model's own modules back after each
forward run while it is open (probe's watched pass, captures, methods), so what each of probe's
passes runs depends on its input alone, never on the inputs before it.

Architecture knowledge is the table :data:`BLOCK_SPARSE_ATTENTION_CLASSES`, keyed by module class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.errors import CaptureError
from probe.hooks.layer_calls import LayerCallReader

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import PretrainedConfig

#: module classes whose forward computes BigBird's block-sparse attention
BLOCK_SPARSE_ATTENTION_CLASSES = frozenset({"BigBirdBlockSparseAttention", "BigBirdPegasusBlockSparseAttention"})
#: HF's five softmaxes of one block-sparse call, in the order it runs them
PARTS = ("first", "second", "middle", "second_last", "last")


#: their parents, which HF keeps while it swaps the child (``.self``) for full attention
BLOCK_SPARSE_PARENT_CLASSES = frozenset({"BigBirdAttention", "BigBirdPegasusEncoderAttention"})


def is_block_sparse(module: torch.nn.Module) -> bool:
    return type(module).__name__ in BLOCK_SPARSE_ATTENTION_CLASSES and isinstance(
        getattr(module, "block_size", None), int) and isinstance(getattr(module, "num_random_blocks", None), int)


def is_block_sparse_layer(module: torch.nn.Module) -> bool:
    """A block-sparse layer as probe reads it: the parent of a BigBird attention whose config asks
    for block-sparse attention (HF's decoders never run it), whichever child HF runs now."""
    config = getattr(module, "config", None)
    return type(module).__name__ in BLOCK_SPARSE_PARENT_CLASSES and hasattr(module, "self") \
        and getattr(config, "attention_type", None) == "block_sparse" and not getattr(config, "is_decoder", False)


def full_attention_limit(module: torch.nn.Module | PretrainedConfig) -> int:
    """HF runs full attention for sequences of at most this many tokens: (5 + 2r) b (``module``:
    the block-sparse module or its config)."""
    return (5 + 2 * int(module.num_random_blocks)) * int(module.block_size)


# --------------------------------------------------------------------------- the attention-type guard


class AttentionTypeGuard:
    """Keeps a model's attention types as they were when the guard opened: after every forward of
    ``model`` (and on :meth:`close`) each module with an ``attention_type`` gets its value and its
    own child modules back. HF's fallback to full attention for a short input then applies to that
    input only. Does nothing on a model without ``attention_type`` modules."""

    def __init__(self, model: torch.nn.Module):
        self._saved = [(m, m.attention_type, dict(m._modules)) for m in model.modules()
                       if isinstance(getattr(m, "attention_type", None), str) and hasattr(m, "set_attention_type")]
        self._handle = model.register_forward_hook(lambda *_: self.restore(), always_call=True) if self._saved else None

    def restore(self) -> None:
        for module, kind, children in self._saved:
            module.attention_type = kind
            for name, child in children.items():
                if module._modules.get(name) is not child:
                    module._modules[name] = child

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.restore()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- one call, densified


@dataclass(frozen=True)
class BlockSparseStructure:
    """What one call of a block-sparse layer ran, in words."""

    mode: str  # "block_sparse" or "full" (HF's fallback for a short input)
    block_size: int
    random_blocks: int  # r per query block and head
    blocks: int  # nb over the padded length (0 in full mode)
    length: int  # the input's positions
    random_drawn: bool  # False: HF drew no random blocks (eval): every random slot is block 0

    def describe(self) -> str:
        if self.mode == "full":
            return f"full attention over {self.length} positions (HF's fallback for a short input)"
        drawn = "drawn for this call" if self.random_drawn else "none drawn (eval): every random slot is block 0"
        return (f"block-sparse: {self.blocks} blocks of {self.block_size}; global first and last blocks, a window "
                f"of 3 blocks, {self.random_blocks} random blocks per head ({drawn})")


@dataclass(frozen=True)
class BlockSparseCall:
    """One call of a block-sparse layer as the reader saw it.

    block_sparse mode: ``parts`` are HF's five softmax results (first [batch, head, b, seq],
    second [batch, head, b, (4 + r) b], middle [batch, head, nb - 4, b, (5 + r) b], second_last
    like second, last like first) over the padded length seq = nb b, and ``random_blocks``
    [batch, head, nb - 2, r] the key blocks the layer gathered. full mode: ``parts`` is the one
    [batch, head, length, length] map. ``real`` [batch, seq] marks real positions."""

    mode: str
    parts: tuple[torch.Tensor, ...]
    random_blocks: torch.Tensor | None
    real: torch.Tensor
    block_size: int
    n_random: int
    length: int
    training: bool = False

    @property
    def batch(self) -> int:
        return int(self.parts[0].shape[0])

    @property
    def heads(self) -> int:
        return int(self.parts[0].shape[1])

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def structure(self) -> BlockSparseStructure:
        seq = int(self.real.shape[1])
        drawn = self.random_blocks is not None and bool(self.random_blocks.ne(0).any())
        return BlockSparseStructure(self.mode, self.block_size, self.n_random,
                                    seq // self.block_size if self.mode == "block_sparse" else 0, self.length,
                                    drawn or self.training)

    def dense(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, rows, length] fp32, structure [batch, rows, length] bool: the union
        over heads of :meth:`head_structure`). Weights are 0 outside each head's structure."""
        weights, structure = self.dense_per_head(rows)
        return weights, structure.any(dim=1)

    def dense_per_head(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [batch, head, rows, length] fp32, structure [batch, head, rows, length] bool)."""
        if rows is None:
            rows = torch.arange(self.length, device=self.device).expand(self.batch, self.length)
        rows = rows.to(self.device)
        if self.mode == "full":
            return _dense_full(self.parts[0], self.real, rows, self.length)
        return _dense_block_sparse(self.parts, self.random_blocks, self.real, self.block_size, rows, self.length)


def _dense_full(weights: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, length: int):
    batch, heads = weights.shape[:2]
    picked = weights.float().gather(2, rows[:, None, :, None].expand(batch, heads, rows.shape[1], weights.shape[-1]))
    real = real.to(weights.device)
    allowed = real.gather(1, rows)[:, :, None] & real[:, None, :]  # [batch, R, seq]
    allowed = allowed[:, None].expand(batch, heads, *allowed.shape[1:])[..., :length]
    return picked[..., :length] * allowed, allowed


def key_blocks(random_blocks: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key blocks each query block scores, in the order of HF's concatenations: (blocks
    [batch, head, nb, 5 + r] long, used [batch, head, nb, 5 + r] bool). Rows 0 and nb - 1 (global)
    are unused here; q = 1 and nb - 2 score 4 + r blocks (their last slot unused)."""
    batch, heads, _, r = random_blocks.shape
    device = random_blocks.device
    nb = blocks
    out = torch.zeros(batch, heads, nb, 5 + r, dtype=torch.long, device=device)
    used = torch.zeros(batch, heads, nb, 5 + r, dtype=torch.bool, device=device)
    # q = 1: [0, 1, 2, nb - 1, rand[0]]
    out[:, :, 1, :4] = torch.tensor([0, 1, 2, nb - 1], device=device)
    out[:, :, 1, 4:4 + r] = random_blocks[:, :, 0]
    used[:, :, 1, :4 + r] = True
    # middle q = 2 .. nb - 3: [0, q - 1, q, q + 1, rand[q - 1], nb - 1]
    if nb > 4:
        q = torch.arange(2, nb - 2, device=device)
        out[:, :, 2:nb - 2, 1:4] = (q[:, None] + torch.arange(-1, 2, device=device))
        out[:, :, 2:nb - 2, 4:4 + r] = random_blocks[:, :, 1:-1]
        out[:, :, 2:nb - 2, 4 + r] = nb - 1
        used[:, :, 2:nb - 2] = True
    # q = nb - 2: [0, nb - 3, nb - 2, nb - 1, rand[-1]]
    out[:, :, nb - 2, :4] = torch.tensor([0, nb - 3, nb - 2, nb - 1], device=device)
    out[:, :, nb - 2, 4:4 + r] = random_blocks[:, :, -1]
    used[:, :, nb - 2, :4 + r] = True
    return out, used


def _dense_block_sparse(parts, random_blocks, real, block_size: int, rows: torch.Tensor, length: int):
    first, second, middle, second_last, last = parts
    batch, heads, b, seq = first.shape
    nb = seq // block_size
    r = int(random_blocks.shape[-1])
    width = (5 + r) * b
    device = first.device
    blocks, used = key_blocks(random_blocks.to(device), nb)  # [batch, head, nb, 5 + r]
    # key positions per query block: [batch, head, nb, (5 + r) b]
    keys = (blocks[..., None] * b + torch.arange(b, device=device)).flatten(-2)
    slot_used = used[..., None].expand(*used.shape, b).flatten(-2)
    # per query position: [batch, head, seq, width] weights and key positions (global rows: unused)
    local = first.new_zeros(batch, heads, nb, b, width, dtype=torch.float32)
    local[:, :, 1, :, :(4 + r) * b] = second.float()
    if nb > 4:
        local[:, :, 2:nb - 2] = middle.float()
    local[:, :, nb - 2, :, :(4 + r) * b] = second_last.float()
    local = local.flatten(2, 3)  # [batch, head, seq, width]
    keys = keys[:, :, :, None].expand(batch, heads, nb, b, width).flatten(2, 3)
    slot_used = slot_used[:, :, :, None].expand(batch, heads, nb, b, width).flatten(2, 3)
    n_rows = rows.shape[1]
    pick = rows[:, None, :, None].expand(batch, heads, n_rows, width)
    row_weights = local.gather(2, pick) * slot_used.gather(2, pick)
    row_keys = keys.gather(2, pick)
    dense = first.new_zeros(batch, heads, n_rows, seq, dtype=torch.float32)
    dense.scatter_add_(-1, row_keys, row_weights)
    # counted, not assigned: an unused slot points at block 0 too and must not clear it
    hits = torch.zeros(batch, heads, n_rows, seq, dtype=torch.int32, device=device)
    hits.scatter_add_(-1, row_keys, slot_used.gather(2, pick).int())
    structure = hits > 0
    # global query blocks: their own softmax over every key
    block_of_row = rows // b  # [batch, R]
    within = (rows % b)[:, None, :, None].expand(batch, heads, n_rows, seq)
    for block, weights in ((0, first), (nb - 1, last)):
        is_row = (block_of_row == block)[:, None, :, None]
        dense = torch.where(is_row, weights.float().gather(2, within), dense)
        structure = structure | is_row
    real = real.to(device)
    allowed = real.gather(1, rows)[:, None, :, None] & real[:, None, None, :]
    structure = structure & allowed
    return (dense * structure)[..., :length], structure[..., :length]


# --------------------------------------------------------------------------- the reader


class _PartsWatch(torch.overrides.TorchFunctionMode):
    """Active while one block-sparse layer runs: keeps the result of every softmax, in order."""

    def __init__(self):
        super().__init__()
        self.results: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax) and isinstance(result, torch.Tensor):
            self.results.append(result)
        return result


class BlockSparseReader(LayerCallReader):
    """Hooks that read the block-sparse layers of ``model`` while it runs: ``modules`` are the
    layers' parents (:func:`is_block_sparse_layer`), which stay when HF swaps their block-sparse
    child for full attention. For each call, ``handle(parent, BlockSparseCall)``. The model's
    output is its own; :meth:`close` removes exactly these hooks and puts the model's attention
    types back (:class:`AttentionTypeGuard`)."""

    reads_input = True

    def __init__(self, model: torch.nn.Module, modules: Mapping[str, torch.nn.Module],
                 handle: Callable[[torch.nn.Module, BlockSparseCall], None]):
        # id of a parent -> (its block-sparse child, the softmax watch, the random-key gathers, the masks, the hook)
        self._open: dict[int, tuple[torch.nn.Module, _PartsWatch, list, list, RemovableHandle]] = {}
        self._guard: AttentionTypeGuard | None = None
        super().__init__(model, modules, handle)

    def _prepare(self, model: torch.nn.Module) -> None:
        self._guard = AttentionTypeGuard(model)

    def _watch(self, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._enter))
        self._handles.append(module.register_forward_hook(self._leave))

    def _enter(self, parent, args):
        child = parent.self
        if not is_block_sparse(child):
            return  # HF's full-attention stand-in: its parent returns its probabilities
        watch, gathered, masks = _PartsWatch(), [], []
        original = child.torch_gather_b2

        def gather(params, indices):
            gathered.append(indices)
            return original(params, indices)

        def keep_masks(mod, a, k):
            masks.append(inspect.signature(mod.forward).bind(*a, **k).arguments.get("to_mask"))

        child.torch_gather_b2 = gather  # an instance attribute over HF's staticmethod, for this call only
        handle = child.register_forward_pre_hook(keep_masks, with_kwargs=True)
        watch.__enter__()
        self._open[id(parent)] = (child, watch, gathered, masks, handle)

    def _finish(self, parent):
        opened = self._open.pop(id(parent), None)
        if opened is not None:
            child, watch, _, _, handle = opened
            watch.__exit__(None, None, None)
            handle.remove()
            child.__dict__.pop("torch_gather_b2", None)
        return opened

    def _leave(self, parent, args, output):
        opened = self._finish(parent)
        block, r = int(parent.config.block_size), int(parent.config.num_random_blocks)
        if opened is None:
            self._full(parent, output, block, r)
            return
        child, watch, gathered, masks, _ = opened
        parts = tuple(watch.results)
        if len(parts) != len(PARTS) or not gathered or not masks or masks[0] is None:
            raise CaptureError(f"{type(child).__name__} ran {len(parts)} softmaxes and {len(gathered)} random-key "
                               f"gathers where probe reads {len(PARTS)} and 1: not the block-sparse attention probe "
                               f"knows")
        to_mask = masks[0]  # [batch, 1, 1, seq]
        real = to_mask.reshape(to_mask.shape[0], -1) > 0
        seq = int(real.shape[1])
        length = self.length if self.length is not None and self.length <= seq else seq
        self.handle(parent, BlockSparseCall(mode="block_sparse", parts=parts, random_blocks=gathered[0], real=real,
                                            block_size=block, n_random=r, length=length, training=child.training))

    def _full(self, parent, output, block: int, r: int):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
            raise CaptureError(f"{type(parent).__name__} ran {type(parent.self).__name__} (HF's full attention for a "
                               "short input) and returned no [batch, head, query, key] probabilities")
        seq = int(weights.shape[-1])
        real = self.mask.bool() if self.mask is not None and self.mask.shape == (weights.shape[0], seq) else \
            torch.ones(weights.shape[0], seq, dtype=torch.bool, device=weights.device)
        self.handle(parent, BlockSparseCall(mode="full", parts=(weights,), random_blocks=None,
                                            real=real.to(weights.device), block_size=block, n_random=r, length=seq,
                                            training=parent.training))

    def close(self) -> None:
        for parent in list(self._open):
            opened = self._open.pop(parent)
            opened[1].__exit__(None, None, None)
            opened[4].remove()
            opened[0].__dict__.pop("torch_gather_b2", None)
        super().close()
        if self._guard is not None:
            self._guard.close()
            self._guard = None


def pattern(module: torch.nn.Module) -> str:
    """The layer's sparse pattern in a few words, for one-line messages."""
    return f"block-sparse attention (blocks of {module.config.block_size}, {module.config.num_random_blocks} random)"


def describe_layers(modules: Mapping[int, torch.nn.Module]) -> str:
    """The structure of a stack's block-sparse layers (their parents) in one line, for the contract."""
    module = modules[min(modules)].config
    b, r = int(module.block_size), int(module.num_random_blocks)
    return (f"block-sparse (BigBird): blocks of {b} over the input padded to a multiple of {b} (cropped); the first "
            f"and last blocks attend to every key and are attended by every query; each other query block attends "
            f"to its own and both neighbouring blocks and {r} random blocks per head, drawn by the call (in eval HF "
            f"draws none: every random slot is block 0); inputs of at most {full_attention_limit(module)} tokens run "
            "full attention (HF's fallback, which probe undoes after each of its passes); probe sums the layer's own "
            "five softmaxes onto their keys (duplicate keys added, zero off the structure)")


def dense_from_output_attentions(attentions: torch.Tensor, module: torch.nn.Module, attention_mask: torch.Tensor,
                                 ran_block_sparse: bool) -> torch.Tensor:
    """HF's own ``output_attentions`` of a block-sparse layer as the map the layer ran: an oracle
    independent of the reader. attentions [batch, head, seq, seq] (seq: the input padded to a
    block multiple, or the input's length where HF ran full attention), attention_mask
    [batch, length]. Cropped to the input's positions, padded rows and keys 0. In eval, HF draws
    no random blocks, so each non-global query block scores key block 0 once as a global block and
    once per random slot with the same score (so the same weight), and HF's map keeps one of those
    weights: here they are counted 1 + r times again. ``module``: the layer (its parent);
    ``ran_block_sparse``: whether this forward ran it (else HF ran full attention, whose map is the
    one that ran). Returns [batch, head, length, length] fp32."""
    length = int(attention_mask.shape[1])
    weights = attentions.float().clone()
    b, r = int(module.config.block_size), int(module.config.num_random_blocks)
    if ran_block_sparse and not module.training:
        seq = int(weights.shape[-1])
        weights[:, :, b:seq - b, :b] *= 1 + r
    real = attention_mask.to(weights.device).bool()
    weights = weights[..., :length, :length] * (real[:, None, :, None] & real[:, None, None, :])
    return weights
