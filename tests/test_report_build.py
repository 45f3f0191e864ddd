"""Reports: ``probe report`` / ``probe compare`` render stored results (HTML, Markdown, CSV) without a model."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from probe.errors import InputError
from probe.names import FORMAT_VERSION
from probe.report.build import build_comparison, build_report
from probe.study.verdict import Verdict

from browser import headless_chromium
from figure_checks import legend_overlaps_axes, overlapping_texts, texts_outside_canvas

ALL_SECTIONS = ["verdict", "setup", "agreement", "frontier", "erasure", "counterfactual", "heads", "tokens",
                "limitations"]
INJECTED = "<script>alert(1)</script>"
WORDS = ["good", "bad", "great", "terrible", "movie", "film", "story", "boring", "fun", "the", "plot", "acting",
         "not", "very", "really", "awful", "excellent", "slow", "funny", "ending"]


def _dataset(path: Path, n: int = 12) -> Path:
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 9)))) for _ in range(n)]
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(n)]}).to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def result(tiny_dirs, tmp_path_factory) -> Path:
    """A finished tiny study with every table: 12 examples in 3 batches of 4."""
    from probe.spec.study import study_from_dict
    from probe.study.runner import run_study

    root = tmp_path_factory.mktemp("report")
    study = study_from_dict({
        "name": "tiny-report",
        "model": {"id": str(tiny_dirs["bert"])},
        "dataset": {"name": str(_dataset(root / "reviews.csv")), "n": 12, "seed": 1},
        "explainers": ["attention", "attention_mean", "rollout", "saliency", "input_x_gradient"],
        "references": ["loo_delete", "loo_mask"],
        "metrics": {"top_k": [1, 3], "erasure": {"rankings": ["attention_mean@last", "saliency"], "bins": [10, 50]},
                    "counterfactual": {"layers": ["last"], "permutations": 3, "adversarial": True,
                                       "adversarial_steps": 10, "adversarial_candidates": 2},
                    "heads": {"ablation": True, "importance": True},
                    "sanity": {"fractions": [0.5, 1.0]}},  # the cascade's curve (by default its judged stage alone)
        "statistics": {"bootstrap": 200, "reference": "loo_delete"},
        "engine": {"batch_size": 4},
        "output": str(root / "result"),
    })
    run_study(study, progress=False, log=lambda _: None)
    return root / "result"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report"))
    return dst


@pytest.fixture(scope="module")
def report(result, tmp_path_factory):
    out = tmp_path_factory.mktemp("report_out") / "report"
    return build_report(result, out)


def _section_ids(html: str) -> list[str]:
    return re.findall(r'<section id="([^"]+)">', html)


# --------------------------------------------------------------------------- a finished study


def test_finished_study_has_every_section_in_order(report, result):
    html = report.html.read_text(encoding="utf-8")
    assert report.sections == ALL_SECTIONS and _section_ids(html) == ALL_SECTIONS and not report.partial
    verdict = json.loads((result / "verdict.json").read_text())
    assert f'answer-{verdict["answer"].replace(" ", "-")}' in html
    assert verdict["headline"].split(":")[0] in html  # the headline, in plain words
    assert "The rule" in html and verdict["rule"][:60] in html
    assert "PARTIAL" not in html
    for text in ("attention contract", "query heads", "head dim", "mask kind", "weights sha256", "forward passes per "
                                                                                                 "example",
                 "peak memory", "sequence length", "time per step", "versions", "not forgery"):
        assert text in html, text
    # one heatmap figure per per-head explainer, the layer lines, the distribution, erasure, both
    # counterfactual figures, the head maps, the sanity checks' randomisation curves, the attention sinks
    names = {p.stem for p in report.figures}
    assert names == {"heads_attention", "layers", "distribution", "frontier", "erasure", "permutation", "adversarial",
                     "heads", "randomisation", "sinks"}
    for phrase in ("not part of this study",):
        assert phrase not in html


def test_html_is_one_self_contained_file(report):
    html = report.html.read_text(encoding="utf-8")
    images = re.findall(r"<img [^>]*src=\"([^\"]+)\"", html)
    assert len(images) == len(report.figures) and all(src.startswith("data:image/png;base64,") for src in images)
    for src in images:
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<script" not in html.lower() and "<style>" in html
    assert not re.search(r"(src|href)=\"(https?:|//|file:)", html)
    assert "@import" not in html and "url(" not in html
    assert 'href="#verdict"' in html  # the table of contents
    mask = os.umask(0)
    os.umask(mask)
    assert report.html.stat().st_mode & 0o777 == 0o666 & ~mask  # as an ordinary file, not mkstemp's 0600


def test_markdown_and_figures_next_to_it(report):
    md = report.markdown.read_text(encoding="utf-8")
    refs = re.findall(r"!\[(?:\\.|[^\]\\])*\]\(([^)]+)\)", md)  # alt text: md_escape backslash-escapes [ and ]
    assert sorted(refs) == sorted(f"figures/{p.name}" for p in report.figures)
    for ref in refs:
        path = report.markdown.parent / ref
        assert path.read_bytes()[:4] == b"\x89PNG"
    headings = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert headings[1:] == ["Verdict", "Model, set-up and provenance", "Agreement with the references",
                            "Cost against agreement", "Erasure curves", "Counterfactual attention", "Heads", "Example token views",
                            "Limitations"]
    assert "**Answer:" in md and "| vs loo\\_delete (verdict) |" in md


def test_csv_tables_are_readable_with_the_right_columns(report, result):
    tables = {p.stem: pd.read_csv(p) for p in report.tables}
    assert set(tables) == {"agreement_by_layer", "baselines_and_ceiling", "erasure_aopc", "erasure_curves",
                           "counterfactual", "frontier", "heads", "sanity", "sanity_units", "verdict_units",
                           "sinks_layers", "sinks_heads"}
    # rule 1's p-values per unit, as paired.parquet holds them; each bottom-up unit's own randomisation check
    units = tables["verdict_units"]
    paired = pd.read_parquet(result / "paired.parquet")
    assert list(units.unit) == list(paired.unit) and np.allclose(units.p_family, paired.p_family)
    assert ((units.p_family >= units.p_chance - 1e-12) & (units.p_chance > 0)).all()
    own = tables["sanity_units"]
    assert {"method", "layer", "head", "status"} <= set(own) and (own.layer >= 0).all()
    assert {"attention_mean", "rollout"} <= set(own.method)
    by_layer = tables["agreement_by_layer"]
    assert {"explainer", "layer", "reference", "measure", "n", "mean", "ci_low", "ci_high", "sig_frac"} <= set(by_layer)
    assert set(by_layer.reference) == {"loo_delete", "loo_mask"} and "attention" not in set(by_layer.explainer)
    summary = pd.read_parquet(result / "summary.parquet")
    row = by_layer[(by_layer.explainer == "rollout") & (by_layer.layer == 1) & (by_layer.reference == "loo_mask")
                   & (by_layer.measure == "spearman")].iloc[0]
    want = summary[(summary.explainer == "rollout") & (summary.layer == 1) & (summary.reference == "loo_mask")
                   & (summary.measure == "spearman") & (summary.role == "explainer")].iloc[0]
    assert row["mean"] == pytest.approx(want["mean"], rel=1e-5) and row["ci_high"] == pytest.approx(want["ci_high"], rel=1e-5)
    base = tables["baselines_and_ceiling"]
    assert set(base.role) == {"baseline", "ceiling"} and {"random", "uniform", "position"} <= set(base.explainer)
    aopc = tables["erasure_aopc"]
    assert list(aopc.ranking) == ["attention_mean@last", "saliency", "random"]
    assert {"aopc", "aopc_ci_low", "aopc_ci_high", "aopc_sufficiency", "flipped_frac"} <= set(aopc)
    erasure = pd.read_parquet(result / "erasure.parquet")
    per_example = erasure.drop_duplicates(["example", "ranking"])
    assert aopc.set_index("ranking").loc["saliency", "aopc"] == pytest.approx(
        per_example[per_example.ranking == "saliency"].aopc.mean(), rel=1e-5)
    curves = tables["erasure_curves"]
    assert {"ranking", "percent", "comprehensiveness", "sufficiency"} <= set(curves) and set(curves.percent) == {10, 50}
    cf = tables["counterfactual"]
    assert list(cf.site) == ["L1"] and {"max_attention_mean", "perm_median_output_tvd_median",
                                        "adv_max_attention_jsd_mean"} <= set(cf)
    heads = tables["heads"]
    assert len(heads) == 2 * 4 and {"layer", "head", "mean_abs_ablation_change", "mean_importance",
                                    "top3_attention"} <= set(heads)


def test_the_frontier_equals_a_direct_computation(report, result):
    """verdict.json's frontier, recomputed by hand from summary.parquet and provenance.json: each
    explainer's best unit against the verdict reference, the other reference's ceiling row, seconds
    per example from the step seconds (a shared step counted whole for each of its methods)."""
    verdict = json.loads((result / "verdict.json").read_text())
    prov = json.loads((result / "provenance.json").read_text())
    summary = pd.read_parquet(result / "summary.parquet")
    frontier = verdict["frontier"]
    assert frontier["reference"] == verdict["reference"] == "loo_delete"
    assert dict(Verdict.read(result).frontier) == frontier
    points = {p["method"]: p for p in frontier["points"]}
    assert set(points) == {"attention", "attention_mean", "rollout", "saliency", "input_x_gradient", "loo_mask"}
    mine = summary[(summary.role == "explainer") & (summary.reference == "loo_delete")
                   & (summary.measure == verdict["measure"])]
    steps, n = prov["step_seconds"], prov["examples"]
    for method, point in points.items():
        seconds = sum(v for k, v in steps.items() if method in k.split("+"))
        assert point["seconds_per_example"] == pytest.approx(seconds / n)
        if method == "loo_mask":  # the ceiling pair's other member: its agreement is the ceiling itself
            assert point["mean"] == pytest.approx(verdict["ceiling"]["mean"]) and point["defines_ceiling"]
            assert not point["within_ceiling"]
            continue
        assert point["mean"] == pytest.approx(mine[mine.explainer == method]["mean"].max())
        assert point["within_ceiling"] == (point["mean"] >= verdict["ceiling"]["ci"][0]
                                           and method not in verdict["unreliable"])
    within = [p for p in points.values() if p["within_ceiling"]]
    cheapest = frontier["cheapest"]
    if within:
        assert cheapest["seconds_per_example"] == min(p["seconds_per_example"] for p in within)
    else:
        assert cheapest is None and "no method reaches" in frontier["why"]
    table = pd.read_csv(report.out_dir / "tables" / "frontier.csv")
    assert list(table.method) == [p["method"] for p in frontier["points"]]
    assert "Cost against agreement" in report.html.read_text(encoding="utf-8")


def test_top3_attention_equals_a_direct_computation(report, result):
    """The head table's attention on the reference's top-3 tokens, recomputed example by example."""
    heads = pd.read_csv(report.out_dir / "tables" / "heads.csv").set_index(["layer", "head"])
    scores = pd.read_parquet(result / "scores.parquet")
    tokens = pd.read_parquet(result / "tokens.parquet")
    for layer, head in ((0, 2), (1, 3)):
        masses = []
        for example in sorted(tokens.example.unique()):
            scored = set(tokens[(tokens.example == example) & tokens.scored].position)
            ref = scores[(scores.example == example) & (scores.method == "loo_delete")]
            ranked = sorted(((float(s), -int(p)) for p, s in zip(ref.position, ref.score)
                             if int(p) in scored and np.isfinite(s)), reverse=True)
            top = [-p for _, p in ranked[:3]]
            att = scores[(scores.example == example) & (scores.method == "attention") & (scores.layer == layer)
                         & (scores["head"] == head)].set_index("position").score
            masses.append(sum(float(att[p]) for p in top))
        assert heads.loc[(layer, head), "top3_attention"] == pytest.approx(np.mean(masses), rel=1e-5)


def test_token_views_show_the_highest_and_lowest_examples(report, result):
    html = report.html.read_text(encoding="utf-8")
    paired = pd.read_parquet(result / "paired.parquet")
    best = paired[paired["head"] < 0].sort_values("mean", ascending=False).iloc[0]
    agreement = pd.read_parquet(result / "agreement.parquet")
    per = agreement[(agreement.explainer == best.explainer) & (agreement.layer == best.layer)
                    & (agreement["head"] == -1) & (agreement.reference == "loo_delete")].set_index("example").kendall_tau
    per = per.dropna().sort_values(ascending=False, kind="stable")
    tokens_part = html.split('<section id="tokens">')[1].split("</section>")[0]
    shown = [int(x) for x in re.findall(r"example (\d+) \u00b7", tokens_part)]
    assert shown[:3] == list(per.index[:3]) and set(shown[3:]) == set(per.index[::-1][:3])
    assert f"{best.unit} (best attention unit)" in tokens_part and "(verdict reference)" in tokens_part
    assert "(gradient)" in tokens_part and "background: rgba(" in tokens_part


# --------------------------------------------------------------------------- escaping


@pytest.fixture(scope="module")
def injected(result, tmp_path_factory):
    """A copy whose texts, tokens and study description carry markup."""
    folder = _copy(result, tmp_path_factory.mktemp("injected") / "result")
    examples = pd.read_parquet(folder / "examples.parquet")
    examples["text"] = examples["text"] + f" {INJECTED} a|b `tick` & co"
    examples.to_parquet(folder / "examples.parquet", index=False)
    tokens = pd.read_parquet(folder / "tokens.parquet")
    tokens.loc[tokens.scored, "token"] = "<b>x|y</b>"
    tokens.to_parquet(folder / "tokens.parquet", index=False)
    record = json.loads((folder / "study.json").read_text())
    record["study"]["description"] = '<img src=x onerror="alert(2)"> & `code` | pipe'
    (folder / "study.json").write_text(json.dumps(record))
    return build_report(folder)


def test_text_from_data_is_escaped_in_html(injected):
    html = injected.html.read_text(encoding="utf-8")
    assert INJECTED not in html and "<script" not in html.lower() and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in html
    assert "&lt;b&gt;x|y&lt;/b&gt;" in html and "<b>x" not in html


def test_text_from_data_is_escaped_in_markdown(injected):
    md = injected.markdown.read_text(encoding="utf-8")
    assert "<script" not in md and "<img" not in md and "<b>" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "a\\|b \\`tick\\` &amp; co" in md
    assert "&lt;b&gt;x\\|y&lt;/b&gt;" in md
    # every table row keeps its column count: an unescaped | in a cell would add one
    for block in re.split(r"\n\n", md):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            counts = {len(re.findall(r"(?<!\\)\|", row)) for row in rows}
            assert len(counts) == 1, block


# --------------------------------------------------------------------------- parts turned off, partial runs


def test_sections_without_their_tables_say_so(result, tmp_path):
    folder = _copy(result, tmp_path / "result")
    for name in ("erasure", "counterfactual", "heads"):
        (folder / f"{name}.parquet").unlink()
    files = build_report(folder)
    html = files.html.read_text(encoding="utf-8")
    assert files.sections == ALL_SECTIONS and files.out_dir == folder / "report"
    for section, what in (("erasure", "Erasure curves are"), ("counterfactual", "Counterfactual attention is")):
        body = html.split(f'<section id="{section}">')[1].split("</section>")[0]
        assert f"{what} not part of this study." in body and "<img" not in body
    heads = html.split('<section id="heads">')[1].split("</section>")[0]
    assert "Head ablation is not part of this study." in heads
    assert {p.stem for p in files.tables} == {"agreement_by_layer", "baselines_and_ceiling", "frontier", "heads",
                                              "sanity", "sanity_units", "verdict_units", "sinks_layers", "sinks_heads"}
    assert "mean_abs_ablation_change" not in pd.read_csv(folder / "report" / "tables" / "heads.csv").columns
    assert {p.stem for p in files.figures} == {"heads_attention", "layers", "distribution", "frontier", "heads",
                                               "randomisation", "sinks"}


def test_the_randomisation_figure_needs_a_curve(result, tmp_path):
    """The default check draws its judged stage alone (issue 63): a curve of the trained model and
    one stage is no figure; the table carries the value, and a note says how to draw the curve."""
    folder = _copy(result, tmp_path / "result")
    verdict = json.loads((folder / "verdict.json").read_text())
    curved = [c for c in verdict["sanity"] if c.get("check") == "randomisation" and len(c.get("curve") or []) > 2]
    assert curved and all(len(c["curve"]) == 4 for c in curved)  # the trained model, the head, 1/2, all layers
    for check in curved:
        check["curve"] = [check["curve"][0], check["curve"][2]]  # trained, the judged stage
    (folder / "verdict.json").write_text(json.dumps(verdict))
    files = build_report(folder)
    assert "randomisation" not in {p.stem for p in files.figures}
    assert "drew its judged stage alone" in files.html.read_text(encoding="utf-8")


def test_a_half_finished_run_gets_a_partial_report(result, tmp_path):
    folder = _copy(result, tmp_path / "result")
    for path in folder.iterdir():
        if path.suffix in (".parquet", ".json") and path.name != "study.json":
            path.unlink()
    (folder / "done" / "b00001.json").unlink()  # batches 0 and 2 done, 1 not
    files = build_report(folder, tmp_path / "out")
    html = files.html.read_text(encoding="utf-8")
    md = files.markdown.read_text(encoding="utf-8")
    # no verdict, and no frontier (it is judged against the verdict's ceiling)
    assert files.partial and files.sections == [s for s in ALL_SECTIONS if s not in ("verdict", "frontier")]
    assert "PARTIAL: 2 of 3 batches done (8 examples)" in html and "PARTIAL: 2 of 3 batches done" in md
    assert "the verdict comes when the run completes" in html.lower()
    assert "Answer:" not in html and "The rule" not in html
    shown = {int(x) for x in re.findall(r"example (\d+) \u00b7", html)}
    assert shown and shown <= {0, 1, 2, 3, 8, 9, 10, 11}  # examples of the done batches only
    by_layer = pd.read_csv(tmp_path / "out" / "tables" / "agreement_by_layer.csv")
    parts = pd.concat([pd.read_parquet(folder / "parts" / "agreement" / f"b{b:05d}.parquet") for b in (0, 2)])
    sel = parts[(parts.explainer == "saliency") & (parts.reference == "loo_delete")]
    row = by_layer[(by_layer.explainer == "saliency") & (by_layer.reference == "loo_delete")
                   & (by_layer.measure == "kendall_tau")].iloc[0]
    # CSV: 6 significant digits
    assert row["n"] == sel.kendall_tau.notna().sum() and row["mean"] == pytest.approx(sel.kendall_tau.mean(), rel=1e-5)
    assert "recorded in provenance.json when the run completes" in html


# --------------------------------------------------------------------------- bad input


def _cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, **(env or {})})


def test_bad_folders_are_one_line_errors(result, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"is not a study result: expected study.json"):
        build_report(empty)
    with pytest.raises(InputError, match="does not exist"):
        build_report(tmp_path / "missing")
    old = _copy(result, tmp_path / "old")
    record = json.loads((old / "study.json").read_text())
    record["format_version"] = FORMAT_VERSION + 1
    (old / "study.json").write_text(json.dumps(record))
    with pytest.raises(InputError, match="made by another probe version.*rerun the study"):
        build_report(old)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "study.json").write_text((result / "study.json").read_text())
    with pytest.raises(InputError, match="no finished batch yet"):
        build_report(fresh)
    for folder, needle in ((empty, "study.json"), (old, "another probe version"), (tmp_path / "missing", "does not "
                                                                                                         "exist")):
        proc = _cli("report", str(folder))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
        assert str(folder) in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("compare", str(result), str(empty))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and str(empty) in proc.stderr


# --------------------------------------------------------------------------- no model, no torch

BLOCKER = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "captum", "accelerate"):
                raise ImportError(f"report tried to import {name}")
    sys.meta_path.insert(0, Refuse())
    sys.argv = ["probe", *sys.argv[1:]]
    from probe.cli import main
    try:
        main()
    finally:
        assert not {"torch", "transformers"} & set(sys.modules), "torch was imported"
""")


def test_report_and_compare_need_no_model_nor_torch(result, tmp_path):
    folder = _copy(result, tmp_path / "result")
    (tmp_path / "cache").mkdir()
    env = {"PROBE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = lambda *args: subprocess.run([sys.executable, "-c", BLOCKER, *args], capture_output=True, text=True,  # noqa: E731
                                       timeout=300, cwd=tmp_path, env={**os.environ, **env})
    proc = run("report", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert (folder / "report" / "report.html").is_file() and str(folder / "report" / "report.html") in proc.stdout
    proc = run("compare", str(folder), str(result))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "comparison" / "report.html").is_file()
    assert not any((tmp_path / "cache").iterdir())


# --------------------------------------------------------------------------- the model contract


def test_grouped_query_heads_show_their_kv_map(result, tmp_path):
    folder = _copy(result, tmp_path / "result")
    prov = json.loads((folder / "provenance.json").read_text())
    contract = prov["model"]["contract"]
    contract.update({"n_kv_heads": 2, "kv_head_of_query": [0, 0, 1, 1]})
    for stack in contract["stacks"].values():
        stack.update({"n_kv_heads": 2, "kv_head_of_query": [0, 0, 1, 1]})
    (folder / "provenance.json").write_text(json.dumps(prov))
    html = build_report(folder).html.read_text(encoding="utf-8")
    assert "q0-&gt;kv0, q1-&gt;kv0, q2-&gt;kv1, q3-&gt;kv1" in html and "GQA" in html
    assert "black lines separate query heads sharing a key/value head" in html
    assert "Black lines separate query heads that share a key/value head." in html  # the head maps' caption
    plain = build_report(result, tmp_path / "plain").html.read_text(encoding="utf-8")
    assert "MHA" in plain and "-&gt;kv" not in plain and "Black lines separate" not in plain


# --------------------------------------------------------------------------- compare


def test_compare_puts_studies_side_by_side(result, tmp_path):
    other = _copy(result, tmp_path / "other")
    record = json.loads((other / "study.json").read_text())
    record["study"]["name"] = "second"
    (other / "study.json").write_text(json.dumps(record))
    for path in other.iterdir():
        if path.suffix in (".parquet", ".json") and path.name != "study.json":
            path.unlink()
    files = build_comparison([result, other], tmp_path / "cmp")
    studies = pd.read_csv(tmp_path / "cmp" / "tables" / "studies.csv")
    verdict = json.loads((result / "verdict.json").read_text())
    assert list(studies.study) == ["tiny-report", "second"]
    assert list(studies.answer) == [verdict["answer"], "(pending)"] and studies.status.iloc[1] == "partial 3/3"
    per_layer = pd.read_csv(tmp_path / "cmp" / "tables" / "per_layer.csv")
    assert set(per_layer.explainer) == {"attention", "attention_mean", "rollout"}
    assert set(per_layer.study) == {"tiny-report", "second"} and set(per_layer.layer) == {0, 1}
    html = files.html.read_text(encoding="utf-8")
    assert _section_ids(html) == ["studies", "layers"] and html.count("<img ") == 1
    assert verdict["headline"].split(":")[0] in html
    proc = _cli("compare", str(result), str(other), cwd=tmp_path)  # default out: ./comparison
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "comparison" / "report.md").is_file() and (tmp_path / "comparison" / "figures" / "per_layer.png").is_file()


def test_report_bootstrap_equals_the_metrics_bootstrap():
    from probe.metrics.statistics import bootstrap_ci
    from probe.metrics.statistics import bootstrap_ci as report_ci

    values = np.random.default_rng(2).normal(size=41)
    values[[3, 9]] = np.nan
    assert report_ci(values, n_boot=300, seed=5) == bootstrap_ci(values, n_boot=300, seed=5)
    assert np.isnan(report_ci([1.0], n_boot=300)).all()


# --------------------------------------------------------------------------- a real browser


def test_report_renders_in_a_headless_browser(injected):
    browser = headless_chromium()
    try:
        browser.get(injected.html.resolve().as_uri())
        state = browser.execute_script(
            "return {ready: document.readyState, scripts: document.scripts.length,"
            " images: Array.from(document.images).map(i => [i.complete, i.naturalWidth]),"
            " sections: Array.from(document.querySelectorAll('section')).map(s => s.id),"
            " text: document.body.innerText}")
        severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1280, min(int(height), 12000))
        browser.save_screenshot(str(injected.out_dir / "report.png"))
    finally:
        browser.quit()
    assert state["ready"] == "complete" and not severe, severe
    assert state["scripts"] == 0  # the injected <script> is text, not an element
    assert len(state["images"]) == len(injected.figures) and all(ok and w > 0 for ok, w in state["images"])
    assert state["sections"] == ALL_SECTIONS and INJECTED in state["text"]
    assert (injected.out_dir / "report.png").read_bytes()[:4] == b"\x89PNG"


def _audit_data(text: str) -> dict:
    """An ``AuditResult.to_dict()`` with one claim, every free text set to ``text``."""
    claim = {"claim": text, "kind": "faithfulness", "verdict": "refuted", "effect": 0.1, "ci": [0.05, 0.15], "n": 2,
             "threshold": 0.5, "measure": text, "rule": text, "intervention": text,
             "evidence": {"tau": {"mean": 0.1, "ci": [0.05, 0.15], "n": 2},
                          "for": [{"id": text, "text": text, "effect": 1.0, "note": text}], "against": []}}
    return {"source": text, "description": text, "claims": [claim],
            "model": {"id": text, "task": "classification", "layers": 2, "heads": 2, "stack": "encoder",
                      "dtype": "float32", "device": "cpu"},
            "data": {"n_examples": 2}, "statistics": {"bootstrap": 10, "level": 0.95, "seed": 0}}


def test_an_audit_page_wears_the_report_s_style_and_shows_a_folded_description_as_text():
    """The audit's page is the study report's style sheet plus its own badges and bars; a claim file's
    description written as YAML folded text (ending in a newline) reads as a sentence, not '\\x0a'."""
    from probe.claims.render import render_html as audit_html
    from probe.document import CSS

    data = {**_audit_data("a claim"), "description": "Popular readings of attention,\nchecked by intervention.\n"}
    page = audit_html(data)
    style = page.split("<style>")[1].split("</style>")[0]
    assert style.startswith(CSS) and ".bar" in style[len(CSS):] and "body{" not in style[len(CSS):]
    assert "<p>Popular readings of attention, checked by intervention.</p>" in page and "x0a" not in page


def test_reports_and_audits_share_one_page_shell_and_escape_everything():
    from probe.claims.render import render_html as audit_html
    from probe.claims.render import render_markdown as audit_markdown
    from probe.document import Document, Para, Section, render_html

    nasty = INJECTED + ' & "quoted" [x](javascript:y)'
    audit = audit_html(_audit_data(nasty))
    report = render_html(Document(title=nasty, sections=[Section("s", nasty, [Para(nasty)])]))
    head = '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
    for page in (audit, report):
        assert page.startswith(head) and page.endswith("</main></body></html>\n")
        assert page.split("<title>")[0] == report.split("<title>")[0]  # one shell, two style sheets
        assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    assert audit.count('<div class="tablewrap"><table><thead>') == 2  # the summary and the evidence rows
    markdown = audit_markdown(_audit_data(nasty))
    assert "<script" not in markdown and "\\[x\\](javascript:y)" in markdown
    tables = [line for line in markdown.splitlines() if line.startswith("|")]
    columns = [len(re.findall(r"(?<!\\)\|", row)) - 1 for row in tables]
    assert columns == [8, 8, 8, 4, 4, 4]  # the summary (head, rule, one claim) and the evidence rows


# --------------------------------------------------------------------------- every figure readable


def test_every_report_figure_keeps_its_texts_inside_the_canvas(result, tmp_path, monkeypatch):
    from probe.report import figures

    drawn = []
    original = figures._png
    monkeypatch.setattr(figures, "_png", lambda fig: (drawn.append(fig), original(fig))[1])
    files = build_report(result, tmp_path / "report")
    assert len(drawn) == len(files.figures) >= 5
    outside = {fig.get_suptitle() or f"figure {i}": texts_outside_canvas(fig) for i, fig in enumerate(drawn)}
    assert not any(outside.values()), {k: v[:3] for k, v in outside.items() if v}


def test_long_legend_entries_are_wrapped_inside_their_panel():
    """The quickstart's front-page figure: redundancy notes made legend entries run off the left
    edge and over each other; they are wrapped and stay inside."""
    from probe.plots import layer_lines_figure

    frame = pd.DataFrame({"layer": range(6), "mean": np.linspace(0, 0.2, 6), "ci_low": np.linspace(-0.05, 0.15, 6),
                          "ci_high": np.linspace(0.05, 0.25, 6)})
    lines = {ref: {m: frame for m in ("attention_mean", "rollout", "flow", "alti", "globenc")}
             for ref in ("loo_delete", "loo_mask", "loo_pad", "loo_random")}
    note = "attention_mean L0 = rollout L0 = flow L0-L4: one ranking"
    fig = layer_lines_figure(lines, {}, {}, "kendall_tau", {"attention_mean": note, "rollout": note, "flow": note})
    assert texts_outside_canvas(fig) == []
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("\n" in label for label in labels) and max(len(line) for label in labels
                                                            for line in label.split("\n")) <= 44


# --------------------------------------------------------------------------- what each figure must show


def _drawn(monkeypatch):
    """The figures the report module draws from now on (each before it becomes PNG bytes)."""
    from probe.report import figures

    drawn = []
    original = figures._png
    monkeypatch.setattr(figures, "_png", lambda fig: (drawn.append(fig), original(fig))[1])
    return drawn


def _line_frame(shift: float) -> pd.DataFrame:
    mean = np.linspace(0, 0.2, 6) + shift
    return pd.DataFrame({"layer": range(6), "mean": mean, "ci_low": mean - 0.05, "ci_high": mean + 0.05})


def test_explainer_lines_never_take_a_baseline_colour():
    """layers.png: explainers were drawn in the default cycle, whose green, purple and orange are
    the ceiling's, the best gradient's and the position baseline's."""
    from matplotlib.colors import to_hex

    from probe.plots import Band, layer_lines_figure

    names = [f"explainer_{i}" for i in range(12)]
    bands = {"random": Band("random", 0.0, -0.02, 0.02), "uniform": Band("uniform", 0.0, None, None),
             "position": Band("position", 0.05, 0.0, 0.1), "ceiling": Band("ceiling (a vs b)", 0.6, 0.58, 0.62)}
    fig = layer_lines_figure({"loo": {n: _line_frame(0.01 * i) for i, n in enumerate(names)}}, {"loo": bands},
                             {"loo": {"explainer": "saliency", "mean": 0.3}}, "kendall_tau")
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() in names]
    assert len(lines) == len(names)
    reserved = {to_hex(p.get_facecolor()[:3]) for p in ax.patches} | {
        to_hex(line.get_color()) for line in ax.get_lines() if line not in lines}
    assert reserved >= {"#7f7f7f", "#000000", "#ff7f0e", "#2ca02c", "#9467bd"}
    assert not {to_hex(line.get_color()) for line in lines} & reserved
    looks = {(to_hex(line.get_color()), line.get_marker(), line.get_linestyle()) for line in lines}
    assert len(looks) == len(lines)  # past the palette's length, markers and line styles tell them apart


def test_captions_name_only_what_is_drawn(result, tmp_path, monkeypatch):
    """The layers caption said "the best gradient (purple)" with no gradient line drawn."""
    from probe.plots import Band, bands_caption
    from probe.report import analysis

    assert bands_caption([{"random": Band("random", 0, -1, 1)}]) == "the random (grey) baseline"
    assert bands_caption([{"ceiling": Band("c", 0.5, None, None)}, {"uniform": Band("uniform", 0, None, None)}],
                         gradient=True) == ("the uniform (black, dotted) baseline, the ceiling (green) and the best "
                                            "gradient (purple, dashed)")
    assert bands_caption([{}]) == ""
    monkeypatch.setattr(analysis, "best_gradient", lambda r, ref: None)
    markdown = build_report(result, tmp_path / "report").markdown.read_text(encoding="utf-8")
    caption = next(line for line in markdown.splitlines() if line.startswith("*Per-layer explainers"))
    assert "best gradient" not in caption and "random (grey)" in caption


QUICKSTART_CURVES = {  # the quickstart's randomisation curves (a model with a head stage), cut down
    "loo_delete": [[0.0, 1.0], [0.0, 0.059], [0.5, -0.013], [1.0, -0.082]],
    "attention": [[0.0, 1.0], [0.0, 1.0], [0.5, -0.023], [1.0, 0.136]],
    "attention_mean": [[0.0, 1.0], [0.0, 1.0], [0.5, -0.023], [1.0, 0.136]],
    **{f"explainer_{i}": [[0.0, 1.0], [0.0, 1.0 - 0.05 * i], [0.5, 0.9 - 0.07 * i], [1.0, 0.3 - 0.05 * i]]
       for i in range(11)},
}


def test_randomisation_curves_read_cleanly(monkeypatch):
    from matplotlib.colors import to_hex

    from probe.report import figures

    drawn = _drawn(monkeypatch)
    figures.randomisation_curves(QUICKSTART_CURVES, "loo_delete")
    fig = drawn[-1]
    ax = next(a for a in fig.axes if a.get_lines())
    # (a) a categorical axis of the stages: no vertical segment at x = 0 hides the first drop
    assert [t.get_text() for t in ax.get_xticklabels()] == ["trained", "head", "head +\ntop half", "head +\nall layers"]
    data = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
    assert all(np.all(np.diff(line.get_xdata()) > 0) for line in data)
    # (b) identical curves drawn once under a joint name, every curve its own look
    labels = [line.get_label() for line in data]
    assert "attention = attention_mean" in labels and "attention" not in labels and "attention_mean" not in labels
    assert len(data) == len(QUICKSTART_CURVES) - 1
    looks = {(to_hex(line.get_color()), line.get_marker(), line.get_linestyle()) for line in data}
    assert len(looks) == len(data)
    # (c) the legend outside the axes, (d) the 0.5 limit and the judged stage in it
    legend = fig.legends[0] if fig.legends else ax.get_legend()
    assert not legend_overlaps_axes(fig, legend, ax)
    texts = [t.get_text() for t in legend.get_texts()]
    assert any(t.startswith("0.5") for t in texts) and any("judged" in t for t in texts)
    assert texts_outside_canvas(fig) == []
    # (e) a model without a head stage: neither axis nor caption speaks of one
    from probe.report.setup_section import randomisation_caption

    headless = {name: [curve[0], *curve[2:]] for name, curve in QUICKSTART_CURVES.items()}
    figures.randomisation_curves(headless, "loo_delete")
    ax = next(a for a in drawn[-1].axes if a.get_lines())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["trained", "top half", "all layers"]
    assert "head first" not in ax.get_xlabel() and "no head stage" in ax.get_xlabel()
    assert "output head, then" in randomisation_caption(QUICKSTART_CURVES)
    assert "output head, then" not in randomisation_caption(headless)
    assert "once the top half is random" in randomisation_caption(headless)


def _units(n: int = 13) -> list[dict]:
    rng = np.random.default_rng(0)
    names = ["alti L5", "attention L4.H7", "attention_mean L4", "attn_grad L5.H10", "attn_norm L4.H7", "flow L0",
             "globenc L5", "rollout L5", "value_zeroing L4", "gradient_shap", "input_x_gradient",
             "integrated_gradients", "saliency"][:n]
    units = []
    for i, name in enumerate(names):
        values = rng.normal(0.1, 0.2, 200)
        kind = " (best head)" if ".H" in name else " (best layer)" if " L" in name else ""
        units.append({"label": name + kind, "unit": name, "explainer": name.split()[0],
                      "same_as": "attention_mean L0 = rollout L0 = flow L1-L4" if name == "flow L0" else None,
                      "family": "gradient" if i >= 9 else "attention", "values": values,
                      "mean": float(values.mean()), "ci": (float(values.mean()) - 0.02, float(values.mean()) + 0.02)})
    return units


def test_distribution_legend_below_and_tick_labels_apart(monkeypatch):
    from probe.plots import Band
    from probe.report import figures

    drawn = _drawn(monkeypatch)
    bands = {"random": Band("random", -0.001, -0.024, 0.020), "uniform": Band("uniform", 0.0, None, None),
             "position": Band("position", 0.008, -0.016, 0.032),
             "ceiling": Band("ceiling (loo_delete vs loo_pad)", 0.598, 0.578, 0.620)}
    for units in (_units(), _units(3)):
        figures.distribution(units, bands, "loo_delete", "kendall_tau")
        fig = drawn[-1]
        ax = fig.axes[0]
        legend = fig.legends[0] if fig.legends else ax.get_legend()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert legend.get_window_extent(renderer).y1 <= ax.patch.get_window_extent(renderer).y0  # below, not beside
        texts = [t.get_text() for t in legend.get_texts()]
        families = {u["family"] for u in units}
        assert all(any(t.startswith(f"{family}") for t in texts) for family in families)  # what the box colours mean
        assert any("mean with its CI" in t for t in texts) and legend.get_title().get_text() != "mean [CI]"
        ticks = ax.get_xticklabels()
        assert not any("=" in t.get_text() or "\n" in t.get_text() for t in ticks)
        assert overlapping_texts(ticks, fig) == []
        assert texts_outside_canvas(fig) == []
    ticks = [t.get_text() for t in drawn[0].axes[0].get_xticklabels()]
    assert "flow L0 (best layer) [1]" in ticks
    assert "[1] flow L0 = attention_mean L0 = rollout L0 = flow L1-L4" in drawn[0].axes[0].get_xlabel()


def test_overlap_check_sees_rotated_labels():
    """The check the distribution test relies on: it measures the rotated labels themselves, not
    their axis-aligned boxes (which overlap for any long rotated label on close ticks)."""
    from probe.plots import new_figure

    long = "a very long label that runs far"
    for labels, rotation, expected in (([long] * 6, 0, True), ([long] * 6, 35, False),
                                       ([f"{long}\nsecond line\nthird line"] * 6, 35, True)):
        fig = new_figure(4, 3)
        ax = fig.subplots()
        ax.set_xticks(range(6), labels, rotation=rotation, ha="right", rotation_mode="anchor", fontsize=8)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
        assert boxes[0].overlaps(boxes[1])  # the axis-aligned boxes always do
        assert bool(overlapping_texts(ax.get_xticklabels(), fig)) is expected, (rotation, labels[0])


def test_convergence_ticks_at_the_steps_and_zeros_marked(monkeypatch):
    from probe.report import figures
    from probe.report.setup_section import convergence_caption

    drawn = _drawn(monkeypatch)
    frame = pd.DataFrame({"example": range(6), "method": "integrated_gradients", "steps": 50,
                          "delta": [1e-6, 0.0, 2e-5, 3e-4, 0.0, 1e-3], "gap": 0.5, "final": True})
    figures.convergence_curves(frame)
    ax = drawn[-1].axes[0]
    assert list(ax.get_xticks()) == [50] and [t.get_text() for t in ax.get_xticklabels()] == ["50"]
    zeros = [line for line in ax.get_lines() if "exactly 0" in line.get_label()]
    assert len(zeros) == 1 and len(zeros[0].get_xdata()) == 2 and zeros[0].get_marker() != "."
    examples = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert not any(np.isclose(np.asarray(line.get_ydata(), dtype=float), 1e-8).any() for line in examples)
    caption = convergence_caption(frame)
    assert "one point per example" in caption and "tolerance" not in caption and "2 deltas are exactly 0" in caption
    auto = pd.DataFrame({"example": [0, 0, 1], "method": "integrated_gradients", "steps": [16, 32, 16],
                         "delta": [1e-2, 1e-5, 1e-5], "gap": 0.5, "final": [False, True, True]})
    assert "met the tolerance" in convergence_caption(auto)
    figures.convergence_curves(auto)
    assert list(drawn[-1].axes[0].get_xticks()) == [16, 32]


def test_heatmaps_have_a_scale_per_panel_and_labelled_colour_bars(monkeypatch):
    from probe.report import figures

    drawn = _drawn(monkeypatch)
    grids = {"loo_delete": np.full((2, 4), 0.02), "loo_unk": np.linspace(-0.4, 0.4, 8).reshape(2, 4)}
    figures.heatmap_grid(grids, "attention", "kendall_tau", [0, 0, 1, 1])
    panels = [ax for ax in drawn[-1].axes if ax.get_images() and ax.get_title().startswith("vs ")]
    assert len(panels) == 2
    for ax, grid in zip(panels, grids.values()):
        image = ax.get_images()[0]
        assert image.get_clim() == pytest.approx((-np.abs(grid).max(), np.abs(grid).max()))  # its own scale
        assert image.colorbar is not None and image.colorbar.ax.get_ylabel()
    figures.head_maps({"mean |change| when the head is ablated": np.linspace(0, 0.04, 8).reshape(2, 4),
                       "mean head importance (Michel et al.)": np.linspace(0, 1, 8).reshape(2, 4)}, [0, 0, 1, 1],
                      {"mean |change| when the head is ablated": "mean |change of the target|"})
    fig = drawn[-1]
    for ax in fig.axes:
        for image in ax.get_images():
            assert image.colorbar is not None and image.colorbar.ax.get_ylabel(), ax.get_title()
        assert all(t.get_fontsize() >= 7 for t in ax.texts)
    assert texts_outside_canvas(fig) == []


def test_erasure_legend_stays_off_the_curves(monkeypatch):
    from probe.report import figures

    drawn = _drawn(monkeypatch)
    rows = []
    for ranking in ("attention_mean@last", "random", "saliency"):
        for percent in (1, 5, 10, 20, 50):
            rows.append({"ranking": ranking, "percent": percent, "comprehensiveness": percent / 100,
                         "comprehensiveness_sem": 0.01, "sufficiency": 0.3 - percent / 200, "sufficiency_sem": 0.01})
    aopc = pd.DataFrame({"ranking": ["attention_mean@last", "random", "saliency"], "aopc": [0.1, 0.05, 0.3],
                         "aopc_sufficiency": [0.2, 0.25, 0.0]})
    figures.erasure_curves(pd.DataFrame(rows), aopc)
    fig = drawn[-1]
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends and all(not legend_overlaps_axes(fig, legend, ax) for legend in legends for ax in fig.axes)
    texts = [t.get_text() for legend in legends for t in legend.get_texts()]
    assert len(texts) == 3 and all("comprehensiveness" in t and "sufficiency" in t for t in texts)
    assert texts_outside_canvas(fig) == []


def test_the_figures_best_gradient_is_the_verdicts_bar_not_a_method_that_failed_its_checks():
    """A gradient that failed a sanity check is never the verdict's bar, so no figure draws it as the
    best gradient either (the smollm2 study's IG failed completeness and agreed most)."""
    import pandas as pd

    from probe.report.lines import summary_best_gradient

    rows = [{"role": "explainer", "explainer": name, "reference": "loo_delete", "measure": "kendall_tau",
             "layer": -1, "head": -1, "mean": mean, "ci_low": mean - 0.01, "ci_high": mean + 0.01}
            for name, mean in (("integrated_gradients", 0.04), ("input_x_gradient", -0.1), ("saliency", 0.02))]
    summary = pd.DataFrame(rows)
    assert summary_best_gradient(summary, "loo_delete", "kendall_tau")["explainer"] == "integrated_gradients"
    chosen = summary_best_gradient(summary, "loo_delete", "kendall_tau", {"integrated_gradients": ["completeness"],
                                                                         "saliency": ["randomisation"]})
    assert chosen["explainer"] == "input_x_gradient" and chosen["mean"] == pytest.approx(-0.1)
    assert summary_best_gradient(summary, "loo_delete", "kendall_tau", ["integrated_gradients", "saliency",
                                                                        "input_x_gradient"]) is None


def test_the_report_names_the_commit_it_was_made_from(report, result):
    import re

    from probe.study.provenance import source_commit

    commit = json.loads((result / "provenance.json").read_text())["source_commit"]
    assert commit == source_commit() or commit is None  # None only outside a git checkout
    if commit is not None:
        assert re.fullmatch(r"[0-9a-f]{40}\+?", commit)
        html = report.html.read_text(encoding="utf-8")
        assert f"commit {commit[:12]}" in html
        assert ("with uncommitted changes" in html) == commit.endswith("+")


def test_the_report_names_the_machine_and_its_load(report, result):
    """A wall time is read with the machine's cores and the load beside it (one source for a timing)."""
    import os

    machine = json.loads((result / "provenance.json").read_text())["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    if hasattr(os, "getloadavg"):
        assert machine["load_average"] >= 0 and machine["batches_with_load"] >= 1
    assert f"{os.cpu_count()} CPU cores" in report.html.read_text(encoding="utf-8")
