"""What the ``probe`` command line prints for ``probe explain``: its JSON and its tables, and text
from the model or the user shown as written. Imports rich inside functions (``probe --help`` stays fast)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from probe import registry
from probe.names import printable

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def plain(value) -> str:
    """Text from the model or the user, shown by rich as written: ``[bold]`` or ``[/]`` in a token,
    label or continuation is not markup, and a control character (ESC, a right-to-left override,
    ...) shows as an escape (:func:`probe.names.printable`) instead of acting on the terminal."""
    from rich.markup import escape

    return escape(printable(value))


def nan_to_none(values):
    if isinstance(values, list):
        return [nan_to_none(v) for v in values]
    return None if values is None or (isinstance(values, float) and math.isnan(values)) else values


def summary_column(scores, layer: int | None):
    """One number per token for the terminal table: per-head scores are averaged over heads."""
    values = scores.scores[0]
    if scores.per_head:
        values = values[layer if layer is not None else -1].nanmean(dim=0)
    elif scores.per_layer:
        values = values[layer if layer is not None else -1]
    return values


def explain_params(chosen, *, steps: int, seed: int, site: str | None) -> dict[str, dict]:
    """``probe explain``'s keyword parameters per method: ``--steps`` for the path methods whose
    points the registry counts in steps (integrated gradients), ``--seed`` for every method the
    registry says takes one, ``--site`` for the gradient methods."""
    params: dict[str, dict] = {m.name: {"steps": steps} for m in registry.methods() if m.points == "steps"}
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


def print_explain_json(pm: ProbeModel, example, results: Mapping, skipped: dict, checks: list) -> None:
    scores: dict[str, Any] = {}
    for name, result in results.items():
        values = result.scores[0].tolist()
        if result.per_head or result.per_layer:
            scores[name] = nan_to_none(values)
        else:
            scores[name] = [None if example.special[i] else v for i, v in enumerate(nan_to_none(values))]
    print(json.dumps({"model_path": pm.path, "tokens": example.tokens, "token_ids": example.input_ids,
                      "target": example.describe(), "scores": scores,
                      "params": {name: dict(r.params) for name, r in results.items()},
                      "skipped": skipped, "sanity": [c.to_dict() for c in checks],
                      "random_weights": list(pm.random_weights),
                      "allow_random_weights": pm.allow_random_weights}, default=str))


def print_explain_tables(pm: ProbeModel, example, results: Mapping, skipped: dict, checks: list,
                         layer: int | None) -> None:
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
    shown_layer = layer if layer is not None else pm.contract.n_layers - 1
    titles = {"attention": f"attention methods at layer {shown_layer} (head mean where per head)",
              "gradient": "gradient methods", "intervention": "leave-one-out: f(x) - f(x perturbed)"}
    # One table per family keeps each within an ordinary terminal's width.
    for kind, title in titles.items():
        names = [name for name in results if registry.method(name).family == kind]
        if names:
            console.print(_family_table(title, example, {name: summary_column(results[name], layer) for name in names}))
    console.print("[dim]* special token: not scored by interventions, excluded from rankings by default[/]")


def _family_table(title: str, example, columns: Mapping):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("token")
    for name in columns:
        table.add_column(name.replace("_", " "), justify="right", overflow="fold")
    for i, token in enumerate(example.tokens):
        cells = []
        for values in columns.values():
            value = float(values[i])
            cells.append("" if value != value else f"{value:.3f}")
        table.add_row(plain(token + (" *" if example.special[i] else "")), *cells)
    return table


def print_generation_tables(pm: ProbeModel, explanation, layer: int | None) -> None:
    """``probe explain --generate``: the output, then per method a table of the prompt's tokens
    (rows) by the generated tokens (columns), each cell the token's score for that output token."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    group = explanation.outputs()[0]
    steps = [explanation.examples[i] for i in group]
    first = steps[0]
    output = "".join(e.label_name for e in steps)
    console.print(plain(f"output ({len(steps)} tokens, {first.kind} of each given the prompt and the output before it): "
                        f"{output!r}  ({pm.contract.implementation}, {pm.contract.dtype}, {pm.contract.device})"))
    console.print(plain("per token: " + ", ".join(f"{_shown(e.label_name)} {e.original_value:.3f}" for e in steps)))
    if pm.random_weights:
        console.print(f"[bold red]random weights (allowed explicitly):[/] {plain(', '.join(pm.random_weights))}")
    shown_layer = layer if layer is not None else -1
    for name in explanation.scores:
        result = explanation[name]
        where = (f" at layer {shown_layer if shown_layer >= 0 else pm.contract.n_layers - 1}"
                 + (" (head mean)" if result.per_head else "")) if result.per_head or result.per_layer else ""
        frame = explanation.matrix(name, 0, layer=shown_layer)
        table = Table(title=f"{name}{where}: rows prompt tokens, columns output tokens")
        table.add_column("token")
        for j, e in enumerate(steps):
            table.add_column(plain(f"{j}:{_shown(e.label_name)}"), justify="right", overflow="fold")
        values = frame.to_numpy()  # [output, source]; target-side: the last row's source runs over the output too
        widest = steps[-1]
        for p, token in enumerate(widest.tokens):
            cells = ["" if v != v else f"{v:.3f}" for v in values[:, p].tolist()]
            written = " (output)" if p >= len(first.tokens) else ""
            table.add_row(plain(token + (" *" if widest.special[p] else "") + written), *cells)
        console.print(table)
    console.print("[dim]* special token: not scored by interventions, excluded from rankings by default[/]")


def _shown(token: str) -> str:
    """An output token on one line: newlines and tabs as escapes."""
    return json.dumps(token, ensure_ascii=False)[1:-1]


def print_generation_json(pm: ProbeModel, explanation, skipped: dict) -> None:
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
                      "skipped": skipped, "random_weights": list(pm.random_weights)}, default=str))
