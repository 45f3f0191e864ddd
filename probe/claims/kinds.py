"""The claim kinds: what each measures, per example, and the verdict it gets.

What each kind measures (the decision rules are in :mod:`probe.claims.rules`):

token_importance  per example, over the scored tokens (special and prompt-template tokens excluded):
                  does the argmax of the attention ranking equal the argmax of the *signed*
                  reference (leave-one-out by default: f(x) - f(x without the token), so the most
                  important token is the one whose removal lowers the explained output most)?
                  Ties go to the earlier token. Evidence: the chance rate (mean of 1/n tokens),
                  Kendall tau-b and the top-k overlap with their CIs.
faithfulness      per example, Kendall tau-b (or Spearman) of the attention ranking and the signed
                  reference over the scored tokens.
specific_tokens   tokens match when their text (decoded alone, word-piece markers "##", "Ġ", "▁"
                  and surrounding spaces stripped) fully matches ``pattern``, case-insensitive
                  (``words``: any of the words). Examples with at least one match and at least as
                  many non-matching scored tokens take part. The matched tokens are removed
                  together (``intervention``: deleted, or replaced by [MASK], [UNK] or the pad id);
                  so are as many other tokens drawn at random (``repeats`` seeded draws, the
                  effect of each averaged) and the as many most-attended other tokens.
                  Effect = |f(x) - f(x - matched)| - mean |f(x) - f(x - random)|. Evidence: the
                  same against the attention-chosen tokens, and the attention share of the matched
                  tokens (their attention / the attention on all scored tokens) against their
                  uniform share (matched / scored tokens).
head_role         the head is ablated (its attention weights zeroed, :func:`probe.intervene.heads.
                  ablate_heads`), then each other head of its layer alone; effect = |f(x) -
                  f(x, head ablated)| - mean over the other heads of the same. Heads are those of
                  the attention that reads the target (cross-attention for seq2seq models).
                  ``attends_to``: the head's raw attention at the target query, share on the
                  matching scored tokens minus their uniform share.
counterfactual    the target row's attention at ``layer`` (one ``head`` or all) is replaced by
                  ``permutations`` seeded permutations of itself (special tokens stay in place);
                  effect = the median output total variation distance per example. With
                  ``adversarial``: Jain & Wallace's adversarial attention within ``bound``, max
                  attention JSD per example (evidence only).
sink_head         per example, the sinks of the head (keys whose mean received attention over the
                  query rows exceeds ``threshold``, :func:`probe.explainers.sinks.attention_sinks`)
                  and the target row's share of attention on them; then the target row's edges to
                  all of them are blocked in this head alone (:func:`probe.intervene.knockout.
                  block_edges`) and the effect is |f(x) - f(x, edges blocked)| (0 where the head
                  has no sink). Two parts: share above ``share``, effect below ``max_effect``.
edge              per example, the target row's edges to every token matching ``to`` (``to_words``,
                  or the one at ``to_position``) are blocked at once in every chosen head of every
                  layer of the window (Geva et al. 2023's attention knockout); effect = |f(x) -
                  f(x, edges blocked)|. Examples without such a token are left out. Evidence: the
                  signed change, and the target row's raw attention on those tokens in the window.
                  Control (always computed, in the same forward batch): per example, ``CONTROL_DRAWS``
                  seeded draws of as many other scored tokens (never a named or special token, nor a
                  sink of at least half of the claim's heads; all of them where fewer are left, none:
                  no control) have the target row's edges to them blocked alike; evidence ``control`` gives their mean |change| and the share of
                  examples whose named edges move the target more than their draws on average. The
                  verdict is the threshold's alone, but a supported claim whose control also reaches
                  the threshold, or whose named edges beat the control in at most half of the
                  examples, carries ``control["warning"]``: the effect is not specific to the tokens.
                  (The keys, the control draws and the blocked changes: :mod:`probe.claims.edges`.)

f is the explained target: the predicted class probability by default (``target`` as in a study).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from probe.claims.context import AuditContext
from probe.claims.edges import (
    CONTROL_DRAWS,
    blocked_changes,
    control_keys,
    control_warning,
    edge_details,
    edge_keys,
    renormalised,
    set_changes,
    window_words,
)
from probe.claims.rules import (
    LN2_HALF,
    RULES,
    Judgement,
    at_least_rule,
    at_most_rule,
    conjunction,
    counterfactual_rule,
    faithfulness_rule,
)
from probe.errors import InputError
from probe.spec.claims import (
    CounterfactualClaim,
    EdgeClaim,
    FaithfulnessClaim,
    HeadRoleClaim,
    SinkHeadClaim,
    SpecificTokensClaim,
    TokenImportanceClaim,
)

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

__all__ = ["ClaimResult", "EVIDENCE_EXAMPLES", "KINDS", "clean_json"]

#: Examples listed as evidence for and against a claim, each.
EVIDENCE_EXAMPLES = 3


@dataclass
class ClaimResult:
    """One claim's verdict. ``effect`` is the mean per-example effect, ``ci`` its bootstrap CI."""

    claim: str
    kind: str
    verdict: str
    effect: float
    ci: tuple[float, float]
    n: int
    threshold: float
    measure: str  # what the per-example effect is
    rule: str  # the decision rule in words
    intervention: str  # what was done to the model or the input
    evidence: dict
    settings: dict
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return clean_json({"claim": self.claim, "kind": self.kind, "verdict": self.verdict, "effect": self.effect,
                       "ci": list(self.ci), "n": self.n, "threshold": self.threshold, "measure": self.measure,
                       "rule": self.rule, "intervention": self.intervention, "evidence": self.evidence,
                       "settings": self.settings, "seconds": round(self.seconds, 3)})



def clean_json(value):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value



def _evidence_examples(ctx: AuditContext, effects: np.ndarray, details: list[dict], secondary=None) -> dict:
    """The examples most for (highest effect) and most against (lowest) the claim."""
    finite = [i for i in range(len(effects)) if math.isfinite(effects[i])]
    if not finite:
        return {"for": [], "against": []}
    key2 = secondary if secondary is not None else np.zeros(len(effects))
    order = sorted(finite, key=lambda i: (effects[i], np.nan_to_num(key2[i], nan=-np.inf)))
    k = min(EVIDENCE_EXAMPLES, max(1, len(finite) // 2))

    def entry(i):
        return {**ctx.describe(i), "effect": float(effects[i]), **details[i]}

    return {"for": [entry(i) for i in reversed(order[-k:])], "against": [entry(i) for i in order[:k]]}


def _summary(ctx: AuditContext, values) -> dict:
    j = ctx.judge(values, RULES["specific_tokens"])  # the rule does not matter here: mean and CI only
    return {"mean": j.mean, "ci": list(j.ci), "n": j.n}


def _result(claim, judgement: Judgement, *, measure: str, rule, intervention: str, evidence: dict,
            verdict: str | None = None, n_needed=None, rule_text: str | None = None) -> ClaimResult:
    verdict = verdict or judgement.verdict
    evidence = dict(evidence)
    evidence["std"] = judgement.std
    if verdict == "inconclusive":
        evidence["n_needed"] = judgement.n_needed if n_needed is None else n_needed
        if judgement.why:
            evidence["why"] = judgement.why
    if judgement.p_value is not None:
        evidence["sign_flip_p"] = judgement.p_value
    settings = claim.model_dump(mode="json", exclude={"claim", "kind"})
    return ClaimResult(claim=claim.claim, kind=claim.kind, verdict=verdict, effect=judgement.mean, ci=judgement.ci,
                       n=judgement.n, threshold=judgement.threshold, measure=measure, rule=rule_text or rule.describe(),
                       intervention=intervention, evidence=evidence, settings=settings)


# ------------------------------------------------------------------------------------------ kinds


def _agreements(ctx: AuditContext, claim, index: int, k: int) -> tuple[list[dict], list[dict]]:
    """Per example: agreement of the attention ranking with the reference over the scored tokens (with
    the claim file's ``spans``: over the spans, attention folded, the reference leaving out whole spans)."""
    from probe.metrics.agreement import agreement

    attention = ctx.attention_vectors(claim.ranking, index)
    if ctx.file.spans is not None:  # spans as units: attention folded over each span, the reference perturbs it whole
        attention, reference = ctx.span_vectors(attention), ctx.span_reference(claim.reference, index)
    else:
        reference = ctx.reference(claim.reference)
    rows, details = [], []
    for i, (x, y) in enumerate(zip(attention, reference)):
        scorable = np.ones(len(x), dtype=bool) if ctx.file.spans is not None else ctx.scorable(i)
        keep = scorable & np.isfinite(x) & np.isfinite(y)
        n = int(keep.sum())
        if n < 2:
            rows.append({})
            details.append({"n_tokens": n})
            continue
        values = {key: float(v[0]) for key, v in agreement(x[keep], y[keep], k=[1, k]).items()}
        positions = np.flatnonzero(keep)
        texts = [span.text for span in ctx.spans()[i]] if ctx.file.spans is not None else ctx.texts(i)
        top_attention = int(positions[np.argsort(-x[keep], kind="stable")[0]])
        top_reference = int(positions[np.argsort(-y[keep], kind="stable")[0]])
        values["chance"] = 1.0 / n
        rows.append(values)
        details.append({"n_tokens": n, "most_attended": texts[top_attention], "most_important": texts[top_reference],
                        "kendall_tau": values["kendall_tau"], "spearman": values["spearman"],
                        f"top{k}_overlap": values[f"top{k}"]})
    return rows, details


def _column(rows: list[dict], key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) for r in rows], dtype=np.float64)


def token_importance(ctx: AuditContext, claim: TokenImportanceClaim, index: int) -> ClaimResult:
    rows, details = _agreements(ctx, claim, index, claim.k)
    top1 = _column(rows, "top1")
    j = ctx.judge(top1, RULES["token_importance"])
    tau = _column(rows, "kendall_tau")
    evidence = {
        "top1_match_rate": j.mean,
        "chance_rate": float(np.nanmean(_column(rows, "chance"))) if j.n else None,
        "kendall_tau": _summary(ctx, tau),
        f"top{claim.k}_overlap": _summary(ctx, _column(rows, f"top{claim.k}")),
        "n_excluded": ctx.n_examples - j.n,
        **_evidence_examples(ctx, top1, details, secondary=tau),
    }
    return _result(claim, j, measure=f"share of examples whose most-attended token ({claim.attention}) is the most "
                                     f"important one by {claim.reference} (signed: largest drop)",
                   rule=RULES["token_importance"], intervention=f"{claim.reference} (reference)", evidence=evidence)


def faithfulness(ctx: AuditContext, claim: FaithfulnessClaim, index: int) -> ClaimResult:
    rows, details = _agreements(ctx, claim, index, 3)
    values = _column(rows, claim.measure)
    rule = faithfulness_rule(claim.threshold)
    j = ctx.judge(values, rule)
    evidence = {
        "top1_match_rate": _summary(ctx, _column(rows, "top1")),
        "random_ranking_expectation": 0.0,
        "n_excluded": ctx.n_examples - j.n,
        **_evidence_examples(ctx, values, details),
    }
    return _result(claim, j, measure=f"{claim.measure} of {claim.attention} with {claim.reference} per example",
                   rule=rule, intervention=f"{claim.reference} (reference)", evidence=evidence)


def _removed(ids: tuple[int, ...], positions, replacement: int | None) -> tuple[int, ...]:
    drop = set(int(p) for p in positions)
    if replacement is None:
        return tuple(t for p, t in enumerate(ids) if p not in drop)
    return tuple(replacement if p in drop else t for p, t in enumerate(ids))


def replacement_token(pm: ProbeModel, mode: str) -> int | None:
    if mode == "delete":
        return None
    from probe.intervene.tokens import replacement_token_id

    return replacement_token_id(pm, mode)


def specific_tokens(ctx: AuditContext, claim: SpecificTokensClaim, index: int) -> ClaimResult:
    matcher = claim.matcher()
    matched = [ctx.matches(i, matcher) for i in range(len(ctx.examples))]
    with_match = [i for i, m in enumerate(matched) if m.any()]
    if not with_match:
        raise InputError(f"{ctx.file.where(index, 'words' if claim.words is not None else 'pattern')}: "
                         f"{claim.matches_what} matches no token in any of the {len(ctx.examples)} examples searched "
                         "(token texts are matched whole, case-insensitive, word-piece markers stripped); "
                         "check the pattern or use more data")
    attention = ctx.attention_vectors(claim.ranking, index)
    plan, rows = _removal_rows(ctx, claim, matched, with_match, attention)
    values = ctx.engine.values(rows, reuse_prefix=ctx.pm.task.next_token).double().numpy() if rows else np.array([])
    effects, versus_attention, share, uniform, details = _removal_effects(ctx, claim, plan, values, attention)
    j = ctx.judge(effects, RULES["specific_tokens"])
    what = {"delete": "deleted", "mask": "replaced by the mask token", "unk": "replaced by the unknown token",
            "pad": "replaced by the pad id (attended)"}[claim.intervention]
    evidence = {
        "matched_minus_attention_chosen": _summary(ctx, versus_attention),
        "abs_change_matched": float(np.nanmean([d.get("abs_change_matched", np.nan) for d in details])) if plan else None,
        "abs_change_random": float(np.nanmean([d.get("abs_change_random", np.nan) for d in details])) if plan else None,
        "attention_share_matched": _summary(ctx, share),
        "uniform_share_matched": float(np.nanmean(uniform)) if plan else None,
        "n_searched": len(ctx.examples),
        "n_with_match": len(with_match),
        "n_without_room": len(with_match) - len(plan),
        **_evidence_examples(ctx, effects, details),
    }
    return _result(claim, j, measure=f"|change| when the tokens matching {claim.matches_what} are {what} minus the "
                                     f"mean |change| when as many random other tokens are ({claim.repeats} draws)",
                   rule=RULES["specific_tokens"],
                   intervention=f"{claim.intervention}: matched tokens vs {claim.repeats} seeded random draws of as "
                                f"many other tokens vs the most-attended other tokens ({claim.attention})",
                   evidence=evidence)


def _removal_rows(ctx: AuditContext, claim: SpecificTokensClaim, matched: list[np.ndarray], with_match: list[int],
                  attention: list[np.ndarray]) -> tuple[list[tuple], list]:
    """Per example with room for as many other tokens: its rows (original, matched removed, each random
    draw removed, the most-attended others removed), and the plan ``(example, first row, matched
    positions, draws, attention-chosen positions)`` to read their values back."""
    from probe.rows.target import example_seed

    replacement = replacement_token(ctx.pm, claim.intervention)
    plan = []
    rows: list = []
    for i in with_match:
        example = ctx.examples[i]
        ids = tuple(int(t) for t in example.input_ids)
        chosen = np.flatnonzero(matched[i])
        others = np.flatnonzero(ctx.scorable(i) & ~matched[i])
        if len(others) < len(chosen):
            continue
        rng = np.random.default_rng(example_seed(ctx.seed, example))
        draws = [np.sort(rng.choice(others, size=len(chosen), replace=False)) for _ in range(claim.repeats)]
        by_attention = others[np.argsort(-attention[i][others], kind="stable")[: len(chosen)]]
        variants = [ids, _removed(ids, chosen, replacement)] + [_removed(ids, d, replacement) for d in draws] \
            + [_removed(ids, by_attention, replacement)]
        plan.append((i, len(rows), chosen, draws, by_attention))
        rows.extend((v, example) for v in variants)
    return plan, rows


def _removal_effects(ctx: AuditContext, claim: SpecificTokensClaim, plan: list[tuple], values: np.ndarray,
                     attention: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
    """Per example (NaN where it took no part): the effect (matched minus random), matched minus
    attention-chosen, the attention share of the matched tokens, their uniform share; and the details."""
    n_all = len(ctx.examples)
    effects, versus_attention = np.full(n_all, np.nan), np.full(n_all, np.nan)
    share, uniform = np.full(n_all, np.nan), np.full(n_all, np.nan)
    details: list[dict] = [{} for _ in range(n_all)]
    for i, first, chosen, _draws, by_attention in plan:
        v = values[first: first + 3 + claim.repeats]
        base = v[0]
        d_matched = abs(base - v[1])
        d_random = float(np.mean(np.abs(base - v[2: 2 + claim.repeats])))
        d_attention = abs(base - v[-1])
        effects[i] = d_matched - d_random
        versus_attention[i] = d_matched - d_attention
        a, scorable = attention[i], ctx.scorable(i)
        total = float(a[scorable].sum())
        share[i] = float(a[chosen].sum()) / total if total > 0 else np.nan
        uniform[i] = len(chosen) / int(scorable.sum())
        texts = ctx.texts(i)
        details[i] = {"matched": [texts[p] for p in chosen], "abs_change_matched": d_matched,
                      "abs_change_random": d_random, "abs_change_attention_chosen": d_attention,
                      "attention_chosen": [texts[p] for p in by_attention],
                      "attention_share_matched": share[i], "uniform_share_matched": uniform[i]}
    return effects, versus_attention, share, uniform, details


def head_role(ctx: AuditContext, claim: HeadRoleClaim, index: int) -> ClaimResult:
    layer_value, head = claim.site
    layer = ctx.layer(layer_value, index, "head")
    ctx.head(head, index, "head")
    if ctx.n_heads < 2:
        raise InputError(f"{ctx.file.where(index, 'head')}: the model has one head per layer; a head's role is "
                         "judged against the other heads of its layer")
    matcher = claim.matcher()
    if matcher is not None:
        found = [ctx.matches(i, matcher) for i in range(len(ctx.examples))]
        if not any(m.any() for m in found):
            raise InputError(f"{ctx.file.where(index, 'attends_to')}: attends_to {claim.attends_to!r} matches no "
                             f"token in any of the {len(ctx.examples)} examples searched; check the pattern")
    values = ctx.layer_ablation(layer)  # [example, 1 + heads]
    change = np.abs(values[:, :1] - values[:, 1:])  # [example, heads]
    others = np.delete(change, head, axis=1).mean(axis=1)
    effects = change[:, head] - others
    j = ctx.judge(effects, RULES["head_role"])
    mean_change = change.mean(axis=0)
    rank = int((mean_change > mean_change[head]).sum()) + 1
    details = [{"abs_change_head": float(change[i, head]), "abs_change_other_heads": float(others[i])}
               for i in range(len(ctx.examples))]
    evidence: dict = {
        "mean_abs_change_per_head": {f"{layer}.{h}": float(c) for h, c in enumerate(mean_change)},
        "rank_in_layer": rank,
        "heads_in_layer": ctx.n_heads,
    }
    verdict, needed = j.verdict, None
    measure = f"|change| when head {layer}.{head} is ablated minus the mean |change| of the other heads of layer {layer}"
    if matcher is not None:
        second = _attends_to(ctx, claim, layer, head, found, details)
        evidence["ablation_verdict"] = j.verdict
        evidence["attends_to"] = _attends_to_evidence(claim, second, details)
        verdict = conjunction(j.verdict, second.verdict)
        if verdict == "inconclusive":
            parts = [p.n_needed for p in (j, second) if p.verdict == "inconclusive" and p.n_needed is not None]
            needed = max(parts) if parts else None
        measure += f"; and it attends to {claim.attends_to!r} more than uniformly (both must hold)"
    evidence.update(_evidence_examples(ctx, effects, details))
    rule_text = RULES["head_role"].describe()
    if matcher is not None:
        rule_text = (f"both parts judged alike ({rule_text}); supported if both are supported, refuted if either "
                     "is refuted, inconclusive otherwise")
    return _result(claim, j, measure=measure, rule=RULES["head_role"], rule_text=rule_text,
                   intervention=f"ablate head {layer}.{head} (attention weights zeroed) vs each other head of layer "
                                f"{layer} alone", evidence=evidence, verdict=verdict, n_needed=needed)


def _attends_to(ctx: AuditContext, claim: HeadRoleClaim, layer: int, head: int, found: list[np.ndarray],
                details: list[dict]) -> Judgement:
    """The head's raw attention share on the matching scored tokens minus their uniform share, judged
    per example; each example's shares go into ``details``."""
    raw = ctx.scores("attention").scores
    excess = np.full(len(ctx.examples), np.nan)
    for i, m in enumerate(found):
        scorable = ctx.scorable(i)
        if not m.any() or m.sum() == scorable.sum():
            continue
        a = raw[i][layer, head].double().numpy()
        total = float(a[scorable].sum())
        if total > 0:
            share = float(a[m].sum()) / total
            uniform = int(m.sum()) / int(scorable.sum())
            excess[i] = share - uniform
            details[i].update({"attention_share_matched": share, "uniform_share_matched": uniform})
    return ctx.judge(excess, RULES["head_role"])


def _attends_to_evidence(claim: HeadRoleClaim, second: Judgement, details: list[dict]) -> dict:
    shares = [d["attention_share_matched"] for d in details if "attention_share_matched" in d]
    uniforms = [d["uniform_share_matched"] for d in details if "uniform_share_matched" in d]
    return {"pattern": claim.attends_to, "measure": "the head's attention share on matching "
            "tokens minus their uniform share", **second.to_dict(),
            "attention_share": float(np.mean(shares)) if shares else None,
            "uniform_share": float(np.mean(uniforms)) if uniforms else None}


def counterfactual(ctx: AuditContext, claim: CounterfactualClaim, index: int) -> ClaimResult:
    from probe.intervene.counterfactual import adversarial_attention, permuted_attention

    layer = ctx.layer(claim.layer, index, "layer")
    head = ctx.head(claim.head, index, "head")
    perm = permuted_attention(ctx.pm, ctx.examples, layer=layer, head=head, n=claim.permutations, seed=ctx.seed)
    summary = perm.summary()
    effects = summary["median_output_tvd"].double().numpy()
    rule = counterfactual_rule(claim.bound)
    j = ctx.judge(effects, rule)
    details = [{"median_output_tvd": float(effects[i]), "max_attention": float(summary["max_attention"][i])}
               for i in range(len(ctx.examples))]
    site = f"layer {layer}" + (f" head {head}" if head is not None else " (all heads)")
    evidence: dict = {"max_output_tvd": float(perm.output_tvd.nan_to_num(-1).max())}
    intervention = f"{claim.permutations} seeded permutations of the target row's attention at {site}"
    if claim.adversarial:
        adv = adversarial_attention(ctx.pm, ctx.examples, layer=layer, head=head, candidates=claim.candidates,
                                    steps=claim.steps, bound=claim.bound, seed=ctx.seed)
        jsd = adv.summary()["max_attention_jsd"].double().numpy()
        evidence["adversarial"] = {"max_attention_jsd": _summary(ctx, jsd),
                                   "share_above_half_ln2": float(np.mean(jsd > LN2_HALF)),
                                   "feasible_share": float(adv.feasible.double().mean()),
                                   "candidates": claim.candidates, "steps": claim.steps, "bound": claim.bound}
        for i in range(len(ctx.examples)):
            details[i]["adversarial_attention_jsd"] = float(jsd[i])
        intervention += (f"; adversarial attention ({claim.candidates} candidates, {claim.steps} steps, output TVD "
                         f"<= {claim.bound:g})")
    evidence.update(_evidence_examples(ctx, effects, details))
    return _result(claim, j, measure=f"median output total variation distance over {claim.permutations} permutations "
                                     f"of the attention at {site}", rule=rule, intervention=intervention,
                   evidence=evidence)


def sink_head(ctx: AuditContext, claim: SinkHeadClaim, index: int) -> ClaimResult:
    from probe.intervene.knockout import EdgeSet

    layer_value, head = claim.site
    layer = ctx.layer(layer_value, index, "head")
    head = ctx.head(head, index, "head")
    found = ctx.sinks(claim.threshold)
    shares = np.full(len(ctx.examples), np.nan)
    sets, details = [], []
    for i, example in enumerate(found.examples):
        shares[i] = float(example.share[layer, head])
        keys = tuple(int(k) for k in np.flatnonzero(example.sinks[layer, head].numpy()))
        texts = ctx.texts(i)
        details.append({"sink_share": shares[i], "sinks": [f"{texts[k] or ctx.examples[i].tokens[k]}@{k}" for k in keys]})
        if keys:
            sets.append(EdgeSet(i, keys, ((layer, head),)))
    changes = blocked_changes(ctx, sets, claim.renormalise)
    effects = np.array([abs(changes[i]) if i in changes else (0.0 if np.isfinite(shares[i]) else np.nan)
                        for i in range(len(ctx.examples))])
    for i, d in enumerate(details):
        d["knockout_abs_change"] = float(effects[i])
    j = ctx.judge(shares, at_least_rule(claim.share))
    second = ctx.judge(effects, at_most_rule(claim.max_effect))
    verdict = conjunction(j.verdict, second.verdict)
    needed = None
    if verdict == "inconclusive":
        parts = [p.n_needed for p in (j, second) if p.verdict == "inconclusive" and p.n_needed is not None]
        needed = max(parts) if parts else None
    first_token = [bool(e.sinks[layer, head, 0]) for e in found.examples if e.sinks.shape[-1]]
    evidence = {"share_verdict": j.verdict,
                "knockout": {"measure": "|f(x) - f(x with the target row's edges to the head's sinks blocked)|",
                             **second.to_dict()},
                "sink_threshold": claim.threshold,
                "examples_with_a_sink": len(sets),
                "first_token_a_sink": float(np.mean(first_token)) if first_token else None,
                **_evidence_examples(ctx, shares, details, secondary=-effects)}
    rule_text = (f"both parts judged alike: the share {at_least_rule(claim.share).describe('mean share')}; the "
                 f"knockout effect {at_most_rule(claim.max_effect).describe('mean |change|')}; supported if both are "
                 "supported, refuted if either is refuted, inconclusive otherwise")
    return _result(claim, j, measure=f"the target row's share of attention on the sink keys of head {layer}.{head} "
                                     f"(mean received attention > {claim.threshold:g}); and |change| when its edges "
                                     f"to them are blocked in that head stays under {claim.max_effect:g} (both must "
                                     "hold)",
                   rule=at_least_rule(claim.share), rule_text=rule_text,
                   intervention=f"edge knockout: the target row's edges to head {layer}.{head}'s sinks blocked in "
                                f"that head alone, {renormalised(claim.renormalise)}",
                   evidence=evidence, verdict=verdict, n_needed=needed)


def edge(ctx: AuditContext, claim: EdgeClaim, index: int) -> ClaimResult:
    from probe.intervene.knockout import EdgeSet

    window = ctx.layer_window(claim, index)
    heads = (list(range(ctx.n_heads)) if claim.head_list is None
             else sorted({ctx.head(h, index, "heads") for h in claim.head_list}))
    keys = edge_keys(ctx, claim, index)
    sites = tuple((layer, head) for layer in window for head in heads)
    controls = control_keys(ctx, keys, sites)
    sets = [EdgeSet(i, k, sites) for i, k in enumerate(keys) if k]
    control_sets = [EdgeSet(i, c, sites) for i, draws in enumerate(controls) for c in draws]
    all_changes = set_changes(ctx, sets + control_sets, claim.renormalise)  # one batched call: one shared f(x)
    changes = {s.example: float(c) for s, c in zip(sets, all_changes[: len(sets)])}
    n_all = len(ctx.examples)
    drawn: dict[int, list[float]] = {}
    for s, c in zip(control_sets, all_changes[len(sets):]):
        drawn.setdefault(s.example, []).append(abs(float(c)))
    control = np.array([float(np.mean(drawn[i])) if i in drawn else np.nan for i in range(n_all)])
    effects = np.array([abs(changes[i]) if i in changes else np.nan for i in range(n_all)])
    signed = np.array([changes.get(i, np.nan) for i in range(n_all)])
    shares, details = edge_details(ctx, keys, window, heads, signed, control, controls)
    rule = at_least_rule(claim.threshold)
    j = ctx.judge(effects, rule)
    span = window_words(window)
    which = "every head" if claim.head_list is None else f"heads {', '.join(map(str, heads))}"
    with_control = np.isfinite(control) & np.isfinite(effects)
    above = float(np.mean(effects[with_control] > control[with_control])) if with_control.any() else None
    control_summary = _summary(ctx, control)
    control_evidence = {"measure": f"mean |change| over {CONTROL_DRAWS} seeded draws of as many other scored tokens "
                                   "(never a named or special token, nor a sink of half the claim's heads or more), their "
                                   "edges blocked alike",
                        "mean_abs_change": control_summary, "draws": CONTROL_DRAWS,
                        "share_named_above_control": above, "n_with_control": int(with_control.sum())}
    warning = control_warning(claim, j.verdict, control_summary["mean"], above, f"{which} of {span}")
    if warning is not None:
        control_evidence["warning"] = warning
    evidence = {"signed_change": _summary(ctx, signed),
                "attention_share": _summary(ctx, shares),
                "control": control_evidence,
                "n_searched": len(ctx.examples), "n_with_target": len(sets), "layers": window,
                **_evidence_examples(ctx, effects, details)}
    return _result(claim, j, measure=f"|change| of the target when the target row's edges to {claim.to_what} are "
                                     f"blocked in {which} of {span}",
                   rule=rule, intervention=f"edge knockout: the target row's edges to {claim.to_what} blocked at once "
                                           f"in {which} of {span}, {renormalised(claim.renormalise)}; control: "
                                           f"{CONTROL_DRAWS} seeded draws of as many other tokens blocked alike",
                   evidence=evidence)


KINDS = {
    "token_importance": token_importance,
    "faithfulness": faithfulness,
    "specific_tokens": specific_tokens,
    "head_role": head_role,
    "counterfactual": counterfactual,
    "sink_head": sink_head,
    "edge": edge,
}
