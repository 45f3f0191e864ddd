"""A study's sanity checks (:mod:`probe.study.sanity`) and its accounting of left-out examples.

Run once per study, on a small sample of its examples (``metrics.sanity.examples``), after every
batch is done; the results are ``sanity.parquet`` and ``verdict.json["sanity"]``. A method that
fails a check is *unreliable* for the study: its units never track, the verdict uses it neither as
the gradient bar nor in a ceiling, and says so. A check that could not tell (randomisation that did
not change the reference) is ``not informative``, which is no failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from probe import registry
from probe.errors import ProbeError
from probe.names import describe_group
from probe.names import method_family as family
from probe.study import sanity as S
from probe.study.plan import methods_needed
from probe.study.randomisation import RANDOM_DRAWS, randomisation, unit_randomisation
from probe.study.replay import ReferenceRuns
from probe.study.weights import cascade_steps, layer_stack

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study

LEFT_OUT_KEY = ["role", "explainer", "reference"]


def study_sanity(pm: ProbeModel, study: Study, examples: list[PreparedExample],
                 stored: Mapping[str, TokenScores] | None = None, *,
                 progress: Callable[[int, int, str], None] | None = None,
                 timings: dict[str, float] | None = None) -> list[S.Check]:
    """Every check that applies to the study's explainers and gradient references, on ``examples``.
    ``stored``: the trained model's scores of these examples as the study's batches computed them
    (:func:`probe.study.tables.scores_from_rows`), used instead of computing them again; the
    randomised models' scores are always computed. ``progress(done, total, what)``: called as the
    checks go, ``total`` being the randomised models (draws) plus one for the checks before them.
    ``timings``: given, it gets the randomisation check's seconds (``"randomisation check"``) and,
    where a method has a completeness check, that check's (``"completeness check"``).

    The reference's trained-model run on the sample is made once for every check that reads it
    (the randomisation checks compare with that run, not with the stored scores, whose batches were
    packed otherwise), and on the cascade's models its layers below the re-initialised ones are
    replayed, not computed (:class:`probe.study.replay.ReferenceRuns`): the same numbers, fewer runs."""
    stored = stored or {}
    report = progress or (lambda done, total, what: None)
    from probe.methods import run_method

    spec = study.metrics.sanity
    params = study.params
    scored = [[study.statistics.include_special or not s for s in e.special] for e in examples]
    planned = [m for m in methods_needed(study) if family(m) != "intervention"]
    report(0, 1 + (_randomised_models(pm, study, planned) if spec.randomisation else 0), "sanity checks")
    checks, results = _score_checks(pm, study, examples, stored, scored, timings)
    ref = study.verdict_reference
    reference = None
    ref_runs = ReferenceRuns(pm, examples, ref, lambda pm, ex: run_method(pm, ex, ref, params=params.get(ref)),
                             replay=spec.randomisation)
    if family(ref) == "intervention":
        try:
            reference = stored[ref] if ref in stored else ref_runs.trained()
        except ProbeError as error:
            checks.append(S.Check(ref, "sign", "not run", None, f"the reference could not run: {error}"))
    checks += _sign_checks(study, results, reference, scored)
    total = 1 + (_randomised_models(pm, study, results) if spec.randomisation else 0)  # less where a method failed
    done = [1]
    report(1, total, "sanity checks")

    def step():
        done[0] += 1
        report(done[0], total, "sanity checks: randomised models")

    if spec.randomisation:
        started = time.perf_counter()
        checks += _randomisation_checks(pm, study, examples, results, ref_runs if reference is not None else None,
                                        _sample_top(study, reference, scored), scored, step)
        if timings is not None:
            timings["randomisation check"] = time.perf_counter() - started
    report(total, total, "sanity checks")
    return checks


def _score_checks(pm: ProbeModel, study: Study, examples: list[PreparedExample], stored: Mapping[str, TokenScores],
                  scored: list[list[bool]],
                  timings: dict[str, float] | None = None) -> tuple[list[S.Check], dict[str, TokenScores]]:
    """The checks of the trained model's scores (constant scores, degeneracy, completeness), and those
    scores (method -> its result, the stored one where the study has it) for the checks after them.
    ``timings``: given, it gets the completeness check's seconds (``"completeness check"``: its search
    for the points that would do) where a method has one."""
    from probe.methods import run_method

    params = study.params
    checks: list[S.Check] = []
    results = {}
    for method in methods_needed(study):
        if family(method) == "intervention":
            continue
        try:
            results[method] = (stored[method] if method in stored else
                               run_method(pm, examples, method, params=params.get(method)))
        except ProbeError as error:
            checks.append(S.Check(method, "constant", "not run", None, str(error)))
            continue
        checks.append(S.constant_scores(method, [S.output_unit(v) for v in results[method].scores], scored))
    gradients = [m for m in results if family(m) == "gradient"]
    checks += S.degeneracy(pm, examples, gradients, params=params)
    started = time.perf_counter()
    complete = [name for name in results if registry.method(name).completeness]
    checks += [S.completeness(pm, examples, results[name], params=params.get(name)) for name in complete]
    if complete and timings is not None:
        timings["completeness check"] = time.perf_counter() - started
    return checks, results


def _sign_checks(study: Study, results: Mapping[str, TokenScores], reference: TokenScores | None,
                 scored: list[list[bool]]) -> list[S.Check]:
    """The sign check of each signed method against a signed reference (none where either is compared
    by magnitude or the reference did not run)."""
    ref = study.verdict_reference
    if reference is None or ref in set(study.metrics.absolute):
        return []
    checks = []
    for method in results:
        entry = registry.find(method)
        if entry is not None and entry.signed and method not in set(study.metrics.absolute):
            checks.append(S.sign_check(method, results[method].scores, reference.scores, scored))
    return checks


def _randomisation_checks(pm: ProbeModel, study: Study, examples: list[PreparedExample],
                          results: Mapping[str, TokenScores], ref_scorer: ReferenceRuns | None, top: int | None,
                          scored: list[list[bool]], step: Callable[[], None]) -> list[S.Check]:
    """The randomisation checks of the methods ``results`` ran: bottom-up methods (a layer's attention,
    rolled or decomposed up to it) one check per unit, asked about the weights that unit is computed
    from (:func:`probe.study.randomisation.unit_randomisation`); the rest (gradients, attention x
    gradient) the cascade from the output head down, one check per method
    (:func:`probe.study.randomisation.randomisation`). A failure to run is a ``not run`` row per method."""
    from probe.methods import run_method

    on_random = {m: randomised_params(study, m) for m in results}
    scorers = {m: (lambda pm, ex, m=m: run_method(pm, ex, m, params=on_random[m]).scores) for m in results}
    trained = {m: r.scores for m, r in results.items()}
    bottom_up = [m for m in scorers if registry.method(m).bottom_up]
    whole = [m for m in scorers if m not in bottom_up]
    checks: list[S.Check] = []
    try:
        if bottom_up:
            checks += unit_randomisation(pm, examples, {m: scorers[m] for m in bottom_up}, seed=study.statistics.seed,
                                         trained_scores=trained, reference=ref_scorer, scored=scored, top=top,
                                         step=step)
        if whole:
            checks += randomisation(pm, examples, {m: scorers[m] for m in whole},
                                    fractions=tuple(study.metrics.sanity.fractions), seed=study.statistics.seed,
                                    trained_scores=trained, reference=ref_scorer, scored=scored, top=top, step=step,
                                    together=_one_gradient_pass(whole, on_random))
    except (ProbeError, RuntimeError, ValueError) as error:  # never crash a study on a check
        checks += [S.Check(m, "randomisation", "not run", None, f"could not run: {error}") for m in results]
    return checks


def _one_gradient_pass(methods: list[str], params: Mapping[str, Mapping | None]) -> dict[tuple[str, ...], Callable]:
    """The methods one gradient pass gives on a randomised model (:func:`probe.methods.one_pass_gradients`
    at the parameters they run with there), as the study's batches run them: the same numbers as
    one by one."""
    from probe.methods import one_pass_gradients, run_shared_gradients

    shared = one_pass_gradients(methods, params)
    if not shared:
        return {}
    return {tuple(shared): lambda pm, ex: {m: r.scores for m, r in run_shared_gradients(pm, ex, shared).items()}}


def randomised_params(study: Study, method: str) -> dict | None:
    """The parameters ``method`` runs with on a randomised model: the study's, except integrated
    gradients at a fixed number of points, which runs at the fewest of 16, 32, ... up to that number
    whose completeness delta passes on that model (``steps: auto`` with ``max_steps`` the study's
    points and its tolerance), never more points than the study's and never fewer without completeness
    shown there (fewer unchecked points would add noise, which reads as model dependence: it would bias
    the check towards passing). A randomised model is often closer to linear along the path than the
    trained one (MiniLM: 16 points suffice once half its layers are redrawn, where the trained model
    needs 16-32), so most of the check's points go."""
    from probe.explainers.integrated_gradients import AUTO_STEPS
    from probe.registry.params import IntegratedGradientsParams, declared_limits

    params = study.params.get(method)
    if method != "integrated_gradients":
        return params
    steps = (params or {}).get("steps", IntegratedGradientsParams.steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or not AUTO_STEPS[0] < steps <= \
            declared_limits(IntegratedGradientsParams, "max_steps")[1]:
        return params  # auto already, at most one rung, or past the ladder: as the study runs it
    return {**(params or {}), "steps": "auto", "max_steps": steps}


def _randomised_models(pm: ProbeModel, study: Study, results) -> int:
    """How many randomised models the randomisation checks draw for the methods ``results`` (progress)."""
    spec = study.metrics.sanity
    layers = layer_stack(pm.model, pm.contract.n_layers)
    bottom_up = [m for m in results if registry.method(m).bottom_up]
    whole = [m for m in results if m not in bottom_up]
    n = RANDOM_DRAWS if bottom_up else 0
    if whole and layers is not None:
        steps = cascade_steps(pm.model, layers, tuple(spec.fractions))
        n += len(steps) * RANDOM_DRAWS
    return n


def _sample_top(study: Study, reference, scored) -> int | None:
    """The k of the top-k comparison the randomisation check makes, or None for Spearman: the
    study's top-k measure, or with measure auto the choice the verdict makes (probe.study.decide),
    taken on the sample's reference."""
    from probe.study.decide import CONCENTRATED

    measure = study.statistics.measure
    if measure.startswith("top"):
        return int(measure[3:])
    if measure != "auto" or reference is None:
        return None
    total = top1 = top2 = 0.0
    for values, keep in zip(reference.scores, scored):
        a = np.abs(values.double().numpy())[np.asarray(list(keep), dtype=bool)]
        a = np.sort(a[np.isfinite(a)])[::-1]
        total, top1, top2 = total + a.sum(), top1 + a[:1].sum(), top2 + a[:2].sum()
    if total <= 0:
        return None
    return 1 if top1 / total >= CONCENTRATED else (2 if top2 / total >= CONCENTRATED else None)


def sanity_table(checks: Iterable[S.Check]) -> pd.DataFrame:
    """One row per check: ``layer`` and ``head`` name the unit of a per-unit check (-1: the whole method)."""
    return pd.DataFrame([{**c.to_dict(), "curve": repr([list(p) for p in c.curve])} for c in checks],
                        columns=["method", "check", "status", "value", "detail", "curve", "layer", "head"])


# --------------------------------------------------------------------------- left out


def with_left_out(summary: pd.DataFrame, agreement: pd.DataFrame, left_out: pd.DataFrame | None,
                  n_examples: int) -> pd.DataFrame:
    """``summary`` plus ``left_out`` (examples not in n) and ``left_out_reasons`` per row: pairs
    scored on fewer than 2 tokens (``left_out`` table), and undefined measures (constant scores)."""
    counts: dict[tuple, dict[str, int]] = {}
    if left_out is not None and len(left_out):
        for key, frame in left_out.groupby(LEFT_OUT_KEY):
            counts[tuple(key)] = frame.reason.value_counts().to_dict()
    out = summary.copy()
    totals, reasons = [], []
    measure_nan = {}
    for measure in out.measure.unique():
        if measure in agreement.columns:
            nan = agreement[agreement[measure].isna()]
            measure_nan[measure] = nan.groupby(["role", "explainer", "reference", "layer", "head"]).size().to_dict()
    for _, row in out.iterrows():
        found = dict(counts.get((row.role, row.explainer, row.reference), {}))
        undefined = measure_nan.get(row.measure, {}).get((row.role, row.explainer, row.reference, row.layer, row["head"]), 0)
        if undefined:
            found["constant scores (measure undefined)"] = int(undefined)
        totals.append(int(sum(found.values())))
        reasons.append("; ".join(f"{k}: {v}" for k, v in sorted(found.items())))
    out["left_out"] = totals
    out["left_out_reasons"] = reasons
    return out


# --------------------------------------------------------------------------- redundancy


def unit_rankings(scores: pd.DataFrame, tokens: pd.DataFrame, methods: Iterable[str]) -> dict[str, list[np.ndarray]]:
    """Layer-level and token-level units of ``methods`` -> one score vector per example (scored tokens)."""
    scored = tokens[tokens.scored][["example", "position"]]
    frame = scores[scores.method.isin(list(methods)) & (scores["head"] < 0)].merge(scored, on=["example", "position"])
    out: dict[str, list[np.ndarray]] = {}
    examples = sorted(frame.example.unique())
    for (method, layer), unit in frame.groupby(["method", "layer"], sort=False):
        name = f"{method} L{layer}" if layer >= 0 else str(method)
        by_example = {e: g.sort_values("position").score.to_numpy(dtype=float) for e, g in unit.groupby("example")}
        out[name] = [by_example.get(e, np.array([])) for e in examples]
    return out


def redundancy(tables: dict, study: Study) -> list[dict]:
    """Groups of the study's explainer units that rank tokens identically (:func:`S.redundancy_groups`)."""
    if "scores" not in tables or "tokens" not in tables:
        return []
    explainers = [m for m in study.explainers if family(m) in ("attention", "gradient")]
    rankings = unit_rankings(tables["scores"], tables["tokens"], explainers)
    groups = S.redundancy_groups(rankings)
    return [{"units": group, "description": describe_group(group)} for group in groups]
