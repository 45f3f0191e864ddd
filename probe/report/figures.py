"""The report's figures, drawn with matplotlib's Agg canvas (no pyplot, no GUI backend, nothing
global changed) and returned as PNG bytes."""

from __future__ import annotations

import io
import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from probe.plots import COLORS, DPI, Band, draw_bands, layer_lines_figure, measure_label, new_figure

ANNOTATE_MAX = 100  # heatmap cells (all panels of a figure) written as numbers; more would be slow and unreadable
LN2 = math.log(2)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _kv_lines(ax, kv_of_query, n_heads: int) -> None:
    """Thin lines between groups of query heads that share a key/value head (GQA)."""
    if not kv_of_query or len(kv_of_query) != n_heads or len(set(kv_of_query)) in (n_heads, 1):
        return
    for h in range(1, n_heads):
        if kv_of_query[h] != kv_of_query[h - 1]:
            ax.axvline(h - 0.5, color="black", lw=1.2, alpha=0.7)


def heatmap_grid(grids: dict[str, np.ndarray], title: str, measure: str, kv_of_query=None) -> bytes:
    """One layer x head heatmap per reference, on a shared colour scale centred on 0; black lines
    separate query heads that share a key/value head."""
    refs = list(grids)
    n_layers, n_heads = next(iter(grids.values())).shape
    finite = [np.nanmax(np.abs(g)) for g in grids.values() if np.isfinite(g).any()]
    vmax = max(max(finite, default=0.0), 1e-6)
    cols = 2 if len(refs) == 4 else min(len(refs), 3)
    rows = math.ceil(len(refs) / cols)
    cell_w = max(3.2, min(6.0, 0.45 * n_heads + 1.4))
    cell_h = max(2.6, min(7.5, 0.28 * n_layers + 1.2))
    fig = new_figure(cell_w * cols + 0.8, cell_h * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    annotate = n_layers * n_heads * len(refs) <= ANNOTATE_MAX
    for i, ref in enumerate(refs):
        ax = axes[i // cols][i % cols]
        grid = grids[ref]
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto", origin="lower",
                          interpolation="nearest")
        _kv_lines(ax, kv_of_query, n_heads)
        ax.set_title(f"vs {ref}", fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(n_heads) if n_heads <= 16 else range(0, n_heads, max(1, n_heads // 8)))
        ax.set_yticks(range(n_layers) if n_layers <= 16 else range(0, n_layers, max(1, n_layers // 8)))
        if annotate:
            for (layer, head), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if abs(value) > 0.6 * vmax else "black")
    for j in range(len(refs), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.85, label=f"mean {measure_label(measure)}")
    fig.suptitle(title, fontsize=11)
    return _png(fig)


def layer_lines(lines_by_ref: dict[str, dict], bands_by_ref: dict[str, dict[str, Band]],
                gradients: dict[str, dict | None], measure: str, notes: dict[str, str] | None = None) -> bytes:
    """:func:`probe.plots.layer_lines_figure` as PNG bytes."""
    return _png(layer_lines_figure(lines_by_ref, bands_by_ref, gradients, measure, notes))


def distribution(units: list[dict], bands: dict[str, Band], reference: str, measure: str) -> bytes:
    """Per explainer unit: a box of the per-example values, the points, and mean with its CI beside
    it; the baselines and the ceiling as horizontal bands."""
    n = len(units)
    fig = new_figure(max(6.0, 0.85 * n + 3.5), 4.6)
    ax = fig.subplots()
    draw_bands(ax, bands)
    positions = np.arange(n, dtype=float)
    family_color = {"attention": "#1f77b4", "gradient": "#9467bd", "intervention": "#8c564b"}
    data = [u["values"] if len(u["values"]) else np.array([np.nan]) for u in units]
    boxes = ax.boxplot(data, positions=positions, widths=0.45, showfliers=False, patch_artist=True,
                       medianprops={"color": "black"})
    rng = np.random.default_rng(0)
    for i, (unit, box) in enumerate(zip(units, boxes["boxes"])):
        color = family_color.get(unit["family"], "#7f7f7f")
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
    ax.set_xticks(positions, [u["label"] for u in units], rotation=35, ha="right", fontsize=8)
    ax.set_xlim(-0.7, n - 0.3)
    ax.set_ylabel(f"{measure_label(measure)} with {reference}\n(per example)")
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="mean [CI]", title_fontsize=7)
    return _png(fig)


def erasure_curves(curves, aopc) -> bytes:
    """Comprehensiveness vs % removed and sufficiency vs % kept, one line per ranking."""
    fig = new_figure(11.0, 4.2)
    ax_c, ax_s = fig.subplots(1, 2)
    aopc = aopc.set_index("ranking") if len(aopc) else aopc
    for j, (ranking, frame) in enumerate(curves.groupby("ranking", sort=False)):
        is_random = ranking == "random"
        color = "#7f7f7f" if is_random else COLORS[j % len(COLORS)]
        style = "--" if is_random else "-"
        x = frame["percent"].to_numpy()
        for ax, col, key in ((ax_c, "comprehensiveness", "aopc"), (ax_s, "sufficiency", "aopc_sufficiency")):
            value = aopc.loc[ranking, key] if ranking in aopc.index else float("nan")
            mean = frame[col].to_numpy()
            sem = frame[f"{col}_sem"].to_numpy(dtype=float)
            ax.plot(x, mean, marker="o", ms=3.5, ls=style, color=color, label=f"{ranking} (AOPC {value:+.3f})")
            if np.isfinite(sem).any():
                ax.fill_between(x, mean - 1.96 * sem, mean + 1.96 * sem, color=color, alpha=0.12, lw=0)
    ax_c.set_title("comprehensiveness: f(x) - f(x without top k%)  (higher is better)", fontsize=9)
    ax_c.set_xlabel("% of scored tokens removed (most important first)")
    ax_s.set_title("sufficiency: f(x) - f(only top k%)  (lower is better)", fontsize=9)
    ax_s.set_xlabel("% of scored tokens kept (most important first)")
    for ax in (ax_c, ax_s):
        ax.set_ylabel("change of the target")
        ax.axhline(0, color="black", lw=0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def permutation_scatter(frame) -> bytes:
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


def adversarial_histogram(frame) -> bytes:
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


def head_maps(maps: dict[str, np.ndarray], kv_of_query=None) -> bytes:
    """Side-by-side layer x head maps (ablation effect, importance, attention on top-3 tokens)."""
    names = list(maps)
    n_layers, n_heads = next(iter(maps.values())).shape
    cell_w = max(3.4, min(5.0, 0.32 * n_heads + 1.6))
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
        fig.colorbar(image, ax=ax, shrink=0.85)
        if annotate:
            for (layer, head), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=6,
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
        for j, (study, (x, y, label)) in enumerate(panels[name].items()):
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


def randomisation_curves(curves: dict[str, list], reference: str | None = None) -> bytes:
    """Cascading randomisation (Adebayo et al. 2018): per explainer, mean Spearman with its trained
    scores against the fraction of layers re-initialised from the top (the output head first, at
    0); the reference's own curve black and dashed; the 0.5 limit dashed."""
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name, curve in curves.items():
        xs = [float(p[0]) for p in curve]
        ys = [float(p[1]) for p in curve]
        if name == reference:
            ax.plot(xs, ys, marker="s", color="black", linestyle="--", linewidth=2, label=f"{name} (reference)")
        else:
            ax.plot(xs, ys, marker="o", label=name)
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.axvline(0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("fraction of layers re-initialised (from the top; the head first, at 0)")
    ax.set_ylabel("Spearman with trained scores")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=7, loc="lower left")
    return _png(fig)


def convergence_curves(frame) -> bytes:
    """Integrated gradients: |delta| / |f(x) - f(baseline)| against the Gauss-Legendre points tried,
    one thin line per example, the median per number of points thick."""
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    relative = (frame["delta"].abs() / frame["gap"].abs().clip(lower=1e-12)).clip(lower=1e-8)
    frame = frame.assign(relative=relative)
    for _, one in frame.groupby("example"):
        ax.plot(one["steps"], one["relative"], color="#9467bd", alpha=0.25, lw=0.8, marker="." if len(one) == 1 else None)
    median = frame.groupby("steps")["relative"].median()
    ax.plot(median.index, median.to_numpy(), color="black", lw=2, marker="o", label="median")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("Gauss-Legendre points")
    ax.set_ylabel("|delta| / |f(x) - f(baseline)|")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)
