"""Names shared by the computing side and the reading side (reports), without importing torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from probe import registry

if TYPE_CHECKING:
    import pandas as pd

#: derived from :mod:`probe.registry` (the one list of methods), in its order
ATTENTION_METHODS = registry.names(family="attention")
#: attention measures that also account for values, residual and norms (probe.explainers.context_mixing)
CONTEXT_MIXING_METHODS = registry.names(group="context mixing")
GRADIENT_METHODS = registry.names(family="gradient")
INTERVENTION_METHODS = registry.names(family="intervention")
ALL_METHODS = registry.names()

#: a stack's (or a layer's) maps are rows of probabilities (the contract's ``maps`` word,
#: as written to files)
SOFTMAX_MAPS = "softmax"
#: a stack's (or a layer's) maps are a token mixer's implicit matrix (:mod:`probe.hooks.implicit`)
IMPLICIT_MAPS = "implicit"
#: a stack whose layers are some softmax, some implicit (``StackContract.layer_maps`` says which)
HYBRID_MAPS = "hybrid"

#: the mark every display puts beside scores whose method's own check failed on them (not converged,
#: constant, a degenerate site: probe.study.sanity.ScoreFlag)
FLAG_MARK = "\u26a0"  # ⚠

#: A result folder's on-disk format (study.json's ``format_version``) and the tables a study
#: writes, per batch and merged (probe.study.store writes them, probe.report reads them).
FORMAT_VERSION = 1
TABLES = ("examples", "tokens", "scores", "agreement", "erasure", "counterfactual", "heads", "left_out", "convergence",
          "interactions", "head_edges", "sinks")
#: a finished folder's record of what it was computed from and what it holds (probe.study.identity
#: writes it; a rerun that finds it unchanged returns at once, and a report records which one it drew)
COMPLETE_FILE = "complete.json"


def method_family(method: str) -> str | None:
    """attention, gradient, intervention, or None (a baseline such as ``random``, or a variant run by name)."""
    entry = registry.find(method)
    return entry.family if entry is not None and entry.listed else None


def measure_columns(agreement: pd.DataFrame) -> list[tuple[str, str | None]]:
    """The agreement measures a table holds (kendall_tau, spearman, topK), each with its p-value column or None."""
    out = []
    for col in agreement.columns:
        if col in ("kendall_tau", "spearman") or (col.startswith("top") and col[3:].isdigit()):
            p = {"kendall_tau": "kendall_p", "spearman": "spearman_p"}.get(col)
            out.append((col, p if p in agreement.columns else None))
    return out


def unit_name(method: str, layer: int, head: int) -> str:
    """``attention L3.H2``, ``rollout L0``, ``saliency``: a unit's name as the verdict writes it."""
    if layer < 0:
        return method
    return f"{method} L{layer}.H{head}" if head >= 0 else f"{method} L{layer}"


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


#: characters that act on a terminal or reorder text instead of showing: C0 and C1 controls (ESC,
#: NUL, BEL, ...), DEL, and the bidirectional embeddings, overrides and isolates (U+202A-U+202E,
#: U+2066-U+2069)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))}
_CONTROL.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``ESC`` as ``\\x1b``, a
    right-to-left override as ``\\u202e``), so text from the data cannot clear a screen, hide
    itself or reverse what follows. ``keep_newlines`` leaves newlines and tabs as they are."""
    table = _CONTROL if not keep_newlines else {k: v for k, v in _CONTROL.items() if k not in (0x09, 0x0A)}
    return str(text).translate(table)
