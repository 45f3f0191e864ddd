"""The kind of a token mixer's terms: its name, carrying the functions that read those terms.

A mixer call's terms (:class:`probe.hooks.implicit.ScanTerms`,
:class:`probe.hooks.linear_mixers.LinearTerms`, :class:`probe.hooks.kernel_mixers.KernelTerms`) are
tagged with a :class:`TermsKind`: the string they were always tagged with (``terms.kind == "mamba2"``
still holds), which also knows how its units' exact matrices are built and how the mixer's output
is rebuilt from them. Nothing branches on the name: a new mixer form is a new kind.
"""

from __future__ import annotations

from collections.abc import Callable


class TermsKind(str):
    """One form of mixer terms: ``name`` (the string itself) with

    matrices   ``(terms, units: slice) -> [batch, unit, query, key]``: the units' exact ``M``
    output     ``(module, terms, scan [batch, channel, time]) -> [batch, time, hidden]``: the
               mixer's output rebuilt from its mixed value path
    own_heads  one unit per map head: the maps probe captures are the units' own matrices
    per_state  the exact form holds a state axis per unit (what one block of units costs in memory)
    """

    matrices: Callable | None
    output: Callable | None
    own_heads: bool
    per_state: bool

    def __new__(cls, name: str, matrices: Callable | None = None, output: Callable | None = None, *,
                own_heads: bool = False, per_state: bool = False):
        kind = super().__new__(cls, name)
        kind.matrices, kind.output, kind.own_heads, kind.per_state = matrices, output, own_heads, per_state
        return kind

    def __repr__(self) -> str:
        return str.__repr__(str(self))
