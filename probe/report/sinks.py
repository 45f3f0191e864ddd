"""Attention sinks as the report and ``probe inspect`` name them, from a sink table only (torch-free).

The table is :func:`probe.explainers.sinks.sink_rows`' (a study's ``sinks`` table): one row per
example, layer and query head with the target row's ``share`` of attention on sink keys,
``n_sinks``, ``first`` (the first token is a sink) and the sinks' ``positions``. Here it becomes a
per-layer summary (:func:`sink_layers`), a per-head one (:func:`sink_heads`) and the sentences that
name the sinks (:func:`sink_lines`: "the first token is a sink in 99% of the heads of layers 15-29",
or one line saying there are none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FIRST_TOKEN_RUN", "OTHER_SINKS_SHOWN", "sink_heads", "sink_layers", "sink_lines"]

#: a run of layers is named in :func:`sink_lines` when the first token is a sink in at least this
#: share of its heads (over the examples), layer by layer
FIRST_TOKEN_RUN = 0.5
#: other sink positions named per layer in :func:`sink_layers`
OTHER_SINKS_SHOWN = 3


def _other_sinks(group, tokens) -> str:
    """The most frequent sink keys other than the first token, as ``'text' (position p) in x%``
    of the layer's (example, head) rows (``tokens``: example, position -> token text, or None)."""
    from collections import Counter

    counts: Counter = Counter()
    for example, positions in zip(group["example"], group["positions"]):
        for p in (int(k) for k in positions.split(",") if k):
            if p == 0:
                continue
            text = tokens.get((int(example), p)) if tokens else None
            counts[repr(text) if text is not None else f"position {p}"] += 1
    if not counts:
        return "none"
    total = len(group)
    return ", ".join(f"{name} in {count / total:.0%}" for name, count in counts.most_common(OTHER_SINKS_SHOWN))


def _token_texts(tokens) -> dict | None:
    if tokens is None or not len(tokens):
        return None
    return {(int(e), int(p)): str(t) for e, p, t in zip(tokens["example"], tokens["position"], tokens["token"])}


def sink_layers(frame: pd.DataFrame, tokens: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per layer, over the table's examples and heads: ``sink_share`` (the mean share of the target
    row on sink keys), ``with_sink`` (the share of (example, head) rows with at least one sink),
    ``first_token`` (the share whose first token is a sink), ``heads`` and ``examples`` counted,
    and ``other_sinks`` (the most frequent other sink keys, by their text where ``tokens``, a
    table of example, position and token, gives it)."""
    import pandas as pd

    texts = _token_texts(tokens)
    rows = []
    for layer, group in frame.groupby("layer", sort=True):
        rows.append({"layer": int(layer), "sink_share": float(group["share"].mean()),
                     "with_sink": float((group["n_sinks"] > 0).mean()), "first_token": float(group["first"].mean()),
                     "heads": int(group["head"].nunique()), "examples": int(group["example"].nunique()),
                     "other_sinks": _other_sinks(group, texts)})
    return pd.DataFrame(rows, columns=["layer", "sink_share", "with_sink", "first_token", "heads", "examples",
                                       "other_sinks"])


def sink_heads(frame: pd.DataFrame) -> pd.DataFrame:
    """Per layer and head, over the examples: ``sink_share`` (mean), ``first_token`` (the share of
    examples whose first token is a sink of the head) and ``with_sink``."""
    grouped = frame.groupby(["layer", "head"], sort=True)
    out = grouped.agg(sink_share=("share", "mean"), first_token=("first", "mean"),
                      with_sink=("n_sinks", lambda n: float((n > 0).mean()))).reset_index()
    return out.astype({"layer": "int64", "head": "int64"})


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(parts)


def sink_lines(frame: pd.DataFrame | None) -> list[str]:
    """Sentences naming a sink table's sinks: the runs of layers whose first token is a sink in at
    least :data:`FIRST_TOKEN_RUN` of the heads, the layers with other sinks, and the target row's
    share on sinks; one sentence saying there is none when no key is a sink anywhere."""
    import numpy as np

    if frame is None or not len(frame):
        return []
    threshold = float(frame["threshold"].iloc[0])
    n_examples = int(frame["example"].nunique())
    examples = f"{n_examples} example{'s' if n_examples != 1 else ''}"
    if not (frame["n_sinks"] > 0).any():
        return [f"No attention sinks: no key receives a mean attention above {threshold:g} in any head of any layer "
                f"({examples})."]
    layers = sink_layers(frame)
    lines = []
    runs: list[list] = []
    for row in layers.itertuples():
        if row.first_token >= FIRST_TOKEN_RUN:
            if runs and runs[-1][-1].layer == row.layer - 1:
                runs[-1].append(row)
            else:
                runs.append([row])
    for run in runs:
        rate = float(np.mean([r.first_token for r in run]))
        span = str(run[0].layer) if len(run) == 1 else f"{run[0].layer}-{run[-1].layer}"
        lines.append(f"The first token is a sink in {rate:.0%} of the heads of layer{'s' if len(run) > 1 else ''} "
                     f"{span}.")
    if not runs:
        best = layers.loc[layers["first_token"].idxmax()]
        lines.append(f"The first token is a sink in at most {best.first_token:.0%} of a layer's heads "
                     f"(layer {int(best.layer)}).")
    other = frame[(frame["n_sinks"] > frame["first"].astype(int))]
    if len(other):
        where = sorted(int(v) for v in other["layer"].unique())
        lines.append(f"Keys other than the first token are sinks in {len(other) / len(frame):.0%} of the "
                     f"(example, head) rows, in layers {_layer_ranges(where)}.")
    share = layers["sink_share"]
    top = layers.loc[share.idxmax()]
    lines.append(f"The target row puts a mean {float(frame['share'].mean()):.2f} of its attention on sink keys "
                 f"(per layer {float(share.min()):.2f} to {float(share.max()):.2f}, most in layer {int(top.layer)}); "
                 f"sinks are keys whose mean received attention over the query rows exceeds {threshold:g} "
                 f"({examples}).")
    return lines
