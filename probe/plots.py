"""Figures any result draws: matplotlib's Agg canvas (no pyplot, no GUI backend, nothing global
changed), the baseline bands, the per-layer agreement lines, token scores and attention heatmaps.

The report (:mod:`probe.report.figures`) turns these figures into PNG bytes; the results' own
``.plot()`` methods hand them back as :class:`matplotlib.figure.Figure` for a notebook to show.
This module imports matplotlib, so the results import it only inside ``.plot()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as _MatplotlibFigure
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI = 100
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
          "#7f7f7f"]


@dataclass(frozen=True)
class BandStyle:
    """How a baseline, the ceiling or the best gradient is drawn, and the words a caption uses for it."""

    color: str
    style: str
    alpha: float
    words: str  # "grey", "orange, dash-dot": what a caption says to point at it


#: the baselines, the ceiling and the best gradient: one style each, shared by every figure and caption
BAND_STYLES = {
    "random": BandStyle("#7f7f7f", "--", 0.18, "grey"),
    "uniform": BandStyle("#000000", ":", 0.18, "black, dotted"),
    "position": BandStyle("#ff7f0e", "-.", 0.10, "orange, dash-dot"),
    "ceiling": BandStyle("#2ca02c", "-", 0.15, "green"),
    "gradient": BandStyle("#9467bd", "--", 0.0, "purple, dashed"),
}
#: explainers' colours: none of them is a baseline's, the ceiling's or the best gradient's (a line
#: must never read as a band); past their number, markers and line styles tell the lines apart
EXPLAINER_COLORS = ["#1f77b4", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#08306b", "#b8860b"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*"]
LINE_STYLES = ["-", "--", "-.", ":"]


def explainer_style(j: int) -> dict:
    """The ``j``-th explainer's colour, marker and line style: no two of the first
    ``len(EXPLAINER_COLORS) * len(MARKERS)`` (88: the two lengths are coprime) look alike."""
    n = len(EXPLAINER_COLORS)
    return {"color": EXPLAINER_COLORS[j % n], "marker": MARKERS[j % len(MARKERS)],
            "linestyle": LINE_STYLES[(j // n) % len(LINE_STYLES)]}


MEASURE_LABEL = {"kendall_tau": "Kendall tau-b", "spearman": "Spearman rho"}


class Figure(_MatplotlibFigure):
    """A matplotlib figure that a notebook shows as a picture by itself (``_repr_png_``), with no
    pyplot and no ``%matplotlib inline``: probe's figures live on their own Agg canvas."""

    def _repr_png_(self) -> bytes:
        import io

        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=DPI)
        return buffer.getvalue()


@dataclass
class Band:
    """A baseline (or the ceiling) drawn across a panel: its mean and, where known, its CI."""

    label: str
    mean: float
    low: float | None
    high: float | None


def measure_label(measure: str) -> str:
    if measure.startswith("top") and measure[3:].isdigit():
        return f"top-{measure[3:]} overlap"
    return MEASURE_LABEL.get(measure, measure)


#: characters per line of a legend entry: two columns of them fit under a report panel
LEGEND_WIDTH = 44
#: characters a method's label beside its panel takes on one line (wrapped beyond: the panel keeps its width)
PANEL_LABEL_WIDTH = 28


def wrap_label(text: str, width: int = LEGEND_WIDTH) -> str:
    """``text`` broken into lines of at most ``width`` characters (a legend entry that stays in its panel)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


#: lines a figure's subtitle (a prompt) may take before the rest is cut with an ellipsis
SUBTITLE_LINES = 4


def wrapped_lines(text: str, width: int, limit: int) -> str:
    """``text`` (on one line: newlines as spaces) in lines of at most ``width`` characters, at most
    ``limit`` of them, the last ending in an ellipsis where text was left out."""
    import textwrap

    lines = textwrap.wrap(" ".join(str(text).split()), width) or [""]
    if len(lines) > limit:
        lines = lines[:limit]
        lines[-1] = lines[-1][: max(width - 1, 1)] + "\u2026"
    return "\n".join(lines)


def new_figure(width: float, height: float) -> Figure:
    """A figure on its own Agg canvas, laid out by constrained layout (legends and labels inside)."""
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def set_title(fig: Figure, text: str) -> None:
    """``text`` as the figure's title, cut to what its width holds (a model's path can be long)."""
    limit = max(int(fig.get_figwidth() * 11), 20)
    fig.suptitle(text if len(text) <= limit else text[: limit - 1] + "\u2026", fontsize=10)


def draw_band(ax: Axes, band: Band | None, color: str, label: str, *, alpha: float = 0.18, style: str = "--") -> None:
    if band is None:
        return
    if band.low is not None and band.high is not None and band.high > band.low:
        ax.axhspan(band.low, band.high, color=color, alpha=alpha, lw=0,
                   label=f"{label} {band.mean:+.3f} [{band.low:+.3f}, {band.high:+.3f}]")
        ax.axhline(band.mean, color=color, lw=0.8, ls=style)
    else:
        ax.axhline(band.mean, color=color, lw=1.2, ls=style, label=f"{label} {band.mean:+.3f}")


def draw_bands(ax: Axes, bands: Mapping[str, Band]) -> None:
    """The random, uniform and position baselines and the ceiling, those of ``bands`` that exist."""
    for name in ("random", "uniform", "position", "ceiling"):
        band = bands.get(name)
        if band is not None:
            style = BAND_STYLES[name]
            draw_band(ax, band, style.color, band.label if name == "ceiling" else name, alpha=style.alpha,
                      style=style.style)


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def bands_caption(bands: Sequence[Mapping[str, Band]], gradient: bool = False) -> str:
    """The words for what :func:`draw_bands` (and, with ``gradient``, the best-gradient line) drew
    on any of the panels whose ``bands`` are given: "the random (grey) and position (orange,
    dash-dot) baselines and the ceiling (green)"; "" when nothing was drawn."""
    present = {name for b in bands for name in b if name in BAND_STYLES}
    baselines = [f"{name} ({BAND_STYLES[name].words})" for name in ("random", "uniform", "position") if name in present]
    parts = []
    if baselines:
        parts.append(f"the {_and(baselines)} baseline{'s' if len(baselines) > 1 else ''}")
    if "ceiling" in present:
        parts.append(f"the ceiling ({BAND_STYLES['ceiling'].words})")
    if gradient:
        parts.append(f"the best gradient ({BAND_STYLES['gradient'].words})")
    return _and(parts) if parts else ""


#: the width (in layers) over which the CI bars of one layer's explainers are spread
CI_SPREAD = 0.5


def ci_offset(j: int, n: int) -> float:
    """Where the ``j``-th of ``n`` explainers draws its CI bars, in layers from the layer itself:
    spread evenly over at most :data:`CI_SPREAD`, centred on the layer, each explainer at its own."""
    if n <= 1:
        return 0.0
    step = min(CI_SPREAD / (n - 1), 0.12)
    return (j - (n - 1) / 2) * step


def layer_lines_figure(lines_by_ref: Mapping[str, Mapping], bands_by_ref: Mapping[str, Mapping[str, Band]],
                       gradients: Mapping[str, dict | None], measure: str, notes: Mapping[str, str] | None = None,
                       *, points_only: bool = False, title: str = "", note: str = "") -> Figure:
    """Per reference: mean agreement per layer (with CI) of each per-layer explainer, beside the
    baselines, the ceiling and the best gradient (a token-level method: a horizontal line). Each
    explainer's line joins its means at the layers themselves; its CIs are thin bars in its colour,
    each explainer's shifted by its own :func:`ci_offset` beside the layer, so that the intervals of
    several explainers never pile into one shaded area.

    ``lines_by_ref``: reference -> explainer -> a frame with ``layer``, ``mean``, ``ci_low``,
    ``ci_high``. ``notes``: explainer -> a remark put in its legend entry (its redundant layers).
    ``points_only``: the layers given are a selection (a verdict's best and worst units), drawn as
    points with CI bars and not joined into a line. ``note``: what the figure leaves out, under it."""
    notes = notes or {}
    refs = list(lines_by_ref)
    cols = min(len(refs), 2)
    rows = math.ceil(len(refs) / cols)
    fig = new_figure(6.2 * cols, 5.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ref in enumerate(refs):
        ax = axes[i // cols][i % cols]
        draw_bands(ax, bands_by_ref.get(ref, {}))
        grad = gradients.get(ref)
        if grad is not None:
            ax.axhline(grad["mean"], color=BAND_STYLES["gradient"].color, lw=1.4, ls=BAND_STYLES["gradient"].style,
                       label=f"best gradient ({grad['explainer']}) {grad['mean']:+.3f}")
        n_lines = len(lines_by_ref[ref])
        for j, (explainer, frame) in enumerate(lines_by_ref[ref].items()):
            style = explainer_style(j)
            color = style["color"]
            x = frame["layer"].to_numpy()
            label = wrap_label(f"{explainer} ({notes[explainer]})" if explainer in notes else explainer)
            mean = frame["mean"].to_numpy(dtype=float)
            low, high = frame["ci_low"].to_numpy(dtype=float), frame["ci_high"].to_numpy(dtype=float)
            if points_only:
                bars = np.vstack([mean - np.where(np.isfinite(low), low, mean),
                                  np.where(np.isfinite(high), high, mean) - mean])
                ax.errorbar(x, mean, yerr=bars, fmt=style["marker"], ms=4, color=color, capsize=3, lw=1.2, label=label)
                continue
            ax.plot(x, mean, marker=style["marker"], ms=3.5, color=color, ls=style["linestyle"], label=label)
            known = np.isfinite(low) & np.isfinite(high)
            if known.any():  # its CIs as thin bars beside the layer, each method at its own offset
                ax.vlines(x[known] + ci_offset(j, n_lines), low[known], high[known], color=color, lw=1.1, alpha=0.75)
        ax.set_title(f"vs {ref}", fontsize=10)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"mean {measure_label(measure)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    for j in range(len(refs), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    if title:
        set_title(fig, title)
    set_note(fig, note)
    return fig


def set_note(fig: Figure, text: str) -> None:
    """``text`` (what the figure leaves out) under the figure, wrapped to its width; nothing where empty."""
    if text:
        fig.supxlabel(wrap_label(text, max(int(fig.get_figwidth() * 13), 40)), fontsize=8, color="#555555")


#: the tallest a token-score figure grows (inches): past it, many methods' panels get shorter
MAX_SCORES_HEIGHT = 12.0
#: a method's panel: its height while the figure is under :data:`MAX_SCORES_HEIGHT`, and the least
#: it shrinks to (past that, the panels go into side-by-side columns)
PANEL_HEIGHT = 1.5
MIN_PANEL_HEIGHT = 0.55
SCORES_MARGIN = 1.4  # inches of the title and the rotated tokens under the bottom panels
SPECIAL_COLOR = "#d6d6d6"
CLIPPED_MARK_COLOR = "#8a8a8a"


def scored_limits(values: np.ndarray, special: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    """The y range of one method's bar panel: 0 and the finite scores of the non-special tokens,
    padded by ``pad`` of their span, so that a special token's bar (rollout's [CLS] at 0.66 beside
    real tokens at 0.02) never sets the scale. Only where no non-special token is scored do the
    special ones set it; (-1, 1) where nothing finite is left."""
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    chosen = values[finite & ~special]
    if not chosen.size:
        chosen = values[finite]
    if not chosen.size:
        return -1.0, 1.0
    low, high = min(float(chosen.min()), 0.0), max(float(chosen.max()), 0.0)
    span = high - low
    if span <= 0:
        return -1.0, 1.0
    return (low - pad * span if low < 0 else 0.0), (high + pad * span if high > 0 else 0.0)


def scores_layout(n_methods: int) -> tuple[int, int, float]:
    """(columns, panels per column, panel height in inches) of a token-score figure: one column
    of :data:`PANEL_HEIGHT` panels while they fit under :data:`MAX_SCORES_HEIGHT`, then shorter ones
    down to :data:`MIN_PANEL_HEIGHT`, then as many columns as keep them at least that tall."""
    room = MAX_SCORES_HEIGHT - SCORES_MARGIN
    per_column = max(int(room // MIN_PANEL_HEIGHT), 1)
    columns = max(math.ceil(n_methods / per_column), 1)
    rows = max(math.ceil(n_methods / columns), 1)
    return columns, rows, min(PANEL_HEIGHT, room / rows)


def token_scores_figure(tokens: Sequence[str], rows: Mapping[str, np.ndarray], special: Sequence[bool],
                        title: str = "") -> Figure:
    """One bar panel per method (``rows``: label -> ``[tokens]`` scores, NaN: not scored), the
    tokens on the x axis of each column's bottom panel, rotated; special tokens' bars and labels
    grey. Each panel's y range is set by its non-special tokens (:func:`scored_limits`): a special
    token's bar beyond it is cut at the panel's edge and marked there with a grey triangle (up at
    the top, down at the bottom). The figure is at most :data:`MAX_SCORES_HEIGHT` inches tall
    (:func:`scores_layout`: many methods get shorter panels, then columns); ``fig.axes`` holds the
    panels in the order of ``rows``, down each column."""
    n_tokens = len(tokens)
    names = list(rows)
    special = np.asarray([bool(s) for s in special], dtype=bool)
    columns, per_column, panel = scores_layout(len(names))
    width = min(max(4.5, 0.32 * n_tokens + 2.0), 30.0 if columns == 1 else 16.0)
    fig = new_figure(width * columns, panel * per_column + SCORES_MARGIN)
    grid = fig.add_gridspec(per_column, columns)
    compact = panel < PANEL_HEIGHT
    x = np.arange(n_tokens)
    axes: list[Axes] = []
    for j, name in enumerate(names):
        row, column = j % per_column, j // per_column
        ax = fig.add_subplot(grid[row, column], sharex=axes[column * per_column] if row else None)
        axes.append(ax)
        values = np.asarray(rows[name], dtype=float)
        shown = np.where(np.isfinite(values), values, 0.0)
        colors = [SPECIAL_COLOR if special[i] else ("#d64541" if shown[i] >= 0 else "#316ec8") for i in range(n_tokens)]
        ax.bar(x, shown, color=colors, width=0.8)
        low, high = scored_limits(values, special)
        ax.set_ylim(low, high)
        for edge, beyond, marker in ((high, shown > high, "^"), (low, shown < low, "v")):
            cut = np.flatnonzero(beyond & special)
            if cut.size:  # a special token's bar cut at the edge: marked there, not setting the scale
                ax.plot(cut, np.full(cut.size, edge), ls="none", marker=marker, ms=4, color=CLIPPED_MARK_COLOR,
                        clip_on=False)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_ylabel(name, fontsize=7 if compact else 8, rotation=0, ha="right", va="center")
        ax.tick_params(axis="y", labelsize=6 if compact else 7)
        if compact:
            ax.yaxis.set_major_locator(MaxNLocator(nbins=3))
        ax.grid(axis="y", alpha=0.3)
        last = row == per_column - 1 or j == len(names) - 1
        if not last:
            ax.tick_params(axis="x", labelbottom=False)
            continue
        ax.set_xticks(x, list(tokens), rotation=60, ha="right", rotation_mode="anchor", fontsize=8)
        ax.set_xlim(-0.6, n_tokens - 0.4)
        for i, label in enumerate(ax.get_xticklabels()):
            if special[i]:
                label.set_color("#8a8a8a")
    if title:
        set_title(fig, title)
    return fig


def attention_figure(weights: np.ndarray, query_positions: Sequence[int], tokens: Sequence[str] | None = None,
                     title: str = "", query_tokens: Sequence[str] | None = None) -> Figure:
    """A ``[query, key]`` attention map as a heatmap, with the token texts on both axes when given:
    ``tokens`` one per key column, ``query_tokens`` one per query row (default: ``tokens`` at
    ``query_positions``, the rows' positions among the keys)."""
    n_query, n_key = weights.shape
    side = min(max(4.0, 0.3 * n_key + 2.5), 16.0)
    fig = new_figure(side + 1.2, min(max(2.2, 0.3 * n_query + 2.5), 16.0))
    ax = fig.subplots()
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=max(float(np.nanmax(weights)), 1e-9) if weights.size else 1.0,
                      aspect="auto", interpolation="nearest")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if tokens is not None:
        ax.set_xticks(range(n_key), [tokens[k] for k in range(n_key)], rotation=60, ha="right",
                      rotation_mode="anchor", fontsize=7)
        if query_tokens is None:
            query_tokens = [tokens[q] if 0 <= q < len(tokens) else str(q) for q in query_positions]
        ax.set_yticks(range(n_query), list(query_tokens), fontsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if n_query <= 40:
            ax.set_yticks(range(n_query), [str(q) for q in query_positions])
    fig.colorbar(image, ax=ax, shrink=0.85, label="attention weight")
    if title:
        set_title(fig, title)
    return fig


def matrix_figure(values: np.ndarray, rows: Sequence[str], columns: Sequence[str], *, title: str = "",
                  label: str = "score", subtitle: str = "") -> Figure:
    """A ``[row, column]`` matrix of scores (e.g. output token x source token) as a heatmap, signed
    values on a diverging scale centred on 0, NaN cells left blank; ``subtitle`` (a prompt) above
    the map, wrapped to its width (at most :data:`SUBTITLE_LINES` lines), not cut to one line."""
    n_rows, n_cols = values.shape
    fig = new_figure(min(max(4.0, 0.32 * n_cols + 3.0), 18.0), min(max(2.4, 0.3 * n_rows + 2.2), 16.0))
    ax = fig.subplots()
    finite = values[np.isfinite(values)]
    signed = finite.size and float(finite.min()) < 0
    top = float(np.abs(finite).max()) if finite.size else 1.0
    top = top if top > 0 else 1.0
    image = ax.imshow(np.ma.masked_invalid(values), cmap="RdBu_r" if signed else "viridis",
                      vmin=-top if signed else 0.0, vmax=top, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(n_cols), list(columns), rotation=60, ha="right", rotation_mode="anchor", fontsize=7)
    ax.set_yticks(range(n_rows), list(rows), fontsize=7)
    ax.set_xlabel("source token")
    ax.set_ylabel("output token")
    if subtitle:
        ax.set_title(wrapped_lines(subtitle, max(int(fig.get_figwidth() * 12), 30), SUBTITLE_LINES), fontsize=8,
                     loc="left")
    fig.colorbar(image, ax=ax, shrink=0.85, label=label)
    if title:
        set_title(fig, title)
    return fig


@dataclass(frozen=True)
class UnitPoint:
    """One unit of a verdict's picture: its name, its group (the family it belongs to), why it is
    shown (``best``, ``worst``, ``best layer of attention weights``, ...), its mean and CI."""

    unit: str
    group: str
    why: str
    mean: float
    low: float
    high: float


def units_figure(points: Sequence[UnitPoint], bands: Mapping[str, Band], gradient: Mapping | None, measure: str,
                 *, title: str = "", note: str = "") -> Figure:
    """Units of several methods and families side by side: one row per point (top to bottom as
    given), its mean agreement with its CI as a horizontal bar, its label the unit's name and why
    it is shown; one colour and marker per group, named in the legend. The random, uniform and
    position baselines and the ceiling (those of ``bands`` that exist) are vertical bands, the best
    gradient (``{"explainer", "mean"}``) a vertical purple dashed line; ``note``: what it leaves out, under it."""
    n = len(points)
    fig = new_figure(7.5, min(max(3.0, 0.32 * n + 2.6), MAX_SCORES_HEIGHT))
    ax = fig.subplots()
    for name in ("random", "uniform", "position", "ceiling"):
        band = bands.get(name)
        if band is None:
            continue
        style = BAND_STYLES[name]
        label = band.label if name == "ceiling" else name
        if band.low is not None and band.high is not None and band.high > band.low:
            ax.axvspan(band.low, band.high, color=style.color, alpha=style.alpha, lw=0,
                       label=f"{label} {band.mean:+.3f} [{band.low:+.3f}, {band.high:+.3f}]")
            ax.axvline(band.mean, color=style.color, lw=0.8, ls=style.style)
        else:
            ax.axvline(band.mean, color=style.color, lw=1.2, ls=style.style, label=f"{label} {band.mean:+.3f}")
    if gradient is not None:
        ax.axvline(float(gradient["mean"]), color=BAND_STYLES["gradient"].color, lw=1.4,
                   ls=BAND_STYLES["gradient"].style,
                   label=f"best gradient ({gradient.get('explainer')}) {float(gradient['mean']):+.3f}")
    groups = list(dict.fromkeys(p.group for p in points))
    y = np.arange(n)[::-1]  # the first point at the top
    for j, group in enumerate(groups):
        at = [i for i, p in enumerate(points) if p.group == group]
        mean = np.array([points[i].mean for i in at], dtype=float)
        low = np.array([points[i].low for i in at], dtype=float)
        high = np.array([points[i].high for i in at], dtype=float)
        bars = np.vstack([mean - np.where(np.isfinite(low), low, mean), np.where(np.isfinite(high), high, mean) - mean])
        style = explainer_style(j)
        ax.errorbar(mean, y[at], xerr=bars, fmt=style["marker"], ms=5, color=style["color"], capsize=3, lw=1.2,
                    label=wrap_label(group))
    ax.set_yticks(y, [wrap_label(f"{p.unit} ({p.why})", 48) for p in points], fontsize=7)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlabel(f"mean {measure_label(measure)}")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    if title:
        set_title(fig, title)
    set_note(fig, note)
    return fig


def mark_axes(ax: Axes, mark: str, colour: str) -> None:
    """A panel of a method whose check failed: its label in ``colour`` and ``mark`` inside it ("": unmarked)."""
    if not mark:
        return
    ax.yaxis.label.set_color(colour)
    ax.text(0.005, 0.96, mark, transform=ax.transAxes, ha="left", va="top", fontsize=7, color=colour,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1})
