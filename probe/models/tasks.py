"""Which of probe's tasks a model is, read from its config (and folder) or from its class.
Below :mod:`probe.models.loading` and :mod:`probe.models.contract`, which both need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from probe.tasks import TASKS, Task

if TYPE_CHECKING:  # imported for annotations only: this module imports neither torch nor transformers
    from transformers import PretrainedConfig, PreTrainedModel


def _is_bare_architecture(name: str) -> bool:
    """``BertModel``, ``RobertaModel``: a base class with no task head (``*For*``, ``*LMHead*``)."""
    return name.endswith("Model") and "For" not in name and "LMHead" not in name


def infer_task(config: PretrainedConfig, path: str | None = None) -> Task:
    """The task a checkpoint's config (and its folder) says it is."""
    return TASKS[_infer_name(config, path)]


def _infer_name(config, path: str | None) -> str:
    from probe.models.architectures import (
        CAUSAL_LM_TYPES,  # imports torch: this module does not
    )

    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    architectures = getattr(config, "architectures", None) or []
    if path is not None:
        from probe.models.encoder import is_sentence_transformers_folder

        if is_sentence_transformers_folder(path):
            return "encoder"
    bare = bool(architectures) and all(_is_bare_architecture(a) for a in architectures)
    if bare and not getattr(config, "is_decoder", False) and config.model_type not in CAUSAL_LM_TYPES:
        return "encoder"
    joined = " ".join(architectures)
    if "SequenceClassification" in joined:
        return "classification"
    if "CausalLM" in joined or "LMHeadModel" in joined:
        return "causal_lm"
    if getattr(config, "is_decoder", False) or config.model_type in CAUSAL_LM_TYPES:
        return "causal_lm"
    return "classification"


# Which head a model class carries, read from its class name (transformers' naming convention);
# the first match wins, so "ForConditionalGeneration" (encoder-decoder) is tried before the others.
_HEAD_TASKS = (
    ("ForConditionalGeneration", "seq2seq"), ("ForSeq2SeqLM", "seq2seq"),
    ("ForSequenceClassification", "classification"),
    ("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"),
)


def task_of_class(model: PreTrainedModel) -> Task | None:
    """The task a model's class name says it is; None for a class with no head probe explains."""
    name = type(model).__name__
    for marker, task_name in _HEAD_TASKS:
        if marker in name:
            task = TASKS[task_name]
            if task.encoder_decoder and not getattr(model.config, "is_encoder_decoder", False):
                return None  # e.g. a vision-language "...ForConditionalGeneration" that is not text-to-text
            return task
    return None
