"""How often the verdict says yes by chance: the verdict of one finished study recomputed at many
statistics seeds from its stored tables (no model run), each seed drawing rule 1's permutations
anew. On a model whose attention carries nothing (``planted:position-heads``) a "yes" or "heads only"
at more than alpha of the seeds would be a false-positive rate above the one the verdict states; on
a model with one planted head (``planted:one-head``) that head should be named, alone, at nearly
every seed. ``probe planted --calibrate N`` writes the table into ``reports/planted/``.

Only rule 1 depends on the seed (rules 2 and 3, the paired test against the best gradient and the
sanity checks, do not), so each seed reruns the chance tests and applies the verdict's own rule
(:func:`probe.study.units.with_chance`, :func:`probe.study.units.family_answers`); the
bootstrap intervals, which are shown and decide nothing, are those of the study's own seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import pandas as pd

from probe.study import decide
from probe.study.summary import ceiling_p, chance_frame, judge_tables
from probe.study.units import family_answers, with_chance

if TYPE_CHECKING:
    from pathlib import Path

    from probe.spec.study import Study
    from probe.study.sanity import Check

__all__ = ["CALIBRATION_COLUMNS", "calibration", "calibration_summary", "folder_calibration", "read_folder"]

CALIBRATION_COLUMNS = ["seed", "answer", "layer_units", "heads", "tracking", "above_chance", "near_alpha"]


def calibration(tables: dict, study: Study, *, dtype: str, sanity: Sequence = (),
                seeds: Iterable[int] = range(200)) -> pd.DataFrame:
    """One row per statistics seed: the verdict's ``answer`` there, how many layer-level units and
    heads of the headline family track, and which (``tracking``, ``; ``-joined unit names), and how
    many of its units pass rule 1 alone (``above_chance``: the statistic's own false positives on a
    null model, whatever rules 2 and 3 then say). Rule 1 runs the verdict's sequential Monte Carlo rule
    (:mod:`probe.study.chance`): ``near_alpha`` counts the headline family's units (and the ceiling)
    whose p-value is still within Monte Carlo error of alpha at the cap."""
    judged = judge_tables(tables, study, dtype=dtype, sanity=sanity)
    v = judged["verdict"]
    st = study.statistics
    paired, plan = judged["paired"], judged["plan"]
    headline = v["headline_family"]
    agreement = judged["agreement"]
    ref = study.verdict_reference
    n_scored = int(agreement[(agreement.reference == ref) & (agreement.role == "explainer")].example.nunique()) \
        if len(agreement) else 0
    pair = tuple(v["ceiling"]["pair"]) if v.get("ceiling") else None
    # the families the answer reads: the headline family and the verdict's ceiling pair
    plan = [f for f in plan if f.family == headline
            or (f.family == "ceiling" and pair is not None and (f.units.explainer.iloc[0], f.reference) == pair)]
    rows = []
    for seed in seeds:
        chance = chance_frame(plan, permutations=st.permutations, seed=int(seed), alpha=st.alpha)
        ceiling = {**v["ceiling"], "p_chance": ceiling_p(chance, *pair)} if pair is not None else None
        reason = decide.undecidable_reason(judged["profile"], n_scored, ceiling, st.alpha, v.get("interactions"))
        decided = with_chance(paired, chance, st.alpha)
        families = family_answers(decided, reason)
        answer = "undecidable" if reason else (families[headline]["answer"] if headline in families else "no")
        own = decided[(decided.family == headline) & decided.tracks] if len(decided) else decided
        rows.append({"seed": int(seed), "answer": answer, "layer_units": int((own["head"] < 0).sum()) if len(own) else 0,
                     "heads": int((own["head"] >= 0).sum()) if len(own) else 0,
                     "tracking": "; ".join(own.unit) if len(own) else "",
                     "above_chance": int((decided.above_chance & (decided.family == headline)).sum())
                     if len(decided) else 0,
                     "near_alpha": int(chance.near_alpha.sum()) if "near_alpha" in chance else 0})
    return pd.DataFrame(rows, columns=CALIBRATION_COLUMNS)


def calibration_summary(frame: pd.DataFrame, expected_units: Sequence[str] = ()) -> dict:
    """The share of seeds answering each way, the share with any unit tracking, and (with
    ``expected_units``) the share where exactly those units track, and nothing else."""
    n = len(frame)
    shares = {answer: float((frame.answer == answer).mean()) for answer in ("yes", "heads only", "no", "undecidable")}
    out = {"seeds": n, "answers": shares, "any_tracking": float(((frame.layer_units + frame.heads) > 0).mean()) if n else 0.0,
           "positive": float(frame.answer.isin(["yes", "heads only"]).mean()) if n else 0.0,
           "rule1_any": float((frame.above_chance > 0).mean()) if n else 0.0}
    if expected_units:
        want = "; ".join(expected_units)
        out["exactly_expected"] = float((frame.tracking == want).mean()) if n else 0.0
    return out


def read_folder(folder: str | Path) -> tuple[dict[str, pd.DataFrame], Study, str, list[Check]]:
    """A finished study's merged tables, its study, its dtype (``provenance.json``) and its sanity
    checks (``sanity.parquet``): everything :func:`judge_tables` needs, no model."""
    import json
    from pathlib import Path

    from probe.names import TABLES
    from probe.spec.study import study_from_dict
    from probe.study.sanity import Check

    root = Path(folder)
    tables = {name: pd.read_parquet(root / f"{name}.parquet") for name in TABLES if (root / f"{name}.parquet").is_file()}
    study = study_from_dict(json.loads((root / "study.json").read_text(encoding="utf-8"))["study"])
    dtype = json.loads((root / "provenance.json").read_text(encoding="utf-8"))["dtype"]
    checks = []
    if (root / "sanity.parquet").is_file():
        for r in pd.read_parquet(root / "sanity.parquet").itertuples():
            value = None if pd.isna(r.value) else float(r.value)
            unit = {"layer": int(r.layer), "head": int(r.head)} if "layer" in r._fields and pd.notna(r.layer) else {}
            checks.append(Check(method=r.method, check=r.check, status=r.status, value=value, detail=r.detail,
                                curve=tuple(tuple(p) for p in _curve(r.curve)), **unit))
    return tables, study, dtype, checks


def folder_calibration(folder: str | Path, seeds: Iterable[int] = range(200)) -> pd.DataFrame:
    """:func:`calibration` of a finished study's result folder (:func:`read_folder`): nothing
    recomputed but the statistics."""
    tables, study, dtype, checks = read_folder(folder)
    return calibration(tables, study, dtype=dtype, sanity=checks, seeds=seeds)


def _curve(text: str) -> list:
    """A stored randomisation curve (``repr`` of a list of [fraction, value] pairs, NaN as ``nan``)."""
    import json
    import re

    return json.loads(re.sub(r"\bnan\b", "NaN", re.sub(r"-?\binf\b", lambda m: m.group(0).replace("inf", "Infinity"),
                                                        str(text))))
