"""Kernelised attention read as the [query, key] matrix it applies: YOSO (Zeng et al. 2021).

YOSO's self-attention (``YosoSelfAttention``, with ``use_expectation``, the default and the only
path that runs without its CUDA kernels) replaces the softmax by the expected collision
probability of ``hash_code_len`` random hyperplane hashes of the unit query and key,

    E_h[t, s] = (1 - arccos(q_t . k_s) / pi) ** tau                 (q, k l2-normalised per head)

masked by the layer's own query and key masks, applies it to the values and l2-normalises each
output row: ``context_t = E_t V / ||E_t V||``. Once the row norms are fixed the layer is linear in
its values, so per head

    M_h[t, s] = E_h[t, s] * mask_t * mask_s / ||(E_h V_h)_t||

and ``context = M V`` exactly. The rows are non-negative but do not sum to one (they have unit
output norm instead), and the matrix is bidirectional (an encoder).

The masks are the layer's own: transformers 5.24 turns the 0/1 attention mask into
``int(1 + mask / 10000)``, which is 1 for padded positions too, so YOSO attends to padding;
probe reads that as it runs (its padding checks then fail, which is the model's fault, not the
reading's). The LSH-sampling path (``use_expectation=False``) and the convolution branch
(``conv_window``) are refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from probe.errors import CaptureError
from probe.hooks.terms_kinds import TermsKind


@dataclass(frozen=True)
class KernelTerms:
    """One call of a kernelised attention layer, its input-dependent terms fixed (fp32).

    value            [batch, channel, time]    the values, channel = head * head_dim + d
    weights          [batch, head, query, key] M per head (padding as the layer masks it)
    unit_of_channel  [channel] long            the head of each channel
    key_mask         [batch, time] bool        real (not padded) positions of the input
    """

    kind: TermsKind  # YOSO: its matrices and its output
    value: torch.Tensor
    weights: torch.Tensor
    unit_of_channel: torch.Tensor
    key_mask: torch.Tensor

    @property
    def n_units(self) -> int:
        return int(self.weights.shape[1])

    def exact_matrices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """M of heads ``start..stop-1`` as the layer applies it: [batch, head, query, key] fp32."""
        assert self.kind.matrices is not None  # YOSO carries its functions
        return self.kind.matrices(self, slice(start, stop))

    def unit_matrices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """M as probe captures it: query rows at padded positions zero (a padded position's own
        output is not read); keys are kept as the layer weighs them. [batch, head, query, key] fp32."""
        matrix = self.exact_matrices(start, stop)
        return matrix * self.key_mask.to(matrix.dtype)[:, None, :, None]

    def _unit_blocks(self) -> list[tuple[int, int]]:
        return [(0, self.n_units)]

    def channel_matrices(self, exact: bool = True) -> torch.Tensor:
        """M of every channel: [batch, channel, query, key] fp32."""
        pick = self.exact_matrices if exact else self.unit_matrices
        return pick()[:, self.unit_of_channel]

    def scan_output(self, matrices: torch.Tensor | None = None) -> torch.Tensor:
        """``M x`` per channel: [batch, channel, time] fp32."""
        matrices = self.channel_matrices() if matrices is None else matrices
        return torch.einsum("bcqk,bck->bcq", matrices, self.value)


def yoso_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> KernelTerms:
    """A ``YosoSelfAttention`` with ``use_expectation`` (its expected-collision form)."""
    if not getattr(module, "use_expectation", False) or getattr(module, "use_conv", False):
        raise CaptureError(f"{type(module).__name__} with LSH sampling (use_expectation=False) or a convolution branch "
                           "(conv_window) has no exact [query, key] matrix probe reads: load it with "
                           "use_expectation=True and conv_window=None")
    batch, time, _ = hidden.shape
    heads, width = int(module.num_attention_heads), int(module.attention_head_size)

    def per_head(layer: torch.nn.Module) -> torch.Tensor:  # [batch, head, time, width]
        return layer(hidden).float().view(batch, time, heads, width).transpose(1, 2)

    query, key, value = (per_head(m) for m in (module.query, module.key, module.value))
    query, key = F.normalize(query, p=2, dim=-1), F.normalize(key, p=2, dim=-1)
    mask = torch.ones(batch, time, device=hidden.device) if attention_mask is None else attention_mask
    mask = (1.0 + mask.float() / 10000.0).int().to(query.dtype)  # the layer's own conversion
    expectation = (1 - torch.acos(query @ key.transpose(-1, -2)) / math.pi) ** int(module.hash_code_len)
    expectation = expectation * mask[:, None, :, None] * mask[:, None, None, :]  # [batch, head, query, key]
    norm = (expectation @ value).norm(dim=-1).clamp_min(1e-12)  # F.normalize's eps
    real = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 \
        else torch.ones(batch, time, dtype=torch.bool, device=hidden.device)
    return KernelTerms(kind=YOSO, value=value.transpose(2, 3).reshape(batch, heads * width, time),
                       weights=expectation / norm[..., None], key_mask=real,
                       unit_of_channel=torch.arange(heads * width, device=hidden.device) // width)


def kernel_output(module: torch.nn.Module, terms: KernelTerms, scan: torch.Tensor) -> torch.Tensor:
    """The layer's context [batch, time, channel] from ``scan`` (``M x``, [batch, channel, time]):
    YOSO's output is its normalised context itself (the output dense layer is the next module's)."""
    return scan.transpose(1, 2)


def yoso_heads(module: torch.nn.Module) -> int:
    return int(module.num_attention_heads)


def yoso_width(module: torch.nn.Module) -> int:
    return int(module.all_head_size)


YOSO = TermsKind("yoso", lambda terms, units: terms.weights[:, units], kernel_output)
