"""Explainers: attention-derived scores and gradient attributions, one module per family.

The methods are run by name through :mod:`probe.methods` (above this package and
:mod:`probe.intervene`); the public entry is :func:`probe.api.explain` (``probe.explain(pm, texts)``).
"""
