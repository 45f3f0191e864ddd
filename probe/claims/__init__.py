"""Claims about a model's attention, tested by intervention: ``probe audit CLAIMS.yaml``.

The claim file's loader is :mod:`probe.claims.file`, each kind (its keys, checks, measurement and rule)
one module of :mod:`probe.claims.kinds`; :func:`probe.claims.run.run_audit`
measures every claim and decides it (supported, refuted or inconclusive; rules in
:mod:`probe.claims.rules`), and :meth:`probe.claims.run.AuditResult.write` writes audit.json,
audit.md and audit.html. The public entry is :func:`probe.api.audit` (``probe.audit(path_or_claims)``).
"""
