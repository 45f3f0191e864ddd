"""Spans as units (issue 27, item 3): token groups given by the text (a regular expression or
character offsets), every method's scores folded over them, and leave-one-out of whole spans
checked against one forward per perturbed sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from probe.errors import InputError

TEXTS = ["the movie was good and the plot was bad", "bad plot"]


def _value(pm, example, ids):
    from probe.rows.values import evaluate

    return float(evaluate(pm, [(list(ids), example)])[0])


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_span_scores_fold_the_token_scores_and_span_loo_deletes_the_whole_span(loaded, kind):
    pm = loaded(kind)
    ex = probe.explain(pm, TEXTS, ["attention_mean", "saliency", "loo_delete"], spans=r"the \w+|bad")
    table = ex.to_pandas(level="span")
    first = ex.examples[0]
    spans = ex.spans[0]
    assert [s.text for s in spans] == ["the movie", "the plot", "bad"]
    for s in spans:
        for method in ("saliency", "loo_delete"):
            row = table[(table.example == 0) & (table.span == s.text) & (table.method == method)]
            expected = np.nansum(ex[method].scores[0][list(s.positions)].double().numpy())
            assert row.score.item() == pytest.approx(expected, abs=1e-6)
        joined = pm.tokenizer.convert_tokens_to_string([first.tokens[p] for p in s.positions]).strip()
        assert joined.replace(" ", "") == s.text.replace(" ", "")
    loo = probe.span_loo(pm, TEXTS, r"the \w+|bad")
    for _, row in loo[loo.example == 0].iterrows():
        s = spans[row.span_index]
        shorter = [t for p, t in enumerate(first.input_ids) if p not in set(s.positions)]
        assert row.score == pytest.approx(_value(pm, first, first.input_ids) - _value(pm, first, shorter), abs=1e-5)
    assert set(loo.example) == {0, 1} and (loo.n_tokens >= 1).all()


def test_span_loo_by_replacement_and_offsets(loaded):
    pm = loaded("bert")
    text = TEXTS[0]
    start = text.index("good")
    loo = probe.span_loo(pm, text, [(start, start + 4), (0, 9)], mode="mask")
    example = probe.prepare(pm, text)[0]
    assert list(loo.span) == ["good", "the movie"]
    spans = probe.find_spans(pm, example, [(start, start + 4), (0, 9)])
    masked = [pm.tokenizer.mask_token_id if p in set(spans[1].positions) else t for p, t in enumerate(example.input_ids)]
    assert loo.score.iloc[1] == pytest.approx(_value(pm, example, example.input_ids) - _value(pm, example, masked),
                                              abs=1e-5)


def test_span_refusals_are_one_line(loaded):
    pm = loaded("bert")
    with pytest.raises(InputError, match="covers no scored token"):
        probe.span_loo(pm, TEXTS, r"zebra")
    with pytest.raises(InputError, match="not a valid regular expression"):
        probe.explain(pm, TEXTS, ["attention_mean"], spans="(")
    with pytest.raises(InputError, match="not a pair of character offsets"):
        probe.span_loo(pm, TEXTS, [(5, 2)])
    with pytest.raises(InputError, match="mode"):
        probe.span_loo(pm, TEXTS, "bad", mode="random")
    with pytest.raises(InputError, match="spans="):
        probe.explain(pm, TEXTS, ["attention_mean"]).to_pandas(level="span")


def test_spans_of_generated_output_steps(loaded):
    """A step-by-step explanation folds each output token's row over the prompt's spans."""
    pm = loaded("gpt2")
    ex = probe.explain(pm, TEXTS[:1], ["loo_delete"], generate=2, spans=r"the \w+")
    table = ex.to_pandas(level="span")
    assert set(table.example) == set(range(len(ex.examples)))
    row = table[(table.example == 1) & (table.span_index == 0)]
    expected = np.nansum(ex["loo_delete"].scores[1][list(ex.spans[1][0].positions)].double().numpy())
    assert row.score.item() == pytest.approx(expected, abs=1e-6)
    assert torch.isfinite(ex["loo_delete"].scores[1][list(ex.spans[1][0].positions)]).all()


def test_a_study_compares_spans_as_its_units(tiny_dirs, tmp_path):
    """``spans:`` in a study: the units are the pattern's matches; an explainer's unit score is its
    token scores summed over the span, the reference deletes the whole span (checked against one
    forward of the shorter sequence), and agreement ranks the spans."""
    import pandas as pd

    from probe.explainers.gradients import saliency
    from probe.metrics.agreement import agreement
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    texts = ["the movie was good and the plot was bad", "the film is fun but the story is boring",
             "the acting was great , the ending was not", "a boring plot and the worst film"]
    pd.DataFrame({"text": texts, "label": [1, 1, 0, 0]}).to_csv(tmp_path / "data.csv", index=False)
    pattern = r"the \w+|bad|boring|fun|great|not"
    spec = {"name": "spans", "model": {"id": str(tiny_dirs["gpt2"])},
            "dataset": {"name": str(tmp_path / "data.csv"), "n": 4, "seed": 0}, "target": {"continuation": " good"},
            "explainers": ["saliency"], "references": ["loo_delete"], "spans": {"pattern": pattern},
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False, "examples": 2}},
            "statistics": {"bootstrap": 100}, "engine": {"batch_size": 4}, "output": str(tmp_path / "out")}
    assert run_study(study_from_dict(spec), progress=False, log=lambda _: None).complete
    out = tmp_path / "out"
    tokens, scores = pd.read_parquet(out / "tokens.parquet"), pd.read_parquet(out / "scores.parquet")
    examples, units = pd.read_parquet(out / "examples.parquet"), pd.read_parquet(out / "agreement.parquet")
    pm = probe.load_model(str(tiny_dirs["gpt2"]))
    for number, text in zip(examples["example"], examples["text"]):
        example = prepare(pm, [text], TargetSpec(continuation=" good"))[0]
        spans = probe.find_spans(pm, example, pattern)
        assert tokens[tokens.example == number]["token"].tolist() == [s.text for s in spans]
        grad = saliency(pm, [example]).scores[0].double().numpy()
        got = scores[(scores.example == number) & (scores.method == "saliency")].sort_values("position")["score"]
        assert got.to_numpy() == pytest.approx([grad[list(s.positions)].sum() for s in spans], abs=1e-5)
        whole = _value(pm, example, example.input_ids)
        ref = scores[(scores.example == number) & (scores.method == "loo_delete")].sort_values("position")["score"]
        by_hand = [whole - _value(pm, example, [t for p, t in enumerate(example.input_ids) if p not in s.positions])
                   for s in spans]
        assert ref.to_numpy() == pytest.approx(by_hand, abs=1e-5)
        row = units[(units.example == number) & (units.explainer == "saliency")].iloc[0]
        expected = agreement(got.to_numpy()[None], ref.to_numpy(), k=[1])["kendall_tau"][0]
        assert row["n_tokens"] == len(spans) and row["kendall_tau"] == pytest.approx(expected, abs=1e-9)


def test_a_study_refuses_spans_with_a_reference_that_has_no_span_form(tmp_path):
    from probe.spec.study import study_from_dict

    spec = {"name": "spans", "model": {"id": "builtin:smollm2-135m"}, "dataset": {"name": "builtin:rotten_tomatoes"},
            "explainers": ["saliency"], "references": ["loo_lm"], "spans": {"pattern": r"\w+"}}
    with pytest.raises(InputError, match="loo_lm has no span form"):
        study_from_dict(spec)
    with pytest.raises(InputError, match="is not a valid regular expression"):
        study_from_dict({**spec, "references": ["loo_delete"], "spans": {"pattern": "(unclosed"}})


# in the tiny word-level vocabulary: "you ," opens the user's turn, "i ," any other
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}you{% else %}i{% endif %} , "
                 "{{ m['content'] }} .\n{% endfor %}{% if add_generation_prompt %}i ,{% endif %}")
CONVERSATION = [{"role": "system", "content": "be very short"}, {"role": "user", "content": "was the plot good"}]


@pytest.fixture(scope="module")
def chat_gpt2(tiny_dirs):
    """The tiny GPT-2 with a chat template of its own (its tokenizer ships none)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])
    tokenizer.chat_template = CHAT_TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["gpt2"]).eval()
    return probe.wrap(model, tokenizer)


def test_chat_roles_are_spans_of_the_conversation(chat_gpt2, tmp_path):
    """A conversation laid out by the chat template: each message's content is scored, the
    template's tokens are not, and ``spans="@roles"`` reads every message as one span named by its
    role: scores folded over the message's tokens, and leave-one-out of the whole message equal to
    one forward of the laid-out prompt without those tokens."""
    pm = chat_gpt2
    ex = probe.explain(pm, CONVERSATION, ["saliency", "loo_delete"], chat=True, generate=2, spans="@roles")
    first = ex.examples[0]
    laid_out = pm.tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert first.text == laid_out and len(ex.examples) == len(first.target_ids) >= 1
    assert [(first.text[a:b], role) for a, b, role in first.messages] == [
        ("be very short", "system"), ("was the plot good", "user")]
    scored = [t for t, s in zip(first.tokens, first.special) if not s]
    assert scored == "be very short was the plot good".split()  # not the template's "i , ... ."
    spans = ex.spans[0]
    assert [(s.role, s.text) for s in spans] == [("system", "be very short"), ("user", "was the plot good")]
    table = ex.to_pandas(level="span")
    columns = list(table.columns)
    assert columns[1:4] == ["text", "output_index", "output_token"]  # generated text: which output token each explains
    assert [c for c in columns if c not in columns[1:4]][:7] == ["example", "span_index", "span", "start", "end",
                                                                 "n_tokens", "role"]
    for i in range(len(ex.examples)):
        for s in ex.spans[i]:
            row = table[(table.example == i) & (table.role == s.role) & (table.method == "saliency")]
            assert row.score.item() == pytest.approx(float(ex["saliency"].scores[i][list(s.positions)].sum()), abs=1e-6)
    ex.save(tmp_path / "saved")
    assert probe.load_explanation(tmp_path / "saved").examples == ex.examples  # the messages come back as they were
    loo = probe.span_loo(pm, CONVERSATION, "@roles", chat=True, generate=2)
    assert set(loo.role) == {"system", "user"}
    for _, row in loo.iterrows():
        e, s = ex.examples[row.example], ex.spans[row.example][row.span_index]
        without = [t for p, t in enumerate(e.input_ids) if p not in s.positions]
        assert row.score == pytest.approx(e.original_value - _value(pm, e, without), abs=1e-5)


def test_chat_role_spans_refusals_are_one_line(chat_gpt2):
    pm = chat_gpt2
    with pytest.raises(InputError, match="chat=True"):
        probe.explain(pm, TEXTS, ["saliency"], spans="@roles")
    with pytest.raises(InputError, match="is not \\{'role'"):
        probe.prepare(pm, [[{"role": "user"}]], chat=True)
    with pytest.raises(InputError, match="message is empty"):
        probe.prepare(pm, [{"role": "user", "content": ""}], chat=True)
    with pytest.raises(InputError, match="needs chat=True"):
        probe.explain(pm, [CONVERSATION], ["saliency"])


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_span_knockout_of_one_token_spans_is_the_token_knockout_and_blocks_a_span_at_once(loaded, kind):
    """knockout's span form: a span of one token scores what knockout gives that token; a longer span
    is the edges to all its tokens blocked together (block_edges' oracle on one edge set)."""
    from probe.intervene.engine import Engine
    from probe.intervene.knockout import EdgeSet, block_edges, knockout
    from probe.intervene.spans import span_knockout
    from probe.rows.prepare import prepare
    from probe.rows.spans import Span
    from probe.rows.target import TargetSpec

    pm = loaded(kind)
    examples = prepare(pm, TEXTS, TargetSpec() if kind == "bert" else TargetSpec(continuation=" good"))
    tokens = knockout(pm, examples, layers="-2:", renormalise=True)
    found = [[Span(text=e.tokens[p], start=0, end=1, positions=(p,)) for p in range(len(e.input_ids))
              if not e.special[p]] for e in examples]
    got = span_knockout(Engine(pm), examples, found, layers="-2:")
    for i, spans in enumerate(found):
        want = tokens.scores[i].double().numpy()[[s.positions[0] for s in spans]]
        assert got[i] == pytest.approx(want, abs=1e-6)
    pair = [[Span(text="two", start=0, end=1, positions=(found[0][0].positions[0], found[0][2].positions[0]))], []]
    joint = span_knockout(Engine(pm), examples, pair, layers="-2:")
    n_layers = pm.contract.stacks[pm.task.target_stack(pm.contract)].n_layers
    sites = tuple((layer, head) for layer in (n_layers - 2, n_layers - 1)
                  for head in range(pm.contract.stacks[pm.task.target_stack(pm.contract)].n_heads))
    original, blocked = block_edges(pm, examples, [EdgeSet(0, pair[0][0].positions, sites)])
    assert joint[0] == pytest.approx([float(original[0] - blocked[0])], abs=1e-9) and len(joint[1]) == 0
    with pytest.raises(InputError, match="query: from has no span form"):
        span_knockout(Engine(pm), examples, found, query="from")


def test_a_study_takes_knockout_as_its_reference_over_spans(tiny_dirs, tmp_path):
    """``spans:`` with knockout as the reference (refused before: no span form): the study's reference
    scores are the span form's, each span's edges blocked at once."""
    import pandas as pd

    from probe.intervene.engine import Engine
    from probe.intervene.spans import span_knockout
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    texts = ["the movie was good and the plot was bad", "the film is fun but the story is boring",
             "the acting was great , the ending was not"]
    pd.DataFrame({"text": texts, "label": [1, 1, 0]}).to_csv(tmp_path / "data.csv", index=False)
    pattern = r"the \w+|bad|boring|fun|great|not"
    spec = {"name": "spans-knockout", "model": {"id": str(tiny_dirs["gpt2"])},
            "dataset": {"name": str(tmp_path / "data.csv"), "n": 3, "seed": 0}, "target": {"continuation": " good"},
            "explainers": ["attention_mean"], "references": ["knockout"], "spans": {"pattern": pattern},
            "params": {"knockout": {"layers": "-1:"}},
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False, "examples": 2}},
            "statistics": {"bootstrap": 100}, "engine": {"batch_size": 4}, "output": str(tmp_path / "out")}
    assert run_study(study_from_dict(spec), progress=False, log=lambda _: None).complete
    scores = pd.read_parquet(tmp_path / "out" / "scores.parquet")
    examples = pd.read_parquet(tmp_path / "out" / "examples.parquet")
    pm = probe.load_model(str(tiny_dirs["gpt2"]))
    for number, text in zip(examples["example"], examples["text"]):
        example = prepare(pm, [text], TargetSpec(continuation=" good"))[0]
        want = span_knockout(Engine(pm), [example], [probe.find_spans(pm, example, pattern)], layers="-1:")[0]
        got = scores[(scores.example == number) & (scores.method == "knockout")].sort_values("position")["score"]
        assert got.to_numpy() == pytest.approx(want, abs=1e-5)
