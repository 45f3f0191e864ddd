"""Names shared by the computing side and the reading side (reports), without importing torch."""

from __future__ import annotations

from collections.abc import Sequence

from probe import registry

#: derived from :mod:`probe.registry` (the one list of methods), in its order
ATTENTION_METHODS = registry.names(family="attention")
#: attention measures that also account for values, residual and norms (probe.explain.context_mixing)
CONTEXT_MIXING_METHODS = registry.names(group="context mixing")
GRADIENT_METHODS = registry.names(family="gradient")
INTERVENTION_METHODS = registry.names(family="intervention")
ALL_METHODS = registry.names()

#: A result folder's on-disk format (study.json's ``format_version``) and the tables a study
#: writes, per batch and merged (probe.study.store writes them, probe.report reads them).
FORMAT_VERSION = 1
TABLES = ("examples", "tokens", "scores", "agreement", "erasure", "counterfactual", "heads", "left_out", "convergence")


def method_family(method: str) -> str | None:
    """attention, gradient, intervention, or None (a baseline such as ``random``, or a variant run by name)."""
    entry = registry.find(method)
    return entry.family if entry is not None and entry.listed else None


def measure_columns(agreement) -> list[tuple[str, str | None]]:
    """The agreement measures a table holds (kendall_tau, spearman, topK), each with its p-value column or None."""
    out = []
    for col in agreement.columns:
        if col in ("kendall_tau", "spearman") or (col.startswith("top") and col[3:].isdigit()):
            p = {"kendall_tau": "kendall_p", "spearman": "spearman_p"}.get(col)
            out.append((col, p if p in agreement.columns else None))
    return out


def describe_group(group: Sequence[str]) -> str:
    """``flow L1-L5 = attention_mean L0``: layers of one method joined into a range where consecutive."""
    by_method: dict[str, list[int | None]] = {}
    for unit in group:
        method, _, layer = unit.partition(" L")
        by_method.setdefault(method, []).append(int(layer) if layer.isdigit() else None)
    parts = []
    for method, layers in by_method.items():
        numbers = sorted(x for x in layers if x is not None)
        if not numbers:
            parts.append(method)
            continue
        runs, start = [], numbers[0]
        for prev, cur in zip(numbers, numbers[1:] + [None]):
            if cur != prev + 1 if cur is not None else True:
                runs.append(f"L{start}" if start == prev else f"L{start}-L{prev}")
                start = cur
        parts.append(f"{method} {','.join(runs)}")
    return " = ".join(parts)
