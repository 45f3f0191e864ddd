"""The per-head causal test's AtP screen (probe.study.head_screen, ``metrics.heads_causal.screen``).

Oracles: the miss-rate bound equals scipy's beta quantile; the
knockout run on a screen's pairs equals the full per-head run on those pairs; a screen that keeps every
head changes no number of the test; on planted:one-head the wired head is kept on every example and
matters, with the audit's bound stated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from probe.spec.study import study_from_dict
from probe.study.head_screen import choose_heads, head_scores
from probe.study.heads_causal import AUDIT, KEPT, SCREENED, screen_record, upper_bound
from probe.study.runner import run_study

sys.path.insert(0, str(Path(__file__).parent))
from test_runner import write_dataset  # noqa: E402

BASE = {"name": "s", "model": {"id": "builtin:minilm-rt"}, "dataset": {"name": "builtin:rotten_tomatoes"},
        "explainers": ["attention"], "references": ["loo_delete"]}


def test_a_head_is_scored_by_its_largest_estimated_effect():
    estimates = np.array([[0.1, -0.7, np.nan], [0.2, 0.3, 0.0], [np.nan, np.nan, np.nan]])
    assert head_scores(estimates).tolist() == [0.7, 0.3, 0.0]


def test_the_largest_bounds_are_kept_and_the_audit_is_drawn_from_the_rest():
    bounds = np.array([0.5, 3.0, 3.0, 0.1, 2.0, 0.0, np.nan, 1.0])
    labels = choose_heads(bounds, 3, 2, np.random.default_rng(1))
    assert list(np.flatnonzero(labels == KEPT)) == [1, 2, 4]
    audited = np.flatnonzero(labels == AUDIT)
    assert len(audited) == 2 and not set(audited) & {1, 2, 4}
    assert (labels == SCREENED).sum() == 3
    again = choose_heads(bounds, 3, 2, np.random.default_rng(1))
    assert (again == labels).all()
    assert (choose_heads(bounds, 20, 4, np.random.default_rng(0)) == KEPT).all()


@pytest.mark.parametrize(("misses", "audited"), [(0, 10), (1, 40), (3, 7), (0, 1)])
def test_the_miss_rate_bound_is_the_beta_quantile(misses, audited):
    from scipy.stats import beta

    assert upper_bound(misses, audited) == pytest.approx(beta.ppf(0.95, misses + 1, audited - misses), rel=1e-9)
    assert upper_bound(0, 0) == 1.0 and upper_bound(5, 5) == 1.0


def test_the_record_counts_the_audit_misses():
    """Two examples: the audited head of the first has an exact effect above a kept one's (a miss), the
    second's does not; the bound is the one-sided Clopper-Pearson bound on 1 of 2."""
    rows = []
    for example, sizes in ((0, {0: (KEPT, 0.5), 1: (KEPT, 0.2), 2: (AUDIT, 0.3), 3: (SCREENED, np.nan)}),
                           (1, {0: (KEPT, 0.5), 1: (KEPT, 0.4), 2: (AUDIT, 0.1), 3: (SCREENED, np.nan)})):
        for head, (label, size) in sizes.items():
            for position, share in enumerate((1.0, -0.5)):
                rows.append({"example": example, "layer": 0, "head": head, "position": position,
                             "attention": 0.5, "knockout": size * share, "atp": size * share * 0.9, "screen": label})
    study = study_from_dict({**BASE, "metrics": {"heads_causal": {"screen": {"heads": 2, "audit": 1}}}})
    record = screen_record(pd.DataFrame(rows), study)
    assert record["audit_compared"] == 2 and record["audit_missed"] == 1
    assert record["pairs_screened"] == 2 and record["pairs_kept"] == 4 and record["pairs_audited"] == 2
    assert record["miss_rate_bound"] == pytest.approx(upper_bound(1, 2))
    assert record["atp_spearman"] == pytest.approx(1.0)
    assert "1 had exact effects" in record["words"]


def test_the_study_file_asks_for_a_screen_and_the_fingerprint_keeps_old_studies():
    base = BASE
    plain = study_from_dict({**base, "metrics": {"heads_causal": True}})
    off = study_from_dict({**base, "metrics": {"heads_causal": {"screen": False}}})
    assert plain.metrics.heads_causal.screen is None and plain.fingerprint() == off.fingerprint()
    on = study_from_dict({**base, "metrics": {"heads_causal": {"screen": "atp"}}})
    assert on.metrics.heads_causal.screen.heads == 16 and on.fingerprint() != plain.fingerprint()
    from probe.errors import InputError

    with pytest.raises(InputError, match="heads"):
        study_from_dict({**base, "metrics": {"heads_causal": {"screen": {"heads": 0}}}})


# ----------------------------------------------------------------------------- on models


def test_knockout_on_chosen_pairs_equals_the_full_run_there(tiny_dirs):
    from probe.intervene.knockout import edge_knockout
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec

    pm = load_model(str(tiny_dirs["bert"]))
    examples = prepare(pm, ["the cat sat on the mat", "a dog ran far away today"], TargetSpec())
    full = edge_knockout(pm, examples, per_head=True)
    units = [{(0, 1), (1, 0)}, {(1, 1)}]
    part = edge_knockout(pm, examples, per_head=True, units=units)
    assert part.stats["rows_run"] < full.stats["rows_run"]
    for i, chosen in enumerate(units):
        got, want = part.per_head.scores[i], full.per_head.scores[i]
        for layer in range(got.shape[0]):
            for head in range(got.shape[1]):
                if (layer, head) in chosen:
                    torch.testing.assert_close(got[layer, head], want[layer, head], equal_nan=True)
                else:
                    assert torch.isnan(got[layer, head]).all()
        torch.testing.assert_close(part.tokens.scores[i], full.tokens.scores[i], equal_nan=True)


def _spec(model: str, data: str, out: Path, screen, *, n: int = 10, **heads_causal) -> dict:
    return {"name": "screen", "model": {"id": model}, "dataset": {"name": data, "n": n, "seed": 1},
            "explainers": ["attention_mean"], "references": ["loo_delete"],
            "metrics": {"top_k": [1], "erasure": None, "counterfactual": None, "heads": None, "interactions": False,
                        "sinks": False, "sanity": {"randomisation": False},
                        "heads_causal": {**heads_causal, "screen": screen}},
            "statistics": {"bootstrap": 100, "measure": "kendall_tau"}, "engine": {"batch_size": 4},
            "output": str(out)}


def test_a_screen_that_keeps_every_head_changes_no_number(tiny_dirs, tmp_path):
    data = str(write_dataset(tmp_path / "data.csv", n=10))
    model = str(tiny_dirs["bert"])
    plain = run_study(study_from_dict(_spec(model, data, tmp_path / "plain", None)), progress=False,
                      log=lambda text: None).verdict.heads_causal
    kept = run_study(study_from_dict(_spec(model, data, tmp_path / "kept", {"heads": 64, "audit": 0})),
                     progress=False, log=lambda text: None).verdict.heads_causal
    assert [u["answer"] for u in kept["units"]] == [u["answer"] for u in plain["units"]]
    assert [u["mean"] for u in kept["units"]] == [u["mean"] for u in plain["units"]]
    assert kept["screen"]["pairs_screened"] == 0 and "screen" not in plain
    edges = pd.read_parquet(tmp_path / "kept" / "head_edges.parquet")
    before = pd.read_parquet(tmp_path / "plain" / "head_edges.parquet")
    pd.testing.assert_frame_equal(edges.drop(columns=["atp", "screen"]), before)
    run = np.isfinite(edges["knockout"]) & np.isfinite(edges["atp"])
    assert np.corrcoef(edges.loc[run, "atp"], edges.loc[run, "knockout"])[0, 1] > 0.5


def test_a_screened_head_is_left_out_and_says_why(tiny_dirs, tmp_path):
    data = str(write_dataset(tmp_path / "data.csv", n=10))
    spec = _spec(str(tiny_dirs["bert"]), data, tmp_path / "out", {"heads": 1, "audit": 1})
    verdict = run_study(study_from_dict(spec), progress=False, log=lambda text: None).verdict.heads_causal
    edges = pd.read_parquet(tmp_path / "out" / "head_edges.parquet")
    pairs = edges.groupby(["example", "layer", "head"])["screen"].first()
    assert set(pairs.groupby("example").value_counts().unstack()[[KEPT, AUDIT]].stack()) == {1}
    assert edges.loc[edges.screen == SCREENED, "knockout"].isna().all()
    assert edges.loc[edges.screen != SCREENED, "atp"].notna().any()
    screen = verdict["screen"]
    assert screen["pairs_kept"] == 10 and screen["pairs_audited"] == 10
    assert screen["pairs_screened"] == len(pairs) - 20
    assert "AtP screen" in verdict["headline"]
    whys = [u.get("why", "") for u in verdict["units"] if u["answer"] == "undecidable"]
    assert any("AtP screen" in why for why in whys)
    from probe.report.build import build_report

    build_report(tmp_path / "out")
    text = (tmp_path / "out" / "report" / "report.md").read_text()
    assert "AtP screen" in text and "audited pairs" in text


@pytest.mark.slow
def test_the_planted_head_is_kept_on_every_example_and_matters(tmp_path):
    """planted:one-head (6 layers x 12 heads): L5.H7 puts over 90% of its row on zz, whose value carries
    the decision. With 6 of 72 heads kept per example and 6 audited, it is kept on every example and
    matters, no positional head of its layer does, and the audit bounds what the screen missed."""
    spec = _spec("planted:one-head", "planted:one-head", tmp_path / "out", {"heads": 6, "audit": 6}, n=24)
    spec["target"] = {"kind": "prob"}
    verdict = run_study(study_from_dict(spec), progress=False, log=lambda text: None).verdict.heads_causal
    print(verdict["headline"])
    edges = pd.read_parquet(tmp_path / "out" / "head_edges.parquet")
    planted = edges[(edges.layer == 5) & (edges["head"] == 7)]
    assert (planted.screen == KEPT).all() and planted.example.nunique() == 24
    units = {u["unit"]: u for u in verdict["units"]}
    assert units["attention L5.H7"]["answer"] == "matters"
    assert all(units[f"attention L5.H{h}"]["answer"] != "matters" for h in range(12) if h != 7)
    screen = verdict["screen"]
    assert screen["audit_compared"] == 24 * 6 and 0 <= screen["miss_rate_bound"] <= 1
