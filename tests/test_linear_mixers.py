"""Implicit attention of linear-recurrent mixers (probe.hooks.linear_mixers): RecurrentGemma's RG-LRU
block, Qwen3-Next's gated DeltaNet and MiniMax's lightning attention. The exact matrices reproduce each mixer's own output (a
right-padded batch, fp32, 1e-5), one entry equals its product formula term by term, the matrices are
causal, and an all-recurrent model is read through the implicit path (maps causal, padding-blind,
batch 1 equal to batch N)."""

from __future__ import annotations

import math

import pytest
import torch

import probe
from probe.hooks import implicit, linear_mixers
from probe.hooks.capture import capture_attention

from tiny_models import eot_tokenizer, fan_in_init

EOT = "<|endoftext|>"
TEXTS = ["the film is good", "a bad movie with a dull plot", "good"]
KINDS = ("recurrent_gemma", "qwen3_next", "minimax", "xlstm")


def _tokenizer():
    return eot_tokenizer((EOT,))


def _build(kind: str, hybrid: bool = False, seed: int = 0):
    """(a tiny causal LM of ``kind``, fp32, eval, seeded; its tokenizer). Linear layers get fan-in
    weights and every bias / gate bias / conv a random value, so no term of the readers is trivially
    zero. ``hybrid``: a full-attention layer after the recurrent one (the models' own layout);
    otherwise every layer is recurrent. use_cache=False: transformers' cache cannot report a length
    for a stack of recurrent layers only."""
    import transformers

    if kind == "minimax":
        return _minimax(hybrid, seed)
    if kind == "xlstm":
        return _xlstm(seed)
    tok, vocab = _tokenizer()
    torch.manual_seed(seed)
    shared = {"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "use_cache": False, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    if kind == "recurrent_gemma":
        # lru width 48 = 4 gate heads of 12 channels; conv width 4
        config = transformers.RecurrentGemmaConfig(
            **shared, lru_width=48, num_attention_heads=4, conv1d_width=4, attention_window_size=16,
            block_types=("recurrent", "attention") if hybrid else ("recurrent",))
        model = transformers.RecurrentGemmaForCausalLM(config)
    else:
        # 4 value heads share 2 query/key heads (grouped), head dims 8
        config = transformers.Qwen3NextConfig(
            **shared, num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=0, layer_types=["linear_attention", "full_attention" if hybrid else "linear_attention"])
        model = transformers.Qwen3NextForCausalLM(config)
    model = model.float().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                module.weight.normal_(0.0, module.in_features ** -0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif isinstance(module, torch.nn.Conv1d):
                module.weight.normal_(0.0, 0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif type(module).__name__ == "RecurrentGemmaRglru":
                module.input_gate_bias.normal_(0.0, 0.5)
                module.recurrent_gate_bias.normal_(0.0, 0.5)
            elif type(module).__name__ == "Qwen3NextGatedDeltaNet":
                module.dt_bias.normal_(0.0, 0.5)
    return model, tok


def _padded(tok, texts=TEXTS):
    return dict(tok(texts, return_tensors="pt", padding=True))


def _mixer_calls(model, inputs):
    """[(module, args, kwargs, the mixer's own output)] of one forward pass, in module order."""
    seen, handles = {}, []
    for path, _ in implicit.find_mixers(model):
        module = model.get_submodule(path)

        def pre(mod, args, kwargs, path=path):
            seen[path] = [mod, args, dict(kwargs)]

        def post(mod, args, kwargs, output, path=path):
            seen[path].append(output)

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                    module.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return list(seen.values())


def _rglru_block_output(module, terms: linear_mixers.LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The recurrent block's output from the mixed path ``y`` [batch, channel, time]: linear_out(y * act(linear_y(u)))."""
    return module.linear_out((scan * terms.gate).transpose(1, 2))


def _deltanet_output(module, terms: linear_mixers.LinearTerms, scan: torch.Tensor) -> torch.Tensor:
    """The DeltaNet's output from ``y = M v`` [batch, channel, time]: out_proj(gated RMSNorm per head)."""
    batch, channels, time = scan.shape
    width = int(module.head_v_dim)
    normed = module.norm(scan.transpose(1, 2).reshape(-1, width), terms.gate.transpose(1, 2).reshape(-1, width))
    return module.out_proj(normed.reshape(batch, time, channels))


# --- RecurrentGemma's RG-LRU block -------------------------------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True])
def test_rglru_matrices_reproduce_the_recurrent_block(hybrid):
    """In a right-padded batch through the model (hybrid: beside a local-attention layer), M x + the
    conv bias term, gated and projected, is each recurrent block's own output, with the conv folded
    into M and without; M is zero above the diagonal."""
    model, tok = _build("recurrent_gemma", hybrid=hybrid)
    batch = _padded(tok)
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1]  # some rows are padded
    calls = _mixer_calls(model, batch)
    assert len(calls) == (1 if hybrid else 2)
    for module, args, kwargs, (output, _) in calls:
        assert float(output.abs().max()) > 0.1  # the oracle compares outputs that are not ~0
        for fold in (True, False):
            with torch.no_grad():
                terms = linear_mixers.rglru_terms(module, args[0], kwargs["attention_mask"], kwargs["position_ids"],
                                                  fold_conv=fold)
                matrices = terms.channel_matrices()
                rebuilt = _rglru_block_output(module, terms, terms.scan_output(matrices))
            assert float((rebuilt - output).abs().max()) < 1e-5, fold
            assert bool((matrices.triu(1) == 0).all())
            assert float(matrices.tril(-1).abs().max()) > 1e-3  # the past does reach the present


def test_rglru_resets_where_position_ids_are_zero():
    """Packed sequences (position_ids restarting mid-row): the block's own output is reproduced; the
    recurrence L carries nothing across a reset, while the folded M does reach the conv's window
    (width - 1 = 3 keys) before it, as the block's conv (which never resets) does."""
    model, _ = _build("recurrent_gemma")
    module = model.model.layers[0].temporal_block
    torch.manual_seed(1)
    hidden = torch.randn(2, 9, 32)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        output, _ = module(hidden, position_ids=positions, attention_mask=None, use_cache=False)
        for fold in (True, False):
            terms = linear_mixers.rglru_terms(module, hidden, None, positions, fold_conv=fold)
            matrices = terms.channel_matrices()
            rebuilt = _rglru_block_output(module, terms, terms.scan_output(matrices))
            assert float((rebuilt - output).abs().max()) < 1e-5, fold
            assert float(matrices[0, :, 3, :3].abs().max()) > 1e-3  # within a segment it mixes
            if fold:
                assert bool((matrices[0, :, 4:, :1] == 0).all())  # beyond the conv's reach
                assert float(matrices[0, :, 4:, 1:4].abs().max()) > 1e-3  # the conv's leak across the reset
            else:
                assert bool((matrices[0, :, 4:, :4] == 0).all()) and bool((matrices[1, :, 3:, :3] == 0).all())


def test_rglru_entry_against_its_formula():
    """M_d[t, r] with the conv folded in, term by term: sum_s prod_{q=s+1..t} a_q sqrt(1 - a_s^2) i_s w_d[r - s + 3],
    the gates a, i recomputed here from the conv output and the block's own parameters."""
    model, tok = _build("recurrent_gemma")
    (module, args, _, _), *_ = _mixer_calls(model, _padded(tok, TEXTS[:1]))
    hidden = args[0]
    with torch.no_grad():
        matrices = linear_mixers.rglru_terms(module, hidden, None).channel_matrices()
        conv = module.conv_1d(module.linear_x(hidden).transpose(1, 2))[..., : hidden.shape[1]][0]  # [channel, time]
    lru = module.rg_lru
    d, t, r = 17, 3, 1  # channel 17 is gate head 1's sixth; the text has 4 tokens
    head, j = divmod(d, lru.block_width)
    block = slice(head * lru.block_width, (head + 1) * lru.block_width)

    @torch.no_grad()
    def gates(q):  # (a_q, i_q) of channel d at position q
        x = conv[block, q].double()
        i = torch.sigmoid(x @ lru.input_gate_weight[head, :, j].double() + lru.input_gate_bias[head, j].double())
        g = torch.sigmoid(x @ lru.recurrent_gate_weight[head, :, j].double() + lru.recurrent_gate_bias[head, j].double())
        return math.exp(-8.0 * float(g) * math.log1p(math.exp(float(lru.recurrent_param[d])))), float(i)

    weight = module.conv_1d.weight[d, 0].detach().double()
    total = 0.0
    for s in range(r, t + 1):  # the conv reaches r from s in r..r+3
        tap = r - s + weight.shape[0] - 1
        if not 0 <= tap < weight.shape[0]:
            continue
        a_s, i_s = gates(s)
        scale = 1.0 if s == 0 else math.sqrt(1 - a_s ** 2)
        total += math.prod(gates(q)[0] for q in range(s + 1, t + 1)) * scale * i_s * float(weight[tap])
    assert abs(float(matrices[0, d, t, r]) - total) < 1e-6
    assert float(matrices[0, d, r, t]) == 0.0  # key after query


# --- Qwen3-Next's gated DeltaNet ---------------------------------------------------------------------

@pytest.mark.parametrize("hybrid", [False, True])
def test_deltanet_matrices_reproduce_the_layer(hybrid):
    """In a right-padded batch through the model (hybrid: before a full-attention layer, Qwen3-Next's
    own layout), out_proj(norm(M v, z)) is each DeltaNet's own output; M is zero above the diagonal."""
    model, tok = _build("qwen3_next", hybrid=hybrid)
    batch = _padded(tok)
    calls = _mixer_calls(model, batch)
    assert len(calls) == (1 if hybrid else 2)
    for module, _args, kwargs, output in calls:
        mask = kwargs["attention_mask"]
        assert mask is not None and mask.dim() == 2  # the layer is handed the padding mask
        assert float(output.abs().max()) > 0.1
        with torch.no_grad():
            terms = linear_mixers.gated_deltanet_terms(module, kwargs["hidden_states"], mask)
            matrices = terms.channel_matrices()
            rebuilt = _deltanet_output(module, terms, terms.scan_output(matrices))
        assert float((rebuilt - output).abs().max()) < 1e-5
        assert bool((matrices.triu(1) == 0).all())
        assert bool((matrices < 0).any())  # signed


def test_deltanet_across_the_kernels_chunk_boundary():
    """70 positions: the torch kernel's chunked scan (chunks of 64) carries a state across a chunk
    boundary; the one closed-form matrix still reproduces it (padding in the second row)."""
    model, _ = _build("qwen3_next")
    module = model.model.layers[0].linear_attn
    torch.manual_seed(2)
    hidden = torch.randn(2, 70, 32)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, 60:] = 0
    with torch.no_grad():
        output = module(hidden, attention_mask=mask)
        terms = linear_mixers.gated_deltanet_terms(module, hidden, mask)
        rebuilt = _deltanet_output(module, terms, terms.scan_output())
    assert float(output.abs().max()) > 0.1
    assert float((rebuilt - output).abs().max()) < 1e-5


def _transition_products(terms: linear_mixers.LinearTerms, h: int):
    """(q, k, beta, M) of head ``h`` of example 0, M[t, s] = q_t^T B_t ... B_{s+1} k_s beta_s with the
    d_k x d_k transitions B_r = (I - beta_r k_r k_r^T) diag(alpha_r) multiplied out (fp64); alpha_r is
    one decay (the DeltaNet: B_r is then symmetric) or one per key channel (Kimi)."""
    q, k = terms.query[0, h].double(), terms.key[0, h].double()  # [time, d_k]
    beta, alpha = terms.beta[0, h].double(), terms.log_decay[0, h].double().exp()  # [time], [time] or [time, d_k]
    time, dim = k.shape
    eye = torch.eye(dim, dtype=torch.float64)
    expected = torch.zeros(time, time, dtype=torch.float64)
    for t in range(time):
        row = q[t]
        for s in range(t, -1, -1):
            expected[t, s] = row @ k[s] * beta[s]
            row = alpha[s].reshape(-1, 1) * (eye - beta[s] * torch.outer(k[s], k[s])) @ row  # B_s^T q
    return q, k, beta, expected


def test_deltanet_entry_is_the_product_of_transitions():
    """M_h[t, s] = q_t^T A_t ... A_{s+1} k_s beta_s with A_r = alpha_r (I - beta_r k_r k_r^T), the
    d_k x d_k transitions multiplied out here (fp64), for every (t, s) of one head."""
    model, tok = _build("qwen3_next")
    (module, _, kwargs, _), *_ = _mixer_calls(model, _padded(tok, TEXTS[1:2]))
    with torch.no_grad():
        terms = linear_mixers.gated_deltanet_terms(module, kwargs["hidden_states"], kwargs["attention_mask"])
        matrices = terms.exact_matrices()
    h = 3
    q, k, beta, expected = _transition_products(terms, h)
    assert float((matrices[0, h].double() - expected).abs().max()) < 1e-6
    # the delta rule matters: plain decayed linear attention (no -beta k k^T) is far from it
    gaps = torch.cumsum(terms.log_decay[0, h].double(), 0)
    plain = ((q @ k.T) * torch.exp(gaps[:, None] - gaps[None, :]) * beta[None, :]).tril()
    assert float((plain - expected).abs().max()) > 1e-3


# --- the implicit path, model level ------------------------------------------------------------------

def _captured(pm, batch):
    with capture_attention(pm, attention_mask=batch["attention_mask"]) as cap, torch.no_grad():
        pm.model(**batch)
    return cap.maps("decoder")


@pytest.fixture(scope="module", params=KINDS)
def wrapped(request):
    model, tok = _build(request.param)
    return request.param, model, tok, probe.wrap(model, tok)


def test_an_all_recurrent_model_is_read_implicitly(wrapped):
    kind, model, tok, pm = wrapped
    stack = pm.contract.stacks["decoder"]
    assert pm.contract.detected_by == "mixer classes (implicit attention)"
    assert stack.maps == "implicit" and not stack.can_edit and stack.mask_kind == "causal"
    assert stack.n_heads == 4 and stack.head_dim == (12 if kind == "recurrent_gemma" else 8)
    batch = _padded(tok)
    maps = _captured(pm, batch)
    time = batch["input_ids"].shape[1]
    assert maps.shape == {"batch": 3, "layer": 2, "head": 4, "query": time, "key": time}
    assert bool((maps.weights.triu(1) == 0).all())
    real = batch["attention_mask"].bool()
    assert bool((maps.weights * ~real[:, None, None, None, :] == 0).all())  # padded keys
    assert bool((maps.weights * ~real[:, None, None, :, None] == 0).all())  # padded query rows
    assert torch.equal(maps.row_has_keys, real[:, None, :].expand_as(maps.row_has_keys))
    # layer 0 is the mean of each map head's channels' exact matrices (DeltaNet: one head, one matrix)
    module, args, kwargs, _ = _mixer_calls(model, batch)[0]
    hidden = args[0] if args else kwargs["hidden_states"]
    with torch.no_grad():
        channels = implicit.mixer_kind(module).terms(module, hidden, batch["attention_mask"]).channel_matrices(exact=False)
    expected = channels.view(channels.shape[0], 4, -1, *channels.shape[2:]).mean(2)
    assert torch.allclose(maps.weights[:, 0], expected, atol=1e-6)


def test_batch_of_one_equals_the_right_padded_batch(wrapped):
    kind, _, tok, pm = wrapped
    together = _captured(pm, _padded(tok))
    for i, text in enumerate(TEXTS):
        alone = _captured(pm, _padded(tok, [text]))
        n = alone.weights.shape[-1]
        assert torch.allclose(together.weights[i, :, :, :n, :n], alone.weights[0], atol=1e-6), (kind, text)


def test_an_all_recurrent_model_is_explained(wrapped):
    _, _, _, pm = wrapped
    explanation = probe.explain(pm, TEXTS[:2], methods=["attention_mean", "loo_delete"], continuation=" good")
    assert float(explanation.scores["attention_mean"].scores[0].abs().sum()) > 0


# --- MiniMax's lightning attention -------------------------------------------------------------------

def _minimax(hybrid: bool, seed: int = 0):
    """A tiny MiniMax (2 experts), blocks of 4 positions so the blocked kernel carries a state from
    block to block within the texts; hybrid: a full-attention layer after the lightning one."""
    import transformers

    tok, vocab = _tokenizer()
    torch.manual_seed(seed)
    config = transformers.MiniMaxConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, block_size=4,
        layer_types=["linear_attention", "full_attention" if hybrid else "linear_attention"], use_cache=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = transformers.MiniMaxForCausalLM(config).float().eval()
    fan_in_init(model)
    return model, tok


@pytest.mark.parametrize("hybrid", [False, True])
def test_lightning_matrices_reproduce_the_layer(hybrid):
    """In a right-padded batch through the model, out_proj(sigmoid(gate) * norm(M v)) with
    M_h[t, s] = (q_t . k_s) exp(-lambda_h (t - s)) is each lightning layer's own output."""
    model, tok = _minimax(hybrid)
    batch = _padded(tok)
    assert batch["input_ids"].shape[1] > 4  # more than one kernel block
    calls = _mixer_calls(model, batch)
    assert len(calls) == (1 if hybrid else 2)
    for module, args, kwargs, (output, _) in calls:
        hidden = args[0] if args else kwargs["hidden_states"]
        assert float(output.abs().max()) > 0.1
        with torch.no_grad():
            terms = linear_mixers.lightning_terms(module, hidden, kwargs.get("attention_mask"))
            matrices = terms.channel_matrices()
            scan = terms.scan_output(matrices).transpose(1, 2)  # [batch, time, channel]
            rebuilt = module.out_proj(terms.gate.transpose(1, 2) * module.norm(scan))
        assert float((rebuilt - output).abs().max()) < 1e-5
        assert bool((matrices.triu(1) == 0).all())
        # one entry against its formula
        h, t, s = 2, 5, 1
        q, k = terms.query[0, h, t].double(), terms.key[0, h, s].double()
        rate = float(module.slope_rate.reshape(-1)[h])
        assert abs(float(matrices[0, h * 8, t, s]) - float(q @ k) * math.exp(-rate * (t - s))) < 1e-6


# --- xLSTM's mLSTM layer ------------------------------------------------------------------------------

def _xlstm(seed: int = 0, chunk_size: int = 2):
    """A tiny xLSTM (2 mLSTM blocks, 4 heads, q/k heads of 4 channels and v heads of 8): fp32 kernels,
    chunks of 2 positions so the chunkwise kernel carries a state across chunks and the recurrent
    one takes the rest; every linear layer fan-in, gate biases drawn so neither gate saturates."""
    import transformers

    tok, vocab = _tokenizer()
    torch.manual_seed(seed)
    config = transformers.xLSTMConfig(
        vocab_size=len(vocab), hidden_size=32, embedding_dim=32, num_blocks=2, num_heads=4, qk_dim_factor=0.5,
        v_dim_factor=1.0, use_cache=False, chunk_size=chunk_size, autocast_kernel_dtype="float32",
        pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = transformers.xLSTMForCausalLM(config).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                module.weight.normal_(0.0, module.in_features ** -0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 1.0)
    return model, tok


def test_mlstm_matrices_reproduce_the_layer_across_both_kernels():
    """out_proj(sigmoid(o) * norm(M v)) with the stabilised, normalised M is each mLSTM layer's own
    output, in a right-padded batch whose rows run through the chunkwise kernel (chunks of 2)
    and the recurrent one (the odd last position); one entry against the recurrence run by hand."""
    model, tok = _xlstm()
    batch = _padded(tok)
    assert batch["input_ids"].shape[1] % 2 == 1 and batch["input_ids"].shape[1] > 4
    calls = _mixer_calls(model, batch)
    assert len(calls) == 2
    for module, args, _kwargs, (output, _) in calls:
        hidden = args[0]
        assert float(output.abs().max()) > 0.1
        with torch.no_grad():
            terms = linear_mixers.mlstm_terms(module, hidden, None)
            matrices = terms.channel_matrices()
            rebuilt = linear_mixers.linear_output(module, terms, terms.scan_output(matrices))
        assert float((rebuilt - output).abs().max()) < 1e-5
        assert bool((matrices.triu(1) == 0).all())
        # the recurrence in unstabilised form, by hand, for one head and query: h_t = C_t^T q / max(|n_t . q|, 1)
        h, t = 1, 6
        q, k = terms.query[0, h].double(), terms.key[0, h].double()  # [time, d_k]
        log_f, i = terms.log_decay[0, h].double(), terms.input_scale[0, h].double()
        weights = torch.stack([torch.exp(log_f[s + 1 : t + 1].sum() + i[s]) for s in range(t + 1)])  # [key]
        scores = (k[: t + 1] @ q[t]) * weights
        expected = scores / max(float(scores.sum().abs()), 1.0)
        assert torch.allclose(matrices[0, h * 8, t, : t + 1].double(), expected, atol=1e-6, rtol=1e-5)


# --- Kimi Linear's delta attention (a decay per key channel) -------------------------------------------

def _kimi():
    """The sweep's tiny Kimi Linear (a delta-attention layer, then MLA attention), every weight of the
    delta layer drawn so that no term is trivially zero."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    torch.manual_seed(0)
    model = sweep.build("kimi_linear", "causal_lm", "eager")
    module = next(m for m in model.modules() if type(m).__name__ == "KimiLinearDeltaAttention")
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, parameter.shape[-1] ** -0.5 if parameter.dim() >= 2 else 0.5)
    return model, module, sweep.tokenizer()


def test_kimi_delta_matrices_reproduce_the_layer_across_the_kernels_chunks():
    """out_proj(gated norm(M v)) is the layer's own output (fp32, 1e-5) at 9 and at 70 positions (the
    torch kernel's chunks are 64 long), a right-padded row included; M is causal and signed."""
    _, module, _ = _kimi()
    torch.manual_seed(1)
    for time in (9, 70):
        hidden = torch.randn(2, time, module.hidden_size)
        mask = torch.ones(2, time, dtype=torch.long)
        mask[1, time - 3:] = 0
        with torch.no_grad():
            output = module(hidden, attention_mask=mask)
            terms = linear_mixers.kimi_delta_terms(module, hidden, mask)
            matrices = terms.channel_matrices()
            rebuilt = implicit.mixer_output(module, terms, terms.scan_output(matrices))
        real = mask.bool()
        assert float(output[real].abs().max()) > 0.1
        assert float((rebuilt - output)[real].abs().max()) < 1e-5
        assert bool((matrices.triu(1) == 0).all()) and bool((matrices < 0).any())


def test_kimi_delta_entry_is_the_product_of_transitions():
    """M_h[t, s] = q_t^T B_t ... B_{s+1} k_s beta_s with B_r = (I - beta_r k_r k_r^T) diag(alpha_r),
    alpha_r a decay per key channel (and the channels do decay differently), multiplied out here (fp64)."""
    _, module, _ = _kimi()
    torch.manual_seed(2)
    hidden = torch.randn(1, 8, module.hidden_size)
    with torch.no_grad():
        terms = linear_mixers.kimi_delta_terms(module, hidden, None)
        matrices = terms.exact_matrices()
    h = 1
    _, _, _, expected = _transition_products(terms, h)
    assert float((matrices[0, h].double() - expected).abs().max()) < 1e-6
    alpha = terms.log_decay[0, h].double().exp()  # [time, d_k]
    assert float(alpha.std(dim=1).max()) > 1e-2  # the channels decay differently


def test_kimi_linear_is_a_hybrid_read_layer_by_layer():
    model, module, tok = _kimi()
    pm = probe.wrap(model, tok)
    stack = pm.contract.stacks["decoder"]
    assert stack.maps == "hybrid" and stack.layer_maps == ("implicit", "softmax")
    from probe.models.checks import run_checks

    failed = [(r.name, r.detail) for r in run_checks(pm) if not r.passed]
    assert not failed, failed
