"""Audit claims about a model's attention by intervention: ``probe audit CLAIMS.yaml``.

:func:`load_claims` reads and validates a claim file, :func:`run_audit` measures every claim and
decides it (supported, refuted or inconclusive; rules in :mod:`probe.audit.rules`), and
:meth:`AuditResult.write` writes audit.json, audit.md and audit.html. Calling the package,
``probe.audit(path_or_claims)``, runs :func:`probe.api.audit`.
"""

from probe.audit.claims import CLAIM_KINDS, ClaimFile, claims_from_dict, load_claims
from probe.audit.run import AuditResult, ClaimResult, run_audit

__all__ = ["AuditResult", "CLAIM_KINDS", "ClaimFile", "ClaimResult", "claims_from_dict", "load_claims", "run_audit"]

from probe.callable_module import make_callable  # noqa: E402

make_callable(__name__, "audit")
