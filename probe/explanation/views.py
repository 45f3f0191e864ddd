"""How an explanation shows itself: its notebook table (a token x method table per example, or a
generated text's output x source matrices), its plots, and the words that mark a method whose own
check failed. :class:`~probe.explanation.Explanation` calls these (``_repr_html_``, ``plot``,
``plot_matrix``, ``columns``); they read an explanation through :class:`Shown` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pandas as pd

from probe.display import FLAG_COLOUR, warning_html
from probe.errors import InputError
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

if TYPE_CHECKING:
    from probe.plots import Figure

__all__ = ["Shown", "explanation_html", "faded_columns", "flag_lines", "flag_words", "generated_groups",
           "generated_html", "matrix_heatmap", "method_rows", "read_at", "scores_figure"]


class Shown(Protocol):
    """What the views read of an explanation (:class:`probe.explanation.Explanation` is one)."""

    model: str
    examples: tuple[PreparedExample, ...]
    scores: Mapping[str, TokenScores]

    def __getitem__(self, method: str) -> TokenScores: ...

    def failed_checks(self, method: str | None = None, example: int | None = None) -> list: ...

    def outputs(self) -> list[tuple[int, ...]]: ...

    def matrix(self, method: str, text: int = 0, *, layer: int = -1, head: int | None = None) -> pd.DataFrame: ...

    def word_groups(self, index: int) -> list[tuple[str, tuple[int, ...]]]: ...


def flag_words(ex: Shown, method: str, example: int) -> str:
    """``"⚠ not converged"`` (the failed checks' words) where ``method`` is marked on ``example``, else ''."""
    from probe.names import FLAG_MARK

    words = list(dict.fromkeys(f.words for f in ex.failed_checks(method, example)))
    return f"{FLAG_MARK} {', '.join(words)}" if words else ""


def flag_lines(ex: Shown, example: int | None = None, method: str | None = None) -> list[str]:
    """One line per failed check (of ``method`` or any, on ``example``'s scores or any), with why."""
    from probe.names import FLAG_MARK

    lines = []
    for f in ex.failed_checks(method, example):
        if example is None:
            named = [f"{i} ({ex.examples[i].label_name!r})" if ex.examples[i].step is not None else str(i)
                     for i in f.examples]  # an output token: its text beside its index
            where = f" on examples {', '.join(named)}" if f.examples else ""
            lines.append(f"{FLAG_MARK} {f.method} {f.words}{where}: {f.detail}")
        else:
            lines.append(f"{FLAG_MARK} {f.method} {f.words} here: {f.note(example)}")
    return lines


def generated_groups(ex: Shown) -> list[tuple[int, ...]]:
    """``ex.outputs()`` where every example is an output token (a generated or step explanation), else []."""
    groups = ex.outputs()
    return groups if groups and sum(len(g) for g in groups) == len(ex.examples) else []


def read_at(ex: Shown, method: str, layer: int = -1, head: int | None = None) -> str:
    """Which layer (and head) a one-layer view of ``method`` shows, as words: ``"layer 5 of 0..5,
    head mean"``; "" for a token-level method."""
    result = ex[method]
    if not (result.per_head or result.per_layer) or not len(result.scores):
        return ""
    n_layers = int(result.scores[0].shape[0])
    shown = layer % n_layers if isinstance(layer, int) and -n_layers <= layer < n_layers else layer
    words = f"layer {shown} of 0..{n_layers - 1}" + (", the last" if shown == n_layers - 1 else "")
    if result.per_head:
        words += ", head mean" if head is None else f", head {head}"
    return words


def matrix_heatmap(ex: Shown, method: str, text: int = 0, *, layer: int = -1, head: int | None = None) -> Figure:
    """``ex.matrix(...)`` as a heatmap: output tokens down, source tokens across; a per-layer or
    per-head method at ``layer`` (default the last) and ``head`` (default their mean), which the
    title names; the prompt (a chat prompt's messages) above the map, wrapped, not cut. Returns
    a :class:`matplotlib.figure.Figure`."""
    from probe.display import prompt_text
    from probe.names import FLAG_MARK
    from probe.plots import matrix_figure

    frame = ex.matrix(method, text, layer=layer, head=head)
    at = read_at(ex, method, layer, head)  # which layer (and head) a per-layer method shows
    group = ex.outputs()[text]
    first = ex.examples[group[0]]
    marks = [flag_words(ex, method, i) for i in group]
    rows = [f"{FLAG_MARK} {r}" if mark else str(r) for r, mark in zip(frame.index, marks)]
    flagged = sum(bool(m) for m in marks)
    words = ", ".join(dict.fromkeys(m.split(" ", 1)[1] for m in marks if m))
    fig = matrix_figure(frame.to_numpy(), rows, [str(c) for c in frame.columns],
                        title=(f"{FLAG_MARK} {words} on {flagged} of {len(group)} output tokens; " if flagged
                               else "") + (f"{ex[method].label} ({at})" if at else ex[method].label),
                        subtitle=f"{ex.model}, text {text}: {prompt_text(first)}",
                        label=f"{method} score")
    for label, mark in zip(fig.axes[0].get_yticklabels(), marks):
        if mark:
            label.set_color(FLAG_COLOUR)
    return fig


def method_rows(ex: Shown, index: int, methods: Sequence[str] | None = None, *,
                marked: bool = False) -> dict[str, np.ndarray]:
    """Method label (``TokenScores.label``: ``saliency (L2)``) -> example ``index``'s ``[tokens]``
    row (per-layer and per-head methods: their last layer, heads averaged; the label says so).
    ``marked``: a method whose own check failed on this example says so in its label
    (``integrated_gradients (...) ⚠ not converged``)."""
    from probe.display import unit_row

    chosen = list(ex.scores) if methods is None else [methods] if isinstance(methods, str) else list(methods)
    rows = {}
    for method in chosen:
        values, what = unit_row(ex[method].scores[index].double().numpy())
        label = f"{ex[method].label} ({what})" if what else ex[method].label
        flagged = flag_words(ex, method, index) if marked else ""
        rows[f"{label} {flagged}" if flagged else label] = values
    return rows


def explanation_html(ex: Shown) -> str:
    from probe.display import MAX_EXAMPLES, block_html, clip, prompt_text, token_table_html

    if generated_groups(ex):
        return generated_html(ex)
    parts = [block_html(repr(ex), warning_html(flag_lines(ex)),
                        "cells shaded by each method's score over its largest |score| on the text's scored "
                        "tokens, written under its name (red positive, blue negative); a method at the "
                        "target's noise floor or whose own check failed is not shaded; grey: special tokens")]
    for i, example in enumerate(ex.examples[:MAX_EXAMPLES]):
        target = example.label_name if example.label_name is not None else example.label
        value = "" if example.original_value is None else f" = {example.original_value:.4g}"
        title = f"example {i}: {clip(prompt_text(example), 120)}"
        note = f"explained: {example.kind} of {target if target is not None else 'the continuation'}{value}"
        rows = method_rows(ex, i, marked=True)
        table = token_table_html(example.tokens, example.special, rows, faded_columns(ex, i, rows))
        parts.append(block_html(title, warning_html(flag_lines(ex, i)) + table, note))
    more = len(ex.examples) - MAX_EXAMPLES
    if more > 0:
        parts.append(block_html(f"... and {more} more example{'s' if more != 1 else ''} "
                                "(ex.to_pandas() has them all)", ""))
    return "<div>" + "".join(parts) + "</div>"


def faded_columns(ex: Shown, index: int, rows: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The columns of example ``index``'s table (``rows``: :func:`method_rows` with ``marked``, in the
    order of ``scores``) left unshaded, each with why: a method whose own check failed on it,
    and an intervention whose largest |effect| on the scored tokens is at or below the target's
    noise floor (:data:`probe.study.decide.NOISE_ULPS` float32 epsilons times the target's
    |value|: an explanation does not record its dtype, and float32's is the lowest floor)."""
    from probe.names import method_family
    from probe.study.decide import noise_floor

    example = ex.examples[index]
    special = np.asarray([bool(s) for s in example.special], dtype=bool)
    value = example.original_value
    floor = noise_floor(abs(float(value))) if value is not None and np.isfinite(value) else None
    faded = {}
    for method, (label, values) in zip(ex.scores, rows.items()):
        if flag_words(ex, method, index):
            faded[label] = "its own check failed"
            continue
        scored = np.abs(values[~special & np.isfinite(values)])
        if floor is not None and method_family(method) == "intervention" and scored.size and scored.max() <= floor:
            faded[label] = f"at the target's noise floor ({floor:.1e})"
    return faded


def generated_html(ex: Shown) -> str:
    """A generated (step) explanation as inseq shows one: per prompt (at most ``MAX_EXAMPLES``),
    its output, then one output x source matrix per method (``ex.matrix``; a per-layer method
    at its last layer, heads averaged, as its title says)."""
    from probe.display import (
        MAX_EXAMPLES,
        WHITESPACE_SIGNS,
        block_html,
        clip,
        matrix_table_html,
        prompt_text,
        shown_token,
    )

    groups = generated_groups(ex)
    parts = [block_html(repr(ex), warning_html(flag_lines(ex)),
                        "per prompt, one matrix per method: a row per output token (explained: that token given "
                        "the prompt and the output before it), a column per source token; cells shaded by the "
                        "method's score over the matrix's scored tokens (red positive, blue negative); grey: "
                        "special tokens; \u2423 a space, \u21b5 a newline, ## a word piece")]
    for t, group in enumerate(groups[:MAX_EXAMPLES]):
        steps = [ex.examples[i] for i in group]
        first, widest = steps[0], max(steps, key=lambda e: len(e.tokens))
        written = len(widest.tokens) - len(first.tokens)  # target-side: the output written before the last
        output = "".join(str(e.label_name) for e in steps)
        output = "".join(c if c == " " else WHITESPACE_SIGNS.get(c, c) for c in output)
        values = ", ".join(f"{shown_token(e.label_name)} {e.original_value:.3f}" for e in steps
                           if e.original_value is not None)
        note = (f"output ({len(steps)} token{'s' if len(steps) != 1 else ''}): {output}; {first.kind} of each: "
                f"{values}" + ("" if written else "; sources: the prompt (target_side=True scores the output "
                                                  "written before each token too)"))
        body = []
        for method, result in ex.scores.items():
            if not len(result.scores):
                continue
            marks = [flag_words(ex, method, i) for i in group]
            rows = [f"{e.output_index}: {shown_token(e.label_name)}" + (f" {mark}" if mark else "")
                    for e, mark in zip(steps, marks)]
            at = read_at(ex, method)
            table = matrix_table_html(ex.matrix(method, t).to_numpy(), rows, widest.tokens, widest.special,
                                      written)
            body.append(block_html(f"{result.label} ({at})" if at else result.label, table))
        parts.append(block_html(f"prompt {t}: {clip(prompt_text(first), 200)}", "".join(body), note))
    more = len(groups) - MAX_EXAMPLES
    if more > 0:
        parts.append(block_html(f"... and {more} more prompt{'s' if more != 1 else ''} "
                                "(ex.matrix(method, text) has each)", ""))
    return "<div>" + "".join(parts) + "</div>"


def scores_figure(ex: Shown, example: int = 0, methods: str | Sequence[str] | None = None, *, level: str = "token",
         agg: str = "sum") -> Figure:
    """Example ``example``'s token scores, one bar panel per method (default: all), the tokens
    on the x axis; per-layer and per-head methods show their last layer (heads averaged).
    ``level="word"``: the words on the x axis, each the ``agg`` of its tokens (as
    ``ex.to_pandas`` folds them). Returns a :class:`matplotlib.figure.Figure` (on its own Agg
    canvas; nothing global changed)."""
    from probe.display import clip, prompt_text, shown_token
    from probe.names import FLAG_MARK
    from probe.plots import PANEL_LABEL_WIDTH, mark_axes, token_scores_figure, wrap_label

    if isinstance(example, bool) or not isinstance(example, int) or not 0 <= example < len(ex.examples):
        raise InputError(f"example={example!r} is not an example of this explanation: use "
                         f"0..{len(ex.examples) - 1}")
    e = ex.examples[example]
    chosen = list(ex.scores) if methods is None else [methods] if isinstance(methods, str) else list(methods)
    marks = [flag_words(ex, m, example) for m in chosen]
    flagged = [m for m, mark in zip(chosen, marks) if mark]
    # a label naming its settings (integrated_gradients (baseline pad, specials replaced)) on lines that fit
    rows = {wrap_label(label, PANEL_LABEL_WIDTH): values for label, values in method_rows(ex, example, chosen).items()}
    shown, special = [shown_token(t) for t in e.tokens], [bool(s) for s in e.special]
    if level != "token":
        from probe.explainers.words import word_rows

        shown, special, rows = word_rows(level, ex.word_groups(example), special, rows, agg)
    fig = token_scores_figure(shown, rows, special,
                              title=(f"{FLAG_MARK} {', '.join(flagged)}: own check failed; " if flagged else "")
                              + f"{ex.model}, example {example}: {clip(prompt_text(e), 70)}")
    for ax, mark in zip(fig.axes, marks):
        mark_axes(ax, mark, FLAG_COLOUR)
    return fig
