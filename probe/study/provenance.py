"""A finished study's provenance (``provenance.json``): the versions, the model (and its weights'
digest), the device, the seeds, the examples and those left out, and where the time and memory went."""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe.study.identity import weights_digest
from probe.study.steps import is_stepwise

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.spec.study import Study
    from probe.study.store import ResultStore


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import captum
    import torch
    import transformers

    try:  # the installed distribution's (probe.__version__ is the same number: a test holds them equal)
        own = version("probe")
    except PackageNotFoundError:
        own = "unknown (probe is not installed: run from a source tree)"
    return {"probe": own, "torch": torch.__version__, "transformers": transformers.__version__,
            "captum": captum.__version__, "numpy": np.__version__, "pandas": pd.__version__,
            "python": platform.python_version()}


def source_commit() -> str | None:
    """The git commit of the source tree probe runs from, with ``+`` where that tree holds uncommitted
    changes to tracked files (a report made from it cannot be remade from the commit alone); None
    where probe is not run from a git checkout (an installed wheel) or git is missing."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0 or not (root / "probe").is_dir():
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                "probe"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def provenance(store: ResultStore, study: Study, pm: ProbeModel, n_batches: int, tables: dict, dropped: dict,
               load_seconds: float, phases: Mapping[str, float] | None = None) -> dict:
    """What the run was and how it went: versions, the model and its weights' hash, the data, the
    seconds of each step over the batches (``step_seconds``) and the model rows it ran
    (``step_rows``: forwards without gradients, and backwards: rows run with them), and of what ran once after them
    (``phase_seconds``: the sanity checks, the randomisation check among them, the statistics)."""
    import torch

    infos = [store.batch_info(b) for b in range(n_batches)]
    examples = tables["examples"]
    n = len(examples)
    steps: dict[str, float] = {}
    rows: dict[str, list[int]] = {}
    for info in infos:
        for step, seconds in info.get("timings", {}).items():
            steps[step] = steps.get(step, 0.0) + seconds
        for step, (forwards, backwards) in info.get("step_rows", {}).items():
            done = rows.setdefault(step, [0, 0])
            done[0], done[1] = done[0] + int(forwards), done[1] + int(backwards)
    lengths = examples["n_tokens"]
    return {
        "versions": _versions(), "source_commit": source_commit(),
        "model": {"id": study.model.id, "path": str(pm.path), "revision": pm.metadata.get("revision"),
                  "weights_sha256": weights_digest(pm.path), "builtin": pm.metadata or None,
                  "contract": pm.contract.to_dict(), "random_weights": list(pm.random_weights),
                  "allow_random_weights": bool(pm.allow_random_weights)},
        "device": str(pm.device), "dtype": pm.contract.dtype, "attn_implementation": pm.contract.implementation,
        "seed": study.statistics.seed, "dataset_seed": study.dataset.seed, "fingerprint": study.fingerprint(),
        "examples": int(examples["source"].nunique()) if is_stepwise(examples) else n,
        **({"output_tokens": n} if is_stepwise(examples) else {}), "batches": n_batches,
        "left_out": {**dropped, **_without_spans(tables)},
        "accuracy": None if study.target.label is not None else _accuracy(examples),
        "sequence_length": {"mean": float(lengths.mean()), "median": float(lengths.median()),
                            "min": int(lengths.min()), "max": int(lengths.max())},
        "wall_seconds": float(sum(i["wall_s"] for i in infos)), "model_load_seconds": load_seconds,
        "step_seconds": {k: float(v) for k, v in steps.items()},
        "step_rows": {k: {"forwards": f, "backwards": b} for k, (f, b) in rows.items()},
        "phase_seconds": {k: float(v) for k, v in (phases or {}).items()},
        "peak_memory_bytes": int(max(i.get("peak_memory_bytes", -1) for i in infos)),
        "forward_passes_per_example": float(sum(i["forward_calls"] for i in infos) / max(n, 1)),
        "forward_rows_per_example": float(sum(i["forward_rows"] for i in infos) / max(n, 1)),
        "batch_sizes": batch_sizes(infos, study.engine.token_budget),
        "devices_used": sorted({str(i.get("device")) for i in infos}),
        "torch_threads": torch.get_num_threads(), "host": platform.platform(), "machine": machine_load(infos),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def batch_sizes(infos: list[dict], token_budget: int) -> dict:
    """The sizes the batches ran at: the study's ``token_budget``, the splits made on running out of
    memory (``oom_splits``), and what the run settled on after them (the smallest over the batches):
    ``token_budget_used``, the tokens of one intervention pass (None where nothing ran out of memory),
    and ``examples_per_call_used``, per method run on parts of the examples, the most examples of
    one call. Batches stored before these were recorded count as none."""
    stats = [i["engine"] for i in infos if isinstance(i.get("engine"), dict)]
    budgets = [int(s["token_budget_used"]) for s in stats if s.get("token_budget_used") is not None]
    per_call: dict[str, int] = {}
    for s in stats:
        for method, size in (s.get("examples_per_call_used") or {}).items():
            per_call[method] = min(per_call.get(method, int(size)), int(size))
    return {"token_budget": int(token_budget), "oom_splits": sum(int(s.get("oom_splits", 0)) for s in stats),
            "token_budget_used": min(budgets) if budgets else None, "examples_per_call_used": per_call}


def machine_load(infos: list[dict]) -> dict:
    """The machine a run's timings come from: its CPU cores and the mean of the 1-minute load average
    at the end of each batch (None where no batch recorded one, as before this was recorded)."""
    import os

    loads = [float(i["load_average"]) for i in infos if i.get("load_average") is not None]
    return {"cpu_count": os.cpu_count(), "load_average": sum(loads) / len(loads) if loads else None,
            "batches_with_load": len(loads)}


def _accuracy(examples: pd.DataFrame) -> float | None:
    """How often the explained label (the prediction, or the LM's preferred choice) equals the
    dataset's label; None when either is missing (and, by the caller, when the study fixes the label)."""
    known = examples[(examples.label >= 0) & (examples.target_label >= 0)]
    return float((known.label == known.target_label).mean()) if len(known) else None


def _without_spans(tables: dict) -> dict:
    """``{"no_span": N}``: the examples of a span study that had no spans to rank (each left out of every
    pair, :data:`probe.study.tables.NO_SPAN`); empty when there are none."""
    from probe.study.tables import NO_SPAN

    left = tables.get("left_out")
    if left is None or not len(left):
        return {}
    units = pd.unique(left.loc[left["reason"] == NO_SPAN, "example"])
    if not len(units):
        return {}
    examples = tables["examples"]
    if is_stepwise(examples):  # units are output tokens: count the dataset examples they belong to
        units = pd.unique(examples.set_index("example").loc[units, "source"])
    return {"no_span": int(len(units))}
