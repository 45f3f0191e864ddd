"""Headless encoders (sentence-transformers and bare ``*Model`` checkpoints): the pooled embedding.

A checkpoint without a task head has no class to explain. probe does not bolt a random head onto
it: the model is loaded as its bare encoder class, and its output is the sentence embedding the
checkpoint was trained to produce, pooled the way its own sentence-transformers configuration says
(``1_Pooling/config.json``: mean over non-padding tokens for all-MiniLM-L6-v2; ``modules.json``
lists a ``Normalize`` module when the embedding is scaled to unit length). Without that
configuration, mean pooling over non-padding tokens, no normalisation, and the pooling says so.

The pooling has no weights. The loaded class is the bare encoder class with only its ``forward``
extended: module paths, parameters and the checkpoint's keys are exactly the bare class's, and the
pooled embedding is returned as ``logits`` (``[batch, hidden]``), the one field every probe
method reads; targets (:mod:`probe.rows.target`) turn it into a similarity or one dimension.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers.utils import ModelOutput

from probe.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
_ST_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
            "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


@dataclass(frozen=True)
class Pooling:
    """How token states become one embedding."""

    mode: str  # one of POOLING_MODES
    normalize: bool  # scaled to unit L2 norm after pooling
    source: str  # where the choice was read from

    def to_dict(self) -> dict:
        return {"mode": self.mode, "normalize": self.normalize, "source": self.source}


def is_sentence_transformers_folder(path: str | Path) -> bool:
    return (Path(path) / "modules.json").is_file()


def read_pooling(path: str | Path) -> Pooling:
    """The pooling of the sentence-transformers model in ``path``, or mean pooling if it has none."""
    folder = Path(path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling("mean", False, "default (no sentence-transformers modules.json)")
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(m.get("type", "")) for m in modules]
        pooling_entry = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {modules_file}: {exc}; fix the file or remove it for mean pooling") from None
    normalize = any(t.endswith(".Normalize") for t in types)
    if pooling_entry is None:
        return Pooling("mean", normalize, f"default ({modules_file.name} lists no Pooling module)")
    config_file = folder / str(pooling_entry.get("path", "")) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the pooling config {config_file}: {exc}") from None
    modes = [mode for key, mode in _ST_KEYS.items() if config.get(key)]
    if len(modes) != 1:
        others = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _ST_KEYS)
        raise ModelLoadError(
            f"pooling config {config_file} turns on {modes + others or 'no mode'}: probe supports exactly one of "
            f"{', '.join(POOLING_MODES)}")
    return Pooling(modes[0], normalize, str(config_file.relative_to(folder)))


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: Pooling) -> torch.Tensor:
    """[batch, seq, hidden] token states -> [batch, hidden] embedding (padding excluded)."""
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    mask = attention_mask.to(hidden.dtype)[..., None]  # [batch, seq, 1]
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "max":
        pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    else:
        count = mask.sum(dim=1).clamp(min=1)  # [batch, 1]
        summed = (hidden * mask).sum(dim=1)  # [batch, hidden]
        pooled = summed / (count if pooling.mode == "mean" else count.sqrt())
    if pooling.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled  # [batch, hidden]


@functools.cache
def pooled_encoder_class(base_class: type[PreTrainedModel]) -> type:
    """``base_class`` (a bare encoder, e.g. ``BertModel``) whose output also carries the pooled
    embedding as ``logits`` ``[batch, hidden]``; set ``model.probe_pooling`` (a :class:`Pooling`)."""
    signature = inspect.signature(base_class.forward)

    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        out = base_class.forward(self, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [batch, seq, hidden]
        pooled = pool(hidden, bound.arguments.get("attention_mask"), self.probe_pooling)  # [batch, hidden]
        if isinstance(out, tuple):
            return (pooled,) + out
        fields = {key: value for key, value in out.items()}
        return EncoderOutput(logits=pooled, **{k: v for k, v in fields.items() if k in _OUTPUT_FIELDS})

    forward.__signature__ = signature  # type: ignore[attr-defined]  # functions take attributes; inspect reads it
    forward.__doc__ = f"{base_class.__name__}.forward, plus the pooled embedding as ``logits`` [batch, hidden]."
    return type(f"Pooled{base_class.__name__}", (base_class,), {"forward": forward, "__module__": __name__})


@dataclass
class EncoderOutput(ModelOutput):
    """A headless encoder's output: the pooled embedding and the encoder's own fields."""

    logits: torch.Tensor | None = None  # [batch, hidden] pooled sentence embedding
    last_hidden_state: torch.Tensor | None = None  # [batch, seq, hidden]
    hidden_states: tuple | None = None
    attentions: tuple | None = None


_OUTPUT_FIELDS = ("last_hidden_state", "hidden_states", "attentions")
