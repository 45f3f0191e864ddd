"""Planted-truth models: tiny models whose token importance is known by construction.

Each recipe builds (seeded, deterministic, a few CPU seconds) a model that loads as ``planted:NAME``
with its study data ``planted:NAME`` (64 held-out texts, :mod:`probe.planted_texts`). The verdict
"attention does / does not track causal importance" is tested on them like a method (DESIGN.md,
house rule 14): probe must give the ``expected`` answer. Every fact a truth rests on is *measured* in
the recipe with plain Hugging Face forwards (eager ``output_attentions``; leave-one-out by deleting
the token and running the model again, never probe's own code) and stored in ``probe_builtin.json``
under ``facts``; a build whose fact does not hold fails instead of shipping a false truth.

==========================  ==============  ==================================================================  ==================
name                        task            truth by construction                                               expected
==========================  ==============  ==================================================================  ==================
trigger-saturated           classification  label = "zz" present; trained to held-out accuracy 1.0 with p > 0.99;  yes
                                            only zz matters, and [CLS] attention (last layer, head mean) puts
                                            zz first among the words of every text holding it
trigger-soft                classification  the same task trained with label smoothing 0.2 (p ~ 0.9): zz carries  yes
                                            the effect, other words' effects are tiny but nonzero; attention
                                            puts zz first
two-triggers                classification  P(1) has a logit that adds +4 per trigger (zz, yy); each has its own  yes
                                            clear effect; attention puts the triggers on top
uniform-attention           classification  query/key weights and biases are zero (frozen in training): every     no
                                            attention row is exactly uniform, yet zz decides (through values)
attention-is-importance     classification  hand-wired 1-layer BERT: the [CLS] attention weight and the deletion   yes
                                            effect rank the words identically (Kendall tau = 1 on every text)
constant-output             classification  trigger-saturated with its classifier weight set to zero: the output  undecidable
                                            does not depend on the input at all
below-noise                 classification  trigger-saturated with its classifier scaled by 1e-8: the largest     undecidable
                                            deletion effect is ~4e-8, below one float32 step at 0.5
randomised                  classification  the trigger architecture with fresh random weights (nothing trained)   no, undecidable
copy-lm                     causal_lm       GPT-2 (1 layer): the next token copies the one marked word of the     yes
                                            prompt; the last position's attention concentrates on it
copy-lm-cue                 causal_lm       copy-lm on prompts ending with a cue word (not explained): the        yes
                                            cue's attention, rollout and ALTI put the copied word first
copy-seq2seq                seq2seq         T5 (1+1 layers): the output is the marked source word, then EOS;      yes
                                            decoder cross-attention concentrates on it
position-heads              classification  hand-wired BERT, 6 layers x 12 heads: every head's query and key read   no
                                            the position embeddings only (moving zz changes no weight); zz, once
                                            per text, decides through the last layer's values
one-head                    classification  position-heads with head L5.H7 wired onto zz (over 90% of its          heads only
                                            attention), the other 71 heads positional
trigger-twice               classification  trigger-saturated on texts holding zz twice: deleting one copy        yes
                                            changes nothing, both flips the label; judged against Shapley values
trigger-twice-soft          classification  trigger-soft on texts holding zz twice: single deletion ranks filler   yes
                                            words first; judged against Shapley values
sink-head                   classification  hand-wired BERT, 1 layer x 1 head: the head puts most of its [CLS]     no (its head: does
                                            row on yy, whose value is zero (blocking that edge removes nothing);   not matter)
                                            zz, its least attended key, carries the decision through its edge
edge-head                   classification  hand-wired BERT, 1 layer x 1 head: the head puts over 90% of its       yes (its head:
                                            [CLS] row on zz, and that edge carries the decision                    matters)
==========================  ==============  ==================================================================  ==================

``position-heads`` and ``one-head`` are the verdict's calibration pair: over many statistics seeds the null's heads must pass
the test against chance at no more than alpha of them, and the planted head alone must be named
(:mod:`probe.study.calibration`). The two ``trigger-twice`` models plant redundancy: their truth is one
single-token deletion cannot see, so the planted study adds ``shapley`` to their references and judges
them against it (``PlantedModel.reference``); judged against ``loo_delete`` on the same tables the
verdict is undecidable or no, and the pair check names the two copies as substitutes.

``sink-head`` and ``edge-head`` plant the per-head causal test's truths (:mod:`probe.study.heads_causal`:
is where a head looks what matters through its own edges?), named per head in
``PlantedModel.head_answers``. They are outside the self-test (``PlantedModel.self_test``): ``probe planted``
runs the models of the shipped table (reports/planted) only, and tests/test_head_causal.py runs a study with
``metrics: heads_causal`` on these two. Each is also judged by the token-level verdict there (its
``expected`` answer).

``materialize_planted(name)`` builds a folder once under ``<cache>/planted/<name>-v<recipe_version>``
(a temporary folder renamed into place, under the built-ins' lock) and reuses it afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from probe.errors import ModelLoadError
from probe.models.builtins import (
    METADATA_FILE,
    default_cache_dir,
    exclusive_lock,
    package_versions,
)
from probe.planted_texts import (
    FILLER,
    PREFIX,
    SECOND_TRIGGER,
    TRIGGER,
    WORDS,
    PlantedText,
    study_texts,
    training_texts,
)

ANSWERS = ("yes", "heads only", "no", "undecidable")
DATA_FILE = "data.jsonl"
SEED = 0
MAX_POSITIONS = 16  # 12 words + [CLS] + [SEP], with room
#: copy-lm-cue's prompts end with this word (one the copy texts never hold): the copy is read at it
COPY_CUE = SECOND_TRIGGER


@dataclass(frozen=True)
class PlantedModel:
    name: str
    task: str  # "classification" | "causal_lm" | "seq2seq"
    truth: str  # the documented truth by construction
    expected: tuple[str, ...]  # the verdict answer(s) probe must give, from ANSWERS
    why: str  # why that answer is the right one
    recipe_version: int = 1
    tracking: tuple[str, ...] = ()  # the units planted to track, where the truth names them
    #: a reference the planted study adds for this model and judges its verdict against (its truth is
    #: one single-token deletion cannot see), or None: the study's own
    reference: str | None = None
    #: a prompt template the planted study reads the texts through (``{text}`` the text; its own
    #: tokens are not explained), or None: the text alone
    prompt: str | None = None
    #: the per-head causal test's planted answers (probe.study.heads_causal), ``(unit, answer)`` pairs
    head_answers: tuple[tuple[str, str], ...] = ()
    #: part of the verdict's self-test (``probe planted``, reports/planted); False: tested on its own
    self_test: bool = True


PLANTED_MODELS: dict[str, PlantedModel] = {m.name: m for m in (
    PlantedModel(
        "trigger-saturated", "classification",
        "label = 1 iff the word zz is present; trained to held-out accuracy 1.0 with the predicted class's "
        "probability above 0.99. Only zz matters, and [CLS] attention (last layer, head mean) puts zz first "
        "among the words of every text that holds it.",
        ("yes",),
        "the token that carries the effect is the token attention ranks first, on every text with a trigger",
    ),
    PlantedModel(
        "trigger-soft", "classification",
        "the trigger task trained with label smoothing 0.2, so the predicted class's probability is about 0.9, "
        "not saturated: zz carries the effect, the other words' deletion effects are tiny but nonzero; "
        "[CLS] attention (last layer, head mean) puts zz first.",
        ("yes",),
        "attention's top token is the causal token, and the target is not saturated, so the effects are measurable",
    ),
    PlantedModel(
        "two-triggers", "classification",
        "trained on soft targets whose logit adds +4 per trigger (P(1) = 0.05 with none, 0.73 with zz or yy, "
        "0.98 with both); label = 1 iff either is present. Each trigger has its own clear deletion effect, "
        "also when both are present, and [CLS] attention (last layer, head mean) ranks the triggers on top.",
        ("yes",),
        "the two causal tokens are the two tokens attention ranks highest",
    ),
    PlantedModel(
        "uniform-attention", "classification",
        "every query and key weight and bias is zero (and was frozen while training), so every attention row is "
        "exactly uniform over the non-padding tokens in every layer; yet zz decides the label (accuracy 1.0), "
        "through the values.",
        ("no",),
        "attention weights are all equal: they carry no information about which token matters, while zz does",
    ),
    PlantedModel(
        "attention-is-importance", "classification",
        "hand-wired one-layer, one-head BERT (no training): each word has a salience read by the [CLS] query, "
        "every word's value is the same unit vector, and the output probability of class 1 (always predicted) "
        "rises with the attention mass on words; so the [CLS] attention weight and the deletion effect on the "
        "predicted class's probability rank the words identically (Kendall tau = 1 on every text).",
        ("yes",),
        "attention is importance by construction: their rankings agree exactly on every example",
    ),
    PlantedModel(
        "constant-output", "classification",
        "trigger-saturated with its classifier weight set to zero: the logits are the classifier bias, exactly "
        "the same for every input, so every deletion effect is exactly 0.",
        ("undecidable",),
        "the output does not depend on the input: there is no importance for attention to track",
    ),
    PlantedModel(
        "below-noise", "classification",
        "trigger-saturated with its classifier weight and bias scaled by 1e-8, so the predicted class's "
        "probability is 0.5 + 2e-8 and the largest deletion effect is about 4e-8 (zz's), below one float32 "
        "step at 0.5 (6e-8): the effects are at the float32 noise floor.",
        ("undecidable",),
        "the reference's effects are at the numerical noise floor: their ranking is rounding, not importance",
    ),
    PlantedModel(
        "randomised", "classification",
        "the trigger model's architecture with every weight freshly random (seeded; nothing trained): nothing "
        "was planted, the output barely depends on the input and follows no rule.",
        ("no", "undecidable"),
        "anything but yes: random weights plant no agreement between attention and importance",
    ),
    PlantedModel(
        "copy-lm", "causal_lm",
        "one-layer GPT-2 trained so the next token copies the one marked word (alpha, beta, gamma, delta, "
        "omega, sigma) of the prompt (a prompt without one continues with EOS): greedy accuracy 1.0 on held-out "
        "prompts; the last position's attention "
        "(head mean) concentrates on the marked word, and deleting it has the largest effect on the "
        "greedy token's log-prob.",
        ("yes",),
        "the token the output copies is the token attention concentrates on",
    ),
    PlantedModel(
        "copy-lm-cue", "causal_lm",
        "copy-lm trained on prompts that end with the cue word yy (read through the template '{text} yy', whose "
        "cue is not explained): at the cue the next token copies the marked word (greedy accuracy 1.0), the cue's "
        "attention concentrates on the marked word, and so do attention rollout (the cue's own residual share "
        "falls on the cue, outside the explained text) and ALTI; deleting the marked word has the largest effect.",
        ("yes",),
        "attention, rollout and ALTI each put the copied word first, as deletion does; a randomised copy of the "
        "model ranks the words by chance, so none of them fails its randomisation check",
        prompt="{text} " + COPY_CUE,
    ),
    PlantedModel(
        "copy-seq2seq", "seq2seq",
        "T5 with one encoder and one decoder layer, trained so the output is the marked source word, then EOS "
        "(a source without one outputs EOS only): greedy accuracy 1.0 on held-out sources; the decoder's "
        "cross-attention (head mean, averaged over the output positions; an auxiliary training loss pulls the "
        "EOS position's onto the marked word too) concentrates on the marked word, whose deletion has the "
        "largest effect.",
        ("yes",),
        "the source token the output copies is the token cross-attention concentrates on",
    ),
    PlantedModel(
        "position-heads", "classification",
        "hand-wired BERT with 6 layers x 12 heads (72 heads): every head's query and key read the position "
        "embeddings only, so its [CLS] attention depends on positions alone (moving zz changes no weight); each "
        "text holds zz once, at a random place, and only the last layer's values read it: deleting zz is the "
        "largest effect on every text. Nothing in any head's attention knows where zz is.",
        ("no",),
        "72 heads that carry no information about the causal token: none may pass the chance test, at any seed",
    ),
    PlantedModel(
        "one-head", "classification",
        "position-heads with one exception: head L5.H7's query reads 'is [CLS]' and its key reads the "
        "trigger, so it puts over 90% of its attention on zz wherever it stands; the other 71 heads are "
        "positional as in position-heads (the 11 others of layer 5 share one sharp pattern, so that layer's head "
        "mean peaks on a position, not on zz).",
        ("heads only",),
        "one head among 72 carries the causal token: exactly that head tracks, and no layer mean",
        tracking=("attention L5.H7",),
    ),
    PlantedModel(
        "trigger-twice", "classification",
        "trigger-saturated (label = 1 iff zz is present) on texts that each hold zz twice: either copy alone "
        "decides the label, so deleting one copy leaves the prediction where it was (effects of order 1e-4) while "
        "deleting both flips it; the copies share the joint effect (their Shapley values), and [CLS] attention "
        "(last layer, head mean) ranks the two copies on top.",
        ("yes",),
        "the two copies carry the effect together, and attention ranks them on top; single deletion sees only "
        "the copies' leftovers, so the verdict is judged against Shapley values (added for this model), and the "
        "pair check names the copies as substitutes",
        reference="shapley",
    ),
    PlantedModel(
        "trigger-twice-soft", "classification",
        "trigger-soft (label smoothing 0.2: the other words have small real effects) on texts that each hold zz "
        "twice: deleting one copy barely moves the prediction, so single deletion ranks a filler word first on "
        "most texts, while the two copies hold most of the Shapley value and attention ranks them on top.",
        ("yes",),
        "the copies substitute for each other: single deletion ranks filler words above them, Shapley values do "
        "not; judged against Shapley values (added for this model), attention tracks",
        reference="shapley",
    ),
    PlantedModel(
        "sink-head", "classification",
        "hand-wired one-layer, one-head BERT (no training) on texts holding zz and yy once each: the head's [CLS] "
        "row puts over 60% on yy (a sink: its value vector is exactly zero, so blocking that edge without "
        "renormalising changes nothing, and with the row renormalised the freed mass moves onto zz and the target "
        "rises), then the filler words by a salience, and least on zz; the head's value reads zz only and its "
        "output decides the class, so blocking the edge to zz (or deleting zz) is the largest effect on every "
        "text. Where the head looks is the reverse of what matters through it.",
        ("no",),
        "attention ranks yy and the fillers above zz on every text, deletion and knockout rank zz first: neither "
        "the token-level units nor the head agree above chance",
        head_answers=(("attention L0.H0", "does not matter"),), self_test=False,
    ),
    PlantedModel(
        "edge-head", "classification",
        "hand-wired one-layer, one-head BERT (no training) on texts holding zz once: the head's [CLS] row puts over "
        "90% on zz (every other key scores 0), its value reads zz only and its output decides the class, so "
        "blocking that one edge (or deleting zz) is the largest effect on every text: the attended edge carries "
        "the decision.",
        ("yes",),
        "attention's top token is the token whose edge, and whose deletion, carries the decision, on every text",
        head_answers=(("attention L0.H0", "matters"),), self_test=False,
    ),
)}


def planted_model_names() -> list[str]:
    return sorted(PLANTED_MODELS)


def self_test_names() -> list[str]:
    """The models of the verdict's self-test (``probe planted``, reports/planted), in table order."""
    return [name for name, recipe in PLANTED_MODELS.items() if recipe.self_test]


def get_planted(name: str) -> PlantedModel:
    try:
        return PLANTED_MODELS[name]
    except KeyError:
        valid = ", ".join(PREFIX + n for n in planted_model_names())
        raise ModelLoadError(f"unknown planted model {PREFIX}{name}; valid: {valid}") from None


def planted_folder(name: str, cache_dir: Path | str | None = None) -> Path:
    recipe = get_planted(name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / "planted" / f"{recipe.name}-v{recipe.recipe_version}"


def built_planted_folder(name: str, cache_dir: Path | str | None = None) -> Path | None:
    """The folder of planted model ``name`` if it is built already, else None (nothing is built)."""
    if name not in PLANTED_MODELS:
        return None
    final = planted_folder(name, cache_dir)
    return final if _is_complete(final, get_planted(name)) else None


def materialize_planted(name: str, cache_dir: Path | str | None = None, progress: bool = False) -> Path:
    """Return the folder of planted model ``name`` (``from_pretrained`` loads it); build it once.

    Built in a temporary folder beside the final one and renamed into place (a killed build leaves
    nothing that looks finished), under a lock (a second process waits, then reuses the folder).
    A build whose measured facts contradict the recipe's truth raises instead of being kept.
    """
    import sys

    recipe = get_planted(name)
    final = planted_folder(name, cache_dir)
    if _is_complete(final, recipe):
        return final
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache folder {root} ({exc}); set PROBE_CACHE to a writable folder") from None

    with exclusive_lock(root / f".{recipe.name}.lock", PREFIX + recipe.name, progress):
        if _is_complete(final, recipe):
            return final
        for leftover in root.glob(f".{recipe.name}.building-*"):  # from killed builds: we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{recipe.name}.building-", dir=root))
        try:
            if progress:
                print(f"probe: building planted model {recipe.name} into {final} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            details = build_planted(name, staging)
            metadata = {
                **asdict(recipe),
                "expected": list(recipe.expected),
                "seed": SEED,
                **details,
                "build_seconds": round(time.perf_counter() - started, 2),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "versions": package_versions(),
            }
            # Written last: its presence is what marks a folder as complete.
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
            staging.chmod(0o755)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


def build_planted(name: str, out: Path | str) -> dict[str, Any]:
    """Build model ``name`` into folder ``out`` (model, tokenizer, ``data.jsonl``); return its
    metadata (measured facts, training settings, weights hash) without writing it."""
    import torch

    recipe = get_planted(name)
    out = Path(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and the sums are always in one order
    try:
        model, tokenizer, details = _BUILDERS[recipe.name]()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _unpin_attention_implementation(out)
    _write_study_data(recipe.name, out)
    return {**details, "weights_sha256": weights_sha256(model)}


def weights_sha256(model) -> str:
    """SHA-256 of every tensor of ``model.state_dict()`` (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ cache helpers


def _is_complete(folder: Path, recipe: PlantedModel) -> bool:
    try:
        metadata = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (metadata.get("name") == recipe.name and metadata.get("recipe_version") == recipe.recipe_version
            and (folder / DATA_FILE).is_file())


def _write_study_data(name: str, out: Path) -> None:
    lines = []
    for text in study_texts(name):
        record: dict[str, Any] = {"text": text.text}
        if text.label is not None:
            record["label"] = text.label
        if text.answer is not None:
            record["answer"] = text.answer
        lines.append(json.dumps(record))
    (out / DATA_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


def _unpin_attention_implementation(folder: Path) -> None:
    """The recipes build with eager attention (to measure it); the saved config must not pin it."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    keys = [k for k in ("attn_implementation", "_attn_implementation", "_attn_implementation_autoset") if k in config]
    if keys:
        for key in keys:
            del config[key]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _require(ok: bool, name: str, fact: str) -> None:
    if not ok:
        raise ModelLoadError(f"planted model {name}: its truth does not hold on this build ({fact}); "
                             "the recipe needs fixing for this torch/transformers version")


# ---------------------------------------------------------------------------------------- tokenizers

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_GPT2_EOS = "<|endoftext|>"
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")


def _vocab(specials: Sequence[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tuple(specials) + WORDS)}


def _tokenizer(kind: str):
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


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


# ------------------------------------------------------------------------------- classifier recipes


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


SATURATED = ClassifierTraining()
SOFT = ClassifierTraining(label_smoothing=0.2)
#: two-triggers: with 4 heads or 300 steps, training often stops where one head serves both triggers
#: (one trigger or two give the same output); 8 heads and 600 steps reached the sum on seeds 0, 1, 2
TWO_TRIGGERS = ClassifierTraining(soft_targets=True, heads=8, steps=600)
UNIFORM = ClassifierTraining(freeze_query_key=True, steps=300)
#: classifier scale of below-noise (its truth says 1e-8; the build checks the effects it gives)
BELOW_NOISE_SCALE = 1e-8


def _bert_config(settings: ClassifierTraining, vocab_size: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size, hidden_size=settings.hidden, num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads, intermediate_size=2 * settings.hidden,
        max_position_embeddings=MAX_POSITIONS, type_vocab_size=2, num_labels=2,
        id2label={0: "absent", 1: "present"}, label2id={"absent": 0, "present": 1},
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )


def _query_key_parameters(model):
    return [p for n, p in model.named_parameters() if ".attention.self.query." in n or ".attention.self.key." in n]


@functools.lru_cache(maxsize=4)
def _trained_classifier_state(settings: ClassifierTraining) -> tuple[dict, float]:
    """(state dict, train seconds) of a BERT trained on the trigger texts with ``settings``; cached in
    the process, so the recipes that start from the same training (constant-output, below-noise) share it."""
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer("bert")
    torch.manual_seed(settings.seed)
    model = BertForSequenceClassification(_bert_config(settings, len(tokenizer)))
    if settings.freeze_query_key:
        with torch.no_grad():
            for p in _query_key_parameters(model):
                p.zero_()
                p.requires_grad_(False)
    kind = "two-triggers" if settings.soft_targets else "trigger"
    train = training_texts(kind, settings.n_train, seed=settings.seed)
    ids, mask = _pad([_ids(tokenizer, t.text) for t in train])  # [example, seq]
    if settings.soft_targets:
        n_triggers = torch.tensor([t.text.split().count(TRIGGER) + t.text.split().count(SECOND_TRIGGER)
                                   for t in train], dtype=torch.float32)
        p1 = torch.sigmoid(-3.0 + 4.0 * n_triggers)  # [example]
        targets = torch.stack([1 - p1, p1], dim=-1)  # [example, 2]
    else:
        targets = torch.tensor([t.label for t in train])  # [example]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    started = time.perf_counter()
    model.train()
    for _step in range(settings.steps):
        rows = torch.randint(0, len(train), (settings.batch_size,), generator=generator)  # [batch]
        logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits  # [batch, 2]
        loss = torch.nn.functional.cross_entropy(logits, targets[rows], label_smoothing=settings.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return {k: v.clone() for k, v in model.state_dict().items()}, time.perf_counter() - started


def _trained_classifier(settings: ClassifierTraining):
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer("bert")
    state, seconds = _trained_classifier_state(settings)
    model = BertForSequenceClassification(_bert_config(settings, len(tokenizer)))
    model.load_state_dict(state)
    model.eval()
    training = {**asdict(settings), "train_texts": settings.n_train, "train_seconds": round(seconds, 2)}
    return model, tokenizer, training


def _pad(rows: Sequence[Sequence[int]], pad_id: int = 0):
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


def measure_classifier(model, tokenizer, texts: Sequence[PlantedText]) -> ClassifierMeasure:
    import torch

    rows = [_ids(tokenizer, t.text) for t in texts]
    deleted = [[r[:t] + r[t + 1:] for t in range(1, len(r) - 1)] for r in rows]  # [CLS] w1..wn [SEP]
    flat = rows + [d for ds in deleted for d in ds]
    ids, mask = _pad(flat)
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


def _cls_word_attention(m: ClassifierMeasure, i: int):
    """[word] the [CLS] row of the last layer, head mean, on the words (not [CLS], [SEP])."""
    return m.attention[i][-1].mean(0)[0, 1:-1]


def _classifier_facts(m: ClassifierMeasure, triggers: Sequence[str] = (TRIGGER,)) -> dict[str, Any]:
    import torch

    labels = torch.tensor([t.label for t in m.texts])
    with_trigger = [i for i, w in enumerate(m.words) if any(x in w for x in triggers)]
    loo_all = [abs(v) for row in m.loo for v in row]
    trigger_loo = [m.loo[i][w.index(x)] for i, w in enumerate(m.words) for x in triggers if x in w]
    other_loo = [abs(m.loo[i][j]) for i, w in enumerate(m.words) for j, x in enumerate(w) if x not in triggers]
    top_attended, top_loo = [], []
    for i in with_trigger:
        present = {j for j, x in enumerate(m.words[i]) if x in triggers}
        attention = _cls_word_attention(m, i)
        top_attended.append(set(attention.argsort(descending=True)[:len(present)].tolist()) == present)
        top_loo.append(set(torch.tensor(m.loo[i]).argsort(descending=True)[:len(present)].tolist()) == present)
    target = m.probs.max(-1).values
    return {
        "study_examples": len(m.texts),
        "examples_with_trigger": len(with_trigger),
        "accuracy": float((torch.tensor(m.predicted) == labels).double().mean()),
        "target_prob_min": float(target.min()),
        "target_prob_mean": float(target.mean()),
        "top_attended_is_trigger": _share(top_attended),
        "top_loo_is_trigger": _share(top_loo),
        "trigger_loo_min": min(trigger_loo) if trigger_loo else None,
        "other_abs_loo_max": max(other_loo) if other_loo else None,
        "other_abs_loo_median": _median(other_loo),
        "max_abs_loo": max(loo_all),
    }


def _share(flags: Sequence[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _build_trigger_saturated():
    model, tokenizer, training = _trained_classifier(SATURATED)
    facts = _classifier_facts(measure_classifier(model, tokenizer, study_texts("trigger-saturated")))
    _require(facts["accuracy"] == 1.0, "trigger-saturated", f"held-out accuracy {facts['accuracy']}")
    _require(facts["target_prob_min"] > 0.99, "trigger-saturated", f"min target prob {facts['target_prob_min']:.4f}")
    _require(facts["top_attended_is_trigger"] >= 0.95, "trigger-saturated",
             f"attention puts zz first on {facts['top_attended_is_trigger']} of the texts holding it")
    return model, tokenizer, {"training": training, "facts": facts}


def _build_twice(settings: ClassifierTraining, name: str):
    """A trigger model (``settings``) measured on texts holding zz twice: the copies substitute for each
    other (deleting one barely moves the prediction, deleting both flips it)."""
    model, tokenizer, training = _trained_classifier(settings)
    m = measure_classifier(model, tokenizer, study_texts(name))
    facts = _classifier_facts(m)
    copies = [[k for k, w in enumerate(words) if w == TRIGGER] for words in m.words]
    facts["copy_loo_max"] = max(abs(m.loo[i][k]) for i, ks in enumerate(copies) for k in ks)
    facts["copies_top2_attended"] = _share([
        set(_cls_word_attention(m, i).argsort(descending=True)[:2].tolist()) == set(ks)
        for i, ks in enumerate(copies)])
    _require(all(len(ks) == 2 for ks in copies), name, "a text without two copies of zz")
    _require(facts["accuracy"] == 1.0, name, f"held-out accuracy {facts['accuracy']}")
    _require(facts["copy_loo_max"] < 0.05, name, f"deleting one copy moves the prediction by "
                                                 f"{facts['copy_loo_max']:.3f}")
    _require(facts["copies_top2_attended"] >= 0.9, name,
             f"attention ranks both copies on top on only {facts['copies_top2_attended']} of the texts")
    return model, tokenizer, {"training": training, "facts": facts}


def _build_trigger_soft():
    model, tokenizer, training = _trained_classifier(SOFT)
    facts = _classifier_facts(measure_classifier(model, tokenizer, study_texts("trigger-soft")))
    _require(facts["accuracy"] == 1.0, "trigger-soft", f"held-out accuracy {facts['accuracy']}")
    _require(facts["target_prob_min"] < 0.97, "trigger-soft", f"min target prob {facts['target_prob_min']:.4f}")
    _require(facts["other_abs_loo_max"] > 1e-6, "trigger-soft", "the other words have no effect at all")
    _require(facts["top_attended_is_trigger"] >= 0.95 and facts["top_loo_is_trigger"] == 1.0, "trigger-soft",
             f"zz first by attention on {facts['top_attended_is_trigger']}, by deletion on "
             f"{facts['top_loo_is_trigger']}")
    return model, tokenizer, {"training": training, "facts": facts}


def _build_two_triggers():
    model, tokenizer, training = _trained_classifier(TWO_TRIGGERS)
    m = measure_classifier(model, tokenizer, study_texts("two-triggers"))
    facts = _classifier_facts(m, triggers=(TRIGGER, SECOND_TRIGGER))
    by_count: dict[int, list[float]] = {}
    for i, w in enumerate(m.words):
        by_count.setdefault(w.count(TRIGGER) + w.count(SECOND_TRIGGER), []).append(float(m.probs[i, 1]))
    facts["p1_mean_by_triggers"] = {str(k): round(sum(v) / len(v), 4) for k, v in sorted(by_count.items())}
    both = [i for i, w in enumerate(m.words) if TRIGGER in w and SECOND_TRIGGER in w]
    facts["examples_with_both"] = len(both)
    facts["each_trigger_loo_min_when_both"] = min(
        m.loo[i][m.words[i].index(x)] for i in both for x in (TRIGGER, SECOND_TRIGGER))
    facts["both_triggers_top2_attended"] = _share([
        set(_cls_word_attention(m, i).argsort(descending=True)[:2].tolist())
        == {m.words[i].index(TRIGGER), m.words[i].index(SECOND_TRIGGER)} for i in both])
    _require(facts["accuracy"] == 1.0, "two-triggers", f"held-out accuracy {facts['accuracy']}")
    _require(facts["each_trigger_loo_min_when_both"] > 0.05, "two-triggers",
             f"a trigger's effect beside the other is only {facts['each_trigger_loo_min_when_both']:.4f}")
    _require(facts["top_attended_is_trigger"] >= 0.95, "two-triggers",
             f"attention ranks the triggers on top on {facts['top_attended_is_trigger']} of the texts")
    return model, tokenizer, {"training": training, "facts": facts}


def _build_uniform_attention():
    model, tokenizer, training = _trained_classifier(UNIFORM)
    m = measure_classifier(model, tokenizer, study_texts("uniform-attention"))
    facts = _classifier_facts(m)
    deviation = 0.0
    for a in m.attention:  # [layer, head, query, key], unpadded
        deviation = max(deviation, float((a - 1.0 / a.shape[-1]).abs().max()))
    facts["attention_max_deviation_from_uniform"] = deviation
    facts["query_key_abs_max"] = max(float(p.detach().abs().max()) for p in _query_key_parameters(model))
    _require(facts["accuracy"] == 1.0, "uniform-attention", f"held-out accuracy {facts['accuracy']}")
    _require(facts["query_key_abs_max"] == 0.0, "uniform-attention", "query/key weights moved in training")
    _require(deviation < 1e-6, "uniform-attention", f"attention deviates from uniform by {deviation}")
    _require(facts["top_loo_is_trigger"] == 1.0, "uniform-attention", "zz is not the most important word")
    return model, tokenizer, {"training": training, "facts": facts}


def _build_constant_output():
    import torch

    model, tokenizer, training = _trained_classifier(SATURATED)
    with torch.no_grad():
        model.classifier.weight.zero_()
    m = measure_classifier(model, tokenizer, study_texts("constant-output"))
    facts = _classifier_facts(m)
    facts["target_prob_range"] = float(m.probs.max(-1).values.max() - m.probs.max(-1).values.min())
    _require(facts["max_abs_loo"] == 0.0 and facts["target_prob_range"] == 0.0, "constant-output",
             f"the output varies (max |LOO| {facts['max_abs_loo']})")
    return model, tokenizer, {"training": training, "derived_from": "trigger-saturated, classifier.weight = 0",
                              "facts": facts}


def _build_below_noise():
    import torch

    model, tokenizer, training = _trained_classifier(SATURATED)
    reference = _classifier_facts(measure_classifier(model, tokenizer, study_texts("below-noise")))
    with torch.no_grad():
        model.classifier.weight.mul_(BELOW_NOISE_SCALE)
        model.classifier.bias.mul_(BELOW_NOISE_SCALE)
    m = measure_classifier(model, tokenizer, study_texts("below-noise"))
    facts = _classifier_facts(m)
    facts["scale"] = BELOW_NOISE_SCALE
    facts["max_abs_loo_before_scaling"] = reference["max_abs_loo"]
    facts["float32_step_at_0.5"] = float(torch.finfo(torch.float32).eps / 2)
    _require(0 < facts["max_abs_loo"] <= 3e-7, "below-noise", f"max |LOO| is {facts['max_abs_loo']:.3g}")
    return model, tokenizer, {"training": training, "derived_from": f"trigger-saturated, classifier x "
                                                                    f"{BELOW_NOISE_SCALE}",
                              "facts": facts}


def _build_randomised():
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer("bert")
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(_bert_config(SATURATED, len(tokenizer)))
    model.eval()
    facts = _classifier_facts(measure_classifier(model, tokenizer, study_texts("randomised")))
    return model, tokenizer, {"training": None, "init": "transformers' default initialisation, seed 0", "facts": facts}


# ------------------------------------------------------------------------- attention-is-importance

#: a word's salience in [0, 1] sets its [CLS] attention score to SCORE_SCALE * salience
SCORE_SCALE = 3.0
SPECIAL_SALIENCE = 0.75  # [CLS], [SEP], [PAD], [MASK]: attended like a word of salience 0.75, value 0
MASS_GAIN = 1.0  # the attention output adds MASS_GAIN * (attention mass on words) to the [CLS] stream
LOGIT_GAIN = 6.0


def _build_attention_is_importance():
    """One layer, one head, hidden 8. Every embedding is ``[z, -z]`` with ``|z|^2 = 4`` (mean 0, variance 1),
    so the embedding LayerNorm is the identity. z = [is CLS, salience, is word, filler]. The [CLS] query
    reads "is CLS", keys read the salience, values read "is word": the attention output is the attention
    mass A on words times a unit vector; deleting word t lowers A by more the larger its weight. The
    residual LayerNorm keeps A in a component that rises with A; the FFN writes nothing; the pooler and
    classifier are monotone in that component, with a bias that keeps class 1 predicted for every A >= 0.
    """
    import random

    import torch
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer("bert")
    vocab = tokenizer.get_vocab()
    torch.manual_seed(SEED)
    settings = ClassifierTraining(hidden=8, heads=1, layers=1)
    config = _bert_config(settings, len(tokenizer))
    config.intermediate_size = 4
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    model = BertForSequenceClassification(config)

    words = ["[UNK]", *WORDS]  # attended and valued like words: an unknown word is scored as a word
    saliences = [i / (len(words) - 1) for i in range(len(words))]
    random.Random(SEED).shuffle(saliences)
    z = torch.zeros(len(tokenizer), 4)  # [vocab, 4]
    for token, index in vocab.items():
        if token in words:
            s = saliences[words.index(token)]
            z[index] = torch.tensor([0.0, s, 1.0, math.sqrt(3.0 - s * s)])
        elif token == "[CLS]":
            z[index] = torch.tensor([1.0, SPECIAL_SALIENCE, 0.0, math.sqrt(3.0 - SPECIAL_SALIENCE ** 2)])
        else:
            z[index] = torch.tensor([0.0, SPECIAL_SALIENCE, 0.0, math.sqrt(4.0 - SPECIAL_SALIENCE ** 2)])
    head_dim = 8
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.bert.embeddings
        emb.word_embeddings.weight.copy_(torch.cat([z, -z], dim=1))  # position and type embeddings stay 0
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        layer = model.bert.encoder.layer[0]
        attention = layer.attention.self
        attention.query.weight[0, 0] = SCORE_SCALE * math.sqrt(head_dim)  # query: "is CLS", scaled
        attention.key.weight[0, 1] = 1.0  # key: the salience
        attention.value.weight[0, 2] = 1.0  # value: "is word"
        dense = layer.attention.output.dense
        dense.weight[1, 0], dense.weight[5, 0] = MASS_GAIN, -MASS_GAIN  # zero-mean write of the mass A
        pooler = model.bert.pooler.dense
        pooler.weight[0, 1] = 1.0
        floor = _mass_component(0.0)  # the component at A = 0: class 1 stays predicted above it
        model.classifier.weight[1, 0] = LOGIT_GAIN
        model.classifier.bias[1] = 0.1 - LOGIT_GAIN * math.tanh(floor)
    model.eval()

    m = measure_classifier(model, tokenizer, study_texts("attention-is-importance"))
    taus = [_kendall_tau(_cls_word_attention(m, i).tolist(), m.loo[i]) for i in range(len(m.texts))]
    target = m.probs.max(-1).values
    facts = {
        "study_examples": len(m.texts),
        "tau_attention_loo": [round(t, 6) for t in taus],
        "tau_attention_loo_min": min(taus),
        "predicted_class_1_share": _share([c == 1 for c in m.predicted]),
        "target_prob_min": float(target.min()),
        "target_prob_max": float(target.max()),
        "loo_min": min(v for row in m.loo for v in row),
        "loo_min_gap_between_words": min(
            (b - a for row in m.loo for a, b in zip(sorted(row), sorted(row)[1:])), default=None),
        "max_abs_loo": max(abs(v) for row in m.loo for v in row),
    }
    _require(facts["tau_attention_loo_min"] == 1.0, "attention-is-importance",
             f"Kendall tau between attention and deletion effect is {facts['tau_attention_loo_min']} on some text")
    _require(facts["predicted_class_1_share"] == 1.0, "attention-is-importance", "class 0 predicted somewhere")
    return model, tokenizer, {"training": None, "construction": _build_attention_is_importance.__doc__.strip(),
                              "saliences": dict(zip(words, saliences)), "facts": facts}


def _mass_component(mass: float) -> float:
    """The pooled-in component of the [CLS] stream after the residual LayerNorm, for attention mass ``mass``."""
    y = SPECIAL_SALIENCE + MASS_GAIN * mass
    rest = 1.0 + 3.0 - SPECIAL_SALIENCE ** 2  # the other components of z for [CLS], squared
    return y / math.sqrt((rest + y * y) / 4.0)


def _layer_norms(model):
    import torch

    return [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]


def _kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties handled; 1.0 for identical rankings)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denominator if denominator else float("nan")


# ---------------------------------------------------------------------- position-heads, one-head

#: 6 layers x 12 heads (72 heads), as the verdict's calibration needs many units
MANY_LAYERS, MANY_HEADS, MANY_HEAD_DIM = 6, 12, 4
#: z = [signal, trigger, is CLS, 6 word dims, word filler | 13 position dims, position filler]
_Z_WORD, _Z_POSITION = 10, 14
_WORD_NORM2, _POSITION_NORM2 = 4.0, 20.0  # |word part|^2 + |position part|^2 = 24 = hidden / 2
POSITION_SCORE_STD = 2.0  # the spread of a position head's [CLS] scores over the keys
#: one-head: the planted layer's other heads share one pattern, sharper, so their mean has a clear positional
#: peak that the planted head's 1/12 share on zz does not outweigh: the layer mean stays positional
LAST_LAYER_SHARPNESS, LAST_LAYER_SPREAD = 2.0, 0.3
PLANTED_HEAD = (MANY_LAYERS - 1, 7)  # one-head: the head whose key reads the trigger
PLANTED_HEAD_SCORE = 8.0  # its [CLS] score on zz (0 elsewhere): about all of its attention
SIGNAL_GAIN, POOL_GAIN, POSITION_LOGIT_GAIN, POSITION_LOGIT_BIAS = 1.0, 1.0, 4.0, 0.1


def _build_position_heads():
    return _many_heads(planted_head=False)


def _build_one_head():
    return _many_heads(planted_head=True)


def _many_heads(planted_head: bool):
    """6 layers x 12 heads, hidden 48, hand-wired (no training). Every embedding is ``[z, -z]`` (mean 0)
    with ``|z|^2 = 24`` (variance 1): the word embedding fills z's word part and the position embedding
    its position part, each to a fixed norm, so every LayerNorm is the identity on them. Every head's
    query and key read the position part only (random weights, seeded): its [CLS] row depends on the
    positions alone, never on which word stands where. Layers 0-4 write nothing (value, output and FFN
    weights zero), so every layer's input is the embeddings and every head's attention is exactly
    positional. In the last layer every head's value reads the trigger coordinate (1 for zz, 0 for any
    other token) and the output adds the summed attention on zz, s, to the [CLS] signal coordinate;
    the pooler and classifier rise with it, class 1 is predicted on every text (each holds zz once),
    and deleting zz removes s. With ``planted_head`` (one-head) the last layer's head 7 is the
    exception: its query reads "is CLS" and its key the trigger coordinate, so it puts almost all of
    its attention on zz, wherever zz stands; the layer's other 11 heads share one sharper positional
    pattern, so the layer's head mean peaks on a position, not on zz."""
    import torch
    from transformers import BertForSequenceClassification

    tokenizer = _tokenizer("bert")
    vocab = tokenizer.get_vocab()
    generator = torch.Generator().manual_seed(SEED + 11)
    settings = ClassifierTraining(hidden=2 * (_Z_WORD + _Z_POSITION), heads=MANY_HEADS, layers=MANY_LAYERS)
    config = _bert_config(settings, len(tokenizer))
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    model = BertForSequenceClassification(config)
    d = _Z_WORD + _Z_POSITION

    def fill(vector: torch.Tensor, norm2: float) -> torch.Tensor:  # last entry tops the norm up
        vector = vector.clone()
        vector[-1] = 0.0
        vector[:-1] *= min(1.0, math.sqrt(0.75 * norm2) / max(float(vector[:-1].norm()), 1e-9))
        vector[-1] = math.sqrt(norm2 - float(vector[:-1].pow(2).sum()))
        return vector

    word = torch.zeros(len(tokenizer), _Z_WORD)  # [vocab, word part]
    for token, index in vocab.items():
        part = torch.zeros(_Z_WORD)
        part[3:9] = torch.randn(6, generator=generator) * 0.5
        part[1] = 1.0 if token == TRIGGER else 0.0
        part[2] = 1.0 if token == "[CLS]" else 0.0
        part[-1] = 0.0
        word[index] = fill(part, _WORD_NORM2)
    position = torch.stack([fill(torch.cat([torch.randn(_Z_POSITION - 1, generator=generator), torch.zeros(1)]),
                                 _POSITION_NORM2) for _ in range(MAX_POSITIONS)])  # [position, position part]
    heads = MANY_HEADS * MANY_HEAD_DIM
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        emb = model.bert.embeddings
        z_word = torch.cat([word, torch.zeros(len(tokenizer), _Z_POSITION)], dim=1)
        z_position = torch.cat([torch.zeros(MAX_POSITIONS, _Z_WORD), position], dim=1)
        emb.word_embeddings.weight.copy_(torch.cat([z_word, -z_word], dim=1))
        emb.position_embeddings.weight.copy_(torch.cat([z_position, -z_position], dim=1))
        scale = POSITION_SCORE_STD * math.sqrt(math.sqrt(MANY_HEAD_DIM) / _POSITION_NORM2)  # score std ~ the target
        for index, layer in enumerate(model.bert.encoder.layer):
            attention = layer.attention.self
            for weight in (attention.query.weight, attention.key.weight):
                draw = torch.randn(heads, _Z_POSITION, generator=generator)
                if planted_head and index == MANY_LAYERS - 1:  # the other heads share one sharp positional pattern
                    common = torch.randn(MANY_HEAD_DIM, _Z_POSITION, generator=generator).repeat(MANY_HEADS, 1)
                    draw = LAST_LAYER_SHARPNESS * (common + LAST_LAYER_SPREAD * draw)
                weight[:, _Z_WORD:d] = draw * scale / math.sqrt(_Z_POSITION)
        last = model.bert.encoder.layer[-1]
        for h in range(MANY_HEADS):
            last.attention.self.value.weight[h * MANY_HEAD_DIM, 1] = 1.0  # every head's value: the trigger coordinate
            last.attention.output.dense.weight[0, h * MANY_HEAD_DIM] = SIGNAL_GAIN  # zero-mean write of s
            last.attention.output.dense.weight[d, h * MANY_HEAD_DIM] = -SIGNAL_GAIN
        if planted_head:
            _, h = PLANTED_HEAD
            rows = slice(h * MANY_HEAD_DIM, (h + 1) * MANY_HEAD_DIM)
            last.attention.self.query.weight[rows] = 0.0
            last.attention.self.key.weight[rows] = 0.0
            last.attention.self.query.weight[h * MANY_HEAD_DIM, 2] = PLANTED_HEAD_SCORE * math.sqrt(MANY_HEAD_DIM)
            last.attention.self.key.weight[h * MANY_HEAD_DIM, 1] = 1.0
        model.bert.pooler.dense.weight[0, 0] = POOL_GAIN
        model.classifier.weight[1, 0] = POSITION_LOGIT_GAIN
        model.classifier.bias[1] = POSITION_LOGIT_BIAS
    model.eval()

    name = "one-head" if planted_head else "position-heads"
    m = measure_classifier(model, tokenizer, study_texts(name))
    facts = _classifier_facts(m)
    swaps = _trigger_swap_change(model, tokenizer, m.texts)
    facts.update({"predicted_class_1_share": _share([c == 1 for c in m.predicted]), **swaps})
    if planted_head:
        layer, h = PLANTED_HEAD
        on_trigger = [float(m.attention[i][layer, h, 0, 1:-1][w.index(TRIGGER)]) for i, w in enumerate(m.words)]
        facts["planted_head_attention_on_trigger_min"] = min(on_trigger)
        _require(min(on_trigger) > 0.9, name, f"the planted head puts only {min(on_trigger):.3f} on zz somewhere")
    else:
        _require(swaps["position_heads_max_change_when_zz_moves"] < 1e-5, name,
                 f"moving zz changes a head's attention by {swaps['position_heads_max_change_when_zz_moves']:.1e}")
    _require(facts["top_loo_is_trigger"] == 1.0, name, f"deleting zz is the largest effect on "
                                                       f"{facts['top_loo_is_trigger']}")
    _require(facts["predicted_class_1_share"] == 1.0, name, "class 0 predicted somewhere")
    return model, tokenizer, {"training": None, "construction": _many_heads.__doc__.strip(), "facts": facts}


def _trigger_swap_change(model, tokenizer, texts: Sequence[PlantedText]) -> dict[str, float]:
    """The largest change of any position head's [CLS] row when zz trades places with another word
    (a plain eager forward of both texts): 0 up to rounding where attention depends on positions only."""
    import torch

    worst = 0.0
    for text in texts[:16]:
        words = text.text.split()
        t = words.index(TRIGGER)
        other = (t + 1) % len(words)
        swapped = list(words)
        swapped[t], swapped[other] = swapped[other], swapped[t]
        rows = [_ids(tokenizer, " ".join(w)) for w in (words, swapped)]
        ids, mask = _pad(rows)
        with torch.no_grad():
            attentions = torch.stack(model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions, 1)
        cls = attentions[:, :, :, 0, :]  # [2, layer, head, key]
        keep = torch.ones(MANY_LAYERS, MANY_HEADS, dtype=torch.bool)
        keep[PLANTED_HEAD] = False
        worst = max(worst, float((cls[0] - cls[1]).abs()[keep].max()))
    return {"position_heads_max_change_when_zz_moves": worst}


# ---------------------------------------------------------------------------- sink-head, edge-head

#: z = [is CLS, trigger (zz), sink (yy), salience, signal (0 in every embedding), filler]: |z|^2 = 6 = hidden / 2
_Z_HEAD = 6
SINK_SCORE = 4.0  # sink-head: the [CLS] score on yy; zz scores 0, a filler word its salience
SALIENCE_MAX = 1.5  # sink-head: the filler words' saliences, distinct, in (0, SALIENCE_MAX]
EDGE_SCORE = 6.0  # edge-head: the [CLS] score on zz (every other key scores 0): about all of the head's attention
#: the attention output adds GAIN x (the head's attention on zz) to the [CLS] signal coordinate
SINK_SIGNAL_GAIN, EDGE_SIGNAL_GAIN = 30.0, 2.0
HEAD_LOGIT_GAIN, HEAD_LOGIT_BIAS = 6.0, 0.1


def _build_sink_head():
    return _one_head_edges(sink=True)


def _build_edge_head():
    return _one_head_edges(sink=False)


def _one_head_edges(sink: bool):
    """One layer, one head, hidden 12, hand-wired (no training). Every embedding is ``[z, -z]`` with
    ``|z|^2 = 6`` (mean 0, variance 1; position and type embeddings zero), so every LayerNorm is the
    identity on it; z = [is CLS, trigger, sink, salience, signal, filler]. The [CLS] query reads
    "is CLS"; the head's value reads the trigger coordinate only (1 for zz, 0 for every other token:
    the value path of every other token is zeroed); the attention output adds the gain times the
    [CLS] row's weight on zz to the [CLS] signal coordinate (zero-mean), the FFN writes nothing, and
    the pooler and classifier rise with that coordinate (class 1 predicted on every text).

    sink-head (texts holding zz and yy once each): the key reads the sink coordinate (yy scores
    SINK_SCORE: about three quarters of the row) and each filler word's salience (distinct, below
    yy's); zz scores 0, the least of all. Where the head looks (yy, then the fillers by salience) is
    the reverse of what matters through it: blocking the edge to yy removes nothing the head writes
    (its value is zero; with the row renormalised the freed mass moves onto zz and the target
    rises), blocking the edge to zz removes the decision.

    edge-head (texts holding zz once): the key reads the trigger coordinate (zz scores EDGE_SCORE,
    every other key 0, so the fillers tie): the head puts over 90% of its row on zz, and that edge
    carries the decision (blocking it, as deleting zz, takes the signal away)."""
    import torch
    from transformers import BertForSequenceClassification

    name = "sink-head" if sink else "edge-head"
    tokenizer = _tokenizer("bert")
    vocab = tokenizer.get_vocab()
    settings = ClassifierTraining(hidden=2 * _Z_HEAD, heads=1, layers=1)
    config = _bert_config(settings, len(tokenizer))
    config.intermediate_size = 4
    config.id2label, config.label2id = {0: "low", 1: "high"}, {"low": 0, "high": 1}
    torch.manual_seed(SEED)
    model = BertForSequenceClassification(config)
    saliences = {word: SALIENCE_MAX * (i + 1) / len(FILLER) for i, word in enumerate(FILLER)}
    z = torch.zeros(len(tokenizer), _Z_HEAD)  # [vocab, z]
    for token, index in vocab.items():
        part = torch.zeros(_Z_HEAD)
        part[0] = 1.0 if token == "[CLS]" else 0.0
        part[1] = 1.0 if token == TRIGGER else 0.0
        part[2] = 1.0 if token == SECOND_TRIGGER else 0.0
        part[3] = saliences.get(token, 0.0)
        part[5] = math.sqrt(_Z_HEAD - float(part[:5].pow(2).sum()))
        z[index] = part
    head_dim = 2 * _Z_HEAD
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in _layer_norms(model):
            norm.weight.fill_(1.0)
        model.bert.embeddings.word_embeddings.weight.copy_(torch.cat([z, -z], dim=1))
        layer = model.bert.encoder.layer[0]
        attention = layer.attention.self
        attention.query.weight[0, 0] = math.sqrt(head_dim)  # "is CLS", so the [CLS] scores are the key's value
        if sink:
            attention.key.weight[0, 2] = SINK_SCORE
            attention.key.weight[0, 3] = 1.0  # the filler's salience
        else:
            attention.key.weight[0, 1] = EDGE_SCORE
        attention.value.weight[0, 1] = 1.0  # the trigger coordinate: every other token's value is zero
        gain = SINK_SIGNAL_GAIN if sink else EDGE_SIGNAL_GAIN
        dense = layer.attention.output.dense
        dense.weight[4, 0], dense.weight[_Z_HEAD + 4, 0] = gain, -gain
        model.bert.pooler.dense.weight[0, 4] = 1.0
        model.classifier.weight[1, 0] = HEAD_LOGIT_GAIN
        model.classifier.bias[1] = HEAD_LOGIT_BIAS
    model.eval()

    texts = study_texts(name)
    m = measure_classifier(model, tokenizer, texts)
    knocked = _cls_edge_knockout(model, tokenizer, texts)  # [example][word]: renormalised, by -inf before the softmax
    zeroed = _cls_edge_knockout(model, tokenizer, texts, renormalise=False)
    rows = [m.attention[i][0, 0, 0, 1:-1] for i in range(len(texts))]  # [example] -> [word] the [CLS] row
    trigger = [w.index(TRIGGER) for w in m.words]
    top_knockout = [max(range(len(k)), key=k.__getitem__) == t for k, t in zip(knocked, trigger)]
    facts = {
        "study_examples": len(texts),
        "predicted_class_1_share": _share([c == 1 for c in m.predicted]),
        "target_prob_min": float(m.probs.max(-1).values.min()),
        "top_knockout_is_trigger": _share(top_knockout),
        "top_loo_is_trigger": _share([max(range(len(r)), key=r.__getitem__) == t for r, t in zip(m.loo, trigger)]),
        "trigger_knockout_min": min(k[t] for k, t in zip(knocked, trigger)),
    }
    if sink:
        sinks = [w.index(SECOND_TRIGGER) for w in m.words]
        facts.update({
            "sink_attention_min": min(float(r[s]) for r, s in zip(rows, sinks)),
            "top_attended_is_sink": _share([int(r.argmax()) == s for r, s in zip(rows, sinks)]),
            "sink_knockout_renormalised_max": max(k[s] for k, s in zip(knocked, sinks)),
            "sink_knockout_zeroed_max_abs": max(abs(k[s]) for k, s in zip(zeroed, sinks)),
            "trigger_attention_max": max(float(r[t]) for r, t in zip(rows, trigger)),
            "tau_attention_knockout": [round(_kendall_tau(r.tolist(), k), 6) for r, k in zip(rows, knocked)],
        })
        _require(facts["sink_attention_min"] > 0.5, name, f"the head puts only {facts['sink_attention_min']:.3f} on yy")
        # the yy value is exactly zero; the rows of one batch differ by float rounding only
        _require(facts["sink_knockout_zeroed_max_abs"] < 1e-6, name, "zeroing the edge to yy moves the target")
        _require(facts["sink_knockout_renormalised_max"] < 0.0, name, "blocking the edge to yy does not lower "
                                                                      "the target's support")
        _require(max(facts["tau_attention_knockout"]) < 0.0, name, "attention and knockout agree somewhere")
    else:
        # the fillers tie in attention (each scores 0); their knockout effects differ by float rounding only
        facts["trigger_attention_min"] = min(float(r[t]) for r, t in zip(rows, trigger))
        facts["top_attended_is_trigger"] = _share([int(r.argmax()) == t for r, t in zip(rows, trigger)])
        facts["other_knockout_max_abs"] = max(abs(v) for k, t in zip(knocked, trigger) for j, v in enumerate(k) if j != t)
        _require(facts["trigger_attention_min"] > 0.9, name, f"the head puts only {facts['trigger_attention_min']:.3f} "
                                                             "on zz")
    _require(facts["top_knockout_is_trigger"] == 1.0, name, "blocking the edge to zz is not the largest effect")
    _require(facts["top_loo_is_trigger"] == 1.0, name, "deleting zz is not the largest effect")
    _require(facts["predicted_class_1_share"] == 1.0, name, "class 0 predicted somewhere")
    return model, tokenizer, {"training": None, "construction": _one_head_edges.__doc__.strip(), "facts": facts}


def _cls_edge_knockout(model, tokenizer, texts: Sequence[PlantedText], renormalise: bool = True) -> list[list[float]]:
    """``[example][word]``: p(predicted | text) - the same with the [CLS] row's edge to the word blocked
    in the (one) layer's attention, by plain forwards: renormalised, the key's score set to -inf in the
    additive mask the eager attention adds before its softmax; not renormalised, the word's weighted
    value taken out of the [CLS] context (the other weights kept)."""
    import torch

    attention = model.bert.encoder.layer[0].attention.self
    out = []
    for text in texts:
        ids = _ids(tokenizer, text.text)
        n = len(ids)
        rows = torch.tensor([ids] * (n - 1))  # row 0 the text, row r blocks the edge [CLS] -> word r
        mask = torch.zeros(n - 1, 1, n, n)  # [row, 1, query, key] additive
        for r in range(1, n - 1):
            mask[r, 0, 0, r] = float("-inf")
        def pre(module, args, kwargs, mask=mask):
            if renormalise:
                kwargs["attention_mask"] = mask
            return args, kwargs

        def post(module, args, kwargs, output, n=n):
            if renormalise:
                return output
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            values = module.value(hidden)  # [row, seq, hidden]: one head
            context, weights = output[0].clone(), output[1]  # [row, seq, hidden], [row, 1, query, key]
            for r in range(1, n - 1):
                context[r, 0] -= weights[r, 0, 0, r] * values[r, r]
            return (context, weights)

        handles = [attention.register_forward_pre_hook(pre, with_kwargs=True),
                   attention.register_forward_hook(post, with_kwargs=True)]
        try:
            with torch.no_grad():
                probs = model(input_ids=rows, output_attentions=True).logits.double().softmax(-1)  # [row, 2]
        finally:
            for handle in handles:
                handle.remove()
        c = int(probs[0].argmax())
        out.append((probs[0, c] - probs[1:, c]).tolist())
    return out


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


def _build_copy_lm(cue: str | None = None):
    """copy-lm; with ``cue``, copy-lm-cue: every prompt (training and study) ends with the word ``cue``,
    and deletion (the recipe's and the study's) removes text words only, never the cue."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    name = "copy-lm-cue" if cue else "copy-lm"
    suffix = f" {cue}" if cue else ""
    settings = COPY_LM
    tokenizer = _tokenizer("gpt2")
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=MAX_POSITIONS, n_embd=settings.hidden, n_layer=settings.layers,
        n_head=settings.heads, n_inner=2 * settings.hidden, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, attn_implementation="eager",
    )
    torch.manual_seed(settings.seed)
    model = GPT2LMHeadModel(config)
    train = _with_unmarked(training_texts("copy", settings.n_train, seed=settings.seed), settings.seed)
    prompts = [_ids(tokenizer, t.text + suffix) for t in train]
    answers = torch.tensor([tokenizer.convert_tokens_to_ids(t.answer) if t.answer else eos
                            for t in train])  # [example] a prompt without a marked word continues with eos
    ids, mask = _pad(prompts, eos)  # [example, seq]
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
    seconds = time.perf_counter() - started

    study = study_texts(name)
    rows = [_ids(tokenizer, t.text + suffix) for t in study]
    kept = 1 if cue else 0  # the cue is never deleted
    deleted = [[r[:t] + r[t + 1:] for t in range(len(r) - kept)] for r in rows]
    flat = rows + [d for ds in deleted for d in ds]
    ids, mask = _pad(flat, eos)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    last = mask.sum(-1) - 1  # [row]
    logprobs = out.logits.double().log_softmax(-1)[torch.arange(len(flat)), last]  # [row, vocab]
    n = len(rows)
    greedy = logprobs[:n].argmax(-1)  # [example]
    attention = torch.stack(out.attentions, dim=1)  # [row, layer, head, query, key]
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
        "greedy_accuracy": _share(correct),
        "attention_layer": settings.layers - 1,
        "top_attended_is_marked": _share(top_attended),
        "marked_attention_mean": round(sum(marked_mass) / n, 4),
        "top_loo_is_marked": _share(top_loo),
        "marked_loo_min": min(loo_marked),
        "other_abs_loo_max": max(loo_other),
    }
    if cue:
        facts["cue"] = cue
        facts["top_rollout_is_marked"] = _share(top_rollout)
    _require(facts["greedy_accuracy"] == 1.0, name, f"greedy accuracy {facts['greedy_accuracy']}")
    _require(facts["top_attended_is_marked"] >= 0.95, name,
             f"attention peaks on the marked word on {facts['top_attended_is_marked']} of the prompts")
    training = {**asdict(settings), "train_seconds": round(seconds, 2)}
    return model, tokenizer, {"training": training, "facts": facts}


# ------------------------------------------------------------------------------------ copy-seq2seq


def _build_copy_seq2seq():
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    settings = COPY_SEQ2SEQ
    tokenizer = _tokenizer("t5")
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = T5Config(
        vocab_size=len(tokenizer), d_model=settings.hidden, d_kv=settings.hidden // settings.heads,
        d_ff=2 * settings.hidden, num_layers=settings.layers, num_decoder_layers=settings.layers,
        num_heads=settings.heads, dropout_rate=0.0, pad_token_id=pad, eos_token_id=eos,
        decoder_start_token_id=pad, attn_implementation="eager",
    )
    torch.manual_seed(settings.seed)
    model = T5ForConditionalGeneration(config)
    train = _with_unmarked(training_texts("copy", settings.n_train, seed=settings.seed), settings.seed)
    ids, mask = _pad([_ids(tokenizer, t.text) for t in train], pad)  # [example, seq]
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
    seconds = time.perf_counter() - started

    study = study_texts("copy-seq2seq")
    rows = [_ids(tokenizer, t.text) for t in study]  # words then </s>
    n = len(rows)
    with torch.no_grad():
        # greedy: the first output token, then what follows it
        ids, mask = _pad(rows, pad)
        start = torch.full((n, 1), pad)
        first_token = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start).logits[:, -1].argmax(-1)
        decoder = torch.cat([start, first_token[:, None]], dim=1)  # [example, 2]
        second_token = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits[:, -1].argmax(-1)
        outputs = torch.stack([first_token, second_token], dim=1)  # [example, 2] greedy output: word, </s>
        # deletions: every source word (not </s>)
        deleted = [(i, t, r[:t] + r[t + 1:]) for i, r in enumerate(rows) for t in range(len(r) - 1)]
        flat = rows + [d for _, _, d in deleted]
        owner = list(range(n)) + [i for i, _, _ in deleted]
        ids, mask = _pad(flat, pad)
        target = outputs[owner]  # [row, 2]
        decoder = torch.cat([torch.full((len(flat), 1), pad), target[:, :1]], dim=1)  # [row, 2]
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, output_attentions=True)
    logprob = out.logits.double().log_softmax(-1).gather(-1, target[..., None])[..., 0].sum(-1)  # [row]
    cross = out.cross_attentions[-1].mean(1)  # [row, decoder position, key] last layer, head mean
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
        "greedy_accuracy": _share(correct),
        "cross_attention_layer": settings.layers - 1,
        "top_cross_attended_is_marked_first_output": _share(top_first),
        "top_cross_attended_is_marked_output_mean": _share(top_mean),
        "top_loo_is_marked": _share(top_loo),
        "marked_loo_min": min(loo_marked),
    }
    _require(facts["greedy_accuracy"] == 1.0, "copy-seq2seq", f"greedy accuracy {facts['greedy_accuracy']}")
    _require(facts["top_cross_attended_is_marked_output_mean"] >= 0.95, "copy-seq2seq",
             f"cross-attention peaks on the marked word on {facts['top_cross_attended_is_marked_output_mean']}")
    training = {**asdict(settings), "train_seconds": round(seconds, 2)}
    return model, tokenizer, {"training": training, "facts": facts}


_BUILDERS: dict[str, Callable[[], tuple[Any, Any, dict[str, Any]]]] = {
    "trigger-saturated": _build_trigger_saturated,
    "trigger-twice": lambda: _build_twice(SATURATED, "trigger-twice"),
    "trigger-twice-soft": lambda: _build_twice(SOFT, "trigger-twice-soft"),
    "trigger-soft": _build_trigger_soft,
    "two-triggers": _build_two_triggers,
    "uniform-attention": _build_uniform_attention,
    "attention-is-importance": _build_attention_is_importance,
    "constant-output": _build_constant_output,
    "below-noise": _build_below_noise,
    "randomised": _build_randomised,
    "copy-lm": _build_copy_lm,
    "copy-lm-cue": lambda: _build_copy_lm(cue=COPY_CUE),
    "copy-seq2seq": _build_copy_seq2seq,
    "position-heads": _build_position_heads,
    "one-head": _build_one_head,
    "sink-head": _build_sink_head,
    "edge-head": _build_edge_head,
}
