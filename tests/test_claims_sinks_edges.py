"""Audit claim kinds on attention edges: ``sink_head`` and ``edge`` (probe.claims.kinds), and the
joint edge blocking under them (probe.intervene.knockout.block_edges), against hand oracles.

The oracle is test_knockout's: the same weights as a plain transformers model in eager attention,
its ``eager_attention_forward`` replaced for one forward so that the blocked (head, query, key)
entries get -inf in the mask. Truths are set by construction: a planted sink head in a tiny GPT-2
(a constant query and a key that reads a coordinate only position 0 carries: every row attends to
the first token), a value projection zeroed (a head whose edges cannot change anything), and for
"matters" the oracle's own per-example effects all far above the claimed threshold.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest
import torch
from test_knockout import _blocked_edges, _target

from probe.claims.edges import CONTROL_DRAWS
from probe.claims.file import claims_from_dict, load_claims
from probe.claims.rules import at_least_rule, at_most_rule, judge
from probe.claims.run import run_audit
from probe.errors import InputError
from probe.explainers.sinks import attention_sinks
from probe.intervene.knockout import EdgeSet, block_edges, edge_knockout
from probe.models.loading import load_model
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tiny_models import WORDS, _strip_attn_implementation
from tolerances import fp_tol, model_depth

FILLERS = [w for w in WORDS[5:60] if w not in ("movie",)]
#: 12 texts holding "movie" once, never first (so the first token is a filler word)
_rng = random.Random(3)
TEXTS = []
for _ in range(12):
    words = [_rng.choice(FILLERS) for _ in range(_rng.randint(4, 7))]
    words.insert(_rng.randint(1, len(words)), "movie")
    TEXTS.append(" ".join(words))
#: the planted sink head of the tiny GPT-2
SINK_LAYER, SINK_HEAD = 0, 1
MARK = 7  # the embedding coordinate only position 0 carries


def _value_columns(config, head: int) -> slice:
    dh = config.n_embd // config.n_head
    return slice(2 * config.n_embd + head * dh, 2 * config.n_embd + (head + 1) * dh)


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _strip_attn_implementation(folder)
    return folder


@pytest.fixture(scope="module")
def planted(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """Tiny GPT-2 variants: ``sink`` (head 0.1 attends to the first token from every row, its value
    projection scaled up so that what it reads moves the output),
    ``sink_novalue`` (the same with that head's value projection zeroed), ``novalue`` (the plain tiny
    GPT-2 with every value projection of both layers zeroed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("claims_edges")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])
    out = {}
    for name in ("sink", "sink_novalue", "novalue"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dirs["gpt2"]).eval()
        config = model.config
        dh = config.n_embd // config.n_head
        with torch.no_grad():
            if name.startswith("sink"):
                wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
                wte[:, MARK] = 0.0
                wpe[:, MARK] = 0.0
                wpe[0, MARK] = 30.0  # after ln_1 the first position's MARK coordinate dominates
                attn = model.transformer.h[SINK_LAYER].attn.c_attn  # Conv1D: x @ weight + bias, [q | k | v]
                q = slice(SINK_HEAD * dh, (SINK_HEAD + 1) * dh)
                k = slice(config.n_embd + SINK_HEAD * dh, config.n_embd + (SINK_HEAD + 1) * dh)
                attn.weight[:, q] = 0.0
                attn.bias[q] = 2.0  # a constant query
                attn.weight[:, k] = 0.0
                attn.bias[k] = 0.0
                attn.weight[MARK, k] = 2.0  # the key reads MARK only
                attn.weight[:, _value_columns(config, SINK_HEAD)] *= 30.0  # what it reads moves the output
            if name == "sink_novalue":
                attn = model.transformer.h[SINK_LAYER].attn.c_attn
                attn.weight[:, _value_columns(config, SINK_HEAD)] = 0.0
                attn.bias[_value_columns(config, SINK_HEAD)] = 0.0
            if name == "novalue":
                for block in model.transformer.h:
                    v = slice(2 * config.n_embd, 3 * config.n_embd)
                    block.attn.c_attn.weight[:, v] = 0.0
                    block.attn.c_attn.bias[v] = 0.0
        out[name] = _save(model, tokenizer, root / name)
    out["plain"] = tiny_dirs["gpt2"]
    return out


_PMS: dict = {}
_ORACLES: dict = {}


def _pm(folder: Path):
    if folder not in _PMS:
        _PMS[folder] = load_model(str(folder))
    return _PMS[folder]


def _oracle(folder: Path):
    if folder not in _ORACLES:
        from transformers import AutoModelForCausalLM

        _ORACLES[folder] = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return _ORACLES[folder]


@torch.no_grad()
def _oracle_change(model, example, keys, sites, renormalise=True) -> float:
    """f(x) - f(x with the last prompt row's edges to ``keys`` blocked in ``sites``), by hand."""
    row = len(example.input_ids) - 1
    edges: dict[int, list] = {}
    for layer, head in sites:
        edges.setdefault(layer, []).extend((head, row, k) for k in keys)
    with _blocked_edges(model, edges, renormalise):
        blocked = _target(model, example)
    return _target(model, example) - blocked


@torch.no_grad()
def _hand_sinks(model, example, layer, head, threshold=0.3):
    """(sink keys, target-row share on them) of one head, from eager output_attentions."""
    ids = torch.tensor([example.input_ids])
    maps = model(input_ids=ids, output_attentions=True).attentions[layer][0, head].double()  # [query, key]
    received = maps.mean(dim=0)
    sinks = [int(k) for k in torch.nonzero(received > threshold).flatten()]
    return sinks, float(maps[-1, sinks].sum())


def _file(folder, claims, texts=TEXTS, **extra):
    return claims_from_dict({"model": {"id": str(folder)}, "data": {"texts": list(texts)}, "claims": claims,
                             "statistics": {"bootstrap": 500}, **extra})


# ----------------------------------------------------------------------------- joint blocking


@pytest.mark.parametrize("renormalise", [True, False])
def test_block_edges_of_one_key_in_one_head_equals_edge_knockout(planted, renormalise):
    pm = _pm(planted["plain"])
    examples = prepare(pm, TEXTS[:4], TargetSpec())
    per_head = edge_knockout(pm, examples, layers=1, heads=2, renormalise=renormalise).per_head
    sets = [EdgeSet(i, (k,), ((1, 2),)) for i, e in enumerate(examples) for k in (0, len(e.input_ids) - 2)]
    original, blocked = block_edges(pm, examples, sets, renormalise=renormalise, batch_size=3)
    for j, s in enumerate(sets):
        expected = float(per_head.scores[s.example][1, 2, s.keys[0]])
        assert abs(float(original[s.example] - blocked[j]) - expected) <= fp_tol(1.0, depth=2)


def test_block_edges_of_a_span_in_a_window_equals_the_masked_eager_forward(planted):
    pm, model = _pm(planted["plain"]), _oracle(planted["plain"])
    examples = prepare(pm, TEXTS[:5], TargetSpec())
    sites = ((0, 0), (0, 3), (1, 1), (1, 2))
    sets = [EdgeSet(i, (0, 1, e.input_ids.index(pm.tokenizer.convert_tokens_to_ids("movie"))), sites)
            for i, e in enumerate(examples)]
    original, blocked = block_edges(pm, examples, sets, batch_size=2)  # padded batches
    for j, s in enumerate(sets):
        expected = _oracle_change(model, examples[s.example], sorted(set(s.keys)), sites)
        assert abs(float(original[s.example] - blocked[j]) - expected) <= 10 * fp_tol(10.0, depth=4), (j, expected)


def test_block_edges_refuses_bad_sets_in_one_line(planted):
    pm = _pm(planted["plain"])
    examples = prepare(pm, TEXTS[:1], TargetSpec())
    for sets, pattern in [([EdgeSet(0, (99,), ((0, 0),))], r"keys \[99\] must be positions 0\.\.\d+"),
                          ([EdgeSet(0, (0,), ((5, 0),))], r"layer 5 does not exist"),
                          ([EdgeSet(0, (0,), ((0, 9),))], r"head 9 does not exist")]:
        with pytest.raises(InputError, match=pattern) as info:
            block_edges(pm, examples, sets)
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- sink_head


def _sink_claim(**extra):
    return {"claim": f"head {SINK_LAYER}.{SINK_HEAD} is a sink head", "kind": "sink_head",
            "head": f"{SINK_LAYER}.{SINK_HEAD}", **extra}


def test_the_planted_sink_head_with_its_value_zeroed_is_supported_and_equals_the_hand_numbers(planted):
    folder = planted["sink_novalue"]
    pm, model = _pm(folder), _oracle(folder)
    result = run_audit(_file(folder, [_sink_claim()]), model=pm).claims[0]
    examples = prepare(pm, TEXTS, TargetSpec())
    hand = [_hand_sinks(model, e, SINK_LAYER, SINK_HEAD) for e in examples]
    assert all(keys == [0] for keys, _ in hand), hand  # the planted sink: the first token, in every example
    shares = [share for _, share in hand]
    assert min(shares) > 0.9
    assert abs(result.effect - sum(shares) / len(shares)) <= fp_tol(1.0, depth=2)
    knockout = result.evidence["knockout"]
    assert knockout["effect"] == 0.0 and knockout["verdict"] == "supported"  # zero values: blocking changes nothing
    assert result.verdict == "supported" and result.n == len(TEXTS)
    assert result.evidence["first_token_a_sink"] == 1.0


def test_the_planted_sink_head_whose_edge_matters_is_refuted_by_its_knockout(planted):
    folder = planted["sink"]
    pm, model = _pm(folder), _oracle(folder)
    examples = prepare(pm, TEXTS, TargetSpec())
    changes = [abs(_oracle_change(model, e, [0], [(SINK_LAYER, SINK_HEAD)], renormalise=False)) for e in examples]
    bound = min(changes) / 10  # the truth, set by the oracle: every example's effect is far above the bound
    assert bound > 10 * fp_tol(10.0, depth=4)
    result = run_audit(_file(folder, [_sink_claim(max_effect=bound)]), model=pm).claims[0]
    knockout = result.evidence["knockout"]
    assert abs(knockout["effect"] - sum(changes) / len(changes)) <= 10 * fp_tol(10.0, depth=4)
    assert knockout["verdict"] == "refuted" and result.evidence["share_verdict"] == "supported"
    assert result.verdict == "refuted"


def test_a_head_that_is_no_sink_head_is_refuted_by_its_share(planted):
    folder = planted["plain"]
    pm, model = _pm(folder), _oracle(folder)
    examples = prepare(pm, TEXTS, TargetSpec())
    shares = [_hand_sinks(model, e, 1, 2)[1] for e in examples]
    share = max(shares) + 0.05  # every example's share is below it: the CI must be too
    assert share < 1
    result = run_audit(_file(folder, [_sink_claim(head="1.2", share=share)]), model=pm).claims[0]
    assert result.evidence["share_verdict"] == "refuted" and result.verdict == "refuted"
    assert abs(result.effect - sum(shares) / len(shares)) <= fp_tol(1.0, depth=2)


# ----------------------------------------------------------------------------- edge


def _edge_claim(**extra):
    return {"claim": "in layers 0-1 the last token's attention to movie matters", "kind": "edge", "layers": "0-1",
            "to_words": ["movie"], **extra}


def test_an_edge_that_matters_is_supported_and_equals_the_hand_numbers(planted):
    folder = planted["plain"]
    pm, model = _pm(folder), _oracle(folder)
    examples = prepare(pm, TEXTS, TargetSpec())
    movie = pm.tokenizer.convert_tokens_to_ids("movie")
    sites = [(layer, head) for layer in (0, 1) for head in range(4)]
    changes = [_oracle_change(model, e, [e.input_ids.index(movie)], sites) for e in examples]
    threshold = min(abs(c) for c in changes) / 2
    assert threshold > 10 * fp_tol(10.0, depth=4)
    result = run_audit(_file(folder, [_edge_claim(threshold=threshold)]), model=pm).claims[0]
    assert result.verdict == "supported" and result.n == len(TEXTS)
    assert abs(result.effect - sum(abs(c) for c in changes) / len(changes)) <= 10 * fp_tol(10.0, depth=4)
    assert abs(result.evidence["signed_change"]["mean"] - sum(changes) / len(changes)) <= 10 * fp_tol(10.0, depth=4)
    assert result.evidence["layers"] == [0, 1] and result.evidence["n_with_target"] == len(TEXTS)
    # the same claim written with a regex, a list of layers and every head named: the same numbers
    again = run_audit(_file(folder, [_edge_claim(threshold=threshold, layers=[0, 1], heads=[0, 1, 2, 3],
                                                 to_words=None, to="mov.*")]), model=pm).claims[0]
    assert again.effect == pytest.approx(result.effect, abs=1e-9)


def test_an_edge_through_zeroed_values_is_refuted(planted):
    folder = planted["novalue"]
    result = run_audit(_file(folder, [_edge_claim(threshold=1e-4)]), model=_pm(folder)).claims[0]
    assert result.effect == 0.0 and result.verdict == "refuted"


def test_an_edge_to_a_position_and_fewer_than_ten_examples(planted):
    folder = planted["sink"]
    pm = _pm(folder)
    claim = _edge_claim(layers=SINK_LAYER, heads=SINK_HEAD, to_words=None, to_position=0, threshold=1e-6)
    result = run_audit(_file(folder, [claim], texts=TEXTS[:4]), model=pm).claims[0]
    assert result.verdict == "inconclusive" and result.n == 4 and result.evidence["why"] == "n = 4, at least 10 needed"
    full = run_audit(_file(folder, [claim]), model=pm).claims[0]
    # the planted head reads the first token only: blocking that edge is the sink head's knockout
    sink = run_audit(_file(folder, [_sink_claim(renormalise=True)]), model=pm).claims[0]
    # not bit-equal: the edge claim's call also blocks its control sets, so its forward batches differ
    assert full.effect == pytest.approx(sink.evidence["knockout"]["effect"], abs=fp_tol(1.0, depth=2))
    assert full.verdict == "supported"


# ----------------------------------------------------------------------------- edge: the random-token control


def _listed(result) -> list[dict]:
    """The per-example entries the evidence lists (with at most 2 x EVIDENCE_EXAMPLES examples: all)."""
    return result.evidence["for"] + result.evidence["against"]


def test_the_edge_control_equals_a_hand_block_of_its_drawn_sets(planted):
    folder, texts = planted["plain"], TEXTS[:6]  # six examples: the evidence lists every one
    pm, model = _pm(folder), _oracle(folder)
    result = run_audit(_file(folder, [_edge_claim(threshold=1e-3)], texts=texts), model=pm).claims[0]
    examples = prepare(pm, texts, TargetSpec())
    sites = tuple((layer, head) for layer in (0, 1) for head in range(4))
    entries = _listed(result)
    assert sorted(texts.index(e["text"]) for e in entries) == list(range(len(texts)))
    tol = fp_tol(1.0, depth=model_depth(pm))  # a probability, by the same code in other batches
    eager_tol = 10 * fp_tol(10.0, depth=4)  # the oracle tests' tolerance for the masked eager forward
    controls, above = [], 0
    for entry in entries:
        i = texts.index(entry["text"])
        drawn = entry["control_tokens"]
        assert len(drawn) == CONTROL_DRAWS and all(len(c) == 1 for c in drawn)  # as many keys as "movie": one
        sets = [EdgeSet(i, tuple(c), sites) for c in drawn]
        original, blocked = block_edges(pm, examples, sets)
        by_hand = float((original[i] - blocked).abs().mean())
        assert abs(entry["control_abs_change"] - by_hand) <= tol, (i, entry["control_abs_change"], by_hand)
        # and the first draw against the masked eager forward, independent of block_edges
        eager = _oracle_change(model, examples[i], drawn[0], sites)
        assert abs(eager - float(original[i] - blocked[0])) <= eager_tol, (i, eager)
        controls.append(by_hand)
        above += entry["effect"] > by_hand
    control = result.evidence["control"]
    assert control["n_with_control"] == len(texts) and control["draws"] == CONTROL_DRAWS
    assert abs(control["mean_abs_change"]["mean"] - sum(controls) / len(controls)) <= tol
    assert control["share_named_above_control"] == pytest.approx(above / len(texts), abs=1e-12)
    assert control["mean_abs_change"]["mean"] > 10 * eager_tol  # random edges do move this model: the check bites


def test_the_edge_control_never_draws_a_named_or_special_token(tiny_dirs):
    folder = tiny_dirs["bert"]  # [CLS] ... [SEP]; words outside the tiny vocabulary are [UNK]
    texts = ["the movie was movie good fun", "a movie and movie", "movie movie the", "movie movie",
             "the good movie was fine", "fun movie movie here"]
    pm = _pm(folder)
    examples = prepare(pm, texts, TargetSpec())
    assert any(sum(e.special) > 2 for e in examples)  # an [UNK] among them: a special token inside the text
    result = run_audit(_file(folder, [_edge_claim(threshold=1e-6)], texts=texts), model=pm).claims[0]
    entries = _listed(result)
    assert sorted(texts.index(e["text"]) for e in entries) == list(range(len(texts)))
    n_drawn = 0
    for entry in entries:
        i = texts.index(entry["text"])
        special = {p for p, flag in enumerate(examples[i].special) if flag}
        named = {int(t.rsplit("@", 1)[1]) for t in entry["tokens"]}
        available = set(range(len(examples[i].input_ids))) - special - named
        drawn = entry["control_tokens"]
        if not available:  # "movie movie": nothing else to block, no control
            assert drawn == [] and not math.isfinite(entry["control_abs_change"])
            continue
        # fewer others than named tokens: all of them, once; else CONTROL_DRAWS draws of as many
        size = min(len(named), len(available))
        assert len(drawn) == (1 if len(available) <= len(named) else CONTROL_DRAWS)
        for c in drawn:
            assert len(c) == size and len(set(c)) == size and list(c) == sorted(c)
            assert set(c) <= available, (entry["text"], c, special, named)
        n_drawn += len(drawn)
    assert n_drawn >= 2 * CONTROL_DRAWS
    assert result.evidence["control"]["n_with_control"] == len(texts) - 1


def test_the_edge_control_is_seeded(planted):
    folder, texts = planted["plain"], TEXTS[:6]
    pm = _pm(folder)

    def control(seed):
        result = run_audit(_file(folder, [_edge_claim(threshold=1e-3)], texts=texts,
                                 statistics={"bootstrap": 500, "seed": seed}), model=pm).claims[0]
        evidence = result.to_dict()["evidence"]  # JSON-clean: a NaN CI compares equal as None
        per_example = {e["text"]: (e["control_tokens"], e["control_abs_change"])
                       for e in evidence["for"] + evidence["against"]}
        return per_example, evidence["control"]

    first, again, other = control(0), control(0), control(1)
    assert first == again  # exact: the same draws, the same forward batches
    assert {t: c[0] for t, c in first[0].items()} != {t: c[0] for t, c in other[0].items()}


def test_a_supported_edge_claim_warns_when_random_edges_move_the_target_as_much(planted, tmp_path):
    # in the planted sink model the edges to "movie" barely matter, and neither do those to other ordinary
    # tokens: supported at a tiny threshold, which random edges reach too (not specific). The first token,
    # the sink of the planted head and of most heads of the window, is never drawn: with it in the draws
    # the control was 0.125, fifty times the named edges' effect, whatever the named tokens were
    from probe.explainers.sinks import attention_sinks

    folder = planted["sink"]
    pm = _pm(folder)
    audit = run_audit(_file(folder, [_edge_claim(layers=SINK_LAYER, threshold=1e-6)]), model=pm)
    result = audit.claims[0]
    control = result.evidence["control"]
    assert result.verdict == "supported"  # the verdict is the threshold's alone
    assert 1e-6 <= control["mean_abs_change"]["mean"] < 10 * result.effect
    found = attention_sinks(pm, prepare(pm, TEXTS, TargetSpec())).examples
    assert all(bool(e.sinks[SINK_LAYER, :, 0].float().mean() >= 0.5) for e in found)  # position 0: a sink of most heads
    assert all(0 not in c for e in _listed(result) for c in e["control_tokens"])
    warning = control["warning"]
    assert "\n" not in warning and "(>= threshold 1e-06)" in warning
    assert warning.endswith("the effect is not specific to the tokens of the words movie")
    paths = audit.write(tmp_path / "audit")
    markdown = paths[1].read_text(encoding="utf-8")
    # on its own line, right under the claim's kind line, not inside the control's evidence line
    lines = markdown.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("- **warning**: "))
    assert lines[at - 1].startswith("- kind: `edge`")
    assert lines[at].endswith("not specific to the tokens of the words movie")
    assert not any("not specific" in line for line in lines if line.startswith("- control:"))
    html = next(p for p in paths if str(p).endswith(".html")).read_text(encoding="utf-8")
    assert "<li><b>warning</b>: blocking the target row" in html


def test_an_edge_claim_specific_to_its_token_warns_only_where_its_control_reaches_the_threshold(planted):
    # the planted sink head reads the first token only: the edges to it matter, those to random others far less
    folder = planted["sink"]
    pm, model = _pm(folder), _oracle(folder)
    examples = prepare(pm, TEXTS, TargetSpec())
    changes = [abs(_oracle_change(model, e, [0], [(SINK_LAYER, SINK_HEAD)])) for e in examples]
    threshold = min(changes) / 2
    assert threshold > 10 * fp_tol(10.0, depth=4)
    claim = _edge_claim(layers=SINK_LAYER, heads=SINK_HEAD, to_words=None, to_position=0, threshold=threshold)
    result = run_audit(_file(folder, [claim]), model=pm).claims[0]
    control = result.evidence["control"]
    assert result.verdict == "supported" and control["n_with_control"] == len(TEXTS)
    assert control["mean_abs_change"]["mean"] < threshold / 10 and control["share_named_above_control"] == 1.0
    assert "warning" not in control
    # every head of the layer: the other heads' random edges move the target a little; the warning's
    # edge is the threshold, on either side of the control's mean |change|
    every_head = {**claim, "heads": None}
    low = run_audit(_file(folder, [{**every_head, "threshold": 1e-6}]), model=pm).claims[0]
    mean = low.evidence["control"]["mean_abs_change"]["mean"]
    assert 10 * fp_tol(10.0, depth=4) < mean < low.ci[0] / 10
    below = run_audit(_file(folder, [{**every_head, "threshold": 0.9 * mean}]), model=pm).claims[0]
    above = run_audit(_file(folder, [{**every_head, "threshold": 1.1 * mean}]), model=pm).claims[0]
    assert below.verdict == above.verdict == "supported"
    assert f"moves the target by {mean:.3g} (>= threshold {0.9 * mean:g})" in below.evidence["control"]["warning"]
    assert "warning" not in above.evidence["control"]
    # the named edges no stronger than random ones but the claim refuted: nothing to warn about
    weak = run_audit(_file(folder, [{**claim, "to_position": -1}]), model=pm).claims[0]
    assert weak.verdict == "refuted" and "warning" not in weak.evidence["control"]


def test_rule_below_and_at_least():
    values = [0.01, 0.02, 0.015, 0.012, 0.018, 0.011, 0.02, 0.013, 0.017, 0.016, 0.014, 0.019]
    assert judge(values, at_most_rule(0.05)).verdict == "supported"
    assert judge(values, at_most_rule(0.005)).verdict == "refuted"
    assert judge(values, at_least_rule(0.005)).verdict == "supported"
    assert judge(values, at_least_rule(0.05)).verdict == "refuted"
    assert "below 0.05" in at_most_rule(0.05).describe()


# ----------------------------------------------------------------------------- malformed claims

GOOD = """\
model: {id: builtin:smollm2-135m}
data: {texts: [the movie was good]}
claims:
  - claim: head 3.1 is a sink head
    kind: sink_head
    head: 3.1
  - claim: the subject matters in layers 10-14
    kind: edge
    layers: 10-14
    to_words: [movie]
"""


def _error(tmp_path, text) -> str:
    path = tmp_path / "claims.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as info:
        load_claims(path)
    message = str(info.value)
    assert "\n" not in message, message
    return message.replace(f"{path} ", "")


def test_a_good_file_reads(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text(GOOD, encoding="utf-8")
    sink, edge = load_claims(path).claims
    assert sink.site == (3, 1)
    assert (sink.share, sink.max_effect, sink.threshold, sink.renormalise) == (0.5, 0.05, 0.3, False)
    assert edge.window == ((10, 14), ()) and edge.head_list is None and edge.threshold == 0.05
    assert claims_from_dict(load_claims(path).to_dict()).claims == load_claims(path).claims


@pytest.mark.parametrize("old, new, pattern", [
    ("head: 3.1", "head: three", r"line 6: claims\[0\]\.head: 'three' is not LAYER\.HEAD"),
    ("head: 3.1", "head: 3.1\n    share: 1.5", r"line 7: claims\[0\]\.share: 1\.5 is out of range"),
    ("head: 3.1", "head: 3.1\n    max_effect: 0", r"claims\[0\]\.max_effect: 0 is out of range"),
    ("head: 3.1", "head: 3.1\n    heads: 2", r"unknown key 'heads' in claims\[0\]"),
    ("    layers: 10-14\n", "", r"claims\[1\]: missing required key 'layers'"),
    ("layers: 10-14", "layers: 10-x", r"claims\[1\]\.layers: '10-x' is not a layer window"),
    ("layers: 10-14", "layers: -1", r"claims\[1\]\.layers: -1 is negative"),
    ("layers: 10-14", "layers: []", r"claims\[1\]\.layers: \[\] is not a list of layer indices"),
    ("to_words: [movie]", "to_words: [movie]\n    to_position: 0", r"claims\[1\]\.to: give exactly one of to"),
    ("    to_words: [movie]\n", "", r"claims\[1\]\.to: give exactly one of to .*none was given"),
    ("to_words: [movie]", "to: '(x'", r"claims\[1\]\.to: '\(x' is not a valid"),
    ("to_words: [movie]", "to_words: [movie]\n    heads: [-1]", r"claims\[1\]\.heads"),
])
def test_malformed_claims_fail_in_one_line(tmp_path, old, new, pattern):
    assert old in GOOD
    message = _error(tmp_path, GOOD.replace(old, new))
    assert re.search(pattern, message), message


def test_run_time_errors_of_the_new_kinds_are_one_line(planted):
    pm = _pm(planted["plain"])  # 2 layers x 4 heads
    cases = [
        (_sink_claim(head="2.0"), r"claims\[0\]\.head: layer 2 does not exist"),
        (_sink_claim(head="1.4"), r"claims\[0\]\.head: head 4 does not exist"),
        (_edge_claim(layers="1-0"), r"claims\[0\]\.layers: the range '1-0' runs from layer 1 down to 0"),
        (_edge_claim(layers="0-7"), r"claims\[0\]\.layers: layer 7 does not exist"),
        (_edge_claim(heads=[0, 9]), r"claims\[0\]\.heads: head 9 does not exist"),
        (_edge_claim(to_words=["zebra"]), r"claims\[0\]\.to_words: the tokens of the words zebra match no token"),
        (_edge_claim(to_words=None, to_position=40), r"claims\[0\]\.to_position: position 40 lies outside every"),
    ]
    for claim, pattern in cases:
        with pytest.raises(InputError) as info:
            run_audit(_file(planted["plain"], [claim]), model=pm)
        assert "\n" not in str(info.value) and re.search(pattern, str(info.value)), str(info.value)


def test_the_audit_report_renders_the_new_kinds(planted, tmp_path):
    folder = planted["sink_novalue"]
    audit = run_audit(_file(folder, [_sink_claim(), _edge_claim(threshold=1e-3)]), model=_pm(folder))
    paths = audit.write(tmp_path / "audit")
    markdown = paths[1].read_text(encoding="utf-8")
    assert "kind: `sink_head`" in markdown and "kind: `edge`" in markdown
    assert "knockout: supported" in markdown and "sinks: " in markdown
    html = paths[2].read_text(encoding="utf-8")
    assert "sink_head" in html and "edge knockout" in html


def test_the_planted_head_is_a_sink_head_by_attention_sinks(planted):
    pm = _pm(planted["sink"])
    found = attention_sinks(pm, prepare(pm, TEXTS, TargetSpec()))
    assert all(bool(e.sinks[SINK_LAYER, SINK_HEAD, 0]) for e in found.examples)
    assert float(found.share[:, SINK_LAYER, SINK_HEAD].min()) > 0.9
