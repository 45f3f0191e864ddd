"""The verdict's headline (``verdict.json["headline"]``): the answer in words, then what it rests
on (the best units, the other families, chance, the gradient bar, the ceiling) and what the reader
must know beside it (failed sanity checks, units above the ceiling, warnings, identical rankings).
Built from the verdict's fields (:func:`probe.study.summary.verdict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from probe.names import unit_name

if TYPE_CHECKING:
    from probe.spec.study import Study


def reference_words(ref: str, study: Study) -> str:
    """``signed loo_delete`` or ``|loo_delete|``: how the verdict reference is compared."""
    return f"|{ref}|" if ref in set(study.metrics.absolute) else f"signed {ref}"


def _fewer(d: dict) -> str:
    return f" (on fewer examples: {d['fewer_examples']})" if d.get("fewer_examples") else ""


def _fmt(d: dict) -> str:
    return f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


def passing_units(layer: dict, head: dict, *, short: bool = False) -> str:
    """``3/6 layer-level units and 2/48 heads`` (``short``: ``3/6 layer-level, 2/48 heads``) from the
    ``{tracking, total}`` counts; heads left out where there are none (a study without a per-head
    explainer), not shown as 0/0."""
    parts = []
    if layer["total"] or not head["total"]:
        parts.append(f"{layer['tracking']}/{layer['total']} layer-level" + ("" if short else " units"))
    if head["total"]:
        parts.append(f"{head['tracking']}/{head['total']} heads")
    return (", " if short else " and ").join(parts)


FAMILY_WORDS = {"yes": "tracks", "heads only": "tracks in single heads only", "no": "does not track",
                "undecidable": "cannot be decided"}


def headline(model: str, v: dict, study: Study, mixing: str = "attention") -> str:
    """The verdict's first sentences from its fields ``v``: the answer, the units that pass, the best
    ones, the other families, chance, the random ranking, the gradient bar and the ceiling."""
    ref, measure = v["reference"], v["measure"]
    how = f"{measure} with {reference_words(ref, study)}" + (f"; n = {v['n']} scored examples" if v.get("n") else "")
    fam = v.get("headline_family")
    if v["answer"] == "undecidable":
        parts = [f"On {model}, whether {mixing} tracks causal importance cannot be decided ({how}): "
                 f"{v['undecidable']}."]
    else:
        subject = mixing if fam in (None, "attention weights") else fam
        lu, hu = v["layer_units"], v["head_units"]
        parts = [f"On {model}, {subject} {FAMILY_WORDS[v['answer']]} causal importance ({how}): "
                 f"{passing_units(lu, hu)} pass the rule."]
        why = (v["families"].get(fam) or {}).get("why") if fam else None
        if why:
            parts.append(f"({why}.)")
        best_layer, best_head = v["best_layers"], v["best_heads"]
        if best_layer:
            parts.append(f"Best layer-level unit: {best_layer[0]['unit']} "
                         f"{_fmt(best_layer[0])}{_fewer(best_layer[0])}.")
        if best_head:
            parts.append(f"Best head: {best_head[0]['unit']} {_fmt(best_head[0])}{_fewer(best_head[0])}.")
    others = [f"{name}: {info['answer']} ({passing_units(info['layer_units'], info['head_units'], short=True)})"
              for name, info in v["families"].items() if name != fam and v["answer"] != "undecidable"]
    if others:
        parts.append("Other attention explanations: " + "; ".join(others) + ".")
    if v["answer"] != "undecidable" and v.get("chance_test"):
        parts.append(f"Chance: {v['chance_test']}.")
    if v["random"]:
        parts.append(f"Random ranking (one draw, shown, not deciding): {_fmt(v['random'])}.")
    if v["best_gradient"]:
        parts.append(f"Best gradient ({v['best_gradient']['explainer']}): {_fmt(v['best_gradient'])}.")
    if v["gradient_bar"]["excluded"] or (v["best_gradient"] is None and v["gradient_bar"]["text"]):
        parts.append(v["gradient_bar"]["text"][0].upper() + v["gradient_bar"]["text"][1:] + ".")
    if v["ceiling"]:
        a, b = v["ceiling"]["pair"]
        parts.append(f"Ceiling ({a} vs {b}): {_fmt(v['ceiling'])}.")
    return " ".join(parts)


def verdict_headline(model: str, v: dict, study: Study, mixing: str, *, unreliable: dict, unreliable_units: dict,
                     redundant: Sequence[dict]) -> str:
    """The whole headline: :func:`headline`, then the methods and units that failed their checks, the
    units above the ceiling, the warnings and the groups of identical rankings."""
    parts = [headline(model, v, study, mixing)]
    if unreliable:
        parts.append(" Failed sanity checks (their units never track; never the gradient bar nor in a ceiling): "
                     + ", ".join(f"{m} ({', '.join(c)})" for m, c in unreliable.items()) + ".")
    if unreliable_units:
        names = [unit_name(*u) for u in unreliable_units]
        parts.append(f" Failed randomisation as units (their ranking stayed once the weights they are computed from "
                     f"were re-initialised; they never track): {', '.join(names[:6])}"
                     + (f" and {len(names) - 6} more" if len(names) > 6 else "") + ".")
    if v["above_ceiling"]:
        parts.append(" Above the ceiling: " + ", ".join(a["unit"] for a in v["above_ceiling"][:5]) + ".")
    parts += [f" Warning: {warning}." for warning in v["warnings"]]
    if redundant:
        parts.append(" Identical rankings: " + "; ".join(g["description"] for g in redundant) + ".")
    return "".join(parts)
