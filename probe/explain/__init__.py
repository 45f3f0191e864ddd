"""Attention-derived scores and gradient attributions.

Calling the package, ``probe.explain(pm, texts, methods=...)``, runs :func:`probe.api.explain`.
"""

from probe.callable_module import make_callable

make_callable(__name__, "explain")
