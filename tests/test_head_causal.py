"""The per-head causal test (probe.study.heads_causal, ``metrics: heads_causal``): each head's attention row
against the knockout effect of its own edges, one unit per head.

The oracle never touches probe's hooks: the attention row is a plain transformers eager forward's
``output_attentions``; the knockout effect of the edge [CLS] -> t in head h is a second eager forward
whose additive attention mask holds -inf at (h, 0, t) in that layer alone (renormalised knockout: the
softmax leaves the key out); the agreement is scipy's Kendall tau-b, the noise floor the one the
verdict states (16 x eps x the target's scale). Also: asking for nothing changes nothing, the study
file's syntax, and the planted truths (probe.models.planted: sink-head, edge-head).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import torch

from probe.errors import InputError
from probe.spec.study import study_from_dict
from probe.study.runner import run_study

from tolerances import fp_tol

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import write_dataset  # noqa: E402


def _study(model, data: Path, out: Path, *, explainers=("attention_mean",), heads_causal=True, measure="kendall_tau",
           n: int = 12, **metrics) -> dict:
    return {
        "name": "head-causal", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": n, "seed": 1},
        "explainers": list(explainers), "references": ["loo_delete"],
        "metrics": {"top_k": [1, 3], "erasure": None, "counterfactual": None, "heads": None,
                    "sanity": {"randomisation": False}, "heads_causal": heads_causal, **metrics},
        "statistics": {"bootstrap": 200, "measure": measure}, "engine": {"batch_size": 5}, "output": str(out)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("head-causal") / "data.csv", n=24)


# ----------------------------------------------------------------------------- the oracle


@torch.no_grad()
def _by_hand(folder: Path, text: str, label: int, layer: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """``(attention [tokens], knockout [tokens])`` of head ``head`` of layer ``layer`` from the [CLS] row,
    by plain eager forwards of the tiny BERT classifier (the target: the label's probability)."""
    import transformers

    model = _eager(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok(text)["input_ids"]])  # [1, seq]
    out = model(input_ids=ids, output_attentions=True)
    attention = out.attentions[layer][0, head, 0].double().numpy()  # [key]
    p = float(out.logits.double().softmax(-1)[0, label])
    n = ids.shape[1]
    module = model.bert.encoder.layer[layer].attention.self
    effects = np.full(n, np.nan)
    for t in range(1, n - 1):  # [CLS] and [SEP] are not scored
        mask = torch.zeros(1, module.config.num_attention_heads, n, n)  # [1, head, query, key] additive
        mask[0, head, 0, t] = float("-inf")

        def pre(mod, args, kwargs, mask=mask):
            kwargs["attention_mask"] = mask
            return args, kwargs

        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            knocked = float(model(input_ids=ids).logits.double().softmax(-1)[0, label])
        finally:
            handle.remove()
        effects[t] = p - knocked
    return attention, effects


def _separated(got: np.ndarray, oracle: np.ndarray) -> bool:
    """Whether every two of the oracle's values lie further apart than twice the largest |probe - oracle|."""
    gap = np.abs(oracle[:, None] - oracle[None, :])[np.triu_indices(len(oracle), 1)]
    return bool((gap > 2 * np.abs(got - oracle).max()).all())


_EAGER: dict = {}


def _eager(folder: Path):
    if folder not in _EAGER:
        import transformers

        _EAGER[folder] = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, attn_implementation="eager").eval()
    return _EAGER[folder]


# ----------------------------------------------------------------------------- the unit's numbers


@pytest.mark.parametrize("with_attention", [False, True])
def test_each_head_unit_equals_a_by_hand_computation(tiny_dirs, data, tmp_path, with_attention):
    """Per head: the stored attention row and knockout effects equal the eager oracle's, and the unit's
    n and mean Kendall tau equal scipy's over the examples above the noise floor; its CI holds the mean
    and its answer follows its family-wise p-value. With ``attention`` among the explainers its scores
    are reused; without, the test reads them itself: the same numbers."""
    folder = tiny_dirs["bert"]
    explainers = ["attention", "attention_mean"] if with_attention else ["attention_mean"]
    run = run_study(study_from_dict(_study(folder, data, tmp_path / "out", explainers=explainers)), progress=False,
                    log=lambda text: None)
    out = tmp_path / "out"
    edges = pd.read_parquet(out / "head_edges.parquet")
    units = pd.read_parquet(out / "heads_causal.parquet")
    examples = pd.read_parquet(out / "examples.parquet")
    record = run.verdict.heads_causal
    assert record is not None and record["measure"] == "kendall_tau" and record["counts"]["total"] == 8 == len(units)
    eps = float(np.finfo(np.float32).eps)
    scale = max(float(examples.target_value.abs().median()), 0.0)
    taus: dict[tuple[int, int], list[float]] = {}
    worst, decided = 0.0, 0
    for e in examples.itertuples():
        for layer in range(2):
            for head in range(4):
                attention, effects = _by_hand(folder, e.text, int(e.target_label), layer, head)
                stored = edges[(edges.example == e.example) & (edges.layer == layer) & (edges["head"] == head)]
                stored = stored.sort_values("position")
                np.testing.assert_allclose(stored.attention.to_numpy(), attention, atol=fp_tol(1.0, depth=3), rtol=0)
                # a difference of two probabilities: bounded by 1, after a forward of 2 layers (+ embeddings, head)
                np.testing.assert_allclose(stored.knockout.to_numpy(), effects, atol=fp_tol(1.0, depth=4), rtol=0,
                                           equal_nan=True)
                keep = np.isfinite(effects)
                got_x, got_y = stored.attention.to_numpy()[keep], stored.knockout.to_numpy()[keep]
                x, y = attention[keep], effects[keep]
                worst = max(worst, float(np.abs(got_y - y).max()))
                floor = 16 * eps * max(abs(float(e.target_value)), scale)
                if np.abs(y).max() <= floor:
                    continue
                # the oracle's ranking is probe's wherever no two values lie closer than twice their largest
                # difference (then no rounding can swap them); where two do (effects of ~1e-8 at the float32
                # resolution of the target), the ranking is rounding, and scipy ranks probe's stored values
                sure = all(_separated(mine, theirs) for mine, theirs in ((got_x, x), (got_y, y)))
                decided += sure
                taus.setdefault((layer, head), []).append(
                    scipy.stats.kendalltau(*((x, y) if sure else (got_x, got_y))).statistic)
    print(f"largest |probe - oracle| knockout effect: {worst:.3g}; oracle rankings used on {decided} of "
          f"{sum(map(len, taus.values()))} example-heads")
    assert decided >= 0.5 * sum(map(len, taus.values()))
    for r in units.itertuples():
        mine = taus.get((r.layer, r.head), [])
        assert r.n == len(mine), r.unit
        assert r.mean == pytest.approx(float(np.mean(mine)), abs=1e-9), r.unit
        assert r.ci_low <= r.mean <= r.ci_high
        assert r.p_family >= r.p_chance
        assert r.answer == ("matters" if r.p_family <= 0.05 else "does not matter"), r.unit
    assert sum(units.answer == "matters") == record["counts"]["matters"]


def test_asking_for_nothing_changes_nothing(tiny_dirs, data, tmp_path):
    """Without ``metrics.heads_causal`` the study's fingerprint, verdict, summary and unit tests are
    those of the same study with it, less the per-head test (which the report shows only when asked)."""
    from probe.report.build import build_report

    folder = tiny_dirs["bert"]
    plain = study_from_dict(_study(folder, data, tmp_path / "plain", explainers=["attention"], heads_causal=None))
    asked = study_from_dict(_study(folder, data, tmp_path / "asked", explainers=["attention"]))
    payload = plain.model_dump(mode="json", exclude={"output", "description"})
    assert payload["metrics"].pop("heads_causal") is None  # a new key, left out of the fingerprint when unset
    assert asked.fingerprint() != plain.fingerprint()
    for study in (plain, asked):
        run_study(study, progress=False, log=lambda text: None)
    a, b = tmp_path / "plain", tmp_path / "asked"
    left, right = json.loads((a / "verdict.json").read_text()), json.loads((b / "verdict.json").read_text())
    assert "heads_causal" not in left and "heads_causal" in right
    right.pop("heads_causal")
    assert left == right
    for name in ("summary", "paired", "chance", "agreement", "scores"):
        pd.testing.assert_frame_equal(pd.read_parquet(a / f"{name}.parquet"), pd.read_parquet(b / f"{name}.parquet"))
    assert not (a / "heads_causal.parquet").exists() and not (a / "head_edges.parquet").exists()
    build_report(a)
    assert "Per-head causal test" not in (a / "report" / "report.md").read_text()
    build_report(b)
    text = (b / "report" / "report.md").read_text()
    assert "Per-head causal test" in text and "what matters through this head" in text


def test_the_study_file_asks_for_it_in_one_line(tiny_dirs, data, tmp_path):
    base = _study("builtin:minilm-rt", Path("x.csv"), tmp_path, heads_causal=None)
    base["dataset"]["name"] = "builtin:rotten_tomatoes"

    def metrics(value):
        return study_from_dict({**base, "metrics": {"heads_causal": value}}).metrics.heads_causal

    assert metrics(None) is None and metrics(False) is None
    on = metrics(True)
    assert (on.layers, on.heads, on.renormalise, on.absolute) == ("all", "all", True, False)
    chosen = metrics({"layers": ["last", 0], "heads": 2, "renormalise": False})
    assert chosen.layers == ["last", 0] and chosen.heads == [2] and not chosen.renormalise
    for bad, words in (({"heads": [-1]}, "head -1 is not a head index"), ({"layers": [-2]}, "layer -2 is negative"),
                       ({"renormalize": True}, "renormalize")):
        with pytest.raises(InputError, match=words) as err:
            metrics(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="ranks tokens .* not spans"):
        study_from_dict({**base, "metrics": {"heads_causal": True}, "spans": {"pattern": r"\w+"}})
    study = study_from_dict(_study(tiny_dirs["bert"], data, tmp_path / "out", heads_causal={"heads": [7]}))
    with pytest.raises(InputError, match=r"^metrics.heads_causal: head 7 does not exist: the model has query heads "
                                         r"0..3"):
        run_study(study, progress=False, log=lambda text: None)


# ----------------------------------------------------------------------------- planted truths


@pytest.mark.parametrize("name", ["sink-head", "edge-head"])
def test_the_planted_heads_get_their_planted_answers(name, tmp_path):
    """sink-head: the head looks at yy (zero value), the decision passes through its least attended
    edge (zz): "not what matters". edge-head: the head looks at zz and that edge carries the decision:
    "what matters". Each at the study's own measure (auto) and with Kendall's tau for sink-head; the
    token-level verdict gets its planted answer beside it."""
    from probe.models.planted import PLANTED_MODELS

    recipe = PLANTED_MODELS[name]
    assert not recipe.self_test and recipe.head_answers
    spec = {"name": f"hc-{name}", "model": {"id": f"planted:{name}"}, "dataset": {"name": f"planted:{name}", "n": 64},
            "target": {"kind": "prob"}, "explainers": ["attention", "attention_mean"], "references": ["loo_delete"],
            "metrics": {"top_k": [1, 2, 3], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"examples": 8}, "heads_causal": True},
            "statistics": {"bootstrap": 500, "measure": "auto"}, "output": str(tmp_path / "auto")}
    measures = ["auto"] + (["kendall_tau"] if name == "sink-head" else [])
    for measure in measures:
        spec["statistics"]["measure"] = measure
        spec["output"] = str(tmp_path / measure)
        v = run_study(study_from_dict(spec), progress=False, log=lambda text: None).verdict
        units = {u["unit"]: u for u in v.heads_causal["units"]}
        print(name, measure, v.heads_causal["headline"])
        for unit, answer in recipe.head_answers:
            assert units[unit]["answer"] == answer, (measure, units[unit])
            assert units[unit]["n"] == 64
        assert v.answer in recipe.expected, v.headline
    edges = pd.read_parquet(tmp_path / "auto" / "head_edges.parquet")
    examples = pd.read_parquet(tmp_path / "auto" / "examples.parquet").set_index("example")
    tokens = pd.read_parquet(tmp_path / "auto" / "tokens.parquet")
    merged = edges.merge(tokens[["example", "position", "token"]], on=["example", "position"])
    trigger = merged[merged.token == "zz"]
    assert (trigger.knockout > 0.3).all()  # the decision passes through the edge to zz
    if name == "sink-head":
        sink = merged[merged.token == "yy"]
        assert (sink.attention > 0.6).all() and (sink.knockout < 0).all()  # renormalised: the freed mass moves to zz
        assert (trigger.attention < 0.02).all()
    else:
        assert (trigger.attention > 0.9).all()
    assert len(examples) == 64


def test_zeroing_the_sink_edge_moves_nothing(tmp_path):
    """sink-head with the blocked weight zeroed (not renormalised): yy's value is zero, so its edge's
    knockout effect is 0 up to rounding while the head puts most of its row on it."""
    spec = {"name": "hc-zeroed", "model": {"id": "planted:sink-head"},
            "dataset": {"name": "planted:sink-head", "n": 16},
            "target": {"kind": "prob"}, "explainers": ["attention_mean"], "references": ["loo_delete"],
            "metrics": {"top_k": [1, 2], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"randomisation": False}, "heads_causal": {"renormalise": False}},
            "statistics": {"bootstrap": 200}, "output": str(tmp_path / "out")}
    run_study(study_from_dict(spec), progress=False, log=lambda text: None)
    edges = pd.read_parquet(tmp_path / "out" / "head_edges.parquet")
    tokens = pd.read_parquet(tmp_path / "out" / "tokens.parquet")
    sink = edges.merge(tokens[tokens.token == "yy"][["example", "position"]], on=["example", "position"])
    assert len(sink) == 16 and (sink.attention > 0.6).all()
    assert sink.knockout.abs().max() <= fp_tol(1.0, depth=3)  # a probability difference: scale 1


# ----------------------------------------------------------------------------- a real built-in


@pytest.mark.slow
def test_the_unit_on_the_smollm2_builtin_equals_a_by_hand_computation(builtin_cache, tmp_path):
    """SmolLM2-135M (Llama, GQA 9 query / 3 kv heads), sdpa in probe: two layers x two heads on two
    prompts explaining ' Paris' (the last prompt row): the stored attention rows and knockout effects
    equal an eager forward's and a masked eager forward's, and each unit's mean Kendall tau scipy's."""
    import transformers

    from probe.models.loading import load_model

    texts = ["The capital of France is", "Paris is the capital city of"]
    data = tmp_path / "data.csv"
    pd.DataFrame({"text": texts, "label": [0, 0]}).to_csv(data, index=False)
    pm = load_model("builtin:smollm2-135m", cache_dir=str(builtin_cache))
    spec = {"name": "hc-smollm2", "model": {"id": "builtin:smollm2-135m"}, "dataset": {"name": str(data)},
            "target": {"continuation": " Paris"}, "explainers": ["attention_mean"], "references": ["loo_delete"],
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None,
                        "sanity": {"examples": 1, "randomisation": False},
                        "heads_causal": {"layers": [1, 20], "heads": [0, 4]}},
            "statistics": {"bootstrap": 100, "measure": "kendall_tau"}, "output": str(tmp_path / "out")}
    run_study(study_from_dict(spec), progress=False, log=lambda text: None)
    out = tmp_path / "out"
    edges = pd.read_parquet(out / "head_edges.parquet")
    units = pd.read_parquet(out / "heads_causal.parquet")
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert sorted(zip(units.layer, units["head"])) == [(1, 0), (1, 4), (20, 0), (20, 4)]
    assert (units.answer == "undecidable").all()  # two examples: fewer than the stated minimum
    model = transformers.AutoModelForCausalLM.from_pretrained(pm.path, attn_implementation="eager").eval()
    paris = 7042  # ' Paris' is one token of SmolLM2's vocabulary
    taus: dict = {}
    for example, part in tokens.groupby("example"):
        ids = torch.tensor([part.sort_values("position").token_id.tolist()])  # [1, seq]: probe's tokens
        n = ids.shape[1]
        with torch.no_grad():
            out_eager = model(input_ids=ids, output_attentions=True)
        target = float(out_eager.logits[0, -1].double().log_softmax(-1)[paris])
        for layer, head in [(1, 0), (1, 4), (20, 0), (20, 4)]:
            attention = out_eager.attentions[layer][0, head, n - 1].double().numpy()  # [key] the last prompt row
            effects = np.full(n, np.nan)
            module = model.model.layers[layer].self_attn
            for t in range(n):
                def pre(mod, args, kwargs, t=t, n=n, head=head):
                    mask = kwargs.get("attention_mask")
                    base = torch.triu(torch.full((n, n), float("-inf")), 1)[None, None] if mask is None else mask
                    mask = base[..., :n].expand(1, model.config.num_attention_heads, n, n).clone()
                    mask[0, head, n - 1, t] = float("-inf")
                    kwargs["attention_mask"] = mask
                    return args, kwargs

                handle = module.register_forward_pre_hook(pre, with_kwargs=True)
                try:
                    with torch.no_grad():
                        knocked = float(model(input_ids=ids).logits[0, -1].double().log_softmax(-1)[paris])
                finally:
                    handle.remove()
                effects[t] = target - knocked
            stored = edges[(edges.example == example) & (edges.layer == layer) & (edges["head"] == head)]
            stored = stored.sort_values("position")
            depth = 2 * (30 + 2)
            np.testing.assert_allclose(stored.attention.to_numpy(), attention, atol=fp_tol(1.0, depth=depth), rtol=0)
            np.testing.assert_allclose(stored.knockout.to_numpy(), effects, atol=fp_tol(abs(target), depth=depth),
                                       rtol=0)
            got_x, got_y = stored.attention.to_numpy(), stored.knockout.to_numpy()
            sure = _separated(got_x, attention) and _separated(got_y, effects)
            taus.setdefault((layer, head), []).append(
                scipy.stats.kendalltau(*((attention, effects) if sure else (got_x, got_y))).statistic)
    for r in units.itertuples():
        assert r.n == len(taus[(r.layer, r.head)])
        assert r.mean == pytest.approx(float(np.mean(taus[(r.layer, r.head)])), abs=1e-9), r.unit
