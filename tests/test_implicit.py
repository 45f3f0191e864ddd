"""Implicit attention of state-space mixers (probe.hooks.implicit): the exact per-channel matrices
reproduce each mixer's own output, the captured maps are causal and padding-blind, batch 1 equals
batch N, and a Mamba model is explained with the methods whose assumptions hold on signed,
unnormalised maps (the others are refused in one line)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import probe
from probe.errors import CaptureError, ProbeError
from probe.hooks import implicit
from probe.hooks.capture import capture_attention

from tiny_models import eot_tokenizer, fan_in_init

EOT = "<|endoftext|>"
KINDS = ("mamba", "falcon_mamba", "mamba2")
TEXTS = ["the film is good", "a bad movie with a dull plot", "good"]


def _config(kind: str, vocab_size: int):
    import transformers

    shared = {"vocab_size": vocab_size, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2,
              "conv_kernel": 4, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "use_cache": False}
    if kind == "mamba":
        return transformers.MambaConfig(**shared)
    if kind == "falcon_mamba":
        return transformers.FalconMambaConfig(**shared)
    # hidden 32 x expand 2 = 8 heads x head dim 8; 2 groups of 4 heads share B and C; chunk 4 < the
    # longest text, so the chunked scan crosses chunk boundaries
    return transformers.Mamba2Config(**shared, num_heads=8, head_dim=8, n_groups=2, chunk_size=4)


def _build(kind: str, seed: int = 0):
    """(a tiny causal LM of ``kind``, fp32, eval, seeded, fan-in init so the mixers' outputs are O(1); its tokenizer)."""
    import transformers

    tok, vocab = eot_tokenizer((EOT,))
    torch.manual_seed(seed)
    classes = {"mamba": transformers.MambaForCausalLM, "falcon_mamba": transformers.FalconMambaForCausalLM,
               "mamba2": transformers.Mamba2ForCausalLM}
    model = classes[kind](_config(kind, len(vocab))).float().eval()
    fan_in_init(model)
    return model, tok


@pytest.fixture(scope="module", params=KINDS)
def tiny(request):
    model, tok = _build(request.param)
    return request.param, model, tok


def _mixer_calls(model, inputs):
    """{path: (module, hidden states, mask, the mixer's own output)} of one forward pass."""
    seen = {}
    handles = []
    for path, _ in implicit.find_mixers(model):
        module = model.get_submodule(path)

        def pre(mod, args, kwargs, path=path):
            seen[path] = [mod, *implicit.call_inputs(mod, args, kwargs)]

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
    return seen


def _mixer_output(module, terms: implicit.ScanTerms, scan: torch.Tensor) -> torch.Tensor:
    """The mixer's output from its scan ``y`` [batch, channel, time]: gate and out_proj (Mamba), or
    Mamba-2's gated RMSNorm and out_proj."""
    if terms.kind == "mamba2":
        return module.out_proj(module.norm(scan.transpose(1, 2), terms.gate.transpose(1, 2)))
    return module.out_proj((scan * F.silu(terms.gate)).transpose(1, 2))


def _padded(tok, texts=TEXTS):
    return tok(texts, return_tensors="pt", padding=True)


def test_exact_matrices_reproduce_each_mixer_output(tiny):
    kind, model, tok = tiny
    batch = _padded(tok)
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1]  # some rows are padded
    calls = _mixer_calls(model, dict(batch))
    assert len(calls) == 2
    for module, hidden, mask, output in calls.values():
        with torch.no_grad():
            terms = implicit.mixer_kind(module).terms(module, hidden, mask)
            rebuilt = _mixer_output(module, terms, terms.scan_output())
        assert float(output.abs().max()) > 0.1  # the oracle compares outputs that are not ~0
        assert float((rebuilt - output).abs().max()) < 1e-5, kind


def _naive_scan(terms: implicit.ScanTerms) -> torch.Tensor:
    """The selective scan step by step, as a recurrence over a state h (fp64):
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t + D x_t, per channel."""
    value, step = terms.value.double(), terms.step.double()  # [batch, channel, time], [batch, unit, time]
    batch, channels, time = value.shape
    unit = terms.unit_of_channel
    out = torch.zeros(batch, channels, time, dtype=torch.float64)
    for c in range(channels):
        u = int(unit[c])
        decay = terms.decay[u].double()  # [state] (Mamba) or scalar (Mamba-2)
        B = terms.B.double() if terms.kind == "mamba" else terms.B[:, :, u].double()  # [batch, time, state]
        C = terms.C.double() if terms.kind == "mamba" else terms.C[:, :, u].double()
        h = torch.zeros(batch, B.shape[-1], dtype=torch.float64)
        for t in range(time):
            dt = step[:, u, t, None]  # [batch, 1]
            h = torch.exp(dt * decay) * h + dt * B[:, t] * value[:, c, t, None]
            out[:, c, t] = (C[:, t] * h).sum(-1) + terms.skip[c].double() * value[:, c, t]
    return out


def test_matrices_equal_a_naive_step_by_step_recurrence(tiny):
    """Against a recurrence written here (fp64), independent of how the matrices are formed."""
    _, model, tok = tiny
    module, hidden, mask, _ = next(iter(_mixer_calls(model, dict(_padded(tok))).values()))
    with torch.no_grad():
        terms = implicit.mixer_kind(module).terms(module, hidden, mask)
        exact = terms.scan_output().double()
        naive = _naive_scan(terms)
        matrices = terms.channel_matrices().double()
    assert float((exact - naive).abs().max()) < 1e-5
    # the tolerance catches an index off by one: the same matrices one query row late miss it by far
    late = torch.zeros_like(matrices)
    late[:, :, 1:] = matrices[:, :, :-1]
    value, skip = terms.value.double(), terms.skip.detach().double()
    wrong = torch.einsum("bcqk,bck->bcq", late, value) + skip[None, :, None] * value
    assert float((wrong - naive).abs().max()) > 1e-3


def test_one_entry_against_its_formula():
    """M_d[t, s] of one Mamba channel, term by term: sum_n C_t[n] prod_{r=s+1..t} exp(dt_r A[d, n]) dt_s B_s[n]."""
    model, tok = _build("mamba")
    module, hidden, mask, _ = next(iter(_mixer_calls(model, dict(_padded(tok, TEXTS[:1]))).values()))
    with torch.no_grad():
        terms = implicit.mamba_terms(module, hidden, mask)
    matrices = terms.channel_matrices()
    d, t, s = 5, 3, 1  # the text has 4 tokens
    dt, A = terms.step[0, d].double(), terms.decay[d].double()
    total = 0.0
    for n in range(A.shape[0]):
        decay = math.prod(math.exp(float(dt[r] * A[n])) for r in range(s + 1, t + 1))
        total += float(terms.C[0, t, n]) * decay * float(dt[s]) * float(terms.B[0, s, n])
    assert abs(float(matrices[0, d, t, s]) - total) < 1e-6
    assert float(matrices[0, d, s, t]) == 0.0  # key after query


def _captured(pm, batch):
    with capture_attention(pm, attention_mask=batch["attention_mask"]) as cap, torch.no_grad():
        pm.model(**batch)
    return cap.maps("decoder")


def test_captured_maps_are_causal_padding_blind_and_group_means(tiny):
    kind, model, tok = tiny
    pm = probe.wrap(model, tok)
    batch = _padded(tok)
    maps = _captured(pm, dict(batch))
    heads = 8 if kind == "mamba2" else implicit.MAMBA_CHANNEL_GROUPS
    assert maps.shape == {"batch": 3, "layer": 2, "head": heads, "query": batch["input_ids"].shape[1],
                          "key": batch["input_ids"].shape[1]}
    assert maps.weights.dtype == torch.float32
    assert bool((maps.weights.triu(1) == 0).all())  # exactly zero after the query
    real = batch["attention_mask"].bool()
    assert bool((maps.weights * ~real[:, None, None, None, :] == 0).all())  # padded keys
    assert torch.equal(maps.row_has_keys, real[:, None, :].expand_as(maps.row_has_keys))
    assert bool((maps.weights < 0).any())  # signed: not probabilities
    # layer 0 equals the exact per-channel matrices, averaged per head (Mamba) or per head's channels (Mamba-2)
    module, hidden, mask, _ = _mixer_calls(model, dict(batch))[pm.contract.module_paths[("decoder", 0)]]
    with torch.no_grad():
        channels = implicit.mixer_kind(module).terms(module, hidden, mask).channel_matrices()
    expected = channels.view(channels.shape[0], heads, -1, *channels.shape[2:]).mean(2)
    assert torch.allclose(maps.weights[:, 0], expected, atol=1e-6)


def test_batch_of_one_equals_the_right_padded_batch(tiny):
    kind, model, tok = tiny
    pm = probe.wrap(model, tok)
    together = _captured(pm, dict(_padded(tok)))
    for i, text in enumerate(TEXTS):
        alone = _captured(pm, dict(_padded(tok, [text])))
        n = alone.weights.shape[-1]
        assert torch.allclose(together.weights[i, :, :, :n, :n], alone.weights[0], atol=1e-6), (kind, text)


def test_contract_says_the_maps_are_implicit(tiny):
    _, model, tok = tiny
    pm = probe.wrap(model, tok)
    stack = pm.contract.stacks["decoder"]
    assert stack.maps == "implicit" and not stack.can_edit
    assert stack.n_layers == 2 and stack.mask_kind == "causal"
    assert stack.module_class == type(model.get_submodule(pm.contract.module_paths[("decoder", 0)])).__name__
    assert pm.contract.detected_by == "mixer classes (implicit attention)"
    assert pm.contract.to_dict()["stacks"]["decoder"]["maps"] == "implicit"


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_a_mamba_model_is_explained(kind):
    model, tok = _build(kind)
    pm = probe.wrap(model, tok)
    explanation = probe.explain(pm, TEXTS[:2], methods=["attention_mean", "loo_delete", "integrated_gradients"],
                                continuation=" good")
    for name, scores in explanation.scores.items():
        for example, per_example in zip(explanation.examples, scores.scores, strict=True):
            values = per_example[..., ~torch.as_tensor(example.special)] if name != "attention_mean" else per_example
            assert bool(torch.isfinite(values).all()), name
    assert float(explanation.scores["attention_mean"].scores[0].abs().sum()) > 0


def test_methods_that_assume_softmax_maps_are_left_out_or_refused():
    model, tok = _build("mamba")
    pm = probe.wrap(model, tok)
    skipped = probe.explain(pm, TEXTS[:1], continuation=" good").skipped
    for name in ("rollout", "flow", "attn_norm", "attn_grad", "value_zeroing", "alti", "globenc"):
        assert "implicit matrices of MambaMixer" in skipped[name], name
        assert "\n" not in skipped[name]
    assert pm.contract.context_mixing["alti"] == skipped["alti"]
    for name in ("rollout", "attn_grad"):
        with pytest.raises(ProbeError, match="signed, rows need not sum to one"):
            probe.explain(pm, TEXTS[:1], methods=[name], continuation=" good")
    with pytest.raises(CaptureError, match="cannot edit decoder layer 0: its maps are the implicit matrix"), \
            capture_attention(pm, editors={("decoder", 0): lambda w, c: w}):
        pass
    with pytest.raises(ProbeError, match="implicit matrix"):
        probe.counterfactual_attention(pm, TEXTS[:1], "uniform", continuation=" good")


def test_no_hook_survives_an_exception():
    model, tok = _build("mamba2")
    pm = probe.wrap(model, tok)
    mixers = [model.get_submodule(path) for path, _ in implicit.find_mixers(model)]
    before = [len(m._forward_pre_hooks) for m in mixers]
    with pytest.raises(RuntimeError, match="boom"), capture_attention(pm):
        assert all(len(m._forward_pre_hooks) > b for m, b in zip(mixers, before, strict=True))
        raise RuntimeError("boom")
    assert [len(m._forward_pre_hooks) for m in mixers] == before


def test_rwkv_wkv_matrices_reproduce_its_time_mixing_and_it_is_read():
    """RWKV's WKV as per-channel softmax matrices over the keys: output(sigmoid(r) * M v) is the
    time-mixing module's own output; a wrapped RWKV is read through the implicit path."""
    import transformers

    tok, vocab = eot_tokenizer((EOT,))
    torch.manual_seed(0)
    config = transformers.RwkvConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                     intermediate_size=64, context_length=64, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)
    model = transformers.RwkvForCausalLM(config).eval()
    fan_in_init(model)
    batch = _padded(tok, TEXTS[1:2])
    calls = _mixer_calls(model, {"input_ids": batch["input_ids"]})
    assert len(calls) == 2
    for module, hidden, mask, output in calls.values():
        with torch.no_grad():
            terms = implicit.rwkv_terms(module, hidden, mask)
            matrices = terms.channel_matrices()
            rebuilt = module.output(terms.gate.transpose(1, 2) * terms.scan_output(matrices).transpose(1, 2))
        own = output[0]
        assert float(own.abs().max()) > 0.1
        assert float((rebuilt - own).abs().max()) < 1e-5
        assert bool((matrices.triu(1) == 0).all())
        assert torch.allclose(matrices.sum(-1), torch.ones(()), atol=1e-5)  # WKV rows are a softmax
    pm = probe.wrap(model, tok)
    assert pm.contract.stacks["decoder"].maps == "implicit"
    maps = _captured(pm, dict(batch))
    assert maps.shape["head"] == implicit.MAMBA_CHANNEL_GROUPS and maps.shape["layer"] == 2
    # the time mixing is never handed the padding mask: padded keys and query rows are zero from
    # the batch's own mask, and the contract's padding checks pass
    padded = _padded(tok, TEXTS[:2])
    real = padded["attention_mask"].bool()
    assert not bool(real.all())
    weights = _captured(pm, dict(padded)).weights
    assert bool((weights * ~real[:, None, None, None, :] == 0).all())
    assert bool((weights * ~real[:, None, None, :, None] == 0).all())
    assert float(weights[real[:, None, None, :, None].expand_as(weights)].abs().max()) > 0
    with capture_attention(pm) as cap, torch.no_grad():  # no mask given: the one the model's forward got
        pm.model(**padded)
    assert torch.equal(cap.maps("decoder").weights, weights)
    from probe.models.checks import run_checks
    results = {c.name: c for c in run_checks(pm)}
    assert results["padded_keys_get_zero"].passed, results["padded_keys_get_zero"].detail
