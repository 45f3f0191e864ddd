"""Load a model by HF id, local folder, ``builtin:NAME`` or ``planted:NAME`` into a :class:`ProbeModel`."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import InputError, ModelLoadError
from probe.models.core import ProbeModel
from probe.models.tasks import infer_task, task_of_class
from probe.tasks import Task, task_named

if TYPE_CHECKING:  # imported for annotations only: loading this module must not import torch
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from probe.models.core import AttentionContract
    from probe.models.encoder import Pooling

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
#: random weights named in a refusal before "and N more"
_SHOWN_RANDOM = 6


def resolve_device(device: str | None) -> torch.device:
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
            raise InputError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s)")
    elif parsed.type not in ("cpu", "mps"):
        raise InputError(f"unsupported device {device!r}: use cpu, cuda, cuda:N or auto")
    return parsed


def check_dtype_on_device(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a dtype the device cannot run (bf16 on a GPU without bf16 support)."""
    import torch

    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise InputError(f"{torch.cuda.get_device_name(device)} cannot run bf16: use --dtype fp16 or fp32")


def resolve_dtype(dtype: str | None) -> torch.dtype:
    import torch

    if dtype in (None, "", "auto"):
        return torch.float32
    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise InputError(f"unknown dtype {dtype!r}: use one of fp32, bf16, fp16")
    return getattr(torch, name)


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


def _auto_class(task: Task, config=None):
    import transformers

    if task.embeds:
        from probe.models.encoder import pooled_encoder_class

        try:
            base = transformers.MODEL_MAPPING[type(config)]
        except KeyError:
            raise ModelLoadError(f"transformers has no bare encoder class for model type {config.model_type!r}: "
                                 "load it as classification, causal_lm or seq2seq") from None
        return pooled_encoder_class(base)
    return getattr(transformers, task.auto_class)


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
    """Load ``name`` (``builtin:NAME``, ``planted:NAME``, a local folder, or a hub id) in eval mode.

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
    asked = task_named(task) if task is not None else None
    path, from_hub, metadata = _find_model(name, cache_dir)
    folder = None if from_hub else path  # where a sentence-transformers configuration may sit

    # Only a hub id needs the network; check it up front so an offline run fails at once.
    local_only = not from_hub or _hub_unreachable()
    with quiet_transformers():
        config = _read_config(name, path, from_hub, local_only)
        task = asked or infer_task(config, folder)
        kwargs = _pretrained_kwargs(torch_dtype, local_only, attn_implementation, device_map)
        model, tokenizer, loading_info = _from_pretrained(name, path, task, config, kwargs)
    random_weights = _random_weights(loading_info)
    if random_weights and not allow_random_weights:
        _refuse_random_weights(name, task, config, folder, random_weights)
    pooling = _attach_pooling(model, task, folder)
    if not device_map:
        model.to(torch_device)
    model.eval()
    _pad_right(tokenizer)

    from probe.models.contract import build_contract

    contract = build_contract(model, tokenizer, task, random_weights=random_weights,
                              random_weights_allowed=allow_random_weights,
                              pooling=pooling.to_dict() if pooling is not None else None)
    _require_readable_attention(name, config, contract)
    logging.getLogger("probe").debug("loaded %s in %.2fs", name, time.perf_counter() - started)
    return _with_method_support(ProbeModel(
        name=name, path=path, model=model, tokenizer=tokenizer, task=task, contract=contract,
        load_seconds=time.perf_counter() - started, metadata=metadata, random_weights=random_weights,
        allow_random_weights=bool(allow_random_weights), pooling=pooling,
    ))


def _pretrained_kwargs(torch_dtype, local_only: bool, attn_implementation: str | None,
                       device_map: str | None) -> dict:
    """The keywords a load passes to every ``from_pretrained``."""
    return {"dtype": torch_dtype, "local_files_only": local_only, "output_loading_info": True,
            **({"attn_implementation": attn_implementation} if attn_implementation else {}),
            **({"device_map": device_map} if device_map else {})}


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' log at ERROR and its progress bars ("Loading weights") off while the block
    runs, both as they were afterwards: transformers logs loading reports (unused or missing
    weights) that probe reports its own way, and the user's own process keeps its settings."""
    import importlib

    from transformers.utils import logging as hf_logging

    hub_bars = importlib.import_module("huggingface_hub.utils.tqdm")  # the module; the package exports a function
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hub_states = dict(hub_bars.progress_bar_states)
    hf_logging.set_verbosity_error()
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # huggingface_hub warns where its environment variable decides
                hf_logging.enable_progress_bar()
        # transformers switches huggingface_hub's bars with its own: put the hub's back as they were
        hub_bars.progress_bar_states.clear()
        hub_bars.progress_bar_states.update(hub_states)


def not_a_model_name(name: object) -> str:
    """The one-line refusal of a ``load_model`` argument that is not a name: a model in memory is
    pointed to ``probe.wrap``, anything else to the names ``load_model`` takes."""
    kind = type(name).__name__
    if hasattr(name, "config") and hasattr(name, "forward"):
        return (f"load_model takes a name or folder, got a {kind} (a model in memory): use "
                "probe.wrap(model, tokenizer)")
    return (f"load_model takes a name or folder, got {kind} {str(name)[:40]!r}: give builtin:NAME, planted:NAME, a "
            "local folder or a hub id (for a model in memory: probe.wrap(model, tokenizer))")


def _find_model(name: str, cache_dir: str | Path | None) -> tuple[str, bool, dict]:
    """(what ``from_pretrained`` loads, whether it is a hub id, a built-in's metadata) for ``name``,
    or a one-line refusal of an empty name, an unknown built-in or a folder that cannot hold a model."""
    if not isinstance(name, str):
        raise InputError(not_a_model_name(name))
    if not name.strip():
        raise InputError("empty model name: give builtin:NAME, planted:NAME, a local folder or a hub id")
    if name.startswith("builtin:"):
        from probe.models.builtins import BUILTIN_MODELS, materialize_builtin

        builtin = name.split(":", 1)[1]
        if builtin not in BUILTIN_MODELS:
            raise ModelLoadError(
                f"unknown built-in model {builtin!r}: valid are {', '.join('builtin:' + n for n in BUILTIN_MODELS)}"
            )
        folder = materialize_builtin(builtin, cache_dir=cache_dir)
        metadata: dict = {}
        meta_file = Path(folder) / "probe_builtin.json"
        if meta_file.exists():
            import json

            metadata = json.loads(meta_file.read_text())
        return str(folder), False, metadata
    if name.startswith("planted:"):
        from probe.models.builtins import read_builtin_metadata
        from probe.models.planted import PLANTED_MODELS, materialize_planted

        planted = name.split(":", 1)[1]
        if planted not in PLANTED_MODELS:
            raise ModelLoadError(
                f"unknown planted model {planted!r}: valid are "
                f"{', '.join('planted:' + n for n in sorted(PLANTED_MODELS))}"
            )
        folder = materialize_planted(planted, cache_dir=cache_dir)
        return str(folder), False, read_builtin_metadata(folder)
    expanded = Path(name).expanduser()
    if expanded.exists():
        if not expanded.is_dir():
            raise ModelLoadError(f"model path {name!r} is a file, not a folder: give the folder holding config.json")
        if not (expanded / "config.json").exists():
            raise ModelLoadError(
                f"folder {name!r} has no config.json: give a folder saved with save_pretrained, or builtin:minilm-rt"
            )
        return str(expanded), False, {}
    if name.startswith((".", "/", "~")):
        raise ModelLoadError(f"model folder {name!r} does not exist: check the path, or use builtin:minilm-rt")
    return name, True, {}  # a hub id


#: the config keys of the layer count and of the query-head count, as architectures spell them
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def config_sizes(name: object) -> tuple[int, int] | None:
    """(layers, query heads) from the ``config.json`` of model ``name`` where it can be read without
    loading, building or downloading anything (a built-in or planted model built already, a local
    folder) and the model has one stack; None otherwise (a hub id, an encoder-decoder, a config that
    nests its text model, or one without both counts). Lets a study's layer and head indices be
    checked before the model loads (:mod:`probe.study.sizes`); the loaded contract is checked again."""
    import json

    if not isinstance(name, str) or not name.strip():
        return None
    folder: Path | None
    if name.startswith("builtin:"):
        from probe.models.builtins import built_builtin_folder

        folder = built_builtin_folder(name.split(":", 1)[1])
    elif name.startswith("planted:"):
        from probe.models.planted import built_planted_folder

        folder = built_planted_folder(name.split(":", 1)[1])
    else:
        folder = Path(name).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if folder is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("is_encoder_decoder") or "text_config" in config:
        return None
    layers = next((config[k] for k in _LAYER_KEYS if isinstance(config.get(k), int)), None)
    heads = next((config[k] for k in _HEAD_KEYS if isinstance(config.get(k), int)), None)
    return (layers, heads) if layers and heads else None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _read_config(name: str, path: str, from_hub: bool, local_only: bool) -> PretrainedConfig:
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        first = _first_line(exc)
        if not from_hub:
            raise ModelLoadError(f"cannot read the config of model {name!r}: {first[:200]}") from None
        raise ModelLoadError(
            f"cannot load model {name!r}: it is not a built-in or a local folder, and the hub "
            f"{'is unreachable (offline) and it is not in the local cache' if local_only else 'did not provide it (' + first[:120] + ')'}; "
            "use builtin:minilm-rt, builtin:smollm2-135m or a local folder"
        ) from None


def _from_pretrained(name: str, path: str, task: Task, config: PretrainedConfig,
                     kwargs: dict) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """(model, tokenizer, ``from_pretrained``'s loading info), or one line saying why not."""
    import transformers

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, loading_info = _auto_class(task, config).from_pretrained(path, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=kwargs["local_files_only"])
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot load model {name!r} as {task}: {_first_line(exc)[:200]}") from None
    return model, tokenizer, loading_info


def _refuse_random_weights(name: str, task: Task, config: PretrainedConfig, folder: str | None,
                           random_weights: tuple[str, ...]) -> None:
    shown = ", ".join(random_weights[:_SHOWN_RANDOM])
    more = f" and {len(random_weights) - _SHOWN_RANDOM} more" if len(random_weights) > _SHOWN_RANDOM else ""
    headless = " (a headless encoder: load it with task encoder and a similarity or dimension target)" \
        if task.labels and infer_task(config, folder).embeds else ""
    raise ModelLoadError(
        f"model {name!r} loaded as {task} has {len(random_weights)} weight(s) its checkpoint does not hold, "
        f"left at random initialisation: {shown}{more}; explaining it would explain random weights{headless}; "
        "pass --allow-random-weights (study/claim file: model.allow_random_weights: true) to go on anyway")


def _attach_pooling(model: PreTrainedModel, task: Task, folder: str | None) -> Pooling | None:
    """A headless encoder's pooling, read from its folder (a hub id: mean, said so) and set on the
    model (its forward pools with it); None for other tasks."""
    if not task.embeds:
        return None
    from probe.models.encoder import Pooling, read_pooling

    if folder is None:
        pooling = Pooling("mean", False, "default (hub id: pooling not read)")
    else:
        pooling = read_pooling(folder)
    model.probe_pooling = pooling
    return pooling


def _no_sites_reason(contract: AttentionContract) -> str:
    """Why a model has no site probe reads: its watched forward pass failed (and why: e.g.
    transformers' cache), or it has no softmax attention module."""
    from probe.models.contract import WATCH_FAILED

    if contract.detected_by.startswith(WATCH_FAILED):
        return "its forward pass failed: " + contract.detected_by[len(WATCH_FAILED):-1]
    return "it has no softmax attention module"


def _require_readable_attention(name: str, config: PretrainedConfig, contract: AttentionContract) -> None:
    if not contract.stacks:
        why = "; ".join(sorted(set(contract.unreadable.values()))) or _no_sites_reason(contract)
        raise ModelLoadError(
            f"model {name!r} (type {config.model_type!r}) has no attention probe can read ({why}): "
            "use a transformer with softmax self-attention (BERT, GPT-2, Llama, T5, BART families) or a model whose "
            "token mixers probe reads (Mamba, Mamba-2, RWKV and the hybrids built on them)"
        )


def _pad_right(tokenizer: PreTrainedTokenizerBase) -> None:
    """Right padding, and a pad token where the tokenizer has none (the tokenizer is changed in place)."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; padded positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token


def _with_method_support(pm: ProbeModel) -> ProbeModel:
    """The contract states which context-mixing methods run on this model (read from its structure
    and probe's layout tables, no forward pass)."""
    from probe import registry

    support = {m.name: m.skip_reason("maps", pm, 0) or m.skip_reason("support", pm, 0)
               for m in registry.methods(group="context mixing")}
    pm.contract = replace(pm.contract, context_mixing=support)
    return pm


def _check_special_tokens(model, tokenizer) -> None:
    """Refuse a tokenizer of another family: one whose begin/end-of-sequence tokens are other ids than
    the model's config says, or that has none where the config has both and marks texts with
    [CLS]/[SEP] instead (an encoder's tokenizer on a decoder)."""
    config = model.config
    name = type(tokenizer).__name__
    fix = "give the tokenizer the model was trained with (AutoTokenizer.from_pretrained of the same checkpoint)"
    for token in ("bos", "eos"):
        wanted = getattr(config, f"{token}_token_id", None)
        have = getattr(tokenizer, f"{token}_token_id", None)
        if isinstance(wanted, int) and isinstance(have, int) and wanted != have:
            raise InputError(f"the tokenizer {name} has {token} token id {have} but the model "
                             f"({config.model_type}) expects {wanted}: {fix}")
    if (isinstance(getattr(config, "bos_token_id", None), int) and isinstance(getattr(config, "eos_token_id", None), int)
            and tokenizer.bos_token_id is None and tokenizer.eos_token_id is None
            and tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None):
        raise InputError(f"the tokenizer {name} marks texts with {tokenizer.cls_token}/{tokenizer.sep_token} and has "
                         f"no "
                         f"begin/end-of-sequence tokens, which the model ({config.model_type}) uses "
                         f"(ids {config.bos_token_id}/{config.eos_token_id}): {fix}")


def wrap_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, name: str | None = None,
               task: str | None = None) -> ProbeModel:
    """A :class:`ProbeModel` for a Hugging Face model and tokenizer already in memory.

    Builds the same contract :func:`load_model` does. The model is put in eval mode (in place, as
    probe needs); the tokenizer is copied, then given right padding and a pad token (the eos or unk
    token) when it has none, so the caller's tokenizer is left as it was. ``task`` (one of
    ``probe.tasks.TASKS``) is read from the model's class (``...ForSequenceClassification``,
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
    task = task_named(task) if task is not None else task_of_class(model)
    if task is None:
        raise InputError(f"{type(model).__name__} has no output head probe can explain: wrap a model loaded with "
                         "AutoModelForSequenceClassification, AutoModelForCausalLM or AutoModelForSeq2SeqLM, or give "
                         "task=")
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise InputError(f"the tokenizer has {len(tokenizer)} tokens but {type(model).__name__}'s input embedding has "
                         f"{rows} rows: give the tokenizer the model was trained with")
    _check_special_tokens(model, tokenizer)
    tokenizer = copy.deepcopy(tokenizer)
    _pad_right(tokenizer)
    if tokenizer.pad_token is None:
        raise InputError(f"the tokenizer {type(tokenizer).__name__} has no pad, eos or unk token to pad a batch with: "
                         "set tokenizer.pad_token first")
    model.eval()

    from probe.models.contract import build_contract

    contract = build_contract(model, tokenizer, task)
    label = name or str(getattr(model.config, "_name_or_path", "") or f"in-memory {type(model).__name__}")
    if not contract.stacks:
        raise InputError(f"model {label!r} (type {model.config.model_type!r}) has no attention modules probe can "
                         f"read ({_no_sites_reason(contract)}): use a transformer with self-attention (BERT, GPT-2, "
                         "Llama, T5, BART families) or a model "
                         "whose token mixers probe reads (Mamba, Mamba-2, RWKV and the hybrids built on them)")
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
