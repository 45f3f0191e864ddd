"""The attention contract: what a loaded model's attention is, read from the model itself.

The types (:class:`AttentionContract`, :class:`StackContract`) live in :mod:`probe.models.core`
and are re-exported here; this module builds them (:func:`build_contract`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from probe.hooks.attention_functions import implementation_of
from probe.hooks.implicit import mixer_kind
from probe.hooks.readers import FUNCTION
from probe.hooks.sites import Site, discover_sites, implicit_sites
from probe.models.architectures import (
    ATTENTION_LAYOUTS,
    CONFIG_HEAD_COUNT_ATTRIBUTES,
    DEFAULT_MAX_POSITIONS,
    HEAD_COUNT_ATTRIBUTES,
    HEAD_DIM_ATTRIBUTES,
    MAX_POSITION_ATTRIBUTES,
    STACK_ORDER,
    find_attention_modules,
)
from probe.models.core import AttentionContract, StackContract
from probe.models.tasks import infer_task
from probe.names import HYBRID_MAPS, IMPLICIT_MAPS
from probe.tasks import Task, task_named

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _max_positions(config, tokenizer) -> int:
    candidates = []
    for attr in MAX_POSITION_ATTRIBUTES:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            candidates.append(value)
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < 1_000_000:
        candidates.append(model_max)
    return min(candidates) if candidates else DEFAULT_MAX_POSITIONS


def _first_set(owners_and_attributes) -> object:
    """The first attribute value that is set (truthy), else the last one read: ``a or b or c``."""
    value = None
    for owner, attribute in owners_and_attributes:
        value = getattr(owner, attribute, None)
        if value:
            break
    return value


def _heads_and_dim(module, config) -> tuple[int | None, int | None]:
    sub = getattr(module, "config", config)
    n_heads = _first_set([(module, a) for a in HEAD_COUNT_ATTRIBUTES]
                         + [(sub, a) for a in CONFIG_HEAD_COUNT_ATTRIBUTES])
    head_dim = _first_set([(module, a) for a in HEAD_DIM_ATTRIBUTES])
    return (n_heads if isinstance(n_heads, int) else None), (head_dim if isinstance(head_dim, int) else None)


def _stack_contract(stack: str, layers: dict[int, object], config, task: Task, sites: dict | None = None) -> StackContract:
    module = layers[min(layers)]
    sub = getattr(module, "config", config)
    n_heads, head_dim = _heads_and_dim(module, config)
    groups = getattr(module, "num_key_value_groups", 1) or 1
    n_kv_heads = getattr(sub, "num_key_value_heads", None) if groups > 1 else n_heads
    n_kv_heads = n_kv_heads or n_heads // groups
    head_dim = head_dim or getattr(sub, "head_dim", None) or config.hidden_size // n_heads
    group = n_heads // n_kv_heads
    kv_map = tuple(h // group for h in range(n_heads))
    seen = [site.causal for (s, _), site in (sites or {}).items() if s == stack and site.causal is not None]
    if stack == "cross":
        mask_kind = "cross"
    elif stack == "encoder" and not task.next_token:
        mask_kind = "bidirectional"
    elif seen and not all(seen):
        # a stack named neither encoder nor decoder (xlm's "attentions") whose maps, watched, look
        # ahead; or a language model that reads every position (xlnet without a permutation mask)
        mask_kind = "bidirectional"
    else:
        window = getattr(sub, "sliding_window", None)
        mask_kind = f"sliding_window({window})" if isinstance(window, int) and window > 0 else "causal"
    per_layer = [_heads_and_dim(layers[i], config) for i in sorted(layers)]
    layer_heads = tuple(h or int(n_heads) for h, _ in per_layer)
    layer_dims = tuple(d or int(head_dim) for _, d in per_layer)
    readers = sorted({site.reader for (s, _), site in (sites or {}).items() if s == stack}, key=lambda r: r.name)
    capture_path = " + ".join(r.describe for r in readers) if readers else FUNCTION.describe
    calls: dict[str, int] = {}
    for (s, _), site in (sites or {}).items():
        if s == stack:
            calls[site.path] = calls.get(site.path, 0) + 1
    return StackContract(
        stack=stack, n_layers=len(layers), n_heads=int(n_heads), n_kv_heads=int(n_kv_heads),
        kv_head_of_query=kv_map, head_dim=int(head_dim), mask_kind=mask_kind, module_class=type(module).__name__,
        capture_path=capture_path, can_edit=all(r.can_edit for r in readers),
        memory="full maps (the model's own)" if any(r.full_maps for r in readers) else "query rows asked for",
        structure=next((text for r in readers if (text := r.structure(layers))), ""),
        sinks=any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in layers.values())
        or any(site.sinks for (s, _), site in (sites or {}).items() if s == stack),
        layer_heads=layer_heads if len(set(layer_heads)) > 1 else (),
        layer_head_dims=layer_dims if len(set(layer_dims)) > 1 else (),
        shared_layers=sum(n for n in calls.values() if n > 1),
    )


#: how a contract says its sites were found when the watched forward pass failed (then the reason follows)
WATCH_FAILED = "module names (the watched forward pass failed: "


def _runs_without_cache(model, tokenizer, task) -> bool:
    """Whether the watched forward pass, which failed with the model's ``use_cache=True``, runs with
    the cache off: then the cache (transformers'), not the model, is what fails. The config is
    restored in ``finally``."""
    config = model.config
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    try:
        discover_sites(model, tokenizer, task)
    except Exception:  # noqa: BLE001 - it fails either way: the cache is not the (only) cause
        return False
    finally:
        config.use_cache = True
    return True


def _locate(model, tokenizer, task):
    """(paths, sites, unreadable, how): the layout table where the model type has an entry, else one
    watched forward pass (probe.hooks.sites), else module names."""
    if getattr(model.config, "model_type", "") in ATTENTION_LAYOUTS:
        paths = find_attention_modules(model)
        return paths, {p: Site(p[0], p[1], path, FUNCTION) for p, path in paths.items()}, {}, "layout table"
    try:
        found, unreadable = discover_sites(model, tokenizer, task)
    except Exception as exc:  # noqa: BLE001 - any failure of the watched forward falls back to module names
        paths = find_attention_modules(model)
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
        if not paths and _runs_without_cache(model, tokenizer, task):
            reason += ("; it runs with use_cache=False, so transformers' key/value cache of this model fails "
                       "(e.g. an LFM2 without attention layers): set model.config.use_cache = False")
        return paths, {p: Site(p[0], p[1], path, FUNCTION) for p, path in paths.items()}, {}, \
            f"{WATCH_FAILED}{reason})"
    sites = {(site.stack, site.layer): site for site in found if site.stack in STACK_ORDER}
    if not sites and (mixers := implicit_sites(model)):  # no softmax attention: state-space mixers, read implicitly
        sites = {(site.stack, site.layer): site for site in mixers}
    kinds = {site.reader.implicit for site in sites.values()}
    if kinds == {True}:
        how = "mixer classes (implicit attention)"
    elif kinds == {True, False}:
        how = "a watched forward pass (softmax attention and mixer classes read as implicit attention, in call order)"
    else:
        how = "a watched forward pass"
    return {p: site.path for p, site in sites.items()}, sites, unreadable, how


def _implicit_stack_contract(stack: str, layers: dict[int, object]) -> StackContract:
    """A stack of state-space mixers read as implicit attention (probe.hooks.implicit): one map per
    map head, causal, signed, not editable."""
    module = layers[min(layers)]
    kind = mixer_kind(module)
    n_heads = kind.heads(module)
    return StackContract(
        stack=stack, n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_heads, kv_head_of_query=tuple(range(n_heads)),
        head_dim=kind.head_width(module), mask_kind="causal" if kind.causal else "bidirectional",
        module_class=type(module).__name__, capture_path=f"implicit {kind.name} matrix (heads: {kind.heads_are})", can_edit=False,
        memory="full maps (recomputed from each mixer's input)", maps=IMPLICIT_MAPS, mixer_class=type(module).__name__)


def _hybrid_stack_contract(stack: str, layers: dict[int, object], config, task: Task, sites: dict) -> StackContract:
    """A stack whose layers mix softmax attention with token mixers read as implicit attention (jamba,
    bamba, lfm2, ...): the softmax layers' contract (heads, kv map, mask, how they are read and
    edited), with every layer counted in model order, its map kind in ``layer_maps`` and its own
    head count and head width where the layers differ. Edits apply to the softmax layers only."""
    implicit = {layer for layer in layers if sites[(stack, layer)].reader.implicit}
    softmax_sites = {place: site for place, site in sites.items() if not site.reader.implicit}
    base = _stack_contract(stack, {layer: m for layer, m in layers.items() if layer not in implicit}, config, task,
                           softmax_sites)
    heads, widths = [], []
    for layer in sorted(layers):
        module = layers[layer]
        if layer in implicit:
            kind = mixer_kind(module)
            heads.append(kind.heads(module))
            widths.append(kind.head_width(module))
        else:
            n_heads, head_dim = _heads_and_dim(module, config)
            heads.append(n_heads or base.n_heads)
            widths.append(head_dim or base.head_dim)
    mixers = sorted({type(layers[layer]).__name__ for layer in implicit})
    names = sorted({mixer_kind(layers[layer]).name for layer in implicit})
    return replace(
        base, n_layers=len(layers), maps=HYBRID_MAPS, mixer_class=" + ".join(mixers),
        layer_maps=tuple(sites[(stack, layer)].reader.maps for layer in sorted(layers)),
        layer_heads=tuple(heads) if len(set(heads)) > 1 else (),
        layer_head_dims=tuple(widths) if len(set(widths)) > 1 else (),
        capture_path=f"{base.capture_path} ({len(layers) - len(implicit)} softmax layers) + implicit "
                     f"{', '.join(names)} matrix ({len(implicit)} layers, not editable)",
        memory=f"{base.memory}; full maps of the mixer layers (recomputed from each mixer's input)")


def build_contract(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task | str | None = None, *,
                   random_weights: tuple[str, ...] = (), random_weights_allowed: bool = False,
                   pooling: dict | None = None) -> AttentionContract:
    config = model.config
    task = task_named(task) if task is not None else infer_task(config)
    paths, sites, unreadable, detected_by = _locate(model, tokenizer, task)
    modules = dict(model.named_modules())
    by_stack: dict[str, dict[int, object]] = {}
    for (stack, layer), path in paths.items():
        by_stack.setdefault(stack, {})[layer] = modules[path]
    stacks = {}
    for stack in STACK_ORDER:
        implicit = [site.reader.implicit for (s, _), site in sites.items() if s == stack]
        if stack in by_stack and implicit and all(implicit):
            stacks[stack] = _implicit_stack_contract(stack, by_stack[stack])
        elif stack in by_stack and any(implicit):
            stacks[stack] = _hybrid_stack_contract(stack, by_stack[stack], config, task, sites)
        elif stack in by_stack:
            stacks[stack] = _stack_contract(stack, by_stack[stack], config, task, sites)
    parameter = next(model.parameters())
    special = tuple(sorted(set(getattr(tokenizer, "all_special_tokens", []) or [])))
    return AttentionContract(
        model_type=config.model_type,
        task=task,
        stacks=stacks,
        implementation=implementation_of(model),
        dtype=str(parameter.dtype).replace("torch.", ""),
        device=str(parameter.device),
        max_positions=_max_positions(config, tokenizer),
        padding_side=getattr(tokenizer, "padding_side", "right"),
        special_tokens=special,
        module_paths=dict(paths),
        sites=sites,
        unreadable=unreadable,
        detected_by=detected_by,
        random_weights=tuple(random_weights),
        random_weights_allowed=bool(random_weights_allowed),
        pooling=pooling,
    )
