"""Preparing examples: texts tokenised and their targets resolved (:func:`prepare`). A classifier's
given or predicted label, a language model's continuation or greedy output (token by token with
``steps``, with the output written so far as input with ``target_side``), a chat prompt laid out by
its template, contrasts and encoder targets checked and set, and each example's value on its
unperturbed input."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from probe.errors import InputError
from probe.rows.forward import build_rows, forward_accepts, plain_kv_cache
from probe.rows.target import PreparedExample, TargetSpec, label_index, special_mask
from probe.rows.values import evaluate, output_values, target_values
from probe.spec.target import TARGET_KINDS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from probe.models.core import ProbeModel


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
        examples = _with_continuations(pm, examples, continuations)
    elif task.next_token:
        with torch.no_grad():
            logits = pm.model(**batch).logits
        next_ids = [[int(logits[i, lengths[i] - 1].argmax())] for i in range(len(examples))]
        examples = [dataclasses.replace(e, target_ids=ids, label_name=pm.tokenizer.decode(ids))
                    for e, ids in zip(examples, next_ids)]
    else:
        examples = _with_greedy_outputs(pm, examples, batch, max_new_tokens)
    if target.contrast is not None:
        examples = _with_foils(pm, examples, contrasts)
    values = evaluate(pm, [(e.input_ids, e) for e in examples])
    return [dataclasses.replace(e, original_value=value) for e, value in zip(examples, values.tolist())]


def _with_continuations(pm: ProbeModel, examples: list[PreparedExample], continuations: list) -> list[PreparedExample]:
    """``examples`` with each one's continuation as its target ids (a decoder's output is a whole
    sequence, its end token included; a causal LM's continuation goes on the input)."""
    ids = {}
    for text in dict.fromkeys(continuations):
        if not isinstance(text, str):
            raise InputError(f"continuation {text!r} is not a text: give a string, or a list with one per text")
        ids[text] = pm.tokenizer(text, add_special_tokens=pm.task.encoder_decoder)["input_ids"]
        if not ids[text]:
            raise InputError(f"target continuation {text!r} tokenises to nothing: give a non-empty text")
    examples = [dataclasses.replace(e, target_ids=list(ids[text]), label_name=text)
                for e, text in zip(examples, continuations)]
    _check_positions(pm, examples)
    return examples


def _with_greedy_outputs(pm: ProbeModel, examples: list[PreparedExample], batch, max_new_tokens: int
                         ) -> list[PreparedExample]:
    """``examples`` with a seq2seq model's greedy output of up to ``max_new_tokens`` as their target ids."""
    with torch.no_grad():
        generated = pm.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    from probe.models.text import decoder_start_id

    start = decoder_start_id(pm)
    pad = pm.tokenizer.pad_token_id
    examples = list(examples)
    for i, example in enumerate(examples):
        out = [t for t in generated[i].tolist()]
        if out and out[0] == start:
            out = out[1:]
        out = [t for t in out if t != pad] or [pm.tokenizer.eos_token_id]
        examples[i] = dataclasses.replace(example, target_ids=out,
                                          label_name=pm.tokenizer.decode(out, skip_special_tokens=True))
    return examples


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


def control_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
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
    position ids, or whose key/value cache is not plain (:func:`~probe.rows.forward.plain_kv_cache`: a recurrent or
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
    return done  # type: ignore[return-value]  # the width groups hold every index: no entry is left None


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

    reference = encode_texts(pm, [target.reference])  # type: ignore[list-item]  # str: _check_encoder_target
    with torch.no_grad():
        embedding = pm.model(**reference).logits[0].float()  # [hidden]
    return [dataclasses.replace(e, reference_embedding=embedding, label_name=target.reference) for e in examples]
