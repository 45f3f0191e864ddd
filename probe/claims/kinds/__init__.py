"""The claim kinds: one module each, holding its spec, its rule, its checks and its measurement
(a :class:`~probe.claims.kind.ClaimKind`), listed here. Adding a kind is one module and one line
of :data:`KINDS`; the claim file's loader, the audit, the docs' key tables and the error messages
read this list."""

from __future__ import annotations

from probe.claims.kind import ClaimKind
from probe.claims.kinds import (
    counterfactual,
    edge,
    faithfulness,
    head_role,
    sink_head,
    specific_tokens,
    token_importance,
)

__all__ = ["CLAIM_KINDS", "KINDS"]

#: every claim kind by its name, in the order the docs and the error messages list them
KINDS: dict[str, ClaimKind] = {kind.name: kind for kind in (
    token_importance.KIND,
    specific_tokens.KIND,
    head_role.KIND,
    faithfulness.KIND,
    counterfactual.KIND,
    sink_head.KIND,
    edge.KIND,
)}
CLAIM_KINDS = tuple(KINDS)
