"""Three small token mixers trained from scratch, one recipe, to compare attention with recurrence
and convolution (the built-ins ``rt-transformer``, ``rt-mamba`` and ``rt-conv``).

Each is a causal language model over the same word-level vocabulary, trained on the rotten_tomatoes
*training* sentences of ``probe.data`` to write the sentiment after the prompt ``"{text} =>"``: the
next token is ``positive`` or ``negative`` (cross-entropy over the whole vocabulary at that one
position). Only the token mixer differs:

- ``transformer``: Llama layers, causal softmax attention (4 heads) and a SwiGLU MLP;
- ``mamba``: Mamba layers (selective state-space scan, no MLP), one more layer so the sizes match;
- ``conv``: LFM2 layers with every mixer a gated convolution (kernel 32, not LFM2's 3) and a
  SwiGLU MLP.

All three are causal, so each reads a sentence in the same direction; same width (128), vocabulary,
tied embeddings, optimiser, schedule, epochs, batch order and seed, and within 7% of each other in
non-embedding parameters. The held-out accuracy (the 1,000 sentences of the fixed test split, never
trained on: log p(positive) against log p(negative) at the prompt's end) goes into the metadata.

Training Mamba through transformers' reference scan costs seconds per batch on a CPU (its
per-step indexing makes the backward quadratic in memory traffic), so while training, each
``MambaMixer`` runs :func:`_mamba_training_forward`: the same function computed from probe's own
reading of the layer (:func:`probe.hooks.implicit.mamba_terms`) with a sequential scan over unbound
time steps. It equals the module's own forward within float rounding (tested); the saved weights
are a plain ``MambaForCausalLM``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported for annotations only: loading this module imports neither torch nor transformers
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

Mixer = Literal["transformer", "mamba", "conv"]
MIXERS: tuple[Mixer, ...] = ("transformer", "mamba", "conv")

#: the prompt every model was trained on; the label word follows it
PROMPT = "{text} =>"
#: label id -> the word the model writes for it
LABEL_WORDS = ("negative", "positive")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[EOS]", "=>")
#: the convolution kernel of ``rt-conv`` (tokens each layer reaches back, itself included)
CONV_KERNEL = 32


@dataclass(frozen=True)
class ScratchTraining:
    """The one recipe of the three scratch built-ins (``n_train``/``n_test`` None: every sentence)."""

    seed: int = 0
    hidden: int = 128
    epochs: int = 3
    lr: float = 2e-3
    batch_size: int = 32
    max_length: int = 96
    min_count: int = 2  # a word seen once in training is [UNK]
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    eval_batch_size: int = 128
    n_train: int | None = None
    n_test: int | None = None


SCRATCH_TRAINING = ScratchTraining()


def build_scratch(mixer: Mixer, out: Path, progress: bool = True,
                  settings: ScratchTraining = SCRATCH_TRAINING) -> dict[str, Any]:
    """Train the ``mixer`` built-in into folder ``out`` (save_pretrained); its metadata."""
    import torch

    from probe.data import load_dataset
    from probe.models.training import seed_everything

    train = load_dataset("builtin:rotten_tomatoes", split="train")[: settings.n_train]
    test = load_dataset("builtin:rotten_tomatoes", split="test")[: settings.n_test]
    train_texts, train_labels = [e.text for e in train], [int(e.label) for e in train]
    test_texts, test_labels = [e.text for e in test], [int(e.label) for e in test]

    tokenizer = word_tokenizer(train_texts, settings.min_count)
    seed_everything(settings.seed)
    model = scratch_model(mixer, len(tokenizer), settings.hidden)
    started = time.perf_counter()
    losses = train_label_words(model, tokenizer, train_texts, train_labels, settings, progress, name=f"rt-{mixer}")
    train_seconds = time.perf_counter() - started
    model.eval()
    accuracy = label_word_accuracy(model, tokenizer, test_texts, test_labels, settings)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    embedding = model.get_input_embeddings().weight.numel()
    return {
        "mixer": mixer,
        "architecture": type(model).__name__,
        "prompt": PROMPT,
        "labels": {"0": LABEL_WORDS[0], "1": LABEL_WORDS[1]},
        "train_data": "builtin:rotten_tomatoes split=train",
        "test_data": "builtin:rotten_tomatoes split=test",
        "heldout_accuracy": round(accuracy, 4),
        "n_train": len(train_texts),
        "n_test": len(test_texts),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "non_embedding_parameters": sum(p.numel() for p in model.parameters()) - embedding,
        "epoch_losses": [round(loss, 4) for loss in losses],
        "training": asdict(settings),
        "train_seconds": round(train_seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------ vocabulary


def word_tokenizer(texts: list[str], min_count: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``texts`` (lower-cased, split at word/punctuation boundaries):
    the special tokens, then every word seen at least ``min_count`` times by falling count (ties
    alphabetically), the label words always in."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    splitter = pre_tokenizers.Whitespace()
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(word for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    words = [w for w, c in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
             if c >= min_count and w not in SPECIAL_TOKENS]
    words += [w for w in LABEL_WORDS if w not in words]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = splitter
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", padding_side="right")


def label_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The vocabulary ids of the label words, in label order."""
    return [tokenizer.convert_tokens_to_ids(word) for word in LABEL_WORDS]  # type: ignore[misc]  # one token: an int


# ---------------------------------------------------------------------------------------- models


def scratch_model(mixer: Mixer, vocab_size: int, hidden: int) -> PreTrainedModel:
    """A freshly initialised causal LM of the given mixer (seed the caller's RNG first)."""
    from transformers import (
        Lfm2Config,
        Lfm2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MambaConfig,
        MambaForCausalLM,
    )

    common = dict(vocab_size=vocab_size, hidden_size=hidden, pad_token_id=0, bos_token_id=None,
                  eos_token_id=2, tie_word_embeddings=True)
    if mixer == "transformer":
        config = LlamaConfig(**common, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, max_position_embeddings=256)
        return LlamaForCausalLM(config)
    if mixer == "mamba":  # no MLP in a Mamba block: three layers match the others' size
        return MambaForCausalLM(MambaConfig(**common, state_size=16, num_hidden_layers=3, expand=2, conv_kernel=4))
    if mixer == "conv":
        # kernel 32, not LFM2's 3: two layers of kernel 3 reach 4 tokens back from the prompt's
        # end, and such a model does not learn the task (54% held-out); 32 reaches 62
        config = Lfm2Config(**common, intermediate_size=2 * hidden, num_hidden_layers=2, layer_types=["conv", "conv"],
                            conv_L_cache=CONV_KERNEL,
                            block_auto_adjust_ff_dim=False, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=256,
                            # transformers 5.24's cache of an LFM2 without attention layers fails
                            # (get_seq_length needs one): this model runs without a cache
                            use_cache=False)
        return Lfm2ForCausalLM(config)
    raise ValueError(f"unknown mixer {mixer!r}: valid are {', '.join(MIXERS)}")


def next_token_logits(model: PreTrainedModel, encoded: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Logits [batch, vocab] of the token after each (right-padded) row's last real token."""
    import torch

    hidden = model.base_model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                              use_cache=False).last_hidden_state
    last = encoded["attention_mask"].sum(dim=1) - 1  # [batch]
    return model.lm_head(hidden[torch.arange(hidden.shape[0]), last])  # [batch, vocab]


# -------------------------------------------------------------------------------------- training


def train_label_words(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], labels: list[int],
                      settings: ScratchTraining, progress: bool, name: str = "scratch model") -> list[float]:
    """Train ``model`` to write the label word after the prompt; the mean loss of each epoch."""
    import torch
    import torch.nn.functional as F
    from transformers import get_linear_schedule_with_warmup

    from probe.models.training import progress_bar

    prompts = [PROMPT.format(text=text) for text in texts]
    targets = torch.tensor(label_token_ids(tokenizer))[torch.tensor(labels)]  # [example]
    generator = torch.Generator().manual_seed(settings.seed)
    batches = -(-len(prompts) // settings.batch_size)
    total_steps = batches * settings.epochs
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    undecayed = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": settings.weight_decay},
                                   {"params": undecayed, "weight_decay": 0.0}], lr=settings.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(settings.warmup_fraction * total_steps), total_steps)
    losses = []
    model.train()
    with _fast_training_forward(model), progress_bar(progress, f"training {name}", total_steps) as advance:
        for _epoch in range(settings.epochs):
            order = torch.randperm(len(prompts), generator=generator)  # [example]
            total = 0.0
            for start in range(0, len(prompts), settings.batch_size):
                rows = order[start : start + settings.batch_size]  # [batch]
                encoded = tokenizer([prompts[i] for i in rows.tolist()], padding=True, truncation=True,
                                    max_length=settings.max_length, return_tensors="pt")
                loss = F.cross_entropy(next_token_logits(model, encoded), targets[rows])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                total += loss.item() * len(rows)
                advance(f"loss {loss.item():.3f}")
            losses.append(total / len(prompts))
    model.eval()
    return losses


def label_word_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], labels: list[int],
                        settings: ScratchTraining = SCRATCH_TRAINING) -> float:
    """Share of ``texts`` whose likelier label word (of the two) after the prompt is their label."""
    import torch

    ids = label_token_ids(tokenizer)
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(texts), settings.eval_batch_size):
            chunk = [PROMPT.format(text=text) for text in texts[start : start + settings.eval_batch_size]]
            encoded = tokenizer(chunk, padding=True, truncation=True, max_length=settings.max_length,
                                return_tensors="pt")
            predicted = next_token_logits(model, encoded)[:, ids].argmax(dim=-1)  # [batch]
            correct += int((predicted == torch.tensor(labels[start : start + len(chunk)])).sum())
    return correct / len(texts)


@contextlib.contextmanager
def _fast_training_forward(model) -> Iterator[None]:
    """While training, every ``MambaMixer`` of ``model`` runs :func:`_mamba_training_forward`."""
    from transformers.models.mamba.modeling_mamba import MambaMixer

    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    for mixer in mixers:
        mixer.forward = _mamba_training_forward.__get__(mixer)
    try:
        yield
    finally:
        for mixer in mixers:
            del mixer.forward


def _mamba_training_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """A ``MambaMixer``'s output [batch, time, hidden] without a cache: y_t = C_t h_t + D x_t with
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, scanned over the time steps of probe's terms."""
    import torch

    from probe.hooks.implicit import mamba_terms, mixer_output

    if cache is not None:
        raise RuntimeError("the training forward of a Mamba mixer takes no cache")
    terms = mamba_terms(self, hidden_states, attention_mask)
    step = terms.step[..., None]  # [batch, channel, time, 1]
    decays = torch.exp(step * terms.decay[None, :, None, :]).unbind(2)  # time x [batch, channel, state]
    inputs = (step * terms.value[..., None] * terms.B[:, None]).unbind(2)  # time x [batch, channel, state]
    readouts = terms.C.unbind(1)  # time x [batch, state]
    state = torch.zeros_like(inputs[0])
    outputs = []
    for decay, update, readout in zip(decays, inputs, readouts):
        state = decay * state + update
        outputs.append(torch.einsum("bcn,bn->bc", state, readout))
    scan = torch.stack(outputs, dim=-1) + terms.skip[None, :, None] * terms.value  # [batch, channel, time]
    return mixer_output(self, terms, scan).to(hidden_states.dtype)
