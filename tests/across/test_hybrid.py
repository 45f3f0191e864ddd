"""Hybrids: models whose layers mix softmax attention with token mixers read as implicit attention
(probe.hooks.implicit). Every token-mixing layer is a layer of the stack, in model order, its kind
in the contract; the mixer layers' maps equal the mixers' exact matrices (grouped as implicit.py
groups them) and the attention layers' equal HF's eager ``output_attentions``; layers with other
head counts are read layer by layer; edits apply to the softmax layers and are refused on the
mixers. Also: a saved tiny Mamba folder loads and is explained, and LFM2's gated short convolution
is read as its banded matrix (oracle: the module's own output)."""

from __future__ import annotations

import pytest
import torch

import probe
from probe.errors import CaptureError, ProbeError
from probe.hooks import implicit
from probe.hooks.capture import capture_attention
from probe.models.checks import run_checks

from tiny_models import build_tiny, eot_tokenizer, fan_in_init, mixer_inputs

EOT = "<|endoftext|>"
TEXTS = ["the film is good", "a bad movie with a dull plot", "good"]
#: model_type -> (the mixer layer, the attention layer) of the tiny two-layer model
HYBRIDS = ("jamba", "bamba", "lfm2")
SHARED = {"vocab_size": None, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 0,
          "eos_token_id": 0, "use_cache": False}


def _config(kind: str, vocab_size: int):
    import transformers

    shared = {**SHARED, "vocab_size": vocab_size}
    if kind == "jamba":  # layer 0 a mamba mixer, layer 1 attention (period 2, offset 1)
        return transformers.JambaConfig(**shared, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                        expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4,
                                        mamba_expand=2, mamba_dt_rank=4)
    if kind == "bamba":  # a Mamba-2 mixer of 8 heads (2 groups), then attention of 4: different head counts
        return transformers.BambaConfig(**shared, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8,
                                        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=2)
    return transformers.Lfm2Config(**shared, layer_types=["conv", "full_attention"], conv_L_cache=3)


def _build(kind: str, seed: int = 0):
    """(a tiny hybrid causal LM, eager, fp32, eval, fan-in init so every layer's output is O(1); its tokenizer)."""
    import transformers

    tok, vocab = eot_tokenizer((EOT,))
    torch.manual_seed(seed)
    classes = {"jamba": transformers.JambaForCausalLM, "bamba": transformers.BambaForCausalLM,
               "lfm2": transformers.Lfm2ForCausalLM}
    model = classes[kind](_config(kind, len(vocab))).float().eval()
    model.set_attn_implementation("eager")
    fan_in_init(model)
    return model, tok


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    model, tok = _build(request.param)
    return request.param, probe.wrap(model, tok)


def _padded(tok, texts=TEXTS):
    return dict(tok(texts, return_tensors="pt", padding=True))


def test_contract_counts_every_mixing_layer_in_model_order(hybrid):
    kind, pm = hybrid
    stack = pm.contract.stacks["decoder"]
    assert stack.n_layers == 2 and stack.maps == "hybrid"
    assert stack.layer_maps == ("implicit", "softmax")  # layer 0 the mixer, layer 1 attention
    assert stack.can_edit  # the softmax layer
    mixer = pm.model.get_submodule(pm.contract.module_paths[("decoder", 0)])
    attention = pm.model.get_submodule(pm.contract.module_paths[("decoder", 1)])
    assert implicit.mixer_kind(mixer) is not None and implicit.mixer_kind(attention) is None
    assert stack.mixer_class == type(mixer).__name__ and stack.module_class == type(attention).__name__
    assert pm.contract.sites[("decoder", 0)].kind == "implicit"
    assert pm.contract.to_dict()["stacks"]["decoder"]["layer_maps"] == ["implicit", "softmax"]
    if kind == "bamba":
        assert stack.layer_heads == (8, 4)  # the mixer's own 8 heads beside attention's 4


def test_mixer_and_attention_layers_equal_their_oracles(hybrid):
    """The mixer layer: the exact per-channel matrices, grouped as implicit.py groups them (Mamba-2:
    a head's channels share one matrix; Mamba / short conv: the mean over each group of channels).
    The attention layer: HF's eager output_attentions (it returns maps for attention layers only)."""
    kind, pm = hybrid
    batch = _padded(pm.tokenizer)
    with capture_attention(pm, attention_mask=batch["attention_mask"]) as cap, torch.no_grad():
        out = pm.model(**batch, output_attentions=True)
    per_layer = cap.layer_maps("decoder")
    assert sorted(per_layer) == [0, 1]
    (module, hidden, mask, _), = mixer_inputs(pm.model, batch).values()
    with torch.no_grad():
        terms = implicit.mixer_kind(module).terms(module, hidden, mask)
        channels = terms.channel_matrices()  # [batch, channel, query, key]
    heads = pm.contract.stacks["decoder"].layer_heads[0] if kind == "bamba" else implicit.MAMBA_CHANNEL_GROUPS
    if terms.kind == "mamba2":
        expected = channels[:, :: int(module.head_dim)]  # one channel per head
    else:
        expected = channels.view(channels.shape[0], heads, -1, *channels.shape[2:]).mean(2)
    mixer_gap = float((per_layer[0].weights[:, 0] - expected).abs().max())
    assert mixer_gap < 1e-6, mixer_gap
    eager = [a for a in out.attentions if a is not None]
    assert len(eager) == 1
    real = batch["attention_mask"].bool()
    gap = float(((per_layer[1].weights[:, 0] - eager[0].float()) * real[:, None, :, None] * real[:, None, None, :])
                .abs().max())
    assert gap < 1e-6, gap


def test_every_contract_check_passes(hybrid):
    _, pm = hybrid
    results = {r.name: r for r in run_checks(pm)}
    assert all(r.passed for r in results.values()), [(r.name, r.detail) for r in results.values() if not r.passed]
    assert "implicit_matrices_rebuild_mixer_outputs" in results
    assert "capture_equals_eager_output_attentions" in results


def test_explain_gives_one_attention_row_per_mixing_layer(hybrid):
    kind, pm = hybrid
    explanation = probe.explain(pm, TEXTS[:2], methods=["attention_mean", "attention", "loo_delete", "saliency"],
                                continuation=" good")
    for example, mean, raw in zip(explanation.examples, explanation.scores["attention_mean"].scores,
                                  explanation.scores["attention"].scores, strict=True):
        assert mean.shape == (2, len(example.input_ids))  # one row per mixing layer: mixer and attention
        assert bool(torch.isfinite(mean).all()) and float(mean[0].abs().sum()) > 0
        assert raw.shape[:2] == (2, max(pm.contract.stacks["decoder"].layer_heads or (4,)))
        if kind == "bamba":  # the attention layer's 4 heads beside the mixer's 8: the rest is NaN
            assert bool(torch.isnan(raw[1, 4:]).all()) and bool(torch.isfinite(raw[1, :4]).all())
    params = explanation.scores["attention_mean"].params
    assert params["maps"] == "hybrid" and params["layer_maps"] == ["implicit", "softmax"]


def test_edits_apply_to_softmax_layers_and_are_refused_on_mixers(hybrid):
    _, pm = hybrid
    batch = _padded(pm.tokenizer)
    with torch.no_grad():
        plain = pm.model(**batch).logits
    with capture_attention(pm, editors={("decoder", 1): lambda w, c: w}, layers=()), torch.no_grad():
        same = pm.model(**batch).logits
    assert float((same - plain).abs().max()) < 1e-5
    with pytest.raises(CaptureError, match=r"cannot edit decoder layer 0: its maps are the implicit matrix of a \w+ "
                                           r".*softmax layers are 1$"), \
            capture_attention(pm, editors={("decoder", 0): lambda w, c: w}):
        pass
    for name in ("rollout", "attn_grad"):  # methods that read rows as probabilities: refused in one line
        with pytest.raises(ProbeError, match="maps include the implicit matrices"):
            probe.explain(pm, TEXTS[:1], methods=[name], continuation=" good")


def test_batch_of_one_equals_the_padded_batch(hybrid):
    _, pm = hybrid
    batch = _padded(pm.tokenizer)
    with capture_attention(pm, attention_mask=batch["attention_mask"]) as cap, torch.no_grad():
        pm.model(**batch)
    together = cap.layer_maps()
    for i, text in enumerate(TEXTS):
        one = _padded(pm.tokenizer, [text])
        with capture_attention(pm, attention_mask=one["attention_mask"]) as cap, torch.no_grad():
            pm.model(**one)
        n = one["input_ids"].shape[1]
        for layer, alone in cap.layer_maps().items():
            assert torch.allclose(together[layer].weights[i, :, :, :n, :n], alone.weights[0], atol=1e-5), (layer, text)


def test_short_convolution_matrix_rebuilds_the_module_output():
    """LFM2's gated short conv: M_c[t, s] = C_t w_c[K-1-(t-s)] B_s, banded (zero beyond the kernel),
    and M x through out_proj is the module's own output (1e-5, fp32)."""
    model, tok = _build("lfm2")
    batch = _padded(tok)
    (module, hidden, mask, output), = mixer_inputs(model, batch).values()
    with torch.no_grad():
        terms = implicit.short_conv_terms(module, hidden, mask)
        matrices = terms.channel_matrices()
        rebuilt = implicit.mixer_output(module, terms)
    real = batch["attention_mask"].bool()
    assert float(output[real].abs().max()) > 0.1
    assert float((rebuilt - output)[real].abs().max()) < 1e-5
    width = module.conv_kernel_size
    lag = torch.arange(matrices.shape[-1])[:, None] - torch.arange(matrices.shape[-1])[None, :]
    assert bool((matrices[..., (lag < 0) | (lag >= width)] == 0).all())  # causal and banded
    assert bool((matrices[..., (lag >= 0) & (lag < width)] != 0).any())
    # one entry by its formula
    b, c, t, s = 1, 3, 4, 2
    formula = terms.C[b, t, c] * module.conv.weight[c, 0, width - 1 - (t - s)].detach() * terms.B[b, s, c]
    assert abs(float(matrices[b, c, t, s] - formula)) < 1e-6


def test_a_saved_mamba_folder_loads_and_is_explained(tmp_path):
    folder = build_tiny("mamba", tmp_path / "mamba")
    pm = probe.load_model(str(folder))
    stack = pm.contract.stacks["decoder"]
    assert stack.maps == "implicit" and stack.mixer_class == "MambaMixer" and stack.n_layers == 2
    assert pm.contract.detected_by == "mixer classes (implicit attention)"
    explanation = probe.explain(pm, TEXTS[:2], methods=["attention_mean", "loo_delete", "saliency"])
    assert explanation.scores["attention_mean"].scores[0].shape == (2, 4)
    for scores in explanation.scores.values():
        for per_example in scores.scores:
            assert bool(torch.isfinite(per_example[~torch.isnan(per_example)]).all())
    from probe.cli import contract_table

    assert "implicit: every layer is a MambaMixer matrix" in _contract_table_text(contract_table(pm.contract))
    assert all(r.passed for r in run_checks(pm))


def _contract_table_text(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_zamba_mamba_heads_and_shared_attention_are_read_layer_by_layer():
    """Zamba (v1): every layer a Mamba scan run on separate heads of the inner width (its own
    x_proj, dt_proj, B and C per head, value and gate interleaved by in_proj), the hybrid layers
    also the shared attention block. The mixers' matrices rebuild each mixer's output (fp32, 1e-5);
    each map head is the mean of its Mamba head's channels; the attention layers equal HF eager;
    every contract check passes and the methods run."""
    import transformers

    tok, vocab = eot_tokenizer((EOT,))
    torch.manual_seed(0)
    config = transformers.ZambaConfig(**{**SHARED, "vocab_size": len(vocab), "num_hidden_layers": 3},
                                      layers_block_type=["mamba", "hybrid", "hybrid"], n_mamba_heads=2,
                                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                                      attention_hidden_size=64, attention_head_dim=16)
    model = transformers.ZambaForCausalLM(config).float().eval()
    model.set_attn_implementation("eager")
    fan_in_init(model)
    with torch.no_grad():  # zamba's per-head projections are parameters, not linear layers
        for name, parameter in model.named_parameters():
            if name.endswith(("x_proj_weight", "dt_proj_weight", "mamba.conv1d.weight")):
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    pm = probe.wrap(model, tok)
    stack = pm.contract.stacks["decoder"]
    assert stack.maps == "hybrid" and stack.layer_maps == ("implicit", "softmax", "implicit", "softmax", "implicit")
    batch = _padded(tok)
    real = batch["attention_mask"].bool()
    mixers = mixer_inputs(model, batch)
    assert len(mixers) == 3
    for module, hidden, mask, output in mixers.values():
        with torch.no_grad():
            terms = implicit.zamba_terms(module, hidden, mask)
            rebuilt = implicit.mixer_output(module, terms)
        assert float((rebuilt - output)[real].abs().max()) < 1e-5 * max(1.0, float(output.abs().max()))
        channels = terms.channel_matrices()
        assert channels.shape[1] == 2 * int(module.mamba_head_dim)
        assert float(channels.tril(-1).abs().max()) > 1e-2  # it mixes: weight on earlier tokens
        # an off-by-one matrix (keys shifted by one) misses the output by far more than the tolerance
        with torch.no_grad():
            shifted = implicit.mixer_output(module, terms, terms.scan_output(torch.roll(channels, 1, dims=-1)))
        assert float((shifted - output)[real].abs().max()) > 1e-3
    with capture_attention(pm, attention_mask=batch["attention_mask"]) as cap, torch.no_grad():
        out = pm.model(**batch, output_attentions=True)
    per_layer = cap.layer_maps("decoder")
    module, hidden, mask, _ = next(iter(mixers.values()))
    with torch.no_grad():
        channels = implicit.zamba_terms(module, hidden, mask).channel_matrices()
    expected = channels.view(channels.shape[0], 2, -1, *channels.shape[2:]).mean(2)
    assert float((per_layer[0].weights[:, 0] - expected).abs().max()) < 1e-6
    eager = [a for a in out.attentions if a is not None]
    assert len(eager) == 2
    for layer, attention in zip((1, 3), eager):
        gap = (per_layer[layer].weights[:, 0] - attention.float()) * real[:, None, :, None] * real[:, None, None, :]
        assert float(gap.abs().max()) < 1e-6
    failed = [(r.name, r.detail) for r in run_checks(pm) if not r.passed]
    assert not failed, failed
    ex = probe.explain(pm, TEXTS[:2], ["attention", "loo_delete", "integrated_gradients"])
    for i, e in enumerate(ex.examples):
        scored = ~torch.tensor(e.special)
        assert torch.isfinite(ex["loo_delete"].scores[i][scored]).all()
        heads = torch.isfinite(ex["attention"].scores[i]).all(-1)  # [layer, head]: the mixers have 2 heads
        assert heads.sum(-1).tolist() == [2, 4, 2, 4, 2]
