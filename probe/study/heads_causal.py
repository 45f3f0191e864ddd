"""The per-head causal test: is where a head looks what matters through that head?

A study that asks for it (``metrics: heads_causal:``, :class:`probe.spec.study.HeadsCausalSpec`)
stores, per example, tested head and token (the ``head_edges`` table,
:func:`probe.study.tables.head_edge_rows`):

* ``attention``: the head's weight on the token from the target query row, as the ``attention``
  explainer reads it;
* ``knockout``: the knockout effect of that one edge, ``f(x) - f(x with the edge blocked)``, blocked
  in that head of that layer alone (:func:`probe.intervene.knockout.edge_knockout` with ``per_head``),
  signed unless the study compares it by magnitude (``absolute``).

The rule (stored in ``verdict.json`` under ``heads_causal``):

    Each tested head H is a unit. Per example, H's agreement is the study's measure (the verdict's,
    chosen as the verdict chooses it) between H's attention row and the knockout effects of H's own
    edges, on the tokens both score; an example whose knockout effects through H are all at the
    numerical noise floor (nothing passes through H's edges there) is left out of H's mean. Where
    this head looks *is what matters through this head* when H's mean agreement is above chance:
    its permutation p-value (each example's knockout effects permuted over its scored tokens, the
    same permutations for every head of the example), adjusted over every tested head by the max-T
    method (family-wise error control, as every unit family of the verdict), is at most alpha; and
    the attention explainer failed no sanity check, on the whole method or on H. Otherwise it *is
    not*; and it *cannot be decided* where fewer than the stated minimum of examples show an effect
    through H's edges, or where H's attention failed a check.

There is no gradient bar (rule 2 of the token-level verdict): no gradient method scores a head's own
edges. The test is reported beside the token-level verdict and never changes it.

Torch-free: it reads the tables a study stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from probe.metrics.agreement import agreement
from probe.metrics.nulls import NullBlock
from probe.metrics.statistics import summarize_groups
from probe.names import measure_columns, unit_name
from probe.study.chance import ChanceFamily
from probe.study.decide import EPS, MIN_EXAMPLES, noise_floor
from probe.study.steps import is_stepwise, per_source

__all__ = ["ANSWER_WORDS", "EXPLAINER", "FAMILY", "RULE", "UNIT_COLUMNS", "HeadsCausal", "edge_agreement",
           "heads_causal"]

RULE = " ".join(__doc__.split("The rule (stored in ``verdict.json`` under ``heads_causal``):")[1]
                .split("There is no gradient bar")[0].split())
#: the units' explainer and their family in the chance test
EXPLAINER = "attention"
FAMILY = "heads causal"
REFERENCE = "knockout (own edges)"
MATTERS, NOT, UNDECIDABLE = "matters", "does not matter", "undecidable"
ANSWER_WORDS = {MATTERS: "where this head looks is what matters through this head",
                NOT: "where this head looks is not what matters through this head",
                UNDECIDABLE: "cannot be decided"}
#: the columns of the per-head table (``heads_causal.parquet``)
UNIT_COLUMNS = ["unit", "layer", "head", "n", "mean", "std", "ci_low", "ci_high", "chance_mean", "chance_high",
                "p_chance", "p_family", "null", "above_chance", "reliable", "answer", "why"]
#: why an example is left out of a head's mean
AT_FLOOR = "knockout effects through the head at the noise floor"
TOO_FEW = "fewer than 2 tokens scored by both"


@dataclass(frozen=True)
class HeadsCausal:
    """The test's result: ``units`` one row per tested head (:data:`UNIT_COLUMNS`), ``agreement``
    one row per (example, head) (per dataset example in a study of generated text), ``left_out``
    the (example, head) pairs left out and why, and ``record`` what ``verdict.json`` keeps."""

    units: pd.DataFrame
    agreement: pd.DataFrame
    left_out: pd.DataFrame
    record: dict


def _wanted(measure: str, study) -> bool:
    chosen = set(study.metrics.agreement)
    if measure.startswith("kendall"):
        return "kendall" in chosen
    if measure.startswith("spearman"):
        return "spearman" in chosen
    return "top_k" in chosen


def _scale(examples: pd.DataFrame) -> tuple[pd.Series, float]:
    values = examples.set_index("example")["target_value"].abs()
    scale = float(values.median()) if len(values) else 1.0
    return values, (scale if np.isfinite(scale) and scale > 0 else 1.0)


def edge_agreement(edges: pd.DataFrame, examples: pd.DataFrame, study, dtype: str
                   ) -> tuple[pd.DataFrame, pd.DataFrame, list[tuple[int, tuple[int, int], np.ndarray, np.ndarray,
                                                                   np.ndarray]]]:
    """Per (example, head): the agreement of the head's attention row with its own edges' knockout
    effects (every measure the study computes), on the tokens both score.

    Returns ``(agreement, left_out, compared)``: ``agreement`` with ``example, explainer, reference,
    role, layer, head, n_tokens`` and the measures; ``left_out`` the pairs left out (``reason``);
    ``compared`` per kept pair ``(example, (layer, head), x, y, positions)`` as the chance test
    permutes it."""
    spec = study.metrics.heads_causal
    eps = EPS.get(str(dtype), EPS["fp32"])
    targets, scale = _scale(examples)
    top_k = list(study.metrics.top_k)
    frame = edges.sort_values(["example", "layer", "head", "position"], kind="stable")
    records, left, compared = [], [], []
    for example, part in frame.groupby("example", sort=True):
        example = int(example)
        floor = noise_floor(max(float(targets.get(example, scale)), scale), eps)
        units = part[["layer", "head"]].drop_duplicates().to_numpy(np.int64)  # [unit, 2]
        n = len(part) // max(len(units), 1)
        if len(part) != n * len(units):
            continue
        x = part["attention"].to_numpy(np.float64).reshape(len(units), n)  # [unit, tokens]
        y = part["knockout"].to_numpy(np.float64).reshape(len(units), n)  # [unit, tokens]
        if spec.absolute:
            y = np.abs(y)
        keep = np.isfinite(x) & np.isfinite(y)  # [unit, tokens]
        groups: dict[bytes, list[int]] = {}
        for u in range(len(units)):
            layer, head = int(units[u, 0]), int(units[u, 1])
            if keep[u].sum() < 2:
                left.append((example, layer, head, TOO_FEW))
            elif float(np.abs(y[u, keep[u]]).max()) <= floor:
                left.append((example, layer, head, AT_FLOOR))
            else:
                groups.setdefault(keep[u].tobytes(), []).append(u)
        for members in groups.values():
            mask = keep[members[0]]
            values = agreement(x[members][:, mask], y[members][:, mask], k=top_k)
            for j, u in enumerate(members):
                row = {"example": example, "layer": int(units[u, 0]), "head": int(units[u, 1]),
                       "n_tokens": int(mask.sum())}
                row.update({key: float(v[j]) for key, v in values.items() if _wanted(key, study)})
                records.append(row)
                compared.append((example, (row["layer"], row["head"]), x[u, mask], y[u, mask], np.flatnonzero(mask)))
    table = pd.DataFrame.from_records(records)
    if len(table):
        table.insert(1, "explainer", EXPLAINER)
        table.insert(2, "reference", REFERENCE)
        table.insert(3, "role", "heads_causal")
        table = table.sort_values(["example", "layer", "head"], kind="stable").reset_index(drop=True)
    left_out = pd.DataFrame(left, columns=["example", "layer", "head", "reason"])
    return table, left_out, compared


def _chance(compared, owners: Mapping[int, int], units: pd.DataFrame, n: tuple[int, ...], measure: str,
            study) -> pd.DataFrame:
    index = {(int(layer), int(head)): i for i, (layer, head) in enumerate(zip(units.layer, units["head"]))}
    blocks = tuple(NullBlock(owner=owners.get(example, example), key=example, units=np.array([index[unit]]),
                             x=x[None, :], y=y, positions=positions)
                   for example, unit, x, y, positions in compared if unit in index)
    family = ChanceFamily(FAMILY, REFERENCE, measure, units.assign(explainer=EXPLAINER)[["explainer", "layer", "head"]],
                          blocks, n)
    return family.test(permutations=study.statistics.permutations, seed=study.statistics.seed)


def heads_causal(tables: Mapping[str, pd.DataFrame], study, *, measure: str, dtype: str,
                 unreliable: Mapping[str, list] | None = None,
                 unreliable_units: Mapping[tuple, list] | None = None, token_answer: str | None = None) -> HeadsCausal:
    """The per-head causal test (module docstring) from a study's stored tables: ``head_edges`` and
    ``examples``. ``measure``: the verdict's measure; ``unreliable`` / ``unreliable_units``: the
    failed sanity checks (:func:`probe.study.sanity.failed_methods`, :func:`~probe.study.sanity.failed_units`);
    ``token_answer``: the token-level verdict's answer, named beside this one."""
    st = study.statistics
    examples = tables["examples"]
    edges = tables.get("head_edges")
    if edges is None:
        edges = pd.DataFrame(columns=["example", "layer", "head", "position", "attention", "knockout"])
    unit_rows, left_out, compared = edge_agreement(edges, examples, study, dtype)
    stepwise = is_stepwise(examples)
    owners = ({int(e): int(s) for e, s in zip(examples["example"], examples["source"])} if stepwise else {})
    per_example = per_source(unit_rows, examples) if stepwise and len(unit_rows) else unit_rows
    tested = edges[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"]).astype(np.int64)
    tested = tested.reset_index(drop=True)
    if measure not in per_example.columns:  # nothing compared: every head undecidable
        summary = pd.DataFrame(columns=["layer", "head", "n", "mean", "std", "ci_low", "ci_high"])
    else:
        p_col = dict(measure_columns(per_example)).get(measure)
        summary = summarize_groups(per_example, ["layer", "head"], measure, p_col, alpha=st.alpha,
                                   n_boot=st.bootstrap, level=st.level, seed=st.seed)
    units = tested.merge(summary[["layer", "head", "n", "mean", "std", "ci_low", "ci_high"]], on=["layer", "head"],
                         how="left")
    units["n"] = units["n"].fillna(0).astype(np.int64)
    chance = _chance(compared, owners, units[["layer", "head"]], tuple(int(v) for v in units.n), measure, study)
    chance = chance[["layer", "head", "chance_mean", "chance_high", "p_chance", "p_family", "null"]]
    units = units.merge(chance, on=["layer", "head"], how="left")
    p = units.p_family.to_numpy(np.float64)
    units["above_chance"] = np.isfinite(p) & (p <= st.alpha)
    units["reliable"], units["answer"], units["why"] = _answers(units, dict(unreliable or {}),
                                                                dict(unreliable_units or {}), st.alpha)
    units.insert(0, "unit", [unit_name(EXPLAINER, int(layer), int(head)) for layer, head in zip(units.layer,
                                                                                                 units["head"])])
    units = units[UNIT_COLUMNS]
    record = _record(units, study, measure, token_answer, len(compared))
    return HeadsCausal(units=units, agreement=per_example, left_out=left_out, record=record)


def _answers(units: pd.DataFrame, unreliable: Mapping[str, list], unreliable_units: Mapping[tuple, list],
             alpha: float) -> tuple[list[bool], list[str], list[str]]:
    """Per head (row of ``units``): (reliable, its answer, why): undecidable where its attention failed a
    sanity check or too few examples show an effect through its edges, else it matters where its
    agreement is above chance (family-wise), and not otherwise."""
    answers, whys, reliable = [], [], []
    for r in units.itertuples():
        failed = list(unreliable.get(EXPLAINER, [])) + list(unreliable_units.get((EXPLAINER, int(r.layer),
                                                                                 int(r.head)), []))
        reliable.append(not failed)
        if failed:
            answers.append(UNDECIDABLE)
            whys.append(f"its attention failed a sanity check ({', '.join(dict.fromkeys(failed))})")
        elif r.n < MIN_EXAMPLES:
            answers.append(UNDECIDABLE)
            whys.append(("knocking out its edges moves the target by no more than the noise floor on every example: "
                         "nothing passes through its edges to rank") if r.n == 0 else
                        f"{r.n} examples show an effect through its edges, at least {MIN_EXAMPLES} needed")
        elif r.above_chance:
            answers.append(MATTERS)
            whys.append("")
        else:
            answers.append(NOT)
            whys.append(f"its agreement is not above chance (family-wise p = {r.p_family:.3g} > alpha {alpha})"
                        if np.isfinite(r.p_family) else "its agreement is undefined (a constant row)")
    return reliable, answers, whys


def _describe(rows: pd.DataFrame) -> list[dict]:
    return [{"unit": str(r.unit), "mean": float(r["mean"]), "ci": [float(r.ci_low), float(r.ci_high)],
             "n": int(r.n), "p_family": None if not np.isfinite(r.p_family) else float(r.p_family),
             "answer": str(r.answer)} for _, r in rows.iterrows()]


def _fmt(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


def _record(units: pd.DataFrame, study, measure: str, token_answer: str | None, n_pairs: int) -> dict:
    spec = study.metrics.heads_causal
    st = study.statistics
    counts = {key: int((units.answer == key).sum()) for key in (MATTERS, NOT, UNDECIDABLE)}
    ranked = units[np.isfinite(units["mean"].to_numpy(np.float64))].sort_values("mean", ascending=False, kind="stable")
    best, worst = _describe(ranked.head(3)), _describe(ranked.tail(3).iloc[::-1])
    how = (f"{measure} of each head's attention row with the knockout of its own edges "
           f"({'|effect|' if spec.absolute else 'signed'}, "
           f"{'row renormalised' if spec.renormalise else 'blocked weight zeroed'})")
    total = len(units)
    parts = [f"Per head ({how}): where the head looks is what matters through it in {counts[MATTERS]} of {total} "
             f"heads, is not in {counts[NOT]}" + (f", cannot be decided in {counts[UNDECIDABLE]}"
                                                    if counts[UNDECIDABLE] else "") + "."]
    matters = units[units.answer == MATTERS].sort_values("mean", ascending=False, kind="stable")
    if len(matters):
        names = list(matters.unit)
        parts.append("Heads where it is: " + ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8
                                                                      else "") + ".")
    if best:
        parts.append(f"Best head: {best[0]['unit']} {_fmt(best[0])}.")
    if token_answer:
        parts.append(f"Beside the token-level verdict: {token_answer}.")
    return {
        "rule": RULE, "measure": measure, "reference": REFERENCE, "renormalise": spec.renormalise,
        "absolute": spec.absolute, "alpha": st.alpha, "level": st.level, "bootstrap": st.bootstrap,
        "permutations": st.permutations,
        "chance_test": (f"max-T permutation test over the {total} heads tested: {st.permutations} permutations of "
                        f"each example's knockout effects, family-wise alpha {st.alpha}"),
        "min_examples": MIN_EXAMPLES, "layers": sorted({int(v) for v in units.layer}),
        "heads_tested": sorted({int(v) for v in units["head"]}), "compared": n_pairs,
        "counts": {"matters": counts[MATTERS], "does_not_matter": counts[NOT], "undecidable": counts[UNDECIDABLE],
                   "total": total},
        "matters": list(matters.unit), "best": best, "worst": worst,
        "units": [{"unit": str(r.unit), "layer": int(r.layer), "head": int(r["head"]), "n": int(r.n),
                   "mean": None if not np.isfinite(r["mean"]) else float(r["mean"]),
                   "ci": [None if not np.isfinite(r.ci_low) else float(r.ci_low),
                          None if not np.isfinite(r.ci_high) else float(r.ci_high)],
                   "p_family": None if not np.isfinite(r.p_family) else float(r.p_family),
                   "answer": str(r.answer), **({"why": str(r.why)} if r.why else {})}
                  for _, r in units.iterrows()],
        "token_level_answer": token_answer, "headline": " ".join(parts),
    }
