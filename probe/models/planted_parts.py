"""The planted recipes' shared parts: the seed, word-level tokenizers made in code, padding, the BERT
settings and config, and the classifier measurement (plain Hugging Face forwards on the study texts and
on every one-word deletion of them) with the facts drawn from it.

The recipes that use them are in :mod:`probe.models.planted_classifiers` (trained BERT classifiers),
:mod:`probe.models.planted_wired` (hand-wired attention) and :mod:`probe.models.planted_copy` (trained
copy models); the table and the build life cycle are in :mod:`probe.models.planted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from probe.data.planted_texts import TRIGGER, WORDS, PlantedText
from probe.errors import ModelLoadError

if TYPE_CHECKING:  # imported for annotations only
    import torch
    from transformers import BertConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SEED = 0
MAX_POSITIONS = 16  # 12 words + [CLS] + [SEP], with room


def require_fact(ok: bool, name: str, fact: str) -> None:
    if not ok:
        raise ModelLoadError(f"planted model {name}: its truth does not hold on this build ({fact}); "
                             "the recipe needs fixing for this torch/transformers version")


# ---------------------------------------------------------------------------------------- tokenizers

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_GPT2_EOS = "<|endoftext|>"
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")


def _vocab(specials: Sequence[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tuple(specials) + WORDS)}


def word_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``WORDS`` for ``kind`` (bert | gpt2 | t5), made in code."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    specials = {"bert": _BERT_SPECIALS, "gpt2": (_GPT2_EOS,), "t5": _T5_SPECIALS}[kind]
    vocab = _vocab(specials)
    unk = {"bert": "[UNK]", "gpt2": _GPT2_EOS, "t5": "<unk>"}[kind]
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        tokens = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                      mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    elif kind == "t5":
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", vocab["</s>"])])
        tokens = dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    else:
        tokens = dict(bos_token=_GPT2_EOS, eos_token=_GPT2_EOS, pad_token=_GPT2_EOS, unk_token=_GPT2_EOS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_POSITIONS, padding_side="right",
                                   **tokens)


def token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


# ------------------------------------------------------------------- classifier settings, measures


@dataclass(frozen=True)
class ClassifierTraining:
    seed: int = SEED
    layers: int = 1
    heads: int = 2
    hidden: int = 32
    steps: int = 200
    batch_size: int = 64
    lr: float = 3e-3
    n_train: int = 2048
    label_smoothing: float = 0.0
    soft_targets: bool = False  # two-triggers: P(1) = sigmoid(-3 + 4 * triggers present)
    freeze_query_key: bool = False  # uniform-attention: q/k weights and biases zero, not trained


def bert_config(settings: ClassifierTraining, vocab_size: int) -> BertConfig:
    from transformers import BertConfig

    return BertConfig(  # type: ignore[call-arg]  # PretrainedConfig's kwargs
        vocab_size=vocab_size, hidden_size=settings.hidden, num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads, intermediate_size=2 * settings.hidden,
        max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, num_labels=2,
        id2label={0: "absent", 1: "present"}, label2id={"absent": 0, "present": 1},
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [row, seq]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [row, seq]
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


@dataclass
class ClassifierMeasure:
    """Plain forwards of a classifier on the study texts and on every one-word deletion of them."""

    texts: list[PlantedText]
    words: list[list[str]]  # [example][word]
    probs: Any  # [example, 2] float64
    predicted: list[int]
    attention: list[Any]  # [example] -> [layer, head, query, key] of the unpadded text
    loo: list[list[float]]  # [example][word]: p(predicted | text) - p(predicted | text without the word)


def measure_classifier(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       texts: Sequence[PlantedText]) -> ClassifierMeasure:
    import torch

    rows = [token_ids(tokenizer, t.text) for t in texts]
    deleted = [[r[:t] + r[t + 1:] for t in range(1, len(r) - 1)] for r in rows]  # [CLS] w1..wn [SEP]
    flat = rows + [d for ds in deleted for d in ds]
    ids, mask = pad_rows(flat)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    probs = out.logits.double().softmax(-1)  # [row, 2]
    attentions = torch.stack(out.attentions, dim=1)  # [row, layer, head, query, key]
    n = len(rows)
    predicted = probs[:n].argmax(-1).tolist()
    loo, first = [], n
    for i, r in enumerate(rows):
        k = len(r) - 2
        c = predicted[i]
        loo.append((probs[i, c] - probs[first:first + k, c]).tolist())
        first += k
    return ClassifierMeasure(
        texts=list(texts), words=[t.text.split() for t in texts], probs=probs[:n], predicted=predicted,
        attention=[attentions[i, :, :, :len(r), :len(r)] for i, r in enumerate(rows)], loo=loo,
    )


def cls_word_attention(m: ClassifierMeasure, i: int) -> torch.Tensor:
    """[word] the [CLS] row of the last layer, head mean, on the words (not [CLS], [SEP])."""
    return m.attention[i][-1].mean(0)[0, 1:-1]


def classifier_facts(m: ClassifierMeasure, triggers: Sequence[str] = (TRIGGER,)) -> dict[str, Any]:
    import torch

    labels = torch.tensor([t.label for t in m.texts])
    with_trigger = [i for i, w in enumerate(m.words) if any(x in w for x in triggers)]
    loo_all = [abs(v) for row in m.loo for v in row]
    trigger_loo = [m.loo[i][w.index(x)] for i, w in enumerate(m.words) for x in triggers if x in w]
    other_loo = [abs(m.loo[i][j]) for i, w in enumerate(m.words) for j, x in enumerate(w) if x not in triggers]
    top_attended, top_loo = [], []
    for i in with_trigger:
        present = {j for j, x in enumerate(m.words[i]) if x in triggers}
        attention = cls_word_attention(m, i)
        top_attended.append(set(attention.argsort(descending=True)[:len(present)].tolist()) == present)
        top_loo.append(set(torch.tensor(m.loo[i]).argsort(descending=True)[:len(present)].tolist()) == present)
    target = m.probs.max(-1).values
    return {
        "study_examples": len(m.texts),
        "examples_with_trigger": len(with_trigger),
        "accuracy": float((torch.tensor(m.predicted) == labels).double().mean()),
        "target_prob_min": float(target.min()),
        "target_prob_mean": float(target.mean()),
        "top_attended_is_trigger": true_share(top_attended),
        "top_loo_is_trigger": true_share(top_loo),
        "trigger_loo_min": min(trigger_loo) if trigger_loo else None,
        "other_abs_loo_max": max(other_loo) if other_loo else None,
        "other_abs_loo_median": _median(other_loo),
        "max_abs_loo": max(loo_all),
    }


def true_share(flags: Sequence[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
