"""Planted-truth models: tiny models whose token importance is known by construction.

Each recipe builds (seeded, deterministic, a few CPU seconds) a model that loads as ``planted:NAME``
with its study data ``planted:NAME`` (64 held-out texts, :mod:`probe.data.planted_texts`). The verdict
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

This module holds the table and that life cycle; the recipes are in :mod:`probe.models.planted_classifiers`
(trained BERT classifiers), :mod:`probe.models.planted_wired` (hand-wired attention) and
:mod:`probe.models.planted_copy` (trained copy models), their shared parts in :mod:`probe.models.planted_parts`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probe.data.planted_texts import PREFIX, SECOND_TRIGGER, study_texts
from probe.errors import ModelLoadError
from probe.files import remove_leftovers, staged_folder
from probe.models.builtins import (
    CACHE_FIX,
    METADATA_FILE,
    default_cache_dir,
    exclusive_lock,
    package_versions,
)
from probe.models.planted_classifiers import (
    SATURATED,
    SOFT,
    build_below_noise,
    build_constant_output,
    build_randomised,
    build_trigger_saturated,
    build_trigger_soft,
    build_twice,
    build_two_triggers,
    build_uniform_attention,
)
from probe.models.planted_copy import build_copy_lm, build_copy_seq2seq
from probe.models.planted_parts import SEED
from probe.models.planted_wired import (
    build_attention_is_importance,
    build_edge_head,
    build_one_head,
    build_position_heads,
    build_sink_head,
)

if TYPE_CHECKING:  # imported for annotations only
    import torch

ANSWERS = ("yes", "heads only", "no", "undecidable")
DATA_FILE = "data.jsonl"
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
        recipe_version=2,  # 2: the word parts drawn in token-id order, the same in every process
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
        recipe_version=2,  # 2: the word parts drawn in token-id order, the same in every process
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
        remove_leftovers(root, f".{recipe.name}.building-")  # from killed builds: we hold the lock
        with staged_folder(final, f".{recipe.name}.building-", CACHE_FIX) as staging:
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


def weights_sha256(model: torch.nn.Module) -> str:
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


# ------------------------------------------------------------------------------- the recipes, by name

_BUILDERS: dict[str, Callable[[], tuple[Any, Any, dict[str, Any]]]] = {
    "trigger-saturated": build_trigger_saturated,
    "trigger-twice": lambda: build_twice(SATURATED, "trigger-twice"),
    "trigger-twice-soft": lambda: build_twice(SOFT, "trigger-twice-soft"),
    "trigger-soft": build_trigger_soft,
    "two-triggers": build_two_triggers,
    "uniform-attention": build_uniform_attention,
    "attention-is-importance": build_attention_is_importance,
    "constant-output": build_constant_output,
    "below-noise": build_below_noise,
    "randomised": build_randomised,
    "copy-lm": build_copy_lm,
    "copy-lm-cue": lambda: build_copy_lm(cue=COPY_CUE),
    "copy-seq2seq": build_copy_seq2seq,
    "position-heads": build_position_heads,
    "one-head": build_one_head,
    "sink-head": build_sink_head,
    "edge-head": build_edge_head,
}
