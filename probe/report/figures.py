"""The report's figures, drawn with matplotlib's Agg canvas (no pyplot, no GUI backend, nothing
global changed) and returned as PNG bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, NullLocator

from probe.plots import (
    BAND_STYLES,
    COLORS,
    DPI,
    Band,
    draw_band,
    draw_bands,
    explainer_style,
    layer_lines_figure,
    measure_label,
    new_figure,
    wrap_label,
)

if TYPE_CHECKING:
    import pandas as pd

ANNOTATE_MAX = 100  # heatmap cells (all panels of a figure) written as numbers; more would be slow and unreadable
LN2 = math.log(2)
FAMILY_COLORS = {"attention": "#1f77b4", "gradient": "#9467bd", "intervention": "#8c564b"}
FAMILY_WORDS = {"attention": "attention-based explainer", "gradient": "gradient explainer",
                "intervention": "intervention"}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def kv_lines_drawn(kv_of_query: Sequence[int] | None, n_heads: int) -> bool:
    """Whether :func:`_kv_lines` draws anything: groups of query heads share key/value heads (GQA),
    more than one group (MQA: one group, nothing to separate)."""
    return bool(kv_of_query) and len(kv_of_query) == n_heads and len(set(kv_of_query)) not in (n_heads, 1)


def _kv_lines(ax, kv_of_query, n_heads: int) -> None:
    """Thin lines between groups of query heads that share a key/value head (GQA)."""
    if not kv_lines_drawn(kv_of_query, n_heads):
        return
    for h in range(1, n_heads):
        if kv_of_query[h] != kv_of_query[h - 1]:
            ax.axvline(h - 0.5, color="black", lw=1.2, alpha=0.7)


def heatmap_grid(grids: dict[str, np.ndarray], title: str, measure: str, kv_of_query: Sequence[int] | None = None) -> bytes:
    """One layer x head heatmap per reference, each on its own colour scale centred on 0 with its
    own colour bar (a shared scale washes out a panel whose values are all small); black lines
    separate query heads that share a key/value head."""
    refs = list(grids)
    n_layers, n_heads = next(iter(grids.values())).shape
    cols = 2 if len(refs) == 4 else min(len(refs), 3)
    rows = math.ceil(len(refs) / cols)
    cell_w = max(3.2, min(6.0, 0.45 * n_heads + 1.4)) + 0.9  # + the panel's colour bar
    cell_h = max(2.6, min(7.5, 0.28 * n_layers + 1.2))
    fig = new_figure(cell_w * cols + 0.3, cell_h * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
    annotate = n_layers * n_heads * len(refs) <= ANNOTATE_MAX
    for i, ref in enumerate(refs):
        ax = axes[i // cols][i % cols]
        grid = grids[ref]
        vmax = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0, 1e-6)
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto", origin="lower",
                          interpolation="nearest")
        _kv_lines(ax, kv_of_query, n_heads)
        ax.set_title(f"vs {ref}", fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_heads) if n_heads <= 16 else range(0, n_heads, max(1, n_heads // 8)))
        ax.set_yticks(range(n_layers) if n_layers <= 16 else range(0, n_layers, max(1, n_layers // 8)))
        bar = fig.colorbar(image, ax=ax, shrink=0.85)
        bar.set_label(f"mean {measure_label(measure)}\n(this panel's scale)", fontsize=8)
        if annotate:
            for (layer, head), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if abs(value) > 0.6 * vmax else "black")
    for j in range(len(refs), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    fig.suptitle(title, fontsize=11)
    return _png(fig)


def layer_lines(lines_by_ref: dict[str, dict], bands_by_ref: dict[str, dict[str, Band]],
                gradients: dict[str, dict | None], measure: str, notes: dict[str, str] | None = None) -> bytes:
    """:func:`probe.plots.layer_lines_figure` as PNG bytes."""
    return _png(layer_lines_figure(lines_by_ref, bands_by_ref, gradients, measure, notes))


def distribution(units: list[dict], bands: dict[str, Band], reference: str, measure: str) -> bytes:
    """Per explainer unit: a box of the per-example values, the points, and mean with its CI beside
    it; the baselines and the ceiling as horizontal bands. The legend sits below the axes; a unit
    that ranks tokens as others do (``same_as``) is marked [n] and the others named under the axis,
    so that every tick label stays one short line."""
    n = len(units)
    fig = new_figure(max(6.0, 0.85 * n + 2.5), 5.6)
    ax = fig.subplots()
    draw_bands(ax, bands)
    band_handles, band_labels = ax.get_legend_handles_labels()
    positions = np.arange(n, dtype=float)
    data = [u["values"] if len(u["values"]) else np.array([np.nan]) for u in units]
    boxes = ax.boxplot(data, positions=positions, widths=0.45, showfliers=False, patch_artist=True,
                       medianprops={"color": "black"})
    rng = np.random.default_rng(0)
    for i, (unit, box) in enumerate(zip(units, boxes["boxes"])):
        color = FAMILY_COLORS.get(unit["family"], "#7f7f7f")
        box.set_facecolor(color)
        box.set_alpha(0.35)
        v = unit["values"]
        if len(v):
            ax.scatter(i + rng.uniform(-0.12, 0.12, len(v)), v, s=6, color=color, alpha=0.5, lw=0)
        low, high = unit["ci"]
        if low is not None and high is not None:
            ax.errorbar(i + 0.32, unit["mean"], yerr=[[unit["mean"] - low], [high - unit["mean"]]], fmt="D",
                        ms=4, color="black", capsize=3, lw=1.2)
        else:
            ax.plot(i + 0.32, unit["mean"], "D", ms=4, color="black")
    labels: list[str] = []
    notes: list[str] = []
    for unit in units:
        label = unit["label"]
        if unit.get("same_as"):
            notes.append(f"[{len(notes) + 1}] {unit.get('unit', unit['label'])} = {unit['same_as']}")
            label += f" [{len(notes)}]"
        labels.append(label)
    ax.set_xticks(positions, labels, rotation=35, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_xlim(-0.7, n - 0.3)
    if notes:
        ax.set_xlabel(wrap_label("identical rankings: " + "; ".join(notes), int(fig.get_figwidth() * 16)), fontsize=7)
    ax.set_ylabel(f"{measure_label(measure)} with {reference}\n(per example)")
    ax.grid(axis="y", alpha=0.3)
    families = list(dict.fromkeys(u["family"] for u in units))
    handles = [Patch(facecolor=FAMILY_COLORS.get(f, "#7f7f7f"), alpha=0.35, edgecolor="black",
                     label=f"{FAMILY_WORDS.get(f, f)}: per-example box and points") for f in families]
    handles.append(Line2D([], [], color="black", marker="D", ms=4, lw=1.2, label="explainer mean with its CI"))
    for handle, label in zip(band_handles, band_labels):
        handle.set_label(wrap_label(label))
        handles.append(handle)
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=2 if fig.get_figwidth() < 9 else 3,
               frameon=False)
    return _png(fig)


def erasure_curves(curves: pd.DataFrame, aopc: pd.DataFrame) -> bytes:
    """Comprehensiveness vs % removed and sufficiency vs % kept, one line per ranking; one legend
    for both panels, below them (inside a panel it covered the curves and their bands)."""
    fig = new_figure(11.0, 4.8)
    ax_c, ax_s = fig.subplots(1, 2)
    aopc = aopc.set_index("ranking") if len(aopc) else aopc
    j = 0
    for ranking, frame in curves.groupby("ranking", sort=False):
        is_random = ranking == "random"
        if is_random:
            style = {"color": BAND_STYLES["random"].color, "marker": "o", "linestyle": "--"}
        else:
            style, j = explainer_style(j), j + 1
        x = frame["percent"].to_numpy()
        values = []
        for ax, col, key in ((ax_c, "comprehensiveness", "aopc"), (ax_s, "sufficiency", "aopc_sufficiency")):
            values.append(aopc.loc[ranking, key] if ranking in aopc.index else float("nan"))
            mean = frame[col].to_numpy()
            sem = frame[f"{col}_sem"].to_numpy(dtype=float)
            line, = ax.plot(x, mean, ms=3.5, **style)
            if np.isfinite(sem).any():
                ax.fill_between(x, mean - 1.96 * sem, mean + 1.96 * sem, color=style["color"], alpha=0.12, lw=0)
        line.set_label(f"{ranking} (AOPC: comprehensiveness {values[0]:+.3f}, sufficiency {values[1]:+.3f})")
    ax_c.set_title("comprehensiveness: f(x) - f(x without top k%)  (higher is better)", fontsize=9)
    ax_c.set_xlabel("% of scored tokens removed (most important first)")
    ax_s.set_title("sufficiency: f(x) - f(only top k%)  (lower is better)", fontsize=9)
    ax_s.set_xlabel("% of scored tokens kept (most important first)")
    for ax in (ax_c, ax_s):
        ax.set_ylabel("change of the target")
        ax.axhline(0, color="black", lw=0.6)
        ax.grid(alpha=0.3)
    fig.legend(handles=ax_s.get_legend_handles_labels()[0], fontsize=7, loc="outside lower center", ncol=2,
               frameon=False)
    return _png(fig)


def permutation_scatter(frame: pd.DataFrame) -> bytes:
    """Jain & Wallace's plot: each example's maximum attention against the median output change
    when the attention weights are permuted."""
    fig = new_figure(6.2, 4.4)
    ax = fig.subplots()
    sites = frame.groupby(["layer", "head"], sort=True)
    for j, ((layer, head), f) in enumerate(sites):
        label = f"L{layer}" if head < 0 else f"L{layer}.H{head}"
        ax.scatter(f["max_attention"], f["perm_median_output_tvd"], s=12, alpha=0.65,
                   color=COLORS[j % len(COLORS)], lw=0, label=label)
    ax.set_xlabel("maximum attention weight (target query)")
    ax.set_ylabel("median output TVD under permutation")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if sites.ngroups <= 12:
        ax.legend(fontsize=7, title="site", title_fontsize=7)
    return _png(fig)


def adversarial_histogram(frame: pd.DataFrame) -> bytes:
    """Distribution of the largest attention JSD found within the output bound, ln 2 marked."""
    fig = new_figure(6.2, 4.0)
    ax = fig.subplots()
    values = frame["adv_max_attention_jsd"].to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    bins = np.linspace(0, LN2 * 1.05, 31)
    ax.hist(values, bins=bins, color="#1f77b4", alpha=0.8)
    ax.axvline(LN2, color="#d62728", lw=1.5, ls="--", label="ln 2 (largest possible JSD)")
    bound = frame["adv_bound"].iloc[0] if "adv_bound" in frame else None
    ax.set_xlabel("max attention JSD from the original" + (f" (output TVD <= {bound:g})" if bound is not None else ""))
    ax.set_ylabel("examples x sites")
    ax.set_xlim(0, LN2 * 1.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def head_maps(maps: dict[str, np.ndarray], kv_of_query: Sequence[int] | None = None,
              labels: dict[str, str] | None = None) -> bytes:
    """Side-by-side layer x head maps (ablation effect, importance, attention on top-3 tokens), each
    with its colour bar labelled ``labels[name]`` (what its colour measures; default the name)."""
    labels = labels or {}
    names = list(maps)
    n_layers, n_heads = next(iter(maps.values())).shape
    cell_w = max(3.4, min(5.0, 0.32 * n_heads + 1.6)) + 0.3  # + the colour bar's label
    cell_h = max(3.2, min(7.5, 0.28 * n_layers + 1.2))
    fig = new_figure(cell_w * len(names) + 0.5, cell_h + 0.4)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    annotate = n_layers * n_heads * len(names) <= ANNOTATE_MAX
    for ax, name in zip(axes, names):
        grid = maps[name]
        vmax = float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(vmax, 1e-9), aspect="auto", origin="lower",
                          interpolation="nearest")
        _kv_lines(ax, kv_of_query, n_heads)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_heads) if n_heads <= 16 else range(0, n_heads, max(1, n_heads // 8)))
        ax.set_yticks(range(n_layers) if n_layers <= 16 else range(0, n_layers, max(1, n_layers // 8)))
        fig.colorbar(image, ax=ax, shrink=0.85, label=labels.get(name, name))
        if annotate:
            for (layer, head), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8 if n_heads <= 8 else 7,
                            color="black" if value > 0.6 * vmax else "white")
    return _png(fig)


def comparison_lines(panels: dict[str, dict[str, tuple[np.ndarray, np.ndarray, str]]], relative: bool) -> bytes:
    """One panel per shared explainer: per-layer mean agreement, one line per study."""
    names = list(panels)
    cols = min(len(names), 2)
    rows = math.ceil(len(names) / cols)
    fig = new_figure(6.2 * cols, 3.9 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, name in enumerate(names):
        ax = axes[i // cols][i % cols]
        for j, (x, y, label) in enumerate(panels[name].values()):
            ax.plot(x, y, marker="o", ms=3.5, color=COLORS[j % len(COLORS)], label=label.replace("$", r"\$"))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("relative depth (layer / last layer)" if relative else "layer")
        if not relative:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("mean agreement with the verdict reference")
        ax.axhline(0, color="black", lw=0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for j in range(len(names), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    return _png(fig)


def _stage_label(fraction: float) -> str:
    if abs(fraction - 1.0) < 1e-9:
        return "all layers"
    if abs(fraction - 0.5) < 1e-9:
        return "top half"
    return f"top {100 * fraction:.0f}%"


def randomisation_stages(curves: dict[str, list]) -> tuple[list[tuple], bool]:
    """The stages the curves hold, in order, as keys (``("trained",)``, ``("head",)``, ``("top",
    fraction)``), and whether there is a head stage. A curve's first point is the trained model;
    a second point at fraction 0 is the output head alone; the others re-initialise the top
    ``fraction`` of the layers (and the head, where there is one)."""
    keys = set()
    for curve in curves.values():
        keys.update(_stage_keys(curve))
    order = {"trained": 0, "head": 1, "top": 2}
    stages = sorted(keys, key=lambda k: (order[k[0]], k[1] if len(k) > 1 else 0.0))
    return stages, ("head",) in keys


def _stage_keys(curve) -> list[tuple]:
    keys = []
    for i, point in enumerate(curve):
        fraction = float(point[0])
        keys.append(("trained",) if i == 0 else ("head",) if i == 1 and fraction == 0.0 else ("top", round(fraction, 6)))
    return keys


def randomisation_curves(curves: dict[str, list], reference: str | None = None) -> bytes:
    """Cascading randomisation (Adebayo et al. 2018): per explainer, mean Spearman with its trained
    scores at each stage of re-initialisation, the stages the data hold on a categorical axis
    (trained, the output head where there is one, then more and more layers from the top); the
    reference's own curve black and dashed; curves that are identical drawn once under a joint
    name; the 0.5 limit and the stage the check is judged at marked; the legend to the right."""
    stages, has_head = randomisation_stages(curves)
    where = {key: i for i, key in enumerate(stages)}
    series: list[tuple[list[str], np.ndarray, np.ndarray]] = []  # (names, xs, ys): identical curves share one entry
    for name, curve in curves.items():
        xs = np.array([where[k] for k in _stage_keys(curve)], dtype=float)
        ys = np.array([float(p[1]) for p in curve], dtype=float)
        same = next((s for s in series if len(s[1]) == len(xs) and np.array_equal(s[1], xs)
                     and np.allclose(s[2], ys, equal_nan=True)), None)
        if same is not None:
            same[0].append(name)
        else:
            series.append(([name], xs, ys))
    fig = new_figure(8.4, 4.0)
    ax = fig.add_subplot(1, 1, 1)
    j = 0
    for names, xs, ys in series:
        if reference in names:
            label = " = ".join([f"{reference} (reference)"] + [n for n in names if n != reference])
            ax.plot(xs, ys, marker="s", color="black", linestyle="--", linewidth=2, label=wrap_label(label, 32), zorder=3)
        else:
            ax.plot(xs, ys, ms=5, label=wrap_label(" = ".join(names), 32), **explainer_style(j))
            j += 1
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1,
               label=wrap_label("0.5: an explainer at or above it at the judged stage fails", 28))
    judged = next((i for i, k in enumerate(stages) if k[0] == "top" and k[1] >= 0.5 - 1e-9), len(stages) - 1)
    ax.axvline(judged, color="grey", linestyle=":", linewidth=1,
               label=wrap_label(f"stage the check is judged at ({_stage_text(stages[judged], has_head)})", 28))
    ax.set_xticks(range(len(stages)), [_stage_text(k, has_head, short=True) for k in stages], fontsize=8)
    ax.set_xlim(-0.3, len(stages) - 0.7)
    ax.set_xlabel("re-initialised, cumulatively from the top" + (" (the output head first)" if has_head else
                  " (no head stage: no separate output head to re-initialise)"))
    ax.set_ylabel("Spearman with trained scores")
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    fig.legend(handles=ax.get_legend_handles_labels()[0], fontsize=7, loc="outside right upper", frameon=False)
    return _png(fig)


def _stage_text(key: tuple, has_head: bool, short: bool = False) -> str:
    if key[0] == "trained":
        return "trained" if short else "the trained model"
    if key[0] == "head":
        return "head" if short else "the output head"
    text = _stage_label(key[1])
    if has_head:
        return f"head +\n{text}" if short else f"the head and the {text}"
    return text if short else f"the {text}"


def convergence_curves(frame: pd.DataFrame) -> bytes:
    """Integrated gradients: |delta| / |f(x) - f(baseline)| against the Gauss-Legendre points tried,
    one thin line per example (a point, with fixed steps), the median per number of points thick;
    a delta of exactly 0 (no place on a log axis) drawn as its own marker at the bottom. Ticks at
    the step values tried."""
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    relative = frame["delta"].abs() / frame["gap"].abs().clip(lower=1e-12)
    frame = frame.assign(relative=relative)
    positive = relative[relative > 0]
    floor = float(positive.min()) / 10 if len(positive) else 1e-8
    for _, one in frame.groupby("example"):
        shown = one["relative"].where(one["relative"] > 0)
        ax.plot(one["steps"], shown, color=BAND_STYLES["gradient"].color, alpha=0.25, lw=0.8,
                marker="." if len(one) == 1 else None)
    zeros = frame[frame["relative"] == 0]
    if len(zeros):
        ax.plot(zeros["steps"], np.full(len(zeros), floor), ls="none", marker="v", ms=6, color="#d62728",
                label=f"exactly 0 ({len(zeros)}; drawn at the bottom)")
    median = frame.groupby("steps")["relative"].median()
    ax.plot(median.index, median.where(median > 0).to_numpy(), color="black", lw=2, marker="o", label="median")
    steps = sorted(int(v) for v in frame["steps"].unique())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(steps, [str(v) for v in steps])
    ax.xaxis.set_minor_locator(NullLocator())
    if steps:
        ax.set_xlim(steps[0] / 1.4, steps[-1] * 1.4)
    if len(zeros):
        ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("Gauss-Legendre points")
    ax.set_ylabel("|delta| / |f(x) - f(baseline)|")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def step_lines(lines: pd.DataFrame, measure: str, reference: str) -> bytes:
    """Agreement against the output token's index (a step study): one line per compared unit, each
    marker's area growing with the number of examples that reached that step."""
    fig = new_figure(7.0, 3.6)
    ax = fig.subplots()
    top = max(int(lines["n"].max()), 1) if len(lines) else 1
    for name, rows in lines.groupby("line", sort=False):
        rows = rows.sort_values("step")
        band = "random" if name == "random ranking" else "gradient" if name.endswith("(gradient)") else None
        style = ({"color": BAND_STYLES[band].color, "linestyle": BAND_STYLES[band].style} if band
                 else {"color": FAMILY_COLORS["attention"], "linestyle": "-"})
        steps = rows["step"].to_numpy() + 1
        ax.plot(steps, rows["mean"], label=name, lw=1.4, **style)
        ax.scatter(steps, rows["mean"], s=8 + 40 * rows["n"].to_numpy() / top, color=style["color"], zorder=3)
    ax.axhline(0.0, color="black", lw=0.6, alpha=0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("output token (step)")
    ax.set_ylabel(f"mean {measure_label(measure)} with {reference}")
    ax.legend(fontsize=7, loc="best", frameon=False)
    return _png(fig)


def output_matrix(values: np.ndarray, rows: Sequence[str], columns: Sequence[str], title: str, label: str) -> bytes:
    """:func:`probe.plots.matrix_figure` (output token x source token) as PNG bytes."""
    from probe.plots import matrix_figure

    return _png(matrix_figure(values, rows, columns, title=title, label=wrap_label(label, 24)))


def frontier_figure(frontier: Mapping[str, Any]) -> bytes:
    """Agreement with the reference (mean and CI) against seconds per example, log scale; the
    ceiling as a band, the reference's own cost as a vertical line, the cheapest method ringed."""
    points = [p for p in frontier["points"] if p.get("seconds_per_example")]
    fig = new_figure(7.0, 4.8)
    ax = fig.subplots()
    ceiling = frontier.get("ceiling")
    if ceiling and ceiling.get("mean") is not None:
        ci = list(ceiling.get("ci") or []) + [None, None]
        label = f"ceiling ({' vs '.join(ceiling.get('pair') or [])})"
        style = BAND_STYLES["ceiling"]
        draw_band(ax, Band(label, float(ceiling["mean"]), ci[0], ci[1]), style.color, label, alpha=style.alpha,
                  style=style.style)
    handles, _ = ax.get_legend_handles_labels()
    cheapest = (frontier.get("cheapest") or {}).get("method")
    for j, p in enumerate(points):
        look = explainer_style(j)
        x, (low, high) = p["seconds_per_example"], p["ci"]
        ax.errorbar([x], [p["mean"]], yerr=[[p["mean"] - low], [high - p["mean"]]], fmt=look["marker"],
                    color=look["color"], ms=6, capsize=3, lw=1.2)
        if p["method"] == cheapest:
            ax.plot([x], [p["mean"]], "o", ms=15, mfc="none", mec="black", mew=1.5)
        handles.append(Line2D([], [], color=look["color"], marker=look["marker"], lw=0,
                              label=p["unit"] + (" (reference)" if p["kind"] == "reference" else "")
                              + (" (failed a check)" if p.get("failed_checks") else "")))
    own = frontier.get("reference_seconds_per_example")
    if own:
        ax.axvline(own, color="black", ls=":", lw=1.2)
        handles.append(Line2D([], [], color="black", ls=":", label=f"{frontier['reference']}'s own cost"))
    if points or own:
        ax.set_xscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("seconds per example (log scale)")
    ax.set_ylabel(wrap_label(f"{measure_label(frontier['measure'])} with {frontier['reference']}", 40))
    ax.grid(alpha=0.3)
    if cheapest:
        handles.append(Line2D([], [], marker="o", ms=12, mfc="none", mec="black", lw=0,
                              label="cheapest within the ceiling"))
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    return _png(fig)
