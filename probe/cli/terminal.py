"""What the ``probe`` command line prints for ``probe explain``: its JSON and its tables, and text
from the model or the user shown as written. Imports rich inside functions (``probe --help`` stays fast)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from probe import registry
from probe.names import FLAG_MARK, printable

if TYPE_CHECKING:
    import torch
    from rich.table import Table

    from probe.explanation import Explanation
    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample


def plain(value: object) -> str:
    """Text from the model or the user, shown by rich as written: ``[bold]`` or ``[/]`` in a token,
    label or continuation is not markup, and a control character (ESC, a right-to-left override,
    ...) shows as an escape (:func:`probe.names.printable`) instead of acting on the terminal."""
    from rich.markup import escape

    return escape(printable(value))


def nan_to_none(values: Any) -> Any:
    if isinstance(values, list):
        return [nan_to_none(v) for v in values]
    return None if values is None or (isinstance(values, float) and math.isnan(values)) else values


def summary_column(scores: TokenScores, layer: int | None) -> torch.Tensor:
    """One number per token for the terminal table: per-head scores are averaged over heads."""
    values = scores.scores[0]
    if scores.per_head:
        values = values[layer if layer is not None else -1].nanmean(dim=0)
    elif scores.per_layer:
        values = values[layer if layer is not None else -1]
    return values


def explain_params(chosen: Iterable[str], *, steps: int | str | None, seed: int, site: str | None) -> dict[str, dict]:
    """``probe explain``'s keyword parameters per method: ``--steps`` for the path methods whose
    points the registry counts in steps (integrated gradients; None: their default, which is
    ``auto`` for output tokens), ``--seed`` for every method the registry says takes one,
    ``--site`` for the gradient methods."""
    params: dict[str, dict] = ({} if steps is None else
                               {m.name: {"steps": steps} for m in registry.methods() if m.points == "steps"})
    params.update({name: {"seed": seed} for name in registry.seeded()})
    if site is not None:
        for name in chosen:
            if registry.method(name).family == "gradient":
                params.setdefault(name, {})["site"] = site
    return params


def no_score_reasons(results: Mapping, skipped: dict[str, str]) -> None:
    """Adds to ``skipped`` each method that gave no score for this input, with why."""
    for name, result in results.items():
        values = result.scores[0]
        if name not in skipped and values.numel() and not bool(values.isfinite().any()):
            skipped[name] = "no score for this input" + (
                f" (limited to {result.params['max_tokens']} tokens)" if "max_tokens" in result.params else "")


def specials_left_out(result: TokenScores) -> bool:
    """Whether ``probe explain`` leaves special tokens' scores out of ``result``'s column (null in
    ``--json``, ``-`` in the table): a token-level method's, whose rankings leave them out; a per-layer
    or per-head method's are shown (attention to [CLS] is part of the map)."""
    return not (result.per_head or result.per_layer)


class WordView:
    """One text's words as ``probe explain --words`` shows them in place of its tokens: each word's
    text, whether it is a special token, and its tokens' ids; the target is the text's."""

    def __init__(self, example: PreparedExample, words: list[tuple[str, tuple[int, ...]]]) -> None:
        self.example = example
        self.tokens = [text for text, _ in words]
        self.special = [bool(example.special[group[0]]) for _, group in words]
        self.input_ids = [[int(example.input_ids[i]) for i in group] for _, group in words]

    def describe(self) -> dict:
        return self.example.describe()


def word_view(explanation: Explanation, agg: str = "sum") -> tuple[WordView, dict]:
    """The first text of ``explanation`` at word level: its :class:`WordView` and every method's scores
    folded into its words (``agg`` of each word's tokens, NaN-aware, as ``to_pandas("word")`` folds them)."""
    import dataclasses

    from probe.explainers.words import aggregate

    words = explanation.word_groups(0)
    groups = [list(group) for _, group in words]
    results = {name: dataclasses.replace(result, scores=[aggregate(result.scores[0], groups, agg)])
               for name, result in explanation.scores.items()}
    return WordView(explanation.examples[0], words), results


def print_explain_json(pm: ProbeModel, example: PreparedExample | WordView, results: Mapping, skipped: dict,
                       checks: list) -> None:
    scores: dict[str, Any] = {}
    for name, result in results.items():
        values = nan_to_none(result.scores[0].tolist())
        if specials_left_out(result):
            values = [None if example.special[i] else v for i, v in enumerate(values)]
        scores[name] = values
    print(json.dumps({"model_path": pm.path, "level": "word" if isinstance(example, WordView) else "token",
                      "tokens": example.tokens, "token_ids": example.input_ids,
                      "target": example.describe(), "scores": scores,
                      "params": {name: dict(r.params) for name, r in results.items()},
                      "labels": {name: r.label for name, r in results.items()},
                      "skipped": skipped, "sanity": [c.to_dict() for c in checks],
                      "random_weights": list(pm.random_weights),
                      "allow_random_weights": pm.allow_random_weights}, default=str))


def print_explain_tables(pm: ProbeModel, example: PreparedExample | WordView, results: Mapping, skipped: dict,
                         checks: list, layer: int | None) -> None:
    """The target line, what was skipped, the sanity summary and one table per family."""
    from rich.console import Console

    from probe.study.sanity import summary_lines

    console = Console()
    target = example.describe()
    # a contrast's label already reads "A vs B": the number is the difference of the two
    what = (f"{target['kind']} difference {target['label']}" if "contrast" in target
            else f"{target['kind']} of {target['label']!r}")
    console.print(plain(f"target: {what} = {target['value']:.4f}  "
                        f"({pm.contract.implementation}, {pm.contract.dtype}, {pm.contract.device})"))
    if pm.random_weights:
        console.print(f"[bold red]random weights (allowed explicitly):[/] {plain(', '.join(pm.random_weights))}")
    for name, reason in skipped.items():
        console.print(f"[dim]skipped {name}: {plain(reason)}[/]")
    for line in summary_lines(checks):
        console.print(printable(line), markup=False, highlight=False)
    failed = {c.method for c in checks if c.status == "fail"}
    shown_layer = layer if layer is not None else pm.contract.n_layers - 1
    titles = {"attention": f"attention methods at layer {shown_layer} (head mean where per head)",
              "gradient": "gradient methods", "intervention": "leave-one-out: f(x) - f(x perturbed)"}
    # One table per family keeps each within an ordinary terminal's width.
    for kind, title in titles.items():
        names = [name for name in results if registry.method(name).family == kind]
        if names:  # a method whose own check failed (the sanity line above says which) is marked in its header
            console.print(_family_table(title, example, {
                results[name].label + (f" {FLAG_MARK}" if name in failed else ""):
                    (summary_column(results[name], layer), specials_left_out(results[name])) for name in names}))
    console.print("[dim]* special token: excluded from rankings by default; - where a method's score for it is "
                  "not shown (null in --json); interventions never score it[/]")


def _family_table(title: str, example, columns: Mapping):
    """``columns``: label -> (``[tokens]`` values, whether special tokens are left out: ``-``)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("word" if isinstance(example, WordView) else "token")
    for name in columns:
        table.add_column(name.replace("_", " "), justify="right", overflow="fold")
    for i, token in enumerate(example.tokens):
        cells = []
        for values, left_out in columns.values():
            value = float(values[i])
            cells.append("-" if left_out and example.special[i] else "" if value != value else f"{value:.3f}")
        table.add_row(plain(_shown(token) + (" *" if example.special[i] else "")), *cells)
    return fitted(table)


def print_generation_tables(pm: ProbeModel, explanation: Explanation, layer: int | None) -> None:
    """``probe explain --generate``: the output, then per method a table of the prompt's tokens
    (rows) by the generated tokens (columns), each cell the token's score for that output token."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    group = explanation.outputs()[0]
    steps = [explanation.examples[i] for i in group]
    first = steps[0]
    output = "".join(str(e.label_name) for e in steps)  # a step's label_name is its token, never None
    console.print(plain(f"output ({len(steps)} tokens, {first.kind} of each given the prompt and the output before "
                        f"it): "
                        f"{output!r}  ({pm.contract.implementation}, {pm.contract.dtype}, {pm.contract.device})"))
    console.print(plain("per token: " + ", ".join(f"{_shown(e.label_name)} {e.original_value:.3f}" for e in steps)))
    if pm.random_weights:
        console.print(f"[bold red]random weights (allowed explicitly):[/] {plain(', '.join(pm.random_weights))}")
    for line in generation_flag_lines(explanation):
        console.print(f"[bold red]{plain(line)}[/]")
    shown_layer = layer if layer is not None else -1
    for name in explanation.scores:
        result = explanation[name]
        where = (f" at layer {shown_layer if shown_layer >= 0 else pm.contract.n_layers - 1}"
                 + (" (head mean)" if result.per_head else "")) if result.per_head or result.per_layer else ""
        frame = explanation.matrix(name, 0, layer=shown_layer)
        table = Table(title=f"{result.label}{where}: rows prompt tokens, columns output tokens")
        table.add_column("token")
        for j, (i, e) in enumerate(zip(group, steps)):
            # a check failed on this token's scores
            mark = f" {FLAG_MARK}" if explanation.failed_checks(name, i) else ""
            table.add_column(plain(f"{j}:{_shown(e.label_name)}{mark}"), justify="right", overflow="fold")
        values = frame.to_numpy()  # [output, source]; target-side: the last row's source runs over the output too
        widest = steps[-1]
        for p, token in enumerate(widest.tokens):
            cells = ["" if v != v else f"{v:.3f}" for v in values[:, p].tolist()]
            written = " (output)" if p >= len(first.tokens) else ""
            table.add_row(plain(_shown(token) + (" *" if widest.special[p] else "") + written), *cells)
        console.print(fitted(table))
    console.print("[dim]* special token: not scored by interventions, excluded from rankings by default[/]")


def generation_flag_lines(explanation: Explanation) -> list[str]:
    """A line per method and output token (of the first text) whose scores failed the method's own
    check: ``⚠ integrated_gradients not converged on output token 1 '.': completeness delta ...``."""
    group = explanation.outputs()[0]
    lines = []
    for flag in explanation.failed_checks():
        if not flag.examples:
            lines.append(f"{FLAG_MARK} {flag.method} {flag.words}: {flag.detail}")
            continue
        for j, i in enumerate(group):
            if i in flag.examples:
                lines.append(f"{FLAG_MARK} {flag.method} {flag.words} on output token {j} "
                             f"'{_shown(explanation.examples[i].label_name)}': {flag.note(i)}")
    return lines


def _shown(token: str) -> str:
    """A token on one line, its whitespace visible (:func:`probe.display.shown_token`: ``↵``, ``␣``)."""
    from probe.display import shown_token  # pandas: not at import (``probe --help`` stays fast)

    return shown_token(token)


def fitted(table: Table) -> _FittedTable:
    """``table`` (rich) as a renderable that never breaks a number across lines: every column after
    the first (the tokens) as wide as its widest cell, and where they do not all fit the width
    (a pipe's 80 columns), several tables, each the first column and as many others as fit."""
    return _FittedTable(table)


#: the width a token takes in a terminal table before it folds onto a second line
TOKEN_WIDTH = 16


class _FittedTable:
    def __init__(self, table):
        self.table = table

    def _part(self, indices: list[int], note: str):
        from rich.table import Table

        table = self.table
        title = table.title if not note or table.title is None else f"{table.title} {note}"
        part = Table(title=title, box=table.box, show_lines=table.show_lines)
        cells = [list(c.cells) for c in table.columns]
        for i in [0, *indices]:
            c = table.columns[i]
            part.add_column(c.header, justify=c.justify, overflow=c.overflow, no_wrap=c.no_wrap, min_width=c.min_width)
        for r in range(table.row_count):
            part.add_row(*[cells[i][r] for i in [0, *indices]])
        return part

    def __rich_console__(self, console, options):
        from rich.measure import Measurement
        from rich.text import Text

        columns = self.table.columns
        for k, column in enumerate(columns):
            widths = [Text.from_markup(c).cell_len if isinstance(c, str) else 0 for c in column.cells]
            # numbers whole; a token up to TOKEN_WIDTH before it folds (never cut to "c…")
            column.min_width = max([column.min_width or 0, *widths]) if k else min(max(widths, default=1), TOKEN_WIDTH)
            column.overflow = "fold"
        unbounded = options.update(max_width=10**6)  # Measurement.get clamps to the width it is given
        chunks: list[list[int]] = [[]]
        for i in range(1, len(columns)):
            needed = Measurement.get(console, unbounded, self._part([*chunks[-1], i], "")).minimum if chunks[-1] else 0
            if needed > options.max_width:
                chunks.append([])
            chunks[-1].append(i)
        if len(chunks) == 1:
            yield self._part(chunks[0], "")
            return
        for k, chunk in enumerate(chunks):
            yield self._part(chunk, f"({k + 1} of {len(chunks)})")


def print_generation_json(pm: ProbeModel, explanation: Explanation, skipped: dict) -> None:
    group = explanation.outputs()[0]
    steps = [explanation.examples[i] for i in group]
    scores = {name: nan_to_none(explanation.stacked(name, 0).tolist()) for name in explanation.scores}
    widest = steps[-1]  # target-side: its input is the prompt and every output token before the last
    print(json.dumps({"model_path": pm.path, "tokens": widest.tokens, "token_ids": widest.input_ids,
                      "prompt_tokens": len(steps[0].input_ids),
                      "output": [{"step": e.output_index, "token": e.label_name,
                                  "token_id": e.target_ids[e.step if e.step is not None else 0],
                                  "kind": e.kind, "value": e.original_value} for e in steps],
                      "scores": scores, "axes": {name: ["output token", *explanation[name].axes]
                                                 for name in explanation.scores},
                      "params": {name: dict(r.params) for name, r in explanation.scores.items()},
                      # the methods' failed checks; their "examples" index "output" (one text)
                      "failed_checks": [f.to_dict() for f in explanation.failed_checks()],
                      "skipped": skipped, "random_weights": list(pm.random_weights)}, default=str))
