"""Implicit attention of linear-recurrent token mixers: Griffin's RG-LRU block, the gated DeltaNet,
lightning attention, xLSTM's mLSTM.

Like the selective scans of :mod:`probe.hooks.implicit`, these mixers are linear in a value path
once their input-dependent terms (gates, decays, keys, queries) are fixed, so each call is a causal
``[query, key]`` matrix ``M``: row ``t`` says how much of each earlier position's value reaches
position ``t``. The rows are signed in general and do not sum to one.

RecurrentGemma's recurrent block (``RecurrentGemmaRecurrentBlock``, Griffin/Hawk). The block is
``linear_out(lru(conv(x)) * act(linear_y(u)))`` with ``x = linear_x(u)``, a depthwise causal conv1d
(no activation after it) and the real-gated linear recurrence, per channel,

    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t c_t,   a_t = exp(-8 r_t softplus(Lambda)),

where ``c = conv(x)``, ``i_t, r_t`` are sigmoid gates of ``c_t`` (block-diagonal per gate head) and a
reset (``position_ids == 0``) sets ``a_t = 0`` and the ``sqrt`` factor to 1. Its matrix over ``c`` is

    L_d[t, s] = prod_{r=s+1..t} a_r[d] * sqrt(1 - a_s[d]^2) * i_s[d]     (s <= t, no reset in (s, t])

and since the conv is linear it is **folded in**: with the conv as a banded matrix
``K_d[s, r] = w_d[r - s + width - 1]`` (``0 <= s - r < width``),

    M_d = L_d K_d,   lru(conv(x))_d = M_d x_d + b_d * L_d 1     (b: the conv's bias)

so ``M`` is over the block's own input projection ``x`` (every token a query row reaches, the conv's
window included); the bias term is carried by no token (``LinearTerms.offset``). The unfolded ``L``
is there too (``fold_conv=False``). Probe's map heads are the RG-LRU's gate heads
(``num_attention_heads`` blocks of ``lru_width / heads`` channels), each the mean of its channels.
The block ignores the padding mask (right padding cannot reach a real query; rows and keys at
padded positions are zero in the maps, the exact matrices keep them) and reads resets from
``position_ids``; what probe captures assumes the model's own default, a reset at position 0 only.
(At a reset mid-row ``L`` is zero across it, but the folded ``M`` is not: the block's conv never
resets, so it reaches ``width - 1`` keys back across it, as the block itself does.)

Qwen3-Next's gated DeltaNet (``Qwen3NextGatedDeltaNet``). Per value head, with ``q, k`` l2-normalised
(``q`` also scaled by ``d_k^-1/2``), ``beta = sigmoid(b)``, ``alpha = exp(g)``,
``g = -exp(A_log) softplus(a + dt_bias)``, the delta rule's state is
``S_t = A_t S_{t-1} + beta_t k_t v_t^T`` with ``A_t = alpha_t (I - beta_t k_t k_t^T)`` and ``o_t = S_t^T q_t``, so

    M_h[t, s] = q_t^T A_t A_{t-1} ... A_{s+1} k_s beta_s                  (s <= t)

computed in closed form (the WY/UT form of the chunked kernel, over the whole sequence):

    M_h = (Q K^T * G) (I + strict_lower(diag(beta) K K^T * G))^{-1} diag(beta),  G[t, s] = exp(sum_{r=s+1..t} g_r)

The value path is ``v`` after the conv1d and its SiLU, the output ``out_proj(norm(M v, z))`` (the
gated RMSNorm per head). Probe's map heads are the value heads, each its exact ``M_h``.

MiniMax's lightning attention (``MiniMaxLightningAttention``): linear attention with a fixed decay
``lambda_h`` per head (``slope_rate``), no normalisation; the blocked kernel's intra- and inter-block
decays compose to one exponential, so per head

    M_h[t, s] = (q_t . k_s) exp(-lambda_h (t - s))                      (s <= t)

with ``q, k, v = act(qkv_proj(u))`` (padded positions zero). The output is
``out_proj(sigmoid(output_gate(u)) * norm(M v))``, the RMSNorm over all heads' channels together.
Probe's map heads are the mixer's heads, each its exact ``M_h``.

xLSTM's mLSTM layer (``xLSTMLayer``, the torch fallback's maths). Per head, with the input gate
``i`` a pre-activation (an exponential gate), the forget gate ``log f = logsigmoid(f_pre)`` (both
soft-capped), ``q`` scaled by ``d_qk^-1/2``, the memory ``C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T``
and normaliser ``n_t = f_t n_{t-1} + exp(i_t) k_t`` give ``h_t = C_t^T q_t / max(|n_t . q_t|, 1)``,
computed stabilised by the running maximum ``m_t = max(log f_t + m_{t-1}, i_t)`` (``m_{-1} = 0``).
With ``D[t, s] = sum_{r=s+1..t} log f_r + i_s`` that is, per head,

    S_h[t, s] = (q_t . k_s) exp(D[t, s] - m_t),   M_h[t, s] = S_h[t, s] / (max(|sum_s S_h[t, s]|, exp(-m_t)) + eps)

(the normaliser is a property of the row, so ``h = M v`` exactly). The output is
``out_proj(sigmoid(o) * norm(h))`` with the per-head layer norm. The layer takes no padding mask
(right padding cannot reach a real query). Probe's map heads are the layer's heads, each its exact ``M_h``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from probe.hooks.terms_kinds import TermsKind

#: elements of one [batch, unit, query, key] block of exact matrices (memory bound)
_BLOCK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LinearTerms:
    """One call of a linear-recurrent mixer, its input-dependent terms fixed (fp32 unless noted).

    A "unit" owns one matrix: a channel for the RG-LRU, a value head for the DeltaNet.

    value            [batch, channel, time]  the value path M mixes
    gate             [batch, channel, time]  act(linear_y(u)) (RG-LRU) or z of the gated norm (DeltaNet)
    offset           [batch, channel, time]  what the scan adds that no token's value carries (conv bias)
    unit_of_channel  [channel] long          the unit whose matrix mixes each channel
    key_mask         [batch, time] bool      real (not padded) positions
    RG-LRU:   log_decay [batch, channel, time] fp64 (log a_t), input_scale [batch, channel, time]
              (sqrt(1 - a^2) i, 1 at resets), segment [batch, time] long (resets so far),
              conv_weight [channel, width] (None: M over the conv's output), conv_bias [channel] | None
    DeltaNet: query, key [batch, unit, time, d_k], beta, log_decay [batch, unit, time] (g);
              Kimi's delta attention the same with log_decay [batch, unit, time, d_k] (a decay per key channel)
    lightning: query, key [batch, unit, time, d_k], log_decay [batch, unit, time] (-lambda_h at every step)
    mLSTM:    query (scaled), key [batch, unit, time, d_k], log_decay [batch, unit, time] (log f),
              input_scale [batch, unit, time] (the input gate's pre-activation i), eps
    """

    kind: TermsKind  # RGLRU | GATED_DELTANET | KIMI_DELTA | LIGHTNING | MLSTM: its matrices and its output
    value: torch.Tensor
    gate: torch.Tensor
    offset: torch.Tensor
    unit_of_channel: torch.Tensor
    key_mask: torch.Tensor
    log_decay: torch.Tensor
    input_scale: torch.Tensor | None = None
    segment: torch.Tensor | None = None
    conv_weight: torch.Tensor | None = None
    query: torch.Tensor | None = None
    key: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    eps: float = 0.0

    @property
    def n_units(self) -> int:
        return int(self.log_decay.shape[1])

    def exact_matrices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Exact ``M`` of units ``start..stop-1`` at every position, padding included:
        [batch, unit, query, key] fp32, zero above the diagonal."""
        units = slice(start, self.n_units if stop is None else stop)
        assert self.kind.matrices is not None  # every kind of LinearTerms carries its functions
        return self.kind.matrices(self, units).float()

    def unit_matrices(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``M`` as probe captures it: :meth:`exact_matrices` with keys and query rows at padded
        positions zero. [batch, unit, query, key] fp32."""
        matrix = self.exact_matrices(start, stop)
        real = self.key_mask.to(matrix.dtype)
        return matrix * real[:, None, None, :] * real[:, None, :, None]

    def _causal(self, time: int) -> torch.Tensor:
        return torch.ones(time, time, dtype=torch.bool, device=self.value.device).tril()  # [query, key]

    def _lru_matrices(self, units: slice, fold: bool) -> torch.Tensor:
        """L (or L K with the conv folded in): [batch, channel, query, key] fp64."""
        log_decay = self.log_decay[:, units]  # [batch, channel, time] fp64
        time = log_decay.shape[-1]
        cumulative = torch.cumsum(log_decay, dim=-1)
        exponent = cumulative[..., :, None] - cumulative[..., None, :]  # [batch, channel, query, key]
        # a reset r in (s, t] sets a_r = 0: the product is zero across a segment boundary
        same_segment = self.segment[:, :, None] == self.segment[:, None, :]  # [batch, query, key]
        allowed = self._causal(time)[None] & same_segment
        exponent = exponent.masked_fill(~allowed[:, None], -torch.inf)
        matrix = torch.exp(exponent) * self.input_scale[:, units].double()[:, :, None, :]
        if not fold:
            return matrix
        return matrix @ self._conv_band(units)[None]  # [batch, channel, query, key]

    def _conv_band(self, units: slice) -> torch.Tensor:
        """The depthwise causal conv as banded matrices K_d[s, r] = w_d[r - s + width - 1]: [channel, time, time] fp64."""
        weight = self.conv_weight[units].double()  # [channel, width]
        width, time = weight.shape[-1], self.value.shape[-1]
        position = torch.arange(time, device=weight.device)
        tap = position[None, :] - position[:, None] + width - 1  # [s, r]
        inside = (tap >= 0) & (tap < width)
        band = weight[:, tap.clamp(0, width - 1)]  # [channel, s, r]
        return band * inside[None].to(band.dtype)

    def _decays(self, units: slice) -> torch.Tensor:
        """G[t, s] = exp(sum_{r=s+1..t} log_decay_r), zero above the diagonal: [batch, head, query, key] fp64."""
        cumulative = torch.cumsum(self.log_decay[:, units].double(), dim=-1)
        causal = self._causal(cumulative.shape[-1])
        return torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, -torch.inf))

    def _lightning_matrices(self, units: slice) -> torch.Tensor:
        """Decayed linear attention: (Q K^T) * G, [batch, head, query, key] fp64."""
        query, key = self.query[:, units].double(), self.key[:, units].double()  # [batch, head, time, d_k]
        return (query @ key.transpose(-1, -2)) * self._decays(units)

    def _mlstm_matrices(self, units: slice) -> torch.Tensor:
        """The mLSTM's stabilised, normalised decayed attention: [batch, head, query, key] fp64."""
        query, key = self.query[:, units].double(), self.key[:, units].double()  # [batch, head, time, d_k]
        gate = self.input_scale[:, units].double()  # [batch, head, time] i
        cumulative = torch.cumsum(self.log_decay[:, units].double(), dim=-1)  # F_t = sum_{r<=t} log f_r
        causal = self._causal(cumulative.shape[-1])
        exponent = (cumulative[..., :, None] - cumulative[..., None, :] + gate[..., None, :]).masked_fill(~causal, -torch.inf)
        # m_t = max(F_t + m_{-1}, max_s D[t, s]), the recurrence's stabiliser from m_{-1} = 0
        stabiliser = torch.maximum(cumulative, exponent.amax(dim=-1))  # [batch, head, query]
        scores = (query @ key.transpose(-1, -2)) * torch.exp(exponent - stabiliser[..., None])
        denominator = torch.maximum(scores.sum(-1).abs(), torch.exp(-stabiliser)) + self.eps
        return scores / denominator[..., None]

    def _delta_matrices(self, units: slice) -> torch.Tensor:
        """The delta rule's M in closed form: [batch, head, query, key] fp64."""
        query, key = self.query[:, units].double(), self.key[:, units].double()  # [batch, head, time, d_k]
        beta = self.beta[:, units].double()  # [batch, head, time]
        if self.log_decay.dim() == 4:  # a decay per key channel (Kimi): G inside the products
            qk, kk = self._channel_decayed(query, key, units)
        else:
            decay = self._decays(units)  # [batch, head, query, key] G
            qk, kk = (query @ key.transpose(-1, -2)) * decay, (key @ key.transpose(-1, -2)) * decay
        time = qk.shape[-1]
        strict = (beta[..., :, None] * kk).tril(-1)
        eye = torch.eye(time, dtype=strict.dtype, device=strict.device)
        solved = torch.linalg.solve_triangular(eye + strict, torch.diag_embed(beta), upper=False, unitriangular=True)
        return qk @ solved

    def _channel_decayed(self, query: torch.Tensor, key: torch.Tensor, units: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``sum_c q_t[c] k_s[c] G_c[t, s]`` and ``sum_c k_t[c] k_s[c] G_c[t, s]`` with
        ``G_c[t, s] = exp(sum_{r=s+1..t} g_r[c])`` (zero above the diagonal): [batch, head, query, key] fp64."""
        cumulative = torch.cumsum(self.log_decay[:, units].double(), dim=2)  # [batch, head, time, d_k]
        time = cumulative.shape[2]
        causal = self._causal(time)
        exponent = (cumulative[:, :, :, None] - cumulative[:, :, None, :]).masked_fill(~causal[..., None], -torch.inf)
        decay = torch.exp(exponent)  # [batch, head, query, key, d_k]
        return (torch.einsum("bhqc,bhkc,bhqkc->bhqk", query, key, decay),
                torch.einsum("bhqc,bhkc,bhqkc->bhqk", key, key, decay))

    def _unit_blocks(self) -> list[tuple[int, int]]:
        batch, _, time = self.value.shape
        per_unit = batch * time * time * (int(self.log_decay.shape[-1]) if self.log_decay.dim() == 4 else 1)
        size = max(1, _BLOCK_ELEMENTS // max(per_unit, 1))
        return [(start, min(start + size, self.n_units)) for start in range(0, self.n_units, size)]

    def channel_matrices(self, exact: bool = True) -> torch.Tensor:
        """``M`` of every channel: [batch, channel, query, key] fp32 (memory: channels x T^2)."""
        pick = self.exact_matrices if exact else self.unit_matrices
        units = torch.cat([pick(a, b) for a, b in self._unit_blocks()], dim=1)
        return units[:, self.unit_of_channel]

    def scan_output(self, matrices: torch.Tensor | None = None) -> torch.Tensor:
        """The mixed value path ``M x + offset`` per channel, before the gate: [batch, channel, time] fp32."""
        matrices = self.channel_matrices() if matrices is None else matrices
        return torch.einsum("bcqk,bck->bcq", matrices, self.value) + self.offset


def _key_mask(attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """[batch, time] bool real positions: a 2-D padding mask, or the diagonal of a 4-D one (a key is
    padding exactly where its own query may not see it); all real without a mask."""
    batch, time = hidden.shape[:2]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask.bool().to(hidden.device)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[-1] == time \
            and attention_mask.shape[-2] == time:
        diagonal = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [batch or 1, time]
        if diagonal.dtype != torch.bool:
            diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
        return diagonal.expand(batch, time).to(hidden.device)
    return torch.ones(batch, time, dtype=torch.bool, device=hidden.device)


def rglru_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None, fold_conv: bool = True) -> LinearTerms:
    """A ``RecurrentGemmaRecurrentBlock``. ``position_ids`` [batch or 1, time] (the block's resets are
    where they are 0; default: 0 at the first position only, the model's own default);
    ``fold_conv``: M over ``linear_x``'s output (the conv folded in) or over the conv's output."""
    batch, time = hidden.shape[:2]
    lru = module.rg_lru
    gate = module.act_fn(module.linear_y(hidden))  # [batch, time, width]
    projected = module.linear_x(hidden)  # [batch, time, width]
    conv = module.conv_1d
    convolved = F.conv1d(projected.transpose(1, 2), conv.weight, conv.bias, padding=conv.kernel_size[0] - 1,
                         groups=conv.groups)[..., :time]  # [batch, width, time]
    activations = convolved.transpose(1, 2)  # [batch, time, width]
    heads, block = int(lru.num_attention_heads), int(lru.block_width)
    per_head = activations.reshape(batch, time, heads, block)
    input_gate = torch.sigmoid(torch.einsum("bthi,hij->bthj", per_head, lru.input_gate_weight)
                               + lru.input_gate_bias).reshape(batch, time, -1)
    recurrent_gate = torch.sigmoid(torch.einsum("bthi,hij->bthj", per_head, lru.recurrent_gate_weight)
                                   + lru.recurrent_gate_bias).reshape(batch, time, -1)
    log_decay = -8.0 * recurrent_gate.double() * F.softplus(lru.recurrent_param.double())  # [batch, time, width]
    if position_ids is None:
        position_ids = torch.arange(time, device=hidden.device)[None]
    reset = (position_ids == 0).expand(batch, time).to(hidden.device)  # [batch, time]
    scale = torch.sqrt(1 - torch.exp(2 * log_decay)).masked_fill(reset[..., None], 1.0) * input_gate.double()
    log_decay = log_decay.masked_fill(reset[..., None], 0.0)  # a_t = 0 there: handled by the segments
    width = activations.shape[-1]
    unfolded = LinearTerms(
        kind=RGLRU, value=activations.transpose(1, 2).float(), gate=gate.transpose(1, 2).float(),
        offset=torch.zeros(batch, width, time, device=hidden.device),
        unit_of_channel=torch.arange(width, device=hidden.device), key_mask=_key_mask(attention_mask, hidden),
        log_decay=log_decay.transpose(1, 2), input_scale=scale.transpose(1, 2).float(),
        segment=torch.cumsum(reset.long(), dim=-1))
    if not fold_conv:
        return unfolded
    offset = unfolded.offset
    if conv.bias is not None:  # b_d * sum_s L_d[t, s], block by block
        offset = torch.cat([unfolded.exact_matrices(a, b).sum(-1) for a, b in unfolded._unit_blocks()], dim=1)
        offset = offset * conv.bias.float()[None, :, None]
    return replace(unfolded, value=projected.transpose(1, 2).float(), offset=offset,
                   conv_weight=conv.weight[:, 0].float())


def gated_deltanet_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> LinearTerms:
    """A ``Qwen3NextGatedDeltaNet`` (the torch fallback's maths; no cache: a prefill)."""
    from transformers.activations import ACT2FN

    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:  # the layer zeroes padding first
        hidden = (hidden * attention_mask[:, :, None]).to(hidden.dtype)
    batch, time = hidden.shape[:2]
    query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden),
                                                                    module.in_proj_ba(hidden))
    mixed = torch.cat([x.reshape(batch, time, -1) for x in (query, key, value)], dim=-1).transpose(1, 2)
    conv = module.conv1d
    mixed = F.conv1d(mixed.to(conv.weight.dtype), conv.weight, conv.bias, padding=conv.kernel_size[0] - 1,
                     groups=conv.groups)[..., :time]
    mixed = ACT2FN[module.activation](mixed).transpose(1, 2)  # [batch, time, conv_dim]
    query, key, value = torch.split(
        mixed, [module.key_dim, module.key_dim, module.value_dim],  # type: ignore[list-item]  # ints on HF's layer
        dim=-1)
    repeat = int(module.num_v_heads) // int(module.num_k_heads)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [batch, time, k_heads * d_k] -> [batch, v_head, time, d_k]
        t = t.float().reshape(batch, time, -1, int(module.head_k_dim)).repeat_interleave(repeat, dim=2)
        return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    query = per_head(query).transpose(1, 2) * int(module.head_k_dim) ** -0.5
    key = per_head(key).transpose(1, 2)
    beta = torch.sigmoid(b.float()).transpose(1, 2)  # [batch, head, time]
    log_decay = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)).transpose(1, 2)
    width = int(module.value_dim)
    return LinearTerms(
        kind=GATED_DELTANET, value=value.float().transpose(1, 2),
        gate=z.reshape(batch, time, -1).float().transpose(1, 2),
        offset=torch.zeros(batch, width, time, device=hidden.device),
        unit_of_channel=torch.arange(width, device=hidden.device) // int(module.head_v_dim),
        key_mask=_key_mask(attention_mask, hidden), log_decay=log_decay, query=query, key=key, beta=beta)


def kimi_delta_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> LinearTerms:
    """A ``KimiLinearDeltaAttention`` (Kimi delta attention: the gated delta rule with a decay per
    key channel, ``g = -exp(A_log) softplus(f_b(f_a(u)) + dt_bias)``; the torch fallback's maths,
    no cache: a prefill)."""
    from transformers.activations import ACT2FN

    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:  # the layer zeroes padding first
        hidden = (hidden * attention_mask[:, :, None]).to(hidden.dtype)
    batch, time = hidden.shape[:2]
    heads, width = int(module.num_heads), int(module.head_dim)
    mixed = torch.cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)], dim=-1).transpose(1, 2)
    conv = module.conv1d
    mixed = F.conv1d(mixed.to(conv.weight.dtype), conv.weight, conv.bias, padding=conv.kernel_size[0] - 1,
                     groups=conv.groups)[..., :time]
    mixed = ACT2FN[module.activation](mixed).transpose(1, 2)  # [batch, time, 3 * heads * width]
    query, key, value = torch.split(mixed, [heads * width] * 3, dim=-1)

    # [batch, time, heads * width] -> [batch, head, time, width], l2-normalised
    def per_head(t: torch.Tensor) -> torch.Tensor:
        t = t.float().reshape(batch, time, heads, width).transpose(1, 2)
        return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    gate = module.g_b_proj(module.g_a_proj(hidden))  # [batch, time, heads * width]
    return LinearTerms(
        kind=KIMI_DELTA, value=value.float().transpose(1, 2), gate=gate.float().transpose(1, 2),
        offset=torch.zeros(batch, heads * width, time, device=hidden.device),
        unit_of_channel=torch.arange(heads * width, device=hidden.device) // width,
        key_mask=_key_mask(attention_mask, hidden),
        log_decay=module.forget_gate(hidden).float().transpose(1, 2),  # [batch, head, time, width]
        query=per_head(query) * width ** -0.5, key=per_head(key),
        beta=torch.sigmoid(module.b_proj(hidden).float()).transpose(1, 2))


def kimi_delta_heads(module: torch.nn.Module) -> int:
    return int(module.num_heads)


def kimi_delta_width(module: torch.nn.Module) -> int:
    return int(module.num_heads) * int(module.head_dim)


def lightning_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> LinearTerms:
    """A ``MiniMaxLightningAttention`` (no cache: a prefill)."""
    batch, time = hidden.shape[:2]
    heads, width = int(module.num_attention_heads), int(module.head_dim)
    states = module.act_fn(module.qkv_proj(hidden))
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:  # the layer zeroes padding here
        states = (states * attention_mask[:, :, None]).to(states.dtype)
    query, key, value = torch.split(states.reshape(batch, time, heads, 3 * width), width, dim=3)
    slope = module.slope_rate.reshape(heads).double()  # lambda_h
    return LinearTerms(
        kind=LIGHTNING, value=value.float().reshape(batch, time, heads * width).transpose(1, 2),
        gate=torch.sigmoid(module.output_gate(hidden)).float().transpose(1, 2),
        offset=torch.zeros(batch, heads * width, time, device=hidden.device),
        unit_of_channel=torch.arange(heads * width, device=hidden.device) // width,
        key_mask=_key_mask(attention_mask, hidden), log_decay=(-slope)[None, :, None].expand(batch, heads, time),
        query=query.float().transpose(1, 2), key=key.float().transpose(1, 2))


def mlstm_terms(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> LinearTerms:
    """An ``xLSTMLayer`` (weight_mode ``single`` or ``fused``; no state: a prefill)."""
    config = module.config
    batch, time = hidden.shape[:2]
    heads = int(config.num_heads)
    if config.weight_mode == "single":
        query, key, value = module.q(hidden), module.k(hidden), module.v(hidden)
        output_gate = module.ogate_preact(hidden)
        input_gate = _soft_cap(module.igate_preact(hidden), config.gate_soft_cap)
        forget_gate = _soft_cap(module.fgate_preact(hidden), config.gate_soft_cap)
    else:
        query, key, value, output_gate = torch.tensor_split(
            module.qkv_opreact(hidden), (module.qk_dim, 2 * module.qk_dim, 2 * module.qk_dim + module.v_dim), dim=-1)
        input_gate, forget_gate = torch.tensor_split(_soft_cap(module.ifgate_preact(hidden), config.gate_soft_cap),
                                                     (heads,), dim=-1)

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [batch, time, heads * width] -> [batch, head, time, width]
        return t.float().reshape(batch, time, heads, -1).transpose(1, 2)

    query, key = per_head(query), per_head(key)
    width = int(module.v_dim)
    return LinearTerms(
        kind=MLSTM, value=value.float().transpose(1, 2), gate=torch.sigmoid(output_gate.float()).transpose(1, 2),
        offset=torch.zeros(batch, width, time, device=hidden.device),
        unit_of_channel=torch.arange(width, device=hidden.device) // (width // heads),
        key_mask=_key_mask(attention_mask, hidden), log_decay=F.logsigmoid(forget_gate.float()).transpose(1, 2),
        input_scale=input_gate.float().transpose(1, 2), query=query * query.shape[-1] ** -0.5, key=key,
        eps=float(config.eps))


def _soft_cap(values: torch.Tensor, cap: float | None) -> torch.Tensor:
    return values if cap is None else cap * torch.tanh(values / cap)


def mlstm_heads(module: torch.nn.Module) -> int:
    return int(module.config.num_heads)


def mlstm_width(module: torch.nn.Module) -> int:
    return int(module.v_dim)


def lightning_heads(module: torch.nn.Module) -> int:
    return int(module.num_attention_heads)


def lightning_width(module: torch.nn.Module) -> int:
    return int(module.num_attention_heads) * int(module.head_dim)


def rglru_heads(module: torch.nn.Module) -> int:
    """The RG-LRU's gate heads."""
    return int(module.rg_lru.num_attention_heads)


def rglru_width(module: torch.nn.Module) -> int:
    return int(module.lru_width)


def deltanet_heads(module: torch.nn.Module) -> int:
    """The DeltaNet's value heads."""
    return int(module.num_v_heads)


def deltanet_width(module: torch.nn.Module) -> int:
    return int(module.value_dim)


def linear_output(module: torch.nn.Module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The mixer's output [batch, time, hidden] rebuilt from its mixed value path ``scan`` (``M x +
    offset`` [batch, channel, time]) through the layer's own gate, norm and output projection (its
    terms kind's ``output``)."""
    assert terms.kind.output is not None  # every kind of LinearTerms carries its functions
    return terms.kind.output(module, terms, scan)


def _rglru_output(module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The RG-LRU block's ``linear_out(y * act(linear_y(u)))``."""
    return module.linear_out((scan * terms.gate).transpose(1, 2))


def _kimi_delta_output(module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """Kimi's ``o_proj(gated norm per head)``."""
    batch, channels, time = scan.shape
    width = int(module.head_dim)
    normed = module.o_norm(scan.transpose(1, 2).reshape(batch, time, -1, width),
                           terms.gate.transpose(1, 2).reshape(batch, time, -1, width))
    return module.o_proj(normed.reshape(batch, time, channels))


def _mlstm_output(module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The mLSTM's ``out_proj(output gate * multi-head norm(y))``."""
    batch, channels, time = scan.shape
    normed = module.multihead_norm(scan.transpose(1, 2).reshape(batch, time, int(module.config.num_heads), -1))
    return module.out_proj(terms.gate.transpose(1, 2) * normed.reshape(batch, time, channels))


def _gated_deltanet_output(module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The DeltaNet's ``out_proj(gated RMSNorm per head)``."""
    batch, channels, time = scan.shape
    width = int(module.head_v_dim)
    normed = module.norm(scan.transpose(1, 2).reshape(-1, width), terms.gate.transpose(1, 2).reshape(-1, width))
    return module.out_proj(normed.reshape(batch, time, channels))


def _lightning_output(module, terms: LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """Lightning attention's ``out_proj(sigmoid(gate) * norm(y))``."""
    return module.out_proj(terms.gate.transpose(1, 2) * module.norm(scan.transpose(1, 2)))


RGLRU = TermsKind("rglru", lambda terms, units: terms._lru_matrices(units, fold=terms.conv_weight is not None),
                  _rglru_output)
GATED_DELTANET = TermsKind("gated_deltanet", LinearTerms._delta_matrices, _gated_deltanet_output)
KIMI_DELTA = TermsKind("kimi_delta", LinearTerms._delta_matrices, _kimi_delta_output)
LIGHTNING = TermsKind("lightning", LinearTerms._lightning_matrices, _lightning_output)
MLSTM = TermsKind("mlstm", LinearTerms._mlstm_matrices, _mlstm_output)
