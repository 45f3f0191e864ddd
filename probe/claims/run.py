"""Run an audit: load the model and the examples once, measure every claim, decide, write the report.

The examples are those a study with the same data would explain (:func:`probe.study.examples.select_examples`),
prepared with the claim file's target; what each claim kind checks, measures and how it is decided is
in its module of :mod:`probe.claims.kinds`, the decision rules' mechanics in :mod:`probe.claims.rules`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from probe.claims.context import AuditContext
from probe.claims.kind import ClaimResult, clean_json
from probe.claims.kinds import KINDS
from probe.claims.spec import ClaimFile
from probe.errors import InputError
from probe.files import write_files
from probe.names import printable
from probe.study.examples import check_contrast, prepare_examples, select_examples

if TYPE_CHECKING:
    import pandas as pd

    from probe.models.core import ProbeModel

__all__ = ["AuditResult", "run_audit"]


@dataclass(repr=False)
class AuditResult:
    """What :func:`probe.audit` returns: each claim's result (:class:`~probe.claims.kind.ClaimResult`),
    in the claim file's order, with the model, data and statistics it ran with, the claim file
    (``source``), the seconds it took, and the report folder and its files when one was written."""

    claims: list[ClaimResult]
    model: dict
    data: dict
    statistics: dict
    source: str
    description: str = ""
    seconds: float = 0.0
    out_dir: Path | None = None
    files: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        from collections import Counter

        from probe.claims.render import why_undecided
        from probe.display import clip

        counts = Counter(c.verdict for c in self.claims)
        tally = ", ".join(f"{n} {v}" for v, n in counts.items())
        n = len(self.claims)
        # an undecided claim's reason below the line, as a decided one's verdict is in it
        reasons = [f"\n# claim {i} inconclusive: {clip(why, 200)}" for i, c in enumerate(self.claims, 1)
                   if (why := why_undecided(c.to_dict()))]
        return (f"<AuditResult {(self.model or {}).get('id', '?')}: {n} claim{'s' if n != 1 else ''}"
                f"{f' ({tally})' if tally else ''}>" + "".join(reasons))

    def _repr_html_(self) -> str:
        from probe.display import block_html, frame_html

        frame = self.to_pandas()[["claim", "kind", "verdict", "why", "effect", "ci_low", "ci_high", "n"]]
        # the first line only: the reasons are the table's why column
        return "<div>" + block_html(repr(self).split("\n")[0], frame_html(frame, max_rows=max(len(frame), 1))) + "</div>"

    def to_dict(self) -> dict:
        return clean_json({"source": self.source, "description": self.description, "model": self.model, "data": self.data, "statistics": self.statistics,
                       "claims": [c.to_dict() for c in self.claims], "seconds": round(self.seconds, 3)})

    def to_pandas(self) -> pd.DataFrame:
        """One row per claim, in the claim file's order: ``claim``, ``kind``, ``verdict`` (supported,
        refuted or inconclusive), ``why`` (an inconclusive claim's reason and ``n_needed``, as
        audit.md gives them; "" where decided), ``effect`` with its CI ``ci_low`` / ``ci_high``, ``n``,
        ``threshold``, ``measure``, ``intervention``, ``seconds``."""
        import pandas as pd

        from probe.claims.render import why_undecided

        columns = ["claim", "kind", "verdict", "why", "effect", "ci_low", "ci_high", "n", "threshold", "measure",
                   "intervention", "seconds"]
        rows = [(c.claim, c.kind, c.verdict, why_undecided(c.to_dict()), float(c.effect), float(c.ci[0]),
                 float(c.ci[1]), int(c.n), float(c.threshold), c.measure, c.intervention, float(c.seconds))
                for c in self.claims]
        return pd.DataFrame.from_records(rows, columns=columns)

    def write(self, out_dir: str | Path) -> list[Path]:
        """audit.json, audit.md and audit.html in ``out_dir`` (created)."""
        from probe.claims.render import render_html, render_markdown

        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
        data = self.to_dict()
        paths = [out / "audit.json", out / "audit.md", out / "audit.html"]
        texts = [json.dumps(data, indent=2, ensure_ascii=False) + "\n", render_markdown(data), render_html(data)]
        # all three written, then renamed into place: a failure leaves the earlier audit's files as they were
        write_files(dict(zip(paths, texts)))
        self.out_dir = out
        self.files = [str(p) for p in paths]
        return paths


# ------------------------------------------------------------------------------------------ the run


def _check_sites(ctx: AuditContext) -> None:
    """Refuse what the model cannot do (a layer or head it lacks, a replacement token its tokenizer
    lacks) for every claim, by its kind's check, before anything slow runs."""
    for index, claim in enumerate(ctx.file.claims):
        KINDS[claim.kind].check(ctx, claim, index)


def _check_target(pm: ProbeModel, claim_file: ClaimFile) -> None:
    t = claim_file.target
    if t.choices and not pm.task.next_token:
        raise InputError(f"{claim_file.source}: target.choices applies to causal LMs; {pm.name} is a {pm.task} model")
    if t.label == "gold" and not pm.task.labels:
        raise InputError(f"{claim_file.source}: target.label: gold applies to classifiers; {pm.name} is a {pm.task} "
                         f"model")
    check_contrast(pm, t, f"{claim_file.source}: ")
    if t.stepwise and not pm.task.continuations:
        raise InputError(f"{claim_file.source}: target.{'generate' if t.generate is not None else 'steps'} explains a "
                         f"language model's output token by token; {pm.name} is a {pm.task} model")


def run_audit(claim_file: ClaimFile, out_dir: str | Path | None = None, progress: bool = False, *,
              model: ProbeModel | None = None) -> AuditResult:
    """Measure and decide every claim of ``claim_file``; with ``out_dir`` write audit.json/.md/.html there.

    ``model``: an already loaded :class:`~probe.models.loading.ProbeModel` to audit instead of
    loading ``claim_file.model`` (its id is then only reported).
    """
    started = time.perf_counter()
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    if model is None:
        from probe.models.loading import load_model

        spec = claim_file.model
        log(f"loading {spec.id} ...")
        model = load_model(spec.id, device=spec.device, dtype=spec.dtype,
                           attn_implementation=spec.attn_implementation, task=spec.task,
                           allow_random_weights=spec.allow_random_weights, device_map=spec.device_map)
    pm = model
    _check_target(pm, claim_file)
    items, _ = select_examples(pm, claim_file.data, claim_file.target)
    from probe.rows import memory

    memory.check_bootstrap_memory(claim_file.statistics.bootstrap, len(items))
    gold = [e.label for e in items]
    examples = prepare_examples(pm, claim_file.target, [e.text for e in items], gold)
    ctx = AuditContext(pm, claim_file, items, examples, progress)
    _check_sites(ctx)
    log(f"{len(items)} examples" + (f" ({len(examples)} output tokens)" if claim_file.target.stepwise else "")
        + f"; {len(claim_file.claims)} claim{'s' if len(claim_file.claims) != 1 else ''}")
    results = []
    for index, claim in enumerate(claim_file.claims):
        t0 = time.perf_counter()
        result = KINDS[claim.kind].run(ctx, claim, index)
        result.seconds = time.perf_counter() - t0
        results.append(result)
        log(f"[{index + 1}/{len(claim_file.claims)}] {result.verdict.upper()}: {printable(claim.claim)} "
            f"({result.seconds:.1f} s)")
    info = pm.contract.stacks[ctx.stack]
    audit = AuditResult(
        claims=results,
        model={"id": claim_file.model.id, "name": pm.name, "path": pm.path, "task": pm.task.name, "stack": ctx.stack,
               "layers": info.n_layers, "heads": info.n_heads, "device": str(pm.device), "dtype": pm.contract.dtype,
               "random_weights": list(pm.random_weights), "allow_random_weights": pm.allow_random_weights},
        data={**claim_file.data.model_dump(mode="json", exclude={"texts"}), "n_examples": len(items),
              "ids": [e.id for e in items], "target": claim_file.target.model_dump(mode="json")},
        statistics=claim_file.statistics.model_dump(mode="json"),
        source=claim_file.source, description=claim_file.description, seconds=time.perf_counter() - started)
    if out_dir is not None:
        audit.write(out_dir)
    return audit
