"""value_zeroing, alti and globenc against independent computations.

Oracles: the decomposition sums to the block output the model itself computes (read by this
test's own hooks); value zeroing equals a full forward with the value row zeroed by a hook on the
value projection; GlobEnc equals a hand computation from HF eager attentions and hidden states.
"""

from __future__ import annotations

import pytest
import torch

from probe import registry
from probe.errors import InputError
from probe.explainers import attention as A
from probe.explainers import context_mixing as M
from probe.methods import applicable_methods, parse_methods, run_method
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.queries import row_batches

from tolerances import assert_fp_close, model_depth

# Tolerances: the scores of value zeroing, ALTI and GlobEnc are rows of row-stochastic matrices (every
# entry in [0, 1], each row sums to 1) and value zeroing's distances are cosine distances (in [0, 2]):
# bounded, so their tolerances stay absolute. The decomposition's terms are hidden states (unbounded):
# compared at the scale of what they sum (tolerances.py).

TEXTS = ["the movie was good and the cast was great", "bad film", "not a good movie , but fun",
         "i loved the acting but the story was slow"]
MINILM_TEXTS = ["the film is a charming , funny and touching story of friendship .",
                "a dull , lifeless movie ."]
KINDS = ("bert", "gpt2", "llama_gqa")
#: the module whose output (post-LN) or input (pre-LN) is the attention block's output y, per kind
BLOCK_OUTPUT = {"bert": ("attention.output", "output"), "minilm": ("attention.output", "output"),
                "llama_gqa": ("post_attention_layernorm", "input"), "smollm2": ("post_attention_layernorm", "input"),
                "gpt2": ("ln_2", "input")}
VALUE_MODULE = {"bert": "attention.self.value", "minilm": "attention.self.value", "llama_gqa": "self_attn.v_proj",
                "smollm2": "self_attn.v_proj", "bart": "self_attn.v_proj"}


def _layers(model):
    for name in ("bert.encoder.layer", "model.layers", "transformer.h", "model.encoder.layers"):
        module = model
        try:
            for part in name.split("."):
                module = getattr(module, part)
        except AttributeError:
            continue
        return module
    raise AssertionError("unknown layer list")


def _block_outputs(pm, ids: torch.Tensor, kind: str) -> dict[int, torch.Tensor]:
    """The attention block's output y per layer, read by hooks of this test: [T, D]."""
    seen = {}
    handles = []
    path, side = BLOCK_OUTPUT[kind]
    for layer, block in enumerate(_layers(pm.model)):
        module = block.get_submodule(path)
        if side == "output":
            handles.append(module.register_forward_hook(
                lambda m, a, out, layer=layer: seen.__setitem__(layer, (out[0] if isinstance(out, tuple) else out)[0])))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, a, layer=layer: seen.__setitem__(layer, a[0][0])))
    try:
        with torch.no_grad():
            pm.model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _assert_sums_to(pm, terms, bias, block_output, msg=None):
    """The per-token terms [n, n, D] and bias sum to the block output the model computed: fp32 rounding
    of a forward (the layers up to this one) at the scale of the summed terms, sum_j |T_ij| + |bias|."""
    scale = float((terms.abs().sum(dim=1) + bias.abs()).max().detach())
    assert_fp_close(terms.sum(dim=1) + bias, block_output, depth=model_depth(pm), scale=scale, msg=msg)


def _check_decomposition_sums(pm, examples, kind, layers):
    layout = M.mixing_layout(pm)
    batch, tq = next(row_batches(pm, examples, len(examples)))
    records = M.record_layers(pm, batch, tq.stack, norms=layout)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        truth = _block_outputs(pm, torch.tensor([example.input_ids]), kind)
        for layer in layers:
            terms, bias = M.mixing_terms(pm, records, tq.stack, layer, row, n, layout)
            assert terms.shape == (n, n, truth[layer].shape[-1])
            _assert_sums_to(pm, terms, bias, truth[layer][:n].float(), msg=f"{kind} layer {layer}")
            if pm.task.name == "causal_lm":  # no term from a later token
                later = torch.triu_indices(n, n, 1)  # (i, j) with j > i
                assert torch.all(terms[later[0], later[1]] == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_alti_decomposition_sums_to_the_block_output(loaded, kind):
    pm = loaded(kind, "eager")
    examples = prepare(pm, TEXTS[:3])
    _check_decomposition_sums(pm, examples, kind, range(pm.contract.n_layers))


def test_alti_and_globenc_matrices_by_hand():
    # two tokens, D = 2: y_0 = (3, 0); T_00 = (2, 0), T_01 = (1, 0) -> distances 1 and 2, ||y||_1 = 3
    terms = torch.tensor([[[2.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, -4.0]]])
    bias = torch.zeros(2, 2)
    alti = M.alti_matrix(terms, bias)  # shares in [0, 1]: allclose's default tolerances are relative enough
    # row 0: max(0, 3-1)=2, max(0, 3-2)=1 -> 2/3, 1/3; row 1: y=(0,-3): d=4 -> 0, d=1 -> 2 -> 0, 1
    assert torch.allclose(alti, torch.tensor([[2 / 3, 1 / 3], [0.0, 1.0]]))
    rows = M.rolled_rows([alti, torch.tensor([[0.5, 0.5], [0.0, 1.0]])], target=0)
    assert torch.allclose(rows, torch.tensor([[2 / 3, 1 / 3], [1 / 3, 2 / 3]]))


def _zeroed_forward_distances(pm, ids: torch.Tensor, kind: str, layer: int, token: int) -> torch.Tensor:
    """Cosine distance of every token's layer output when a hook zeroes value row ``token`` of ``layer``: [T].

    The layer output is read at the block (HF's last hidden state is after the final norm)."""
    block = _layers(pm.model)[layer]
    seen = []
    keep = block.register_forward_hook(lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out)[0]))
    try:
        with torch.no_grad():
            pm.model(input_ids=ids)
        module = block.get_submodule(VALUE_MODULE[kind])

        def zero(m, args, out):
            out = out.clone()
            out[:, token] = 0
            return out

        handle = module.register_forward_hook(zero)
        try:
            with torch.no_grad():
                pm.model(input_ids=ids)
        finally:
            handle.remove()
    finally:
        keep.remove()
    base, moved = seen
    return 1 - torch.nn.functional.cosine_similarity(moved.double(), base.double(), dim=-1)


def _check_value_zeroing(pm, examples, kind, cases):
    batch, tq = next(row_batches(pm, examples, len(examples)))
    distances = M.value_zeroing_distances(pm, batch, tq.lengths.tolist(), M._mixing_stack(pm, tq))
    for row, layer, token in cases:
        ids = torch.tensor([examples[row].input_ids])
        expected = _zeroed_forward_distances(pm, ids, kind, layer, token)
        got = distances[row][layer, :, token]
        # cosine distances (in [0, 2]): absolute
        assert torch.allclose(got, expected.clamp(min=0), atol=5e-6), (kind, layer, token, got, expected)
        assert got.abs().sum() > 1e-6  # the zeroing moved something
        if pm.task.name == "causal_lm":  # zeroing a value moves only the tokens that read it
            assert torch.all(got[:token] <= 1e-12)


@pytest.mark.parametrize("kind", ["bert", "llama_gqa", "bart"])
def test_value_zeroing_equals_a_forward_with_that_value_row_zeroed(loaded, kind):
    pm = loaded(kind, "eager")
    examples = prepare(pm, TEXTS[:3])
    _check_value_zeroing(pm, examples, kind, [(0, 0, 2), (0, 1, 0), (2, 1, 4), (1, 0, 1)])


def test_value_zeroing_is_the_same_in_one_pass_or_one_variant_per_pass(loaded):
    pm = loaded("llama_gqa")
    examples = prepare(pm, TEXTS)
    batch, tq = next(row_batches(pm, examples, len(examples)))
    wide = M.value_zeroing_distances(pm, batch, tq.lengths.tolist(), tq.stack, token_budget=10**6)
    narrow = M.value_zeroing_distances(pm, batch, tq.lengths.tolist(), tq.stack, token_budget=1)
    for a, b in zip(wide, narrow, strict=True):
        assert torch.allclose(a, b, atol=1e-6)  # cosine distances: bounded (module header)


def _globenc_by_hand(model, ids: torch.Tensor) -> torch.Tensor:
    """GlobEnc for a BERT from HF eager attentions, hidden states and the weights: [layer, T] at [CLS]."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
        mats = []
        for layer, block in enumerate(model.bert.encoder.layer):
            x = out.hidden_states[layer][0]  # [T, D]
            alpha = out.attentions[layer][0]  # [H, T, T]
            n_heads, t, _ = alpha.shape
            d = x.shape[-1] // n_heads
            v = block.attention.self.value(x)  # [T, D]
            w_o = block.attention.output.dense.weight  # [D_out, D_in]
            ln1, ln2 = block.attention.output.LayerNorm, block.output.LayerNorm
            attn_out = torch.zeros(t, x.shape[-1])
            z = torch.zeros(t, t, x.shape[-1])
            for h in range(n_heads):
                fh = v[:, h * d:(h + 1) * d] @ w_o[:, h * d:(h + 1) * d].t()  # [T, D]
                z += alpha[h][..., None] * fh[None]
                attn_out += alpha[h] @ fh
            z += torch.diag_embed(torch.ones(t))[..., None] * x[None]  # residual on the diagonal
            pre_ln1 = attn_out + block.attention.output.dense.bias + x
            s1 = torch.sqrt(pre_ln1.var(-1, unbiased=False) + ln1.eps)  # [T]
            u = ln1.weight * (z - z.mean(-1, keepdim=True)) / s1[:, None, None]
            post_ln1 = ln1(pre_ln1)
            pre_ln2 = block.output.dense(block.intermediate(post_ln1)) + post_ln1
            s2 = torch.sqrt(pre_ln2.var(-1, unbiased=False) + ln2.eps)
            g = ln2.weight * (u - u.mean(-1, keepdim=True)) / s2[:, None, None]
            norms = g.norm(dim=-1)  # [T, T]
            mats.append(norms / norms.sum(-1, keepdim=True))
        rows, product = [], None
        for m in mats:
            product = m if product is None else m @ product
            rows.append(product[0])
    return torch.stack(rows)


def test_globenc_equals_a_hand_computation_on_a_tiny_bert(loaded):
    pm = loaded("bert", "eager")
    examples = prepare(pm, TEXTS[:2])
    scores = M.globenc(pm, examples)
    for i, example in enumerate(examples):
        expected = _globenc_by_hand(pm.model, torch.tensor([example.input_ids]))
        assert torch.allclose(scores.scores[i], expected, atol=1e-5), i  # rolled rows in [0, 1] (module header)


#: seq2seq encoders: (layer list, module under a layer, side) whose output/input is the attention block's y
SEQ2SEQ_BLOCK_OUTPUT = {"bart": ("model.encoder.layers", "self_attn_layer_norm", "output"),
                        "t5": ("encoder.block", "layer.1.layer_norm", "input")}


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_seq2seq_encoder_decomposition_sums_and_the_cross_hop_uses_hf_cross_attentions(loaded, kind):
    pm = loaded(kind, "eager")
    examples = prepare(pm, TEXTS[:3])
    layout = M.mixing_layout(pm)
    batch, tq = next(row_batches(pm, examples, len(examples)))
    records = M.record_layers(pm, batch, "encoder", norms=layout)
    layers_path, path, side = SEQ2SEQ_BLOCK_OUTPUT[kind]
    seen, handles = {}, []
    for layer, block in enumerate(pm.model.get_submodule(layers_path)):
        module = block.get_submodule(path)
        if side == "output":
            handles.append(module.register_forward_hook(lambda m, a, out, layer=layer: seen.__setitem__(layer, out)))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, a, layer=layer: seen.__setitem__(layer, a[0])))
    try:
        with torch.no_grad():
            hf = pm.model(**batch.inputs, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    scores = M.alti(pm, examples, batch_size=len(examples))
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        matrices = []
        for layer in range(pm.contract.stacks["encoder"].n_layers):
            terms, bias = M.mixing_terms(pm, records, "encoder", layer, row, n, layout)
            _assert_sums_to(pm, terms, bias, seen[layer][row, :n].float(), msg=f"{kind} layer {layer}")
            matrices.append(M.alti_matrix(terms, bias))
        product = matrices[0]
        for matrix in matrices[1:]:
            product = matrix @ product
        valid = tq.valid[row]
        for layer, cross in enumerate(hf.cross_attentions):  # HF's own [batch, head, target, key]
            row_of_cross = cross[row].float().mean(dim=0)[tq.rows[row][valid]].mean(dim=0)[:n]
            # rolled rows in [0, 1]
            assert torch.allclose(scores.scores[row][layer], row_of_cross @ product, atol=1e-5), (kind, row, layer)
    assert "cross-attention hop is raw" in scores.params["seq2seq"]


@pytest.mark.parametrize("kind", KINDS + ("bart", "t5"))
@pytest.mark.parametrize("method", M.CONTEXT_MIXING_METHODS)
def test_batch_of_one_equals_batch_of_n(loaded, kind, method):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS)
    together = M.context_mixing_scores(pm, examples, method, batch_size=len(examples))
    assert together.per_layer and not together.per_head
    for i in range(len(examples)):
        alone = M.context_mixing_scores(pm, examples[i:i + 1], method, batch_size=1)
        n_layers = pm.contract.stacks["cross" if pm.task.name == "seq2seq" else pm.contract.primary_stack].n_layers
        assert together.scores[i].shape == (n_layers, len(examples[i].input_ids))
        # distributions (module header)
        assert torch.allclose(together.scores[i], alone.scores[0], atol=1e-5, rtol=1e-4), (kind, method, i)
        # rows of row-stochastic matrices: every layer's scores are a distribution over the tokens
        assert torch.allclose(together.scores[i].sum(-1), torch.ones(n_layers), atol=1e-5)  # rows sum to 1
        assert (together.scores[i] >= 0).all()


def test_registered_like_every_method_and_refused_where_undefined(loaded, monkeypatch):
    assert parse_methods("value_zeroing,alti,globenc") == ["value_zeroing", "alti", "globenc"]
    bert = loaded("bert")
    examples = prepare(bert, TEXTS[:1])
    assert torch.allclose(run_method(bert, examples, "alti").scores[0], M.alti(bert, examples).scores[0])
    chosen, skipped = applicable_methods(bert, examples)
    assert {"value_zeroing", "alti", "globenc"} <= set(chosen)
    bart = loaded("bart")
    bart_examples = prepare(bart, TEXTS[:1])
    chosen, skipped = applicable_methods(bart, bart_examples)
    assert {"value_zeroing", "alti", "globenc"} <= set(chosen)
    assert bart.contract.to_dict()["context_mixing"] == {m: "supported" for m in M.CONTEXT_MIXING_METHODS}
    from probe.models import architectures as layouts

    monkeypatch.setattr(layouts, "SEQ2SEQ_TYPES", ("t5",))  # an encoder-decoder probe knows no layers of
    chosen, skipped = applicable_methods(bart, bart_examples)
    assert not {"value_zeroing", "alti", "globenc"} & set(chosen)
    for method in M.CONTEXT_MIXING_METHODS:
        assert "BartForConditionalGeneration" in skipped[method]
        with pytest.raises(InputError, match="encoder-decoder model BartForConditionalGeneration") as error:
            M.context_mixing_scores(bart, bart_examples, method)
        assert "\n" not in str(error.value)
    monkeypatch.undo()
    monkeypatch.delitem(layouts.MIXING_LAYOUTS, "gpt2")
    gpt2 = loaded("gpt2")
    with pytest.raises(InputError, match=r"GPT2LMHeadModel \(model type 'gpt2'\).*supported model types are") as error:
        M.alti(gpt2, prepare(gpt2, TEXTS[:1]))
    assert "\n" not in str(error.value)
    # value zeroing needs neither the norm layout nor the value/output table
    monkeypatch.delitem(A.VALUE_OUTPUT_LAYOUTS, "gpt2")
    assert layouts.value_zeroing_support(gpt2, "value_zeroing") is None
    assert registry.find("value_zeroing").skip_reason("support", gpt2, 0) is None
    assert "GPT2LMHeadModel" in layouts.context_mixing_support(gpt2, "globenc")
    zeroed = M.value_zeroing(gpt2, prepare(gpt2, TEXTS[:1]))
    assert torch.allclose(zeroed.scores[0].sum(-1), torch.ones(gpt2.contract.n_layers), atol=1e-5)  # rows sum to 1


# ---------------------------------------------------------------------------
# real models
# ---------------------------------------------------------------------------


def test_on_pretrained_minilm(minilm):
    pm = minilm
    examples = prepare(pm, MINILM_TEXTS)
    _check_decomposition_sums(pm, examples, "minilm", [0, 3, 5])
    _check_value_zeroing(pm, examples, "minilm", [(0, 2, 3), (1, 5, 0)])
    for method in M.CONTEXT_MIXING_METHODS:
        together = M.context_mixing_scores(pm, examples, method)
        alone = M.context_mixing_scores(pm, examples[1:], method, batch_size=1)
        assert torch.allclose(together.scores[1], alone.scores[0], atol=1e-5, rtol=1e-4), method  # distributions


@pytest.mark.slow
def test_on_the_trained_minilm_builtin(builtin_cache):
    pm = load_model("builtin:minilm-rt", cache_dir=str(builtin_cache))
    examples = prepare(pm, MINILM_TEXTS)
    scores = {m: M.context_mixing_scores(pm, examples, m) for m in M.CONTEXT_MIXING_METHODS}
    for s in scores.values():
        # rows sum to 1
        assert torch.isfinite(s.scores[0]).all() and torch.allclose(s.scores[0].sum(-1), torch.ones(6), atol=1e-5)
    _check_decomposition_sums(pm, examples[:1], "minilm", [5])


@pytest.mark.slow
def test_on_the_smollm2_builtin(builtin_cache):
    pm = load_model("builtin:smollm2-135m", cache_dir=str(builtin_cache))
    examples = prepare(pm, ["Review: a dull film\nSentiment:", "Great"])
    assert pm.contract.n_kv_heads < pm.contract.n_heads  # GQA
    _check_decomposition_sums(pm, examples, "smollm2", [0, 15, 29])
    _check_value_zeroing(pm, examples, "smollm2", [(0, 3, 2), (0, 29, 5)])
    for method in M.CONTEXT_MIXING_METHODS:
        together = M.context_mixing_scores(pm, examples, method)
        alone = M.context_mixing_scores(pm, examples[1:], method, batch_size=1)
        # distributions; 30 layers of SmolLM2 (bounded)
        assert torch.allclose(together.scores[1], alone.scores[0], atol=1e-4, rtol=1e-3), method
        assert torch.allclose(together.scores[0].sum(-1), torch.ones(pm.contract.n_layers), atol=1e-4)  # rows sum to 1
