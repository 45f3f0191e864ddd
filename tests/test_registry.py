"""The method registry is the one list of methods: everything else derives from it and cannot drift."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from probe import names, registry
from probe.errors import InputError
from probe.tasks import task_named

ENTRIES = registry.REGISTRY + registry.COUNTERFACTUALS


def test_names_are_unique_and_every_family_and_group_has_methods():
    every = [m.name for m in registry.REGISTRY]
    assert len(every) == len(set(every))
    assert {m.family for m in registry.REGISTRY} == set(registry.FAMILIES)
    for family in registry.FAMILIES:
        assert registry.names(family=family), family
    assert [g.name for g in registry.GROUPS] == list(dict.fromkeys(m.group for m in registry.methods()))
    for group in registry.GROUPS:
        assert registry.names(group=group.name) and group.what, group.name


def test_names_derive_the_shared_tuples_in_registry_order():
    assert names.ALL_METHODS == names.ATTENTION_METHODS + names.GRADIENT_METHODS + names.INTERVENTION_METHODS
    assert set(names.CONTEXT_MIXING_METHODS) <= set(names.ATTENTION_METHODS)
    assert names.ALL_METHODS == tuple(m.name for m in registry.REGISTRY if m.listed)
    for name in names.ALL_METHODS:
        assert names.method_family(name) == registry.method(name).family
    unlisted = [m.name for m in registry.REGISTRY if not m.listed]
    assert unlisted == ["attn_norm_sum"]
    assert names.method_family("attn_norm_sum") is None and names.method_family("random") is None


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_entry_resolves_and_its_defaults_are_the_implementation_keywords(entry):
    function = entry.load()
    assert callable(function)
    paths = [entry.implementation] + ([entry.scorer] if isinstance(entry, registry.Method) else [])
    if isinstance(entry, registry.Method) and entry.applies.support:
        paths.append(entry.applies.support)
    if isinstance(entry, registry.Method) and entry.query_max:
        paths.append(entry.query_max)
        assert callable(entry.load_query_max())
    for path in paths:  # each names the module that defines the function, not one that re-exports it
        module, _, name = path.partition(":")
        assert registry._load(path).__module__ == module, (entry.name, path)
    params = inspect.signature(function).parameters
    fields = dataclasses.fields(entry.params)
    assert entry.params.__dataclass_params__.frozen
    for f in fields:
        assert f.name in params, (entry.name, f.name)
        assert params[f.name].default == f.default, (entry.name, f.name)
    keywords = {n for n, p in params.items() if p.default is not inspect.Parameter.empty}
    assert keywords == {f.name for f in fields}, entry.name  # every keyword parameter is registered
    if isinstance(entry, registry.Method):
        assert callable(entry.load_scorer())
        assert dict(entry.preset).keys() <= {f.name for f in fields}
    seed_param = "seed" in {f.name for f in fields}
    assert seed_param or not entry.takes_seed, entry.name
    if getattr(entry, "engine", False) is False:  # leave-one-out shares one function; only its sampling modes seed
        assert entry.takes_seed == seed_param, entry.name


def test_params_are_frozen():
    defaults = registry.method("integrated_gradients").defaults()
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.steps = 8
    assert registry.find("attn_norm_sum").defaults().per_head is False
    assert registry.method("loo_mask").defaults().mode == "mask"


def test_unknown_names_are_one_line_errors_listing_the_valid_ones():
    with pytest.raises(InputError, match=r"unknown method 'telepathy': valid methods are attention, attention_mean"):
        registry.method("telepathy")
    with pytest.raises(InputError, match="valid methods are"):
        registry.method("attn_norm_sum")  # a variant: run by name through the attention scorer only
    with pytest.raises(InputError, match="uniform, permuted, adversarial"):
        registry.counterfactual("random")


def test_seeded_methods():
    assert registry.seeded() == ("gradient_shap", "loo_random", "loo_lm", "shapley")
    assert registry.seeded(["loo_lm", "saliency"]) == ("loo_lm",)


class _Tokenizer:
    def __init__(self, mask, unk):
        self.mask_token_id, self.unk_token_id = mask, unk


class _Model:
    def __init__(self, task, mask=None, unk=None):
        self.task, self.tokenizer = task_named(task), _Tokenizer(mask, unk)


def test_skipped_reasons_come_in_check_order():
    checks = registry.CHECKS[:-1]  # the layout check (support) needs a real model: test_context_mixing runs it
    reasons = registry.skipped(_Model("classification"), longest=65, checks=checks)
    assert list(reasons) == ["loo_lm", "loo_mask", "loo_unk", "flow", "attention_nosink", "saliency_l1", "saliency_sum",
                             "shapley", "knockout", "atp"]
    assert reasons["flow"] == "attention flow is limited to 64 tokens (longest input has 65)"
    assert reasons["loo_mask"] == "the tokenizer has no mask token"
    assert list(registry.skipped(_Model("causal_lm", mask=1, unk=2), longest=64, checks=checks)) == \
        ["attention_nosink", "saliency_l1", "saliency_sum", "shapley", "knockout", "atp"]


def test_importing_the_registry_loads_no_torch():
    code = "import sys, probe.registry, probe.names; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_study_and_claim_files_take_the_registry_adversarial_defaults():
    """One default for the adversarial search: the library, study files and claim files agree."""
    from probe.claims.kinds.counterfactual import CounterfactualClaim
    from probe.intervene.counterfactual import adversarial_attention
    from probe.spec.study import CounterfactualSpec

    adversarial = registry.counterfactual("adversarial").defaults()
    keywords = inspect.signature(adversarial_attention).parameters
    assert keywords["steps"].default == adversarial.steps and keywords["candidates"].default == adversarial.candidates
    spec = CounterfactualSpec()
    assert (spec.adversarial_steps, spec.adversarial_candidates) == (adversarial.steps, adversarial.candidates)
    claim = CounterfactualClaim(claim="x", kind="counterfactual")
    assert (claim.steps, claim.candidates) == (adversarial.steps, adversarial.candidates)


def test_per_head_and_query_max_methods_are_registry_facts():
    from probe.explainers.attention import QUERY_MAX_METHODS
    from probe.spec.claim_values import PER_HEAD_METHODS

    assert PER_HEAD_METHODS == registry.per_head_methods() and "attention" in PER_HEAD_METHODS
    assert "attention_mean" not in PER_HEAD_METHODS
    assert QUERY_MAX_METHODS == registry.query_max_methods() and "flow" in QUERY_MAX_METHODS
    assert all(registry.method(m).family == "attention" for m in PER_HEAD_METHODS + QUERY_MAX_METHODS)


def test_gradient_capability_fields_agree_with_the_parameter_classes():
    """A method shared from one gradient takes no parameter but its site; ``points`` names one of its
    parameters; only a method with a completeness check is IG-like (its params have steps)."""
    for entry in registry.methods(family="gradient", listed=False):
        fields = {f.name for f in dataclasses.fields(entry.params)}
        if entry.reduction is not None:
            assert entry.reduction in ("l2", "l1", "sum") and fields == {"site"}, entry.name
            assert entry.points is None and not entry.completeness, entry.name
        else:
            assert not entry.times_input, entry.name
        if entry.points is not None:
            assert entry.points in fields, entry.name
        if entry.completeness:
            assert "steps" in fields and "baseline" in fields, entry.name
    assert [m.name for m in registry.methods(family="gradient") if m.reduction] == \
        ["saliency", "saliency_l1", "saliency_sum", "input_x_gradient"]


def test_the_capability_fields_say_what_each_method_needs():
    needs = {m.name for m in registry.methods(listed=False) if m.needs_gradients}
    assert needs == set(registry.names(family="gradient")) | {"attn_grad", "atp"}
    assert {m.name for m in registry.methods() if m.reads_attention} == set(names.ATTENTION_METHODS)
    # the one intervention that runs a backward pass estimates knockout to first order (attribution patching)
    assert [m.name for m in registry.methods(family="intervention") if m.needs_gradients] == ["atp"]


def test_labels_name_the_settings_where_numbers_differ_from_captum_and_inseq():
    """saliency's L2 norm (captum users sum |grad|) and IG's baseline at [CLS]/[SEP] too (captum's
    tutorial keeps them) are named beside the method; a method with nothing to name keeps its name."""
    assert registry.labelled("saliency") == "saliency (L2)"
    assert registry.labelled("saliency_l1") == "saliency_l1 (L1)"
    assert registry.labelled("integrated_gradients") == "integrated_gradients (baseline pad, specials replaced)"
    # what a result recorded (IG writes baseline_keeps_special) or what was given
    recorded = {"baseline": "zero", "baseline_keeps_special": True}
    assert registry.labelled("integrated_gradients", recorded) == "integrated_gradients (baseline zero, specials kept)"
    assert registry.labelled("gradient_shap", {"baseline": ["pad", "unk"], "keep_special": True}) == (
        "gradient_shap (baseline pad+unk, specials kept)")
    for name in ("attention", "input_x_gradient", "loo_delete", "not_a_method"):
        assert registry.labelled(name) == name
