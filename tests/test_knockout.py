"""Attention edge knockout (probe.intervene.knockout) against a hand oracle.

The oracle never touches probe's hooks or editors: it loads the same weights as plain transformers
models in eager attention and replaces the modeling file's own ``eager_attention_forward`` for the
duration of one forward. Renormalised knockout: the attention mask handed to that function gets
-inf at the blocked (head, query, key) entries, so the softmax itself leaves the key out.
Not renormalised: the model's own function runs unchanged and the blocked edge's contribution
``w[h, q, k] * v[k]`` is subtracted from its output. The target is recomputed by hand from the
logits (the label's probability; the continuation's summed log-prob).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from probe.errors import InputError
from probe.intervene.knockout import edge_knockout
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tiny_models import build_tiny
from tolerances import assert_fp_close, fp_tol, model_depth

TEXTS = ["the movie was good and fun", "a bad film", "i loved the music but the plot was slow"]
KINDS = ("bert", "gpt2", "llama_gqa", "mistral_sw")


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def folders(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """The session's tiny models, and a Mistral with GQA and a sliding window of 3 keys (built here:
    the session's tiny set has no sliding-window model), sharing the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from tiny_models import _sharpen_attention

    folder = tmp_path_factory.mktemp("knockout") / "mistral_sw"
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama_gqa"])
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=3, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, tie_word_embeddings=False, attention_dropout=0.0)
    model = MistralForCausalLM(config)
    _sharpen_attention("llama_gqa", model)  # the same q_proj / k_proj names
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return {**{k: tiny_dirs[k] for k in ("bert", "gpt2", "llama_gqa")}, "mistral_sw": folder}


_PMS: dict = {}


def _pm(folders, kind, implementation):
    if (kind, implementation) not in _PMS:
        _PMS[(kind, implementation)] = load_model(str(folders[kind]), attn_implementation=implementation)
    return _PMS[(kind, implementation)]


_ORACLES: dict = {}


def _oracle_model(folders, kind):
    """The same weights as a plain transformers model in eager attention (not probe's)."""
    if kind not in _ORACLES:
        import transformers

        auto = "AutoModelForSequenceClassification" if kind == "bert" else "AutoModelForCausalLM"
        model = getattr(transformers, auto).from_pretrained(folders[kind], attn_implementation="eager").eval()
        _ORACLES[kind] = model
    return _ORACLES[kind]


def _attention_modules(model) -> list[torch.nn.Module]:
    """The module of each layer that calls the eager attention function, read from the model's layout."""
    if hasattr(model, "bert"):
        return [layer.attention.self for layer in model.bert.encoder.layer]
    if hasattr(model, "transformer"):
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


# ----------------------------------------------------------------------------- the oracle


@contextlib.contextmanager
def _blocked_edges(model, edges: dict[int, list[tuple[int, int, int]]], renormalise: bool):
    """Within the block, the eager attention of layer ``l`` runs with edges ``(head, query, key)``
    of ``edges[l]`` blocked (see the module docstring)."""
    modules = _attention_modules(model)
    modeling = sys.modules[type(modules[0]).__module__]
    original = modeling.eager_attention_forward
    layer_of = {id(m): layer for layer, m in enumerate(modules)}

    def patched(module, query, key, value, attention_mask, *args, **kwargs):
        blocked = edges.get(layer_of.get(id(module)), [])
        if not blocked:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        batch, n_heads, q_len, _ = query.shape
        k_len = key.shape[2]
        if renormalise:
            base = torch.zeros((1, 1, q_len, k_len), dtype=query.dtype) if attention_mask is None \
                else attention_mask[..., :k_len]
            mask = base.expand(batch, n_heads, q_len, k_len).clone()  # [batch, head, query, key] additive
            for head, q, k in blocked:
                mask[:, head, q, k] = float("-inf")
            return original(module, query, key, value, mask, *args, **kwargs)
        output, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        output = output.clone()  # [batch, query, head, dim]
        group = n_heads // value.shape[1]
        for head, q, k in blocked:
            output[:, q, head, :] -= weights[:, head, q, k, None] * value[:, head // group, k, :]
        return output, weights

    modeling.eager_attention_forward = patched
    try:
        yield
    finally:
        modeling.eager_attention_forward = original


@torch.no_grad()
def _target(model, example) -> float:
    """The example's target from a plain forward of one row (no padding), by hand."""
    if example.target_ids:  # causal LM: the continuation's summed log-prob
        ids = list(example.input_ids) + list(example.target_ids[:-1])
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        n = len(example.input_ids)
        logprobs = [torch.log_softmax(logits[n - 1 + j], -1)[t] for j, t in enumerate(example.target_ids)]
        value = torch.stack(logprobs).sum()
        return float(value.exp() if example.kind == "prob" else value)
    logits = model(input_ids=torch.tensor([example.input_ids])).logits[0].double()
    assert example.kind == "prob"
    return float(torch.softmax(logits, -1)[example.label])


def _query_rows(example, key: int, query: str, query_from) -> list[int]:
    width = len(example.input_ids) + max(0, len(example.target_ids) - 1)
    if query == "target":
        return [0] if not example.target_ids else [len(example.input_ids) - 1]
    first = key + 1 if query_from is None else (len(example.input_ids) + query_from if query_from < 0 else query_from)
    return list(range(first, width))


def _oracle_score(model, example, key, units, query, query_from, renormalise) -> float:
    rows = _query_rows(example, key, query, query_from)
    edges: dict[int, list] = {}
    for layer, head in units:
        edges.setdefault(layer, []).extend((head, q, key) for q in rows)
    with _blocked_edges(model, edges, renormalise):
        knocked = _target(model, example)
    return _target(model, example) - knocked


def _check(pm, model, examples, result, *, layers, heads, query="target", query_from=None, renormalise,
           per_head_units=None, label=""):
    """Every scored token's per-token score, and the per-head scores of ``per_head_units``, against the oracle."""
    depth = model_depth(pm)
    worst = 0.0
    for i, example in enumerate(examples):
        scale = abs(float(result.original_value[i]))
        expected_tokens = torch.full((len(example.input_ids),), float("nan"), dtype=torch.float64)
        for t, special in enumerate(example.special):
            if not special:
                expected_tokens[t] = _oracle_score(model, example, t, list(itertools.product(layers, heads)), query,
                                                   query_from, renormalise)
        assert_fp_close(result.tokens.scores[i], expected_tokens, depth=depth, scale=scale,
                        msg=f"{label} tokens ex {i}")
        worst = max(worst, float((result.tokens.scores[i].double() - expected_tokens).nan_to_num().abs().max()))
        for layer, head in per_head_units or ():
            got = result.per_head.scores[i][layer, head]
            expected = torch.full_like(expected_tokens, float("nan"))
            for t, special in enumerate(example.special):
                if not special:
                    expected[t] = _oracle_score(model, example, t, [(layer, head)], query, query_from, renormalise)
            assert_fp_close(got, expected, depth=depth, scale=scale, msg=f"{label} L{layer}H{head} ex {i}")
            worst = max(worst, float((got.double() - expected).nan_to_num().abs().max()))
    print(f"{label}: largest |probe - oracle| {worst:.3g}")  # shown with pytest -s
    return worst


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_knockout_of_the_target_row_equals_the_masked_eager_forward(folders, kind, implementation, renormalise):
    pm = _pm(folders, kind, implementation)
    model = _oracle_model(folders, kind)
    examples = prepare(pm, TEXTS, TargetSpec())
    n_layers = pm.contract.stacks[pm.task.target_stack(pm.contract)].n_layers
    result = edge_knockout(pm, examples, renormalise=renormalise, batch_size=16)
    units = [(0, 1), (n_layers - 1, 2)]
    _check(pm, model, examples, result, layers=range(n_layers), heads=range(4), renormalise=renormalise,
           per_head_units=units, label=f"{kind} {implementation} renormalise={renormalise}")
    # per-head grid: NaN exactly at special tokens, every layer and head scored
    for i, example in enumerate(examples):
        grid = result.per_head.scores[i]
        assert grid.shape == (n_layers, 4, len(example.input_ids))
        special = torch.tensor(example.special)
        assert bool(grid[:, :, special].isnan().all()) and not bool(grid[:, :, ~special].isnan().any())
    # the knockout moves the target far beyond the tolerance: not a vacuous comparison
    largest = max(float(s.nan_to_num().abs().max()) for s in result.tokens.scores)
    assert largest > 100 * fp_tol(float(result.original_value.abs().max()), depth=model_depth(pm))


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "mistral_sw"])
def test_a_layer_window_and_a_head_subset_equal_the_oracle(folders, kind, renormalise):
    pm = _pm(folders, kind, "sdpa")
    model = _oracle_model(folders, kind)
    examples = prepare(pm, TEXTS[:2], TargetSpec())
    # one layer, two query heads that read the same key/value head under GQA (0 and 1 share kv head 0)
    result = edge_knockout(pm, examples, layers=[-1], heads=[0, 1], renormalise=renormalise)
    assert result.tokens.params["layers"] == [1] and result.tokens.params["heads"] == [0, 1]
    _check(pm, model, examples, result, layers=[1], heads=[0, 1], renormalise=renormalise,
           per_head_units=[(1, 0), (1, 1)], label=f"{kind} window renormalise={renormalise}")
    for grid in result.per_head.scores:  # outside the window and the heads: not scored
        assert bool(grid[0].isnan().all()) and bool(grid[1, 2:].isnan().all())


@pytest.mark.parametrize("query_from", [None, -2, 1])
@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama_gqa", "mistral_sw"])
def test_every_query_row_from_a_position_on_equals_the_oracle(folders, kind, query_from):
    pm = _pm(folders, kind, "sdpa")
    model = _oracle_model(folders, kind)
    if kind == "bert":
        examples = prepare(pm, TEXTS[:2], TargetSpec())
    else:  # a two-token continuation: its first token's row is blocked too
        examples = prepare(pm, TEXTS[:2], TargetSpec(continuation=" very good"))
        assert all(len(e.target_ids) == 2 for e in examples)
    for renormalise in (True, False):
        result = edge_knockout(pm, examples, query="from", query_from=query_from, renormalise=renormalise,
                               per_head=True)
        _check(pm, model, examples, result, layers=[0, 1], heads=range(4), query="from", query_from=query_from,
               renormalise=renormalise, per_head_units=[(0, 3)],
               label=f"{kind} from={query_from} renormalise={renormalise}")


def test_a_one_layer_one_head_window_is_one_row_and_equals_its_per_head_score(folders):
    pm = _pm(folders, "llama_gqa", "sdpa")
    examples = prepare(pm, TEXTS, TargetSpec())
    result = edge_knockout(pm, examples, layers=1, heads=3)
    n_scored = sum(not s for e in examples for s in e.special)
    assert result.stats["rows_run"] == len(examples) + n_scored  # the per-head row is the per-token row
    for i in range(len(examples)):
        assert torch.equal(result.tokens.scores[i].nan_to_num(7.0), result.per_head.scores[i][1, 3].nan_to_num(7.0))


def test_per_head_scores_are_consistent_with_the_window(folders):
    """Knockouts do not add up exactly (the target is not linear in the weights), but blocking one
    head's edge without renormalising is a change linear in that head's output: for small effects
    the sum of the per-head scores of a window approaches its per-token score (first order)."""
    pm = _pm(folders, "llama_gqa", "sdpa")
    examples = prepare(pm, TEXTS, TargetSpec())
    result = edge_knockout(pm, examples, layers=1, renormalise=False)
    for i, example in enumerate(examples):
        summed = result.per_head.scores[i][1].sum(0)  # [tokens] over the layer's heads
        token = result.tokens.scores[i]
        scored = ~torch.tensor(example.special)
        error = (summed[scored] - token[scored]).abs()
        # second order in the removed weights: well under the effects' own size
        assert float(error.max()) <= 0.5 * float(token[scored].abs().max()) + fp_tol(1.0, depth=model_depth(pm))


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_a_batch_of_one_equals_a_batch_of_several(folders, kind):
    pm = _pm(folders, kind, "sdpa")
    examples = prepare(pm, TEXTS, TargetSpec())
    together = edge_knockout(pm, examples, batch_size=64)
    for i in range(len(examples)):
        alone = edge_knockout(pm, examples[i:i + 1], batch_size=1)
        scale = abs(float(together.original_value[i]))
        assert_fp_close(alone.tokens.scores[0], together.tokens.scores[i], depth=model_depth(pm), scale=scale)
        assert_fp_close(alone.per_head.scores[0], together.per_head.scores[i], depth=model_depth(pm), scale=scale)


@pytest.mark.parametrize("block", [None, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_prefix_reuse_feeds_each_row_from_its_first_edited_query_and_gives_the_same_scores(folders, kind, block,
                                                                                           monkeypatch):
    """A causal LM's knockout rows share every position before their first edited query row: run
    once as a cache, each row then feeds only its suffix (one token for a one-token target). The
    scores equal the rows run whole, for the target row, a continuation, the rows from a position on,
    per generated step and with a contrast foil; the oracle tests above already run the reused path.
    ``block``: the shared prefix fed 2 tokens at a time (its query blocks), the same scores."""
    import probe.intervene.prefix as prefix

    if block is not None:
        monkeypatch.setattr(prefix, "QUERY_BLOCK", block)
    pm = _pm(folders, kind, "sdpa")
    cases = [(TargetSpec(), "target", None), (TargetSpec(continuation=" very good"), "target", None),
             (TargetSpec(continuation=" very good"), "from", -2), (TargetSpec(), "from", 1),
             (TargetSpec(continuation=" very good", steps=True), "target", None),
             (TargetSpec(continuation=" good", contrast=" bad"), "target", None)]
    for spec, query, query_from in cases:
        examples = prepare(pm, TEXTS, spec)
        reused = edge_knockout(pm, examples, query=query, query_from=query_from, batch_size=4)
        whole = edge_knockout(pm, examples, query=query, query_from=query_from, batch_size=4, reuse_prefix=False)
        assert reused.stats["prefix_reuse"] and not whole.stats["prefix_reuse"]
        assert reused.stats["rows_run"] == whole.stats["rows_run"]
        # from position 1 on: one token fewer per row; the target rows: about the text's length fewer
        assert reused.stats["tokens_fed"] < whole.stats["tokens_fed"] / (1.05 if query_from == 1 else 2), (spec, query)
        if query == "target" and not spec.continuation:  # one fed token per row
            assert reused.stats["tokens_fed"] == reused.stats["rows_run"]
        for i in range(len(examples)):
            # a contrast is a difference of log-probs, each of magnitude up to log(vocabulary): their scale
            scale = max(abs(float(whole.original_value[i])), math.log(len(pm.tokenizer)))
            assert_fp_close(reused.tokens.scores[i], whole.tokens.scores[i], depth=model_depth(pm), scale=scale)
            assert_fp_close(reused.per_head.scores[i], whole.per_head.scores[i], depth=model_depth(pm), scale=scale)
        largest = max(float(s.nan_to_num().abs().max()) for s in whole.tokens.scores)
        assert largest > 100 * fp_tol(float(whole.original_value.abs().max()), depth=model_depth(pm))


def test_prefix_reuse_is_not_tried_where_the_cache_is_not_plain_or_the_model_not_causal(folders):
    for kind in ("bert", "mistral_sw"):  # bidirectional; a sliding window keeps another cache
        pm = _pm(folders, kind, "sdpa")
        result = edge_knockout(pm, prepare(pm, TEXTS[:1], TargetSpec()), per_head=False)
        assert not result.stats["prefix_reuse"], kind


def test_joint_blocking_reuses_the_prefix_and_gives_the_same_values(folders):
    from probe.intervene.knockout import EdgeSet, block_edges

    pm = _pm(folders, "llama_gqa", "sdpa")
    examples = prepare(pm, TEXTS, TargetSpec(continuation=" very good"))
    sets = [EdgeSet(i, (1, 2), ((0, 1), (1, 0), (1, 3))) for i in range(len(examples))]
    sets += [EdgeSet(0, (0,), ((1, 2),))]
    original, blocked = block_edges(pm, examples, sets, batch_size=2)
    original_whole, blocked_whole = block_edges(pm, examples, sets, batch_size=2, reuse_prefix=False)
    assert_fp_close(original, original_whole, depth=model_depth(pm), scale=float(original_whole.abs().max()))
    assert_fp_close(blocked, blocked_whole, depth=model_depth(pm), scale=float(original_whole.abs().max()))
    assert float((blocked_whole - original_whole[[s.example for s in sets]]).abs().max()) > 1e-3


def test_closed_edges_are_exact_zeros_without_a_pass(folders):
    """query='from' after the key: the last prompt token of a one-token target has no later row, so
    its knockout is a no-op (0, no row run); a sliding window's closed edges change nothing either."""
    pm = _pm(folders, "gpt2", "sdpa")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    assert len(examples[0].target_ids) == 1
    result = edge_knockout(pm, examples, query="from", per_head=False)
    assert float(result.tokens.scores[0][-1]) == 0.0
    assert result.stats["noops"] == 1
    # Mistral, window 3: the target row (the last token) cannot see keys more than 2 back in any layer
    pm = _pm(folders, "mistral_sw", "sdpa")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    n = len(examples[0].input_ids)
    result = edge_knockout(pm, examples, layers=[0, 1], per_head=False)
    closed = result.tokens.scores[0][1: n - 3]  # scored keys outside the window of the target row
    assert closed.numel() > 0
    assert_fp_close(closed, torch.zeros_like(closed), depth=model_depth(pm), scale=abs(float(result.original_value[0])))
    assert float(result.tokens.scores[0][n - 3:].abs().max()) > 1e-4  # and the keys inside it matter


def test_bad_options_are_refused_in_one_line(folders):
    pm = _pm(folders, "gpt2", "sdpa")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    for kwargs, words in [({"query": "all"}, "target, from"), ({"layers": 5}, "0..1"), ({"heads": [4]}, "0..3"),
                          ({"query_from": 2}, "query='from'"), ({"renormalise": "yes"}, "True"),
                          ({"batch_size": 0}, "positive")]:
        with pytest.raises(InputError) as info:
            edge_knockout(pm, examples, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value), kwargs


def test_a_read_path_that_cannot_edit_is_refused_in_one_line(tmp_path):
    """Banded attention (Longformer) is read densified but cannot take edited weights back; an
    implicit mixer (Mamba) has no softmax to knock an edge out of."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    tok = sweep.tokenizer()
    pm = sweep.wrap(sweep.build("longformer", "classification", "eager"), tok, "classification")
    examples = prepare(pm, ["the movie was good"], TargetSpec())
    with pytest.raises(InputError) as info:
        edge_knockout(pm, examples)
    message = str(info.value)
    assert "edge knockout" in message and "\n" not in message, message

    folder = build_tiny("mamba", tmp_path / "mamba")
    pm = load_model(str(folder))
    examples = prepare(pm, ["the movie was good"], TargetSpec())
    with pytest.raises(InputError) as info:
        edge_knockout(pm, examples)
    message = str(info.value)
    assert "edge knockout" in message and "\n" not in message, message


@pytest.mark.slow
def test_knockout_on_the_smollm2_builtin_equals_the_masked_eager_forward(builtin_cache):
    """SmolLM2-135M (Llama layout, GQA 9 query / 3 kv heads, 30 layers): a window of two layers,
    knocked out in sdpa by probe, against the eager oracle on the same weights."""
    pm = load_model("builtin:smollm2-135m", cache_dir=str(builtin_cache))
    assert pm.contract.n_kv_heads < pm.contract.n_heads  # GQA
    examples = prepare(pm, ["The capital of France is"], TargetSpec(continuation=" Paris"))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(pm.path, attn_implementation="eager").eval()
    heads = [0, 4]  # query heads 0 and 4 read different kv heads (3 query heads per kv head)
    for renormalise in (True, False):
        result = edge_knockout(pm, examples, layers=[10, 11], heads=heads, renormalise=renormalise, per_head=True)
        _check(pm, model, examples, result, layers=[10, 11], heads=heads, renormalise=renormalise,
               per_head_units=[(11, 4)], label=f"smollm2 renormalise={renormalise}")



# ----------------------------------------------------------------------------- the registered reference `knockout`


def test_knockout_is_a_registered_signed_reference_run_by_name():
    from probe import registry
    from probe.names import INTERVENTION_METHODS

    entry = registry.method("knockout")
    assert entry.family == "intervention" and entry.signed and not entry.per_head and not entry.engine
    assert "knockout" in INTERVENTION_METHODS and entry.span_mode is None
    assert entry.defaults() == registry.KnockoutParams()
    assert registry.params_problem("knockout", {"layers": "-2:", "heads": "0,1", "renormalise": False}) is None
    assert registry.params_problem("knockout", {"layers": 1, "query": "from", "query_from": 2}) is None
    bad, sentence = registry.params_problem("knockout", {"renormalize": True})
    assert bad == "renormalize" and "did you mean 'renormalise'" in sentence
    # lists of ints, as a study file writes them, and layers counted from the end
    assert registry.params_problem("knockout", {"layers": [0, -1], "heads": [0, 2]}) is None
    assert registry.params_problem("knockout", {"layers": -1, "heads": 1}) is None
    bad, sentence = registry.params_problem("knockout", {"layers": [0, "x"]})
    assert bad == "layers" and "tuple[int, ...]" in sentence
    bad, sentence = registry.params_problem("knockout", {"heads": -1})
    assert bad == "heads" and "out of range" in sentence  # a head index does not count from the end
    bad, sentence = registry.params_problem("knockout", {"batch_size": -3})
    assert bad == "batch_size" and "give 1..4096" in sentence
    bad, sentence = registry.params_problem("knockout", {"query": "all"})
    assert bad == "query" and "give one of target, from" in sentence  # the declared choices, before any model


def test_a_study_file_gives_layers_and_heads_as_lists(tmp_path):
    """`params: {knockout: {layers: [0, 1], heads: [0, 2]}}` in a study file validates, and the
    method runs on those layers and heads (YAML lists are what a person writes)."""
    import yaml

    from probe.spec.study import load_study

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:rotten_tomatoes", "n": 10},
        "explainers": ["attention_mean"], "references": ["knockout"],
        "params": {"knockout": {"layers": [0, -1], "heads": [0, 2], "renormalise": False}}}))
    study = load_study(path)
    assert study.params["knockout"]["layers"] == [0, -1] and study.params["knockout"]["heads"] == [0, 2]


def _as_result(scores, pm):
    """A TokenScores of the registered method read as _check reads a KnockoutResult."""
    from types import SimpleNamespace

    per_head = SimpleNamespace(scores=scores.extras["per_head"]) if "per_head" in scores.extras else None
    return SimpleNamespace(tokens=scores, per_head=per_head,
                           original_value=torch.tensor(scores.extras["original_values"]))


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_the_registered_method_through_the_dispatcher_equals_the_oracle(folders, kind):
    """`run_method(pm, examples, "knockout", params=...)` (the path of probe explain, studies and claims):
    the last layer (a study file's "-1:"), heads "0,1", not renormalised, per-head scores in extras."""
    from probe.methods import run_method

    pm, model = _pm(folders, kind, "sdpa"), _oracle_model(folders, kind)
    examples = prepare(pm, TEXTS[:2], TargetSpec(continuation=None if kind == "bert" else " fun"))
    scores = run_method(pm, examples, "knockout", params={"layers": "-1:", "heads": "0,1", "renormalise": False,
                                                          "per_head": True})
    assert scores.method == "knockout" and not scores.per_head
    assert scores.params["layers"] == [1] and scores.params["heads"] == [0, 1] and scores.params["per_head"]
    for i, example in enumerate(examples):
        assert scores.scores[i].shape == (len(example.input_ids),)
        assert scores.extras["per_head"][i].shape == (2, pm.contract.n_heads, len(example.input_ids))
    _check(pm, model, examples, _as_result(scores, pm), layers=[1], heads=[0, 1], renormalise=False,
           per_head_units=[(1, 1)], label=f"registered {kind}")
    default = run_method(pm, examples[:1], "knockout")  # defaults: every layer and head, renormalised
    direct = edge_knockout(pm, examples[:1], per_head=False)
    assert torch.equal(default.scores[0].nan_to_num(-9), direct.tokens.scores[0].nan_to_num(-9))
    assert "per_head" not in default.extras


@pytest.mark.parametrize("kind", ["bert", "gpt2", "t5"])
def test_the_registered_method_in_a_batch_of_one_equals_a_batch_of_several(loaded, kind):
    """What tests/across/test_every_method.py checks of every method it runs by default (knockout runs by name only)."""
    from probe.methods import run_method

    pm = loaded(kind)
    texts = ["a good film", "the plot was thin and the acting was worse than the plot", "bad", "it was fine, I think"]
    examples = prepare(pm, texts, TargetSpec())
    together = run_method(pm, examples, "knockout", params={"batch_size": 5})
    for i in (1, 2):
        alone = run_method(pm, examples[i:i + 1], "knockout")
        assert together.scores[i].shape == alone.scores[0].shape == (len(examples[i].input_ids),)
        assert_fp_close(together.scores[i], alone.scores[0], depth=model_depth(pm),
                        scale=abs(examples[i].original_value), msg=f"{kind} example {i}")


def test_probe_explain_study_and_claim_files_take_knockout(loaded):
    import probe
    from probe.claims.file import claims_from_dict
    from probe.spec.study import study_from_dict

    pm = loaded("gpt2")
    explanation = probe.explain(pm, ["a good film"], "knockout", params={"knockout": {"layers": 0}})
    assert explanation.scores["knockout"].params["layers"] == [0]
    study = study_from_dict({"name": "k", "model": {"id": "builtin:minilm-rt"},
                             "dataset": {"name": "builtin:rotten_tomatoes"}, "explainers": ["attention"],
                             "references": ["knockout"],
                             "params": {"knockout": {"layers": "-2:", "renormalise": False}}})
    assert study.references == ["knockout"] and study.params["knockout"]["layers"] == "-2:"
    with pytest.raises(InputError, match="renormalise"):
        study_from_dict({"name": "k", "model": {"id": "builtin:minilm-rt"},
                         "dataset": {"name": "builtin:rotten_tomatoes"}, "explainers": ["attention"],
                         "references": ["knockout"], "params": {"knockout": {"renormalise": "yes"}}})
    claims = claims_from_dict({"model": {"id": "builtin:minilm-rt"},
                               "data": {"dataset": "builtin:rotten_tomatoes", "split": "test", "n": 2}, "claims": [
        {"claim": "c", "kind": "faithfulness", "attention": "attention_mean@last", "reference": "knockout",
         "threshold": 0.0}]})
    assert claims.claims[0].reference == "knockout"


def test_bad_layer_and_head_strings_are_refused_in_one_line(folders):
    from probe.intervene.knockout import knockout

    pm = _pm(folders, "gpt2", "sdpa")
    examples = prepare(pm, TEXTS[:1], TargetSpec(continuation=" fun"))
    for params, word in (({"layers": "a:b"}, "layers"), ({"heads": "5:"}, "heads"), ({"layers": "0:1:2"}, "layers")):
        with pytest.raises(InputError, match=word) as info:
            knockout(pm, examples, **params)
        assert "\n" not in str(info.value)


def test_lists_of_ints_select_what_their_strings_select(folders):
    """layers [-1] and heads [0, 1] (a study file's lists) knock out exactly what "-1:" and "0,1" do."""
    from probe.methods import run_method

    pm = _pm(folders, "bert", "sdpa")
    examples = prepare(pm, TEXTS[:2], TargetSpec())
    strings = run_method(pm, examples, "knockout", params={"layers": "-1:", "heads": "0,1"})
    lists = run_method(pm, examples, "knockout", params={"layers": [-1], "heads": [0, 1]})
    assert lists.params["layers"] == strings.params["layers"] == [1] and lists.params["heads"] == [0, 1]
    for a, b in zip(strings.scores, lists.scores):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
