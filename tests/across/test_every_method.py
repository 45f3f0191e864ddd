"""Every registered method, by enumeration of the registry (no hand list): a batch of one gives what
the same example gives in a batch of several, padding is never scored, and the sanity checks that
fit a method run on it. A method added to the registry is tested here without a line more."""

from __future__ import annotations

import pytest

from probe import registry
from probe.methods import run_method
from probe.rows.prepare import prepare
from probe.rows.target import TargetSpec

from tolerances import assert_fp_close, gradient_term_scales, model_depth

#: examples of different lengths, so that a batch of them is padded
TEXTS = ["a good film", "the plot was thin and the acting was worse than the plot", "bad", "it was fine, I think"]
ENTRIES = registry.methods(listed=False)
KINDS = ("bert", "gpt2", "t5")


def _prepared(loaded, kind):
    pm = loaded(kind)
    examples = prepare(pm, TEXTS, TargetSpec())
    return pm, examples


def _run(pm, examples, entry):
    """A listed method through the dispatcher; a variant run only by name through its family's scorer."""
    if entry.listed:
        return run_method(pm, examples, entry.name)
    return entry.load_scorer()(pm, examples, entry.name)


def _scale(pm, example, entry) -> float | None:
    """The scale a score is rounded at: a gradient's terms before they are summed over the embedding,
    an intervention's target value before the difference; None: the score's own."""
    if entry.family == "gradient":
        return gradient_term_scales(pm, [example], entry.name)[0]
    if entry.family == "intervention":
        return abs(example.original_value)
    return None


def _skip_reason(pm, examples, name: str) -> str | None:
    longest = max(len(e.input_ids) for e in examples)
    return registry.skipped(pm, longest).get(name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [m.name for m in ENTRIES])
def test_a_batch_of_one_equals_a_batch_of_several(loaded, kind, name):
    pm, examples = _prepared(loaded, kind)
    reason = _skip_reason(pm, examples, name)
    if reason is not None:
        pytest.skip(f"{name} does not apply to the tiny {kind}: {reason}")
    entry = registry.find(name)
    together = _run(pm, examples, entry)
    depth = model_depth(pm, backward=entry.needs_gradients)
    if name == "integrated_gradients":
        depth *= 4  # a sum over the path's points: each point's rounding adds up
    for i in (1, 2):
        alone = _run(pm, examples[i:i + 1], entry)
        assert together.scores[i].shape == alone.scores[0].shape, name
        assert together.scores[i].shape[-1] == len(examples[i].input_ids), f"{name} scored padding"
        assert_fp_close(together.scores[i], alone.scores[0], depth=depth, scale=_scale(pm, examples[i], entry),
                        msg=f"{kind} {name} example {i}")


@pytest.mark.parametrize("name", [m.name for m in ENTRIES])
def test_every_method_gets_the_sanity_checks_that_fit_it(loaded, name):
    from probe.study.sanity import explain_checks

    pm, examples = _prepared(loaded, "bert")  # a norm right after its embeddings: degeneracy applies
    reason = _skip_reason(pm, examples, name)
    if reason is not None:
        pytest.skip(f"{name} does not apply to the tiny bert: {reason}")
    entry = registry.find(name)
    result = _run(pm, examples[:2], entry)
    checks = {c.check for c in explain_checks(pm, examples[:2], {name: result}) if c.method == name}
    expected = set()
    if entry.family != "intervention":
        expected.add("constant")
    if entry.reduction == "sum":  # a sum over the embedding axis: it can cancel to nothing
        expected.add("degeneracy")
    if entry.completeness:
        expected.add("completeness")
    assert checks == expected, name


def test_the_enumeration_covers_every_family_and_the_unlisted_variants():
    """The lists above are the registry's: every family is in them, and so is a variant run only by name."""
    assert {m.family for m in ENTRIES} == {"attention", "gradient", "intervention"}
    assert any(not m.listed for m in ENTRIES)
