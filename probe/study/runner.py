"""Run a study: examples in fixed batches, every explainer and reference, tables after every batch.

The examples are selected once (filters, length limit, ``n`` with the dataset seed;
:mod:`probe.study.examples`) and cut into batches of ``engine.batch_size`` in that order. Batch
``b`` always holds the same examples, and every seeded method draws from the example's content, so
a batch (:mod:`probe.study.batch`) computes the same numbers whether it runs alone, after a restart,
or in another shard. A shard ``i/n`` computes the batches ``b`` with ``b % n == i``; whoever finds
every batch done merges the tables and writes the statistics (:mod:`probe.study.summary`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from probe import registry
from probe.errors import InputError, warn_at_caller
from probe.names import method_family as family
from probe.rows.target import PreparedExample
from probe.study.batch import run_batch
from probe.study.checks import study_sanity
from probe.study.examples import check_contrast, check_spans, prepare_examples, select_examples
from probe.study.lock import folder_lock
from probe.study.plan import methods_needed
from probe.study.sizes import check_sizes
from probe.study.store import ResultStore
from probe.study.summary import finalize
from probe.study.verdict import Verdict

if TYPE_CHECKING:
    from tqdm.std import tqdm

    from probe.models.core import ProbeModel
    from probe.spec.study import Study


@dataclass(frozen=True)
class RunResult:
    """What one call of :func:`run_study` did: the batches it computed and found done, and once every
    batch is done the verdict (None on a shard other than the one that merges). The runner's own
    answer; the result a user reads is :class:`probe.report.results.StudyResult`, which
    :func:`probe.api.run_study` returns."""

    out: Path
    n_examples: int
    n_batches: int
    computed: list[int]
    skipped: list[int]
    complete: bool
    verdict: Verdict | None = None


def prepare_study_examples(pm: ProbeModel, study: Study, texts: Sequence[str],
                           gold: Sequence[int | None] | None = None) -> list[PreparedExample]:
    """Tokenise and resolve each example's target as the study says (:func:`probe.study.examples.prepare_examples`)."""
    return prepare_examples(pm, study.target, texts, gold)


# --------------------------------------------------------------------------- the run


def _distributed() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() and os.environ.get("PROBE_DIST_BACKEND") != "gloo"
                                else "gloo")
    return dist.get_rank(), dist.get_world_size()


def output_folder(study: Study) -> Path:
    return Path(study.output or Path("results") / study.name)


def run_study(study: Study, *, shard: tuple[int, int] | None = None, progress: bool = True,
              log: Callable[[str], None] | None = None, stop_after: int | None = None,
              on_complete: Callable[[Path], None] | None = None, wait: bool = False,
              force_new: bool = False, model: ProbeModel | None = None) -> RunResult:
    """Run (or continue) ``study``; returns what was computed and, once complete, the verdict.

    ``stop_after``: stop after computing that many batches (for tests of resumption).
    ``on_complete``: called with the result folder once every batch is done and the verdict is
    written, while this run still holds the folder (:func:`probe.api.run_study` writes the report
    with it: the runner itself knows nothing of reports).
    ``wait``: when another process holds the result folder (:mod:`probe.study.lock`), wait for it
    instead of refusing.
    ``model``: a loaded :class:`ProbeModel` to run instead of loading ``study.model.id`` (the
    study should name it: :func:`probe.api.run_study` sets ``model.id`` to its name).
    ``force_new``: start over in a result folder that holds another study's results, or this
    study's on other data, weights or code (everything it holds is removed once the study has
    been checked and the model loaded); a folder that is not a probe result is still refused.
    """
    from probe.spec.study import Study as _Study

    if not isinstance(study, _Study):
        raise InputError(f"run_study needs a Study (from probe.spec.load_study or study_from_dict), not "
                         f"{type(study).__name__} {str(study)[:40]!r}")
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 0):
        raise InputError(f"stop_after={stop_after!r} is not a number of batches; give an integer >= 0 or None")
    with contextlib.ExitStack() as locks:
        return _run_study(study, shard=shard, progress=progress, log=log, stop_after=stop_after, on_complete=on_complete,
                          wait=wait, force_new=force_new, locks=locks, model=model)


def _run_study(study: Study, *, shard, progress, log, stop_after, on_complete, wait, force_new: bool,
               locks: contextlib.ExitStack, model: ProbeModel | None = None) -> RunResult:
    log = log or (lambda text: print(text, file=sys.stderr))
    dist_info = _distributed()
    if dist_info is not None and shard is None:
        shard = dist_info
    out = output_folder(study)
    store = ResultStore(out)
    record = {"fingerprint": study.fingerprint(), "study": study.to_dict()}
    if not (force_new and store.is_result()):
        store.check(record)  # refuses another study's folder before the model loads, writing nothing
    locked = out.is_dir()
    if locked:  # a run to continue: whoever holds the folder is found before the model loads
        locks.enter_context(folder_lock(out, shard=shard, wait=wait, log=log))
        if shard is None and store.is_result():  # held exclusively: no other write is under way
            stale = store.remove_stale_temporaries()  # left by a run killed while writing (kill -9 in the merge)
            if stale:
                log(f"removed {len(stale)} temporary file(s) a killed run left in {out} ({stale[0].name}, ...)")
        if not (force_new and store.is_result()):
            store.check(record)  # the holder may have started the folder meanwhile
    if locked and dist_info is None and not force_new:
        finished = _finished(study, store, shard=shard, model=model, on_complete=on_complete, log=log)
        if finished is not None:
            return finished
    if model is None:
        check_sizes(study)  # layer and head indices against the model's config, before it loads
    pm, load_seconds = (model, model.load_seconds) if model is not None else _load(study, dist_info)
    _check_methods(pm, study)
    data, dropped = select_examples(pm, study.dataset, study.target)
    _check_labels(pm, study, data)
    if study.spans is not None:
        check_spans(study.spans.pattern, study.target, data, study.dataset.name)
    _check_memory(study, len(data))
    from probe.study.identity import study_identity

    record["identity"] = study_identity(pm, data)
    if force_new and locked and store.is_result():
        log(f"--force-new: removing the earlier results in {out}")
        store.clear()
    store.open(record)  # refuses this study's folder on other data, weights or code, naming what changed
    if not locked:
        locks.enter_context(folder_lock(out, shard=shard, wait=wait, log=log))
    try:
        return _run_batches(pm, study, store, data, dropped, load_seconds, shard=shard, dist_info=dist_info,
                            progress=progress, stop_after=stop_after, on_complete=on_complete, log=log)
    except BaseException:
        if not locked:
            _remove_if_empty(out)
        raise


def _finished(study: Study, store: ResultStore, *, shard, model: ProbeModel | None,
              on_complete: Callable[[Path], None] | None, log: Callable[[str], None]) -> RunResult | None:
    """A complete folder whose study, dataset, model files, code and result files are all as they were
    when it finished (:func:`probe.study.identity.finished_unchanged`): its result, with no model
    loaded and nothing recomputed (``on_complete`` still runs); else None."""
    import json

    from probe.study.identity import finished_unchanged, quick_identity
    from probe.study.store import folder_stamp

    existing = store.read_study() or {}
    if existing.get("identity") is None:
        return None
    stamp = folder_stamp(existing["fingerprint"], existing["identity"])
    record = finished_unchanged(store.root, stamp, quick_identity(study, model))
    if record is None:
        return None
    try:
        verdict = Verdict.from_dict(json.loads((store.root / "verdict.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    n_batches = int(record["n_batches"])
    mine = [b for b in range(n_batches) if shard is None or b % shard[1] == shard[0]]
    log(f"study {study.name}: complete ({record['n_examples']} examples in {n_batches} batches), and nothing it was "
        f"computed from has changed: nothing to run -> {store.root}")
    if on_complete is not None:
        on_complete(store.root)
    warn_about_ties(store.root, study)
    return RunResult(out=store.root, n_examples=int(record["n_examples"]), n_batches=n_batches, computed=[],
                     skipped=mine, complete=True, verdict=verdict)


def _remove_if_empty(out: Path) -> None:
    """A folder this run made and that holds no finished batch yet is removed again when the run fails
    before its first batch, so a study that cannot start leaves nothing behind."""
    import shutil

    done = out / "done"
    if done.is_dir() and any(done.iterdir()):
        return
    shutil.rmtree(out, ignore_errors=True)


def _run_batches(pm: ProbeModel, study: Study, store: ResultStore, data: list, dropped: dict, load_seconds: float, *,
                 shard, dist_info, progress, stop_after, on_complete, log) -> RunResult:
    out = store.root
    size = study.engine.batch_size
    batches = [data[s: s + size] for s in range(0, len(data), size)]
    mine = [b for b in range(len(batches)) if shard is None or b % shard[1] == shard[0]]
    done = store.verified_done(log) & set(range(len(batches)))
    todo = [b for b in mine if b not in done]
    where = f" (shard {shard[0]}/{shard[1]})" if shard else ""
    log(f"study {study.name}: {len(data)} examples in {len(batches)} batches{where}; "
        f"{len(mine) - len(todo)} already done, {len(todo)} to run -> {out}")
    computed = _compute(pm, study, store, batches, mine, done, todo, shard=shard,
                        progress=progress, stop_after=stop_after)
    _barrier(dist_info)
    all_done = store.done_batches() >= set(range(len(batches)))
    verdict = None
    if all_done and (dist_info is None or dist_info[0] == 0):
        verdict = _finish(pm, study, store, data, n_batches=len(batches), dropped=dropped,
                          load_seconds=load_seconds, on_complete=on_complete, progress=progress, log=log)
    if dist_info is not None:
        _barrier(dist_info)
    elif not all_done:
        log(_not_done_hint(set(range(len(batches))) - store.done_batches(), shard))
    if all_done and (dist_info is None or dist_info[0] == 0):
        warn_about_ties(out, study)
    return RunResult(out=out, n_examples=len(data), n_batches=len(batches), computed=computed,
                     skipped=[b for b in mine if b in done], complete=all_done, verdict=verdict)


def _load(study: Study, dist_info: tuple[int, int] | None) -> tuple[ProbeModel, float]:
    """The study's model (under torchrun on this process's GPU) and the seconds its loading took."""
    device = study.model.device
    if dist_info is not None and device.startswith("cuda") and ":" not in device:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', dist_info[0]))}"
    t_load = time.perf_counter()
    pm = load_study_model(study, device=device)
    return pm, time.perf_counter() - t_load


def load_study_model(study: Study, *, device: str | None = None) -> ProbeModel:
    """The study's model as its ``model`` section says (on ``device`` where given)."""
    from probe.models.loading import load_model

    return load_model(study.model.id, device=device or study.model.device, dtype=study.model.dtype,
                      attn_implementation=study.model.attn_implementation, task=study.model.task,
                      allow_random_weights=study.model.allow_random_weights, device_map=study.model.device_map)


def _compute(pm: ProbeModel, study: Study, store: ResultStore, batches: list[list], mine: list[int], done: set[int],
             todo: list[int], *, shard: tuple[int, int] | None, progress: bool, stop_after: int | None) -> list[int]:
    """Run and store the batches ``todo`` (at most ``stop_after``) with a progress bar over ``mine``
    that names the step of the batch under way (a method, the agreement, ...). A batch starts from
    the sizes the one before it settled on after running out of memory, so the sizes that fit are
    found once per process, not once per batch."""
    size = study.engine.batch_size
    bar = None
    if progress and todo:
        from probe.progress import progress_bar

        bar = progress_bar(total=sum(len(batches[b]) for b in mine),
                           initial=sum(len(batches[b]) for b in mine if b in done), unit="ex", desc=study.name)
    computed: list[int] = []
    settled = None
    try:
        for b in todo:
            if stop_after is not None and len(computed) >= stop_after:
                break
            step = (lambda name, b=b: bar.set_postfix_str(f"batch {b}: {name}")) if bar is not None else None
            tables, info = run_batch(pm, study, batches[b], b * size, on_step=step, settled=settled)
            settled = info["engine"]
            store.write_batch(b, tables, {**info, "device": str(pm.device), "shard": list(shard) if shard else None})
            computed.append(b)
            if bar is not None:
                bar.update(len(batches[b]))
    finally:
        if bar is not None:
            bar.close()
    return computed


def _barrier(dist_info: tuple[int, int] | None) -> None:
    if dist_info is not None:
        import torch.distributed as dist

        dist.barrier()


class _FinishBar:
    """The progress bar over what follows the batches: one step per randomised model of the sanity
    checks (and one for the checks before them), then one for the statistics, each phase named while
    it runs. Opened at the first step, when the checks know how many models they draw."""

    def __init__(self, name: str):
        self.name = name
        self.bar: tqdm | None = None

    def _open(self, total: int) -> None:
        from probe.progress import progress_bar

        self.bar = progress_bar(total=total, desc=f"{self.name}: sanity checks", unit="step")

    def sanity(self, done: int, total: int, what: str) -> None:
        if self.bar is None:
            self._open(total + 1)  # the statistics after them
        elif self.bar.total != total + 1:  # fewer models: a method failed its checks before its draws
            self.bar.total = total + 1
        self.bar.set_description(f"{self.name}: {what}", refresh=False)
        self.bar.update(done - self.bar.n)

    def statistics(self) -> None:
        if self.bar is None:
            self._open(1)
        self.bar.set_description(f"{self.name}: statistics")

    def close(self, complete: bool) -> None:
        if self.bar is None:
            return
        if complete:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


def _finish(pm: ProbeModel, study: Study, store: ResultStore, data: list, *, n_batches: int, dropped: dict,
            load_seconds: float, on_complete: Callable[[Path], None] | None, progress: bool = False,
            log: Callable[[str], None] | None = None) -> Verdict:
    """Every batch is done: the sanity checks, the statistics and the verdict, then ``on_complete``;
    with ``progress`` a bar over the checks and the statistics, and a line before ``on_complete``."""
    from probe.names import COMPLETE_FILE

    (store.root / COMPLETE_FILE).unlink(missing_ok=True)  # what it vouched for is rewritten now
    sample = data[: study.metrics.sanity.examples]
    prepared = prepare_study_examples(pm, study, [e.text for e in sample], [e.label for e in sample])
    if study.target.stepwise:  # as many units as the sanity sample has examples, spread over their output tokens
        k = min(len(prepared), study.metrics.sanity.examples)
        prepared = [prepared[int(i)] for i in np.linspace(0, len(prepared) - 1, k).round().astype(int)]
    if study.target.stepwise or study.spans is not None:
        stored = {}  # the checks read tokens: the stored rows are step units or spans, so the scores are computed again
    else:
        stored = _stored_scores(store, study, prepared)
    bar = _FinishBar(study.name) if progress else None
    finished = False
    try:
        phases: dict[str, float] = {}
        started = time.perf_counter()
        checks = study_sanity(pm, study, prepared, stored=stored, progress=bar.sanity if bar is not None else None,
                              timings=phases)
        phases = {"sanity checks": time.perf_counter() - started, **phases}
        if bar is not None:
            bar.statistics()
        verdict = finalize(store, study, pm, n_batches=n_batches, dropped=dropped, load_seconds=load_seconds,
                           sanity=checks, phases=phases)
        finished = True
    finally:
        if bar is not None:
            bar.close(complete=finished)
    _record_identity(store)
    _record_completion(store, study, pm, n_examples=len(data), n_batches=n_batches)
    if on_complete is not None:
        if progress and log is not None:
            log(f"study {study.name}: {verdict.answer}; writing the report")
        on_complete(store.root)
    return verdict


def _stored_scores(store: ResultStore, study: Study, examples: list[PreparedExample]) -> dict:
    """The trained model's scores of the study's first examples (the sanity sample), read back from
    the batches that computed them, so the sanity checks do not compute them again; {} when they
    cannot be read (the checks then compute them)."""
    from probe.study.tables import scores_from_rows

    size = study.engine.batch_size
    frames: dict[str, list[pd.DataFrame]] = {"scores": [], "convergence": []}
    try:
        for index in range(-(-len(examples) // size)):
            for name in frames:
                path = store.part_path(name, index)
                if path.is_file():
                    frames[name].append(pd.read_parquet(path))
    except Exception:  # pyarrow raises several kinds for a damaged part; the merge names it later
        return {}
    if not frames["scores"]:
        return {}
    convergence = pd.concat(frames["convergence"], ignore_index=True) if frames["convergence"] else None
    return scores_from_rows(pd.concat(frames["scores"], ignore_index=True), convergence, examples, study.params)


def _record_completion(store: ResultStore, study: Study, pm: ProbeModel, *, n_examples: int, n_batches: int) -> None:
    """``complete.json``: what lets the next run of this study return at once (see :func:`_finished`).

    It protects against accidental change (an edited dataset or model file, a damaged or foreign
    result file), not against a forger: its digests are kept in the folder they describe, so whoever
    can write the folder can rewrite files and digests together (:mod:`probe.study.identity`)."""
    from probe.names import COMPLETE_FILE
    from probe.study.identity import completion_record, quick_identity
    from probe.study.store import write_json

    quick = quick_identity(study, pm)
    if quick is not None:
        write_json(store.root / COMPLETE_FILE,
                   completion_record(store.root, store.stamp, quick, n_examples=n_examples, n_batches=n_batches))


def _record_identity(store: ResultStore) -> None:
    """provenance.json keeps the identity the results were computed under: the hash of the selected
    examples beside the weights' hash it already records, and the code."""
    import json

    from probe.study.store import write_json

    identity = (store.read_study() or {}).get("identity")
    path = store.root / "provenance.json"
    if identity is None or not path.is_file():
        return
    provenance = json.loads(path.read_text(encoding="utf-8"))
    provenance["dataset_sha256"] = identity.get("data_sha256")
    provenance["identity"] = identity
    write_json(path, provenance)


def _check_memory(study: Study, n_examples: int) -> None:
    """Refuse, before anything is written, a bootstrap whose resamples this machine cannot hold."""
    from probe.rows import memory

    memory.check_bootstrap_memory(study.statistics.bootstrap, n_examples)


def _not_done_hint(left: set[int], shard: tuple[int, int] | None) -> str:
    """What to run to finish: the same command, or with a sharded run the shards still missing."""
    if shard is None:
        return f"{len(left)} batch(es) not done yet: run the same command again to continue"
    n = shard[1]
    missing = sorted({b % n for b in left})
    commands = " and ".join(f"--shard {i}/{n}" for i in missing)
    return (f"{len(left)} batch(es) not done yet, of shard(s) {', '.join(f'{i}/{n}' for i in missing)}: run the same "
            f"command with {commands} to continue (or without --shard for all of them)")


def warn_about_ties(out: Path, study: Study) -> None:
    """Warn when a reference scores many tokens exactly 0: in bf16/fp16 small target changes round
    to zero, and those ties make the rank correlations with it less informative."""
    path = out / "scores.parquet"
    if not path.is_file():
        return
    refs = [r for r in study.references if family(r) == "intervention"]
    if not refs:
        return
    scores = pd.read_parquet(path, columns=["method", "score"], filters=[("method", "in", refs)])
    scores = scores[np.isfinite(scores["score"])]
    for method, values in scores.groupby("method", sort=False)["score"]:
        zeros = int((values == 0).sum())
        if len(values) and zeros / len(values) >= 0.1:
            why = (f"in {study.model.dtype} small changes of the target round to zero; fp32 resolves them"
                   if study.model.dtype != "fp32" else "the target did not change when those tokens were perturbed")
            warn_at_caller(f"{method}: {zeros} of {len(values)} token scores are exactly 0 ({why}); rank agreement "
                           f"with {method} is computed over these ties")


def _check_labels(pm: ProbeModel, study: Study, data: list) -> None:
    """Refuse, before anything is written, labels the model has no class for: ``target.label`` (index
    or name), the labels of ``dataset.filters``, and with ``target.label: gold`` every example's
    label. Without ``gold`` a dataset label outside the classes is only stored: a warning says so."""
    from probe.rows.target import label_index

    if not pm.task.labels:
        return
    if study.target.label == "gold":
        unlabelled = [e for e in data if e.label is None]
        if unlabelled:
            raise InputError(f"target.label: gold explains each example's dataset label, and {len(unlabelled)} of "
                             f"{len(data)} selected examples of {study.dataset.name} have none (e.g. "
                             f"{unlabelled[0].id}); fill in the {study.dataset.label_column} column, or leave "
                             "target.label out (the predicted class)")
    n_labels = int(getattr(pm.model.config, "num_labels", 0) or 0)
    classes = f"this model has labels 0..{n_labels - 1}"
    names = pm.model.config.id2label or {}
    if names:
        classes += " (" + ", ".join(f"{int(k)} = {v}" for k, v in sorted(names.items(), key=lambda kv: int(kv[0]))) + ")"
    if study.target.label is not None and study.target.label != "gold":
        try:
            label_index(pm, study.target.label)
        except InputError as err:
            raise InputError(f"target.label: {err}") from None
    wrong = [label for label in (study.dataset.filters.labels or []) if not 0 <= label < n_labels]
    if wrong:
        raise InputError(f"dataset.filters.labels {wrong} are not classes of the model: {classes}")
    outside = [e for e in data if e.label is not None and not 0 <= e.label < n_labels]
    if not outside:
        return
    first = outside[0]
    message = (f"{len(outside)} of {len(data)} examples of {study.dataset.name} have labels outside the model's "
               f"classes (e.g. {first.id}: label {first.label}); {classes}")
    if study.target.label == "gold":
        raise InputError(f"target.label: gold explains each example's label, and {message}; fix the labels or the "
                         "label column, or leave target.label out (the predicted class)")
    warn_at_caller(f"{message}; they are stored as they are")


def _check_methods(pm: ProbeModel, study: Study) -> None:
    """Refuse methods this model cannot run before any batch starts: what each registry entry
    applies to (its task and the tokens it needs), with the registered methods of its family that do
    apply named as the alternatives."""
    cannot = registry.skipped(pm, 0, checks=("task", "token"))
    for name in methods_needed(study):
        if name in cannot:
            family = registry.method(name).family
            left_out = registry.skipped(pm, 0, checks=("task", "token", "by_name"))
            others = [m.name for m in registry.methods(family=family) if m.name != name and m.name not in left_out]
            raise InputError(f"{name} cannot run on {pm.name!r}: {cannot[name]}; use "
                             f"{', '.join(others) or 'another method'} instead")
    if study.target.label == "gold" and not pm.task.labels:
        raise InputError("target.label: gold applies to classifiers; a language model explains a continuation")
    if study.target.stepwise and not pm.task.continuations:
        key = "target.generate" if study.target.generate is not None else "target.steps"
        raise InputError(f"{key} explains a language model's output token by token; {pm.name} is a {pm.task.head}: "
                         f"remove {key}")
    if study.target.choices and not pm.task.next_token:
        raise InputError("target.choices applies to causal LMs; a classifier explains its predicted or given label")
    check_contrast(pm, study.target)


__all__ = ["load_study_model", "run_study", "prepare_study_examples", "output_folder"]
