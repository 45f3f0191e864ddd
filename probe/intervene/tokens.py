"""Leave-one-out references: the change of the target when one token is removed or replaced.

For every non-special token ``t`` of an example, ``score[t] = f(x) - f(x with t perturbed)``
(signed: positive means the token supports the target). Special tokens are not scored (NaN).
Tokens are perturbed as *ids*, never by editing text and re-tokenising (which shifts token
boundaries; see PROTOCOLS.md, "Lessons").

Modes (method name ``loo_<mode>``), an experimental factor to report, not a hidden default:

========  =====================================================================================
delete    the token is removed: the sequence is one shorter (Jain & Wallace's LOO)
mask      replaced by the tokenizer's mask token (models without one: use another mode)
unk       replaced by the unknown token (Abnar & Zuidema's "blank-out")
pad       replaced by the pad id. The attention mask stays 1 there: the pad *embedding* is
          attended to like any token. This is a replacement baseline, not a removal (masking the
          position out would be a deletion that keeps the position ids; use ``delete`` for removal)
random    replaced by ``k`` ids drawn uniformly from the vocabulary (special ids and the original
          token excluded), seeded; the score averages f over the draws
lm        replaced by ``k`` draws from the causal LM's own next-token distribution at that
          position (special ids and the original token excluded, renormalised), seeded; averaged.
          Needs a causal LM: masked-LM heads are not loaded by probe, and a classifier has no
          language-model head sharing its tokenizer
========  =====================================================================================

Random draws are seeded per example from ``(seed, the example's ids)``, so an example gets the same
draws whether it is scored alone or in a batch, and in any order.

All rows of all examples go to the engine in one call; for causal LMs the engine reuses each
example's unchanged prefix (every LOO row shares the original up to the perturbed position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe.errors import InputError
from probe.intervene.engine import Engine
from probe.registry.params import LeaveOneOutParams, check_params
from probe.rows.queries import eval_mode
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, example_generator, example_seed

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

LOO_MODES = ("delete", "mask", "unk", "pad", "random", "lm")
#: Draws per position for the sampling modes (random, lm).
DEFAULT_DRAWS = 8
#: loo_lm holds the logits of one batch of original inputs, [rows, tokens, vocab]: at most this
#: many floats (256 MiB in fp32), whatever the token budget.
LM_LOGITS_FLOATS = 2**26


def scorable_positions(example: PreparedExample) -> list[int]:
    return [t for t, special in enumerate(example.special) if not special]


def replacement_token_id(pm: ProbeModel, mode: str) -> int:
    tok = pm.tokenizer
    others = ", ".join(m for m in LOO_MODES if m != mode and (m != "lm" or pm.task.next_token))
    attribute = {"mask": "mask_token_id", "unk": "unk_token_id", "pad": "pad_token_id"}[mode]
    token_id = getattr(tok, attribute, None)
    if token_id is None:
        raise InputError(
            f"loo_{mode} needs a {mode} token, and the tokenizer of {pm.name!r} has none: "
            f"use another leave-one-out mode ({others})"
        )
    return int(token_id)


def _vocabulary_candidates(pm: ProbeModel) -> np.ndarray:
    """Ids a random replacement may take: the tokenizer's ids the model can embed, specials excluded."""
    size = min(len(pm.tokenizer), int(pm.model.get_input_embeddings().weight.shape[0]))
    special = np.asarray(sorted(set(pm.tokenizer.all_special_ids or [])), dtype=np.int64)
    candidates = np.setdiff1d(np.arange(size, dtype=np.int64), special)
    if len(candidates) < 2:
        raise InputError(f"loo_random needs at least two non-special ids in the vocabulary of {pm.name!r}")
    return candidates


def _random_draws(candidates: np.ndarray, original: int, k: int, rng: np.random.Generator) -> list[int]:
    """``k`` uniform draws from ``candidates`` without ``original`` (with replacement)."""
    where = int(np.searchsorted(candidates, original))
    present = where < len(candidates) and candidates[where] == original
    pool = len(candidates) - int(present)
    draws = rng.integers(0, pool, size=k)
    if present:
        draws = draws + (draws >= where)  # skip over the original's slot
    return [int(candidates[d]) for d in draws]


def _lm_draws(engine: Engine, examples: Sequence[PreparedExample], k: int, seed: int) -> list[dict[int, list[int]]]:
    """Per example ``{position: k ids}`` drawn from the causal LM's next-token distribution.

    The distribution at position ``t`` is the model's prediction after ``ids[:t]``. When the first
    token is scorable (no BOS, e.g. GPT-2), the BOS/EOS id is put in front so position 0 has a
    context; the replacement itself never includes special ids or the original token.
    """
    pm = engine.pm
    tok = pm.tokenizer
    lead = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    special = torch.tensor(sorted(set(tok.all_special_ids or [])), dtype=torch.long)
    contexts, offsets = [], []
    for example in examples:
        needs_lead = bool(scorable_positions(example)) and not example.special[0]
        if needs_lead and lead is None:
            raise InputError(
                f"loo_lm cannot propose a token for position 0 of {example.text[:40]!r}: the tokenizer of "
                f"{pm.name!r} has no BOS or EOS token to start from; use another mode ({', '.join(LOO_MODES[:-1])})")
        contexts.append(([lead] if needs_lead else []) + list(example.input_ids))
        offsets.append(1 if needs_lead else 0)
    # budgeted batches of original sequences; sampling happens per batch so that the
    # [rows, tokens, vocab] logits of all examples are never held at once
    order = sorted(range(len(examples)), key=lambda i: len(contexts[i]))
    out: list[dict[int, list[int]]] = [dict() for _ in examples]
    vocab = int(pm.model.get_output_embeddings().weight.shape[0]) if pm.model.get_output_embeddings() is not None \
        else int(pm.model.config.vocab_size)
    max_tokens = max(1, min(engine.token_budget, LM_LOGITS_FLOATS // max(1, vocab)))
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * len(contexts[order[stop]]) <= max_tokens:
            stop += 1
        chunk = order[start:stop]
        width = len(contexts[chunk[-1]])
        input_ids = torch.full((len(chunk), width), tok.pad_token_id or 0, dtype=torch.long)  # [rows, width]
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [rows, width]
        for r, i in enumerate(chunk):
            input_ids[r, : len(contexts[i])] = torch.tensor(contexts[i])
            attention_mask[r, : len(contexts[i])] = 1
        with eval_mode(pm.model, grad=False):
            logits = pm.model(input_ids=input_ids.to(pm.device), attention_mask=attention_mask.to(pm.device),
                              use_cache=False).logits.float().cpu()  # [rows, width, vocab]
        engine.stats.forward_passes += 1
        engine.stats.padded_tokens += int(input_ids.numel())
        for r, i in enumerate(chunk):
            example = examples[i]
            generator = example_generator(seed, example)
            for t in scorable_positions(example):
                # logits at context position (t + offset - 1) predict the token at t
                probs = torch.softmax(logits[r, t + offsets[i] - 1].double(), dim=-1)  # [vocab]
                probs[special[special < probs.numel()]] = 0.0
                probs[example.input_ids[t]] = 0.0
                if float(probs.sum()) <= 0:
                    continue  # nothing plausible left: the position stays unscored (NaN)
                out[i][t] = torch.multinomial(probs / probs.sum(), k, replacement=True, generator=generator).tolist()
        start = stop
    return out


@dataclass(frozen=True)
class _Replacements:
    """What a leave-one-out mode puts in a token's place (nothing for ``delete``)."""

    mode: str
    k: int = 0  # draws per position (random)
    token_id: int | None = None  # mask, unk, pad
    candidates: np.ndarray | None = None  # random: the vocabulary it draws from
    lm_draws: list[dict[int, list[int]]] | None = None  # lm: per example {position: ids}

    def ids(self, i: int, original: int, t: int, rng: np.random.Generator | None) -> list[int]:
        """The ids that replace token ``t`` (id ``original``) of example ``i``."""
        if self.token_id is not None:
            return [self.token_id]
        if self.mode == "random":
            return _random_draws(self.candidates, original, self.k, rng)
        return self.lm_draws[i].get(t, [])


def loo(engine: Engine, examples: Sequence[PreparedExample], mode: str = "delete", *,
        k: int = DEFAULT_DRAWS, seed: int = 0) -> TokenScores:
    """Leave-one-out scores ``[tokens]`` per example: ``f(x) - f(x with the token deleted/replaced)``.

    ``k`` and ``seed`` apply to the sampling modes (random, lm). Special tokens get NaN.
    """
    params, replacements = _loo_setup(engine, examples, mode, k, seed)
    rows, spans, originals = _loo_rows(examples, replacements, seed)

    before = engine.stats.as_dict()
    values = engine.values(rows, reuse_prefix=engine.pm.task.next_token).double()  # [rows]
    after = engine.stats.as_dict()

    scores = [torch.full((len(e.input_ids),), float("nan"), dtype=torch.float64) for e in examples]
    for i, t, first, n in spans:
        scores[i][t] = values[originals[i]] - values[first:first + n].mean()
    extras = {
        "rows": len(rows),
        "rows_evaluated": after["rows_evaluated"] - before["rows_evaluated"],
        "forward_passes": after["forward_passes"] - before["forward_passes"],
        "original_values": values[originals].tolist(),
    }
    return TokenScores(method=f"loo_{mode}", scores=scores, params=params, extras=extras)


def _loo_setup(engine: Engine, examples: Sequence[PreparedExample], mode: str, k: int,
               seed: int) -> tuple[dict, _Replacements]:
    """The checked mode's parameters (as the scores record them) and its replacements; the lm
    mode draws its replacements here (one pass over the originals)."""
    if mode not in LOO_MODES:
        raise InputError(f"unknown leave-one-out mode {mode!r}: use one of {', '.join(LOO_MODES)}")
    pm = engine.pm
    params: dict = {"mode": mode}
    if mode in ("random", "lm"):
        if int(k) < 1:
            raise InputError(f"loo_{mode} needs k >= 1 draws per token, got {k!r}")
        check_params(LeaveOneOutParams, f"loo_{mode}", k=k)
        params.update(k=int(k), seed=int(seed))
    if mode == "lm" and not pm.task.next_token:
        raise InputError(
            f"loo_lm needs a masked or causal language model sharing the tokenizer, and {pm.name!r} is a "
            f"{pm.task} model without one: use loo_delete, loo_mask, loo_unk, loo_pad or loo_random")
    if mode in ("mask", "unk", "pad"):
        replacement = replacement_token_id(pm, mode)
        params["replacement_id"] = replacement
        params["replacement_token"] = pm.tokenizer.convert_ids_to_tokens(replacement)
        if mode == "pad":
            params["pad_attended"] = True  # the pad id is attended to (mask 1): a replacement, not a removal
        return params, _Replacements(mode, token_id=replacement)
    if mode == "random":
        return params, _Replacements(mode, k=int(k), candidates=_vocabulary_candidates(pm))
    if mode == "lm":
        return params, _Replacements(mode, lm_draws=_lm_draws(engine, examples, int(k), int(seed)))
    return params, _Replacements(mode)


def _loo_rows(examples: Sequence[PreparedExample], replacements: _Replacements,
              seed: int) -> tuple[list[tuple[tuple[int, ...], PreparedExample]], list[tuple[int, int, int, int]], list[int]]:
    """Every row: each example's original (its index in ``originals``) followed by its perturbed
    rows; ``spans`` holds ``(example index, position, first row, number of rows)`` per scored token."""
    rows: list[tuple[tuple[int, ...], PreparedExample]] = []
    spans: list[tuple[int, int, int, int]] = []
    originals: list[int] = []
    for i, example in enumerate(examples):
        ids = tuple(int(x) for x in example.input_ids)
        originals.append(len(rows))
        rows.append((ids, example))
        rng = np.random.default_rng(example_seed(seed, example)) if replacements.mode == "random" else None
        for t in scorable_positions(example):
            if replacements.mode == "delete":
                variants = [ids[:t] + ids[t + 1:]]
            else:
                variants = [ids[:t] + (d,) + ids[t + 1:] for d in replacements.ids(i, ids[t], t, rng)]
            if variants:
                spans.append((i, t, len(rows), len(variants)))
                rows.extend((v, example) for v in variants)
    return rows, spans, originals
