"""The planted-truth self-test: one study (``studies/planted.yaml``) run on every planted model of
:mod:`probe.models.planted`, each verdict set beside the truth it was built to have.

A verdict is tested like a method (DESIGN rule 14): where the truth is known by construction,
probe must give it, and ``undecidable`` where nothing can be decided. ``probe planted`` runs the
study on each model (its explainers and references cut to what applies to that model) and writes
``planted.md``, ``planted.csv`` and ``planted.json``: truth, expected answer, probe's answer,
whether they match, the measure and the headline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from probe.errors import InputError
from probe.files import write_file

if TYPE_CHECKING:
    from probe.spec.study import Study
    from probe.tasks import Task

PLANTED_PREFIX = "planted:"


def planted_study(template: Study, name: str, *, out: Path, skipped: dict[str, str], task: Task) -> Study:
    """``template`` aimed at the planted model ``name``: its model and data, its own output folder,
    the methods that apply to it (``skipped``: method -> why not), its prompt template where it has one
    (:attr:`probe.models.planted.PlantedModel.prompt`), and the model's own reference
    (:attr:`probe.models.planted.PlantedModel.reference`) added and judged against where it has one."""
    from probe.models.planted import PLANTED_MODELS
    from probe.spec.study import parse_ranking, study_from_dict

    data = template.to_dict()
    data["name"] = f"planted-{name}"
    data["model"]["id"] = PLANTED_PREFIX + name
    data["dataset"]["name"] = PLANTED_PREFIX + name
    data["output"] = str(out / name)
    data["explainers"] = [m for m in data["explainers"] if m not in skipped]
    data["references"] = [m for m in data["references"] if m not in skipped]
    if not task.labels and (data.get("target") or {}).get("label") is not None:
        data["target"]["label"] = None
    used = set(data["explainers"]) | set(data["references"])
    data["params"] = {k: v for k, v in (data.get("params") or {}).items() if k in used}
    metrics = data["metrics"]
    if metrics.get("erasure"):
        metrics["erasure"]["rankings"] = [r for r in metrics["erasure"]["rankings"] if parse_ranking(r)[0] in used]
    if metrics.get("ceilings"):
        metrics["ceilings"] = [p for p in metrics["ceilings"] if set(p) <= used]
    metrics["absolute"] = [m for m in metrics.get("absolute") or [] if m in used]
    prompt = PLANTED_MODELS[name].prompt if name in PLANTED_MODELS else None
    if prompt is not None:  # the model reads its texts through its own template
        data["target"] = {**(data.get("target") or {}), "prompt": prompt}
    own = PLANTED_MODELS[name].reference if name in PLANTED_MODELS else None
    if own is not None:
        data["references"] = list(dict.fromkeys([*data["references"], own]))
        data["statistics"]["reference"] = own
    if data["statistics"].get("reference") not in data["references"]:
        data["statistics"]["reference"] = None
    return study_from_dict(data, source=f"{template.name} on {PLANTED_PREFIX}{name}")


def run_planted(template: Study, *, names: Sequence[str] | None = None, results: Path, n: int | None = None,
                calibrate: int = 0, log: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Run ``template`` on every planted model of the self-test (or ``names``); one row per model. With ``calibrate``,
    each verdict is recomputed from its tables at that many statistics seeds
    (:func:`probe.study.calibration.folder_calibration`): the row gains the share of seeds giving each
    answer (``seeds_yes``, ``seeds_heads_only``, ``seeds_no``, ``seeds_undecidable``), ``seeds_right``
    (the expected answer) and, for a model with planted units, ``seeds_exact`` (exactly those track)."""
    from probe.models.loading import load_model
    from probe.models.planted import PLANTED_MODELS, self_test_names
    from probe.registry import CHECKS
    from probe.registry import skipped as skipped_methods
    from probe.study.runner import run_study

    log = log or (lambda text: None)
    chosen = list(names) if names else self_test_names()
    unknown = [x for x in chosen if x not in PLANTED_MODELS]
    if unknown:
        raise InputError(f"unknown planted model(s) {', '.join(unknown)}: valid are {', '.join(PLANTED_MODELS)}")
    if n is not None:
        template = template.model_copy(update={"dataset": template.dataset.model_copy(update={"n": n})})
    rows = []
    for name in chosen:
        recipe = PLANTED_MODELS[name]
        pm = load_model(PLANTED_PREFIX + name)
        # the template names its methods: one run only when asked for by name is asked for here
        applies = tuple(check for check in CHECKS if check != "by_name")
        study = planted_study(template, name, out=Path(results), skipped=skipped_methods(pm, 64, checks=applies),
                              task=pm.task)
        del pm
        log(f"planted {name}: {recipe.truth}")
        run = run_study(study, progress=False, log=lambda text: None)
        v = run.verdict
        answer = v.answer if v is not None else None
        families = {k: f["answer"] for k, f in v.families.items()} if v is not None else {}
        rows.append({"model": name, "task": recipe.task, "truth": recipe.truth, "expected": " or ".join(recipe.expected),
                     "answer": answer, "right": answer in recipe.expected,
                     "measure": v.measure if v is not None else None,
                     "undecidable": (v.undecidable if v is not None else None) or "",
                     "families": "; ".join(f"{k}: {a}" for k, a in families.items()), "why": recipe.why,
                     "headline": v.headline if v is not None else ""})
        if calibrate and v is not None:
            rows[-1].update(_calibrated(Path(results) / name, recipe, calibrate))
        log(f"planted {name}: {answer} (expected {' or '.join(recipe.expected)})")
    return pd.DataFrame(rows)


def _calibrated(folder: Path, recipe, seeds: int) -> dict:
    from probe.study.calibration import calibration_summary, folder_calibration

    frame = folder_calibration(folder, seeds=range(seeds))
    summary = calibration_summary(frame, recipe.tracking)
    out = {"seeds": seeds, **{f"seeds_{a.replace(' ', '_')}": share for a, share in summary["answers"].items()},
           "seeds_right": float(frame.answer.isin(recipe.expected).mean()), "seeds_rule1": summary["rule1_any"]}
    if recipe.tracking:
        out["seeds_exact"] = summary["exactly_expected"]
    return out


#: the planted models the self-test re-judges on small random subsets of their stored tables
#: (:mod:`probe.study.subsets`), and the subset sizes: the positive at 12 scored examples (drawn from the
#: texts that hold the trigger: the others are left out by the effect floor, so 12 of them and 12 others
#: are judged alike), the null at 10 to 40 examples
SMALL_N = {"trigger-saturated": (12,), "position-heads": (10, 12, 20, 40)}
SCORED_POOL = {"trigger-saturated"}  # drawn from the scored examples only


def planted_small_n(results: Path, names: Sequence[str], *, draws: int = 100, seed: int = 0) -> pd.DataFrame:
    """The verdict at small n on each model of :data:`SMALL_N` among ``names`` whose result is in
    ``results``: one row per (model, n) with the share of draws giving each answer
    (:func:`probe.study.subsets.subset_summary`)."""
    from probe.study.calibration import read_folder
    from probe.study.subsets import scored_examples, subset_answers, subset_summary

    frames = []
    for name, sizes in SMALL_N.items():
        if name not in names or not (Path(results) / name / "verdict.json").is_file():
            continue
        tables, study, dtype, sanity = read_folder(Path(results) / name)
        pool = scored_examples(tables, study, dtype=dtype) if name in SCORED_POOL else None
        answers = subset_answers(tables, study, dtype=dtype, sanity=sanity, sizes=sizes, draws=draws, seed=seed,
                                 pool=pool)
        frames.append(subset_summary(answers).assign(model=name))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _small_n_lines(small: pd.DataFrame) -> list[str]:
    """The small-n table: each verdict re-judged on random subsets of its stored tables."""
    lines = ["", "## At small n: the answers on random subsets", "",
             "Each verdict re-judged on random subsets of n of its examples, drawn from its stored tables (no model "
             "rerun, `probe.study.subsets`). A rule that passes on the absence of evidence says yes at small n where "
             "the whole study says no; the null `position-heads` must say yes or heads only at no more than alpha "
             "(5%) of the draws, and the positive `trigger-saturated`, drawn as 12 of the texts that hold the "
             "trigger (the others are left out by the effect floor), must still say yes at 95% of them at least, "
             "so that 'undecidable whenever n is small' cannot pass.", "",
             "| model | n | draws | median scored | yes | heads only | no | undecidable |", "|---|---|---|---|---|---|---|---|"]
    for r in small.itertuples():
        lines.append(f"| `{r.model}` | {r.n} | {r.draws} | {r.median_scored:g} | {100 * r.yes:.0f}% | "
                     f"{100 * getattr(r, 'heads_only', 0.0):.0f}% | {100 * r.no:.0f}% | {100 * r.undecidable:.0f}% |")
    return lines


def _calibration_lines(frame: pd.DataFrame) -> list[str]:
    """The calibration table: each verdict recomputed from its stored tables at many statistics seeds."""
    seeds = int(frame.seeds.dropna().max())
    lines = ["", "## Calibration: the answers over statistics seeds", "",
             f"Each verdict recomputed from its stored tables at statistics seeds 0..{seeds - 1} (no model rerun): "
             f"only "
             "rule 1's permutations change with the seed. The share of seeds giving each answer; *exactly planted* is "
             "the share where the planted units, and no other, track; *rule 1 alone* the share where any unit of the "
             "headline family passes the test against chance, whatever rules 2 and 3 say (on a model whose attention "
             "carries nothing, that is the statistic's own family-wise false-positive rate). A model whose attention "
             "carries nothing must say yes or heads only, and pass rule 1 anywhere, at no more than alpha (5%) of the "
             "seeds.", "",
             "| model | expected | yes | heads only | no | undecidable | expected answer | exactly planted | "
             "rule 1 alone |",
             "|---|---|---|---|---|---|---|---|---|"]

    def pct(value) -> str:
        return "" if value is None or value != value else f"{100 * value:.1f}%"

    for r in frame.itertuples():
        lines.append(f"| `{r.model}` | {r.expected} | {pct(getattr(r, 'seeds_yes', None))} | "
                     f"{pct(getattr(r, 'seeds_heads_only', None))} | {pct(getattr(r, 'seeds_no', None))} | "
                     f"{pct(getattr(r, 'seeds_undecidable', None))} | {pct(getattr(r, 'seeds_right', None))} | "
                     f"{pct(getattr(r, 'seeds_exact', None))} | {pct(getattr(r, 'seeds_rule1', None))} |")
    return lines


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_planted(frame: pd.DataFrame, out: Path, *, command: str = "probe planted studies/planted.yaml",
                  small_n: pd.DataFrame | None = None) -> list[Path]:
    """``planted.md``, ``planted.csv`` and ``planted.json`` in ``out`` (each written atomically), and
    ``small_n.csv`` with :func:`planted_small_n`'s table where given."""
    out = Path(out)
    right = int(frame.right.sum()) if len(frame) else 0
    lines = ["# Planted truths: what probe answers where the answer is known", "",
             f"Made with `{command}`: the study on every planted model of `probe.models.planted`, "
             "each built so that its token importance, and what its attention does, is known by construction "
             f"(the recipes measure and store their facts). **{right} of {len(frame)} answers are right.**", "",
             "| model | task | truth | expected | probe's answer | right | measure | families | why undecidable |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in frame.itertuples():
        lines.append(f"| `{r.model}` | {r.task} | {_cell(r.truth)} | {r.expected} | **{r.answer}** | "
                     f"{'yes' if r.right else 'NO'} | {r.measure} | {_cell(r.families)} | {_cell(r.undecidable)} |")
    lines += ["", "## Headlines", ""]
    for r in frame.itertuples():
        lines += [f"- `{r.model}`: {_cell(r.headline)}"]
    if "seeds" in frame.columns:
        lines += _calibration_lines(frame)
    if small_n is not None and len(small_n):
        lines += _small_n_lines(small_n.rename(columns={"heads only": "heads_only"}))
    lines += ["", "## Why each expected answer", ""] + [f"- `{r.model}`: {_cell(r.why)}" for r in frame.itertuples()]
    paths = [out / "planted.md", out / "planted.csv", out / "planted.json"]
    write_file(paths[0], "\n".join(lines) + "\n")
    write_file(paths[1], frame.to_csv(index=False))
    write_file(paths[2], json.dumps(frame.to_dict(orient="records"), indent=1, ensure_ascii=False) + "\n")
    if small_n is not None and len(small_n):
        paths.append(out / "small_n.csv")
        write_file(paths[3], small_n.to_csv(index=False))
    return paths
