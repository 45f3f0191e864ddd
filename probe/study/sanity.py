"""Sanity checks that guard each explainer's assumption (house rule 13), run by every study and by
``probe explain``; results are data (:class:`Check` rows, a table in the result folder and a list in
``verdict.json``). On an explanation (``probe.explain``) the checks that need no rerun mark the scores
they failed on, per example where the check is (:class:`ScoreFlag`, :func:`explanation_flags`).

    degeneracy     gradient methods: is the target invariant along the direction the method
                   measures? ``input_x_gradient`` scores x_t . g_t, the derivative along scaling
                   token t's site vector; where the site's vector is one part of a sum that a norm
                   then normalises (BERT's word embedding inside word + position + type ->
                   LayerNorm), the derivative along scaling the *whole* sum w_t is zero, so
                   x_t . g_t = -(w_t - x_t) . g_t, a ranking set by the rest of the sum. Measured
                   as sum_t |w_t . g_t| / sum_t ||w_t|| ||g_t|| (0: scale invariant). The signed
                   gradient sum (``saliency_sum``) is zero when the model is invariant to adding a
                   constant to every coordinate (LayerNorm's mean subtraction): measured as
                   sum_t |sum_d g_td| / sum_t sum_d |g_td|. Every method: score vectors constant
                   or zero to float precision on every sampled example.
    completeness   integrated gradients: |sum of attributions - (f(x) - f(baseline))| relative to
                   |f(x) - f(baseline)| (the completeness axiom), and the steps that bring it under
                   :data:`COMPLETENESS_TOLERANCE` when the study's do not (doubling, up to
                   :data:`MAX_STEPS`: the search reruns IG on the sample at every try, which on a
                   30-layer model took minutes at 1024; past it, ``steps: auto`` finds the steps
                   per example). A try runs only as many of the sample's examples as decide its
                   median (:mod:`probe.study.completeness`: the whole sample's answer, about half
                   the points where IG is far from converging).
    randomisation  Adebayo et al. 2018 (:mod:`probe.study.randomisation`), cascading from the logits down: first the output head (the
                   classifier, score or pooler modules that are not tied to the input embeddings),
                   then the layers from the top, each re-initialised (matrices N(0, init std),
                   biases 0, norm scales 1; three draws per step, averaged; by default only the
                   judged step, the head and the top half, is drawn: ``metrics.sanity.fractions``
                   lists more for the curve). At each step, each explainer's Spearman correlation
                   with its trained-model scores, mean over a small sample, and the same for the
                   study's reference (its own row: how far the step moved what the model does with
                   its input) with the mean |change| of the target. Judged once the head and the
                   top half of the layers are random: if the reference's own ranking still has
                   Spearman >= 0.5 with the trained one, the randomisation did not change the
                   function the explainers explain, and every explainer is ``not informative``
                   (not a failure: post-LN blocks at N(0, 0.02) are close to the identity);
                   otherwise an explainer whose correlation stays >= 0.5 does not depend on the
                   model (fail). The reference runs once on the trained model for every check
                   that reads it, and on the cascade's models its layers below the re-initialised
                   ones are replayed from that run, not computed (:class:`~probe.study.replay.ReferenceRuns`: the same
                   numbers, bit for bit, for about half the work).
    sign           signed explainers (input x gradient, IG, GradientSHAP, attn_grad, saliency_sum):
                   on each sampled example's top tokens by |reference|, the share of the
                   reference's |effect| on tokens where the explainer's sign is the reference's;
                   below :data:`SIGN_LIMIT` the method is inverted (it says "pushes down" where
                   deleting the token lowers the target): fail.
    redundancy     explainer units whose rankings are identical (tau-b = 1) on >= 95% of the
                   examples form one group (``flow L1-L5 = attention_mean L0``).

A check that cannot run is a row with status ``not run`` and the reason, never an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe import registry
from probe.errors import ProbeError
from probe.study.completeness import search_steps

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample

DEGENERACY_TOLERANCE = 1e-4  # relative: below this the invariance holds to float precision
COMPLETENESS_TOLERANCE = 0.05  # |delta| / |f(x) - f(baseline)|, median over the sample
REDUNDANT_SHARE = 0.95  # share of examples with identical rankings that makes two units one
MAX_STEPS = 256  # the completeness check's search for the steps that would do stops here
SIGN_LIMIT = 0.25  # |effect|-weighted share of top tokens whose sign agrees; 0.5 is chance
SIGN_TOP = 3  # the top tokens by |reference| the sign check reads per example


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of one method: ``status`` pass, fail or not run; ``value`` the measured number."""

    method: str
    check: str
    status: str
    value: float | None
    detail: str
    curve: tuple = ()  # randomisation: ((fraction of layers randomised, mean Spearman), ...)
    layer: int = -1  # a check of one unit (randomisation of a bottom-up method): its layer and head
    head: int = -1

    @property
    def unit(self) -> tuple[str, int, int] | None:
        """``(method, layer, head)`` for a check of one unit, None for a check of the whole method."""
        return (self.method, self.layer, self.head) if self.layer >= 0 else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["curve"] = [list(point) for point in self.curve]
        return out


def failed_methods(checks: Sequence[Check]) -> dict[str, list[str]]:
    """Method -> the checks of the whole method it failed (a method failing any is unreliable for
    the study); a unit's own failed check marks that unit only (:func:`failed_units`)."""
    out: dict[str, list[str]] = {}
    for c in checks:
        if c.status == "fail" and c.unit is None:
            out.setdefault(c.method, []).append(c.check)
    return out


def failed_units(checks: Sequence[Check]) -> dict[tuple[str, int, int], list[str]]:
    """``(method, layer, head)`` -> the checks of that unit alone it failed (it never tracks)."""
    out: dict[tuple[str, int, int], list[str]] = {}
    for c in checks:
        if c.status == "fail" and c.unit is not None:
            out.setdefault(c.unit, []).append(c.check)
    return out



# --------------------------------------------------------------------------- degeneracy


def _site_gradients(pm: ProbeModel, examples, site_name: str | None):
    """(site, x [rows, seq, dim] at the site, g = d target / d x, w = the vector a scale invariance
    would act on (the norm's input where the site feeds a norm inside the embeddings module, else x),
    g_w = d target / d w, mask [rows, seq]) by plain autograd over forward hooks."""
    from probe.explainers.gradient_forward import (
        embeddings_module,
        hooked,
        is_norm,
        resolve_site,
    )
    from probe.rows.forward import build_rows
    from probe.rows.queries import eval_mode
    from probe.rows.values import target_values

    site = resolve_site(pm, site_name)
    batch = build_rows(pm, [(e.input_ids, e) for e in examples])
    held: dict[str, torch.Tensor] = {}
    module = site.module if site.module is not None else pm.model.get_input_embeddings()

    def keep_site(mod, args, output):
        output.retain_grad()
        held["x"] = output

    norm = None
    if site.name == "word" and site.normalising is not None:
        found = embeddings_module(pm.model)
        norm = next((m for m in found[1].modules() if is_norm(m)), None) if found else None

    def keep_norm_input(mod, args):
        args[0].retain_grad()
        held["w"] = args[0]

    with eval_mode(pm.model, grad=True), contextlib.ExitStack() as stack:
        stack.enter_context(hooked(module, keep_site))
        if norm is not None:
            handle = norm.register_forward_pre_hook(keep_norm_input)
            stack.callback(handle.remove)
        values = target_values(pm, batch, pm.model(**batch.inputs).logits)  # [rows]
        values.sum().backward()
    pm.model.zero_grad(set_to_none=True)
    if "x" not in held or held["x"].grad is None:
        raise ProbeError(f"site {site.name}: the forward pass of the target did not reach it with a gradient "
                         "(on a seq2seq model the encoder's site may be bypassed), so its degeneracy cannot be "
                         "measured")
    x, g = held["x"].detach().float(), held["x"].grad.detach().float()  # [rows, seq, dim]
    if "w" in held:
        w, gw = held["w"].detach().float(), held["w"].grad.detach().float()
    else:
        w, gw = x, g
    seq = batch.inputs["input_ids"].shape[1]
    mask = torch.arange(seq)[None, :].to(batch.input_lengths.device) < batch.input_lengths[:, None]  # [rows, seq]
    return site, x, g, w, gw, mask


def degeneracy(pm: ProbeModel, examples: Sequence[PreparedExample], methods: Sequence[str], *,
               params: Mapping[str, Mapping] | None = None) -> list[Check]:
    """The degeneracy checks of the gradient ``methods`` at each one's site (module docstring)."""
    params = params or {}
    checks = []
    probes: dict[str | None, tuple] = {}
    for method in methods:
        site_name = (params.get(method) or {}).get("site")
        try:
            if site_name not in probes:
                probes[site_name] = _site_gradients(pm, examples, site_name)
        except ProbeError as error:
            checks.append(Check(method, "degeneracy", "not run", None, str(error)))
            continue
        site, x, g, w, gw, mask = probes[site_name]
        m = mask[..., None]
        entry = registry.method(method)
        if entry.reduction == "sum" and entry.times_input:  # x . grad: zero where the model ignores |x|
            scale = float(((w * gw).sum(-1).abs() * mask).sum() / ((w.norm(dim=-1) * gw.norm(dim=-1)) * mask).sum()
                          .clamp_min(1e-30))
            bad = scale <= DEGENERACY_TOLERANCE
            whole = "the embedding sum entering the norm" if w is not x else "the site's vector"
            detail = (f"site {site.name}: sum|w.g| / sum|w||g| = {scale:.1e} with w = {whole}"
                      + ("; the model is invariant to scaling it, so x . grad = -(rest of the sum) . grad: "
                         "use site embeddings" if bad else ""))
            checks.append(Check(method, "degeneracy", "fail" if bad else "pass", scale, detail))
        elif entry.reduction == "sum":  # sum_d grad: zero where a mean-subtracting norm follows
            cancel = float(((g * m).sum(-1).abs()).sum() / (g.abs() * m).sum().clamp_min(1e-30))
            bad = cancel <= DEGENERACY_TOLERANCE
            detail = (f"site {site.name}: sum|sum_d g| / sum|g| = {cancel:.1e}"
                      + ("; the gradient sums to zero over the hidden axis (a mean-subtracting norm follows): "
                         "use site embeddings" if bad else ""))
            checks.append(Check(method, "degeneracy", "fail" if bad else "pass", cancel, detail))
    return checks


def constant_scores(method: str, scores: Sequence[torch.Tensor], scored: Sequence[Sequence[bool]]) -> Check:
    """Fails when every example's scored token vector is constant (zero included) to float precision."""
    flat = 0
    total = 0
    for values, keep in zip(scores, scored):
        values = values.detach().double().reshape(-1, values.shape[-1])[:, torch.tensor(list(keep), dtype=torch.bool)]
        if values.shape[-1] < 2:
            continue
        total += values.shape[0]
        spread = values.max(-1).values - values.min(-1).values
        size = values.abs().max(-1).values
        flat += int(((spread <= 1e-6 * size) | (size <= 1e-12)).sum())
    if not total:
        return Check(method, "constant", "not run", None, "no example has 2 scored tokens")
    share = flat / total
    bad = share == 1.0
    return Check(method, "constant", "fail" if bad else "pass", share,
                 f"{flat}/{total} score vectors constant or zero to float precision")


# --------------------------------------------------------------------------- completeness


def completeness(pm: ProbeModel, examples: Sequence[PreparedExample], result: TokenScores, *,
                 params: Mapping | None = None) -> Check:
    """Completeness of a path method (registry ``completeness``: integrated gradients) on ``result``
    (its convergence deltas in ``extras``); when too far off, the steps that would do, found by
    running the method's own registry entry with more steps on as few of ``examples`` as decide each
    try (:func:`probe.study.completeness.search_steps`: the whole sample's answer)."""
    name = result.method
    entry = registry.method(name)
    relative = _relative_delta(result)
    if relative is None:
        return Check(name, "completeness", "not run", None,
                     "f(x) = f(baseline) on every example: the relative delta is undefined")
    default = entry.defaults().steps
    steps = int(result.params.get("steps", default)) if isinstance(result.params.get("steps"), int) else default
    if relative <= COMPLETENESS_TOLERANCE:
        return Check(name, "completeness", "pass", relative,
                     f"median |delta| / |f(x) - f(baseline)| = {relative:.3f} at {steps} steps")
    kwargs = {**dict(entry.preset), **{k: v for k, v in dict(params or {}).items() if k != "steps"}}
    compute = entry.load()
    needed, trial = search_steps(lambda chosen, points: compute(pm, [examples[i] for i in chosen], steps=points,
                                                                **kwargs),
                                 result, steps, tolerance=COMPLETENESS_TOLERANCE, max_steps=MAX_STEPS)
    more = f"; {needed} steps bring it under {COMPLETENESS_TOLERANCE}" if needed else \
        f"; still above {COMPLETENESS_TOLERANCE} at {trial} steps (steps: auto finds them per example)"
    return Check(name, "completeness", "fail", relative,
                 f"median |delta| / |f(x) - f(baseline)| = {relative:.3f} at {steps} steps{more}")


def _relative_delta(result: TokenScores) -> float | None:
    extras = result.extras
    delta = np.abs(np.asarray(extras["convergence_delta"], dtype=float))
    gap = np.abs(np.asarray(extras["target_value"], dtype=float) - np.asarray(extras["baseline_value"], dtype=float))
    ok = gap > 1e-9
    return float(np.median(delta[ok] / gap[ok])) if ok.any() else None


# --------------------------------------------------------------------------- sign


def output_unit(values: torch.Tensor) -> torch.Tensor:
    """An explainer's output-level score vector: the last layer (head mean) of a per-layer/head method."""
    if values.ndim == 3:
        return values[-1].float().nanmean(dim=0)
    if values.ndim == 2:
        return values[-1]
    return values


def sign_check(method: str, scores: Sequence[torch.Tensor], reference: Sequence[torch.Tensor],
               scored: Sequence[Sequence[bool]], *, top: int = SIGN_TOP) -> Check:
    """Does a signed explainer's sign agree with the signed reference's on each example's top tokens
    (by |reference|)? The share of the reference's |effect| on agreeing tokens (module docstring)."""
    agree = total = 0.0
    for values, ref, keep in zip(scores, reference, scored):
        x = output_unit(values).double().numpy()
        y = ref.double().numpy()
        ok = np.asarray(list(keep), dtype=bool) & np.isfinite(x) & np.isfinite(y) & (np.abs(y) > 0)
        idx = np.flatnonzero(ok)
        if not len(idx):
            continue
        chosen = idx[np.argsort(-np.abs(y[idx]), kind="stable")[:top]]
        weight = np.abs(y[chosen])
        agree += float((weight * (np.sign(x[chosen]) == np.sign(y[chosen]))).sum())
        total += float(weight.sum())
    if total <= 0:
        return Check(method, "sign", "not run", None, "the reference is zero on every sampled token")
    share = agree / total
    bad = share < SIGN_LIMIT
    return Check(method, "sign", "fail" if bad else "pass", share,
                 f"{100 * share:.0f}% of the reference's |effect| on the top {top} tokens has this method's sign"
                 + (f" (< {100 * SIGN_LIMIT:.0f}%: inverted, it scores the tokens that raise the target as lowering "
                    "it)" if bad else ""))


# --------------------------------------------------------------------------- redundancy


def redundancy_groups(rankings: Mapping[str, Sequence[np.ndarray]], *, share: float = REDUNDANT_SHARE) -> list[list[str]]:
    """Groups (2+ units, in the given order) whose score vectors rank tokens identically (tau-b = 1,
    i.e. the same order and the same ties) on at least ``share`` of the examples they share.
    ``rankings`` maps a unit name to one score vector per example (NaN-free, same length per example)."""
    names = list(rankings)
    parent = {n: n for n in names}
    # tau-b = 1 exactly when both vectors have the same dense ranks (same order, same ties) and are
    # not constant; comparing ranks is exact and far cheaper than a tau per pair.
    dense = {n: [np.unique(np.asarray(x, dtype=float), return_inverse=True)[1] if len(x) else np.array([], int)
                 for x in rankings[n]] for n in names}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if root(a) == root(b):
                continue
            same = total = 0
            for x, y in zip(dense[a], dense[b]):
                if len(x) < 2 or len(x) != len(y):
                    continue
                total += 1
                same += bool(x.max() > 0 and np.array_equal(x, y))
            if total and same / total >= share:
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    return [g for g in groups.values() if len(g) > 1]


# --------------------------------------------------------------------------- for one explained input


def explain_checks(pm: ProbeModel, examples: Sequence[PreparedExample], results: Mapping[str, TokenScores],
                   params: Mapping[str, Mapping] | None = None) -> list[Check]:
    """The checks that fit one ``probe explain`` call (no randomisation: it would rerun every
    method several times): degeneracy of the gradient methods, constant scores, IG completeness."""
    from probe.names import method_family

    params = params or {}
    scored = [[not s for s in e.special] for e in examples]
    checks = [constant_scores(name, [output_unit(v) for v in r.scores], scored)
              for name, r in results.items() if method_family(name) != "intervention"]
    gradients = [m for m in results if method_family(m) == "gradient"]
    checks += degeneracy(pm, examples, gradients, params={m: {"site": results[m].params.get("site")} for m in gradients})
    for name in results:
        if registry.find(name).completeness:
            checks.append(completeness(pm, examples, results[name],
                                       params={k: v for k, v in (params.get(name) or {}).items() if k != "steps"}))
    return checks


def summary_lines(checks: Sequence[Check]) -> list[str]:
    """One line per method: ``sanity input_x_gradient: ok (degeneracy 3.1e-01, constant 0.0e+00)``
    or ``sanity saliency_sum: FAILED degeneracy: ...``."""
    by_method: dict[str, list[Check]] = {}
    for c in checks:
        by_method.setdefault(c.method, []).append(c)
    lines = []
    for method, items in by_method.items():
        failed = [c for c in items if c.status == "fail"]
        if failed:
            lines.append(f"sanity {method}: FAILED " + "; ".join(f"{c.check}: {c.detail}" for c in failed))
        else:
            ran = [f"{c.check} {c.status}" for c in items]
            lines.append(f"sanity {method}: ok ({', '.join(ran)})")
    return lines


# --------------------------------------------------------------------------- marks on an explanation's scores

#: the words a display puts beside a method's scores where one of its own checks failed
FLAG_WORDS = {"completeness": "not converged", "constant": "constant scores", "degeneracy": "degenerate site"}


@dataclasses.dataclass(frozen=True)
class ScoreFlag:
    """A method's own check failed on the scores of an explanation (``Explanation.flags``): every
    display of those scores marks them. ``examples``: the examples (indices into the explanation's)
    it failed on, each with its line in ``notes``; empty where the check is of the method as a
    whole (a degenerate site), which marks every example."""

    method: str
    check: str  # a key of FLAG_WORDS
    detail: str
    examples: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def words(self) -> str:
        """``not converged``, ``constant scores`` or ``degenerate site``."""
        return FLAG_WORDS.get(self.check, f"{self.check} failed")

    def covers(self, example: int) -> bool:
        return not self.examples or example in self.examples

    def note(self, example: int) -> str:
        """Why example ``example`` is marked (the whole method's detail where the check is the method's)."""
        if example in self.examples:
            return self.notes[self.examples.index(example)]
        return self.detail

    def to_dict(self) -> dict:
        return {"method": self.method, "check": self.check, "detail": self.detail, "examples": list(self.examples),
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, record: Mapping) -> ScoreFlag:
        return cls(str(record["method"]), str(record["check"]), str(record["detail"]),
                   tuple(int(i) for i in record.get("examples", ())), tuple(str(n) for n in record.get("notes", ())))


def completeness_flag(result: TokenScores) -> ScoreFlag | None:
    """The examples on which a path method (registry ``completeness``) breaks completeness: |delta|
    above ``tolerance`` x |f(x) - f(baseline)| (the method's ``tolerance``, which ``steps: auto``
    records, else its default) and above the absolute floor ``steps: auto`` uses; where ``steps:
    auto`` says per example whether it converged, that. None when every example is within."""
    from probe.explainers.integrated_gradients import AUTO_ABSOLUTE_TOLERANCE

    entry = registry.find(result.method)
    extras = result.extras
    if entry is None or not entry.completeness or "convergence_delta" not in extras:
        return None
    tolerance = result.params.get("tolerance", getattr(entry.defaults(), "tolerance", COMPLETENESS_TOLERANCE))
    steps = result.params.get("steps")
    bad, notes = [], []
    for i, delta in enumerate(extras["convergence_delta"]):
        gap = float(extras["target_value"][i]) - float(extras["baseline_value"][i])
        delta = float(delta)
        converged = extras.get("converged")
        failed = (not converged[i]) if converged is not None else \
            not abs(delta) <= max(float(tolerance) * abs(gap), AUTO_ABSOLUTE_TOLERANCE)  # NaN fails too
        if failed:
            used = extras["steps_used"][i] if "steps_used" in extras else steps
            bad.append(i)
            notes.append(f"completeness delta {delta:+.4g} against f(x) - f(baseline) = {gap:+.4g} at {used} steps "
                         f"(tolerance {float(tolerance):g} x |f(x) - f(baseline)|)")
    if not bad:
        return None
    more = ("; steps: auto found no convergence up to max_steps " f"{result.params.get('max_steps')}"
            if steps == "auto" else "; try steps='auto' (or more steps)")
    return ScoreFlag(result.method, "completeness", f"integral not converged on {len(bad)} of "
                     f"{len(extras['convergence_delta'])} examples{more}", tuple(bad), tuple(notes))


def constant_flag(result: TokenScores, examples: Sequence[PreparedExample]) -> ScoreFlag | None:
    """The examples whose scored tokens (not special, finite) all have the same score, zero
    included, to float precision (as :func:`constant_scores` counts them); None when none do."""
    bad, notes = [], []
    for i, (values, example) in enumerate(zip(result.scores, examples)):
        row = output_unit(values).detach().double()
        keep = torch.tensor([not s for s in example.special], dtype=torch.bool)[: row.shape[-1]] & torch.isfinite(row)
        kept = row[keep]
        if kept.numel() < 2:
            continue
        spread, size = float(kept.max() - kept.min()), float(kept.abs().max())
        if spread <= 1e-6 * size or size <= 1e-12:
            bad.append(i)
            notes.append(f"every scored token has the score {float(kept[0]):.3g}: the scores rank nothing")
    if not bad:
        return None
    return ScoreFlag(result.method, "constant", f"constant scores on {len(bad)} of {len(result.scores)} examples",
                     tuple(bad), tuple(notes))


def score_flags(examples: Sequence[PreparedExample], results: Mapping[str, TokenScores]) -> list[ScoreFlag]:
    """The marks that need no model: completeness per example (path methods) and constant scores
    per example (every method but the interventions, whose all-zero effect can be the truth)."""
    from probe.names import method_family

    flags = []
    for name, result in results.items():
        if not len(result.scores):
            continue
        found = [completeness_flag(result)]
        if method_family(name) != "intervention":
            found.append(constant_flag(result, examples))
        flags += [f for f in found if f is not None]
    return flags


def explanation_flags(pm: ProbeModel, examples: Sequence[PreparedExample],
                      results: Mapping[str, TokenScores]) -> list[ScoreFlag]:
    """:func:`score_flags`, and the degeneracy of each gradient method that sums over the hidden
    axis (registry ``reduction == "sum"``) on the word embedding where it enters a norm inside the
    embeddings module (BERT family), the one place the invariance it measures is exact (one gradient
    pass of the model; elsewhere none is spent): a method whose check failed, marked on every example."""
    from probe.explainers.gradient_forward import resolve_site
    from probe.names import method_family

    flags = score_flags(examples, results)
    gradients = []
    for m in results:
        if method_family(m) != "gradient" or not len(results[m].scores) or registry.method(m).reduction != "sum":
            continue
        try:
            site = resolve_site(pm, results[m].params.get("site"))
        except ProbeError:
            continue
        if site.name == "word" and site.normalising is not None:  # the word vector is one part of a normalised sum
            gradients.append(m)
    if gradients:
        sites = {m: {"site": results[m].params.get("site")} for m in gradients}
        flags += [ScoreFlag(c.method, c.check, c.detail) for c in degeneracy(pm, examples, gradients, params=sites)
                  if c.status == "fail"]
    return flags
