"""The study's verdict as a typed, frozen object: :func:`probe.study.summary.finalize` makes it from
the verdict :func:`probe.study.summary.verdict` builds and writes its :meth:`Verdict.to_dict` to
``verdict.json``; :meth:`Verdict.read` reads it back. Torch-free: a report or a notebook reads it
without a model."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from probe.errors import InputError
from probe.frozen import PicklableFrozen

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

ANSWERS = ("yes", "heads only", "no", "undecidable")


@dataclass(frozen=True)
class UnitCount:
    """How many attention units (layers, or heads) track the reference, of how many."""

    tracking: int
    total: int


def _mean(unit: Mapping[str, Any]) -> float:
    mean = unit.get("mean")
    return float("nan") if mean is None else float(mean)


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _finite(value: Any) -> float | None:
    number = _number(value)
    return number if math.isfinite(number) else None


def _family_order(families: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The families in :data:`probe.registry.VERDICT_FAMILIES` order (the headline's first), whatever
    order a file kept them in (``verdict.json`` is written with sorted keys)."""
    from probe.registry import VERDICT_FAMILIES

    rank = {name: i for i, name in enumerate(VERDICT_FAMILIES)}
    return sorted(families.items(), key=lambda item: rank.get(str(item[0]), len(rank)))


@dataclass(frozen=True, repr=False)
class Verdict(PicklableFrozen):
    """Does attention track the reference? ``answer`` is yes (some layer-level unit of the attention
    weights tracks it), heads only (only single heads do), no, or undecidable (``undecidable`` says
    why: the output does not depend on the input, the reference is at the noise floor, too few
    examples, references that do not agree above random); ``headline`` says it in a sentence and
    ``families`` answers for each kind of attention explanation separately.

    ``best`` / ``worst`` (and ``best_layers``, ``best_heads``, ...) are the verdict's unit rows as
    written: ``{"unit", "mean", "ci": [low, high], "tracks"}``. ``random``, ``best_gradient`` and
    ``ceiling`` are ``{"mean", "ci", ...}`` or None. ``data`` keeps the whole verdict.json, keys
    this type does not name included.
    """

    answer: str
    headline: str
    reference: str
    measure: str
    rule: str
    alpha: float
    level: float
    bootstrap: int
    layer_units: UnitCount
    head_units: UnitCount
    best: tuple[Mapping[str, Any], ...] = ()
    worst: tuple[Mapping[str, Any], ...] = ()
    best_layers: tuple[Mapping[str, Any], ...] = ()
    best_heads: tuple[Mapping[str, Any], ...] = ()
    random: Mapping[str, Any] | None = None
    best_gradient: Mapping[str, Any] | None = None
    ceiling: Mapping[str, Any] | None = None
    undecidable: str | None = None
    families: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __repr__(self) -> str:
        from probe.display import clip

        why = f" ({clip(self.undecidable, 90)})" if self.undecidable else ""
        n = self.data.get("n")
        return (f"<Verdict {self.answer}{why}: {self.measure} with {self.reference}"
                + (f", n = {n}" if n else "") + "; "
                f"{self.layer_units.tracking}/{self.layer_units.total} layer-level units and "
                f"{self.head_units.tracking}/{self.head_units.total} heads track>")

    def _repr_html_(self) -> str:
        from probe.display import block_html, frame_html

        numbers = []
        for name, entry in (("random", self.random), ("best gradient", self.best_gradient), ("ceiling", self.ceiling)):
            if entry and entry.get("mean") is not None:
                ci = entry.get("ci") or (None, None)
                interval = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if None not in ci else ""
                numbers.append(f"{name} {float(entry['mean']):+.3f}{interval}")
        n, need = self.data.get("n"), self.data.get("n_needed")
        size = (f", n = {n} scored examples" if n else "") + (f" (about {need} would decide)" if need else "")
        note = f"{self.measure} with {self.reference}{size}" + (": " + "; ".join(numbers) if numbers else "")
        table = frame_html(self.to_pandas(), caption="per family of attention explanation")
        return ("<div>" + block_html(f"Does attention track {self.reference}? {self.answer}", "", self.headline)
                + block_html("", table, note) + "</div>")

    def plot(self) -> Figure:
        """The verdict's best and worst units across its methods and families, one row each with its
        mean and CI: the three best and the three worst of every attention unit (``best`` /
        ``worst``; a verdict written before they were recorded: the headline family's
        ``best_layers`` / ``worst_layers`` and ``best_heads`` / ``worst_heads``), and each family's
        best layer-level unit and best head, coloured by family, beside the random baseline (and
        the other baselines the verdict keeps), the ceiling and the best gradient as vertical
        lines. A verdict holds these few units only: a study's
        :meth:`~probe.StudyResult.plot` draws every layer from the summary table.
        Returns a :class:`matplotlib.figure.Figure`."""
        from probe.plots import Band, UnitPoint, units_figure

        family_of = {str(m): str(name) for name, info in self.families.items() for m in info.get("methods") or ()}

        def group(unit: str) -> str:
            explainer = unit.rpartition(" L")[0] or unit
            return family_of.get(explainer, explainer)

        chosen: dict[str, tuple[Mapping[str, Any], list[str]]] = {}

        def add(entries, why: str) -> None:
            for entry in entries or ():
                if isinstance(entry, Mapping) and entry.get("unit") and entry.get("mean") is not None:
                    chosen.setdefault(str(entry["unit"]), (entry, []))[1].append(why)

        overall = bool(self.best or self.worst)
        add(self.best, "best")
        add(self.worst, "worst")
        if not overall:
            add(self.best_layers, "best layer-level")
            add(self.data.get("worst_layers"), "worst layer-level")
            add(self.best_heads, "best head")
            add(self.data.get("worst_heads"), "worst head")
        for name, info in _family_order(self.families):
            add([info.get("best_layer")], f"{name}: best layer-level")
            add([info.get("best_head")], f"{name}: best head")
        if not chosen:
            raise InputError(f"this verdict records no layer-level unit or head to plot (answer {self.answer!r})")
        points = []
        for unit, (entry, whys) in chosen.items():
            ci = entry.get("ci") or (None, None)
            points.append(UnitPoint(unit, group(unit), "; ".join(dict.fromkeys(whys)), _mean(entry), _number(ci[0]),
                                    _number(ci[1])))
        bands = {}
        for name, entry in {**(self.data.get("baselines") or {}), "random": self.random,
                            "ceiling": self.ceiling}.items():
            if isinstance(entry, Mapping) and entry.get("mean") is not None:
                ci = entry.get("ci") or (None, None)
                label = f"ceiling ({' vs '.join(entry.get('pair') or ())})" if name == "ceiling" else name
                bands[name] = Band(label, _mean(entry), _finite(ci[0]), _finite(ci[1]))
        gradient = dict(self.best_gradient) if self.best_gradient and self.best_gradient.get("mean") is not None else None
        return units_figure(points, bands, gradient, self.measure, note=self._left_out(),
                            title=f"verdict: {self.answer} (best and worst units across methods and families, "
                                  f"vs {self.reference})")

    def _left_out(self) -> str:
        """What :meth:`plot` does not draw, in words: token-level explainers (no layer axis) beside the best
        gradient's line, and the gradient explainers excluded by their failed checks."""
        bar = self.data.get("gradient_bar") or {}
        best = (self.best_gradient or {}).get("explainer")
        excluded = ", ".join(f"{m} ({', '.join(c)})" for m, c in (bar.get("excluded") or {}).items())
        kept = f" other than the best gradient, {best} (the dashed line)" if best else ""
        failed = f"; gradient explainers whose checks failed: {excluded}" if excluded else ""
        named = self.data.get("token_level")  # absent from a verdict.json written before it was recorded
        if named is not None:
            named = [str(e) for e in named if e != best and e not in (bar.get("excluded") or {})]
            if not named and not failed:
                return ""
            kept = f": {', '.join(named) or 'none'}" + (f" ({best}, the best gradient, is the dashed line)" if best else "")
        return (f"not drawn: token-level explainers (no layer axis){kept}{failed}; the verdict holds the units "
                "drawn only, run.to_pandas() has every explainer")

    @property
    def heads_causal(self) -> Mapping[str, Any] | None:
        """The per-head causal test beside the verdict (``probe.study.heads_causal``: per head,
        whether where it looks is what matters through it), or None where the study did not ask for it."""
        value = self.data.get("heads_causal")
        return MappingProxyType(dict(value)) if isinstance(value, Mapping) else None

    @property
    def frontier(self) -> Mapping[str, Any] | None:
        """The cost frontier (``probe.study.frontier``): each method's agreement with the reference
        against its seconds per example, and ``cheapest``, the cheapest method within the ceiling (or
        None, ``why`` says why); None for a verdict written before frontiers or without step seconds."""
        value = self.data.get("frontier")
        return MappingProxyType(dict(value)) if isinstance(value, Mapping) else None

    @property
    def tracks(self) -> bool:
        """True when the answer is yes or heads only."""
        return self.answer in ("yes", "heads only")

    def to_dict(self) -> dict[str, Any]:
        """The whole verdict as plain dicts and lists, keys in the order they were built: what
        ``verdict.json`` holds (a copy; changing it changes nothing here)."""
        return copy.deepcopy(dict(self.data))

    def to_pandas(self) -> pd.DataFrame:
        """One row per family of attention explanation (the order of ``families``; the headline's
        family first): ``family``, ``answer``, ``layer_tracking`` / ``layer_total`` and
        ``head_tracking`` / ``head_total`` (units that track the reference, of how many),
        ``best_layer`` / ``best_layer_mean`` and ``best_head`` / ``best_head_mean`` (the family's best
        unit by mean agreement; None and NaN where it has none)."""
        import pandas as pd

        columns = ["family", "answer", "layer_tracking", "layer_total", "head_tracking", "head_total",
                   "best_layer", "best_layer_mean", "best_head", "best_head_mean"]
        rows = []
        for name, info in self.families.items():
            layers, heads = info.get("layer_units") or {}, info.get("head_units") or {}
            best_layer, best_head = info.get("best_layer") or {}, info.get("best_head") or {}
            rows.append((name, info.get("answer"), int(layers.get("tracking", 0)), int(layers.get("total", 0)),
                         int(heads.get("tracking", 0)), int(heads.get("total", 0)), best_layer.get("unit"),
                         _mean(best_layer), best_head.get("unit"), _mean(best_head)))
        frame = pd.DataFrame.from_records(rows, columns=columns)
        return frame.astype({"layer_tracking": "int64", "layer_total": "int64", "head_tracking": "int64",
                             "head_total": "int64", "best_layer_mean": "float64", "best_head_mean": "float64"})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "verdict") -> Verdict:
        """A :class:`Verdict` from the dict ``verdict.json`` holds; one-line :class:`InputError` if it is not one."""
        if not isinstance(data, Mapping):
            raise InputError(f"{source} is not a verdict: expected a mapping with answer, headline, reference, measure")
        missing = [k for k in ("answer", "headline", "reference", "measure", "layer_units", "head_units") if k not in data]
        if missing:
            raise InputError(f"{source} is not a verdict: it lacks {', '.join(missing)}")
        if data["answer"] not in ANSWERS:
            raise InputError(f"{source}: unknown answer {data['answer']!r}: expected one of {', '.join(ANSWERS)}")

        def units(key: str) -> UnitCount:
            value = data[key] or {}
            return UnitCount(tracking=int(value.get("tracking", 0)), total=int(value.get("total", 0)))

        def rows(key: str) -> tuple[Mapping[str, Any], ...]:
            return tuple(MappingProxyType(dict(r)) for r in data.get(key) or ())

        def entry(key: str) -> Mapping[str, Any] | None:
            value = data.get(key)
            return MappingProxyType(dict(value)) if isinstance(value, Mapping) else None

        return cls(
            answer=str(data["answer"]), headline=str(data["headline"]), reference=str(data["reference"]),
            measure=str(data["measure"]), rule=str(data.get("rule", "")), alpha=float(data.get("alpha", float("nan"))),
            level=float(data.get("level", float("nan"))), bootstrap=int(data.get("bootstrap", 0)),
            layer_units=units("layer_units"), head_units=units("head_units"),
            best=rows("best"), worst=rows("worst"), best_layers=rows("best_layers"), best_heads=rows("best_heads"),
            random=entry("random"), best_gradient=entry("best_gradient"), ceiling=entry("ceiling"),
            undecidable=str(data["undecidable"]) if data.get("undecidable") else None,
            families=MappingProxyType({str(k): MappingProxyType(dict(v)) for k, v in _family_order(data.get("families") or {})}),
            data=MappingProxyType(dict(data)),
        )

    @classmethod
    def read(cls, path: str | Path) -> Verdict:
        """Read ``verdict.json``, or the one in a result folder."""
        path = Path(path)
        if path.is_dir():
            path = path / "verdict.json"
        if not path.is_file():
            raise InputError(f"{path} does not exist: a finished study's result folder holds verdict.json")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{path} is unreadable ({err}); rerun the study") from None
        return cls.from_dict(data, source=str(path))
