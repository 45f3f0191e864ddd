"""Attention sinks (probe.explainers.sinks) against a hand computation.

The oracle never touches probe's hooks: it runs the same weights as a plain transformers model in
eager attention with ``output_attentions=True``, one example per forward (no padding), and applies
the definition by hand: a key's mean received attention over the query rows 0..n-1, above the
threshold = a sink; the target row (the last prompt token of a causal LM, [CLS] of a classifier)
summed over the sinks = the sink share; its non-sink weights renormalised = attention_nosink.
"""

from __future__ import annotations

import pytest
import torch

from probe.errors import InputError
from probe.explainers.sinks import attention_nosink, attention_sinks, nosink_rows
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tolerances import assert_fp_close, fp_tol, model_depth

TEXTS = ["the movie was good and fun", "a bad film", "i loved the music but the plot was slow"]
#: the threshold of the tiny models' tests: far enough from every received mean that rounding cannot flip a sink
THRESHOLD = 0.3

_ORACLES: dict = {}


def _oracle(tiny_dirs, kind):
    if kind not in _ORACLES:
        import transformers

        auto = "AutoModelForSequenceClassification" if kind == "bert" else "AutoModelForCausalLM"
        _ORACLES[kind] = getattr(transformers, auto).from_pretrained(tiny_dirs[kind],
                                                                     attn_implementation="eager").eval()
    return _ORACLES[kind]


@torch.no_grad()
def _by_hand(model, example, threshold):
    """(received, sinks, target, share, nosink) of one example, every [layer, head, ...], by hand."""
    ids = torch.tensor([example.input_ids])
    maps = torch.stack(model(input_ids=ids, output_attentions=True).attentions)[:, 0].double()  # [layer, head, q, k]
    n = len(example.input_ids)
    received = maps[:, :, :n, :n].mean(dim=2)  # Gu et al.: mean over the query rows
    sinks = received > threshold
    row = 0 if model.config.model_type == "bert" else n - 1  # [CLS], or the last prompt token
    target = maps[:, :, row, :n]
    share = (target * sinks).sum(-1)
    kept = target * ~sinks
    total = kept.sum(-1, keepdim=True)
    nosink = torch.where(total > 0, kept / total, torch.zeros_like(kept))
    return received, sinks, target, share, nosink


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama_gqa"])
def test_sinks_share_and_nosink_equal_the_hand_computation(tiny_dirs, loaded, kind):
    pm = loaded(kind)
    model = _oracle(tiny_dirs, kind)
    examples = prepare(pm, TEXTS, TargetSpec())
    found = attention_sinks(pm, examples, threshold=THRESHOLD, batch_size=3)  # padded batch
    nosink = attention_nosink(pm, examples, threshold=THRESHOLD, batch_size=2)
    depth = model_depth(pm)
    n_sinks = 0
    for i, example in enumerate(examples):
        received, sinks, target, share, expected_nosink = _by_hand(model, example, THRESHOLD)
        # a received mean within rounding of the threshold would make the comparison ill-posed
        assert float((received - THRESHOLD).abs().min()) > 100 * fp_tol(depth=depth, scale=1.0)
        got = found.examples[i]
        assert_fp_close(got.received, received, depth=depth, scale=1.0, msg=f"{kind} received ex {i}")
        assert_fp_close(got.target, target, depth=depth, scale=1.0, msg=f"{kind} target ex {i}")
        assert torch.equal(got.sinks, sinks), f"{kind} sinks ex {i}"
        assert_fp_close(got.share, share, depth=depth, scale=1.0, msg=f"{kind} share ex {i}")
        assert_fp_close(found.share[i], share, depth=depth, scale=1.0)
        assert nosink.scores[i].shape == (pm.contract.n_layers, pm.contract.n_heads, len(example.input_ids))
        assert_fp_close(nosink.scores[i], expected_nosink, depth=depth, scale=1.0, msg=f"{kind} nosink ex {i}")
        assert_fp_close(nosink.extras["sink_share"][i], share, depth=depth, scale=1.0)
        n_sinks += int(sinks.sum())
    assert n_sinks > 0, f"the tiny {kind} has no sink at threshold {THRESHOLD}: the test would be empty"
    first = torch.stack([_by_hand(model, e, THRESHOLD)[1][..., 0] for e in examples]).double().mean(0)
    assert torch.allclose(found.first_token.double(), first)
    assert torch.allclose(found.mean_share.double(), found.share.double().mean(0))


def test_nosink_rows_by_hand():
    target = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.1, 0.0], [0.6, 0.4, 0.0]])
    sinks = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    expected = torch.tensor([[0.0, 0.6, 0.4], [0.9, 0.1, 0.0], [0.0, 0.0, 0.0]])  # nothing left: all zeros
    assert torch.allclose(nosink_rows(target, sinks), expected)


def test_a_registered_explainer_run_by_name(loaded):
    from probe import registry
    from probe.methods import run_method

    entry = registry.method("attention_nosink")
    assert entry.family == "attention" and entry.per_head and entry.applies.by_name
    assert registry.params_problem("attention_nosink", {"threshold": 0.5}) is None
    pm = loaded("gpt2")
    examples = prepare(pm, TEXTS, TargetSpec())
    scores = run_method(pm, examples, "attention_nosink", params={"threshold": 0.5})
    assert scores.per_head and scores.params["threshold"] == 0.5 and "Gu et al." in scores.params["sinks"]
    direct = attention_nosink(pm, examples, threshold=0.5)
    for a, b in zip(scores.scores, direct.scores):
        assert torch.equal(a, b)
    sums = torch.cat([s.sum(-1).flatten() for s in scores.scores])  # every row sums to 1, or is all zeros
    assert bool(((sums - 1).abs() < 1e-5).logical_or(sums == 0).all())
    # a batch of one equals a batch of several (padding never scored, never a sink)
    alone = attention_nosink(pm, examples[1:2], threshold=0.5)
    assert_fp_close(alone.scores[0], direct.scores[1], depth=model_depth(pm), scale=1.0)


@pytest.mark.parametrize("threshold", [-0.1, 1.0, "0.3", True])
def test_a_bad_threshold_is_refused_in_one_line(loaded, threshold):
    pm = loaded("gpt2")
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    with pytest.raises(InputError, match="threshold") as info:
        attention_sinks(pm, examples, threshold=threshold)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_the_first_token_of_smollm2_is_a_sink_in_most_upper_heads(builtin_cache):
    """Xiao et al. 2023: in a trained causal LM the initial token soaks up attention in most heads
    of most layers (not in the first layers, which still mix local context)."""
    from probe.models.loading import load_model

    pm = load_model("builtin:smollm2-135m", cache_dir=str(builtin_cache))
    texts = ["The capital of France is", "I went to the market and bought some apples and a loaf of bread",
             "The weather today is sunny with a light breeze from the west"]
    examples = prepare(pm, texts, TargetSpec())
    found = attention_sinks(pm, examples)
    n_layers = pm.contract.n_layers
    upper = found.first_token[n_layers // 2:]  # [layer, head]
    print(f"smollm2: first token a sink in {float(upper.mean()):.0%} of upper heads; mean sink share by layer "
          f"{[round(float(v), 2) for v in found.mean_share.mean(-1)]}")
    assert float(upper.mean()) > 0.5
    # the target row puts most of its mass on sinks there too
    assert float(found.mean_share[n_layers // 2:].mean()) > 0.3
