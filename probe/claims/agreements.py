"""The agreement of an attention ranking with a reference, per example: what the ranking claims
(``token_importance``, ``faithfulness``) measure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from probe.claims.context import AuditContext
    from probe.spec.claim_values import AttentionRanking


class RankingClaim(Protocol):
    """What a ranking claim (``token_importance``, ``faithfulness``) gives :func:`agreements`."""

    @property
    def ranking(self) -> AttentionRanking: ...

    @property
    def reference(self) -> str: ...

__all__ = ["RankingClaim", "agreements", "column"]


def agreements(ctx: AuditContext, claim: RankingClaim, index: int, k: int) -> tuple[list[dict], list[dict]]:
    """Per example: agreement of the attention ranking with the reference over the scored tokens (with
    the claim file's ``spans``: over the spans, attention folded, the reference leaving out whole spans)."""
    from probe.metrics.agreement import agreement

    attention = ctx.attention_vectors(claim.ranking, index)
    if ctx.file.spans is not None:  # spans as units: attention folded over each span, the reference perturbs it whole
        attention, reference = ctx.span_vectors(attention), ctx.span_reference(claim.reference, index)
    else:
        reference = ctx.reference(claim.reference)
    rows: list[dict[str, float]] = []
    details: list[dict[str, object]] = []
    for i, (x, y) in enumerate(zip(attention, reference)):
        scorable = np.ones(len(x), dtype=bool) if ctx.file.spans is not None else ctx.scorable(i)
        keep = scorable & np.isfinite(x) & np.isfinite(y)
        n = int(keep.sum())
        if n < 2:
            rows.append({})
            details.append({"n_tokens": n})
            continue
        values = {key: float(v[0]) for key, v in agreement(x[keep], y[keep], k=[1, k]).items()}
        positions = np.flatnonzero(keep)
        texts = [span.text for span in ctx.spans()[i]] if ctx.file.spans is not None else ctx.texts(i)
        top_attention = int(positions[np.argsort(-x[keep], kind="stable")[0]])
        top_reference = int(positions[np.argsort(-y[keep], kind="stable")[0]])
        values["chance"] = 1.0 / n
        rows.append(values)
        details.append({"n_tokens": n, "most_attended": texts[top_attention], "most_important": texts[top_reference],
                        "kendall_tau": values["kendall_tau"], "spearman": values["spearman"],
                        f"top{k}_overlap": values[f"top{k}"]})
    return rows, details


def column(rows: list[dict], key: str) -> np.ndarray:
    """One value of every example's row (NaN where the example had none)."""
    return np.array([r.get(key, np.nan) for r in rows], dtype=np.float64)
