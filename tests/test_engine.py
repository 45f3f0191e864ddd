"""Token interventions and the batched engine: correctness against captum, against full
recomputation, across batch sizes; de-duplication; erasure curves; errors."""

from __future__ import annotations

import math

import pytest
import torch

from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.intervene.erasure import (
    ERASURE_BINS,
    bin_size,
    erasure,
    random_ranking,
    ranked_positions,
)
from probe.intervene.rowcache import common_prefix
from probe.intervene.tokens import LOO_MODES, loo
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec
from probe.rows.values import evaluate

from tolerances import assert_fp_close, fp_close, gradient_term_scales, model_depth

TINY_TEXTS = [
    "the movie was very good",
    "i hated this film , it was boring and too long",
    "a great story with wonderful acting",
    "the movie was very good",  # a duplicate: its rows must be run once
]
LM_TEXTS = ["the movie was very good and the acting was great", "i hated this film", "paris is the capital of"]
REAL_TEXTS = [
    "a gorgeous, witty, seductive movie.",
    "the plot is nothing but boilerplate clichés from start to finish.",
    "an utterly compelling 'who wrote it' in which the reputation of the most famous author who ever lived comes into "
    "question.",
    "it's a lot less funny than it thinks it is, and the performances are wooden.",
    "unflinchingly bleak and desperate",
    "the film sparkles with the energy of its young cast.",
    "too long, too slow and too pleased with itself.",
    "a masterpiece four years in the making.",
]
MODES_BY_KIND = {
    "bert": ("delete", "mask", "unk", "pad", "random"),
    "gpt2": ("delete", "pad", "random", "lm"),  # no mask token; unk is the EOS id
    "llama_gqa": ("delete", "unk", "pad", "random", "lm"),
    "t5": ("delete", "unk", "pad", "random"),
}


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load_model(str(tiny_dirs[kind])) for kind in MODES_BY_KIND}


def _examples(pm, kind: str | None = None):
    if pm.task.name == "classification":
        # logits of the tiny random classifier move more than its near-0.5 probabilities
        return prepare(pm, TINY_TEXTS, TargetSpec(kind="logit"))
    if pm.task.name == "causal_lm":
        return prepare(pm, LM_TEXTS, TargetSpec(continuation="it was good"))
    return prepare(pm, TINY_TEXTS)


def _same(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    """Equality for seeded and determinism checks (atol 0, or 1e-9 where any difference counts)."""
    return bool(torch.equal(torch.isnan(a), torch.isnan(b))) and torch.allclose(
        torch.nan_to_num(a), torch.nan_to_num(b), atol=atol, rtol=0)


def _loo_scale(example, *scores: torch.Tensor) -> float:
    """A LOO effect f(x) - f(x') is rounded at the scale of the two target values (logits, log-probs:
    unbounded), not at that of their difference: |f(x)| + max |f(x')| <= 2 |f(x)| + max |effect|."""
    finite = torch.cat([s[~torch.isnan(s)].double().flatten() for s in scores])
    return 2 * abs(example.original_value) + (float(finite.abs().max()) if finite.numel() else 0.0)


def _same_loo(pm, example, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two LOO score vectors from one forward each per row, in other batches: fp32 rounding of a forward."""
    return fp_close(a, b, depth=model_depth(pm), scale=_loo_scale(example, a, b))


# ------------------------------------------------------------------------------ LOO vs captum


def _captum_loo(pm, example, baseline: int, perturbations_per_eval: int = 1) -> torch.Tensor:
    """captum FeatureAblation over input ids: one feature per position, the same target."""
    from captum.attr import FeatureAblation

    def forward(ids: torch.Tensor) -> torch.Tensor:  # [batch, tokens] -> [batch]
        return evaluate(pm, [(row.tolist(), example) for row in ids])

    ids = torch.tensor([example.input_ids])  # [1, tokens]
    attribution = FeatureAblation(forward).attribute(
        ids, baselines=baseline, feature_mask=torch.arange(ids.shape[1])[None],
        perturbations_per_eval=perturbations_per_eval)
    return attribution[0].double()  # [tokens]; captum: f(x) - f(x with the feature ablated)


@pytest.mark.parametrize("mode", ["mask", "unk", "pad"])
def test_loo_replacement_equals_captum_feature_ablation_tiny(models, mode):
    pm = models["bert"]
    examples = _examples(pm)
    scores = loo(Engine(pm), examples, mode)
    baseline = scores.params["replacement_id"]
    for example, ours in zip(examples, scores.scores):
        theirs = _captum_loo(pm, example, baseline)
        scored = ~torch.tensor(example.special)
        assert torch.isnan(ours[~scored]).all()
        assert_fp_close(ours[scored].double(), theirs[scored], depth=model_depth(pm), scale=_loo_scale(example, ours))


@pytest.mark.parametrize("mode", ["mask", "unk", "pad"])
def test_loo_replacement_equals_captum_feature_ablation_minilm(minilm, mode):
    examples = prepare(minilm, REAL_TEXTS[:4])
    scores = loo(Engine(minilm, token_budget=512), examples, mode)
    baseline = scores.params["replacement_id"]
    assert scores.method == f"loo_{mode}"
    for example, ours in zip(examples, scores.scores):
        theirs = _captum_loo(minilm, example, baseline, perturbations_per_eval=8)
        scored = ~torch.tensor(example.special)
        assert_fp_close(ours[scored].double(), theirs[scored], depth=model_depth(minilm), scale=_loo_scale(example, ours))
        assert ours[scored].abs().max() > 1e-4  # the comparison is not between zeros


@pytest.mark.slow
def test_loo_mask_equals_captum_on_trained_minilm_rt(builtin_cache):
    pm = load_model("builtin:minilm-rt", cache_dir=str(builtin_cache))
    examples = prepare(pm, REAL_TEXTS[:3])
    scores = loo(Engine(pm), examples, "mask")
    for example, ours in zip(examples, scores.scores):
        theirs = _captum_loo(pm, example, pm.tokenizer.mask_token_id, perturbations_per_eval=16)
        scored = ~torch.tensor(example.special)
        assert_fp_close(ours[scored].double(), theirs[scored], depth=model_depth(pm), scale=_loo_scale(example, ours))


def test_loo_delete_is_the_one_shorter_sequence(models):
    pm = models["bert"]
    examples = _examples(pm)[:2]
    scores = loo(Engine(pm), examples, "delete")
    for example, score in zip(examples, scores.scores):
        ids = example.input_ids
        for t in range(len(ids)):
            if example.special[t]:
                continue
            expected = evaluate(pm, [(ids, example)])[0] - evaluate(pm, [(ids[:t] + ids[t + 1:], example)])[0]
            assert fp_close(float(score[t]), float(expected), depth=model_depth(pm), scale=_loo_scale(example, score))


# ------------------------------------------------------------------------------ batching


@pytest.mark.parametrize("kind,mode", [(k, m) for k, modes in MODES_BY_KIND.items() for m in modes])
def test_batch_one_batch_n_and_packed_engine_agree(models, kind, mode):
    pm = models[kind]
    examples = _examples(pm)
    together = loo(Engine(pm, token_budget=100_000), examples, mode, k=3, seed=5)
    packed = loo(Engine(pm, token_budget=16), examples, mode, k=3, seed=5)  # many small batches
    for i, example in enumerate(examples):
        one_row_at_a_time = loo(Engine(pm, token_budget=1), [example], mode, k=3, seed=5)
        assert _same_loo(pm, example, one_row_at_a_time.scores[0], together.scores[i]), (kind, mode, i)
        assert _same_loo(pm, example, packed.scores[i], together.scores[i]), (kind, mode, i)
        # padding never enters: one score per explained token, specials (only) unscored
        special = torch.tensor(example.special)
        assert together.scores[i].shape == (len(example.input_ids),)
        assert torch.isnan(together.scores[i][special]).all()
        assert not torch.isnan(together.scores[i][~special]).any()


def test_sampling_modes_are_seeded(models):
    pm = models["llama_gqa"]
    examples = _examples(pm)
    for mode in ("random", "lm"):
        a = loo(Engine(pm), examples, mode, k=2, seed=1)
        b = loo(Engine(pm), examples, mode, k=2, seed=1)
        c = loo(Engine(pm), examples, mode, k=2, seed=2)
        assert all(_same(x, y, atol=0) for x, y in zip(a.scores, b.scores))
        assert not all(_same(x, y, atol=1e-9) for x, y in zip(a.scores, c.scores))
        assert a.params == {"mode": mode, "k": 2, "seed": 1}


def test_padding_does_not_change_a_rows_value(models):
    pm = models["bert"]
    short, long = _examples(pm)[:2]
    engine = Engine(pm)
    alone = engine.values([(short.input_ids, short)])
    padded = Engine(pm).values([(short.input_ids, short), (long.input_ids, long)])  # short is right-padded
    # a logit: rounding of one forward at its own scale, far below what a leaked pad key moves it by
    assert fp_close(float(alone[0]), float(padded[0]), depth=model_depth(pm)), (float(alone[0]), float(padded[0]))


def test_packing_respects_the_token_budget(models):
    pm = models["bert"]
    examples = _examples(pm)
    widths = []
    original_forward = pm.model.forward

    def spy(*args, **kwargs):
        widths.append(tuple(kwargs["input_ids"].shape))
        return original_forward(*args, **kwargs)

    pm.model.forward = spy
    try:
        loo(Engine(pm, token_budget=40), examples, "delete")
    finally:
        del pm.model.forward
    assert len(widths) > 1
    assert all(rows * width <= 40 or rows == 1 for rows, width in widths)


def test_engine_counts_and_deduplicates(models):
    pm = models["bert"]
    examples = _examples(pm)  # the 4th is a copy of the 1st
    engine = Engine(pm)
    n_scorable = [sum(not s for s in e.special) for e in examples]
    unique = n_scorable[:3]
    loo(engine, examples, "mask")
    assert engine.stats.rows_requested == sum(n_scorable) + len(examples)
    assert engine.stats.rows_evaluated == sum(unique) + 3  # duplicate example's rows run once
    passes = engine.stats.forward_passes
    loo(engine, examples, "mask")  # everything cached
    assert engine.stats.rows_evaluated == sum(unique) + 3
    assert engine.stats.forward_passes == passes
    loo(engine, examples, "unk")  # only the new perturbations run; the originals are reused
    assert engine.stats.rows_evaluated == 2 * sum(unique) + 3
    assert engine.stats.cache_hits > 0


def test_engine_runs_in_eval_mode_and_restores_the_mode(minilm):
    examples = prepare(minilm, REAL_TEXTS[:2])
    rows = [(e.input_ids, e) for e in examples]
    reference = Engine(minilm).values(rows)
    minilm.model.train()  # MiniLM has dropout 0.1: values would be random in train mode
    try:
        again = Engine(minilm).values(rows)
        assert minilm.model.training
    finally:
        minilm.model.eval()
    assert_fp_close(reference, again, depth=model_depth(minilm))  # target values (eval both times)


# ------------------------------------------------------------------------------ prefix reuse


def _perturbations(example, replacement: int, min_position: int = 0):
    ids = list(example.input_ids)
    rows = []
    for t in range(min_position, len(ids)):
        rows.append(ids[:t] + [replacement] + ids[t + 1:])  # same length
        rows.append(ids[:t] + ids[t + 1:])  # one shorter
        rows.append(ids[:t] + [replacement, replacement] + ids[t:])  # two longer
    return [r for r in rows if r]


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_prefix_reuse_equals_full_recomputation(models, kind):
    pm = models[kind]
    examples = _examples(pm)
    for example in examples:
        rows = _perturbations(example, replacement=7)
        engine = Engine(pm, token_budget=64)
        reused = engine.values_with_prefix_reuse(example, rows)
        full = evaluate(pm, [(r, example) for r in rows])  # one padded batch, no cache
        # log-probs (unbounded) from a cached prefix and from scratch: one forward in another order
        assert_fp_close(reused, full, depth=model_depth(pm))
        assert engine.stats.prefix_rows > 0 and engine.stats.prefix_passes > 0
        for r in range(0, len(rows), 7):  # and unpadded, one row at a time
            assert fp_close(float(reused[r]), float(evaluate(pm, [(rows[r], example)])[0]), depth=model_depth(pm))


@pytest.mark.parametrize("logits", ["kept", "all"])
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_prefix_reuse_with_packed_segments(models, kind, logits):
    """Rows of several examples, of different lengths and first-change positions, packed side by
    side into bins over a gathered prefix cache, under a 4-D mask. The vocabulary projection runs
    on the kept positions only ("kept") or, for a model that slices its logits its own way, on all."""
    pm = models[kind]
    examples = _examples(pm)
    rows = [(r, e) for e in examples for r in _perturbations(e, replacement=9, min_position=1)]
    calls, projected = [], []
    original_forward = pm.model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs.get("cache") is not None, tuple(kwargs["input_ids"].shape),
                      tuple(kwargs["attention_mask"].shape)))
        return original_forward(*args, **kwargs)

    pm.model.forward = spy
    head = pm.model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: projected.append(args[0].shape[:-1].numel()))
    try:
        # a huge per-call cost: the planner puts every bin in one batch
        engine = Engine(pm, token_budget=100_000, call_overhead_tokens=100_000)
        assert engine._packed_logits
        engine._packed_logits = logits == "kept"
        reused = engine.values(rows, reuse_prefix=True)
    finally:
        del pm.model.forward
        head.remove()
    # one prefix pass over the originals, one packed pass over every other row of every example
    assert engine.stats.prefix_passes == 1 and engine.stats.forward_passes == 2
    has_cache, (bins, width), mask_shape = calls[-1]
    perturbed = {(tuple(r), id(e)) for r, e in rows if list(r) != list(e.input_ids)}  # unique rows
    assert engine.stats.prefix_rows == len(perturbed)
    assert has_cache and bins < len(perturbed)  # several rows share a bin
    unique = {(tuple(r), id(e)): (r, e) for r, e in rows if list(r) != list(e.input_ids)}.values()
    fed = sum(len(r) - min(common_prefix(r, e.input_ids), len(r) - 1) + len(e.target_ids) - 1 for r, e in unique)
    assert bins * width < 1.5 * fed + width  # little padding: bins are filled
    assert len(mask_shape) == 4 and mask_shape[0] == bins and mask_shape[2] == width and mask_shape[3] > width
    if logits == "kept":  # each row's target positions, no padding
        assert projected[-1] == sum(len(e.target_ids) for _, e in unique)
    else:
        assert projected[-1] == bins * width
    assert max(len(e.target_ids) for e in examples) > 1  # short continuations are padded in the arithmetic
    full = evaluate(pm, rows)
    assert_fp_close(reused, full, depth=model_depth(pm))  # log-probs, as above


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_long_segments_are_fed_in_query_blocks_with_the_same_values(models, kind, monkeypatch):
    """A segment longer than QUERY_BLOCK (here 3 tokens) is fed a block at a time, each block reading
    the prefix and the blocks before it as its cache: no call's mask is wider than a block in its
    queries, and every value (originals from the prefix pass, perturbed rows from the suffix passes)
    equals full recomputation."""
    import probe.intervene.prefix as prefix

    monkeypatch.setattr(prefix, "QUERY_BLOCK", 3)
    pm = models[kind]
    examples = _examples(pm)
    rows = [(r, e) for e in examples for r in _perturbations(e, replacement=9, min_position=1)]
    rows += [(list(e.input_ids), e) for e in examples]
    fed = []
    packed = prefix.packed_batch

    def spy(engine, bins, *args, **kwargs):
        fed.extend((len(seg.ids), seg.key is None, seg.shared) for b in bins for seg in b)
        return packed(engine, bins, *args, **kwargs)

    monkeypatch.setattr(prefix, "packed_batch", spy)
    engine = Engine(pm, token_budget=64)
    reused = engine.values(rows, reuse_prefix=True)
    n_target = max(len(e.target_ids) for e in examples)
    assert max(len(e.input_ids) + len(e.target_ids) - 1 for e in examples) > 3 * 2
    assert max(n for n, _, _ in fed) <= 3 + n_target - 1  # no segment fed whole past a block
    assert any(unstored and shared > 0 for _, unstored, shared in fed)  # blocks reading the blocks before
    assert engine.stats.prefix_rows > 0
    assert_fp_close(reused, evaluate(pm, rows), depth=model_depth(pm))


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_prefix_reuse_with_one_example_per_bin(models, kind, monkeypatch):
    """The per-example packing (no fixed bin width offered): every bin holds one example's
    segments, as wide as its longest, and the values still equal full recomputation."""
    import probe.intervene.packing as packing

    monkeypatch.setattr(packing, "PACK_WIDTHS", ())
    pm = models[kind]
    examples = _examples(pm)
    rows = [(r, e) for e in examples for r in _perturbations(e, replacement=9, min_position=1)]
    seen = []
    pack = packing.pack_by_example

    def spy(segments):
        bins = pack(segments)
        seen.append((segments, bins))
        return bins

    monkeypatch.setattr(packing, "pack_by_example", spy)
    engine = Engine(pm, token_budget=256)
    reused = engine.values(rows, reuse_prefix=True)
    segments, bins = seen[-1]  # the suffix pass
    assert sorted(i for b in bins for i in b) == list(range(len(segments)))
    for b in bins:
        assert len({segments[i].slot for i in b}) == 1
        example_longest = max(len(s.ids) for s in segments if s.slot == segments[b[0]].slot)
        assert sum(len(segments[i].ids) for i in b) <= example_longest
    assert len(bins) < len(segments)  # segments share bins
    assert engine.stats.forward_passes > 2  # the budget splits the bins over several calls
    assert_fp_close(reused, evaluate(pm, rows), depth=model_depth(pm))  # log-probs, as above


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_loo_on_causal_lm_matches_full_recomputation(models, kind):
    pm = models[kind]
    examples = _examples(pm)
    engine = Engine(pm)
    scores = loo(engine, examples, "pad")
    assert engine.stats.prefix_rows > 0
    for example, score in zip(examples, scores.scores):
        ids, pad = example.input_ids, pm.tokenizer.pad_token_id
        for t in range(len(ids)):
            if example.special[t]:
                continue
            expected = evaluate(pm, [(ids, example)])[0] - evaluate(pm, [(ids[:t] + [pad] + ids[t + 1:], example)])[0]
            assert fp_close(float(score[t]), float(expected), depth=model_depth(pm), scale=_loo_scale(example, score))


def test_values_with_and_without_prefix_reuse_agree(models):
    pm = models["llama_gqa"]
    examples = _examples(pm)
    rows = [(r, e) for e in examples for r in _perturbations(e, replacement=11)]
    with_reuse = Engine(pm, token_budget=48).values(rows, reuse_prefix=True)
    without = Engine(pm, token_budget=48).values(rows)
    assert_fp_close(with_reuse, without, depth=model_depth(pm))  # log-probs, as above


# ------------------------------------------------------------------------------ erasure


def test_bin_sizes_round_half_up_and_keep_at_least_one():
    assert bin_size(0.01, 20) == 1
    assert bin_size(0.05, 50) == 3  # 2.5 -> 3 (Python's round would give 2)
    assert bin_size(0.5, 3) == 2
    assert bin_size(0.2, 7) == 1
    assert bin_size(1.0, 7) == 7
    assert bin_size(0.5, 0) == 0


def test_full_removal_is_f_x_minus_f_of_the_specials(models):
    pm = models["bert"]
    examples = _examples(pm)
    engine = Engine(pm)
    frame = erasure(engine, examples, loo(engine, examples, "delete"), bins=(1.0,))
    for i, example in enumerate(examples):
        specials_only = [x for x, s in zip(example.input_ids, example.special) if s]
        expected = evaluate(pm, [(example.input_ids, example)])[0] - evaluate(pm, [(specials_only, example)])[0]
        rows = frame[frame.example == i]
        # differences of two logits: at the scale of the logits (the second is f(x) - expected)
        scale = 2 * abs(example.original_value) + abs(float(expected))
        assert fp_close(torch.tensor(rows.comprehensiveness.to_numpy()), float(expected), depth=model_depth(pm), scale=scale)
        # everything kept = the input itself: f(x) - f(x), 0 up to the rounding of f(x) in another batch
        assert fp_close(torch.tensor(rows.sufficiency.to_numpy()), 0.0, depth=model_depth(pm), scale=scale)


def test_erasure_rows_match_direct_evaluation_and_never_remove_specials(models):
    pm = models["bert"]
    examples = _examples(pm)[:2]
    engine = Engine(pm)
    # a ranking that scores special tokens highest: they must still never be removed
    ranking = [torch.where(torch.tensor(e.special), 100.0, torch.arange(len(e.input_ids), dtype=torch.float64))
               for e in examples]
    frame = erasure(engine, examples, {"mine": ranking}, bins=(0.2, 0.5))
    for i, example in enumerate(examples):
        order = ranked_positions(example, ranking[i])
        assert all(not example.special[t] for t in order)
        assert order == sorted((t for t, s in enumerate(example.special) if not s), reverse=True)
        base = float(evaluate(pm, [(example.input_ids, example)])[0])
        for frac in (0.2, 0.5):
            k = bin_size(frac, len(order))
            top = set(order[:k])
            without = [x for t, x in enumerate(example.input_ids) if t not in top]
            only = [x for t, x in enumerate(example.input_ids) if t in top or example.special[t]]
            row = frame[(frame.example == i) & (frame.ranking == "mine") & (frame.bin == frac)].iloc[0]
            assert row.k == k
            # differences of logits, at the scale of the logits (one forward each, other batches)
            removed, kept = float(evaluate(pm, [(without, example)])[0]), float(evaluate(pm, [(only, example)])[0])
            scale = abs(base) + abs(removed) + abs(kept)
            assert fp_close(row.comprehensiveness, base - removed, depth=model_depth(pm), scale=scale)
            assert fp_close(row.sufficiency, base - kept, depth=model_depth(pm), scale=scale)


def test_erasure_frame_shape_and_random_baseline(models):
    pm = models["bert"]
    examples = _examples(pm)
    engine = Engine(pm)
    frame = erasure(engine, examples, loo(engine, examples, "mask"))
    assert list(frame.columns[:7]) == ["example", "ranking", "bin", "k", "n_scorable", "comprehensiveness", "sufficiency"]
    assert {"aopc", "aopc_sufficiency", "flip"} <= set(frame.columns)
    assert set(frame.ranking) == {"loo_mask", "random"}
    assert len(frame) == len(examples) * 2 * len(ERASURE_BINS)
    per = frame.groupby(["example", "ranking"])
    # AOPC is the mean of the same fp64 numbers: one reduction, at the scale of its terms
    scale = float(frame.comprehensiveness.abs().max())
    assert fp_close(torch.tensor(per.comprehensiveness.mean().to_numpy()), torch.tensor(per.aopc.first().to_numpy()),
                    depth=1, dtype=torch.float64, scale=scale)
    flips = frame.flip.dropna()
    assert ((flips > 0) & (flips <= 1)).all()


def test_decision_flip_is_the_first_label_change(models):
    pm = models["bert"]
    examples = _examples(pm)[:3]
    engine = Engine(pm)
    ranking = loo(engine, examples, "delete")
    frame = erasure(engine, examples, ranking)
    for i, example in enumerate(examples):
        order = ranked_positions(example, ranking.scores[i])
        rows, removed = [], set()
        for t in order:
            removed.add(t)
            rows.append([x for s, x in enumerate(example.input_ids) if s not in removed])
        labels = [int(pm.model(input_ids=torch.tensor([r])).logits.argmax(-1)) for r in rows]
        original = int(pm.model(input_ids=torch.tensor([example.input_ids])).logits.argmax(-1))
        changed = [j for j, label in enumerate(labels, start=1) if label != original]
        expected = changed[0] / len(order) if changed else None
        got = frame[(frame.example == i) & (frame.ranking == "loo_delete")].flip.iloc[0]
        if expected is None:
            assert got is None or (isinstance(got, float) and math.isnan(got))
        else:
            assert abs(got - expected) < 1e-12  # a fraction k / n in [0, 1], computed in fp64: absolute


def test_random_ranking_is_seeded_and_reproducible(models):
    pm = models["bert"]
    examples = _examples(pm)
    a, b, c = random_ranking(examples, 3), random_ranking(examples, 3), random_ranking(examples, 4)
    assert all(_same(x, y, atol=0) for x, y in zip(a.scores, b.scores))
    assert not all(_same(x, y, atol=0) for x, y in zip(a.scores, c.scores))
    alone = random_ranking(examples[1:2], 3)
    assert _same(alone.scores[0], a.scores[1], atol=0)  # independent of the batch
    for example, score in zip(examples, a.scores):
        special = torch.tensor(example.special)
        assert torch.isnan(score[special]).all()
        assert sorted(score[~special].tolist()) == list(range(int((~special).sum())))
    f1 = erasure(Engine(pm), examples, {"given": a}, seed=3)
    f2 = erasure(Engine(pm), examples, {"given": b}, seed=3)
    assert f1[f1.ranking == "random"].comprehensiveness.tolist() == f2[f2.ranking == "random"].comprehensiveness.tolist()


def test_erasure_on_causal_lm_has_no_flips(models):
    pm = models["gpt2"]
    examples = _examples(pm)
    engine = Engine(pm)
    frame = erasure(engine, examples, loo(engine, examples, "delete"), bins=(0.2, 1.0))
    assert frame.flip.isna().all()
    # GPT-2 has no special tokens here: removing everything leaves an empty input, whose target is undefined
    assert frame[frame.bin == 1.0].comprehensiveness.isna().all()
    assert frame[frame.bin == 0.2].comprehensiveness.notna().all()


def test_oracle_ranking_beats_random_on_a_real_model(minilm):
    examples = prepare(minilm, REAL_TEXTS)
    engine = Engine(minilm)
    oracle = loo(engine, examples, "delete")
    frame = erasure(engine, examples, oracle, seed=0)
    per = frame.groupby(["ranking", "example"]).aopc.first().unstack(0)  # [example, ranking]
    assert per["loo_delete"].mean() > per["random"].mean()
    top1 = frame[frame.bin == 0.01].pivot(index="example", columns="ranking", values="comprehensiveness")
    assert (top1["loo_delete"] >= top1["random"] - 1e-6).all()  # the top-1 deletion is LOO's maximum


# ------------------------------------------------------------------------------ errors


def test_mask_mode_without_mask_token_names_the_alternatives(models):
    pm = models["gpt2"]
    with pytest.raises(InputError) as info:
        loo(Engine(pm), _examples(pm), "mask")
    message = str(info.value)
    for alternative in ("delete", "unk", "pad", "random"):
        assert alternative in message


def test_unknown_mode_lists_valid_ones(models):
    pm = models["bert"]
    with pytest.raises(InputError) as info:
        loo(Engine(pm), _examples(pm), "blank")
    assert "'blank'" in str(info.value)
    assert all(mode in str(info.value) for mode in LOO_MODES)


def test_lm_mode_needs_a_language_model(models):
    pm = models["bert"]
    with pytest.raises(InputError, match="masked or causal"):
        loo(Engine(pm), _examples(pm), "lm")


def test_erasure_rejects_bad_bins_and_per_head_rankings(models):
    pm = models["bert"]
    examples = _examples(pm)[:1]
    with pytest.raises(InputError, match="bins"):
        erasure(Engine(pm), examples, random_ranking(examples), bins=(0.0, 0.5))
    per_head = [torch.zeros(2, 4, len(examples[0].input_ids))]
    with pytest.raises(InputError, match="one score per token"):
        erasure(Engine(pm), examples, {"heads": per_head})
    with pytest.raises(InputError, match="reserved"):
        erasure(Engine(pm), examples, {"random": random_ranking(examples)})
    with pytest.raises(InputError, match="token_budget"):
        Engine(pm, token_budget=0)


@pytest.mark.parametrize("kind,reuse", [("bert", False), ("llama_gqa", False), ("llama_gqa", True)])
def test_out_of_memory_halves_the_batch_and_loses_nothing(loaded, kind, reuse, monkeypatch, simulated_oom):
    """A batch that runs out of memory is halved and retried: same values, each row stored once."""
    from probe.intervene import packing
    from probe.intervene.engine import Engine

    # narrow bins, so that prefix reuse packs its segments into several bins per batch
    monkeypatch.setattr(packing, "PACK_WIDTHS", (16,))
    pm = loaded(kind)
    examples = prepare(pm, ["the movie was good and fun", "bad film , not fun at all", "i loved the acting"])
    rows = [(e.input_ids[:t] + e.input_ids[t + 1:], e) for e in examples for t in range(1, len(e.input_ids) - 1)]
    rows += [(list(e.input_ids), e) for e in examples]
    expected = Engine(pm).values(rows, reuse_prefix=reuse)

    # any batch of more than 20 tokens runs out of memory
    with simulated_oom(pm, lambda _, ids: ids is not None and ids.shape[0] > 1 and ids.numel() > 20) as calls:
        engine = Engine(pm)
        got = engine.values(rows, reuse_prefix=reuse)
    assert calls["failed"] > 0 and engine.stats.oom_splits > 0
    assert_fp_close(got, expected, depth=model_depth(pm))  # target values in halved batches: one forward each
    assert engine.stats.rows_evaluated == len({(tuple(ids), id(e)) for ids, e in rows})


OOM_TEXTS = ["the movie was good and fun", "bad film , not fun at all", "i loved the acting",
             "a great story with wonderful acting", "i hated this film , it was boring and too long", "slow plot",
             "the cast sparkles", "too long and too slow"]


def _engine_tokens(kwargs) -> int:
    """A model call's tokens in the engine's measure: rows x (cached prefix + fed width)."""
    ids = kwargs["input_ids"]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return ids.shape[0] * (ids.shape[1] + (cache.get_seq_length() if cache is not None else 0))


@pytest.mark.parametrize("kind,reuse", [("bert", False), ("llama_gqa", False), ("llama_gqa", True)])
def test_out_of_memory_settles_the_token_budget_of_later_batches(loaded, kind, reuse, monkeypatch, simulated_oom):
    """Calls over more than X tokens run out of memory: the batch that first does is halved and
    continued, every later batch is planned at the tokens of the largest part that ran (<= X, recorded
    in the stats), so a handful of errors are raised in all, not some for every batch; the values are
    an uninterrupted run's and each row is run once."""
    from probe.intervene import packing

    monkeypatch.setattr(packing, "PACK_WIDTHS", (16,))  # prefix reuse: many narrow bins
    pm = loaded(kind)
    examples = prepare(pm, OOM_TEXTS)
    rows = [(e.input_ids[:t] + e.input_ids[t + 1:], e) for e in examples for t in range(1, len(e.input_ids) - 1)]
    rows += [(list(e.input_ids), e) for e in examples]
    # a call costs much more than its tokens: every batch is planned as full as the budget allows
    budget, limit, overhead = 64, 32, 1024
    uninterrupted = Engine(pm, token_budget=budget, call_overhead_tokens=overhead)
    expected = uninterrupted.values(rows, reuse_prefix=reuse)
    unique = len({(tuple(ids), id(e)) for ids, e in rows})
    planned = uninterrupted.stats.forward_passes
    assert planned >= 4  # the budget plans several batches, each over the limit

    with simulated_oom(pm, lambda _, tokens: tokens > limit, size=_engine_tokens) as calls:
        engine = Engine(pm, token_budget=budget, call_overhead_tokens=overhead)
        assert engine.stats.token_budget_used is None
        got = engine.values(rows, reuse_prefix=reuse)
    assert_fp_close(got, expected, depth=model_depth(pm))  # the same rows in smaller batches
    assert engine.stats.rows_evaluated == unique  # every row computed exactly once
    settled = engine.stats.token_budget_used
    assert settled is not None and settled <= limit and engine.token_budget == settled
    assert max(calls["ran"]) <= limit and engine.stats.oom_splits == calls["failed"]
    # the first batch over the limit fails at 64, then none does (measured: 1 error against 5-9 when
    # each batch is only halved, one per batch planned at the start)
    assert 0 < calls["failed"] <= 2

    # a later call is planned at the settled budget at once
    with simulated_oom(pm, lambda _, tokens: tokens > limit, size=_engine_tokens) as later:
        engine.values([(ids[:-1], e) for ids, e in rows if len(ids) > 3], reuse_prefix=reuse)
    assert later["failed"] == 0 and later["ran"] and engine.token_budget == settled


def test_settled_budget_is_never_raised(loaded):
    """settle_budget only lowers the budget; start_from takes an earlier engine's settled sizes."""
    pm = loaded("bert")
    engine = Engine(pm, token_budget=100)
    assert not engine.settle_budget(None) and engine.stats.token_budget_used is None
    assert engine.settle_budget(40) and engine.token_budget == 40 == engine.stats.token_budget_used
    assert not engine.settle_budget(70) and engine.token_budget == 40
    later = Engine(pm, token_budget=100)
    later.start_from(engine.stats.as_dict() | {"examples_per_call_used": {"rollout": 3}})
    assert later.token_budget == 40 and later.stats.examples_per_call_used == {"rollout": 3}
    later.start_from(None)
    assert later.token_budget == 40


def test_in_halves_settles_on_the_largest_part_that_ran():
    """Parts over 3 items run out of memory: every item once, in order; a part as big as one that
    failed is split untried (3 errors, where retrying every half raises 7), the largest part that
    ran (3) is recorded, and a later call is cut at it from the start (no error)."""
    from probe.rows.memory import SettledSize, in_halves

    failed = []

    def run(part: list[int], start: int) -> list[int]:
        if len(part) > 3:
            failed.append(len(part))
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        assert part == list(range(start, start + len(part)))
        return part

    settled = SettledSize()
    parts = in_halves(list(range(20)), run, settled=settled)
    assert [i for part in parts for i in part] == list(range(20))
    assert failed == [20, 10, 5] and settled.size == 3 and max(len(p) for p in parts) == 3
    failed.clear()
    assert [i for part in in_halves(list(range(7)), run, settled=settled) for i in part] == list(range(7))
    assert failed == [] and settled.size == 3
    assert in_halves([], run) == [[]]  # no items: one call on none, as before


def test_a_single_row_that_does_not_fit_is_a_clear_error(loaded):
    from probe.errors import ProbeError
    from probe.intervene.engine import Engine

    pm = loaded("bert")
    examples = prepare(pm, ["the movie was good"])
    model = pm.model

    def forward(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    model.forward = forward
    try:
        with pytest.raises(ProbeError, match="out of memory on a single batch item"):
            Engine(pm).values([(examples[0].input_ids, examples[0])])
    finally:
        del model.forward


@pytest.mark.parametrize("kind", ["bert", "llama_gqa"])
def test_device_map_auto_gives_the_same_results(tiny_dirs, loaded, kind):
    """Loaded with accelerate's device_map="auto" (all on the CPU here), capture, gradients and
    interventions give what the plain load gives. Spreading over several GPUs is left to the GPU check."""
    from probe.intervene.counterfactual import permuted_attention
    from probe.intervene.heads import head_ablation_effects
    from probe.methods import run_methods
    from probe.models.loading import load_model

    plain = loaded(kind)
    mapped = load_model(str(tiny_dirs[kind]), device_map="auto")
    texts = ["the movie was good and fun", "bad film , not fun"]
    methods = ["attention", "rollout", "attn_norm", "saliency", "integrated_gradients", "loo_delete"]
    results = []
    for pm in (plain, mapped):
        examples = prepare(pm, texts)
        scores = run_methods(pm, examples, methods, params={"integrated_gradients": {"steps": 8}})
        heads = head_ablation_effects(pm, examples).change
        perm = permuted_attention(pm, examples, layer=0, n=3).output_tvd
        results.append((scores, heads, perm))
    (s0, h0, p0), (s1, h1, p1) = results
    # the same model on the same CPU: at most fp32 rounding of the method's passes at the scale of what
    # each sums (IG: its per-dim terms; LOO: the target values; tolerances.py)
    examples = prepare(plain, texts)
    scales = {"integrated_gradients": gradient_term_scales(plain, examples, "integrated_gradients", steps=8),
              "loo_delete": [_loo_scale(e, s) for e, s in zip(examples, s0["loo_delete"].scores)]}
    depth = model_depth(plain, backward=True)
    for method in methods:
        for i, (a, b) in enumerate(zip(s0[method].scores, s1[method].scores)):
            assert_fp_close(a, b, depth=depth, scale=scales.get(method, [0.0] * len(examples))[i], msg=method)
    # target changes under head ablation: differences of target values (probabilities, log-probs)
    assert_fp_close(h0, h1, depth=depth, scale=2 * max(abs(e.original_value) for e in examples) + float(h0.abs().max()))
    assert_fp_close(p0, p1, depth=depth)  # output TVDs in [0, 1]
