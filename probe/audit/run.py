"""Run an audit: load the model and the examples once, measure every claim, decide, write the report.

What each kind measures (the decision rules are in :mod:`probe.audit.rules`):

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

f is the explained target: the predicted class probability by default (``target`` as in a study).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from probe.audit.claims import (
    AttentionRanking,
    ClaimFile,
    CounterfactualClaim,
    FaithfulnessClaim,
    HeadRoleClaim,
    SpecificTokensClaim,
    TokenImportanceClaim,
)
from probe.audit.rules import (
    LN2_HALF,
    RULES,
    Judgement,
    conjunction,
    counterfactual_rule,
    faithfulness_rule,
    judge,
)
from probe.errors import InputError

__all__ = ["AuditResult", "ClaimResult", "run_audit", "select_examples", "token_text"]

#: Examples listed as evidence for and against a claim, each.
EVIDENCE_EXAMPLES = 3
WORD_PIECE_MARKERS = ("##", "Ġ", "▁")


# ------------------------------------------------------------------------------------------ results


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
        return _clean({"claim": self.claim, "kind": self.kind, "verdict": self.verdict, "effect": self.effect,
                       "ci": list(self.ci), "n": self.n, "threshold": self.threshold, "measure": self.measure,
                       "rule": self.rule, "intervention": self.intervention, "evidence": self.evidence,
                       "settings": self.settings, "seconds": round(self.seconds, 3)})


@dataclass
class AuditResult:
    claims: list[ClaimResult]
    model: dict
    data: dict
    statistics: dict
    source: str
    description: str = ""
    seconds: float = 0.0
    out_dir: Path | None = None
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return _clean({"source": self.source, "description": self.description, "model": self.model, "data": self.data, "statistics": self.statistics,
                       "claims": [c.to_dict() for c in self.claims], "seconds": round(self.seconds, 3)})

    def write(self, out_dir: str | Path) -> list[Path]:
        """audit.json, audit.md and audit.html in ``out_dir`` (created)."""
        from probe.audit.render import render_html, render_markdown

        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output folder {out}: {exc.strerror or exc}") from None
        data = self.to_dict()
        paths = [out / "audit.json", out / "audit.md", out / "audit.html"]
        paths[0].write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        paths[1].write_text(render_markdown(data), encoding="utf-8")
        paths[2].write_text(render_html(data), encoding="utf-8")
        self.out_dir = out
        self.files = [str(p) for p in paths]
        return paths


def _clean(value):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


# ------------------------------------------------------------------------------------------ examples


def select_examples(pm, claim_file: ClaimFile) -> list:
    """The audit's examples (``probe.data.Example``), as a study with the same data would pick them:
    texts that fit the model's window (and ``max_length``), then ``n`` after a shuffle with ``seed``."""
    from probe.data import Example, _take, load_dataset

    d = claim_file.data
    prompt = claim_file.target.prompt
    if d.texts is not None:
        items = [Example(f"text-{i}", text, None) for i, text in enumerate(d.texts)]
        return items[: d.n] if d.n is not None else items
    everything = load_dataset(d.dataset, split=d.split, n=None, seed=d.seed, text_column=d.text_column,
                              label_column=d.label_column)
    limit = min(d.max_length or pm.contract.max_positions, pm.contract.max_positions)
    texts = [prompt.replace("{text}", e.text) if prompt else e.text for e in everything]
    lengths = [len(ids) for ids in pm.tokenizer(texts)["input_ids"]]
    fitting = [e for e, n in zip(everything, lengths) if n <= limit]
    if not fitting:
        raise InputError(f"no example of {d.dataset} fits in {limit} tokens; raise data.max_length")
    return _take(fitting, d.n, d.seed, d.dataset)


def token_text(pm, token_id: int) -> str:
    """A token's text for matching: decoded alone, word-piece markers and surrounding spaces stripped."""
    text = pm.tokenizer.decode([int(token_id)]).strip()
    for marker in WORD_PIECE_MARKERS:
        if text.startswith(marker):
            text = text[len(marker):]
    return text.strip()


# ------------------------------------------------------------------------------------------ context


class _Context:
    """What every claim shares: the model, the prepared examples, one engine, cached scores."""

    def __init__(self, pm, claim_file: ClaimFile, items, examples, progress: bool):
        from probe.intervene.engine import Engine

        self.pm, self.file, self.items, self.examples = pm, claim_file, items, examples
        self.engine = Engine(pm)
        self.seed = claim_file.statistics.seed
        self.progress = progress
        self.stack = "cross" if pm.task == "seq2seq" else pm.contract.primary_stack
        info = pm.contract.stacks[self.stack]
        self.n_layers, self.n_heads = info.n_layers, info.n_heads
        self._scores: dict = {}
        self._ablations: dict[int, np.ndarray] = {}
        self._texts: dict[int, list[str]] = {}

    def judge(self, values, rule) -> Judgement:
        s = self.file.statistics
        return judge(values, rule, n_boot=s.bootstrap, level=s.level, seed=s.seed)

    def scores(self, method: str):
        if method not in self._scores:
            from probe.explain.methods import run_method

            params = {m: {"seed": self.seed} for m in ("loo_random", "loo_lm", "gradient_shap")}.get(method)
            self._scores[method] = run_method(self.pm, self.examples, method, engine=self.engine, params=params)
        return self._scores[method]

    def texts(self, i: int) -> list[str]:
        if i not in self._texts:
            self._texts[i] = [token_text(self.pm, t) for t in self.examples[i].input_ids]
        return self._texts[i]

    def scorable(self, i: int) -> np.ndarray:
        return ~np.asarray(self.examples[i].special, dtype=bool)

    def matches(self, i: int, matcher) -> np.ndarray:
        """Scored tokens of example i whose text fully matches ``matcher``."""
        texts = self.texts(i)
        return self.scorable(i) & np.array([bool(matcher.fullmatch(t)) for t in texts], dtype=bool)

    def layer(self, value: int | str, index: int, key: str) -> int:
        layer = {"first": 0, "last": self.n_layers - 1}.get(value, value)
        if not 0 <= layer < self.n_layers:
            raise InputError(f"{self.file.where(index, key)}: layer {value} does not exist: {self.pm.name} has "
                             f"{self.n_layers} layers in its {self.stack} attention (valid 0..{self.n_layers - 1}, "
                             "first or last)")
        return layer

    def head(self, value: int | None, index: int, key: str) -> int | None:
        if value is not None and not 0 <= value < self.n_heads:
            raise InputError(f"{self.file.where(index, key)}: head {value} does not exist: {self.pm.name} has "
                             f"{self.n_heads} heads per layer (valid 0..{self.n_heads - 1})")
        return value

    def check_ranking(self, ranking: AttentionRanking, index: int) -> tuple[int, int | None]:
        return self.layer(ranking.layer, index, "attention"), self.head(ranking.head, index, "attention")

    def attention_vectors(self, ranking: AttentionRanking, index: int) -> list[np.ndarray]:
        """One ``[tokens]`` vector per example: the method at the layer, the head or the head mean."""
        layer, head = self.check_ranking(ranking, index)
        out = []
        for s in self.scores(ranking.method).scores:
            v = s[layer]
            if v.dim() == 2:
                v = v[head] if head is not None else v.mean(dim=0)
            out.append(v.double().numpy())
        return out

    def layer_ablation(self, layer: int) -> np.ndarray:
        """[example, 1 + heads]: the target unablated, then with each head of ``layer`` ablated alone."""
        if layer not in self._ablations:
            from probe.intervene.heads import ablate_heads

            ablations = [[]] + [[(layer, h)] for h in range(self.n_heads)]
            self._ablations[layer] = ablate_heads(self.pm, self.examples, ablations, stack=self.stack).double().numpy()
        return self._ablations[layer]

    def reference(self, method: str) -> list[np.ndarray]:
        return [s.double().numpy() for s in self.scores(method).scores]

    def describe(self, i: int) -> dict:
        item = self.items[i]
        return {"id": item.id, "text": item.text}


def _evidence_examples(ctx: _Context, effects: np.ndarray, details: list[dict], secondary=None) -> dict:
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


def _summary(ctx: _Context, values) -> dict:
    j = ctx.judge(values, RULES["specific_tokens"])  # the rule does not matter here: mean and CI only
    return {"mean": j.mean, "ci": list(j.ci), "n": j.n}


def _result(claim, judgement: Judgement, *, measure: str, rule, intervention: str, evidence: dict,
            verdict: str | None = None, n_needed=None, rule_text: str | None = None) -> ClaimResult:
    verdict = verdict or judgement.verdict
    evidence = dict(evidence)
    evidence["std"] = judgement.std
    if verdict == "inconclusive":
        evidence["n_needed"] = judgement.n_needed if n_needed is None else n_needed
    settings = claim.model_dump(mode="json", exclude={"claim", "kind"})
    return ClaimResult(claim=claim.claim, kind=claim.kind, verdict=verdict, effect=judgement.mean, ci=judgement.ci,
                       n=judgement.n, threshold=judgement.threshold, measure=measure, rule=rule_text or rule.describe(),
                       intervention=intervention, evidence=evidence, settings=settings)


# ------------------------------------------------------------------------------------------ kinds


def _agreements(ctx: _Context, claim, index: int, k: int) -> tuple[list[dict], list[dict]]:
    """Per example: agreement of the attention ranking with the reference over the scored tokens."""
    from probe.metrics.agreement import agreement

    attention = ctx.attention_vectors(claim.ranking, index)
    reference = ctx.reference(claim.reference)
    rows, details = [], []
    for i, (x, y) in enumerate(zip(attention, reference)):
        keep = ctx.scorable(i) & np.isfinite(x) & np.isfinite(y)
        n = int(keep.sum())
        if n < 2:
            rows.append({})
            details.append({"n_tokens": n})
            continue
        values = {key: float(v[0]) for key, v in agreement(x[keep], y[keep], k=[1, k]).items()}
        positions = np.flatnonzero(keep)
        texts = ctx.texts(i)
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


def token_importance(ctx: _Context, claim: TokenImportanceClaim, index: int) -> ClaimResult:
    rows, details = _agreements(ctx, claim, index, claim.k)
    top1 = _column(rows, "top1")
    j = ctx.judge(top1, RULES["token_importance"])
    tau = _column(rows, "kendall_tau")
    evidence = {
        "top1_match_rate": j.mean,
        "chance_rate": float(np.nanmean(_column(rows, "chance"))) if j.n else None,
        "kendall_tau": _summary(ctx, tau),
        f"top{claim.k}_overlap": _summary(ctx, _column(rows, f"top{claim.k}")),
        "n_excluded": len(ctx.examples) - j.n,
        **_evidence_examples(ctx, top1, details, secondary=tau),
    }
    return _result(claim, j, measure=f"share of examples whose most-attended token ({claim.attention}) is the most "
                                     f"important one by {claim.reference} (signed: largest drop)",
                   rule=RULES["token_importance"], intervention=f"{claim.reference} (reference)", evidence=evidence)


def faithfulness(ctx: _Context, claim: FaithfulnessClaim, index: int) -> ClaimResult:
    rows, details = _agreements(ctx, claim, index, 3)
    values = _column(rows, claim.measure)
    rule = faithfulness_rule(claim.threshold)
    j = ctx.judge(values, rule)
    evidence = {
        "top1_match_rate": _summary(ctx, _column(rows, "top1")),
        "random_ranking_expectation": 0.0,
        "n_excluded": len(ctx.examples) - j.n,
        **_evidence_examples(ctx, values, details),
    }
    return _result(claim, j, measure=f"{claim.measure} of {claim.attention} with {claim.reference} per example",
                   rule=rule, intervention=f"{claim.reference} (reference)", evidence=evidence)


def _removed(ids: tuple[int, ...], positions, replacement: int | None) -> tuple[int, ...]:
    drop = set(int(p) for p in positions)
    if replacement is None:
        return tuple(t for p, t in enumerate(ids) if p not in drop)
    return tuple(replacement if p in drop else t for p, t in enumerate(ids))


def _replacement(pm, mode: str) -> int | None:
    if mode == "delete":
        return None
    from probe.intervene.tokens import _replacement_id

    return _replacement_id(pm, mode)


def specific_tokens(ctx: _Context, claim: SpecificTokensClaim, index: int) -> ClaimResult:
    from probe.intervene.tokens import example_seed

    matcher = claim.matcher()
    matched = [ctx.matches(i, matcher) for i in range(len(ctx.examples))]
    with_match = [i for i, m in enumerate(matched) if m.any()]
    if not with_match:
        raise InputError(f"{ctx.file.where(index, 'words' if claim.words is not None else 'pattern')}: "
                         f"{claim.matches_what} matches no token in any of the {len(ctx.examples)} examples searched "
                         "(token texts are matched whole, case-insensitive, word-piece markers stripped); "
                         "check the pattern or use more data")
    replacement = _replacement(ctx.pm, claim.intervention)
    attention = ctx.attention_vectors(claim.ranking, index)
    plan = []  # (example, rows of this example: original, matched, random draws..., attention-chosen)
    rows: list = []
    for i in with_match:
        example = ctx.examples[i]
        ids = tuple(int(t) for t in example.input_ids)
        scorable = ctx.scorable(i)
        chosen = np.flatnonzero(matched[i])
        others = np.flatnonzero(scorable & ~matched[i])
        if len(others) < len(chosen):
            continue
        rng = np.random.default_rng(example_seed(ctx.seed, example))
        draws = [np.sort(rng.choice(others, size=len(chosen), replace=False)) for _ in range(claim.repeats)]
        by_attention = others[np.argsort(-attention[i][others], kind="stable")[: len(chosen)]]
        variants = [ids, _removed(ids, chosen, replacement)] + [_removed(ids, d, replacement) for d in draws] \
            + [_removed(ids, by_attention, replacement)]
        plan.append((i, len(rows), chosen, draws, by_attention))
        rows.extend((v, example) for v in variants)
    values = ctx.engine.values(rows, reuse_prefix=ctx.pm.task == "causal_lm").double().numpy() if rows else np.array([])
    n_all = len(ctx.examples)
    effects, versus_attention = np.full(n_all, np.nan), np.full(n_all, np.nan)
    share, uniform = np.full(n_all, np.nan), np.full(n_all, np.nan)
    details: list[dict] = [{} for _ in range(n_all)]
    for i, first, chosen, draws, by_attention in plan:
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
    j = ctx.judge(effects, RULES["specific_tokens"])
    what = {"delete": "deleted", "mask": "replaced by the mask token", "unk": "replaced by the unknown token",
            "pad": "replaced by the pad id (attended)"}[claim.intervention]
    evidence = {
        "matched_minus_attention_chosen": _summary(ctx, versus_attention),
        "abs_change_matched": float(np.nanmean([d.get("abs_change_matched", np.nan) for d in details])) if plan else None,
        "abs_change_random": float(np.nanmean([d.get("abs_change_random", np.nan) for d in details])) if plan else None,
        "attention_share_matched": _summary(ctx, share),
        "uniform_share_matched": float(np.nanmean(uniform)) if plan else None,
        "n_searched": n_all,
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


def head_role(ctx: _Context, claim: HeadRoleClaim, index: int) -> ClaimResult:
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
        second = ctx.judge(excess, RULES["head_role"])
        shares = [d["attention_share_matched"] for d in details if "attention_share_matched" in d]
        uniforms = [d["uniform_share_matched"] for d in details if "uniform_share_matched" in d]
        evidence["ablation_verdict"] = j.verdict
        evidence["attends_to"] = {"pattern": claim.attends_to, "measure": "the head's attention share on matching "
                                  "tokens minus their uniform share", **second.to_dict(),
                                  "attention_share": float(np.mean(shares)) if shares else None,
                                  "uniform_share": float(np.mean(uniforms)) if uniforms else None}
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


def counterfactual(ctx: _Context, claim: CounterfactualClaim, index: int) -> ClaimResult:
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


KINDS = {
    "token_importance": token_importance,
    "faithfulness": faithfulness,
    "specific_tokens": specific_tokens,
    "head_role": head_role,
    "counterfactual": counterfactual,
}


# ------------------------------------------------------------------------------------------ the run


def _check_sites(ctx: _Context) -> None:
    """Refuse layers and heads the model does not have before anything slow runs."""
    for index, claim in enumerate(ctx.file.claims):
        if isinstance(claim, (TokenImportanceClaim, FaithfulnessClaim, SpecificTokensClaim)):
            ctx.check_ranking(claim.ranking, index)
        elif isinstance(claim, HeadRoleClaim):
            layer, head = claim.site
            ctx.layer(layer, index, "head")
            ctx.head(head, index, "head")
        elif isinstance(claim, CounterfactualClaim):
            ctx.layer(claim.layer, index, "layer")
            ctx.head(claim.head, index, "head")
        if isinstance(claim, SpecificTokensClaim) and claim.intervention != "delete":
            _replacement(ctx.pm, claim.intervention)


def _check_target(pm, claim_file: ClaimFile) -> None:
    t = claim_file.target
    if t.choices and pm.task != "causal_lm":
        raise InputError(f"{claim_file.source}: target.choices applies to causal LMs; {pm.name} is a {pm.task} model")
    if t.label == "gold" and pm.task != "classification":
        raise InputError(f"{claim_file.source}: target.label: gold applies to classifiers; {pm.name} is a {pm.task} model")


def run_audit(claim_file: ClaimFile, out_dir: str | Path | None = None, progress: bool = False, *,
              model=None) -> AuditResult:
    """Measure and decide every claim of ``claim_file``; with ``out_dir`` write audit.json/.md/.html there.

    ``model``: an already loaded :class:`~probe.models.loading.ProbeModel` to audit instead of
    loading ``claim_file.model`` (its id is then only reported).
    """
    from probe.study.runner import prepare_study_examples

    started = time.perf_counter()
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    if model is None:
        from probe.models.loading import load_model

        spec = claim_file.model
        log(f"loading {spec.id} ...")
        model = load_model(spec.id, device=spec.device, dtype=spec.dtype,
                           attn_implementation=spec.attn_implementation, task=spec.task,
                           allow_random_weights=spec.allow_random_weights)
    pm = model
    _check_target(pm, claim_file)
    items = select_examples(pm, claim_file)
    study_like = SimpleNamespace(target=claim_file.target)
    gold = [e.label for e in items]
    examples = prepare_study_examples(pm, study_like, [e.text for e in items], gold)
    ctx = _Context(pm, claim_file, items, examples, progress)
    _check_sites(ctx)
    log(f"{len(examples)} examples; {len(claim_file.claims)} claims")
    results = []
    for index, claim in enumerate(claim_file.claims):
        t0 = time.perf_counter()
        result = KINDS[claim.kind](ctx, claim, index)
        result.seconds = time.perf_counter() - t0
        results.append(result)
        log(f"[{index + 1}/{len(claim_file.claims)}] {result.verdict.upper()}: {claim.claim} "
            f"({result.seconds:.1f} s)")
    info = pm.contract.stacks[ctx.stack]
    audit = AuditResult(
        claims=results,
        model={"id": claim_file.model.id, "name": pm.name, "path": pm.path, "task": pm.task, "stack": ctx.stack,
               "layers": info.n_layers, "heads": info.n_heads, "device": str(pm.device), "dtype": pm.contract.dtype,
               "random_weights": list(pm.random_weights), "allow_random_weights": pm.allow_random_weights},
        data={**claim_file.data.model_dump(mode="json", exclude={"texts"}), "n_examples": len(items),
              "ids": [e.id for e in items], "target": claim_file.target.model_dump(mode="json")},
        statistics=claim_file.statistics.model_dump(mode="json"),
        source=claim_file.source, description=claim_file.description, seconds=time.perf_counter() - started)
    if out_dir is not None:
        audit.write(out_dir)
    return audit
