"""Subpackages that are also the public function of the same name: ``probe.explain(pm, texts)``
runs :func:`probe.api.explain` while ``probe.explain.methods`` stays a module.

A plain function named ``probe.explain`` could not work: importing ``probe.explain.methods`` sets
the attribute ``probe.explain`` to the subpackage, replacing the function. So the subpackage
itself is made callable, by the module ``__class__`` assignment the Python data model documents.
Nothing here imports torch; the call imports :mod:`probe.api` when it happens.
"""

from __future__ import annotations

import sys
import types


class CallableModule(types.ModuleType):
    """A module whose call runs ``probe.api.<__api_function__>``."""

    __api_function__ = ""

    def __call__(self, *args, **kwargs):
        from probe import api

        return getattr(api, self.__api_function__)(*args, **kwargs)

    @property
    def __signature__(self):
        """The function's signature, for ``inspect.signature`` and notebook help (imports probe.api)."""
        import inspect

        from probe import api

        return inspect.signature(getattr(api, self.__api_function__))


def make_callable(module_name: str, function: str) -> None:
    """Make the module ``module_name`` (already in ``sys.modules``) call ``probe.api.<function>``."""
    module = sys.modules[module_name]
    module.__class__ = type(f"Callable_{function}", (CallableModule,), {"__api_function__": function})
