"""Targets: the scalar an explanation explains, and batched evaluation of it on token rows.

A *row* is one sequence of token ids in the explained input (the classifier's text, the causal
LM's prompt, the seq2seq source), perturbed or not, paired with the example it belongs to. Every
method (capture, gradients, interventions) evaluates its target through :func:`build_rows` and
:func:`target_values`, so they all explain exactly the same number.

Layouts (right padding everywhere):
    classification  [input][pad]                        value from logits[row, label]
    causal_lm       [input][continuation][pad]          sum of log p(continuation token | prefix)
    seq2seq         encoder [input][pad], decoder [start][output[:-1]][pad]   sum of log p(output)
    encoder         [input][pad]                        from the pooled embedding [row, hidden]: its cosine
                                                        similarity to a reference text's, or one dimension

A *contrastive* target ("why this rather than that", Yin & Neubig 2022) explains a difference from the
same forward pass: a classifier's ``logit[label] - logit[contrast_label]`` (``TargetSpec.contrast_label``),
a language model's sum over the target positions j of ``log p(target_j | prefix, target_<j) -
log p(foil_j | prefix, target_<j)`` (``TargetSpec.contrast``, a foil text aligned token by token with
the target; kind ``logit``: the logits' difference). See :func:`contrast_terms`.

A headless encoder (:mod:`probe.models.encoder`) has no class: its targets are ``similarity``
(cosine of the input's pooled embedding with the fixed embedding of ``TargetSpec.reference``) and
``dimension`` (component ``TargetSpec.dimension`` of the pooled embedding).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError, ProbeError

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

#: every target kind; which a model takes is its task's (:attr:`probe.tasks.Task.kinds`)
TARGET_KINDS = ("prob", "logit", "logprob", "similarity", "dimension")


@dataclass(frozen=True)
class TargetSpec:
    """What to explain. ``label``: class index or name (default: the predicted class).
    ``continuation``: text whose log-prob a causal LM / seq2seq model explains (default: the
    greedy next token for a causal LM, the greedy output for seq2seq). Either may be a tuple
    with one value per text (:func:`prepare` checks the count).

    ``contrast_label`` (classifiers; index or name): explain ``logit[label] - logit[contrast_label]``
    (kind logit or logprob, the same number; the default kind becomes logit; prob is refused).
    ``contrast`` (language models): a foil text, tokenised as the continuation is, into as many tokens
    as the target or into one (then the foil at every target position); the target becomes the
    log-prob (kind logit: logit) of the target tokens minus that of the foil tokens at the same
    positions, after the same prefix (prob is refused). Both may be tuples, one per text."""

    kind: str | None = None  # default: prob for classifiers, logprob for language models
    label: int | str | tuple[int | str, ...] | None = None
    continuation: str | tuple[str, ...] | None = None
    reference: str | None = None  # kind similarity: the text whose pooled embedding is compared
    dimension: int | None = None  # kind dimension: which component of the pooled embedding
    #: language models: explain every output token on its own (one example per generated step:
    #: :attr:`PreparedExample.step`), the output being ``continuation`` or, without it, the greedy
    #: output of up to ``max_new_tokens`` tokens
    steps: bool = False
    max_new_tokens: int | None = None
    #: causal LMs, with ``steps``: score the output written before each token as well as the prompt
    #: (target-side attribution): each output token's example reads the prompt and the output before
    #: it as its input (:attr:`PreparedExample.written`)
    target_side: bool = False
    #: chat models: each text is the user's message, laid out by the tokenizer's chat template with
    #: the assistant's turn opened; the template's own tokens are kept in the input and marked
    #: special (never scored or perturbed), a message's content is plain text (``chat_encoding``)
    chat: bool = False
    contrast: str | tuple[str, ...] | None = None  # language models: the foil text
    contrast_label: int | str | tuple[int | str, ...] | None = None  # classifiers: the contrasted class


@dataclass(frozen=True)
class PreparedExample:
    """One text tokenised with its target resolved. Frozen: a changed target is a new example
    (``dataclasses.replace``), so nothing cached by an example's content goes stale."""

    text: str
    input_ids: list[int]  # the explained tokens, special tokens included
    special: list[bool]  # True where input_ids holds a special token (not scored by default)
    tokens: list[str]
    kind: str  # prob | logit | logprob
    label: int | None = None  # classification
    target_ids: list[int] = field(default_factory=list)  # causal continuation or seq2seq output
    label_name: str | None = None
    original_value: float | None = None  # the target on the unperturbed input
    reference_embedding: torch.Tensor | None = None  # [hidden] kind similarity: the reference's pooled embedding
    #: a language model's output explained token by token: the target is the log-prob (or logit,
    #: prob) of ``target_ids[step]`` alone, given the input and ``target_ids[:step]`` (teacher
    #: forced); None: the whole output's summed log-prob
    step: int | None = None
    #: a target-side step (``TargetSpec.target_side``): the output token's index in its text's output;
    #: ``input_ids`` then holds the prompt and the ``written`` output tokens before it, the target the
    #: next token alone (``step`` None), so every method scores the earlier output as it scores the prompt
    written: int | None = None
    foil_ids: list[int] = field(default_factory=list)  # LM contrast: the foil's id at each target position
    contrast_label: int | None = None  # classifier contrast: the class subtracted
    contrast_name: str | None = None  # what is contrasted (the foil text, the contrast label's name)
    #: a chat prompt (``TargetSpec.chat``): each message's content in ``text``, ``(start, end, role)``
    messages: tuple[tuple[int, int, str], ...] = ()
    #: a chat prompt: each input token's character offsets in ``text`` ((0, 0): a token the tokenizer
    #: adds). Its messages are read as plain text (``chat_encoding``), so where one holds a control
    #: token's text (``<|im_end|>``) re-encoding ``text`` does not give ``input_ids``; empty otherwise
    offsets: tuple[tuple[int, int], ...] = ()

    @property
    def output_index(self) -> int | None:
        """The output token this example explains, by its index in the text's output (a step or a
        target-side step), or None for a whole target."""
        return self.step if self.step is not None else self.written

    @property
    def contrasted(self) -> bool:
        """The target is a difference: this example's label or continuation rather than its contrast."""
        return bool(self.foil_ids) or self.contrast_label is not None

    def describe(self) -> dict:
        described = {"label": self.label_name, "kind": self.kind, "value": self.original_value}
        if self.contrasted:
            described["contrast"] = self.contrast_name
        if self.step is not None:
            described["step"] = self.step
        return described


def sources(examples: Sequence[PreparedExample]) -> list[int]:
    """For step units in order (each text's output tokens, step 0 first), the index of the text each
    came from; for other examples, their own index."""
    owners, current = [], -1
    for example in examples:
        current += example.output_index is None or example.output_index == 0
        owners.append(current)
    return owners


def same_row_groups(examples: Sequence[PreparedExample]) -> list[list[int]]:
    """Indices of ``examples`` in groups that feed the model the same row: the output tokens of one
    text (:attr:`PreparedExample.step` set; one input, output, foil and target kind), each reading
    its own output position of that row. Every other example is a group of its own."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(examples):
        key = ((tuple(e.input_ids), tuple(e.special), tuple(e.target_ids), tuple(e.foil_ids), e.kind)
               if e.step is not None else ("example", i))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


@dataclass
class RowBatch:
    """Padded model inputs for a list of rows, and where each row's target lives."""

    inputs: dict  # kwargs for the model (without input_ids when embeddings are given)
    examples: list[PreparedExample]
    input_lengths: torch.Tensor  # [rows] length of the explained part
    target_positions: torch.Tensor | None  # [rows, n_target] logit positions of target tokens (LMs)
    target_tokens: torch.Tensor | None  # [rows, n_target] ids scored at those positions
    target_valid: torch.Tensor | None  # [rows, n_target] bool (continuations differ in length)
    foil_tokens: torch.Tensor | None = None  # [rows, n_target] contrast foil ids at those positions, -1: none


def label_index(pm: ProbeModel, label) -> int:
    n_labels = int(getattr(pm.model.config, "num_labels", 0) or 0)
    if isinstance(label, str) and not label.lstrip("-").isdigit():
        mapping = {str(v): int(k) for k, v in (pm.model.config.id2label or {}).items()}
        if label not in mapping:
            raise InputError(f"unknown label {label!r}: this model's labels are {', '.join(mapping)}")
        return mapping[label]
    if isinstance(label, bool) or type(label).__name__ == "bool_":  # True would silently be class 1
        raise InputError(f"label={label!r} is a boolean, not a class: give the class index (e.g. label=1) or its name")
    if isinstance(label, float) or type(label).__name__.startswith("float"):
        if not float(label).is_integer():
            raise InputError(f"label={label!r} is not a class index: give a whole number or the class name")
    elif not isinstance(label, str) and not hasattr(label, "__index__"):
        raise InputError(f"label={label!r} is a {type(label).__name__}, not a class: give the class index or its name")
    index = int(label)
    if not 0 <= index < n_labels:
        raise InputError(f"label {index} is out of range: this model has labels 0..{n_labels - 1}")
    return index


def example_seed(seed: int, example: PreparedExample) -> list[int]:
    """A seed sequence (``numpy.random.default_rng``'s, ``SeedSequence``'s entropy) that depends on
    ``seed`` and the example's input tokens only, never on its place in a batch, so that a seeded
    method gives the same result for an example alone and in any batch (:func:`example_generator`
    for torch). Examples with the same input tokens draw the same (whatever their target): one text
    explained for several targets, steps or contrasts is perturbed alike."""
    import zlib

    import numpy as np

    return [int(seed), zlib.crc32(np.asarray(example.input_ids, dtype=np.int64).tobytes())]


def example_generator(seed: int, example: PreparedExample) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`example_seed` (the input tokens only)."""
    import numpy as np

    return torch.Generator().manual_seed(int(np.random.SeedSequence(example_seed(seed, example)).generate_state(1)[0]))


def target_generator(seed: int, example: PreparedExample) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by ``seed`` and the example's whole content: its input
    tokens, its target's tokens and its label, so one text explained for another target draws
    anew (GradientSHAP's baselines and noise, counterfactual attention's permutations and starting
    points). Never its place in a batch. Kept apart from :func:`example_generator` so that the
    shipped reports these methods made stay reproducible draw for draw."""
    import zlib

    key = repr((int(seed), list(example.input_ids), list(example.target_ids), example.label)).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def special_mask(pm: ProbeModel, ids: list[int]) -> list[bool]:
    special_ids = set(getattr(pm.tokenizer, "all_special_ids", []) or [])
    return [i in special_ids for i in ids]


#: how many tokens a language model writes when its output is explained step by step and no
#: ``max_new_tokens`` is given
DEFAULT_NEW_TOKENS = 16


def prepare(pm: ProbeModel, texts: list[str], target: TargetSpec = TargetSpec(), *, strict_length: bool = False,
            max_new_tokens: int = 16, token_ids: Sequence[Sequence[int]] | None = None) -> list[PreparedExample]:
    """Tokenise ``texts`` and resolve the target of each (predicted label, continuation ids).
    With ``target.steps`` every output token becomes its own example (:func:`per_step`), in order:
    text 0's steps, then text 1's, ... ``token_ids``: each text's ids as the model reads them, where
    encoding the text would not give them (a chat prompt's, :func:`chat_encoding`), already fitting
    the model's positions."""
    if target.chat:
        return _prepare_chat(pm, texts, target, strict_length=strict_length, max_new_tokens=max_new_tokens)
    if target.steps:
        return _prepare_steps(pm, texts, target, strict_length=strict_length, token_ids=token_ids)
    task = pm.task
    kind = target.kind or task.default_kind
    if kind is not None and kind not in TARGET_KINDS:
        raise InputError(f"unknown target kind {kind!r}: use one of {', '.join(TARGET_KINDS)}")
    _check_encoder_target(pm, target, kind)
    kind = contrast_kind(pm, target, kind)
    if not task.labels and target.label is not None:
        raise InputError("--label applies to classifiers; for a language model give --continuation TEXT")
    labels = _per_text(target.label, texts, "label")
    continuations = _per_text(target.continuation, texts, "continuation")
    contrasts = _per_text(target.contrast_label if task.labels else target.contrast, texts,
                          "contrast_label" if task.labels else "contrast")
    batch = _encode(pm, texts, strict_length=strict_length, token_ids=token_ids)
    lengths = batch["attention_mask"].sum(1).tolist()
    examples = []
    for i, text in enumerate(texts):
        ids = batch["input_ids"][i, : lengths[i]].tolist()
        examples.append(PreparedExample(text=text, input_ids=ids, special=special_mask(pm, ids),
                                        tokens=pm.tokenizer.convert_ids_to_tokens(ids), kind=kind))
    if task.embeds:
        examples = _resolve_encoder_target(pm, examples, target, kind)
    elif task.labels:
        fixed = [label_index(pm, label) if label is not None else None for label in labels]
        contrast_labels = [label_index(pm, c) if c is not None else None for c in contrasts]
        return _classify(pm, examples, fixed, contrast_labels)
    elif target.continuation is not None:
        # a decoder's output is a whole sequence (its end token included); a continuation goes on the input
        ids = {}
        for text in dict.fromkeys(continuations):
            if not isinstance(text, str):
                raise InputError(f"continuation {text!r} is not a text: give a string, or a list with one per text")
            ids[text] = pm.tokenizer(text, add_special_tokens=task.encoder_decoder)["input_ids"]
            if not ids[text]:
                raise InputError(f"target continuation {text!r} tokenises to nothing: give a non-empty text")
        examples = [dataclasses.replace(e, target_ids=list(ids[text]), label_name=text)
                    for e, text in zip(examples, continuations)]
        _check_positions(pm, examples)
    elif task.next_token:
        with torch.no_grad():
            logits = pm.model(**batch).logits
        next_ids = [[int(logits[i, lengths[i] - 1].argmax())] for i in range(len(examples))]
        examples = [dataclasses.replace(e, target_ids=ids, label_name=pm.tokenizer.decode(ids))
                    for e, ids in zip(examples, next_ids)]
    else:
        with torch.no_grad():
            generated = pm.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        from probe.models.text import decoder_start_id

        start = decoder_start_id(pm)
        pad = pm.tokenizer.pad_token_id
        for i, example in enumerate(examples):
            out = [t for t in generated[i].tolist()]
            if out and out[0] == start:
                out = out[1:]
            out = [t for t in out if t != pad] or [pm.tokenizer.eos_token_id]
            examples[i] = dataclasses.replace(example, target_ids=out,
                                              label_name=pm.tokenizer.decode(out, skip_special_tokens=True))
    if target.contrast is not None:
        examples = _with_foils(pm, examples, contrasts)
    values = evaluate(pm, [(e.input_ids, e) for e in examples])
    return [dataclasses.replace(e, original_value=value) for e, value in zip(examples, values.tolist())]


#: a chat message: its role and its text, as the tokenizer's chat template takes it
Message = Mapping[str, str]


def chat_layout(pm: ProbeModel, text: str | Sequence[Message]) -> tuple[str, tuple[tuple[int, int, str], ...]]:
    """``text`` in the tokenizer's chat template with the assistant's turn opened: a string is the
    user's one message, a list of ``{"role": ..., "content": ...}`` a conversation. Returns the
    laid-out string and where each message's content lies in it: ``(start, end, role)`` per message."""
    tokenizer = pm.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{pm.name}'s tokenizer has no chat template: leave out chat (or --chat), or give the "
                         "prompt as the model reads it")
    messages = _messages(text)
    markers = [f"\u2063probe-message-{i}\u2063" for i in range(len(messages))]
    template = tokenizer.apply_chat_template([{**m, "content": marker} for m, marker in zip(messages, markers)],
                                             tokenize=False, add_generation_prompt=True)
    if any(template.count(marker) != 1 for marker in markers):
        raise InputError(f"{pm.name}'s chat template does not show each message once: give the prompt as the model "
                         "reads it instead of chat")
    # each content goes in at its marker's place in the template's own text, in one pass: a content is never
    # searched, so one that holds a marker (or another message's text) cannot move where a message lies
    parts, regions, cursor, length = [], [], 0, 0
    for i in sorted(range(len(messages)), key=lambda i: template.index(markers[i])):
        at, content = template.index(markers[i]), messages[i]["content"]
        parts += [template[cursor:at], content]
        start = length + at - cursor
        regions.append((start, start + len(content), messages[i]["role"]))
        length, cursor = start + len(content), at + len(markers[i])
    parts.append(template[cursor:])
    return "".join(parts), tuple(regions)


def control_texts(tokenizer) -> list[str]:
    """The texts ``tokenizer`` reads as control tokens (its special tokens and the added tokens marked
    special, e.g. ``<|im_end|>``), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts |= {token.content for token in added.values() if getattr(token, "special", False)}
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


def _control_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, token in added.items() if getattr(token, "special", False)}


def chat_encoding(pm: ProbeModel, laid_out: str, regions: Sequence[tuple[int, int, str]]
                  ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The ids of a chat layout (:func:`chat_layout`) as the model reads it, and each token's character
    offsets in it ((0, 0): a token the tokenizer adds).

    The template's text is read as the tokenizer reads it (its control tokens are control tokens); a
    message's content always as plain text: a control token's text inside a message (``<|im_end|>``,
    ``<|endoftext|>``) becomes the ordinary pieces that spell it, so no message can close its turn,
    open another or end the text. Where no message holds such text this is the tokenizer's own
    encoding of the layout; otherwise each piece of the layout is encoded on its own (the messages
    with special tokens split) between the tokens the tokenizer adds around a text. A tokenizer that
    cannot spell such text (its pieces still come out as a control token, e.g. an unknown-word token
    that is also the end token) is refused in one line."""
    tokenizer = pm.tokenizer
    whole = tokenizer(laid_out, return_offsets_mapping=True, verbose=False)
    ids = [int(t) for t in whole["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in whole["offset_mapping"]]
    held = [t for t in control_texts(tokenizer) if any(t in laid_out[start:end] for start, end, _ in regions)]
    if not held:
        return ids, tuple(offsets)
    bare = [int(t) for t in tokenizer(laid_out, add_special_tokens=False, verbose=False)["input_ids"]]
    added = next((k for k in range(len(ids) - len(bare) + 1) if ids[k: k + len(bare)] == bare), None)
    if added is None:
        raise InputError(f"a chat message holds {held[0]!r}, a control token of {pm.name}'s tokenizer, and the "
                         "tokenizer's encoding of the layout cannot be split to read it as text: remove it from the "
                         "message, or give the prompt as the model reads it instead of chat")
    cuts = sorted({0, len(laid_out), *(edge for start, end, _ in regions for edge in (start, end))})
    pieces, piece_offsets = [], []
    for a, b in zip(cuts, cuts[1:]):
        in_message = any(start <= a and b <= end for start, end, _ in regions)
        enc = tokenizer(laid_out[a:b], add_special_tokens=False, return_offsets_mapping=True, verbose=False,
                        split_special_tokens=in_message)
        pieces += [int(t) for t in enc["input_ids"]]
        piece_offsets += [(int(x) + a, int(y) + a) for x, y in enc["offset_mapping"]]
    n_after = len(ids) - added - len(bare)
    ids = ids[:added] + pieces + ids[len(ids) - n_after:]
    offsets = [(0, 0)] * added + piece_offsets + [(0, 0)] * n_after
    control = _control_ids(tokenizer)
    leaked = [t for t, (a, b) in zip(ids, offsets)
              if t in control and any(a < end and b > start for start, end, _ in regions)]
    if leaked:
        spelled = tokenizer.convert_ids_to_tokens([leaked[0]])[0]
        raise InputError(f"a chat message holds {held[0]!r}, a control token of {pm.name}'s tokenizer, which this "
                         f"tokenizer cannot spell as plain text (it still reads as the control token {spelled!r}): "
                         "remove it from the message")
    return ids, tuple(offsets)


def _messages(text: str | Sequence[Message]) -> list[dict]:
    """A chat text as a list of messages, checked: a string is one user message."""
    if isinstance(text, str):
        if not text.strip():
            raise InputError(f"the chat text {text!r} is empty: give the user's message, at least one word")
        return [{"role": "user", "content": text}]
    if not isinstance(text, Sequence) or not text:
        raise InputError(f"a chat text is a string (the user's message) or a non-empty list of messages, "
                         f"got {text!r}")
    messages = []
    for m in text:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"chat message {m!r} is not {{'role': str, 'content': str}}: write e.g. "
                             "{'role': 'user', 'content': 'Hello'}")
        if not m["content"].strip():
            raise InputError(f"the {m['role']} message is empty ({m['content']!r}): give every message some text")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _prepare_chat(pm: ProbeModel, texts: list, target: TargetSpec, *, strict_length: bool,
                  max_new_tokens: int) -> list[PreparedExample]:
    """Each text laid out by the chat template (:func:`chat_layout`) and encoded with its messages as
    plain text (:func:`chat_encoding`), then prepared as any prompt; every token outside the messages'
    contents is marked special, and each example keeps where its messages lie
    (:attr:`PreparedExample.messages`: the spans ``@roles``) and its tokens' offsets. A layout longer
    than the model's positions is refused (cutting it would cut the assistant's opened turn)."""
    layouts = [chat_layout(pm, text) for text in texts]
    encoded = {laid: chat_encoding(pm, laid, where) for laid, where in layouts}
    limit = pm.contract.max_positions
    for i, (laid, _) in enumerate(layouts):
        if len(encoded[laid][0]) > limit:
            raise InputError(f"chat text #{i} laid out in {pm.name}'s chat template has {len(encoded[laid][0])} "
                             f"tokens, more than the model's {limit} (max positions): give a shorter message")
    examples = prepare(pm, [laid for laid, _ in layouts], dataclasses.replace(target, chat=False),
                       strict_length=strict_length, max_new_tokens=max_new_tokens,
                       token_ids=[encoded[laid][0] for laid, _ in layouts])
    regions = {laid: where for laid, where in layouts}
    out = []
    for e in examples:
        ids, offsets = encoded[e.text]
        if list(ids) != list(e.input_ids):
            raise InputError(f"cannot find the message's tokens in {pm.name}'s chat layout (the tokenizer's "
                             "offsets do not match its ids): give the prompt as the model reads it instead of chat")
        outside = [not any(a < end and b > start for start, end, _ in regions[e.text]) for a, b in offsets]
        out.append(dataclasses.replace(e, special=[s or o for s, o in zip(e.special, outside)],
                                       messages=regions[e.text], offsets=offsets))
    return out


def _prepare_steps(pm: ProbeModel, texts: list[str], target: TargetSpec, *, strict_length: bool,
                   token_ids: Sequence[Sequence[int]] | None = None) -> list[PreparedExample]:
    """Each text's output (the given continuation, else the greedy output of up to
    ``target.max_new_tokens`` tokens), one example per output token."""
    task = pm.task
    if not task.continuations:
        raise InputError(f"a step-by-step target explains a language model's output token by token; this model is a "
                         f"{task.head}: leave out --generate / steps")
    n_new = target.max_new_tokens if target.max_new_tokens is not None else DEFAULT_NEW_TOKENS
    if isinstance(n_new, bool) or not isinstance(n_new, int) or not 1 <= n_new <= 1024:
        raise InputError(f"--generate {n_new!r}: give a number of tokens to generate from 1 to 1024")
    whole = dataclasses.replace(target, steps=False, max_new_tokens=None)
    if target.continuation is None and task.next_token:
        if target.contrast is not None or target.contrast_label is not None:
            raise InputError("a contrast is set against a given output, token by token: give the output as "
                             "--continuation (Python: continuation=) with --generate / steps")
        if target.label is not None:
            raise InputError("--label applies to classifiers; for a language model give --continuation TEXT")
        kind = target.kind or task.default_kind
        _check_encoder_target(pm, target, kind)
        tokenised = _tokenised(pm, texts, kind, strict_length, token_ids)
        _check_generation_room(pm, [len(e.input_ids) for e in tokenised], n_new)
        outputs = greedy_outputs(pm, [e.input_ids for e in tokenised], n_new)
        examples = [dataclasses.replace(e, target_ids=out) for e, out in zip(tokenised, outputs)]
        examples = [dataclasses.replace(e, label_name=pm.tokenizer.decode(e.target_ids)) for e in examples]
    else:
        examples = prepare(pm, texts, whole, strict_length=strict_length, max_new_tokens=n_new, token_ids=token_ids)
    if target.target_side:
        return target_side_steps(pm, examples)
    return per_step(pm, examples)


#: prompts one batched greedy generation takes at most (:func:`greedy_outputs`)
GENERATION_BATCH = 32


def greedy_outputs(pm: ProbeModel, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """A causal LM's greedy output ids after each prompt (up to ``n_new`` tokens, its end token
    included when it writes one).

    Prompts are generated together, left-padded (a pad between a prompt and its output would be
    read as part of it): the mask keeps the pads out and position ids count from each prompt's
    first token, so every prompt reads what it reads alone. A model whose forward takes no
    position ids, or whose key/value cache is not plain (:func:`plain_kv_cache`: a recurrent or
    windowed state), generates one unpadded prompt at a time."""
    eos = pm.tokenizer.eos_token_id
    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    together = forward_accepts(pm.model, "position_ids") and plain_kv_cache(pm)
    size = GENERATION_BATCH if together else 1
    outputs = []
    for start in range(0, len(prompts), size):
        chunk = prompts[start: start + size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, prompt in enumerate(chunk):
            ids[r, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[r, width - len(prompt):] = 1
        with torch.no_grad():
            generated = pm.model.generate(input_ids=ids.to(pm.device), attention_mask=mask.to(pm.device),
                                          max_new_tokens=n_new, do_sample=False, pad_token_id=pad)
        for row in generated[:, width:].tolist():
            out = [int(t) for t in row]
            if eos is not None and eos in out:
                out = out[: out.index(eos) + 1]
            outputs.append(out or ([int(eos)] if eos is not None else []))
    return outputs


def _tokenised(pm: ProbeModel, texts: list[str], kind: str, strict_length: bool,
               token_ids: Sequence[Sequence[int]] | None = None) -> list[PreparedExample]:
    """``texts`` tokenised as the model reads them (or their ``token_ids``), without a target yet."""
    batch = _encode(pm, texts, strict_length=strict_length, token_ids=token_ids)
    lengths = batch["attention_mask"].sum(1).tolist()
    examples = []
    for i, text in enumerate(texts):
        ids = batch["input_ids"][i, : lengths[i]].tolist()
        examples.append(PreparedExample(text=text, input_ids=ids, special=special_mask(pm, ids),
                                        tokens=pm.tokenizer.convert_ids_to_tokens(ids), kind=kind))
    return examples


def _encode(pm: ProbeModel, texts: list[str], *, strict_length: bool,
            token_ids: Sequence[Sequence[int]] | None) -> Mapping[str, torch.Tensor]:
    """The right-padded model batch of ``texts`` (:func:`~probe.models.core.encode_texts`), or of
    ``token_ids`` where given: ``input_ids`` and ``attention_mask``, each ``[text, longest]``."""
    from probe.models.core import encode_texts

    if token_ids is None:
        return encode_texts(pm, texts, strict_length=strict_length)
    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    width = max(len(ids) for ids in token_ids)
    input_ids = torch.full((len(token_ids), width), pad, dtype=torch.long)  # [text, longest]
    attention_mask = torch.zeros((len(token_ids), width), dtype=torch.long)  # [text, longest]
    for row, ids in enumerate(token_ids):
        input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids.to(pm.device), "attention_mask": attention_mask.to(pm.device)}


def _check_generation_room(pm: ProbeModel, prompt_lengths: list[int], n_new: int) -> None:
    """A causal LM's prompts and ``n_new`` output tokens fit in the model's positions (the last output
    token is never fed: a prompt of P tokens needs P + n_new - 1), else one line naming the limit and
    the largest ``n_new`` that fits, before anything is generated."""
    limit = pm.contract.max_positions
    for i, n in enumerate(prompt_lengths):
        if n + n_new - 1 > limit:
            fits = limit - n + 1
            raise InputError(f"--generate {n_new} (Python: generate={n_new}): text #{i} has {n} tokens, and it and "
                             f"{n_new} output tokens need {n + n_new - 1} positions, more than the model's {limit} "
                             f"(max positions): give --generate {fits} or less, or a shorter text")


def _check_positions(pm: ProbeModel, examples: list[PreparedExample]) -> None:
    """A causal LM's input and target (continuation) fit in the model's positions together (the last
    target token is never fed), else one line naming the limit, before any forward."""
    if not pm.task.next_token:
        return
    limit = pm.contract.max_positions
    for i, e in enumerate(examples):
        n, m = len(e.input_ids), len(e.target_ids)
        if n + m - 1 > limit:
            raise InputError(f"text #{i} ({n} tokens) and its continuation ({m} tokens) need {n + m - 1} positions, "
                             f"more than the model's {limit} (max positions): give a shorter text or continuation")


def target_side_steps(pm: ProbeModel, examples: list[PreparedExample]) -> list[PreparedExample]:
    """Each causal LM example's output token by token, the output before each token part of the
    input (target-side attribution): the example of output token j reads the prompt and output
    tokens 0..j-1 (not special: they are scored and perturbed as the prompt is) and explains the
    next token, ``target_ids[j]``, alone; its ``written`` is j."""
    if not pm.task.next_token:
        raise InputError("target-side attribution reads the output written so far as input, which a causal LM "
                         f"does; {pm.name} is a {pm.task.head} (its output is the decoder's): leave out target_side")
    out = []
    for e in examples:
        for j, token in enumerate(e.target_ids):
            before = [int(t) for t in e.target_ids[:j]]
            unit = dataclasses.replace(
                e, input_ids=[*e.input_ids, *before], special=[*e.special, *([False] * j)],
                tokens=[*e.tokens, *pm.tokenizer.convert_ids_to_tokens(before)], target_ids=[int(token)],
                foil_ids=[e.foil_ids[j]] if e.foil_ids else [], label_name=pm.tokenizer.decode([int(token)]),
                original_value=None, step=None, written=j)
            out.append(unit)
    values = evaluate(pm, [(u.input_ids, u) for u in out]) if out else torch.zeros(0)
    return [dataclasses.replace(u, original_value=float(v)) for u, v in zip(out, values.tolist())]


def per_step(pm: ProbeModel, examples: list[PreparedExample]) -> list[PreparedExample]:
    """Each example's output token by token: one example per target token (``step``), its
    ``original_value`` that token's log-prob (or logit, prob) given the input and the output before it."""
    out = []
    for e in examples:
        values = output_values(pm, e).tolist()  # [n_target]: every step's value from one forward of its row
        out += [dataclasses.replace(e, step=j, original_value=values[j],
                                    label_name=pm.tokenizer.decode([e.target_ids[j]]))
                for j in range(len(e.target_ids))]
    return out


def output_values(pm: ProbeModel, example: PreparedExample) -> torch.Tensor:
    """``[n_target]`` the value of each output token of ``example`` (log-prob, logit or prob, minus
    its foil's where contrasted) given the input and the output before it, from one forward of the
    example's row: every step of it reads a column of the same row (:func:`position_values`)."""
    whole = dataclasses.replace(example, step=None)
    batch = build_rows(pm, [(whole.input_ids, whole)])
    inputs = dict(batch.inputs)
    kept = keep_target_logits(pm, batch, inputs)
    with torch.no_grad():
        logits = pm.model(**inputs).logits
    values = position_values(pm, kept, logits)[0]  # [n_target]
    return values.exp() if example.kind == "prob" else values


#: rows x width of one forward when :func:`prepare` labels and values a classifier's examples
PREPARE_TOKEN_BUDGET = 8192


def _width_groups(widths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by width, cut into groups of at most ``budget`` padded tokens (rows x widest)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: (widths[i], i)):
        if groups and (len(groups[-1]) + 1) * widths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _per_text(value, texts: list[str], name: str) -> list:
    """``value`` for each text: one value repeated, or a tuple/list with exactly one per text."""
    if not isinstance(value, (tuple, list)):
        return [value] * len(texts)
    if len(value) != len(texts):
        raise InputError(f"{name} has {len(value)} value(s) for {len(texts)} texts: give one {name} per text, "
                         f"or a single {name} for all of them")
    return list(value)


def _classify(pm: ProbeModel, examples: list[PreparedExample], fixed: list[int | None],
              contrasts: list[int | None] | None = None) -> list[PreparedExample]:
    """A classifier's examples with their label (``fixed[i]``, else the predicted class), their
    contrast label (``contrasts[i]``, if any) and their target value, all read from one forward per
    group of similar widths: the prediction's logits are the ones the target value needs, so no
    second pass, and no short example is padded to the longest one's width."""
    names = pm.model.config.id2label or {}
    contrasts = contrasts or [None] * len(examples)
    done: list[PreparedExample | None] = [None] * len(examples)
    for group in _width_groups([len(e.input_ids) for e in examples], PREPARE_TOKEN_BUDGET):
        batch = build_rows(pm, [(examples[i].input_ids, examples[i]) for i in group])
        with torch.no_grad():
            logits = pm.model(**batch.inputs).logits  # [rows, classes]
        chosen = [fixed[i] if fixed[i] is not None else int(c) for i, c in zip(group, logits.argmax(-1).tolist())]
        labelled = [dataclasses.replace(examples[i], label=c, label_name=str(names.get(c, c)))
                    for i, c in zip(group, chosen)]
        labelled = [_with_contrast_label(e, contrasts[i], names, i, fixed[i] is not None)
                    for i, e in zip(group, labelled)]
        values = target_values(pm, dataclasses.replace(batch, examples=labelled), logits).tolist()
        for i, example, value in zip(group, labelled, values):
            done[i] = dataclasses.replace(example, original_value=value)
    return done


def contrast_kind(pm: ProbeModel, target: TargetSpec, kind: str | None) -> str | None:
    """The target kind of ``target`` once its contrast is checked: a contrast on the wrong kind of
    model, or with kind prob, is refused in one line; a contrasted classifier defaults to logit
    (logit and logprob differences of two classes are the same number)."""
    task = pm.task
    if target.contrast is None and target.contrast_label is None:
        return kind
    if task.embeds:
        raise InputError("--contrast / --contrast-label need a task head; a headless encoder explains "
                         "--target similarity --reference TEXT or --target dimension --dimension N")
    if target.contrast is not None and not task.continuations:
        raise InputError(f"--contrast (a foil text) applies to language models; this model is a {task.head}: "
                         "give --contrast-label (index or name) instead")
    if target.contrast_label is not None and not task.labels:
        raise InputError(f"--contrast-label applies to classifiers; this model is a {task.head}: "
                         "give --contrast TEXT (a foil continuation) instead")
    if target.kind is None and task.labels:
        return "logit"
    if kind == "prob":
        raise InputError("target kind 'prob' cannot be contrasted (a difference of log-probs is not a probability): "
                         "use --target logprob or logit, or leave the contrast out")
    return kind


def _with_contrast_label(example: PreparedExample, contrast: int | None, names: dict, index: int,
                         given: bool) -> PreparedExample:
    """``example`` contrasted with class ``contrast`` (None: unchanged); the explained label itself is refused."""
    if contrast is None:
        return example
    name = str(names.get(contrast, contrast))
    if contrast == example.label:
        how = "given" if given else "predicted"
        raise InputError(f"contrast label {name!r} is the explained ({how}) label of text #{index}: a contrast "
                         f"explains "
                         "one class rather than another; give a different --contrast-label (or another --label)")
    return dataclasses.replace(example, contrast_label=contrast, contrast_name=name,
                               label_name=f"{example.label_name} vs {name}")


def _with_foils(pm: ProbeModel, examples: list[PreparedExample], foils: list) -> list[PreparedExample]:
    """Copies of the language-model ``examples`` with the foil of each (tokenised exactly as a
    continuation is) aligned on its target tokens: as many tokens, or one repeated at every position."""
    special = set(getattr(pm.tokenizer, "all_special_ids", []) or [])
    out = []
    for i, (example, foil) in enumerate(zip(examples, foils)):
        if not isinstance(foil, str):
            raise InputError(f"contrast {foil!r} is not a text: give a foil string, or a list with one per text")
        ids = list(pm.tokenizer(foil, add_special_tokens=pm.task.encoder_decoder)["input_ids"])
        if not [t for t in ids if t not in special]:
            raise InputError(f"contrast foil {foil!r} tokenises to nothing: give a non-empty foil text, e.g. ' "
                             f"negative'")
        n = len(example.target_ids)
        if len(ids) == 1:
            ids = ids * n
        elif len(ids) != n:
            raise InputError(f"contrast foil {foil!r} tokenises to {len(ids)} tokens and the target "
                             f"{example.label_name!r} of text #{i} to {n}: a foil is compared token by token at the "
                             f"target's positions, so give a foil of {n} token(s) or of a single token")
        if ids == list(example.target_ids):
            raise InputError(f"contrast foil {foil!r} is the target of text #{i} itself (the same tokens): give a "
                             "different foil, the output it should be contrasted with")
        out.append(dataclasses.replace(example, foil_ids=ids, contrast_name=foil,
                                       label_name=f"{example.label_name!r} vs {foil!r}"))
    return out


def _check_encoder_target(pm: ProbeModel, target: TargetSpec, kind: str) -> None:
    """Encoder targets only on encoders, with what they need; nothing else on an encoder."""
    if not pm.task.embeds:
        if kind not in pm.task.kinds:
            raise InputError(f"target {kind!r} applies to a headless encoder (task encoder); this is a {pm.task} "
                             f"model: use one of {', '.join(pm.task.kinds)}")
        if target.reference is not None or target.dimension is not None:
            raise InputError("--reference / --dimension apply to a headless encoder's similarity / dimension target; "
                             f"this is a {pm.task} model")
        return
    if kind not in pm.task.kinds:
        asked = f"target {kind!r}" if kind is not None else "no target kind given"
        raise InputError(f"a headless encoder has no class or next token to explain ({asked}): use "
                         "--target similarity --reference TEXT or --target dimension --dimension N")
    if target.label is not None or target.continuation is not None:
        raise InputError("--label / --continuation need a task head; a headless encoder explains "
                         "--target similarity --reference TEXT or --target dimension --dimension N")
    if kind == "similarity":
        if target.dimension is not None:
            raise InputError("--dimension belongs to --target dimension; a similarity target takes --reference TEXT")
        if not isinstance(target.reference, str) or not target.reference.strip():
            raise InputError(f"target similarity needs a reference text (got {target.reference!r}): "
                             "give --reference TEXT")
    else:
        if target.reference is not None:
            raise InputError("--reference belongs to --target similarity; a dimension target takes --dimension N")
        hidden = int(pm.model.config.hidden_size)
        if isinstance(target.dimension, bool) or not isinstance(target.dimension, int) \
                or not 0 <= target.dimension < hidden:
            raise InputError(f"target dimension needs --dimension N with N in 0..{hidden - 1} "
                             f"(the embedding has {hidden}); got {target.dimension!r}")


def _resolve_encoder_target(pm: ProbeModel, examples: list[PreparedExample], target: TargetSpec,
                            kind: str) -> list[PreparedExample]:
    """Copies of the examples with their encoder target: the reference embedding (held fixed) or the dimension."""
    if kind == "dimension":
        return [dataclasses.replace(e, label=int(target.dimension), label_name=f"dimension {target.dimension}")
                for e in examples]
    from probe.models.core import encode_texts

    reference = encode_texts(pm, [target.reference])
    with torch.no_grad():
        embedding = pm.model(**reference).logits[0].float()  # [hidden]
    return [dataclasses.replace(e, reference_embedding=embedding, label_name=target.reference) for e in examples]


def build_rows(pm: ProbeModel, rows: list[tuple[list[int], PreparedExample]], *, device=None) -> RowBatch:
    """Pad rows into one model batch. Rows may come from different examples and have different lengths."""
    device = device or pm.device
    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    examples = [example for _, example in rows]
    input_lengths = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long)
    if pm.task.next_token:
        # the last continuation token is never fed: no target reads the logits after it
        sequences = [list(ids) + list(example.target_ids[:-1]) for ids, example in rows]
    else:
        sequences = [list(ids) for ids, _ in rows]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, seq in enumerate(sequences):
        input_ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[r, : len(seq)] = 1
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    positions = tokens = valid = None
    if pm.task.continuations:
        n_target = max(len(example.target_ids) for example in examples)
        positions = torch.zeros((len(rows), n_target), dtype=torch.long)
        tokens = torch.zeros((len(rows), n_target), dtype=torch.long)
        valid = torch.zeros((len(rows), n_target), dtype=torch.bool)
        for r, (ids, example) in enumerate(rows):
            n = len(example.target_ids)
            tokens[r, :n] = torch.tensor(example.target_ids)
            valid[r, :n] = True
            # causal: the token at position len+j is predicted by the logits at len+j-1
            offset = len(ids) - 1 if pm.task.next_token else 0
            positions[r, :n] = torch.arange(n) + offset
        if pm.task.encoder_decoder:
            from probe.models.text import decoder_start_id

            start = decoder_start_id(pm)
            decoder = torch.full((len(rows), n_target), pad, dtype=torch.long)
            decoder_mask = torch.zeros((len(rows), n_target), dtype=torch.long)
            for r, (_, example) in enumerate(rows):
                seq = [start] + list(example.target_ids[:-1])
                decoder[r, : len(seq)] = torch.tensor(seq)
                decoder_mask[r, : len(seq)] = 1
            inputs["decoder_input_ids"] = decoder.to(device)
            inputs["decoder_attention_mask"] = decoder_mask.to(device)
        positions, tokens, valid = positions.to(device), tokens.to(device), valid.to(device)
    return RowBatch(inputs=inputs, examples=examples, input_lengths=input_lengths.to(device),
                    target_positions=positions, target_tokens=tokens, target_valid=valid,
                    foil_tokens=foil_tokens(examples, tokens.shape[1], device) if tokens is not None else None)


def foil_tokens(examples: list[PreparedExample], n_target: int, device=None) -> torch.Tensor | None:
    """``[rows, n_target]`` long: each row's contrast foil id at each of its target positions (aligned
    as ``RowBatch.target_tokens`` is), -1 where a row has no foil or no target token; None when no
    row is contrasted. Every builder of a language-model ``RowBatch`` fills ``foil_tokens`` with it."""
    if not any(e.foil_ids for e in examples):
        return None
    foil = torch.full((len(examples), n_target), -1, dtype=torch.long)
    for r, example in enumerate(examples):
        if example.foil_ids:
            foil[r, : len(example.foil_ids)] = torch.tensor(example.foil_ids)
    return foil.to(device) if device is not None else foil


@functools.cache
def _class_accepts(model_class: type, name: str) -> bool:
    try:
        return name in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_accepts(model, name: str) -> bool:
    """Whether the model class's forward takes ``name`` (the class, not the instance: a wrapped
    instance method would hide the signature)."""
    return _class_accepts(type(model), name)


def plain_kv_cache(pm: ProbeModel) -> bool:
    """Whether the model takes a ``cache`` and its ``DynamicCache`` holds plain full-attention
    layers (``DynamicLayer``: every key and value kept, appended in order). Sliding-window,
    chunked, linear-attention or shared-KV layers keep another state, and an unusual config
    counts as not plain."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = getattr(DynamicCache(config=pm.model.config), "layers", [])
        plain = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    except Exception:  # an unusual config: not plain
        plain = False
    return plain and forward_accepts(pm.model, "cache")


@functools.cache
def _class_slices_logits_to_keep(model_class: type) -> bool:
    try:
        return "slice_logits_to_keep(" in inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False


def slices_logits_to_keep(model) -> bool:
    """Whether the model class's forward slices ``logits_to_keep`` with transformers' helper, which
    also takes a boolean ``[batch, positions]`` mask and returns the kept positions flattened, and
    an integer ``[batch, n]`` tensor row by row (transformers 5.17's forwards index
    ``hidden_states[:, logits_to_keep]`` instead: one 1-D list of positions for every row)."""
    return _class_slices_logits_to_keep(type(model))


def keep_target_logits(pm: ProbeModel, batch: RowBatch, kwargs: dict) -> RowBatch:
    """Causal LMs whose forward takes ``logits_to_keep``: project only the positions the target
    reads onto the vocabulary (far less memory; the values are those of the full projection, the
    same rows of the same matmul).

    A forward that slices through transformers' ``slice_logits_to_keep`` (newer 5.x releases) takes
    the ``[rows, n_target]`` target positions: the logits come back as ``[rows, n_target, vocab]``
    and the returned batch's target positions are ``0..n_target-1``. An older forward indexes
    ``hidden_states[:, logits_to_keep]``, which takes one list of positions for every row: it gets
    the sorted positions any row reads, and the returned batch's target positions index that list.
    Any other model: the batch unchanged.
    """
    if not pm.task.next_token or not forward_accepts(pm.model, "logits_to_keep"):
        return batch
    positions = batch.target_positions  # [rows, n_target]
    if slices_logits_to_keep(pm.model):
        kwargs["logits_to_keep"] = positions
        n_rows, n_target = positions.shape
        kept = torch.arange(n_target, device=positions.device).expand(n_rows, n_target)
    else:
        union = torch.unique(positions)  # sorted
        kwargs["logits_to_keep"] = union
        kept = torch.searchsorted(union, positions)
    return dataclasses.replace(batch, target_positions=kept)


def target_values(pm: ProbeModel, batch: RowBatch, logits: torch.Tensor) -> torch.Tensor:
    """[rows] target value of each row from the model's logits (fp32)."""
    logits = logits.float()
    if pm.task.embeds:  # logits: [rows, hidden] pooled embeddings
        if batch.examples[0].kind == "similarity":
            reference = torch.stack([e.reference_embedding for e in batch.examples]).to(logits.device)  # [rows, hidden]
            return torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
        dims = torch.tensor([e.label for e in batch.examples], device=logits.device)
        return logits.gather(1, dims[:, None])[:, 0]
    if pm.task.labels:
        labels = torch.tensor([e.label for e in batch.examples], device=logits.device)
        kind = batch.examples[0].kind
        if kind == "logit":
            return logits.gather(1, labels[:, None])[:, 0] - contrast_terms(batch, logits, kind)
        logp = torch.log_softmax(logits, dim=-1).gather(1, labels[:, None])[:, 0]
        if kind == "logprob":
            return logp - contrast_terms(batch, logits, kind)
        return logp.exp() - contrast_terms(batch, logits, kind)  # refused where a row is contrasted
    return reduce_positions(position_values(pm, batch, logits), batch.examples)


def position_values(pm: ProbeModel, batch: RowBatch, logits: torch.Tensor) -> torch.Tensor:
    """A language model's ``[rows, n_target]`` per output position: the log-prob of the target
    token there (kind ``logit``: its logit; with a contrast, minus the foil's), 0 past a shorter
    row's output. Every target of the row's example (the whole output, or one ``step``) is a
    reduction of it (:func:`reduce_positions`), so one forward pass gives them all."""
    logits = logits.float()
    kind = batch.examples[0].kind
    index = batch.target_positions[:, :, None].expand(-1, -1, logits.shape[-1])
    at = logits.gather(1, index)  # [rows, n_target, vocab]
    chosen = batch.target_tokens[:, :, None]
    if batch.examples[0].kind == "logit":
        per_token = at.gather(2, chosen)[..., 0]
    else:
        per_token = torch.log_softmax(at, dim=-1).gather(2, chosen)[..., 0]
    per_token = per_token - contrast_terms(batch, at, kind)
    return per_token * batch.target_valid


def reduce_positions(values: torch.Tensor, examples: list[PreparedExample]) -> torch.Tensor:
    """``[rows]`` target values from :func:`position_values` ``[rows, n_target]``: the sum over the
    output, or the example's ``step`` alone; exponentiated for kind ``prob``."""
    if any(e.step is not None for e in examples):
        positions = torch.arange(values.shape[1], device=values.device)
        steps = torch.tensor([-1 if e.step is None else e.step for e in examples], device=values.device)
        values = values * ((positions[None, :] == steps[:, None]) | (steps[:, None] < 0))
    total = values.sum(1)
    return total.exp() if examples[0].kind == "prob" else total


def contrast_terms(batch: RowBatch, scores: torch.Tensor, kind: str) -> torch.Tensor | float:
    """What a contrastive target subtracts, from the same logits as the target (no forward of its own).

    Classifier (``scores`` ``[rows, classes]``): ``[rows]`` the contrast label's logit (kind logit) or
    log-prob (kind logprob), 0 for rows without a contrast label. Language model (``scores``
    ``[rows, n_target, vocab]``, the logits at the target positions): ``[rows, n_target]`` the
    foil's logit or log-prob at each position, 0 where a row has no foil. ``0.`` when no row of the
    batch is contrasted.
    """
    examples = batch.examples
    if not any(e.contrasted for e in examples):
        return 0.0
    if kind not in ("logit", "logprob"):
        raise InputError(f"target kind {kind!r} cannot be contrasted (a difference of log-probs is not a probability): "
                         "use logprob or logit")
    scores = scores.float()
    if scores.dim() == 2:  # classifier
        contrast = torch.tensor([-1 if e.contrast_label is None else e.contrast_label for e in examples],
                                device=scores.device)  # [rows]
        picked = scores.gather(1, contrast.clamp(min=0)[:, None])[:, 0]  # [rows]
        if kind == "logprob":
            picked = picked - torch.logsumexp(scores, dim=-1)
        return picked * (contrast >= 0)
    foil = batch.foil_tokens
    if foil is None:
        raise ProbeError("a contrasted language-model batch was built without its foil tokens "
                         "(RowBatch.foil_tokens): build it with build_rows or fill it with foil_tokens()")
    picked = scores.gather(2, foil.clamp(min=0)[..., None])[..., 0]  # [rows, n_target]
    if kind == "logprob":
        picked = picked - torch.logsumexp(scores, dim=-1)
    return picked * (foil >= 0)


def evaluate(pm: ProbeModel, rows: list[tuple[list[int], PreparedExample]]) -> torch.Tensor:
    """Target values of ``rows`` in one forward pass (callers batch; see the engine)."""
    batch = build_rows(pm, rows)
    with torch.no_grad():
        logits = pm.model(**batch.inputs).logits
    return target_values(pm, batch, logits)
