"""The report's example token views: the examples where the best layer-level attention unit
agrees most and least with the verdict reference, each as that unit's token scores, a gradient's
and the reference's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from probe.names import method_family as family
from probe.report.analysis import best_attention_unit, best_gradient
from probe.report.results import StudyResult

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class TokenRow:
    label: str
    values: np.ndarray  # per position; NaN where not shown


@dataclass
class TokenExample:
    example: int
    text: str
    target: str
    agreement: float
    group: str  # "highest" or "lowest"
    tokens: list[str]
    scored: np.ndarray
    rows: list[TokenRow]


def unit_rows(scores: pd.DataFrame, layer: int = -1, head: int = -1) -> pd.DataFrame:
    """One method's rows of the scores table as one unit reads them: its ``layer`` (and ``head``)
    where the method has layers, else, for a per-layer method read as token-level, its last layer."""
    if layer >= 0 and (scores["layer"] >= 0).any():
        scores = scores[scores["layer"] == layer]
        return scores[scores["head"] == head] if head >= 0 else scores
    if (scores["layer"] >= 0).any():
        return scores[scores["layer"] == scores["layer"].max()]
    return scores


def display_token(token: str) -> str:
    return token.replace("\u0120", " ").replace("\u2581", " ").replace("\u010a", "\u23ce").strip() or token


def token_examples(r: StudyResult, n: int = 3) -> tuple[dict | None, list[TokenExample]]:
    """The ``n`` examples with the highest and the ``n`` with the lowest agreement of the best
    layer-level attention unit, with that unit's scores, a gradient's and the reference's."""
    unit = best_attention_unit(r)
    # a step study: the units (output tokens) are shown, each under its dataset example and step
    a = r.table("unit_agreement") if r.stepwise else r.table("agreement")
    scores, tokens, examples = r.table("scores"), r.table("tokens"), r.table("examples")
    if unit is None or a is None or scores is None or tokens is None or examples is None:
        return unit, []
    sel = a[(a["role"] == "explainer") & (a["reference"] == r.reference) & (a["explainer"] == unit["explainer"])
            & (a["layer"] == unit["layer"]) & (a["head"] == unit["head"])]
    per = sel.set_index("example")[r.measure].dropna().sort_values(ascending=False, kind="stable")
    if not len(per):
        return unit, []
    high = list(per.index[:n])
    low = [e for e in per.index[::-1] if e not in high][:n]
    chosen = high + low
    grad = (r.verdict.best_gradient if r.verdict is not None else None) or best_gradient(r, r.reference)
    grad_name = grad["explainer"] if grad else next((m for m in r.explainers + r.references
                                                      if family(m) == "gradient"), None)
    methods = [unit["explainer"], grad_name, r.reference]
    sc = scores[scores["example"].isin(chosen) & scores["method"].isin([m for m in methods if m])]
    tok = tokens[tokens["example"].isin(chosen)].sort_values(["example", "position"])
    ex = examples.set_index("example")
    out = []
    for group, ids in (("highest", high), ("lowest", low)):
        for e in ids:
            t = tok[tok["example"] == e]
            length = int(t["position"].max()) + 1 if len(t) else 0
            rows = []
            for label, method, layer, head in (
                    (unit["unit"] + " (best attention unit)", unit["explainer"], unit["layer"], unit["head"]),
                    (f"{grad_name} (gradient)" if grad_name else None, grad_name, -1, -1),
                    (f"{r.reference} (verdict reference)", r.reference, -1, -1)):
                if method is None:
                    continue
                s = unit_rows(sc[(sc["example"] == e) & (sc["method"] == method)], layer, head)
                v = s.groupby("position")["score"].mean()
                values = np.full(length, np.nan)
                keep = v.index[v.index < length]
                values[keep.to_numpy()] = v.loc[keep].to_numpy()
                rows.append(TokenRow(label, values))
            row = ex.loc[e]
            target = str(row.get("target_name", ""))
            if r.stepwise:
                target = f"output token {int(row['step']) + 1}, {target!r}"
            out.append(TokenExample(
                example=int(row["source"]) if r.stepwise else int(e), text=str(row["text"]), target=target,
                agreement=float(per.loc[e]), group=group, tokens=[display_token(str(x)) for x in t["token"]],
                scored=t["scored"].to_numpy(dtype=bool), rows=rows))
    return unit, out
