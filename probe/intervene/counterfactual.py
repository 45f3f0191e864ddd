"""Counterfactual attention: replace the target row's attention in one layer (or one head of it).

The *site* is the attention that reads the target (see :mod:`probe.explainers.attention`): the
[CLS]/pooled row of a classifier, the last explained token of a causal LM, the cross-attention rows
of the predicting decoder positions of a seq2seq model. At layer ``layer`` (and head ``head``, or
every head when None) those rows are replaced, everything else is recomputed as usual:

    given         attention supplied by the caller (injecting the original reproduces the output)
    uniform       1/n over the allowed keys (the n explained tokens): mean pooling
    permutation   n seeded permutations of the original row (Jain & Wallace). Only the allowed,
                  non-special keys are shuffled by default: [CLS]/[SEP]/<s> carry large "no-op"
                  mass in transformers (Clark et al. 2019) and moving it onto words would mix that
                  sink effect into the order test; ``permute_special=True`` shuffles them too. One
                  permutation of key positions is applied to every edited head and row.
    adversarial   Jain & Wallace: K candidate attention-logit vectors, Adam, maximise
                  JSD(adversarial, original) while |delta y| <= bound

Reported per example and sample: total variation distance and Jensen-Shannon divergence (natural
log, max ln 2) between the original and counterfactual output distributions (classifier: label
distribution; causal LM: next-token distribution at the target position; seq2seq: the predicting
positions' distributions, divergences averaged over them), the target change original -
counterfactual, and the JSD between the injected and the original attention rows.

Always in eval mode (the model is switched for the duration; captures refuse edits in training).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from probe import registry
from probe.errors import InputError
from probe.hooks.capture import capture_attention
from probe.hooks.types import python_layer
from probe.registry.params import ADVERSARIAL_CONSTRAINTS as CONSTRAINTS
from probe.registry.params import AdversarialParams, PermutedParams, check_params
from probe.rows.forward import build_rows
from probe.rows.frames import grid_frame
from probe.rows.queries import (
    TargetQueries,
    capture_masks,
    eval_mode,
    row_batches,
    target_queries,
)
from probe.rows.target import PreparedExample, RowBatch, target_generator
from probe.rows.values import target_values

if TYPE_CHECKING:
    import pandas as pd

    from probe.models.core import ProbeModel

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Site:
    """Where attention is replaced: the target stack, one layer, some query heads."""

    stack: str
    layer: int
    heads: tuple[int, ...]


def _site(pm: ProbeModel, layer: int, head: int | None) -> Site:
    stack = pm.task.target_stack(pm.contract)
    info = pm.contract.stacks[stack]
    index = python_layer(layer, info.n_layers)
    if index is None:
        raise InputError(f"layer {layer!r} does not exist in the {stack}: it has layers 0..{info.n_layers - 1} "
                         f"(-1 is the last)")
    layer = index
    if head is not None and (not isinstance(head, int) or not 0 <= head < info.n_heads):
        raise InputError(f"head {head!r} does not exist in the {stack}: it has heads 0..{info.n_heads - 1} (or None = "
                         f"all)")
    return Site(stack, layer, tuple(range(info.n_heads)) if head is None else (head,))


@dataclass(repr=False)
class CounterfactualResult:
    """Output change caused by counterfactual attention; ``[example, sample]`` unless stated."""

    method: str
    site: Site
    original_value: torch.Tensor  # [example] target on the unedited input
    counterfactual_value: torch.Tensor  # [example, sample]
    output_tvd: torch.Tensor  # [example, sample]
    output_jsd: torch.Tensor  # [example, sample]
    attention_jsd: torch.Tensor  # [example, sample] JSD(injected, original) over edited heads and rows
    max_attention: torch.Tensor  # [example] largest original weight of the row (mean over edited heads/rows)
    feasible: torch.Tensor | None = None  # adversarial: [example, candidate] a state within the bound was found
    params: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        n, samples = self.output_tvd.shape
        heads = self.site.heads
        where = f"H{heads[0]}" if len(heads) == 1 else f"heads {heads[0]}-{heads[-1]}" if heads else "no head"
        median = float(self.output_tvd.nanmedian()) if self.output_tvd.numel() else float("nan")
        return (f"<CounterfactualResult {self.method} at {self.site.stack} L{self.site.layer} {where}: {n} examples "
                f"x {samples} samples; median output TVD {median:.4g}>")

    @property
    def target_change(self) -> torch.Tensor:
        """[example, sample] original - counterfactual (the sign TokenScores use)."""
        return self.original_value[:, None] - self.counterfactual_value

    def summary(self) -> dict[str, torch.Tensor]:
        """Per-example numbers of the papers: medians over permutations, max JSD over candidates."""
        out = {
            "median_output_tvd": self.output_tvd.nanmedian(dim=1).values,
            "median_abs_target_change": self.target_change.abs().nanmedian(dim=1).values,
            "max_attention": self.max_attention,
        }
        if self.feasible is not None:
            # 0 when no candidate stayed within the bound: the original attention always does
            jsd = torch.where(self.feasible, self.attention_jsd, torch.zeros_like(self.attention_jsd))
            out["max_attention_jsd"] = jsd.max(dim=1).values
        return out

    def to_pandas(self) -> pd.DataFrame:
        """One row per (example, sample): the ``[example, sample]`` fields, ``target_change``, the
        example's ``original_value`` and ``max_attention`` and (adversarial) ``feasible``."""
        extra = {"feasible": self.feasible} if self.feasible is not None else {}
        return grid_frame(("example", "sample"), {
            "original_value": self.original_value[:, None], "counterfactual_value": self.counterfactual_value,
            "target_change": self.target_change, "output_tvd": self.output_tvd, "output_jsd": self.output_jsd,
            "attention_jsd": self.attention_jsd, "max_attention": self.max_attention[:, None], **extra})


# ---------------------------------------------------------------------------
# distributions and divergences
# ---------------------------------------------------------------------------


def output_distributions(batch: RowBatch, tq: TargetQueries, logits: torch.Tensor) -> torch.Tensor:
    """[rows, target rows, classes|vocab] output distribution at the target position(s), fp32."""
    logits = logits.float()
    if logits.dim() == 2:  # classifier: [rows, labels]
        return torch.softmax(logits, dim=-1)[:, None]
    index = tq.rows[:, :, None].expand(-1, -1, logits.shape[-1])
    return torch.softmax(logits.gather(1, index), dim=-1)  # [rows, target rows, vocab]


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance over the last axis."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def _kl_to_mixture(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """KL(p || m) over the last axis where m >= p / 2; terms with p = 0 are 0 *and have gradient 0*
    (xlogy would give 0/0 = NaN gradients at keys both distributions leave empty, e.g. padding)."""
    positive = p > 0
    one = torch.ones((), dtype=p.dtype, device=p.device)
    log_ratio = torch.where(positive, p, one).log() - torch.where(positive, m, one).log()
    return torch.where(positive, p * log_ratio, torch.zeros((), dtype=p.dtype, device=p.device)).sum(dim=-1)


def jsd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence over the last axis, natural log (0 .. ln 2); zeros are fine."""
    m = 0.5 * (p + q)
    return (0.5 * (_kl_to_mixture(p, m) + _kl_to_mixture(q, m))).clamp(min=0.0)


# ---------------------------------------------------------------------------
# running a batch with the target rows replaced
# ---------------------------------------------------------------------------


def _replacing_editor(tq: TargetQueries, heads: tuple[int, ...], new_rows: torch.Tensor):
    """Editor writing ``new_rows`` [batch, edited head, rows, n_keys] into the target rows.

    Keys beyond ``n_keys`` (padding, a causal LM's continuation) get 0. Invalid target rows
    (shorter seq2seq outputs) are left as they are. Out of place, so gradients reach ``new_rows``.
    """
    batch_index, row_index = tq.valid.nonzero(as_tuple=True)  # [N]
    query_index = tq.rows[batch_index, row_index]  # [N]
    head_index = torch.tensor(heads, device=tq.rows.device)

    def edit(weights, context):  # weights [batch, head, query, key]
        width = weights.shape[-1]
        padded = torch.nn.functional.pad(new_rows, (0, width - new_rows.shape[-1]))
        values = padded[batch_index, :, row_index, :].to(weights.dtype)  # [N, edited head, key]
        n = batch_index.shape[0]
        index = (batch_index[:, None].expand(n, len(heads)), head_index[None, :].expand(n, len(heads)),
                 query_index[:, None].expand(n, len(heads)))
        return weights.index_put(index, values)

    return edit


def _forward(pm: ProbeModel, batch: RowBatch, tq: TargetQueries, site: Site, new_rows: torch.Tensor) -> torch.Tensor:
    """Logits with the site's target rows replaced by ``new_rows`` [batch, edited head, rows, n_keys]."""
    editors = {(site.stack, site.layer): _replacing_editor(tq, site.heads, new_rows)}
    with capture_attention(pm, editors=editors, stacks=[site.stack], layers={site.stack: ()},
                           **capture_masks(batch)):
        return pm.model(**batch.inputs).logits


def _row_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[rows, target rows] -> [rows], mean over the valid target rows."""
    weight = valid.to(values.dtype)
    return (values * weight).sum(dim=1) / weight.sum(dim=1).clamp(min=1)


def _attention_jsd(new: torch.Tensor, original: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[rows, head, target rows, key] x2 -> [rows] JSD averaged over heads and valid target rows."""
    return _row_mean(jsd(new, original).mean(dim=1), valid)


@dataclass
class _Original:
    """Unedited numbers of one chunk of examples."""

    value: torch.Tensor  # [batch]
    probs: torch.Tensor  # [batch, target rows, vocab]
    attention: torch.Tensor  # [batch, edited head, target rows, n_keys] at the site


def _original(pm: ProbeModel, batch: RowBatch, tq: TargetQueries, site: Site) -> _Original:
    """One unedited pass: its target values, output distributions and the site's target rows."""
    with torch.no_grad(), capture_attention(pm, queries={site.stack: tq.rows}, stacks=[site.stack],
                                            layers={site.stack: [site.layer]}, **capture_masks(batch)) as capture:
        logits = pm.model(**batch.inputs).logits
    weights = capture.maps(site.stack).weights[:, 0]  # [batch, head, rows, key]
    n_keys = int(tq.lengths.max())
    attention = weights[:, list(site.heads), :, :n_keys]
    return _Original(target_values(pm, batch, logits), output_distributions(batch, tq, logits), attention)


def _expand(pm: ProbeModel, examples: Sequence[PreparedExample], repeats: int) -> tuple[RowBatch, TargetQueries]:
    batch = build_rows(pm, [(e.input_ids, e) for e in examples for _ in range(repeats)])
    return batch, target_queries(pm, batch)


def _key_mask(tq: TargetQueries, n_keys: int) -> torch.Tensor:
    """[rows, 1, 1, n_keys] bool: the explained tokens (= the allowed keys of a target row)."""
    keys = torch.arange(n_keys, device=tq.lengths.device)
    return (keys[None, :] < tq.lengths[:, None])[:, None, None, :]


def _max_attention(original: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return _row_mean(original.max(dim=-1).values.mean(dim=1), valid)


def _run_samples(pm: ProbeModel, examples: Sequence[PreparedExample], site: Site, make_rows, n_samples: int, *,
                 batch_size: int, method: str, params: dict) -> CounterfactualResult:
    """Shared driver: ``make_rows(first index, examples, original, tq) -> [chunk * n_samples, head, rows, n_keys]``."""
    columns: dict[str, list[torch.Tensor]] = {k: [] for k in ("orig", "value", "tvd", "jsd", "ajsd", "max")}
    per_chunk = max(1, batch_size // n_samples)  # examples per pass; batch_size counts model rows
    with eval_mode(pm.model):
        first = 0
        for batch, tq in row_batches(pm, examples, per_chunk):
            chunk = batch.examples
            original = _original(pm, batch, tq, site)
            new = make_rows(first, chunk, original, tq)  # [chunk * samples, head, rows, n_keys]
            first += len(chunk)
            big, big_tq = _expand(pm, chunk, n_samples)
            with torch.no_grad():
                logits = _forward(pm, big, big_tq, site, new)
            probs = output_distributions(big, big_tq, logits)
            reference = original.probs.repeat_interleave(n_samples, dim=0)
            columns["orig"].append(original.value.cpu())
            columns["value"].append(target_values(pm, big, logits).view(-1, n_samples).cpu())
            columns["tvd"].append(_row_mean(tvd(probs, reference), big_tq.valid).view(-1, n_samples).cpu())
            columns["jsd"].append(_row_mean(jsd(probs, reference), big_tq.valid).view(-1, n_samples).cpu())
            ajsd = _attention_jsd(new, original.attention.repeat_interleave(n_samples, dim=0), big_tq.valid)
            columns["ajsd"].append(ajsd.view(-1, n_samples).cpu())
            columns["max"].append(_max_attention(original.attention, tq.valid).cpu())
    cat = {k: torch.cat(v) for k, v in columns.items()}
    return CounterfactualResult(
        method=method, site=site, original_value=cat["orig"], counterfactual_value=cat["value"],
        output_tvd=cat["tvd"], output_jsd=cat["jsd"], attention_jsd=cat["ajsd"], max_attention=cat["max"],
        params={"stack": site.stack, "layer": site.layer, "heads": list(site.heads),
                "divergence_log": "natural", **params})


# ---------------------------------------------------------------------------
# the counterfactuals
# ---------------------------------------------------------------------------


def original_attention(pm: ProbeModel, examples: Sequence[PreparedExample], *, layer: int, head: int | None = None,
                       batch_size: int = 16) -> list[torch.Tensor]:
    """The site's original target rows per example: [edited head, target rows, tokens]."""
    site = _site(pm, layer, head)
    out = []
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            attention = _original(pm, batch, tq, site).attention  # [batch, head, rows, n_keys]
            for i, n in enumerate(tq.lengths.tolist()):
                out.append(attention[i][:, tq.valid[i], :n].cpu())
    return out


def replace_attention(pm: ProbeModel, examples: Sequence[PreparedExample], rows: Sequence[torch.Tensor], *, layer: int,
                      head: int | None = None, batch_size: int = 16) -> CounterfactualResult:
    """Inject given attention: ``rows[i]`` is [edited head, target rows, tokens] for example i
    (the layout :func:`original_attention` returns; one head when ``head`` is given)."""
    site = _site(pm, layer, head)
    if len(rows) != len(examples):
        raise InputError(f"{len(rows)} attention rows given for {len(examples)} examples: give one per example")
    def make_rows(first, chunk, original, tq):
        new = torch.zeros_like(original.attention)  # [batch, head, rows, n_keys]
        for b in range(len(chunk)):
            given = torch.as_tensor(rows[first + b], dtype=new.dtype, device=new.device)
            n_rows, n = int(tq.valid[b].sum()), int(tq.lengths[b])
            if given.shape != (len(site.heads), n_rows, n):
                raise InputError(f"attention for example {first + b} has shape {tuple(given.shape)}; "
                                 f"expected (heads, rows, tokens) = {(len(site.heads), n_rows, n)}")
            new[b][:, tq.valid[b], :n] = given
        return new

    return _run_samples(pm, examples, site, make_rows, 1, batch_size=batch_size, method="given", params={})


def uniform_attention(pm: ProbeModel, examples: Sequence[PreparedExample], *, layer: int, head: int | None = None,
                      batch_size: int = 16) -> CounterfactualResult:
    """Uniform attention over the allowed keys (the explained tokens) at the target rows."""
    site = _site(pm, layer, head)

    def make_rows(first, chunk, original, tq):
        allowed = _key_mask(tq, original.attention.shape[-1]).float()  # [batch, 1, 1, n_keys]
        return (allowed / allowed.sum(-1, keepdim=True)).expand_as(original.attention).contiguous()

    return _run_samples(pm, examples, site, make_rows, 1, batch_size=batch_size, method="uniform",
                        params={"over": "allowed keys (explained tokens, specials included)"})


def permutation_order(example: PreparedExample, n: int, seed: int, permute_special: bool) -> torch.Tensor:
    """[n, tokens] long: key order of each permutation; positions not permuted map to themselves.

    Seeded by the example's content (not its place in the batch), so results are reproducible and
    batch 1 and batch N agree. Fewer than two permutable keys -> the identity.
    """
    length = len(example.input_ids)
    movable = torch.tensor([t for t in range(length) if permute_special or not example.special[t]], dtype=torch.long)
    generator = target_generator(seed, example)
    orders = torch.arange(length).repeat(n, 1)
    for k in range(n):
        if movable.numel() > 1:
            orders[k, movable] = movable[torch.randperm(movable.numel(), generator=generator)]
    return orders


def permuted_attention(pm: ProbeModel, examples: Sequence[PreparedExample], *, layer: int, head: int | None = None,
                       n: int = 100, seed: int = 0, permute_special: bool = False,
                       batch_size: int = 64) -> CounterfactualResult:
    """``n`` seeded permutations of the original target rows (Jain & Wallace): [example, n] results.

    ``summary()['median_output_tvd']`` is their per-instance median |delta y|.
    """
    site = _site(pm, layer, head)
    if not isinstance(n, int) or n < 1:
        raise InputError(f"number of permutations must be a positive integer, got {n!r}")
    check_params(PermutedParams, "permuted", n=n)

    def make_rows(first, chunk, original, tq):
        out = []
        for b, example in enumerate(chunk):
            length = int(tq.lengths[b])
            orders = permutation_order(example, n, seed, permute_special).to(original.attention.device)
            row = original.attention[b]  # [head, rows, n_keys]
            for k in range(n):
                permuted = row.clone()
                permuted[..., :length] = row[..., orders[k]]
                out.append(permuted)
        return torch.stack(out)  # [chunk * n, head, rows, n_keys]

    return _run_samples(pm, examples, site, make_rows, n, batch_size=batch_size, method="permutation",
                        params={"n": n, "seed": seed, "permute_special": permute_special,
                                "seeding": "per example content (crc32 of ids, target) + seed"})


_ADV = registry.AdversarialParams  # the registered defaults (probe.registry), one place for them


def adversarial_attention(pm: ProbeModel, examples: Sequence[PreparedExample], *, layer: int, head: int | None = _ADV.head,
                          candidates: int = _ADV.candidates, steps: int = _ADV.steps, lr: float = _ADV.lr,
                          bound: float = _ADV.bound, constraint: str = _ADV.constraint, penalty: float = _ADV.penalty,
                          init_scale: float = _ADV.init_scale, seed: int = _ADV.seed,
                          batch_size: int = _ADV.batch_size) -> CounterfactualResult:
    """Adversarial attention (Jain & Wallace 2019): per example ``candidates`` attention-logit vectors
    optimised with Adam (``lr``, up to ``steps`` steps) to maximise JSD(adversarial, original) while
    |delta y| <= ``bound``.

    |delta y| is the output TVD (``constraint="tvd"``, their definition; for a binary classifier it
    is |delta p|) or |target change| (``constraint="target"``). The bound enters the loss as a hinge
    penalty, -JSD + penalty * max(0, |delta y| - bound); every step's forward pass checks the bound
    exactly and each candidate keeps its best *feasible* state, so reported results always satisfy
    it, whatever the penalty weight; a candidate that never was within the bound reports NaN and
    ``feasible`` False. Candidates start at the original logits plus N(0, init_scale^2) noise seeded
    by the example's content (not at the original itself: there the JSD gradient is exactly 0).
    Stops early once every candidate is within 1e-4 of ln 2. ``summary()['max_attention_jsd']`` is
    their per-instance max JSD over feasible candidates, 0 when none was (the original attention
    itself is always within the bound).
    """
    site = _site(pm, layer, head)
    if constraint not in CONSTRAINTS:
        raise InputError(f"unknown adversarial constraint {constraint!r}: use one of {', '.join(CONSTRAINTS)}")
    if candidates < 1 or steps < 0 or bound < 0 or lr <= 0:
        raise InputError("adversarial attention needs candidates >= 1, steps >= 0, bound >= 0 and lr > 0")
    check_params(AdversarialParams, "adversarial", candidates=candidates, steps=steps)
    opts = _ADV(head=head, candidates=candidates, steps=steps, lr=lr, bound=bound, constraint=constraint,
                penalty=penalty, init_scale=init_scale, seed=seed, batch_size=batch_size)
    columns: dict[str, list[torch.Tensor]] = {k: [] for k in ("orig", "value", "tvd", "jsd", "ajsd", "max", "ok")}
    used_steps = []
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            original = _original(pm, batch, tq, site)
            best, step = _adversarial_search(pm, batch.examples, tq, site, original, opts)
            used_steps.append(step)
            found = best["ajsd"] >= 0
            columns["orig"].append(original.value.detach().cpu())
            for key in ("value", "tvd", "jsd"):
                columns[key].append(best[key].view(-1, candidates))
            columns["ajsd"].append(torch.where(found, best["ajsd"], torch.full_like(best["ajsd"], float("nan")))
                                   .view(-1, candidates))
            columns["ok"].append(found.view(-1, candidates))
            columns["max"].append(_max_attention(original.attention, tq.valid).cpu())
    cat = {k: torch.cat(v) for k, v in columns.items()}
    return CounterfactualResult(
        method="adversarial", site=site, original_value=cat["orig"], counterfactual_value=cat["value"],
        output_tvd=cat["tvd"], output_jsd=cat["jsd"], attention_jsd=cat["ajsd"], max_attention=cat["max"],
        feasible=cat["ok"],
        params={"stack": site.stack, "layer": site.layer, "heads": list(site.heads), "divergence_log": "natural",
                "candidates": candidates, "steps": steps, "steps_run": used_steps, "lr": lr, "bound": bound,
                "constraint": constraint, "penalty": penalty, "init_scale": init_scale, "seed": seed,
                "bound_handling": "hinge penalty in the loss; only states verified within the bound are reported"})


def _adversarial_start(chunk: Sequence[PreparedExample], tq: TargetQueries, reference_attention: torch.Tensor,
                       allowed: torch.Tensor, opts: registry.AdversarialParams) -> torch.Tensor:
    """The candidates' starting attention logits [rows, head, R, n_keys]: the original's plus
    seeded noise, each example's own draws over its own target rows and keys, so its start does not
    depend on how wide the batch it shares is padded."""
    candidates = opts.candidates
    start = torch.log(reference_attention.clamp(min=1e-12))
    noise = torch.zeros((len(chunk) * candidates,) + tuple(start.shape[1:]))  # [rows, head, R, n_keys]
    for i, example in enumerate(chunk):
        generator = target_generator(opts.seed, example)
        n_rows, n_keys = int(tq.valid[i].sum()), int(tq.lengths[i])
        noise[i * candidates:(i + 1) * candidates, :, :n_rows, :n_keys] = torch.randn(
            (candidates, start.shape[1], n_rows, n_keys), generator=generator) * opts.init_scale
    return (start + noise.to(start.device)).masked_fill(~allowed, 0.0).requires_grad_(True)


def _adversarial_search(pm: ProbeModel, chunk: Sequence[PreparedExample], tq: TargetQueries, site: Site,
                        original: _Original, opts: registry.AdversarialParams) -> tuple[dict[str, torch.Tensor], int]:
    """Adam on one chunk's candidates: each candidate's best feasible state (``ajsd`` -1 where none
    was feasible) [rows] per key, and the last step run."""
    candidates = opts.candidates
    big, big_tq = _expand(pm, chunk, candidates)
    reference_attention = original.attention.repeat_interleave(candidates, dim=0)  # [rows, head, R, n_keys]
    reference_probs = original.probs.repeat_interleave(candidates, dim=0)
    reference_value = original.value.repeat_interleave(candidates, dim=0)
    allowed = _key_mask(big_tq, reference_attention.shape[-1])  # [rows, 1, 1, n_keys]
    logits_param = _adversarial_start(chunk, tq, reference_attention, allowed, opts)
    optimiser = torch.optim.Adam([logits_param], lr=opts.lr)
    n_rows = logits_param.shape[0]
    best = {"ajsd": torch.full((n_rows,), -1.0), "value": torch.full((n_rows,), float("nan")),
            "tvd": torch.full((n_rows,), float("nan")), "jsd": torch.full((n_rows,), float("nan"))}
    step = 0
    for step in range(opts.steps + 1):
        with torch.enable_grad():
            scores = logits_param.masked_fill(~allowed, torch.finfo(logits_param.dtype).min)
            adversary = torch.softmax(scores, dim=-1) * allowed  # [rows, head, R, n_keys]
            logits = _forward(pm, big, big_tq, site, adversary)
            probs = output_distributions(big, big_tq, logits)
            values = target_values(pm, big, logits)
            out_tvd = _row_mean(tvd(probs, reference_probs), big_tq.valid)
            delta = out_tvd if opts.constraint == "tvd" else (values - reference_value).abs()
            attention_jsd = _attention_jsd(adversary, reference_attention, big_tq.valid)
        with torch.no_grad():
            feasible = (delta <= opts.bound).cpu()
            better = feasible & (attention_jsd.detach().cpu() > best["ajsd"])
            best["ajsd"] = torch.where(better, attention_jsd.detach().cpu(), best["ajsd"])
            best["value"] = torch.where(better, values.detach().cpu(), best["value"])
            best["tvd"] = torch.where(better, out_tvd.detach().cpu(), best["tvd"])
            out_jsd = _row_mean(jsd(probs.detach(), reference_probs), big_tq.valid).cpu()
            best["jsd"] = torch.where(better, out_jsd, best["jsd"])
        if step == opts.steps or bool((best["ajsd"] >= LN2 - 1e-4).all()):
            break
        loss = (-attention_jsd + opts.penalty * torch.relu(delta - opts.bound)).sum()
        (grad,) = torch.autograd.grad(loss, logits_param)
        optimiser.zero_grad(set_to_none=True)
        logits_param.grad = grad
        optimiser.step()
    return best, step

__all__ = [
    "CounterfactualResult", "Site", "adversarial_attention", "jsd", "original_attention",
    "output_distributions", "permutation_order", "permuted_attention", "replace_attention", "tvd",
    "uniform_attention",
]
