"""Tokenisation with the checks a user's text needs (empty, too long)."""

from __future__ import annotations

import warnings

from probe.errors import InputError


class TruncationWarning(UserWarning):
    """A text was longer than the model's window and was cut."""


def encode_texts(pm, texts: list[str], *, strict_length: bool = False, max_length: int | None = None):
    """Right-padded batch for ``pm``; refuses empty texts and over-long ones when ``strict_length``."""
    if isinstance(texts, str):
        texts = [texts]
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"text #{i} is empty: give at least one word to explain")
    limit = min(max_length or pm.contract.max_positions, pm.contract.max_positions)
    tok = pm.tokenizer
    lengths = [len(ids) for ids in tok(list(texts), add_special_tokens=True)["input_ids"]]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if too_long:
        i, n = too_long[0]
        if strict_length:
            raise InputError(
                f"text #{i} has {n} tokens, more than the model's window of {limit}: shorten it, "
                "or drop --strict-length to truncate"
            )
        warnings.warn(
            f"{len(too_long)} text(s) longer than the model's window of {limit} tokens were truncated (first: #{i}, {n} tokens)",
            TruncationWarning,
            stacklevel=3,
        )
    batch = tok(list(texts), padding=True, truncation=True, max_length=limit, return_tensors="pt")
    if batch["input_ids"].shape[1] == 0 or bool((batch["attention_mask"].sum(dim=1) == 0).any()):
        raise InputError("a text tokenised to no tokens: give text the tokenizer can read")
    return batch.to(pm.device)


def forward_inputs(pm, batch, decoder_batch=None) -> dict:
    """Keyword arguments for ``pm.model(**...)``.

    Seq2seq models need decoder inputs: ``decoder_batch`` (a tokenised target) when given, else the
    source itself shifted right, which is enough for checks that only need a decoder to run.
    """
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if pm.task != "seq2seq":
        return inputs
    target = decoder_batch if decoder_batch is not None else batch
    inputs["decoder_input_ids"] = shift_right(pm, target["input_ids"], target["attention_mask"])
    # Shifting right keeps the length: the start token plus the first n-1 target tokens are real.
    inputs["decoder_attention_mask"] = target["attention_mask"]
    return inputs


def decoder_start_id(pm) -> int:
    """The token a seq2seq decoder starts from: the config's start token, else pad, else 0."""
    config = pm.model.config
    for name in ("decoder_start_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


def shift_right(pm, ids, mask):
    """``[start] + ids[:-1]`` per row, pad behind each row's real tokens: [batch, length].

    Written here rather than taken from the model's ``prepare_decoder_input_ids_from_labels``, which
    some classes lack (blenderbot, m2m_100, nllb-moe, seamless_m4t) and others (mbart, plbart) build
    from the last real token, so that the decoder inputs of a row would change with the padding.
    """
    import torch

    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    shifted = torch.cat([torch.full_like(ids[:, :1], decoder_start_id(pm)), ids[:, :-1]], dim=1)
    return torch.where(mask.bool(), shifted, torch.full_like(shifted, pad))
