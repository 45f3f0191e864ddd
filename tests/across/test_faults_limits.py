"""Limits of work and of input (issue 62, reliability round 5).

Every method parameter that multiplies work has a range declared once, in its parameter class
(:mod:`probe.registry.params`): the file check and the run-time check read it, so a study file past a
limit is refused in one line naming the file, the line, the key and the real range, before any
model loads, and the implementation refuses the same value with the same sentence. Sampled Shapley
values of a long example are bounded in rows; a control character in a study or claim file is one
line naming where it is; an edge set names an example of its batch and at least one head; an edge
claim's bad head names the key, not pydantic's union branch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

import probe
from probe import registry
from probe.errors import InputError
from probe.registry.params import (
    SHAPLEY_EXACT_LIMIT,
    SHAPLEY_PERMUTATIONS_LIMIT,
    AdversarialParams,
    ShapleyParams,
    check_params,
    declared_limits,
)

from test_faults import _cli, _one_line

STUDY = {"name": "limits", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:rotten_tomatoes", "n": 4},
         "explainers": ["attention_mean"]}

#: (method, its params in the file, the key refused, what the message states)
PAST_THE_LIMIT = [
    ("shapley", {"exact_max": 0, "permutations": 1_000_000}, "permutations", f"give 2..{SHAPLEY_PERMUTATIONS_LIMIT}"),
    ("shapley", {"exact_max": 17}, "exact_max", f"give 0..{SHAPLEY_EXACT_LIMIT}"),
    ("shapley", {"permutations": 0}, "permutations", "give 2.."),
    ("shapley", {"permutations": 1}, "permutations", "give 2.."),
    ("shapley", {"mode": "random"}, "mode", "give one of delete, mask, unk, pad"),
    ("shapley", {"units": "sentence"}, "units", "give one of token, word"),
    ("knockout", {"query": "all"}, "query", "give one of target, from"),
    ("knockout", {"batch_size": 0}, "batch_size", "give 1..4096"),
    ("integrated_gradients", {"steps": 1_000_000}, "steps", "give 1..1024"),
    ("gradient_shap", {"n_samples": 100_000}, "n_samples", "give 1..1024"),
    ("loo_random", {"k": 10_000}, "k", "give 1..256"),
    ("flow", {"max_tokens": 100_000}, "max_tokens", "give 1..256"),
    ("integrated_gradients", {"rule": "simpson"}, "rule", "give one of gausslegendre, riemann_trapezoid"),
    ("gradient_shap", {"baseline": ["pad", "blank"]}, "baseline", "give one of pad, zero, mask, unk"),
]


def _study_file(tmp_path, method, params):
    study = {**STUDY, "references": [method] if method not in ("flow",) else ["loo_delete"],
             "explainers": ["attention_mean"] + (["flow"] if method == "flow" else []),
             "params": {method: params}}
    path = tmp_path / "study.yaml"
    text = yaml.safe_dump(study, sort_keys=False)
    path.write_text(text)
    return path, text


def _line(text: str, key: str) -> int:
    """The line of ``key`` under ``params:`` in a written study."""
    lines = text.splitlines()
    start = lines.index("params:")
    return next(i for i in range(start, len(lines)) if lines[i].strip().startswith(f"{key}:")) + 1


@pytest.mark.parametrize("method, params, key, states", PAST_THE_LIMIT)
def test_a_parameter_past_its_declared_limit_is_refused_by_the_file_check_with_its_line(tmp_path, method, params,
                                                                                        key, states):
    path, text = _study_file(tmp_path, method, params)
    with pytest.raises(InputError) as info:
        probe.load_study(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path} line {_line(text, key)}: params.{method}.{key}: "), message
    assert states in message


@pytest.mark.parametrize("method, params, key, states", PAST_THE_LIMIT)
def test_the_run_time_check_says_what_the_file_check_says(method, params, key, states):
    entry = registry.method(method)
    bad, sentence = registry.params_problem(method, params)
    assert bad == key
    with pytest.raises(InputError) as info:
        check_params(entry.params, method, **params)
    assert str(info.value) == sentence


def test_the_largest_declared_values_are_accepted_and_one_more_is_not():
    for entry in registry.methods(listed=False):
        for key, (_, high) in ((k, declared_limits(entry.params, k)) for k in registry.param_fields(entry)
                                 if declared_limits(entry.params, k) is not None and k not in dict(entry.preset)):
            field_type = {f.name: str(f.type) for f in dataclasses.fields(entry.params)}[key]
            if "int" not in field_type:
                continue
            assert registry.params_problem(entry.name, {key: high}) is None, (entry.name, key)
            assert registry.params_problem(entry.name, {key: high + 1})[0] == key, (entry.name, key)


def test_shapley_refuses_its_limits_at_run_time_with_the_declared_sentence(tiny_dirs):
    from probe.intervene.engine import Engine
    from probe.intervene.shapley import shapley
    from probe.rows.prepare import prepare

    pm = probe.load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the movie was good"])
    for bad in ({"exact_max": SHAPLEY_EXACT_LIMIT + 1}, {"permutations": SHAPLEY_PERMUTATIONS_LIMIT + 1},
                {"permutations": 1}, {"mode": "random"}):
        _, sentence = registry.params_problem("shapley", bad)
        with pytest.raises(InputError) as info:
            shapley(Engine(pm), examples, **bad)
        assert str(info.value) == sentence


def test_the_cli_refuses_a_shapley_bomb_in_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import probe.models.loading as loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the file was checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    path, text = _study_file(tmp_path, "shapley", {"exact_max": 0, "permutations": 1_000_000})
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert code == 2
    _one_line(err, f"line {_line(text, 'permutations')}: params.shapley.permutations", "give 2..1024")


def test_the_study_and_claim_files_take_the_counterfactual_limits_from_the_declaration(tmp_path):
    from probe.claims.kinds.counterfactual import CounterfactualClaim
    from probe.spec.study import CounterfactualSpec

    high = declared_limits(AdversarialParams, "candidates")[1]
    assert CounterfactualSpec(adversarial_candidates=high).adversarial_candidates == high
    with pytest.raises(Exception, match="less than or equal to 64"):
        CounterfactualSpec(adversarial_candidates=high + 1)
    with pytest.raises(Exception, match="less than or equal to 64"):
        CounterfactualClaim(claim="x", kind="counterfactual", candidates=high + 1)
    study = {**STUDY, "references": ["loo_delete"], "metrics": {"counterfactual": {"adversarial_candidates": 1000}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    with pytest.raises(InputError, match=r"line \d+: metrics.counterfactual.adversarial_candidates: 1000 is out of "
                                         r"range; give a value <= 64"):
        probe.load_study(path)


# ------------------------------------------------------------------ 1. sampled Shapley values are bounded


def test_the_sampled_plan_walks_each_order_prefix_by_prefix():
    """The plan kept as packed keys: each order's prefix k is the coalition of its first k players,
    and the coalitions are distinct (46 players, the largest number of orders)."""
    from probe.intervene.shapley import sampled_plan

    n = 46
    coalitions, prefixes, orders = sampled_plan(n, SHAPLEY_PERMUTATIONS_LIMIT, np.random.default_rng(0))
    assert orders.shape == (SHAPLEY_PERMUTATIONS_LIMIT, n) and prefixes.shape == (SHAPLEY_PERMUTATIONS_LIMIT, n + 1)
    assert len(np.unique(coalitions, axis=0)) == len(coalitions)
    for o in (0, 1, 517, SHAPLEY_PERMUTATIONS_LIMIT - 1):
        for k in (0, 1, 20, n):
            expected = np.zeros(n, dtype=bool)
            expected[orders[o, :k]] = True
            assert (coalitions[prefixes[o, k]] == expected).all()
    assert (orders[1] == orders[0][::-1]).all()  # antithetic pairs


def test_a_long_example_takes_fewer_orders_within_the_row_limit(tiny_dirs, monkeypatch):
    """An example's sampled rows stay within SHAPLEY_ROW_LIMIT however many players it has: fewer
    orders (its extras say how many), the values still efficient."""
    import probe.intervene.shapley as shapley_module
    from probe.intervene.engine import Engine
    from probe.rows.prepare import prepare

    monkeypatch.setattr(shapley_module, "SHAPLEY_ROW_LIMIT", 60)
    pm = probe.load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["i hated this film , it was boring and too long", "a great story"])
    out = shapley_module.shapley(Engine(pm), examples, "pad", exact_max=0, permutations=64, seed=0)
    players = out.extras["players"]
    assert players[0] >= 10
    assert out.extras["permutations"][0] == 2 * ((60 // (players[0] + 1)) // 2) < 64
    assert out.extras["coalitions"][0] <= 60
    assert out.extras["permutations"][1] == 2 * ((60 // (players[1] + 1)) // 2)
    assert all(abs(d) < 1e-4 for d in out.extras["efficiency_delta"])
    assert out.params["permutations"] == 64  # what was asked; the extras say what ran


def test_the_declared_limits_are_the_ones_the_docs_state():
    assert ShapleyParams().permutations == 64 and declared_limits(ShapleyParams, "permutations") == (2, 1024)


# ------------------------------------------------------------------ 2. control characters in a file


@pytest.mark.parametrize("char", ["\x1b", "\x00"])
def test_a_control_character_in_a_study_file_is_one_line_with_its_line_and_column(tmp_path, monkeypatch, capsys, char):
    path = tmp_path / "study.yaml"
    path.write_text(f"name: cc\ndescription: a {char}[31m red study\nmodel: {{id: builtin:minilm-rt}}\n",
                    encoding="utf-8")
    with pytest.raises(InputError) as info:
        probe.load_study(path)
    code = f"U+{ord(char):04X}"
    escape = f"\\x{ord(char):02x}"
    assert str(info.value) == (f"{path} line 2 column 16: the control character {code} is not allowed in a YAML "
                               f"file; remove it, or write it as an escape inside double quotes (\"{escape}\")")
    exit_code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress")
    assert exit_code == 2
    _one_line(err, "line 2 column 16", code)


def test_a_control_character_in_an_edge_claims_to_is_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "claims.yaml"
    path.write_text("model: {id: builtin:smollm2-135m}\ndata: {texts: [the movie was good]}\nclaims:\n"
                    "  - claim: the subject matters\n    kind: edge\n    layers: 1\n    to: mov\x00ie\n",
                    encoding="utf-8")
    with pytest.raises(InputError, match=r"claims\.yaml line 7 column 12: the control character U\+0000"):
        probe.load_claims(path)
    code, _, err = _cli(monkeypatch, capsys, "audit", path, "--no-progress")
    assert code == 2
    _one_line(err, "line 7 column 12")


# ------------------------------------------------------------------ 4. edge sets are checked


@pytest.mark.parametrize("example, sites, states", [
    (3, ((0, 0),), "give an example index 0..0 of the 1 examples given"),
    (-1, ((0, 0),), "give an example index 0..0"),
    (0, (), "names no (layer, head)"),
])
def test_an_edge_set_names_an_example_of_the_batch_and_a_head(tiny_dirs, example, sites, states):
    from probe.intervene.knockout import EdgeSet, block_edges
    from probe.rows.prepare import prepare

    pm = probe.load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the movie was good"])
    with pytest.raises(InputError) as info:
        block_edges(pm, examples, [EdgeSet(example=example, keys=(1,), sites=sites)])
    assert "\n" not in str(info.value) and states in str(info.value)


# ------------------------------------------------------------------ 5. an edge claim's heads


@pytest.mark.parametrize("heads, line, states", [("-1", 7, "-1 is not a head index"),
                                                  ("[0, -2]", 7, "-2 is not a head index"),
                                                  ("x", 7, "'x' is not a head index")])
def test_an_edge_claims_bad_head_names_the_key_not_the_union_branch(tmp_path, heads, line, states):
    path = tmp_path / "claims.yaml"
    path.write_text("model: {id: builtin:smollm2-135m}\ndata: {texts: [the movie was good]}\nclaims:\n"
                    f"  - claim: the subject matters\n    kind: edge\n    layers: 1\n    heads: {heads}\n"
                    "    to_words: [movie]\n", encoding="utf-8")
    with pytest.raises(InputError) as info:
        probe.load_claims(path)
    message = str(info.value)
    assert "constrained-int" not in message and "\n" not in message
    assert f"line {line}: claims[0].heads" in message and states in message, message


@pytest.mark.parametrize("fields, states", [
    ({"chat": "yes"}, "chat='yes': give True or False"),
    ({"steps": 1}, "steps=1: give True or False"),
    ({"bogus": 1}, "unknown TargetSpec field 'bogus'; its fields: kind, label"),
    ({"kind": 3}, "kind=3 is not text; give one of prob, logit"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 is not a positive whole number"),
    ({"dimension": -1}, "dimension=-1: give a component index >= 0"),
])
def test_a_target_spec_checks_its_own_fields_in_one_line(fields, states):
    with pytest.raises(InputError) as info:
        probe.TargetSpec(**fields)
    assert str(info.value).startswith(states) and "\n" not in str(info.value)
    assert probe.TargetSpec(chat=True, kind="logit").chat is True


def test_the_reliability_page_states_the_declared_ranges():
    """docs/reference/limits.md's table gives each parameter's range as its declaration does."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "limits.md").read_text()
    rows = re.findall(r"^\| `(\w+)\.(\w+)`[^|]*\| (-?\d+)\.\.(\d+) \|", page, flags=re.M)
    assert len(rows) >= 10
    seen = set()
    for method, key, low, high in rows:
        entry = registry.find(method) or registry.counterfactual(method)
        assert declared_limits(entry.params, key) == (int(low), int(high)), (method, key)
        seen.add((type(entry).__name__, entry.params, key))
    for entry in registry.methods(listed=False) + registry.COUNTERFACTUALS:
        for f in dataclasses.fields(entry.params):
            if "low" in f.metadata and f.name != "batch_size" and f.name != "token_budget":
                assert any(p is entry.params and k == f.name for _, p, k in seen), (entry.name, f.name)


@pytest.mark.parametrize("method, bad", [("loo_random", {"k": 257}), ("integrated_gradients", {"steps": 1025}),
                                         ("gradient_shap", {"n_samples": 1025}), ("permuted", {"n": 10_001}),
                                         ("adversarial", {"candidates": 65})])
def test_each_implementation_refuses_past_its_declaration_with_the_file_checks_sentence(tiny_dirs, method, bad):
    """A direct call of the implementation (no file, no probe.explain) is refused before any work,
    in the sentence the file check gives."""
    from probe.explainers.integrated_gradients import gradient_shap, integrated_gradients
    from probe.intervene.counterfactual import adversarial_attention, permuted_attention
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo
    from probe.rows.prepare import prepare

    pm = probe.load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the movie was good"])
    calls = {"loo_random": lambda: loo(Engine(pm), examples, "random", **bad),
             "integrated_gradients": lambda: integrated_gradients(pm, examples, **bad),
             "gradient_shap": lambda: gradient_shap(pm, examples, **bad),
             "permuted": lambda: permuted_attention(pm, examples, layer=0, **bad),
             "adversarial": lambda: adversarial_attention(pm, examples, layer=0, **bad)}
    entry = registry.find(method) or registry.counterfactual(method)
    (key, value), = bad.items()
    expected = registry.params_problem(method, bad)[1] if registry.find(method) else \
        f"{value!r} is out of range for {method}.{key}; give {declared_limits(entry.params, key)[0]}.."
    with pytest.raises(InputError) as info:
        calls[method]()
    assert str(info.value).startswith(expected), str(info.value)


# --------------------------------------------------------------------------------------------------
# layer and head indices against the model's size, before the model loads (issue 62, item 3)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama_gqa", "bart", "t5"])
def test_the_config_sizes_are_the_loaded_contracts_or_none(tiny_dirs, kind):
    from probe.models.loading import config_sizes

    pm = probe.load_model(str(tiny_dirs[kind]))
    sizes = config_sizes(str(tiny_dirs[kind]))
    if len(pm.contract.stacks) > 1:  # an encoder-decoder: the config cannot say which stack is meant
        assert sizes is None
        return
    info = pm.contract.stacks[pm.task.target_stack(pm.contract)]
    assert sizes == (info.n_layers, info.n_heads)  # GQA: query heads, as every layer and head index counts


def test_config_sizes_read_nothing_they_cannot_read_offline(tmp_path):
    from probe.models.loading import config_sizes

    assert config_sizes("someone/some-model") is None  # a hub id: nothing is downloaded to check
    assert config_sizes(str(tmp_path)) is None  # a folder without config.json
    assert config_sizes("builtin:no-such-model") is None


#: (the study's extra keys, the key path refused, what the message states); tiny llama: 2 layers, 4 query heads
OUT_OF_RANGE = [
    ({"references": ["knockout"], "params": {"knockout": {"layers": 9}}}, ("params", "knockout", "layers"),
     "layer 9 does not exist"),
    ({"references": ["knockout"], "params": {"knockout": {"heads": "0,7"}}}, ("params", "knockout", "heads"),
     "head 7 does not exist"),
    ({"references": ["knockout"], "params": {"knockout": {"layers": "5:9"}}}, ("params", "knockout", "layers"),
     "selects no layer"),
    # a good layer beside a bad head: the head's key is blamed, not the first key of the section
    ({"references": ["knockout"], "params": {"knockout": {"layers": 0, "heads": 9}}}, ("params", "knockout", "heads"),
     "head 9 does not exist"),
    ({"references": ["loo_delete"], "metrics": {"heads_causal": {"layers": [1], "heads": [0, 6]}}},
     ("metrics", "heads_causal", "heads"), "head 6 does not exist"),
    ({"references": ["loo_delete"], "metrics": {"heads_causal": {"layers": [0, 3]}}},
     ("metrics", "heads_causal", "layers"), "layer 3 does not exist"),
    ({"references": ["loo_delete"], "metrics": {"heads_causal": {"heads": [4]}}},
     ("metrics", "heads_causal", "heads"), "head 4 does not exist"),
    ({"references": ["loo_delete"], "metrics": {"counterfactual": {"layers": [2]}}},
     ("metrics", "counterfactual", "layers"), "counterfactual layer 2 does not exist"),
    ({"references": ["loo_delete"], "metrics": {"counterfactual": {"heads": [0, 5]}}},
     ("metrics", "counterfactual", "heads"), "counterfactual head 5 does not exist"),
]


@pytest.mark.parametrize("extra, keys, states", OUT_OF_RANGE)
def test_a_layer_or_head_the_model_lacks_is_refused_before_it_loads_with_file_line_and_key(
        tiny_dirs, tmp_path, monkeypatch, capsys, extra, keys, states):
    import probe.models.loading as loading
    from probe.spec.validation import line_of, read_yaml_mapping

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before its layers and heads were checked")

    study = {**STUDY, "model": {"id": str(tiny_dirs["llama_gqa"])},
             "dataset": {"name": "builtin:rotten_tomatoes", "n": 2}, **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    _, root = read_yaml_mapping(path, "study file", "study", "", "")
    monkeypatch.setattr(loading, "load_model", no_load)
    code, _, err = _cli(monkeypatch, capsys, "run", path, "--no-progress", "--out", tmp_path / "out")
    assert code == 2
    _one_line(err, f"{path} line {line_of(root, keys)}: {'.'.join(keys)}: ", states)
    assert not (tmp_path / "out").exists()  # nothing written
    with pytest.raises(InputError) as info:  # the Python API says the same
        probe.run_study(path, out=tmp_path / "out")
    assert f"line {line_of(root, keys)}: {'.'.join(keys)}: " in str(info.value)


def test_the_runner_refuses_without_a_file_and_lets_a_loaded_model_through(tiny_dirs, tmp_path, monkeypatch):
    import probe.models.loading as loading
    from probe.spec.study import study_from_dict

    study = study_from_dict({**STUDY, "model": {"id": str(tiny_dirs["llama_gqa"])}, "references": ["knockout"],
                             "params": {"knockout": {"heads": 6}}, "output": str(tmp_path / "out")})
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(InputError, match=r"^the study: params\.knockout\.heads: head 6 does not exist"):
        probe.run_study(study)


# --------------------------------------------------------------------------------------------------
# a large user file: the draw reads the length of the examples it draws only (issue 62, item 6)


def _user_csv(path, texts):
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([t, i % 2] for i, t in enumerate(texts))
    return path


def _counting_tokenizer(pm, seen: list):
    real = pm.tokenizer

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, texts, *args, **kwargs):
            seen.extend([texts] if isinstance(texts, str) else texts)
            return real(texts, *args, **kwargs)

    return dataclasses.replace(pm, tokenizer=Counting())


def test_a_user_file_draw_tokenises_the_drawn_examples_only_and_draws_as_before(tiny_dirs, tmp_path):
    from probe.data import load_dataset, take
    from probe.spec.study import study_from_dict
    from probe.study.examples import select_examples

    texts = [f"the film number {i} was good" for i in range(5000)]
    path = _user_csv(tmp_path / "big.csv", texts)
    pm = probe.load_model(str(tiny_dirs["bert"]))
    seen: list = []
    study = study_from_dict({**STUDY, "model": {"id": str(tiny_dirs["bert"])}, "references": ["loo_delete"],
                             "dataset": {"name": str(path), "n": 7, "seed": 3}})
    chosen, dropped = select_examples(_counting_tokenizer(pm, seen), study.dataset, study.target)
    every = load_dataset(str(path))
    assert [e.id for e in chosen] == [e.id for e in take(list(every), 7, 3, str(path))]  # the draw every fit gives
    assert len(seen) <= 16 and dropped == {"filters": 0, "too_long": 0}  # one part of the order, not 5000 texts


def test_a_drawn_example_too_long_is_passed_over_and_a_huge_cell_never_tokenised(tiny_dirs, tmp_path):
    from probe.spec.study import study_from_dict
    from probe.study.examples import select_examples

    huge = "good " * 2_000_000  # 10 MB
    texts = [huge if i % 3 == 0 else f"short review {i}" for i in range(60)]
    path = _user_csv(tmp_path / "cells.csv", texts)
    pm = probe.load_model(str(tiny_dirs["bert"]))
    seen: list = []
    study = study_from_dict({**STUDY, "model": {"id": str(tiny_dirs["bert"])}, "references": ["loo_delete"],
                             "dataset": {"name": str(path), "n": 30, "max_length": 32}})
    chosen, dropped = select_examples(_counting_tokenizer(pm, seen), study.dataset, study.target)
    assert len(chosen) == 30 and all(e.text != huge for e in chosen)
    assert dropped["too_long"] > 0 and max(map(len, seen)) < 100  # passed over without tokenising them
    study = study_from_dict({**STUDY, "model": {"id": str(tiny_dirs["bert"])}, "references": ["loo_delete"],
                             "dataset": {"name": str(path), "n": 41, "max_length": 32}})
    with pytest.raises(InputError, match=r"n=41 is larger than the 40 examples .* left after the filters and the "
                                         r"length limit; give n <= 40"):
        select_examples(pm, study.dataset, study.target)


def test_a_bad_row_past_the_drawn_ones_is_still_refused_in_one_line(tmp_path):
    from probe.data import scan_dataset

    path = _user_csv(tmp_path / "late.csv", [f"review {i}" for i in range(3000)] + ["   "])
    with pytest.raises(InputError, match=r"row 3000 .* has an empty 'text'; every example needs text"):
        scan_dataset(str(path)).take(4, 0)
