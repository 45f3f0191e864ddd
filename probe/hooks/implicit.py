"""Implicit attention: a state-space token mixer read as a ``[query, key]`` matrix.

A selective scan is linear in its value path once its input-dependent terms are fixed, so each
call of a mixer is a causal token-mixing matrix. For Mamba (``MambaMixer``, ``FalconMambaMixer``),
channel ``d`` of the inner width gives ``y_t = sum_{s<=t} M_d[t, s] x_s + D_d x_t`` with

    M_d[t, s] = sum_n C_t[n] * exp(A[d, n] * sum_{r=s+1..t} dt_r[d]) * dt_s[d] * B_s[n]

where ``x`` is the value path (in_proj, the causal conv1d, the activation, the padding mask),
``dt = softplus(dt_proj(...))``, ``A = -exp(A_log)`` and ``B, C`` come from ``x_proj`` (falcon_mamba
normalises ``dt``, ``B`` and ``C`` first). For Mamba-2 (``Mamba2Mixer``) ``A`` is one scalar per head,
so one matrix serves the head's channels:

    M_h[t, s] = (C_t . B_s) * exp(A_h * sum_{r=s+1..t} dt_r[h]) * dt_s[h]

with ``B, C`` those of the head's group (``n_groups``). The mixer's output is then
``out_proj(y * silu(gate))`` (Mamba) or ``out_proj(norm(y, gate))`` (Mamba-2's gated RMSNorm).
The hybrids' mixers are these same forms: Jamba's ``JambaMambaMixer`` is Mamba's (with dt/B/C norms),
Zamba's ``ZambaMambaMixer`` Mamba's run on separate heads of the inner width (B, C, dt per head);
``BambaMixer``, ``Zamba2MambaMixer``, ``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer`` and
``FalconH1Mixer`` (its input and muP multipliers applied first) are Mamba-2's. LFM2's gated short
convolution (``Lfm2ShortConv``) is ``y = C * conv(B * x)``, a banded matrix per channel
``M_c[t, s] = C_t[c] w_c[K-1-(t-s)] B_s[c]`` for ``0 <= t-s < K``.
RWKV's time mixing (``RwkvSelfAttention``) is a softmax per channel over the keys,
``M_c[t, s] ∝ exp(k_s + (t-1-s) w_c)`` for s < t and ``exp(u_c + k_t)`` at s = t, and its output
``output(sigmoid(r) * M v)`` (no D term).

What probe captures per layer (:func:`implicit_maps`) is ``[batch, head, query, key]`` fp32:

- Mamba-2: its own heads, each head's exact ``M_h``;
- Mamba (and RWKV, the short convolution): ``MAMBA_CHANNEL_GROUPS`` groups of consecutive channels (``d_inner / 4`` each),
  each the mean of its channels' ``M_d`` (these mixers have no heads; the groups are probe's).

These maps are signed in general (``C_t . B_s`` may be negative) and their rows do not sum to one:
methods that read rows as probabilities must not run on them. Entries with key > query are exactly
zero; keys and query rows at padded positions are zero. The exact per-channel form
(:meth:`ScanTerms.channel_matrices`, :meth:`ScanTerms.scan_output`) is there for oracles.

Everything is recomputed from the mixer's own input (a forward pre-hook) with the mixer's own
submodules; the mixer's forward runs unchanged. A mixer class is one row of :data:`MIXERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from probe.hooks import kernel_mixers, linear_mixers
from probe.hooks.terms_kinds import TermsKind

#: Mamba's channel groups read as heads (its inner width split into this many consecutive blocks)
MAMBA_CHANNEL_GROUPS = 4
#: elements of one [batch, channel, query, key, state] block of Mamba's exact form (memory bound)
_BLOCK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ScanTerms:
    """One call of a selective scan, its input-dependent terms fixed (fp32).

    A "unit" owns one decay: a channel for Mamba, a head for Mamba-2.

    value            [batch, channel, time]  x, the value path the scan mixes
    gate             [batch, channel, time]  z, the gate applied after the scan
    skip             [channel]               D
    step             [batch, unit, time]     dt (softplus, Mamba-2 also clamped to its limit)
    decay            [unit, state] (Mamba) or [unit] (Mamba-2)   A = -exp(A_log); the kernel [channel, K] (conv)
    B, C             [batch, time, state] (Mamba, shared by channels), [batch, time, channel, state]
                     (zamba: each Mamba head its own) or [batch, time, unit, state] (Mamba-2, each
                     head its group's)
    unit_of_channel  [channel] long          the unit whose matrix mixes each channel
    key_mask         [batch, time] bool      real (not padded) positions
    """

    kind: TermsKind  # MAMBA | MAMBA2 | RWKV | CONV: its matrices and its output
    value: torch.Tensor
    gate: torch.Tensor
    skip: torch.Tensor
    step: torch.Tensor
    decay: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    unit_of_channel: torch.Tensor
    key_mask: torch.Tensor

    @property
    def n_units(self) -> int:
        return int(self.step.shape[1])

    def _exponents(self, units: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_{r=s+1..t} dt_r [batch, unit, query, key] fp64, causal bool [query, key])."""
        cumulative = torch.cumsum(self.step[:, units].double(), dim=-1)  # [batch, unit, time]
        between = cumulative[..., :, None] - cumulative[..., None, :]  # [batch, unit, query, key]
        time = between.shape[-1]
        causal = torch.ones(time, time, dtype=torch.bool, device=between.device).tril()
        return between, causal

    def unit_matrices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Exact ``M`` of units ``start..stop-1``: [batch, unit, query, key] fp32, zero above the
        diagonal and at padded keys and query rows."""
        units = slice(start, self.n_units if stop is None else stop)
        assert self.kind.matrices is not None  # every kind of ScanTerms carries its functions
        return self.kind.matrices(self, units)

    def _real_only(self, matrix: torch.Tensor) -> torch.Tensor:
        """``matrix`` [batch, unit, query, key] with keys and query rows at padded positions zero."""
        real = self.key_mask.to(matrix.dtype)
        return matrix * real[:, None, None, :] * real[:, None, :, None]

    def _wkv_matrices(self, units: slice) -> torch.Tensor:
        """RWKV's WKV per channel: M_c[t, s] = exp(k_s + (t-1-s) w_c) / Z_t for s < t and
        exp(u_c + k_t) / Z_t for s = t (w = -exp(time_decay), u = time_first, k in ``B``): a softmax
        over the keys, so these rows do sum to one. [batch, channel, query, key] fp32."""
        key = self.B[:, :, units].double().transpose(1, 2)  # [batch, channel, time]
        decay, first = self.decay[units].double(), self.step[0, units, 0].double()  # [channel] each
        time = key.shape[-1]
        position = torch.arange(time, device=key.device, dtype=torch.float64)
        lag = position[:, None] - 1 - position[None, :]  # [query, key] t-1-s
        logits = key[:, :, None, :] + lag[None, None] * decay[None, :, None, None]
        diagonal = torch.eye(time, dtype=torch.bool, device=key.device)
        logits = torch.where(diagonal, (first[None, :, None] + key)[..., None, :].expand_as(logits), logits)
        logits = logits.masked_fill(~torch.ones(time, time, dtype=torch.bool, device=key.device).tril(), -torch.inf)
        return self._real_only(torch.softmax(logits, dim=-1).float())

    def _conv_matrices(self, units: slice) -> torch.Tensor:
        """A gated short convolution per channel: M_c[t, s] = C_t[c] * w_c[K-1-(t-s)] * B_s[c] for
        0 <= t-s < K (``decay`` holds the kernel w [channel, K]), zero elsewhere: banded, signed.
        [batch, channel, query, key] fp32."""
        kernel = self.decay[units].float()  # [channel, K]
        width = kernel.shape[-1]
        time = self.B.shape[1]
        position = torch.arange(time, device=kernel.device)
        lag = position[:, None] - position[None, :]  # [query, key] t - s
        band = (lag >= 0) & (lag < width)
        taps = kernel[:, (width - 1 - lag).clamp(0, width - 1)] * band  # [channel, query, key]
        query_gate = self.C[:, :, units].transpose(1, 2)  # [batch, channel, time]
        key_gate = self.B[:, :, units].transpose(1, 2)
        return self._real_only(query_gate[..., :, None] * taps[None] * key_gate[..., None, :])

    def _unit_blocks(self) -> list[tuple[int, int]]:
        batch, _, time = self.step.shape
        per_unit = batch * time * time * (self.B.shape[-1] if self.kind.per_state else 1)
        size = max(1, _BLOCK_ELEMENTS // max(per_unit, 1))
        return [(start, min(start + size, self.n_units)) for start in range(0, self.n_units, size)]

    def channel_matrices(self) -> torch.Tensor:
        """Exact ``M`` of every channel: [batch, channel, query, key] fp32 (memory: channels x T^2)."""
        units = torch.cat([self.unit_matrices(a, b) for a, b in self._unit_blocks()], dim=1)
        return units[:, self.unit_of_channel]

    def scan_output(self, matrices: torch.Tensor | None = None) -> torch.Tensor:
        """y = M x + D x per channel, before the gate: [batch, channel, time] fp32."""
        matrices = self.channel_matrices() if matrices is None else matrices
        mixed = torch.einsum("bcqk,bck->bcq", matrices, self.value)
        return mixed + self.skip[None, :, None] * self.value


def _mamba_matrices(terms: ScanTerms, units: slice) -> torch.Tensor:
    """Mamba's (and Zamba's) ``M_d``: a state axis per channel, B and C shared or per channel."""
    between, causal = terms._exponents(units)
    step = terms.step[:, units]  # [batch, unit, time]
    decay = terms.decay[units].double()  # [unit, state]
    exponent = between[..., None] * decay[None, :, None, None, :]  # [batch, unit, query, key, state]
    exponent = exponent.masked_fill(~causal[..., None], -torch.inf)
    weights = torch.exp(exponent).float()
    if terms.B.dim() == 4:  # B, C per channel (zamba's heads)
        matrix = torch.einsum("bquN,buqkN,bkuN->buqk", terms.C[:, :, units], weights, terms.B[:, :, units])
    else:
        matrix = torch.einsum("bqN,buqkN,bkN->buqk", terms.C, weights, terms.B)
    return terms._real_only(matrix * step[:, :, None, :])


def _mamba2_matrices(terms: ScanTerms, units: slice) -> torch.Tensor:
    """Mamba-2's ``M_h``: one scalar decay per head, B and C of the head's group."""
    between, causal = terms._exponents(units)
    step = terms.step[:, units]  # [batch, unit, time]
    decay = terms.decay[units].double()[None, :, None, None]  # [1, unit, 1, 1]
    exponent = (decay * between).masked_fill(~causal, -torch.inf)
    scores = torch.einsum("bquN,bkuN->buqk", terms.C[:, :, units], terms.B[:, :, units])
    return terms._real_only(scores * torch.exp(exponent).float() * step[:, :, None, :])


def _gated_output(module, terms: ScanTerms, scan: torch.Tensor) -> torch.Tensor:
    """Mamba's ``out_proj(y * silu(z))``."""
    return module.out_proj((scan * F.silu(terms.gate)).transpose(1, 2))


def _mamba2_output(module, terms: ScanTerms, scan: torch.Tensor) -> torch.Tensor:
    """Mamba-2's ``out_proj(norm(y, z))`` (its gated RMSNorm), or Mamba's gate where it has no norm."""
    if isinstance(module.norm, torch.nn.Identity):
        return _gated_output(module, terms, scan)
    return module.out_proj(module.norm(scan.transpose(1, 2), terms.gate.transpose(1, 2)))


def _rwkv_output(module, terms: ScanTerms, scan: torch.Tensor) -> torch.Tensor:
    """RWKV's ``output(sigmoid(r) * M v)``."""
    return module.output((terms.gate * scan).transpose(1, 2))


def _conv_output(module, terms: ScanTerms, scan: torch.Tensor) -> torch.Tensor:
    """The short convolution's ``out_proj(C * conv(B x))``."""
    bias = module.conv.bias
    if bias is not None:  # C_t * b: the conv's bias, gated by the query side, mixes nothing
        scan = scan + terms.gate * bias.float()[None, :, None]
    return module.out_proj(scan.transpose(1, 2))


MAMBA = TermsKind("mamba", _mamba_matrices, _gated_output, per_state=True)
MAMBA2 = TermsKind("mamba2", _mamba2_matrices, _mamba2_output, own_heads=True)
RWKV = TermsKind("rwkv", ScanTerms._wkv_matrices, _rwkv_output)
CONV = TermsKind("conv", ScanTerms._conv_matrices, _conv_output)


def _real(attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """[batch, time] bool: the positions the mask keeps (all, without a mask)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    return attention_mask.bool().to(hidden.device)


def _zero_padding(states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``states`` [batch, time, width] with padded positions zero, as the mixers do (2-D masks only)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return states
    return (states * attention_mask[:, :, None]).to(states.dtype)


def _causal_conv(module, states: torch.Tensor) -> torch.Tensor:
    """The mixer's depthwise causal conv1d and activation: [batch, width, time] -> same."""
    time = states.shape[-1]
    conv = module.conv1d
    out = F.conv1d(states.to(conv.weight.dtype), conv.weight, conv.bias, padding=conv.kernel_size[0] - 1,
                   groups=conv.groups)[..., :time]
    return module.act(out)


def mamba_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> ScanTerms:
    """A ``MambaMixer`` (or ``FalconMambaMixer``: its dt/B/C norms where the module has them)."""
    hidden = _zero_padding(hidden, attention_mask)
    value, gate = module.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # [batch, d_inner, time] each
    value = _zero_padding(_causal_conv(module, value).transpose(1, 2), attention_mask)  # [batch, time, d_inner]
    rank, state = int(module.time_step_rank), int(module.ssm_state_size)
    step, B, C = torch.split(module.x_proj(value), [rank, state, state], dim=-1)
    if getattr(module, "dt_layernorm", None) is not None:  # falcon_mamba: weightless RMS norms on dt, B, C
        step, B, C = module.dt_layernorm(step), module.b_layernorm(B), module.c_layernorm(C)
    step = step @ module.dt_proj.weight.transpose(0, 1)  # [batch, time, d_inner]
    if module.dt_proj.bias is not None:
        step = step + module.dt_proj.bias
    channels = value.shape[-1]
    return ScanTerms(
        kind=MAMBA, value=value.transpose(1, 2).float(), gate=gate.float(), skip=module.D.float(),
        step=F.softplus(step.float()).transpose(1, 2), decay=-torch.exp(module.A_log.float()),
        B=B.float(), C=C.float(), unit_of_channel=torch.arange(channels, device=value.device),
        key_mask=_real(attention_mask, hidden))


def zamba_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> ScanTerms:
    """A ``ZambaMambaMixer``: Mamba's scan run on ``n_mamba_heads`` heads of the inner width, each
    with its own ``x_proj`` and ``dt_proj``, so ``B`` and ``C`` are per head (kept per channel:
    [batch, time, channel, state]). ``in_proj`` interleaves value and gate channel by channel."""
    hidden = _zero_padding(hidden, attention_mask)
    batch, time, _ = hidden.shape
    heads, width = int(module.n_mamba_heads), int(module.mamba_head_dim)
    rank, state = int(module.time_step_rank), int(module.ssm_state_size)
    value, gate = module.in_proj(hidden).transpose(1, 2).reshape(batch, -1, 2, time).unbind(2)  # [batch, inner, time]
    # [batch, time, inner]
    value = _zero_padding(_causal_conv(module, value.contiguous()).transpose(1, 2), attention_mask)
    per_head = value.reshape(batch, time, heads, width)
    params = torch.einsum("hpw,bthw->bthp", module.x_proj_weight, per_head)  # [batch, time, head, rank + 2 state]
    step, B, C = torch.split(params, [rank, state, state], dim=-1)
    # [batch, time, head, width]
    step = torch.einsum("hwr,bthr->bthw", module.dt_proj_weight, step) + module.dt_proj_bias

    def per_channel(t: torch.Tensor) -> torch.Tensor:  # [batch, time, head, state] -> [batch, time, channel, state]
        return t.float().repeat_interleave(width, dim=2)

    channels = heads * width
    return ScanTerms(
        kind=MAMBA, value=value.transpose(1, 2).float(), gate=gate.float(), skip=module.D.float().reshape(channels),
        step=F.softplus(step.float()).reshape(batch, time, channels).transpose(1, 2),
        decay=-torch.exp(module.A_log.float()).reshape(channels, state), B=per_channel(B), C=per_channel(C),
        unit_of_channel=torch.arange(channels, device=value.device), key_mask=_real(attention_mask, hidden))


def mamba2_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> ScanTerms:
    """A ``Mamba2Mixer`` (and the hybrids' copies of it: bamba, zamba2, nemotron_h, granitemoehybrid,
    falcon_h1 with its input and muP multipliers): scalar decay per head, B and C per group of heads."""
    hidden = _zero_padding(hidden, attention_mask)
    inner, heads, groups = int(module.intermediate_size), int(module.num_heads), int(module.n_groups)
    state = int(module.ssm_state_size)
    projected = module.in_proj(hidden * getattr(module, "ssm_in_multiplier", 1.0))
    if isinstance(getattr(module, "mup_vector", None), torch.Tensor):  # falcon_h1's muP multipliers
        projected = projected * module.mup_vector
    gate, mixed, step = projected.split([inner, module.conv_dim, heads], dim=-1)
    mixed = _zero_padding(_causal_conv(module, mixed.transpose(1, 2)).transpose(1, 2), attention_mask)
    value, B, C = torch.split(mixed, [inner, groups * state, groups * state], dim=-1)
    batch, time = value.shape[:2]
    step = F.softplus(step.float() + module.dt_bias.float())  # [batch, time, head]
    low, high = module.time_step_limit  # type: ignore[misc]  # a tuple (nn.Module.__getattr__ says Tensor | Module)
    step = torch.clamp(step, min=low, max=high)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [batch, time, group * state] -> [batch, time, head, state]
        return t.float().view(batch, time, groups, state).repeat_interleave(heads // groups, dim=2)

    head_of_channel = torch.arange(inner, device=value.device) // int(module.head_dim)
    return ScanTerms(
        kind=MAMBA2, value=value.transpose(1, 2).float(), gate=gate.transpose(1, 2).float(),
        skip=module.D.float()[head_of_channel], step=step.transpose(1, 2), decay=-torch.exp(module.A_log.float()),
        B=per_head(B), C=per_head(C), unit_of_channel=head_of_channel, key_mask=_real(attention_mask, hidden))


def rwkv_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> ScanTerms:
    """An ``RwkvSelfAttention`` (time mixing): value and key from the token-shifted input, the
    receptance sigmoid(r) as the gate; ``B`` holds the keys, ``decay`` w = -exp(time_decay) and
    ``step`` carries time_first (u) per channel. No skip term: D = 0."""
    shifted = module.time_shift(hidden)  # [batch, time, hidden], the previous position's (0 at the first)

    def mix(weight):
        return hidden * weight + shifted * (1 - weight)

    key = module.key(mix(module.time_mix_key)).float()  # [batch, time, channel]
    value = module.value(mix(module.time_mix_value)).float()
    receptance = torch.sigmoid(module.receptance(mix(module.time_mix_receptance))).float()
    batch, time, channels = key.shape
    first = module.time_first.float()[None, :, None].expand(batch, channels, time)
    return ScanTerms(
        kind=RWKV, value=value.transpose(1, 2), gate=receptance.transpose(1, 2),
        skip=torch.zeros(channels, device=key.device), step=first, decay=-torch.exp(module.time_decay.float()),
        B=key, C=key, unit_of_channel=torch.arange(channels, device=key.device), key_mask=_real(attention_mask, hidden))


def short_conv_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> ScanTerms:
    """An ``Lfm2ShortConv``: ``in_proj`` gives B, C and x per channel, then y = C * conv(B * x), a
    causal depthwise convolution of kernel w: so y_t = sum_s C_t w[K-1-(t-s)] B_s x_s (+ C_t b with a
    conv bias, no mixing). ``B`` and ``C`` are the key and query gates [batch, time, channel],
    ``decay`` the kernel [channel, K]; no skip term."""
    hidden = _zero_padding(hidden, attention_mask)
    B, C, value = module.in_proj(hidden).float().chunk(3, dim=-1)  # [batch, time, channel] each
    batch, time, channels = value.shape
    return ScanTerms(
        kind=CONV, value=value.transpose(1, 2), gate=C.transpose(1, 2), skip=torch.zeros(channels, device=value.device),
        step=torch.ones(batch, channels, time, device=value.device), decay=module.conv.weight[:, 0].float(),
        B=B, C=C, unit_of_channel=torch.arange(channels, device=value.device), key_mask=_real(attention_mask, hidden))


def mixer_output(module: torch.nn.Module, terms: ScanTerms, scan: torch.Tensor | None = None) -> torch.Tensor:
    """The mixer's output [batch, time, hidden] rebuilt from its matrices: ``scan`` (``y = M x + D x``
    [batch, channel, time], by default :meth:`ScanTerms.scan_output`) through the mixer's own gate and
    output projection (its terms kind's ``output``). An oracle: equal to the module's output, the
    matrices are its mixing."""
    scan = terms.scan_output() if scan is None else scan
    assert terms.kind.output is not None  # every kind of ScanTerms carries its functions
    return terms.kind.output(module, terms, scan)


def _width(module) -> int:
    """Channels a mixer's scan mixes."""
    if hasattr(module, "intermediate_size"):
        return int(module.intermediate_size)
    if hasattr(module, "key"):  # rwkv
        return int(module.key.out_features)
    return int(module.out_proj.in_features)  # a short convolution


def _mamba_heads(module) -> int:
    channels = _width(module)
    return MAMBA_CHANNEL_GROUPS if channels % MAMBA_CHANNEL_GROUPS == 0 else 1


def _zamba_heads(module: torch.nn.Module) -> int:
    return int(module.n_mamba_heads)


def _mamba2_heads(module: torch.nn.Module) -> int:
    return int(module.num_heads)


@dataclass(frozen=True)
class MixerKind:
    """One family of token mixers probe reads as implicit attention."""

    name: str
    classes: tuple[str, ...]  # module class names
    terms: Callable[..., ScanTerms]  # (module, hidden [batch, time, hidden], 2-D mask | None) -> ScanTerms
    heads: Callable[[object], int]  # the number of map heads of a module
    heads_are: str  # what a map head is, for the contract
    width: Callable[[object], int] | None = None  # channels the mixer mixes (default: _width)
    causal: bool = True  # False: an encoder's mixer, every query reads every key
    mask_arg: int = 2  # the position of the attention mask among the forward's positional arguments
    takes_mask: bool = True  # False: the model never hands the mixer its padding mask (the capture's is used)

    def head_width(self, module: torch.nn.Module) -> int:
        """Channels per map head."""
        return (self.width or _width)(module) // self.heads(module)


MIXERS: tuple[MixerKind, ...] = (
    MixerKind("mamba selective scan", ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer"), mamba_terms,
              _mamba_heads,
              f"{MAMBA_CHANNEL_GROUPS} groups of consecutive channels, each the mean of its channels' matrices"),
    MixerKind("zamba multi-head selective scan", ("ZambaMambaMixer",), zamba_terms, _zamba_heads,
              "the mixer's mamba heads, each the mean of its channels' matrices"),
    MixerKind("mamba2 selective scan", ("Mamba2Mixer", "BambaMixer", "Zamba2MambaMixer", "FalconH1Mixer",
                                        "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer"),
              mamba2_terms, _mamba2_heads, "the mixer's own heads"),
    MixerKind("gated short convolution", ("Lfm2ShortConv",), short_conv_terms, _mamba_heads,
              f"{MAMBA_CHANNEL_GROUPS} groups of consecutive channels, each the mean of its channels' matrices"),
    MixerKind("rwkv wkv", ("RwkvSelfAttention",), rwkv_terms, _mamba_heads,
              f"{MAMBA_CHANNEL_GROUPS} groups of consecutive channels, each the mean of its channels' matrices",
              takes_mask=False),
    MixerKind("rg-lru recurrence", ("RecurrentGemmaRecurrentBlock",), linear_mixers.rglru_terms,
              linear_mixers.rglru_heads, "the RG-LRU's gate heads, each the mean of its channels' matrices (conv "
                                         "folded in)",
              linear_mixers.rglru_width),
    MixerKind("gated deltanet", ("Qwen3NextGatedDeltaNet",), linear_mixers.gated_deltanet_terms,
              linear_mixers.deltanet_heads, "the mixer's value heads", linear_mixers.deltanet_width),
    MixerKind("kimi delta attention", ("KimiLinearDeltaAttention",), linear_mixers.kimi_delta_terms,
              linear_mixers.kimi_delta_heads, "the mixer's own heads", linear_mixers.kimi_delta_width),
    MixerKind("yoso expected-collision attention", ("YosoSelfAttention",), kernel_mixers.yoso_terms,
              kernel_mixers.yoso_heads, "the layer's own heads", kernel_mixers.yoso_width, causal=False, mask_arg=1),
    MixerKind("lightning attention", ("MiniMaxLightningAttention",), linear_mixers.lightning_terms,
              linear_mixers.lightning_heads, "the mixer's own heads", linear_mixers.lightning_width),
    MixerKind("mlstm matrix memory", ("xLSTMLayer",), linear_mixers.mlstm_terms, linear_mixers.mlstm_heads,
              "the layer's own heads", linear_mixers.mlstm_width, takes_mask=False),
)


def mixer_kind(module: torch.nn.Module) -> MixerKind | None:
    """The row of :data:`MIXERS` for ``module``'s class, or None."""
    name = type(module).__name__
    return next((kind for kind in MIXERS if name in kind.classes), None)


def find_mixers(model: torch.nn.Module) -> list[tuple[str, MixerKind]]:
    """(path, kind) of every mixer module of ``model``, in module order (a stack's layer order)."""
    return [(path, kind) for path, module in model.named_modules() if (kind := mixer_kind(module)) is not None]


def call_inputs(module: torch.nn.Module, args: tuple,
                kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(hidden states, attention mask) a mixer's forward is called with (a forward pre-hook's view)."""
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("hidden"))
    at = kind.mask_arg if (kind := mixer_kind(module)) is not None else 2
    mask = kwargs.get("attention_mask", args[at] if len(args) > at else None)
    return hidden, mask if isinstance(mask, torch.Tensor) else None


def continues_a_state(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this call continues a cached recurrent state (a generation step): its matrix over
    the call's own tokens would miss the past, so probe refuses to read it."""
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    if cache is None or not hasattr(cache, "get_recurrent_state"):
        return False
    try:
        return cache.get_recurrent_state(module.layer_idx, state_idx=0) is not None
    except (AttributeError, IndexError, KeyError, TypeError):
        return False


def group_maps(terms: ScanTerms, heads: int) -> torch.Tensor:
    """The maps probe captures: [batch, head, query, key] fp32. Mamba-2 (one unit per head): its
    units' exact matrices; Mamba: the mean over each group of ``channels / heads`` consecutive channels."""
    if terms.kind.own_heads and terms.n_units == heads:
        return torch.cat([terms.unit_matrices(a, b) for a, b in terms._unit_blocks()], dim=1)
    width = terms.n_units // heads
    sums = None
    for a, b in terms._unit_blocks():
        block = terms.unit_matrices(a, b)  # [batch, unit, query, key]
        group = torch.arange(a, b, device=block.device) // width
        part = torch.zeros(block.shape[0], heads, *block.shape[2:], dtype=block.dtype, device=block.device)
        part = part.index_add(1, group, block)
        sums = part if sums is None else sums + part
    assert sums is not None  # the blocks cover every unit, at least one
    return sums / width


def implicit_maps(module: torch.nn.Module, kind: MixerKind, hidden: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(maps [batch, head, query, key] fp32, has_keys [batch, head, query] bool) of one mixer call:
    a query row has keys where its own position is real."""
    terms = kind.terms(module, hidden, attention_mask)
    maps = group_maps(terms, kind.heads(module))
    has_keys = terms.key_mask[:, None, :].expand(maps.shape[0], maps.shape[1], maps.shape[2])
    return maps, has_keys
