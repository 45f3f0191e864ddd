"""The report's "Model, set-up and provenance" section: the model and its attention contract, the
study's settings, the run's provenance (or, for a run not finished, what its batches recorded) and
the methods' sanity checks."""

from __future__ import annotations

import numpy as np
import pandas as pd

from probe.document import KeyValues, Para, Section, Table, fmt
from probe.models.core import maps_are_softmax
from probe.report import analysis as an
from probe.report import figures as fg
from probe.report.output import Writer
from probe.report.results import StudyResult
from probe.report.sinks import sink_heads, sink_layers, sink_lines
from probe.spec.parts import TargetConfig


def _bytes(n) -> str:  # type: ignore[return]  # false positive: the loop returns at its last unit, TiB
    if n is None or n < 0:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _seconds(s) -> str:
    if s is None:
        return "n/a"
    s = float(s)
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min ({s:.0f} s)"


def _list(values) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _contract_rows(contract: dict) -> list[tuple[str, str]]:
    rows = [("model type / task", f"{contract.get('model_type', '?')} / {contract.get('task', '?')}")]
    stacks = contract.get("stacks") or {}
    if not stacks:
        stacks = {"model": contract}
    for name, st in stacks.items():
        n_heads, n_kv = st.get("n_heads"), st.get("n_kv_heads")
        prefix = f"{name} stack: " if len(stacks) > 1 or name != "model" else ""
        kind = "MHA: one key/value head per query head" if n_heads == n_kv else (
            "MQA: one key/value head" if n_kv == 1 else "GQA: query heads share key/value heads")
        rows.append((f"{prefix}layers x query heads", f"{st.get('n_layers')} x {n_heads}"))
        rows.append((f"{prefix}key/value heads", f"{n_kv} ({kind})"))
        kv = st.get("kv_head_of_query")
        if kv and n_heads != n_kv:
            rows.append((f"{prefix}query -> kv head", ", ".join(f"q{h}->kv{g}" for h, g in enumerate(kv))))
        rows.append((f"{prefix}head dim", str(st.get("head_dim"))))
        rows.append((f"{prefix}mask kind", str(st.get("mask_kind"))))
        if st.get("module_class"):
            rows.append((f"{prefix}attention module", str(st.get("module_class"))))
    for key in ("implementation", "dtype", "device", "max_positions", "padding_side"):
        if key in contract:
            rows.append((key.replace("_", " "), str(contract[key])))
    return rows


def _random_weights_row(prov_model: dict, study_model: dict) -> str:
    """The set-up line on weights the checkpoint did not hold (left at random initialisation)."""
    names = prov_model.get("random_weights")
    allowed = prov_model.get("allow_random_weights", study_model.get("allow_random_weights", False))
    if names:
        return (f"{len(names)}, allowed explicitly (model.allow_random_weights: true); the explained model is "
                f"partly random: {', '.join(names)}")
    if names is None:
        return ("recorded in provenance.json when the run completes"
                + ("; model.allow_random_weights: true" if allowed else ""))
    return "none: every weight was loaded from the checkpoint"


def setup_section(r: StudyResult, w: Writer) -> Section:
    blocks: list = []  # Section.blocks: Para, KeyValues, Table, ...
    if r.spec.description:
        blocks.append(Para(" ".join(r.spec.description.split())))
    blocks += [Para("Model and attention contract", "h3"), KeyValues(_model_rows(r))]
    blocks += sink_blocks(r, w)
    blocks += [Para("Study set-up", "h3"), KeyValues(_study_rows(r)),
               Para("Provenance", "h3")]
    blocks += _provenance_blocks(r)
    blocks += _sanity_blocks(r, w)
    return Section("setup", "Model, set-up and provenance", blocks)


def _model_rows(r: StudyResult) -> list[tuple[str, str]]:
    """The model: its id, path, revision, weights, pooling and attention contract."""
    contract = r.contract
    model = r.spec.model.model_dump(mode="json")
    rows = [("model", r.spec.model.id)]
    prov_model = (r.provenance or {}).get("model") or {}
    if prov_model.get("path"):
        rows.append(("model path", str(prov_model["path"])))
    if prov_model.get("revision"):
        rows.append(("revision", str(prov_model["revision"])))
    rows.append(("weights sha256", str(prov_model.get("weights_sha256") or "n/a")))
    rows.append(("weights left random", _random_weights_row(prov_model, model)))
    if (contract or {}).get("pooling"):
        pooling = contract["pooling"]
        rows.append(("pooled embedding", f"{pooling.get('mode')} pooling"
                     f"{', normalised' if pooling.get('normalize') else ''} (from {pooling.get('source')})"))
    if contract:
        rows += _contract_rows(contract)
        sinks = r.table("sinks")
        lines = sink_lines(sinks) if sinks is not None else []
        if lines:
            rows.append(("attention sinks (keys)", lines[0] + (" (more under Attention sinks)" if len(lines) > 1 else "")))
    else:
        rows += [("requested device / dtype", f"{r.spec.model.device} / {r.spec.model.dtype}"),
                 ("attention contract", "recorded in provenance.json when the run completes")]
    return rows


#: a per-head sink table is shown (not only its CSV) up to this many layer x head rows
SINK_HEAD_ROWS = 64


def _sink_source(r: StudyResult, frame: pd.DataFrame) -> str:
    """Which examples the sinks were found on, and at what cost."""
    from probe.study.sinks import NOSINK, SINK_EXAMPLES

    n = int(frame["example"].nunique())
    if NOSINK in r.spec.explainers:
        return f"found on all {n} examples by attention_nosink's own pass (no extra pass)"
    return (f"found on the study's first {n} example{'s' if n != 1 else ''} (at most {SINK_EXAMPLES}: one extra "
            "forward pass with every query row captured; run attention_nosink to find them on every example)")


def _target_stack_maps(r: StudyResult) -> str | None:
    stacks = (r.contract or {}).get("stacks") or {}
    maps = {st.get("maps", "softmax") for st in stacks.values()}
    return next((m for m in maps if not maps_are_softmax(m)), None)


def sink_blocks(r: StudyResult, w: Writer) -> list:
    """The "Attention sinks" part of the model view: the sentences naming the sinks, a per-layer
    table, a per-head table where it fits (always as CSV) and a layer x head figure; one line when
    the model has none, or when they were not measured (and why)."""
    from probe.study.sinks import unmeasured_reason

    blocks = [Para("Attention sinks", "h3")]
    frame = r.table("sinks")
    if frame is None:
        reason = unmeasured_reason(_target_stack_maps(r))
        blocks.append(Para(f"Not measured: {reason}." if reason else
                           "Not measured: this result has no sinks table (run before sinks were measured, or the "
                           "maps were read with downsampled keys).", "note"))
        return blocks
    lines = sink_lines(frame)
    source = _sink_source(r, frame)
    if not (frame["n_sinks"] > 0).any():
        return blocks + [Para(f"{lines[0][:-1]}; {source}.")]
    blocks.append(Para(" ".join(lines) + f" Sinks {source}."))
    layers = sink_layers(frame, r.table("tokens"))
    blocks.append(Table(layers, caption="per layer, over the examples and query heads: the target row's mean share of "
                                        "attention on sink keys, the share of (example, head) rows with a sink, the "
                                        "share whose first token is a sink, and the most frequent other sink keys",
                        csv=w.csv("sinks_layers", layers)))
    heads = sink_heads(frame)
    csv = w.csv("sinks_heads", heads)
    if len(heads) <= SINK_HEAD_ROWS:
        blocks.append(Table(heads, caption="per layer and head, over the examples", csv=csv))
    else:
        blocks.append(Para(f"Per layer and head: {csv}.", "note"))
    shape = (int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1)
    grids = {name: np.full(shape, np.nan) for name in ("sink share", "first token a sink")}
    for row in heads.itertuples():
        grids["sink share"][row.layer, row.head] = row.sink_share
        grids["first token a sink"][row.layer, row.head] = row.first_token
    stacks: dict[str, dict] = (r.contract or {}).get("stacks") or {}
    kv = next(iter(stacks.values()), {}).get("kv_head_of_query") if len(stacks) == 1 else None
    blocks.append(w.figure("sinks", fg.head_maps(grids, kv, labels={
        "sink share": "target row's mean attention on sink keys",
        "first token a sink": "share of examples whose first token is a sink"}),
        f"Attention sinks per layer and head: the target row's mean share of attention on sink keys (left) and the "
        f"share of examples in which the first token is a sink of the head (right); a sink is a key whose mean "
        f"received attention over the query rows exceeds {float(frame['threshold'].iloc[0]):g}."))
    return blocks


def _target_text(target: TargetConfig) -> str:
    if target.stepwise:
        output = (f"the greedy output of up to {target.generate} tokens" if target.generate is not None
                  else f"the continuation {target.continuation!r}")
        text = (f"{target.kind or 'log-prob'} of each token of {output}, given the prompt and the output before it "
                "(one unit per output token; statistics over the examples, each the mean of its tokens)")
        if target.contrast is not None:
            text += f", minus that of the foil {target.contrast!r} at the same position"
        if target.target_side:
            text += "; the output before each token is scored too (target-side attribution)"
        return text
    text = f"{target.kind or 'default'} of " + (
        f"the pooled embedding with that of {target.reference!r} (cosine)" if target.reference else
        f"the pooled embedding, dimension {target.dimension}" if target.dimension is not None else
        f"the preferred answer among {target.choices}" if target.choices else
        "the dataset label (gold)" if target.label == "gold" else
        f"label {target.label}" if target.label is not None else
        f"the continuation {target.continuation!r}" if target.continuation else "the predicted class / greedy output")
    if target.contrast_label is not None:
        text += f", minus that of label {target.contrast_label} (contrastive: this rather than that)"
    elif target.contrast is not None:
        text += f", minus that of the foil {target.contrast!r} at the same positions (contrastive: this rather than that)"
    return text


def _study_rows(r: StudyResult) -> list[tuple[str, str]]:
    """The study's settings: data, target, methods, statistics and the parts run."""
    s = r.spec
    ds, target, st, metrics = s.dataset, s.target, s.statistics, s.metrics
    filters = {k: v for k, v in ds.filters.model_dump(mode="json").items() if v is not None}
    rows = [("study", s.name),
            ("dataset", f"{ds.name} (split {ds.split}, text column {ds.text_column}, label column {ds.label_column})"),
            ("examples", f"{r.n_examples} reported" + (f" of n = {ds.n}" if ds.n is not None else "")
             + (f" ({r.n_units} output tokens)" if r.stepwise else "")
             + f", seed {ds.seed}, max length {ds.max_length or 'the model window'}"),
            ("filters", ", ".join(f"{k}={v}" for k, v in filters.items()) or "none"),
            ("units compared", f"spans: the matches of '{s.spans.pattern}', explainer scores folded by "
             f"{s.spans.aggregate}, each leave-one-out reference perturbing the whole span" if s.spans is not None
             else "tokens"),
            ("target", _target_text(target)),
            ("explainers", _list(s.explainers)),
            ("references", _list(s.references)),
            ("verdict reference / measure", f"{r.reference} / {r.measure}"),
            ("agreement measures", _list(metrics.agreement)),
            ("baselines", _list(metrics.baselines)),
            ("statistics", f"bootstrap {st.bootstrap}, level {st.level}, alpha {st.alpha}, "
                           f"seed {st.seed}, special tokens scored: {st.include_special}"),
            ("parts run", ", ".join(f"{k}: {'yes' if getattr(metrics, k) is not None else 'no'}"
                                    for k in ("erasure", "counterfactual", "heads")))]
    if target.prompt:
        rows.insert(5, ("prompt template", target.prompt))
    if metrics.absolute:
        rows.append(("compared by magnitude", _list(metrics.absolute)))
    if s.params:
        rows.append(("method parameters", "; ".join(f"{m}: {p}" for m, p in s.params.items())))
    return rows


def _provenance_blocks(r: StudyResult) -> list:
    """What the run recorded (``provenance.json``, or for a run not finished its batches' markers),
    and the time per step."""
    p = (r.provenance or {}) if r.complete else an.partial_provenance(r)
    blocks = []
    if not r.complete:
        blocks.append(Para(f"From the {r.batches_done} finished batches' markers; the full provenance "
                           "(versions, weight hash, contract) is written when the run completes.", "note"))
    blocks.append(KeyValues(_provenance_rows(r, p)))
    steps = p.get("step_seconds") or {}
    if steps:
        total = sum(steps.values()) or 1.0
        frame = pd.DataFrame({"step": list(steps), "seconds": list(steps.values())}).sort_values("seconds",
                                                                                                 ascending=False)
        frame["share"] = frame["seconds"] / total
        frame["seconds_per_example"] = frame["seconds"] / max(r.n_examples, 1)
        blocks.append(Table(frame, caption="time per step, over all batches"))
    phases = p.get("phase_seconds") or {}
    if phases:
        frame = pd.DataFrame({"phase": list(phases), "seconds": list(phases.values())})
        blocks.append(Table(frame, caption="time after the steps, once per study (the randomisation check is part of "
                                           "the sanity checks; the report's own rendering is not here: probe run "
                                           "prints it with the report's path)"))
    return blocks


def _provenance_rows(r: StudyResult, p: dict) -> list[tuple[str, str]]:
    seq = p.get("sequence_length") or {}
    rows = [("examples / batches", f"{p.get('examples', r.n_examples)} / {p.get('batches', r.batches_done)}")]
    if p.get("left_out"):
        rows.append(("left out", ", ".join(f"{k}: {v}" for k, v in p["left_out"].items())))
    if p.get("accuracy") is not None:
        rows.append(("accuracy of the explained label", f"{p['accuracy']:.3f}"))
    if seq:
        rows.append(("sequence length (tokens)", f"mean {seq.get('mean', 0):.1f}, median {seq.get('median', 0):.1f}, "
                                                 f"min {seq.get('min')}, max {seq.get('max')}"))
    rows += [("wall time (batches)", _seconds(p.get("wall_seconds")))]
    if p.get("model_load_seconds") is not None:
        rows.append(("model load", _seconds(p.get("model_load_seconds"))))
    rows += [("peak memory", _bytes(p.get("peak_memory_bytes"))),
             ("forward passes per example", fmt(p.get("forward_passes_per_example"))),
             ("forward rows per example", fmt(p.get("forward_rows_per_example")))]
    for key, label in (("device", "device"), ("dtype", "dtype"), ("attn_implementation", "attention implementation"),
                       ("devices_used", "devices used"), ("torch_threads", "torch threads"), ("seed", "seed"),
                       ("host", "host"), ("finished_at", "finished at"), ("fingerprint", "study fingerprint")):
        if p.get(key) is not None:
            value = p[key]
            rows.append((label, _list(value) if isinstance(value, list) else str(value)))
    if p.get("machine"):
        rows.append(("machine", _machine(p["machine"], p.get("torch_threads"))))
    if p.get("versions"):
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in p["versions"].items())))
    if p.get("source_commit"):
        commit = p["source_commit"]
        rows.append(("probe source", f"commit {commit.rstrip('+')[:12]}" + (" with uncommitted changes to probe/"
                                                                              if commit.endswith("+") else "")))
    rows.append(("integrity", "complete.json's digests catch accidents (a file edited, damaged or left by a killed "
                              "run, another study's results), not forgery: they live in the folder they describe"))
    return rows


def _machine(machine: dict, threads: int | None) -> str:
    """The machine's cores and load while the batches ran, so that the wall time can be read."""
    text = f"{machine.get('cpu_count')} CPU cores"
    load = machine.get("load_average")
    if load is None:
        return text + "; load not recorded"
    text += f"; load average {load:.1f} at the end of the batches (1-minute, mean)"
    if threads is not None and load > threads + 0.5:
        text += f": more than the run's {threads} torch thread(s), so other work shared the machine"
    return text


def _sanity_blocks(r: StudyResult, w: Writer) -> list:
    """The sanity checks (verdict.json's ``sanity``): a table, and the randomisation curves."""
    checks = (r.verdict.data.get("sanity") if r.verdict is not None else None)
    if checks is None:
        return [Para("Sanity checks", "h3"), Para("This result has no sanity checks (run before they existed, or "
                                                  "not complete).", "note")]
    blocks = [Para("Sanity checks", "h3")]
    if not checks:
        return blocks + [Para("No explainer in this study has a check that applies.", "note")]
    whole = [c for c in checks if int(c.get("layer", -1) if c.get("layer") is not None else -1) < 0]
    units = [c for c in checks if c not in whole]
    frame = pd.DataFrame([{k: c.get(k) for k in ("method", "check", "status", "value", "detail")}
                          for c in whole] + unit_rollup(units), columns=["method", "check", "status", "value", "detail"])
    blocks.append(Table(frame, caption="sanity checks of each method (fail: unreliable for this study, its units never "
                                       "track; per unit: the units of a bottom-up method, each asked on its own, a "
                                       "failed unit never tracks; not informative: the check could not tell; not run: "
                                       "why)", csv=w.csv("sanity", frame)))
    if units:
        unit_frame = pd.DataFrame([{k: c.get(k) for k in ("method", "layer", "head", "check", "status", "value",
                                                           "detail")} for c in units])
        blocks.append(Para(f"Every unit's own randomisation check ({len(units)} units) is in "
                           f"{w.csv('sanity_units', unit_frame)}.", "note"))
    curves = {c["method"]: c["curve"] for c in whole if c.get("check") == "randomisation" and c.get("curve")}
    if any(len(curve) > 2 for curve in curves.values()):  # the trained model and more than the judged stage
        blocks.append(w.figure("randomisation", fg.randomisation_curves(curves, r.reference),
                               randomisation_caption(curves)))
    elif curves:
        blocks.append(Para("The randomisation check drew its judged stage alone (the table's values); "
                           "metrics.sanity.fractions: [0.25, 0.5, 1.0] draws the cascade's curve, from the output "
                           "head alone down.", "note"))
    convergence = an.ig_convergence(r)
    if len(convergence):
        shown = convergence.assign(**{c: [f"{v:.1e}" for v in convergence[c]]
                                      for c in ("median_relative_delta", "max_relative_delta")})
        blocks.append(Table(shown, caption="integrated gradients' completeness by the number of Gauss-Legendre "
                                                 "points: examples tried, examples whose scores come from that try, "
                                                 "median and largest |delta| / |f(x) - f(baseline)|",
                            csv=w.csv("ig_convergence", convergence)))
        table = r.table("convergence")
        blocks.append(w.figure("ig_convergence", fg.convergence_curves(table), convergence_caption(table)))
    return blocks


def unit_rollup(units: list[dict]) -> list[dict]:
    """One row per (method, check) of per-unit checks: how many units passed, failed or could not tell,
    the range of their values, and the failed units by name."""
    from probe.names import unit_name

    rows = []
    grouped: dict[tuple[str, str], list[dict]] = {}
    for c in units:
        grouped.setdefault((c["method"], c["check"]), []).append(c)
    for (method, check), group in grouped.items():
        counts: dict[str, int] = {}
        for c in group:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        values = [float(c["value"]) for c in group if c.get("value") is not None]
        failed = [unit_name(method, int(c["layer"]), int(c["head"])) for c in group if c["status"] == "fail"]
        detail = ("per unit, each asked about the weights it is computed from (the embeddings and its layers 0..l); "
                  + (f"values {min(values):+.2f} to {max(values):+.2f}; " if values else "")
                  + (f"failed: {', '.join(failed[:8])}" + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
                     if failed else "no unit failed"))
        rows.append({"method": method, "check": f"{check} (per unit)",
                     "status": ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                     "value": float(np.median(values)) if values else None, "detail": detail})
    return rows


def randomisation_caption(curves: dict[str, list]) -> str:
    """The randomisation figure's caption, worded from the stages its data hold."""
    _, has_head = fg.randomisation_stages(curves)
    stages = ("the output head, then the layers from the top, are re-initialised" if has_head else
              "the layers from the top are re-initialised (there is no head stage: the model has no separate "
              "output head to re-initialise)")
    judged = "once the head and the top half are random" if has_head else "once the top half is random"
    return ("Cascading model-parameter randomisation (Adebayo et al. 2018): each explainer's mean Spearman with its "
            f"trained-model scores as {stages}; the reference's own curve (black, dashed) shows whether the model's "
            f"function changed. An explainer still at or above 0.5 {judged} (the dotted line), while the reference "
            "moved, does not depend on the model. Curves that are identical are drawn once, their names joined "
            "by =.")


def convergence_caption(frame: pd.DataFrame) -> str:
    """The IG convergence figure's caption, worded from the data: one point per example with fixed
    steps, a line per example that ends at the tolerance with ``steps: auto``."""
    tries = frame.groupby("example")["steps"].nunique()
    steps = sorted(int(v) for v in frame["steps"].unique())
    zeros = int((frame["delta"] == 0).sum())
    text = ("Integrated gradients: the completeness delta relative to f(x) - f(baseline) against the points used, "
            "per example (thin) and its median (black). ")
    if (tries > 1).any():
        text += "Each example's line ends where it met the tolerance (steps: auto)."
    else:
        text += (f"Every example used the same {_list(steps)} points: one point per example"
                 + (" per number of points." if len(steps) > 1 else "."))
    if zeros:
        text += (f" {zeros} delta{'s are' if zeros > 1 else ' is'} exactly 0 (no place on a log axis): "
                 "the red triangles at the bottom.")
    return text
