"""The randomisation checks of the sanity checks (:mod:`probe.study.sanity`; Adebayo et al. 2018).

    cascade        :func:`randomisation`, for the methods whose scores come from the whole model:
                   the output head first, then the layers from the top, re-initialised
                   (:mod:`probe.study.weights`; ``draws`` draws per step, averaged); at each step each
                   explainer's Spearman (or chance-corrected top-k agreement) with its trained-model
                   scores, and the same for the study's reference with the mean |change| of the target.
                   Judged once the head and the top half of the layers are random; by default
                   that stage alone is drawn (``metrics.sanity.fractions``: more stages draw the
                   cascade's curve, from the head alone down, and decide nothing more).
    units          :func:`unit_randomisation`, for the bottom-up methods: a layer-l unit is computed
                   from the embeddings and layers 0..l only, so every weight is re-initialised and each
                   unit gets its own check.

Where the reference's own ranking stays >= :data:`RANDOMISATION_LIMIT` with its trained one the
randomisation did not change the function the explainers explain, and every explainer (or unit) is
``not informative``; otherwise one whose correlation stays >= the limit does not depend on the model
(fail). The reference runs once on the trained model and is replayed below the re-initialised layers
(:class:`~probe.study.replay.ReferenceRuns`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe.errors import ProbeError
from probe.rows.scores import score_unit_rows
from probe.study.replay import ReferenceRuns, reference_runs
from probe.study.sanity import Check, output_unit
from probe.study.weights import cascade_steps, head_parameters, layer_stack, randomised, randomised_top

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample

RANDOMISATION_LIMIT = 0.5  # Spearman with the trained scores once the top half of layers is random
RANDOM_DRAWS = 3  # draws of random weights per cascade step, averaged


def _init_std(pm: ProbeModel) -> float:
    """The std of the fresh random matrices: the model's ``initializer_range`` (0.02 where it has none)."""
    return float(getattr(pm.model.config, "initializer_range", 0.02) or 0.02)


def _mean_spearman(trained: Sequence[np.ndarray], values: Sequence[np.ndarray],
                   scored: Sequence[Sequence[bool]] | None = None, top: int | None = None) -> float:
    """Mean over examples of Spearman's rho between trained and randomised scores (scored tokens);
    with ``top`` the chance-corrected overlap of their top-``top`` tokens instead ((o - k/n) / (1 - k/n):
    1 the same top tokens, 0 what chance gives), for a reference whose effect sits on a few tokens."""
    from probe.metrics.agreement import agreement

    rhos = []
    for i, (a, b) in enumerate(zip(trained, values)):
        ok = np.isfinite(a) & np.isfinite(b)
        if scored is not None:
            ok &= np.asarray(list(scored[i]), dtype=bool)
        n = int(ok.sum())
        if top is not None and n > top:
            overlap = float(agreement(b[ok], a[ok], k=top)[f"top{top}"][0])
            chance = top / n
            rhos.append((overlap - chance) / (1 - chance))
        elif top is None and n >= 2:
            rhos.append(float(agreement(b[ok], a[ok], k=1)["spearman"][0]))
    rhos = [r for r in rhos if np.isfinite(r)]
    return float(np.mean(rhos)) if rhos else float("nan")



def randomisation(pm: ProbeModel, examples: Sequence[PreparedExample], scorers: Mapping[str, Callable], *,
                  fractions: Sequence[float] = (0.5,), seed: int = 0,
                  trained_scores: Mapping[str, Sequence[torch.Tensor]] | None = None,
                  reference: tuple[str, Callable] | ReferenceRuns | None = None,
                  scored: Sequence[Sequence[bool]] | None = None, top: int | None = None,
                  draws: int = RANDOM_DRAWS, step: Callable[[], None] | None = None,
                  together: Mapping[tuple[str, ...], Callable] | None = None) -> list[Check]:
    """Cascading randomisation (module docstring). ``scorers`` maps a name to ``f(pm, examples) ->
    list of per-example score tensors``; each one's output unit is compared by Spearman.
    ``together``: names whose scores one call gives (``f(pm, examples) -> {name: scores}``, e.g.
    saliency and input x gradient from one gradient pass), made once per model instead of per name.
    ``trained_scores``: a scorer's output on the trained model where the caller already has it
    (the same call, so the same numbers); the others are run first. ``reference``: (name, scorer)
    of the study's reference, a leave-one-out whose result carries ``original_values``: its own
    row (first) says whether the randomisation changed the model's function, and where it did not
    every explainer is ``not informative`` (or :class:`~probe.study.replay.ReferenceRuns`, which the caller shares with
    :func:`unit_randomisation`: the trained run once, and the layers below the re-initialised ones
    replayed instead of computed). ``scored``: per example, the tokens the study scores
    (special tokens are left out of the correlations as they are of the agreement). ``top``: compare
    the top-``top`` tokens (chance-corrected overlap) instead of Spearman over every token, as the
    verdict does where the reference's effect sits on one or two tokens. ``draws``: random weights
    drawn per step (seeds ``seed``, ``seed + 1``, ...), the correlations averaged over them.
    ``step``: called after each draw (progress)."""
    layers = layer_stack(pm.model, pm.contract.n_layers)
    reference = reference_runs(pm, examples, reference)
    ref_name = reference.name if reference is not None else None
    names = ([ref_name] if reference else []) + [n for n in scorers if n != ref_name]
    if layers is None:
        reason = f"no list of {pm.contract.n_layers} layers found in the model to re-initialise"
        return [Check(name, "randomisation", "not run", None, reason) for name in names]
    values: list[np.ndarray] = []  # the reference's own target values, one array per run of it
    run = _ranking_run(pm, examples, scorers, reference, values, together)
    trained, checks = _trained_rankings(names, run, trained_scores)
    steps = cascade_steps(pm.model, layers, fractions)
    curves, changes = _cascade_curves(pm, layers, steps, run, trained, values if ref_name in trained else None,
                                      seed=seed, draws=draws, scored=scored, top=top, step=step)
    judged = next((i for i, c in enumerate(steps) if c / len(layers) >= 0.5 - 1e-9), len(steps) - 1) + 1
    checks.update(_cascade_checks(curves, changes, judged, ref_name, head=bool(head_parameters(pm.model, layers)),
                                  top=top))
    return [checks[name] for name in names if name in checks]


def _ranking_run(pm: ProbeModel, examples, scorers: Mapping[str, Callable], reference: ReferenceRuns | None,
                 values: list[np.ndarray], together: Mapping[tuple[str, ...], Callable] | None = None) -> Callable:
    """``run(name, changed=None)``: ``name``'s output-unit scores (one array per example) on the trained
    model, or with ``changed`` re-initialised (the caller's block); each run of the reference appends
    its ``original_values`` (the target's values) to ``values``. A name of a ``together`` group takes
    the group's one call on this model (the same ``changed`` object: the same model)."""
    ref_name = reference.name if reference is not None else None
    groups = {name: group for group in (together or {}) for name in group}
    made: dict[tuple[str, ...], tuple[object, Mapping]] = {}  # group -> (the model's changed, its scores)

    def scores(name, changed):
        group = groups.get(name)
        if group is None:
            return scorers[name](pm, examples)
        if group not in made or made[group][0] is not changed:
            made[group] = (changed, together[group](pm, examples))
        return made[group][1][name]

    def run(name, changed=None):
        if name != ref_name:
            result = scores(name, changed)
        else:
            result = reference.trained() if changed is None else reference.randomised(changed)
            values.append(np.asarray(result.extras.get("original_values", []), dtype=float))
            result = result.scores
        return [output_unit(v).double().numpy() for v in result]
    return run


def _trained_rankings(names: Sequence[str], run: Callable,
                      trained_scores: Mapping[str, Sequence[torch.Tensor]] | None) -> tuple[dict, dict]:
    """(name -> its trained-model output-unit scores, the caller's where given; name -> a ``not run``
    check where its scorer failed)."""
    trained, checks = {}, {}
    for name in names:
        try:
            given = (trained_scores or {}).get(name)
            trained[name] = ([output_unit(v).double().numpy() for v in given] if given is not None else run(name))
        except ProbeError as error:
            checks[name] = Check(name, "randomisation", "not run", None, str(error))
    return trained, checks


def _target_moved(values: Sequence[np.ndarray]) -> float:
    """The mean |change| of the target between the reference's first (trained) run and its last."""
    first, last = values[0], values[-1]
    return float(np.mean(np.abs(last - first))) if len(first) == len(last) else float("nan")


def _cascade_curves(pm: ProbeModel, layers: torch.nn.ModuleList, steps: Sequence[int], run: Callable,
                    trained: Mapping[str, list[np.ndarray]], values: list[np.ndarray] | None, *, seed: int,
                    draws: int, scored, top: int | None,
                    step: Callable[[], None] | None) -> tuple[dict[str, list[tuple[float, float]]], list[float]]:
    """Walk the cascade: (name -> its curve ``[(fraction of layers randomised, mean correlation), ...]``
    from ``(0, 1)``, the mean |change| of the reference's target per step where ``values`` (the
    reference's runs) are given)."""
    std = _init_std(pm)
    curves: dict[str, list[tuple[float, float]]] = {name: [(0.0, 1.0)] for name in trained}
    changes: list[float] = []
    for count in steps:
        sums: dict[str, list[float]] = {name: [] for name in trained}
        moved = []
        # one draw's fixed random function of the inputs can rank like the trained one by luck
        for draw in range(draws):
            with randomised_top(pm.model, layers, count, seed=seed + draw, std=std, head=True) as changed:
                for name in trained:
                    sums[name].append(_mean_spearman(trained[name], run(name, changed), scored, top))
                if values is not None and len(values) > 1:
                    moved.append(_target_moved(values))
            if step is not None:
                step()
        for name in trained:
            curves[name].append((count / len(layers), float(np.nanmean(sums[name])) if np.isfinite(sums[name]).any()
                                 else float("nan")))
        if moved:
            changes.append(float(np.mean(moved)))
    return curves, changes


def _cascade_checks(curves: Mapping[str, list[tuple[float, float]]], changes: Sequence[float], judged: int,
                    ref_name: str | None, *, head: bool, top: int | None) -> dict[str, Check]:
    """Each curve judged at step ``judged`` (the head and the top half of the layers random): the
    reference's own row says whether the check is informative, the others pass or fail by
    :data:`RANDOMISATION_LIMIT`."""
    where = ("the head and the top half of the layers" if head else "the top half of the layers")
    word = "Spearman" if top is None else f"top-{top} agreement (chance-corrected)"
    ref_rho = curves[ref_name][judged][1] if ref_name is not None and ref_name in curves else None
    informative = ref_rho is None or not (ref_rho >= RANDOMISATION_LIMIT)
    checks = {}
    for name, curve in curves.items():
        at_half = curve[judged][1]
        if ref_name is not None and name == ref_name:
            moved = changes[judged - 1] if len(changes) >= judged else float("nan")
            detail = (f"the reference's own {word} with its trained ranking once {where} are random: {at_half:+.2f}; "
                      f"the target moved by {moved:.2g} on average"
                      + ("" if informative else f" (>= {RANDOMISATION_LIMIT}: the randomisation did not change what "
                                                "the model does with its input, so the check cannot tell explainers "
                                                "apart)"))
            checks[name] = Check(name, "randomisation", "pass" if informative else "not informative", at_half, detail,
                                 tuple(curve))
        elif not informative:
            checks[name] = Check(name, "randomisation", "not informative", at_half,
                                 f"{word} with the trained scores {at_half:+.2f} once {where} are random, but the "
                                 f"reference's own ranking stayed at {ref_rho:+.2f}: not informative", tuple(curve))
        else:
            bad = bool(at_half >= RANDOMISATION_LIMIT)
            detail = (f"{word} with the trained scores {at_half:+.2f} once {where} are random" + (
                f" (>= {RANDOMISATION_LIMIT}: the scores do not depend on the model's upper layers)" if bad else ""))
            checks[name] = Check(name, "randomisation", "fail" if bad else "pass", at_half, detail, tuple(curve))
    return checks


def _unit_rows(values: torch.Tensor) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A bottom-up method's per-example scores as unit rows ``[unit, tokens]`` with ``(layer, head)``."""
    rows, layer, head = score_unit_rows(values)
    return rows, [(int(la), int(h)) for la, h in zip(layer, head)]



def unit_randomisation(pm: ProbeModel, examples: Sequence[PreparedExample], scorers: Mapping[str, Callable], *,
                       seed: int = 0, trained_scores: Mapping[str, Sequence[torch.Tensor]] | None = None,
                       reference: tuple[str, Callable] | ReferenceRuns | None = None,
                       scored: Sequence[Sequence[bool]] | None = None, top: int | None = None,
                       draws: int = RANDOM_DRAWS, step: Callable[[], None] | None = None) -> list[Check]:
    """Model-parameter randomisation asked of every unit of the bottom-up methods (``scorers``:
    name -> ``f(pm, examples)`` per-example score tensors ``[layer, (head,) tokens]``), one check per
    unit. A layer-l unit is computed from the embeddings and layers 0..l only, so that is what is
    re-initialised for it: every weight of the model is drawn afresh (matrices N(0, init std), biases
    0, norm scales 1; ``draws`` draws, correlations averaged), which changes what a unit is computed
    from entirely and nothing else it could depend on. The unit fails where its scores keep Spearman
    (or, with ``top``, chance-corrected top-k agreement) >= :data:`RANDOMISATION_LIMIT` with its
    trained scores while the reference's own ranking moved below it: its ranking does not come from
    the weights. Where the reference did not move, every unit is ``not informative``. Units whose
    trained rankings are identical get identical randomised rankings too, hence the same answer.
    ``reference`` and ``step`` as :func:`randomisation` takes them."""
    reference = reference_runs(pm, examples, reference)
    params = [(name, p) for name, p in pm.model.named_parameters()]
    std = _init_std(pm)
    out: list[Check] = []
    trained, units = _unit_trained(pm, examples, scorers, trained_scores, out)
    ref_trained = None
    if reference is not None:
        try:
            ref_trained = [output_unit(v).double().numpy() for v in reference.trained().scores]
        except ProbeError:
            ref_trained = None
    rhos: dict[str, list[np.ndarray]] = {name: [] for name in trained}
    ref_rhos: list[float] = []
    for draw in range(draws):
        with randomised(params, seed=seed + draw, std=std):
            changed = [p for _, p in params]
            _unit_draw(pm, examples, scorers, trained, units, rhos, out, scored=scored, top=top)
            if ref_trained is not None:
                moved = [output_unit(v).double().numpy() for v in reference.randomised(changed).scores]
                ref_rhos.append(_mean_spearman(ref_trained, moved, scored, top))
        if step is not None:
            step()
    word = "Spearman" if top is None else f"top-{top} agreement (chance-corrected)"
    ref_rho = float(np.nanmean(ref_rhos)) if ref_rhos and np.isfinite(ref_rhos).any() else None
    informative = ref_rho is None or not (ref_rho >= RANDOMISATION_LIMIT)
    if reference is not None:
        out.append(_unit_reference_check(reference.name, ref_rho, informative, word))
    for name in trained:
        out += _unit_checks(name, rhos[name], units[name], informative, word)
    return out


def _unit_trained(pm: ProbeModel, examples, scorers: Mapping[str, Callable],
                  trained_scores: Mapping[str, Sequence[torch.Tensor]] | None,
                  out: list[Check]) -> tuple[dict[str, list[np.ndarray]], dict[str, list[tuple[int, int]]]]:
    """(name -> its trained unit rows per example, the caller's scores where given; name -> its units
    ``(layer, head)``); a method whose scorer failed gets a ``not run`` check in ``out``."""
    trained: dict[str, list[np.ndarray]] = {}
    units: dict[str, list[tuple[int, int]]] = {}
    for name in scorers:
        try:
            given = (trained_scores or {}).get(name)
            values = given if given is not None else scorers[name](pm, examples)
        except ProbeError as error:
            out.append(Check(name, "randomisation", "not run", None, str(error)))
            continue
        rows = [_unit_rows(v) for v in values]
        trained[name] = [r for r, _ in rows]
        units[name] = rows[0][1] if rows else []
    return trained, units


def _unit_draw(pm: ProbeModel, examples, scorers: Mapping[str, Callable], trained: dict[str, list[np.ndarray]],
               units: Mapping[str, list[tuple[int, int]]], rhos: Mapping[str, list[np.ndarray]], out: list[Check], *,
               scored, top: int | None) -> None:
    """On one randomised model (the caller's block), each method's per-unit correlations with its
    trained rows, appended to ``rhos``. A method whose scorer fails there gets a ``not run`` check in
    ``out`` and leaves ``trained``, and the draw stops there (the methods after it get no correlation
    from this draw)."""
    for name in trained:
        try:
            fresh = [_unit_rows(v)[0] for v in scorers[name](pm, examples)]
        except ProbeError as error:
            out.append(Check(name, "randomisation", "not run", None, f"on the randomised model: {error}"))
            trained.pop(name)
            break
        per_unit = [_mean_spearman([t[u] for t in trained[name]], [f[u] for f in fresh], scored, top)
                    for u in range(len(units[name]))]
        rhos[name].append(np.array(per_unit))


def _unit_reference_check(name: str, ref_rho: float | None, informative: bool, word: str) -> Check:
    """The reference's own row of the unit check: did re-initialising every weight move its ranking?"""
    detail = (f"the reference's own {word} with its trained ranking once every weight is re-initialised: "
              + ("not computed" if ref_rho is None else f"{ref_rho:+.2f}")
              + ("" if informative else f" (>= {RANDOMISATION_LIMIT}: the randomisation did not change what the "
                                        "model does with its input, so the check cannot tell units apart)"))
    return Check(name, "randomisation (units)", "pass" if informative else "not informative", ref_rho,
                 detail, ((0.0, 1.0), (1.0, ref_rho if ref_rho is not None else float("nan"))))


def _unit_checks(name: str, rhos: Sequence[np.ndarray], units: Sequence[tuple[int, int]], informative: bool,
                 word: str) -> list[Check]:
    """One check per unit of method ``name``: its correlation averaged over the draws ``rhos``."""
    if not rhos:
        return []
    mean = np.nanmean(np.stack(rhos), axis=0) if np.isfinite(np.stack(rhos)).any() else np.full(len(units), np.nan)
    out = []
    for (layer, head), rho in zip(units, mean):
        rho = float(rho)
        where = f"the embeddings and layers 0..{layer}" if layer >= 0 else "every weight"
        if not informative:
            status = "not informative"
        elif not np.isfinite(rho):
            status = "not run"
        else:
            status = "fail" if rho >= RANDOMISATION_LIMIT else "pass"
        detail = (f"{word} {rho:+.2f} with the trained scores once what it is computed from ({where}) is "
                  "re-initialised" + (" (its ranking does not come from the weights)" if status == "fail" else ""))
        out.append(Check(name, "randomisation", status, rho if np.isfinite(rho) else None, detail,
                         ((0.0, 1.0), (1.0, rho)), layer=int(layer), head=int(head)))
    return out
