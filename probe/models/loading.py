"""Load a model by HF id, local folder or ``builtin:NAME`` into a :class:`ProbeModel`."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import InputError, ModelLoadError

if TYPE_CHECKING:  # imported for annotations only: loading this module must not import torch
    import torch
    from transformers import BatchEncoding, PreTrainedTokenizerBase

    from probe.models.contract import AttentionContract

from probe.models.tasks import _infer_task, _task_of_class  # noqa: E402,F401  (torch-free; re-exported)

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
TASKS = ("classification", "causal_lm", "seq2seq", "encoder")
#: random weights named in a refusal before "and N more"
_SHOWN_RANDOM = 6


def resolve_device(device: str | None):
    """Turn a user's device string into a ``torch.device``, or explain why it cannot be used."""
    import torch

    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} asked for but CUDA is not available on this machine: use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type not in ("cpu", "mps"):
        raise InputError(f"unsupported device {device!r}: use cpu, cuda, cuda:N or auto")
    return parsed


def check_dtype_on_device(dtype, device) -> None:
    """Refuse a dtype the device cannot run (bf16 on a GPU without bf16 support)."""
    import torch

    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise InputError(f"{torch.cuda.get_device_name(device)} cannot run bf16: use --dtype fp16 or fp32")


def resolve_dtype(dtype: str | None):
    import torch

    if dtype in (None, "", "auto"):
        return torch.float32
    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise InputError(f"unknown dtype {dtype!r}: use one of fp32, bf16, fp16")
    return getattr(torch, name)


@dataclass
class ProbeModel:
    """A loaded model with its tokenizer and attention contract. Made only by :func:`load_model`
    (a model by name or folder) or :func:`wrap_model` (a model and tokenizer already in memory)."""

    name: str  # what the user asked for
    path: str  # a folder (or hub id) that ``from_pretrained`` loads; for a wrapped model, its config's name_or_path
    model: torch.nn.Module  # a transformers PreTrainedModel in eval mode
    tokenizer: PreTrainedTokenizerBase  # right padding, with a pad token
    task: str  # one of TASKS
    contract: AttentionContract
    load_seconds: float
    metadata: dict = field(default_factory=dict)
    #: weights the checkpoint did not hold (missing or of another shape), left at random initialisation
    random_weights: tuple[str, ...] = ()
    #: the user said explicitly that a model with random weights may be explained
    allow_random_weights: bool = False
    #: a headless encoder's pooling (``probe.models.encoder.Pooling``); None for other tasks
    pooling: object = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_length(self) -> int:
        return self.contract.max_positions

    def encode(self, texts: list[str], *, strict_length: bool = False, max_length: int | None = None) -> BatchEncoding:
        """Tokenise a batch, right-padded. Returns a BatchEncoding on the model's device.

        Right padding keeps real tokens at positions 0..n-1 in every model, so batch of one and
        batch of N agree (left padding shifts positions of models that derive them from the cache).
        Too-long texts are truncated with a warning, or refused when ``strict_length``.
        """
        from probe.models.text import encode_texts

        return encode_texts(self, texts, strict_length=strict_length, max_length=max_length)


def _hub_unreachable() -> bool:
    """True when the hub cannot be used: offline mode set, or its name does not resolve.

    Checked up front so that an unknown id fails at once instead of after minutes of retries.
    """
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return True
    try:
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        return True
    return False


def _auto_class(task: str, config=None):
    import transformers

    if task == "encoder":
        from probe.models.encoder import pooled_encoder_class

        try:
            base = transformers.MODEL_MAPPING[type(config)]
        except KeyError:
            raise ModelLoadError(f"transformers has no bare encoder class for model type {config.model_type!r}: "
                                 "load it as classification, causal_lm or seq2seq") from None
        return pooled_encoder_class(base)
    return {
        "classification": transformers.AutoModelForSequenceClassification,
        "causal_lm": transformers.AutoModelForCausalLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[task]


def load_model(
    name: str,
    *,
    device: str | None = "cpu",
    dtype: str | None = "fp32",
    attn_implementation: str | None = None,
    task: str | None = None,
    cache_dir: str | Path | None = None,
    device_map: str | None = None,
    allow_random_weights: bool = False,
) -> ProbeModel:
    """Load ``name`` (``builtin:NAME``, a local folder, or a hub id) in eval mode.

    Weights the checkpoint does not hold (``from_pretrained``'s missing and shape-mismatched keys,
    e.g. the classifier of an encoder loaded as a classifier) are left at random initialisation by
    transformers; such a model is refused with one line naming them unless ``allow_random_weights``
    (they are then listed in the contract and every report). ``task="encoder"`` (inferred for
    sentence-transformers folders and bare ``*Model`` checkpoints) loads the bare encoder and
    explains its pooled embedding (:mod:`probe.models.encoder`).

    ``attn_implementation`` is passed through to transformers (default: its own default, ``sdpa``);
    capture works on either ``sdpa`` or ``eager`` without reloading.
    """
    started = time.perf_counter()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    check_dtype_on_device(torch_dtype, torch_device)
    if task is not None and task not in TASKS:
        raise InputError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    metadata: dict = {}
    from_hub = False
    if not isinstance(name, str) or not name.strip():
        raise InputError("empty model name: give builtin:NAME, a local folder or a hub id")
    if name.startswith("builtin:"):
        from probe.models.builtins import BUILTIN_MODELS, materialize_builtin

        builtin = name.split(":", 1)[1]
        if builtin not in BUILTIN_MODELS:
            raise ModelLoadError(
                f"unknown built-in model {builtin!r}: valid are {', '.join('builtin:' + n for n in BUILTIN_MODELS)}"
            )
        folder = materialize_builtin(builtin, cache_dir=cache_dir)
        path = str(folder)
        meta_file = Path(folder) / "probe_builtin.json"
        if meta_file.exists():
            import json

            metadata = json.loads(meta_file.read_text())
    else:
        expanded = Path(name).expanduser()
        if expanded.exists():
            if not expanded.is_dir():
                raise ModelLoadError(f"model path {name!r} is a file, not a folder: give the folder holding config.json")
            if not (expanded / "config.json").exists():
                raise ModelLoadError(
                    f"folder {name!r} has no config.json: give a folder saved with save_pretrained, or builtin:minilm-rt"
                )
            path = str(expanded)
        elif name.startswith((".", "/", "~")):
            raise ModelLoadError(f"model folder {name!r} does not exist: check the path, or use builtin:minilm-rt")
        else:
            path = name  # a hub id
            from_hub = True

    import transformers

    # Only a hub id needs the network; check it up front so an offline run fails at once.
    local_only = not from_hub or _hub_unreachable()
    # transformers logs loading reports (unused/missing weights); probe reports its own way.
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not from_hub:
            raise ModelLoadError(f"cannot read the config of model {name!r}: {first[:200]}") from None
        raise ModelLoadError(
            f"cannot load model {name!r}: it is not a built-in or a local folder, and the hub "
            f"{'is unreachable (offline) and it is not in the local cache' if local_only else 'did not provide it (' + first[:120] + ')'}; "
            "use builtin:minilm-rt, builtin:smollm2-135m or a local folder"
        ) from None
    task = task or _infer_task(config, path if not from_hub else None)
    kwargs = {"dtype": torch_dtype, "local_files_only": local_only, "output_loading_info": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map:
        kwargs["device_map"] = device_map
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, loading_info = _auto_class(task, config).from_pretrained(path, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model {name!r} as {task}: {first[:200]}") from None
    random_weights = _random_weights(loading_info)
    if random_weights and not allow_random_weights:
        shown = ", ".join(random_weights[:_SHOWN_RANDOM])
        more = f" and {len(random_weights) - _SHOWN_RANDOM} more" if len(random_weights) > _SHOWN_RANDOM else ""
        headless = " (a headless encoder: load it with task encoder and a similarity or dimension target)" \
            if task == "classification" and _infer_task(config, path if not from_hub else None) == "encoder" else ""
        raise ModelLoadError(
            f"model {name!r} loaded as {task} has {len(random_weights)} weight(s) its checkpoint does not hold, "
            f"left at random initialisation: {shown}{more}; explaining it would explain random weights{headless}; "
            "pass --allow-random-weights (study/claim file: model.allow_random_weights: true) to go on anyway")
    pooling = None
    if task == "encoder":
        from probe.models.encoder import Pooling, read_pooling

        pooling = read_pooling(path) if not from_hub else Pooling("mean", False, "default (hub id: pooling not read)")
        model.probe_pooling = pooling
    if not device_map:
        model.to(torch_device)
    model.eval()
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; padded positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token

    from probe.models.contract import build_contract

    contract = build_contract(model, tokenizer, task, random_weights=random_weights,
                              random_weights_allowed=allow_random_weights,
                              pooling=pooling.to_dict() if pooling is not None else None)
    if not contract.stacks:
        why = "; ".join(sorted(set(contract.unreadable.values()))) or "it has no softmax attention module"
        raise ModelLoadError(
            f"model {name!r} (type {config.model_type!r}) has no attention probe can read ({why}): "
            "use a transformer with softmax self-attention (BERT, GPT-2, Llama, T5, BART families)"
        )
    logging.getLogger("probe").debug("loaded %s in %.2fs", name, time.perf_counter() - started)
    return _with_method_support(ProbeModel(
        name=name, path=path, model=model, tokenizer=tokenizer, task=task, contract=contract,
        load_seconds=time.perf_counter() - started, metadata=metadata, random_weights=random_weights,
        allow_random_weights=bool(allow_random_weights), pooling=pooling,
    ))


def _with_method_support(pm: ProbeModel) -> ProbeModel:
    """The contract states which context-mixing methods run on this model (read from its structure
    and probe's layout tables, no forward pass)."""
    from probe.models.architectures import context_mixing_support  # imports torch: not at module level
    from probe.names import CONTEXT_MIXING_METHODS

    support = {method: context_mixing_support(pm, method) for method in CONTEXT_MIXING_METHODS}
    pm.contract = replace(pm.contract, context_mixing=support)
    return pm


def wrap_model(model, tokenizer, *, name: str | None = None, task: str | None = None) -> ProbeModel:
    """A :class:`ProbeModel` for a Hugging Face model and tokenizer already in memory.

    Builds the same contract :func:`load_model` does. The model is put in eval mode (in place, as
    probe needs); the tokenizer is copied, then given right padding and a pad token (the eos or unk
    token) when it has none, so the caller's tokenizer is left as it was. ``task`` (one of
    ``TASKS``) is read from the model's class (``...ForSequenceClassification``,
    ``...ForCausalLM``, ``...ForConditionalGeneration``) when not given. Refused, in one line: a
    model that is not a transformers model, a model without an output head, a tokenizer with more
    tokens than the model's input embedding has rows, or a model without attention modules probe
    can read.
    """
    import copy

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    started = time.perf_counter()
    if not isinstance(model, PreTrainedModel):
        raise InputError(f"wrap needs a transformers PreTrainedModel, got {type(model).__name__}: load one with "
                         "AutoModelForSequenceClassification, AutoModelForCausalLM or AutoModelForSeq2SeqLM")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise InputError(f"wrap needs a transformers tokenizer, got {type(tokenizer).__name__}: load one with "
                         "AutoTokenizer.from_pretrained")
    if task is not None and task not in TASKS:
        raise InputError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    task = task or _task_of_class(model)
    if task is None:
        raise InputError(f"{type(model).__name__} has no output head probe can explain: wrap a model loaded with "
                         "AutoModelForSequenceClassification, AutoModelForCausalLM or AutoModelForSeq2SeqLM, or give task=")
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise InputError(f"the tokenizer has {len(tokenizer)} tokens but {type(model).__name__}'s input embedding has "
                         f"{rows} rows: give the tokenizer the model was trained with")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        # As load_model: padded positions are masked out, so any existing token serves as pad.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise InputError(f"the tokenizer {type(tokenizer).__name__} has no pad, eos or unk token to pad a batch with: "
                         "set tokenizer.pad_token first")
    model.eval()

    from probe.models.contract import build_contract

    contract = build_contract(model, tokenizer, task)
    label = name or str(getattr(model.config, "_name_or_path", "") or f"in-memory {type(model).__name__}")
    if not contract.stacks:
        raise InputError(f"model {label!r} (type {model.config.model_type!r}) has no attention modules probe can "
                         "read: use a transformer with self-attention (BERT, GPT-2, Llama, T5, BART families)")
    return _with_method_support(ProbeModel(
        name=label, path=str(getattr(model.config, "_name_or_path", "") or ""), model=model, tokenizer=tokenizer,
        task=task, contract=contract, load_seconds=time.perf_counter() - started, metadata={"wrapped": True},
    ))


def _random_weights(loading_info: dict) -> tuple[str, ...]:
    """Sorted names of the weights ``from_pretrained`` did not load: missing, or shaped otherwise."""
    missing = set(loading_info.get("missing_keys") or ())
    mismatched = {entry[0] if isinstance(entry, (tuple, list)) else entry
                  for entry in loading_info.get("mismatched_keys") or ()}
    return tuple(sorted(missing | mismatched))
