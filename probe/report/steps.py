"""The report's section on a study of a language model's output token by token (``target.generate``
/ ``target.steps``): agreement against the output token's index, and per chosen example an output
token x source token matrix of each compared method."""

from __future__ import annotations

import numpy as np
import pandas as pd

from probe.document import Para, Section, Table
from probe.report.analysis import best_attention_unit, best_gradient
from probe.report.output import Writer
from probe.report.results import StudyResult
from probe.report.tokens import display_token, unit_rows
from probe.study.steps import step_agreement

__all__ = ["steps_section", "step_lines", "unit_matrix"]

#: dataset examples whose matrices the section draws (the first ones with the most output tokens)
MATRIX_EXAMPLES = 2


def step_lines(r: StudyResult) -> pd.DataFrame:
    """Mean agreement with the verdict reference per output step (over the examples that reached it)
    of the best attention unit, the best gradient and the random baseline; columns ``line``,
    ``step``, ``mean``, ``n``."""
    units = r.table("unit_agreement")
    examples = r.table("examples")
    if units is None or examples is None:
        return pd.DataFrame(columns=["line", "step", "mean", "n"])
    by_step = step_agreement(units[units["reference"] == r.reference], examples, r.measure)
    chosen = []
    unit = best_attention_unit(r)
    if unit is not None:
        chosen.append((unit["unit"], unit["explainer"], unit["layer"], unit["head"]))
    grad = (r.verdict.best_gradient if r.verdict is not None else None) or best_gradient(r, r.reference)
    if grad:
        chosen.append((f"{grad['explainer']} (gradient)", grad["explainer"], -1, -1))
    chosen.append(("random ranking", "random", -1, -1))
    frames = []
    for line, explainer, layer, head in chosen:
        sel = by_step[(by_step["explainer"] == explainer) & (by_step["layer"] == layer) & (by_step["head"] == head)]
        frames.append(sel[["step", "mean", "n"]].assign(line=line))
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "mean", "n", "line"])
    return out[["line", "step", "mean", "n"]]


def unit_matrix(r: StudyResult, source: int, method: str, layer: int = -1, head: int = -1
                ) -> tuple[np.ndarray, list[str], list[str]]:
    """``method``'s scores of dataset example ``source`` as ``[output token, source token]`` (NaN
    where a token is not scored), with the output tokens' and the source tokens' labels."""
    examples, scores, tokens = r.table("examples"), r.table("scores"), r.table("tokens")
    units = examples[examples["source"] == source].sort_values("step")
    widest = int(units["example"].iloc[-1])  # target-side: the last token's input holds the output before it
    tok = tokens[tokens["example"] == widest].sort_values("position")
    columns = [display_token(str(t)) for t in tok["token"]]
    scored = tok["scored"].to_numpy(dtype=bool)
    sel = unit_rows(scores[scores["example"].isin(units["example"]) & (scores["method"] == method)], layer, head)
    table = sel.groupby(["example", "position"])["score"].mean().unstack("position")
    table = table.reindex(index=units["example"].to_numpy(), columns=range(len(columns)))
    values = table.to_numpy(dtype=np.float64, copy=True)
    values[:, ~scored] = np.nan  # the template's and special tokens (NaN past a target-side row's own input already)
    rows = [f"{int(s) + 1}: {display_token(str(t))}" for s, t in zip(units["step"], units["target_name"])]
    return values, rows, columns


def steps_section(r: StudyResult, w: Writer) -> Section | None:
    """None for a study that is not step by step."""
    from probe.report import figures as fg

    if not r.stepwise:
        return None
    examples = r.table("examples")
    per = examples.groupby("source")["step"].size()
    blocks = [Para(f"Each of the {r.n_examples} examples' output tokens ({r.n_units} in all, "
                   f"{per.min()}-{per.max()} per example) is a unit: explained, perturbed and compared on its own. "
                   "The statistics above are over the examples, each the mean of its output tokens, so an example "
                   "with a long output weighs as much as one with a short output.")]
    lines = step_lines(r)
    if len(lines):
        csv = w.csv("agreement_by_step", lines)
        blocks.append(w.figure("steps", fg.step_lines(lines, r.measure, r.reference),
                               f"Mean {r.measure} with {r.reference} at each output token (over the examples whose "
                               "output reached it; the marker's size shows how many), for the best attention unit, "
                               "the best gradient and a random ranking."))
        table = lines.pivot_table(index="step", columns="line", values="mean").reset_index()
        table.insert(0, "output token", table.pop("step") + 1)
        table.columns.name = None
        blocks.append(Table(table,
                            caption=f"mean {r.measure} per output token", csv=csv, max_rows=40))
    unit = best_attention_unit(r)
    grad = (r.verdict.best_gradient if r.verdict is not None else None) or best_gradient(r, r.reference)
    methods = [(unit["unit"], unit["explainer"], unit["layer"], unit["head"])] if unit else []
    if grad:
        methods.append((grad["explainer"], grad["explainer"], -1, -1))
    methods.append((r.reference, r.reference, -1, -1))
    for source in per.sort_values(ascending=False, kind="stable").index[:MATRIX_EXAMPLES]:
        text = str(examples[examples["source"] == source]["text"].iloc[0])
        for label, method, layer, head in methods:
            values, rows, columns = unit_matrix(r, int(source), method, layer, head)
            if not np.isfinite(values).any():
                continue
            name = f"matrix_e{int(source)}_{method}" + (f"_L{layer}" if layer >= 0 else "") + (
                f"_H{head}" if head >= 0 else "")
            png = fg.output_matrix(values, rows, columns, title=f"example {int(source)}: {label}", label=label)
            blocks.append(w.figure(name, png,
                                   f"Example {int(source)} ({text[:80]!r}): {label}'s score of each source token "
                                   "(columns) for each output token (rows, in the order written)."))
    return Section("steps", "Output tokens", blocks)
