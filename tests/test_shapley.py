"""Shapley values (probe.intervene.shapley): exact values equal captum's ShapleyValues on token ids,
delete mode equals a by-hand enumeration over plain forwards, sampled values sit within a few
standard errors of the exact ones, efficiency holds, every task runs, and two redundant copies of a
trigger share the effect that single deletion cannot see."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.intervene.shapley import shapley, shapley_players
from probe.intervene.tokens import loo
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec
from probe.rows.values import evaluate

from tolerances import assert_fp_close, model_depth

TEXTS = ["the movie was very good", "i hated this film", "a great story"]
REAL_TEXTS = ["bleak, witty and desperate"]


@pytest.fixture(scope="module")
def bert(tiny_dirs):
    return load_model(str(tiny_dirs["bert"]))


def _scale(example, *scores) -> float:
    finite = torch.cat([s[~torch.isnan(s)].double().flatten() for s in scores])
    return 2 * abs(example.original_value) + (float(finite.abs().max()) if finite.numel() else 0.0)


def _captum_shapley(pm, example, baseline: int) -> torch.Tensor:
    """captum's exact ShapleyValues (every order of the players) over the scorable token ids, the
    special tokens put back around them by the forward function (never perturbed)."""
    from captum.attr import ShapleyValues

    ids = torch.tensor(example.input_ids)  # [tokens]
    scorable = ~torch.tensor(example.special)

    def forward(players: torch.Tensor) -> torch.Tensor:  # [batch, players] -> [batch]
        rows = ids.repeat(len(players), 1)
        rows[:, scorable] = players
        return evaluate(pm, [(row.tolist(), example) for row in rows])

    attribution = ShapleyValues(forward).attribute(ids[scorable][None], baselines=baseline,
                                                   perturbations_per_eval=64)
    out = torch.full((len(ids),), float("nan"), dtype=torch.float64)
    out[scorable] = attribution[0].double()
    return out


def _by_hand_delete(pm, example) -> np.ndarray:
    """Exact Shapley values with deletion, from plain per-coalition forwards and the textbook weights."""
    positions = [t for t, s in enumerate(example.special) if not s]
    n = len(positions)
    value = {}
    for r in range(n + 1):
        for subset in itertools.combinations(range(n), r):
            keep = {positions[j] for j in subset}
            ids = [x for t, x in enumerate(example.input_ids) if example.special[t] or t in keep]
            value[frozenset(subset)] = float(evaluate(pm, [(ids, example)])[0])
    phi = np.zeros(n)
    for j in range(n):
        others = [k for k in range(n) if k != j]
        for r in range(n):
            for subset in itertools.combinations(others, r):
                s = frozenset(subset)
                weight = math.factorial(r) * math.factorial(n - r - 1) / math.factorial(n)
                phi[j] += weight * (value[s | {j}] - value[s])
    return phi


@pytest.mark.parametrize("mode", ["mask", "unk", "pad"])
def test_exact_shapley_equals_captum_shapley_values_tiny(bert, mode):
    examples = prepare(bert, TEXTS, TargetSpec(kind="logit"))
    result = shapley(Engine(bert), examples, mode)
    baseline = result.params["replacement_id"]
    for example, ours in zip(examples, result.scores):
        theirs = _captum_shapley(bert, example, baseline)
        scored = ~torch.tensor(example.special)
        assert torch.isnan(ours[~scored]).all()
        assert_fp_close(ours[scored].double(), theirs[scored], depth=model_depth(bert), scale=_scale(example, ours))
        assert ours[scored].abs().max() > 1e-4
    assert all(result.extras["exact"])
    assert max(abs(d) for d in result.extras["efficiency_delta"]) < 1e-4


def test_exact_shapley_equals_captum_on_pretrained_minilm(minilm):
    examples = prepare(minilm, REAL_TEXTS)
    result = shapley(Engine(minilm, token_budget=4096), examples, "mask")
    theirs = _captum_shapley(minilm, examples[0], minilm.tokenizer.mask_token_id)
    scored = ~torch.tensor(examples[0].special)
    assert_fp_close(result.scores[0][scored].double(), theirs[scored], depth=model_depth(minilm),
                    scale=_scale(examples[0], result.scores[0]))


def test_exact_shapley_with_deletion_equals_a_by_hand_enumeration(bert):
    examples = prepare(bert, TEXTS[:2], TargetSpec(kind="logit"))
    result = shapley(Engine(bert), examples, "delete")
    for example, ours in zip(examples, result.scores):
        scored = ~torch.tensor(example.special)
        theirs = torch.from_numpy(_by_hand_delete(bert, example))
        assert_fp_close(ours[scored].double(), theirs, depth=model_depth(bert), scale=_scale(example, ours))


def test_sampled_shapley_is_within_three_standard_errors_of_exact(bert):
    examples = prepare(bert, ["i hated this film , it was boring and too long"], TargetSpec(kind="logit"))
    engine = Engine(bert)
    exact = shapley(engine, examples, "pad", exact_max=16)
    sampled = shapley(engine, examples, "pad", exact_max=0, permutations=200, seed=3)
    assert exact.extras["exact"] == [True] and sampled.extras["exact"] == [False]
    assert sampled.extras["permutations"] == [200]
    scored = ~torch.tensor(examples[0].special)
    se = sampled.extras["standard_error"][0][scored].double()
    gap = (sampled.scores[0][scored].double() - exact.scores[0][scored].double()).abs()
    assert (se > 0).all()
    assert (gap <= 3 * se + 1e-6).float().mean() >= 0.9  # 3 SE covers nearly every player
    # efficiency holds exactly for every order, so for their mean too
    assert abs(sampled.extras["efficiency_delta"][0]) < 1e-4
    # the sampled orders share coalitions: fewer distinct rows than orders x players
    assert sampled.extras["coalitions"][0] < 200 * (sampled.extras["players"][0] + 1)


def test_sampled_shapley_is_seeded_per_example(bert):
    texts = ["i hated this film , it was boring and too long", "a great story with wonderful acting , really"]
    examples = prepare(bert, texts, TargetSpec(kind="logit"))
    both = shapley(Engine(bert), examples, "pad", exact_max=4, permutations=8, seed=1)
    alone = shapley(Engine(bert), examples[1:], "pad", exact_max=4, permutations=8, seed=1)
    other = shapley(Engine(bert), examples[1:], "pad", exact_max=4, permutations=8, seed=2)
    assert torch.allclose(both.scores[1], alone.scores[0], atol=1e-5, equal_nan=True)
    assert not torch.allclose(alone.scores[0], other.scores[0], atol=1e-6, equal_nan=True)


def test_word_units_group_word_pieces_and_share_the_value(minilm):
    examples = prepare(minilm, ["unflinchingly bleak"])
    players = shapley_players(minilm, examples[0], "word")
    assert len(players) == 2 and len(players[0]) > 1  # "unflinchingly" is several pieces
    result = shapley(Engine(minilm), examples, "mask", units="word")
    first = result.scores[0][list(players[0])]
    assert torch.allclose(first, first[0].expand_as(first))  # one value shared equally
    assert abs(result.extras["efficiency_delta"][0]) < 1e-4


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5"])
def test_shapley_runs_on_every_task_with_efficiency(tiny_dirs, kind):
    pm = load_model(str(tiny_dirs[kind]))
    if pm.task.name == "causal_lm":
        examples = prepare(pm, ["the movie was good", "paris is the capital of"], TargetSpec(continuation="it was"))
        mode = "pad"
    else:
        examples = prepare(pm, ["the movie was good"])
        mode = "pad"
    result = shapley(Engine(pm), examples, mode)
    for example, score in zip(examples, result.scores):
        scored = ~torch.tensor(example.special)
        assert torch.isfinite(score[scored]).all()
    assert max(abs(d) for d in result.extras["efficiency_delta"]) < 1e-3


def test_shapley_per_generated_token_steps(tiny_dirs):
    pm = load_model(str(tiny_dirs["gpt2"]))
    examples = prepare(pm, ["the movie was good"], TargetSpec(continuation="it was fine", steps=True))
    assert len(examples) > 1 and examples[0].step is not None
    result = shapley(Engine(pm), examples, "pad")
    full = evaluate(pm, [(e.input_ids, e) for e in examples])
    for example, score, value, empty in zip(examples, result.scores, full, result.extras["empty_value"]):
        scored = ~torch.tensor(example.special)
        assert math.isclose(float(score[scored].double().sum()), float(value) - empty, abs_tol=1e-4)


def test_delete_mode_without_any_fixed_token_is_refused(tiny_dirs):
    pm = load_model(str(tiny_dirs["gpt2"]))
    examples = prepare(pm, ["the movie was good"], TargetSpec(continuation="it was"))
    if any(examples[0].special):
        pytest.skip("this tokenizer adds a special token")
    with pytest.raises(InputError, match="mode pad"):
        shapley(Engine(pm), examples, "delete")


@pytest.mark.parametrize("bad, match", [({"mode": "random"}, "shapley.mode"), ({"units": "sentence"}, "shapley.units"),
                                        ({"exact_max": 40}, "exact_max"), ({"permutations": 1}, "permutations")])
def test_bad_shapley_parameters_are_one_line(bert, bad, match):
    examples = prepare(bert, TEXTS[:1])
    with pytest.raises(InputError, match=match):
        shapley(Engine(bert), examples, **bad)


def test_two_redundant_copies_share_the_effect_single_deletion_misses(bert):
    """An OR of two copies, computed as a value function over the engine's rows: with either copy the
    target is high, with neither low. Deleting one copy changes nothing; Shapley gives each copy half."""
    examples = prepare(bert, ["good movie good"], TargetSpec(kind="logit"))
    example = examples[0]
    copies = [t for t, tok in enumerate(example.tokens) if tok == "good"]
    assert len(copies) == 2

    class OrEngine(Engine):
        def values(self, rows, *, reuse_prefix=False):
            target = self.pm.tokenizer.convert_tokens_to_ids("good")
            return torch.tensor([1.0 if target in ids else 0.0 for ids, _ in rows])

    engine = OrEngine(bert)
    phi = shapley(engine, examples, "delete")
    single = loo(engine, examples, "delete")
    assert float(single.scores[0][copies].abs().max()) == 0.0  # single deletion sees nothing
    assert torch.allclose(phi.scores[0][copies], torch.tensor([0.5, 0.5]))
    other = [t for t, s in enumerate(example.special) if not s and t not in copies]
    assert float(phi.scores[0][other].abs().max()) == 0.0


def test_a_study_judged_against_shapley_beside_deletion(tiny_dirs, tmp_path):
    """A study with shapley among its references, the verdict judged against it (statistics.reference),
    its scores stored like any reference's and the ceiling including it."""
    import json

    from test_faults import _dataset, _run, _study

    data = _dataset(tmp_path / "data.csv", n=10)
    study = _study(tiny_dirs["bert"], data, tmp_path / "out", dataset={"name": str(data), "n": 10, "seed": 0},
                   references=["loo_delete", "shapley"], params={"shapley": {"exact_max": 4, "permutations": 8}},
                   statistics={"bootstrap": 100, "reference": "shapley", "permutations": 1000})
    result = _run(study, report=False)
    assert result.complete
    import pandas as pd

    scores = pd.read_parquet(tmp_path / "out" / "scores.parquet")
    assert set(scores["method"]) >= {"loo_delete", "shapley", "attention_mean"}
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert verdict["reference"] == "shapley"
    assert sorted(verdict["ceiling"]["pair"]) == ["loo_delete", "shapley"]  # the ceiling between references
    pairs = pd.read_parquet(tmp_path / "out" / "interactions.parquet")
    assert len(pairs) and set(pairs["example"]) == set(range(10))
    assert verdict["interactions"]["examples"] == 10


class _RuleEngine(Engine):
    """An engine whose target is a rule over which words a row still holds (a planted truth)."""

    def __init__(self, pm, rule):
        super().__init__(pm)
        self.rule = rule

    def values(self, rows, *, reuse_prefix=False):
        vocab = self.pm.tokenizer.convert_ids_to_tokens
        return torch.tensor([float(self.rule(vocab(list(ids)))) for ids, _ in rows], dtype=torch.float64)


@pytest.mark.parametrize("rule, kind", [
    (lambda toks: toks.count("good") >= 1, "substitutes"),  # either copy is enough
    (lambda toks: "good" in toks and "movie" in toks, "complements"),  # both are needed
    (lambda toks: 0.3 * toks.count("good") + 0.2 * ("movie" in toks), "additive"),
])
def test_pair_interactions_name_substitutes_complements_and_additive_tokens(bert, rule, kind):
    from probe.intervene.pairs import pair_interactions

    text = "good movie good" if kind == "substitutes" else "good movie"  # two copies, or one of each
    examples = prepare(bert, [text], TargetSpec(kind="logit"))
    tokens = examples[0].tokens
    pairs = [tokens.index("good"), len(tokens) - 2] if kind == "substitutes" else \
        [tokens.index("good"), tokens.index("movie")]
    frame = pair_interactions(_RuleEngine(bert, rule), examples, [pairs])
    assert len(frame) == 1
    row = frame.iloc[0]
    assert row["kind"] == kind
    # the copies' single effects are 0 (misranked); the AND pair's singles are the largest (ranked right)
    assert bool(row["misranked"]) == (kind == "substitutes")
    assert math.isclose(row["interaction"], row["joint"] - row["single_a"] - row["single_b"], abs_tol=1e-12)


def _jitter(toks: list[str]) -> float:
    """A fixed pseudo-random number in [-1e-4, 1e-4) per row (its tokens): the rounding a trained model's
    target carries, enough to move |interaction| / largest single across 1 from text to text."""
    import zlib

    return 2e-4 * (zlib.crc32(" ".join(toks).encode()) / 2 ** 32 - 0.5)


_BOUNDARY_RULES = {
    "complements": lambda toks: float("good" in toks and "movie" in toks) + _jitter(toks),  # a pure AND
    "substitutes": lambda toks: float("good" in toks or "movie" in toks) + _jitter(toks),  # a pure OR
    "additive": lambda toks: 0.3 * ("good" in toks) + 0.2 * ("movie" in toks) + _jitter(toks),
}


@pytest.mark.parametrize("kind", list(_BOUNDARY_RULES))
def test_a_textbook_and_or_pair_gets_its_label_on_every_text(bert, kind):
    """A pure AND of two words (the target needs both) is complements on every one of 40 texts, a pure
    OR (either suffices) substitutes, an additive pair additive, with each row's target jittered by up
    to 1e-4: the AND's |interaction| equals its largest single effect up to that jitter (ratios on both
    sides of 1 here), which is where a rule "at least the largest single effect" decided its label by
    rounding; the rule's boundary sits at half of it (probe.intervene.pairs.FLAG_SHARE)."""
    from probe.intervene.pairs import FLAG_SHARE, pair_interactions

    rng = np.random.default_rng(3)
    fillers = ["the", "was", "a", "story", "film", "very", "i", "this"]
    texts = []
    for _ in range(40):
        words = list(rng.choice(fillers, size=int(rng.integers(2, 6))))
        for word in ("good", "movie"):
            words.insert(int(rng.integers(0, len(words) + 1)), word)
        texts.append(" ".join(words))
    examples = prepare(bert, texts, TargetSpec(kind="logit"))
    candidates = [[e.tokens.index("good"), e.tokens.index("movie")] for e in examples]
    frame = pair_interactions(_RuleEngine(bert, _BOUNDARY_RULES[kind]), examples, candidates)
    assert len(frame) == 40
    ratio = (frame.interaction.abs() / frame.largest_single).to_numpy()
    print(kind, "|interaction| / largest single:", np.round([ratio.min(), ratio.max()], 5))
    if kind == "complements":  # the premise: the AND sits on the old boundary, on both sides of it
        assert (ratio < 1).any() and (ratio > 1).any() and np.abs(ratio - 1).max() < 1e-3
        assert (frame.interaction < 0).all()
    if kind == "additive":
        assert ratio.max() < 1e-3 < FLAG_SHARE
    assert (frame.kind == kind).all(), frame.kind.value_counts().to_dict()


def test_the_verdict_warns_when_single_deletion_misjudges_substitutes():
    import pandas as pd

    from probe.study.decide import interaction_summary, interaction_warning

    rows = pd.DataFrame([{"example": e, "position_a": 1, "position_b": 3, "token_a": "zz", "token_b": "zz",
                          "single_a": 6e-4, "single_b": 6e-4, "joint": 0.78, "interaction": 0.78 - 1.2e-3,
                          "largest_single": 0.01, "original_value": 0.9, "kind": "substitutes" if e < 7 else "additive",
                          "misranked": e < 7} for e in range(10)])
    found = interaction_summary(rows)
    assert found["substitutes"]["examples"] == list(range(7)) and found["complements"]["examples"] == []
    text = interaction_warning(found, "loo_delete")
    assert "in 7 of 10 examples" in text and "'zz' + 'zz'" in text and "shapley" in text
    assert interaction_warning(found, "shapley") is None  # Shapley values share the joint effect
    pieces = interaction_summary(rows.assign(token_a="Ġa", token_b="Ġmac"))  # byte-level BPE pieces
    assert "'a' + 'mac'" in interaction_warning(pieces, "loo_delete")  # shown as the tables show them
    assert interaction_warning(interaction_summary(rows.assign(kind="additive", misranked=False)), "loo_delete") is None
    # two triggers that keep clear effects of their own: flagged as interacting, ranked right, no warning
    assert interaction_warning(interaction_summary(rows.assign(misranked=False)), "loo_delete") is None


def test_shapley_explains_a_contrast_and_runs_from_the_cli(bert, tiny_dirs, monkeypatch, capsys):
    """A classifier contrast (logit[1] - logit[0]): the values sum to the contrast's own change; and
    `probe explain --methods shapley` prints them (asked for by name: not in the default set)."""
    import json

    from test_faults import _cli

    examples = prepare(bert, ["the movie was very good"], TargetSpec(label=1, contrast_label=0))
    result = shapley(Engine(bert), examples, "pad")
    scored = ~torch.tensor(examples[0].special)
    total = float(result.scores[0][scored].double().sum())
    assert math.isclose(total, result.extras["full_value"][0] - result.extras["empty_value"][0], abs_tol=1e-5)
    assert math.isclose(result.extras["full_value"][0], float(evaluate(bert, [(examples[0].input_ids, examples[0])])[0]),
                        abs_tol=1e-5)
    code, out, err = _cli(monkeypatch, capsys, "explain", tiny_dirs["bert"], "the movie was very good",
                          "--methods", "shapley", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert list(data["scores"]) == ["shapley"] and data["params"]["shapley"]["exact_max"] == 10
    values = [v for v in data["scores"]["shapley"] if v is not None]
    assert len(values) == 5 and data["scores"]["shapley"][0] is None  # [CLS] is never a player


def test_a_claim_is_judged_against_shapley_values(tiny_dirs, bert):
    """``reference: shapley`` in a claim file: the audit's token-importance effect is the share of
    examples whose most-attended word is Shapley's most important one, as computed here by hand."""
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit
    from probe.explainers.attention import attention

    texts = ["the movie was very good", "i hated this film", "a great story", "not bad at all",
             "the plot was thin", "wonderful acting", "a waste of time", "it was fine", "i loved it",
             "dull and slow", "never again", "quite funny"]
    spec = claims_from_dict({"model": {"id": str(tiny_dirs["bert"])}, "data": {"texts": texts}, "claims": [
        {"claim": "top-1 by Shapley", "kind": "token_importance", "attention": "attention@0.1", "reference": "shapley"},
        {"claim": "ranks like Shapley", "kind": "faithfulness", "attention": "attention_mean@last",
         "reference": "shapley", "threshold": 0.0}]})
    result = run_audit(spec, model=bert)
    examples = prepare(bert, texts)
    phi = shapley(Engine(bert), examples).scores
    att = attention(bert, examples).scores
    matches = []
    for example, a, s in zip(examples, att, phi):
        scored = ~np.array(example.special)
        matches.append(float(np.argmax(a[0, 1].numpy()[scored]) == np.argmax(s.numpy()[scored])))
    assert result.claims[0].effect == pytest.approx(np.mean(matches))
    assert result.claims[0].n == len(texts) and "shapley" in result.claims[0].intervention
    assert result.claims[1].verdict in ("supported", "refuted", "inconclusive") and result.claims[1].n == len(texts)


# ----------------------------------------------------------------------------- spans as the players


def _by_hand_spans(pm, example, spans) -> np.ndarray:
    """Exact Shapley values with each span a player (its tokens deleted when absent; a token in no
    span always present), from plain per-coalition forwards and the textbook weights."""
    n = len(spans)
    value = {}
    for r in range(n + 1):
        for subset in itertools.combinations(range(n), r):
            gone = {p for j, s in enumerate(spans) if j not in subset for p in s.positions}
            ids = [x for t, x in enumerate(example.input_ids) if t not in gone]
            value[frozenset(subset)] = float(evaluate(pm, [(ids, example)])[0])
    phi = np.zeros(n)
    for j in range(n):
        for r in range(n):
            for subset in itertools.combinations([k for k in range(n) if k != j], r):
                weight = math.factorial(r) * math.factorial(n - r - 1) / math.factorial(n)
                phi[j] += weight * (value[frozenset(subset) | {j}] - value[frozenset(subset)])
    return phi


def test_spans_as_players_equal_a_by_hand_enumeration_over_the_spans(bert):
    """Two-word spans as the players ("the movie", "was very"; "good" in no span stays present):
    exact values equal the textbook formula over plain forwards, and they add up to v(all) - v(no span)."""
    from probe.intervene.shapley import span_shapley
    from probe.rows.spans import spans_per_example

    examples = prepare(bert, TEXTS, TargetSpec(kind="logit"))
    found = spans_per_example(bert, examples, r"\w+ \w+")
    assert [len(s) for s in found] == [2, 2, 1]
    values = span_shapley(Engine(bert), examples, found, "delete")
    for example, spans, ours in zip(examples, found, values):
        theirs = _by_hand_spans(bert, example, spans)
        assert ours.shape == (len(spans),)
        scale = 2 * abs(example.original_value) + float(np.abs(theirs).max())
        assert_fp_close(torch.from_numpy(ours), torch.from_numpy(theirs), depth=model_depth(bert), scale=scale)
        gone = {p for s in spans for p in s.positions}
        empty = float(evaluate(bert, [([x for t, x in enumerate(example.input_ids) if t not in gone], example)])[0])
        assert ours.sum() == pytest.approx(example.original_value - empty, abs=1e-4)
    assert np.abs(np.concatenate(values)).max() > 1e-4


def test_a_study_with_spans_is_judged_against_shapley_values_of_the_spans(tiny_dirs, tmp_path):
    """``spans:`` with shapley as the reference (refused before: no span form): the study's reference
    scores per span are the Shapley values with the spans as players, not token values folded."""
    import pandas as pd

    import probe
    from probe.intervene.shapley import span_shapley
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    texts = ["the movie was good and the plot was bad", "the film is fun but the story is boring",
             "the acting was great , the ending was not", "a boring plot and the worst film"]
    pd.DataFrame({"text": texts, "label": [1, 1, 0, 0]}).to_csv(tmp_path / "data.csv", index=False)
    pattern = r"the \w+|bad|boring|fun|great|not"
    spec = {"name": "spans", "model": {"id": str(tiny_dirs["bert"])},
            "dataset": {"name": str(tmp_path / "data.csv"), "n": 4, "seed": 0}, "target": {"kind": "logit"},
            "explainers": ["saliency"], "references": ["loo_delete", "shapley"], "spans": {"pattern": pattern},
            "params": {"shapley": {"exact_max": 6}},
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False, "examples": 2}},
            "statistics": {"bootstrap": 100, "reference": "shapley"}, "engine": {"batch_size": 4},
            "output": str(tmp_path / "out")}
    assert run_study(study_from_dict(spec), progress=False, log=lambda _: None).complete
    out = tmp_path / "out"
    scores, examples = pd.read_parquet(out / "scores.parquet"), pd.read_parquet(out / "examples.parquet")
    pm = probe.load_model(str(tiny_dirs["bert"]))
    checked = 0
    for number, text in zip(examples["example"], examples["text"]):
        example = prepare(pm, [text], TargetSpec(kind="logit"))[0]
        spans = probe.find_spans(pm, example, pattern)
        expected = span_shapley(Engine(pm), [example], [spans], exact_max=6)[0]
        got = scores[(scores.example == number) & (scores.method == "shapley")].sort_values("position")["score"]
        assert got.to_numpy() == pytest.approx(expected, abs=1e-5)
        folded = shapley(Engine(pm), [example], exact_max=10).scores[0].double().numpy()
        checked += len(spans) > 1 and not np.allclose(expected, [folded[list(s.positions)].sum() for s in spans],
                                                      atol=1e-4)
    assert checked  # spans as players differ from token values summed over a span (interactions inside it)
