"""Planted recipes of trained copy models: copy-lm and copy-lm-cue (a one-layer GPT-2 whose next token
copies the marked word of the prompt) and copy-seq2seq (a 1+1-layer T5 that outputs the marked source
word, then EOS).

Each trains (seeded) on the copy texts with a share of unmarked ones, then measures its truth with plain
forwards; the table that names them is in :mod:`probe.models.planted`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from probe.data.planted_texts import FILLER, PlantedText, study_texts, training_texts
from probe.models.planted_parts import (
    MAX_POSITIONS,
    SEED,
    pad_rows,
    require_fact,
    token_ids,
    true_share,
    word_tokenizer,
)

if TYPE_CHECKING:  # imported for annotations only
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, T5ForConditionalGeneration

# ----------------------------------------------------------------------------------------- copy-lm


@dataclass(frozen=True)
class CopyTraining:
    seed: int = SEED
    layers: int = 1
    heads: int = 2
    hidden: int = 32
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    n_train: int = 2048


COPY_LM = CopyTraining()
COPY_SEQ2SEQ = CopyTraining(steps=300)
#: copy-seq2seq: weight of the auxiliary loss -log(cross-attention on the marked word), at both output
#: positions. Without it the </s> position's cross-attention is diffuse and the output-mean peaks
#: elsewhere on ~6% of the texts; the planted truth is about the attention probe reads (that mean).
ATTENTION_LOSS_WEIGHT = 0.1


#: share of the copy models' training texts whose marked word is replaced by a filler word
UNMARKED_SHARE = 0.25


def _with_unmarked(texts: list[PlantedText], seed: int) -> list[PlantedText]:
    """``texts`` with every 4th one's marked word replaced by a filler word (answer None): trained to
    output end-of-sequence, so that deleting the marked word removes the answer instead of leaving
    the model to guess one."""
    import random

    rng = random.Random(seed)
    step = round(1 / UNMARKED_SHARE)
    out = []
    for i, t in enumerate(texts):
        if i % step == step - 1:
            words = [rng.choice(FILLER) if w == t.answer else w for w in t.text.split()]
            t = PlantedText(" ".join(words), None, None)
        out.append(t)
    return out


def build_copy_lm(cue: str | None = None) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast, dict[str, Any]]:
    """copy-lm; with ``cue``, copy-lm-cue: every prompt (training and study) ends with the word ``cue``,
    and deletion (the recipe's and the study's) removes text words only, never the cue."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    name = "copy-lm-cue" if cue else "copy-lm"
    suffix = f" {cue}" if cue else ""
    settings = COPY_LM
    tokenizer = word_tokenizer("gpt2")
    eos = tokenizer.eos_token_id
    config = GPT2Config(  # type: ignore[call-arg]  # PretrainedConfig's kwargs
        vocab_size=len(tokenizer), n_positions=MAX_POSITIONS, n_embd=settings.hidden, n_layer=settings.layers,
        n_head=settings.heads, n_inner=2 * settings.hidden, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, attn_implementation="eager",
    )
    torch.manual_seed(settings.seed)
    model = GPT2LMHeadModel(config)
    seconds = _train_copy_lm(model, tokenizer, settings, suffix)
    facts = _copy_lm_facts(model, tokenizer, name, cue, settings.layers)
    training = {**asdict(settings), "train_seconds": round(seconds, 2)}
    return model, tokenizer, {"training": training, "facts": facts}


def _train_copy_lm(model, tokenizer, settings: CopyTraining, suffix: str) -> float:
    """Train copy-lm (seeded) to continue each prompt (``suffix`` appended) with its marked word, or
    with end-of-text where it has none; leaves the model in eval mode. Returns the seconds taken."""
    import torch

    eos = tokenizer.eos_token_id
    train = _with_unmarked(training_texts("copy", settings.n_train, seed=settings.seed), settings.seed)
    prompts = [token_ids(tokenizer, t.text + suffix) for t in train]
    answers = torch.tensor([tokenizer.convert_tokens_to_ids(t.answer) if t.answer else eos
                            for t in train])  # [example] a prompt without a marked word continues with eos
    ids, mask = pad_rows(prompts, eos)  # [example, seq]
    last = mask.sum(-1) - 1  # [example] the position that predicts the answer
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    started = time.perf_counter()
    model.train()
    for _step in range(settings.steps):
        rows = torch.randint(0, len(train), (settings.batch_size,), generator=generator)  # [batch]
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits  # [batch, seq, vocab]
        loss = torch.nn.functional.cross_entropy(logits[torch.arange(len(rows)), last[rows]], answers[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return time.perf_counter() - started


def _copy_lm_forward(model, rows: list[list[int]], kept: int, eos: int):
    """One forward of the study prompts ``rows`` and of each with one word deleted (the last ``kept``
    tokens never): the next-token log-probs at each row's last position ``[row, vocab]``, the
    attention ``[row, layer, head, query, key]`` and each row's last position."""
    import torch

    deleted = [[r[:t] + r[t + 1:] for t in range(len(r) - kept)] for r in rows]
    flat = rows + [d for ds in deleted for d in ds]
    ids, mask = pad_rows(flat, eos)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    last = mask.sum(-1) - 1  # [row]
    logprobs = out.logits.double().log_softmax(-1)[torch.arange(len(flat)), last]  # [row, vocab]
    attention = torch.stack(out.attentions, dim=1)  # [row, layer, head, query, key]
    return logprobs, attention, last


def _copy_lm_facts(model, tokenizer, name: str, cue: str | None, layers: int) -> dict:
    """copy-lm's (or copy-lm-cue's) measured facts on its study texts, each required of it."""
    suffix = f" {cue}" if cue else ""
    study = study_texts(name)
    rows = [token_ids(tokenizer, t.text + suffix) for t in study]
    kept = 1 if cue else 0  # the cue is never deleted
    logprobs, attention, last = _copy_lm_forward(model, rows, kept, tokenizer.eos_token_id)
    n = len(rows)
    greedy = logprobs[:n].argmax(-1)  # [example]
    correct, top_attended, top_loo, marked_mass, loo_marked, loo_other, top_rollout = [], [], [], [], [], [], []
    first = n
    for i, (t, r) in enumerate(zip(study, rows)):
        place = t.text.split().index(t.answer)
        correct.append(tokenizer.convert_ids_to_tokens(int(greedy[i])) == t.answer)
        row = attention[i, -1, :, last[i], :len(r)].mean(0)  # [key] last layer, head mean, last position
        top_attended.append(int(row.argmax()) == place)
        marked_mass.append(float(row[place]))
        effect = logprobs[i, greedy[i]] - logprobs[first:first + len(r) - kept, greedy[i]]  # [word]
        top_loo.append(int(effect.argmax()) == place)
        loo_marked.append(float(effect[place]))
        loo_other += [abs(float(e)) for j, e in enumerate(effect) if j != place]
        if cue:  # rollout at the cue, from the same attention: 0.5 A + 0.5 I, the cue's share left out
            words = len(r) - kept
            rolled = (0.5 * attention[i, -1, :, last[i], :len(r)].mean(0))[:words]
            top_rollout.append(int(rolled.argmax()) == place)
        first += len(r) - kept
    facts = {
        "study_examples": n,
        "greedy_accuracy": true_share(correct),
        "attention_layer": layers - 1,
        "top_attended_is_marked": true_share(top_attended),
        "marked_attention_mean": round(sum(marked_mass) / n, 4),
        "top_loo_is_marked": true_share(top_loo),
        "marked_loo_min": min(loo_marked),
        "other_abs_loo_max": max(loo_other),
    }
    if cue:
        facts["cue"] = cue
        facts["top_rollout_is_marked"] = true_share(top_rollout)
    require_fact(facts["greedy_accuracy"] == 1.0, name, f"greedy accuracy {facts['greedy_accuracy']}")
    require_fact(facts["top_attended_is_marked"] >= 0.95, name,
                 f"attention peaks on the marked word on {facts['top_attended_is_marked']} of the prompts")
    return facts


# ------------------------------------------------------------------------------------ copy-seq2seq


def build_copy_seq2seq() -> tuple[T5ForConditionalGeneration, PreTrainedTokenizerFast, dict[str, Any]]:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    settings = COPY_SEQ2SEQ
    tokenizer = word_tokenizer("t5")
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = T5Config(  # type: ignore[call-arg]  # PretrainedConfig's kwargs
        vocab_size=len(tokenizer), d_model=settings.hidden, d_kv=settings.hidden // settings.heads,
        d_ff=2 * settings.hidden, num_layers=settings.layers, num_decoder_layers=settings.layers,
        num_heads=settings.heads, dropout_rate=0.0, pad_token_id=pad, eos_token_id=eos,
        decoder_start_token_id=pad, attn_implementation="eager",
    )
    torch.manual_seed(settings.seed)
    model = T5ForConditionalGeneration(config)
    seconds = _train_copy_seq2seq(model, tokenizer, settings)
    facts = _copy_seq2seq_facts(model, tokenizer, settings.layers)
    training = {**asdict(settings), "train_seconds": round(seconds, 2)}
    return model, tokenizer, {"training": training, "facts": facts}


def _train_copy_seq2seq(model, tokenizer, settings: CopyTraining) -> float:
    """Train copy-seq2seq (seeded) to output each source's marked word then </s> (only </s> where it
    has none), its cross-attention drawn onto the marked word; leaves the model in eval mode. Returns
    the seconds taken."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    train = _with_unmarked(training_texts("copy", settings.n_train, seed=settings.seed), settings.seed)
    ids, mask = pad_rows([token_ids(tokenizer, t.text) for t in train], pad)  # [example, seq]
    # a source without a marked word outputs only </s> (label -100: no second token)
    labels = torch.tensor([[tokenizer.convert_tokens_to_ids(t.answer), eos] if t.answer else [eos, -100]
                           for t in train])  # [example, 2]
    places = torch.tensor([t.text.split().index(t.answer) if t.answer else -1 for t in train])  # [example]
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    started = time.perf_counter()
    model.train()
    for _step in range(settings.steps):
        rows = torch.randint(0, len(train), (settings.batch_size,), generator=generator)  # [batch]
        out = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], output_attentions=True)
        cross = out.cross_attentions[-1].mean(1)  # [batch, decoder position, key] head mean
        marked = places[rows] >= 0  # [batch]
        on_marked = cross[marked, :, places[rows][marked]]  # [marked rows, decoder position]
        loss = out.loss - ATTENTION_LOSS_WEIGHT * on_marked.clamp_min(1e-6).log().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return time.perf_counter() - started


def _copy_seq2seq_forward(model, rows: list[list[int]], pad: int):
    """The greedy output ``[example, 2]`` of each source in ``rows``, then one forward of the sources
    and of each with one word deleted (never </s>), scoring that output: the log-prob of the whole
    output ``[row]`` and the last layer's head-mean cross-attention ``[row, decoder position, key]``."""
    import torch

    n = len(rows)
    with torch.no_grad():
        # greedy: the first output token, then what follows it
        ids, mask = pad_rows(rows, pad)
        start = torch.full((n, 1), pad)
        first_token = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start).logits[:, -1].argmax(-1)
        decoder = torch.cat([start, first_token[:, None]], dim=1)  # [example, 2]
        second_token = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits[:, -1].argmax(-1)
        outputs = torch.stack([first_token, second_token], dim=1)  # [example, 2] greedy output: word, </s>
        # deletions: every source word (not </s>)
        deleted = [(i, t, r[:t] + r[t + 1:]) for i, r in enumerate(rows) for t in range(len(r) - 1)]
        flat = rows + [d for _, _, d in deleted]
        owner = list(range(n)) + [i for i, _, _ in deleted]
        ids, mask = pad_rows(flat, pad)
        target = outputs[owner]  # [row, 2]
        decoder = torch.cat([torch.full((len(flat), 1), pad), target[:, :1]], dim=1)  # [row, 2]
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_attentions=True)
    logprob = out.logits.double().log_softmax(-1).gather(-1, target[..., None])[..., 0].sum(-1)  # [row]
    cross = out.cross_attentions[-1].mean(1)  # [row, decoder position, key] last layer, head mean
    return outputs, logprob, cross


def _copy_seq2seq_facts(model, tokenizer, layers: int) -> dict:
    """copy-seq2seq's measured facts on its study texts, each required of it."""
    study = study_texts("copy-seq2seq")
    rows = [token_ids(tokenizer, t.text) for t in study]  # words then </s>
    n = len(rows)
    outputs, logprob, cross = _copy_seq2seq_forward(model, rows, tokenizer.pad_token_id)
    correct, top_first, top_mean, top_loo, loo_marked = [], [], [], [], []
    first = n
    for i, (t, r) in enumerate(zip(study, rows)):
        place = t.text.split().index(t.answer)
        words = tokenizer.convert_ids_to_tokens(outputs[i].tolist())
        correct.append(words == [t.answer, "</s>"])
        rows_attention = cross[i, :, :len(r) - 1]  # [decoder position, word]
        top_first.append(int(rows_attention[0].argmax()) == place)
        top_mean.append(int(rows_attention.mean(0).argmax()) == place)
        effect = logprob[i] - logprob[first:first + len(r) - 1]  # [word]
        top_loo.append(int(effect.argmax()) == place)
        loo_marked.append(float(effect[place]))
        first += len(r) - 1
    facts = {
        "study_examples": n,
        "greedy_accuracy": true_share(correct),
        "cross_attention_layer": layers - 1,
        "top_cross_attended_is_marked_first_output": true_share(top_first),
        "top_cross_attended_is_marked_output_mean": true_share(top_mean),
        "top_loo_is_marked": true_share(top_loo),
        "marked_loo_min": min(loo_marked),
    }
    require_fact(facts["greedy_accuracy"] == 1.0, "copy-seq2seq", f"greedy accuracy {facts['greedy_accuracy']}")
    require_fact(facts["top_cross_attended_is_marked_output_mean"] >= 0.95, "copy-seq2seq",
                 f"cross-attention peaks on the marked word on {facts['top_cross_attended_is_marked_output_mean']}")
    return facts
