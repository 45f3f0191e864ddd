"""Tokenisation with the checks a user's text needs (empty, too long), and a batch's model inputs.

:func:`encode_texts` and :class:`TruncationWarning` live in :mod:`probe.models.core` (what
``ProbeModel.encode`` runs) and are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from probe.models.core import ProbeModel


def forward_inputs(pm: ProbeModel, batch: Mapping[str, torch.Tensor],
                   decoder_batch: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Keyword arguments for ``pm.model(**...)``.

    Seq2seq models need decoder inputs: ``decoder_batch`` (a tokenised target) when given, else the
    source itself shifted right, which is enough for checks that only need a decoder to run.
    """
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if not pm.task.encoder_decoder:
        return inputs
    target = decoder_batch if decoder_batch is not None else batch
    inputs["decoder_input_ids"] = shift_right(pm, target["input_ids"], target["attention_mask"])
    # Shifting right keeps the length: the start token plus the first n-1 target tokens are real.
    inputs["decoder_attention_mask"] = target["attention_mask"]
    return inputs


def decoder_start_id(pm: ProbeModel) -> int:
    """The token a seq2seq decoder starts from: the config's start token, else pad, else 0."""
    config = pm.model.config
    for name in ("decoder_start_token_id", "pad_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


def shift_right(pm: ProbeModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[start] + ids[:-1]`` per row, pad behind each row's real tokens: [batch, length].

    Written here rather than taken from the model's ``prepare_decoder_input_ids_from_labels``, which
    some classes lack (blenderbot, m2m_100, nllb-moe, seamless_m4t) and others (mbart, plbart) build
    from the last real token, so that the decoder inputs of a row would change with the padding.
    """
    import torch

    pad = pm.tokenizer.pad_token_id if pm.tokenizer.pad_token_id is not None else 0
    shifted = torch.cat([torch.full_like(ids[:, :1], decoder_start_id(pm)), ids[:, :-1]], dim=1)
    return torch.where(mask.bool(), shifted, torch.full_like(shifted, pad))
