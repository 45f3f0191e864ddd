"""What a study computes, read from its spec alone: the methods it needs (explainers, references,
the members of its ceilings, its erasure rankings). Used by the runner and by the sanity checks."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from probe.errors import InputError
from probe.names import method_family as family

if TYPE_CHECKING:
    from probe.spec.study import Study


def ceiling_pairs(study: Study) -> list[tuple[str, str]]:
    """Pairs of references (and gradient vs intervention) whose agreement bounds what to expect."""
    if study.metrics.ceilings is not None:
        return [(a, b) for a, b in study.metrics.ceilings]
    refs = list(study.references)
    return [(a, b) for j, b in enumerate(refs) for a in refs[:j]]


def methods_needed(study: Study) -> list[str]:
    names = list(dict.fromkeys([*study.explainers, *study.references]))
    for a, b in ceiling_pairs(study):
        names += [m for m in (a, b) if m not in names]
    if study.metrics.erasure is not None:
        for ranking in erasure_rankings(study):
            method = ranking.split("@")[0]
            if method not in names:
                names.append(method)
    return names


def erasure_rankings(study: Study) -> list[str]:
    spec = study.metrics.erasure
    if spec.rankings:
        return list(spec.rankings)
    out = []
    attention = [m for m in study.explainers if family(m) == "attention"]
    gradient = [m for m in study.explainers if family(m) == "gradient"]
    for m in ("attention_mean", "rollout"):
        if m in attention:
            out.append(f"{m}@last")
    if not out and attention:
        out.append(f"{attention[0]}@last")
    if gradient:
        out.append(gradient[0])
    out.append(study.verdict_reference)
    return list(dict.fromkeys(out))


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` as ``(I, N)`` (None when not given); a one-line error otherwise. Torch-free,
    so the command line checks it before the slow imports."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise InputError(f"--shard {text!r} is not I/N with 0 <= I < N (e.g. 0/2)")
    return int(match.group(1)), int(match.group(2))
