"""The plan's predictions for a full 7B shape from seven_b.py's measured rows (``--predict``), and the
markdown tables of a seven_b JSON file:

    python tests/gpu/seven_b_predict.py seven_b.json     # the measured and predicted tables, as markdown

How a method's seconds are predicted (each step an assumption, stated in the output):
1. depth: its seconds at the measured depths, fitted as fixed + per layer (two depths; one depth, or a
   deeper model that ran no slower: all per layer, no fixed part), taken at the full depth;
   never below the forward's own prediction at that length (every method runs at least one);
2. length: times the ratio of its rows at the target length to its rows at the measured length, both
   counted by the plan (``probe.study.cost.method_rows``; a backward row weighs three forwards), and the
   ratio of the plan's per-row weight ``T (6 d + T)`` (``probe.study.cost.row_weight``);
3. on a GPU: times the CPU's measured forward throughput over an assumed achieved GPU throughput.
Memory: the full shape's weights exactly (its parameter count times the dtype's bytes); activations by
the plan's rule, the measured peak per token of the largest call (fitted to the depth as the seconds are)
times the run's largest call, plus eager attention's [heads, T, T] scores (:func:`_activation`).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path

GIB = 2**30
#: the memory an 80 GB H100 gives torch, about
H100_GIB = 79.0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _fit(points: dict[int, float], layers: int) -> float:
    """Seconds at ``layers`` from {depth: seconds}: fixed + per layer through two depths, else (one depth,
    or a deeper model no slower) all per layer from the deepest."""
    if len(points) == 1:
        (depth, seconds), = points.items()
        return seconds * layers / depth
    (d1, s1), (d2, s2) = sorted(points.items())[:2]
    if s2 <= s1:  # the deeper model ran no slower: one-time costs or noise hide the per-layer part
        return s2 * layers / d2  # taken as all per layer, an upper bound
    per_layer = (s2 - s1) / (d2 - d1)
    return max(s1 - per_layer * d1, 0.0) + per_layer * layers


def _fit_memory(points: dict[int, float], layers: int) -> float:
    """Peak at ``layers`` from {depth: peak}: fixed + per layer where the deeper model held more, else the
    largest (a method that holds one layer at a time)."""
    (d1, m1), (d2, m2) = (sorted(points.items()) * 2)[:2] if len(points) == 1 else sorted(points.items())[:2]
    if m2 <= m1 or d1 == d2:
        return max(m1, m2)
    per_layer = (m2 - m1) / (d2 - d1)
    return max(m1 - per_layer * d1, 0.0) + per_layer * layers


def _activation(entry, depths: dict[int, dict], tokens: int, t0: int, config) -> float:
    """GiB above the weights at ``tokens`` on the full depth, by the plan's rule (probe.study.cost's
    ``_run_peak``): the measured peak per token of the largest call (fitted to the depth), times the run's
    largest call, the measured one grown with the tokens up to what one call holds (gradients
    GRADIENT_TOKEN_BUDGET tokens, the engine its token budget); plus eager attention's [heads, T, T]
    scores, which the plan's linear rule misses: one layer's bf16 scores and fp32 softmax at a time, or
    every layer's bf16 weights where a backward keeps them."""
    from probe.explainers.gradient_forward import GRADIENT_TOKEN_BUDGET
    from probe.intervene.engine import Engine

    deepest = depths[max(depths)]
    peak = _fit_memory({d: r["peak_gib"] for d, r in depths.items()}, config.num_hidden_layers)
    call = max(deepest.get("call_tokens") or t0, 1)
    grown = call * tokens / t0
    gradients = entry is not None and entry.needs_gradients
    engine = entry is not None and (entry.engine or entry.family == "intervention")
    budget = inspect.signature(Engine).parameters["token_budget"].default
    cap = GRADIENT_TOKEN_BUDGET if gradients else budget if engine else None
    run_tokens = grown if cap is None else min(grown, max(cap, tokens))
    squares = config.num_attention_heads * tokens * tokens
    scores = squares * 2 * config.num_hidden_layers if gradients else squares * 6
    return peak / call * run_tokens + scores / GIB


def _weighted_rows(pm, name: str, params, example) -> float | None:
    from probe.study.cost import method_rows

    rows = (1, 0) if name == "forward" else method_rows(pm, name, params, example)
    return None if rows is None else rows[0] + 3 * rows[1]


def _row_ratio(name: str, tokens: int, t0: int, width: int) -> float:
    """A row at ``tokens`` over a row at ``t0`` by the plan's weight; a row that feeds one token against
    the others cached (:data:`seven_b.ONE_TOKEN_ROWS`) weighs that token's pass, ``6 d + T``."""
    from seven_b import ONE_TOKEN_ROWS

    from probe.study.cost import row_weight

    if name in ONE_TOKEN_ROWS:
        return (6 * width + tokens) / (6 * width + t0)
    return row_weight(tokens, width) / row_weight(t0, width)


def _counting_examples(args, lengths: list[int]):
    """A one-layer model of the shape's width and heads (its vocabulary cut: only the row counts are
    read) and an example at each length, for the plan's row counts."""
    from probe.models.shapes import shape_model, shape_texts
    from probe.rows.prepare import prepare

    pm = shape_model(args.shape, layers=1, heads=args.heads, vocab=512, device="cpu", dtype=args.dtype)
    return pm, {t: prepare(pm, shape_texts(pm, t))[0] for t in lengths}


def _measured(rows: list[dict]) -> tuple[int, dict[str, dict[int, dict]]]:
    """(the measured length, {method: {depth: row}}) of the rows that ran."""
    tokens = min(r["tokens"] for r in rows)
    by_method: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["tokens"] == tokens and r["status"] == "ok":
            by_method.setdefault(r["method"], {})[r["layers"]] = r
    return tokens, by_method


def predictions(args, rows: list[dict], models: dict) -> dict:
    """Every method that ran, predicted for the full shape at ``args.predict_tokens`` on the CPU and on a
    GPU at ``args.gpu_tflops``; with the assumptions, in a dict for the JSON."""
    from probe import registry
    from probe.models.shapes import SHAPES, parameter_count, shape_config
    shape = SHAPES[args.shape]
    full = shape_config(args.shape, layers=args.predict_layers, heads=args.heads, vocab=args.vocab)
    width, depth = full.hidden_size, full.num_hidden_layers
    t0, by_method = _measured(rows)
    deepest = max(r["layers"] for r in rows if r["method"] == "forward" and r["tokens"] == t0)
    forward = by_method["forward"][deepest]
    # one thread on a CPU: the process's CPU seconds, which other work on the machine does not inflate
    clock = "cpu_seconds" if args.device == "cpu" and torch_threads() == 1 else "seconds"
    cpu_rate = forward["flops"] / forward[clock]
    weights_gib = parameter_count(full) * (2 if args.dtype in ("bf16", "fp16") else 4) / GIB
    pm, examples = _counting_examples(args, [t0, *args.predict_tokens])
    out: list[dict] = []
    floor: dict[int, float] = {}  # the forward's prediction per length: every method runs at least one
    for name, depths in by_method.items():  # the forward first: it is the first measured row
        entry = registry.find(name)
        params = depths[max(depths)].get("params")
        base = _weighted_rows(pm, name, params, examples[t0])
        at_depth = _fit({d: r[clock] for d, r in depths.items()}, depth)
        for tokens in args.predict_tokens:
            reason = registry.skipped(pm, tokens).get(name) if entry is not None else None
            if reason is not None and reason != entry.applies.by_name:  # type: ignore[union-attr]
                out.append({"method": name, "tokens": tokens, "status": "not applicable", "detail": reason})
                continue
            target = _weighted_rows(pm, name, params, examples[tokens])
            scale = (target / base if base and target else math.nan) * _row_ratio(name, tokens, t0, width)
            cpu = max(at_depth * scale, floor.get(tokens, 0.0))
            if name == "forward":
                floor[tokens] = cpu
            activation = _activation(entry, depths, tokens, t0, full)
            out.append({"method": name, "tokens": tokens, "status": "prediction", "cpu_seconds": cpu,
                        "gpu_seconds": cpu * cpu_rate / (args.gpu_tflops * 1e12), "activation_gib": activation,
                        "peak_gib": weights_gib + activation,
                        "fits_h100": weights_gib + activation <= H100_GIB, "weighted_rows": target})
    return {"shape": args.shape, "checkpoint": shape.checkpoint, "layers": depth, "hidden": width,
            "vocab": full.vocab_size, "parameters": parameter_count(full), "weights_gib": weights_gib,
            "measured_tokens": t0, "measured_layers": sorted({r["layers"] for r in rows}),
            "cpu_forward_tflops": cpu_rate / 1e12, "clock": clock, "gpu_tflops_assumed": args.gpu_tflops, "rows": out}


def _seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 0.1:
        return f"{s * 1000:.1f} ms"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def measured_table(data: dict) -> list[str]:
    lines = ["| method | layers | tokens | status | seconds (wall) | seconds (CPU) | peak above the weights (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in data["measured"]:
        figures = (f"{_seconds(r['seconds'])} | {_seconds(r['cpu_seconds'])} | {r['peak_gib']:.2f}" if "seconds" in r
                   else f"| | {r.get('detail', '')[:90]}")
        lines.append(f"| {r['method']} | {r['layers']} | {r['tokens']} | {r['status']} | {figures} |")
    return lines


def predicted_table(data: dict) -> list[str]:
    """One row per method, a column group per predicted length: CPU seconds, H100 seconds, peak GiB
    (weights and activations; * where over 80 GB)."""
    p = data["predictions"]
    lengths = sorted({r["tokens"] for r in p["rows"]})
    by_method: dict[str, dict[int, dict]] = {}
    for r in p["rows"]:
        by_method.setdefault(r["method"], {})[r["tokens"]] = r
    head = ["method"] + [f"{what} at {t:,}" for what in ("CPU", "H100", "peak GiB") for t in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, at in by_method.items():
        cells = [method]
        for key in ("cpu_seconds", "gpu_seconds", "peak_gib"):
            for t in lengths:
                r = at.get(t, {})
                if r.get("status") != "prediction":
                    cells.append("n/a" if r else "")
                elif key == "peak_gib":
                    cells.append(f"{r[key]:.0f}" + ("" if r["fits_h100"] else "*"))
                else:
                    cells.append(_seconds(r[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    loaded = json.loads(Path(sys.argv[1]).read_text())
    if "--again" in sys.argv:  # the predictions recomputed from the file's measured rows and its command's options
        from seven_b import parse

        options = loaded["environment"]["command"].split()[2:]
        loaded["predictions"] = predictions(parse(options), loaded["measured"], loaded["models"])
        Path(sys.argv[1]).write_text(json.dumps(loaded, indent=1, default=str) + "\n")
    print("\n".join(measured_table(loaded)))
    if "predictions" in loaded:
        print()
        print("\n".join(predicted_table(loaded)))
