"""The attention contract: what a loaded model's attention is, read from the model itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from probe.models.architectures import STACK_ORDER, find_attention_modules


@dataclass(frozen=True)
class StackContract:
    stack: str  # encoder | decoder | cross
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int
    kv_head_of_query: tuple[int, ...]  # query head h reads key/value head kv_head_of_query[h]
    head_dim: int
    mask_kind: str  # bidirectional | causal | sliding_window(W) | cross (all encoder keys)
    module_class: str
    # how probe reaches the layers: "attention function" (the registry wrapper: reads any query rows,
    # recomputing them from query and key when the kernel returns none) or "probability module" (a
    # forward hook on the child that hands on the model's own [batch, head, query, key] probabilities:
    # full maps, as the model itself materialises them); both can edit
    capture_path: str = "attention function"
    can_edit: bool = True
    memory: str = "query rows asked for"
    sinks: bool = False  # an attention sink takes mass out of every row: rows sum to 1 minus it
    layer_heads: tuple[int, ...] = ()  # query heads per layer, where layers differ
    layer_head_dims: tuple[int, ...] = ()  # head dim per layer, where layers differ
    shared_layers: int = 0  # layers served by a module the model calls more than once per forward


@dataclass(frozen=True)
class AttentionContract:
    model_type: str
    task: str
    stacks: dict[str, StackContract]
    implementation: str  # the attention implementation the model was loaded with
    dtype: str
    device: str
    max_positions: int
    padding_side: str
    special_tokens: tuple[str, ...]
    module_paths: dict[tuple[str, int], str] = field(repr=False, default_factory=dict)
    sites: dict = field(repr=False, default_factory=dict)  # (stack, layer) -> probe.capture.sites.Site
    unreadable: dict[str, str] = field(default_factory=dict)  # module path -> why probe cannot read it
    detected_by: str = "layout table"
    #: weights the checkpoint did not hold, left at random initialisation (missing or mismatched keys)
    random_weights: tuple[str, ...] = ()
    #: whether the user allowed explaining a model with random weights
    random_weights_allowed: bool = False
    #: a headless encoder's pooling (mode, normalize, source); None for other tasks
    pooling: dict | None = None
    #: context-mixing method -> None when it runs on this model, else why not (one line)
    context_mixing: dict[str, str | None] = field(default_factory=dict)

    @property
    def primary_stack(self) -> str:
        """The stack whose attention explains the prediction's inputs (encoder if there is one)."""
        return "encoder" if "encoder" in self.stacks else "decoder"

    @property
    def n_layers(self) -> int:
        return self.stacks[self.primary_stack].n_layers

    @property
    def n_heads(self) -> int:
        return self.stacks[self.primary_stack].n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.stacks[self.primary_stack].n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.stacks[self.primary_stack].head_dim

    def to_dict(self) -> dict:
        primary = self.stacks[self.primary_stack]
        return {
            "model_type": self.model_type,
            "task": self.task,
            "n_layers": primary.n_layers,
            "n_heads": primary.n_heads,
            "n_kv_heads": primary.n_kv_heads,
            "kv_head_of_query": list(primary.kv_head_of_query),
            "head_dim": primary.head_dim,
            "mask_kind": primary.mask_kind,
            "implementation": self.implementation,
            "dtype": self.dtype,
            "device": self.device,
            "max_positions": self.max_positions,
            "padding_side": self.padding_side,
            "special_tokens": list(self.special_tokens),
            "stacks": {name: {**asdict(s), "kv_head_of_query": list(s.kv_head_of_query),
                              "layer_heads": list(s.layer_heads), "layer_head_dims": list(s.layer_head_dims)}
                       for name, s in self.stacks.items()},
            "unreadable": dict(self.unreadable),
            "detected_by": self.detected_by,
            "context_mixing": {m: ("supported" if why is None else why) for m, why in self.context_mixing.items()},
            "random_weights": list(self.random_weights),
            "random_weights_allowed": self.random_weights_allowed,
            "pooling": self.pooling,
        }


def _max_positions(config, tokenizer) -> int:
    candidates = []
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            candidates.append(value)
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < 1_000_000:
        candidates.append(model_max)
    # T5 has relative positions and no hard window; 512 is what it was trained on.
    return min(candidates) if candidates else 512


def _heads_and_dim(module, config) -> tuple[int | None, int | None]:
    sub = getattr(module, "config", config)
    n_heads = (
        getattr(module, "num_heads", None)
        or getattr(module, "num_attention_heads", None)
        or getattr(module, "n_heads", None)
        or getattr(sub, "num_attention_heads", None)
        or getattr(sub, "n_head", None)
    )
    head_dim = (
        getattr(module, "head_dim", None)
        or getattr(module, "attention_head_size", None)
        or getattr(module, "key_value_proj_dim", None)
    )
    return (n_heads if isinstance(n_heads, int) else None), (head_dim if isinstance(head_dim, int) else None)


def _stack_contract(stack: str, layers: dict[int, object], config, task: str, sites: dict | None = None) -> StackContract:
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
    elif stack == "encoder" and task != "causal_lm":
        mask_kind = "bidirectional"
    elif seen and not all(seen) and task != "causal_lm":
        # a stack named neither encoder nor decoder (xlm's "attentions") whose maps, watched, look ahead
        mask_kind = "bidirectional"
    else:
        window = getattr(sub, "sliding_window", None)
        mask_kind = f"sliding_window({window})" if isinstance(window, int) and window > 0 else "causal"
    per_layer = [_heads_and_dim(layers[i], config) for i in sorted(layers)]
    layer_heads = tuple(h or int(n_heads) for h, _ in per_layer)
    layer_dims = tuple(d or int(head_dim) for _, d in per_layer)
    kinds = {site.kind for (s, _), site in (sites or {}).items() if s == stack}
    path = {"function": "attention function", "probabilities": "probability module", "softmax": "softmax call"}
    capture_path = " + ".join(path[k] for k in sorted(kinds)) if kinds else "attention function"
    calls = {}
    for (s, _), site in (sites or {}).items():
        if s == stack:
            calls[site.path] = calls.get(site.path, 0) + 1
    return StackContract(
        stack=stack, n_layers=len(layers), n_heads=int(n_heads), n_kv_heads=int(n_kv_heads),
        kv_head_of_query=kv_map, head_dim=int(head_dim), mask_kind=mask_kind, module_class=type(module).__name__,
        capture_path=capture_path, can_edit=True,
        memory="full maps (the model's own)" if kinds & {"probabilities", "softmax"} else "query rows asked for",
        sinks=any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in layers.values())
        or any(site.sinks for (s, _), site in (sites or {}).items() if s == stack),
        layer_heads=layer_heads if len(set(layer_heads)) > 1 else (),
        layer_head_dims=layer_dims if len(set(layer_dims)) > 1 else (),
        shared_layers=sum(n for n in calls.values() if n > 1),
    )


def _locate(model, tokenizer, task):
    """(paths, sites, unreadable, how): the layout table where the model type has an entry, else one
    watched forward pass (probe.capture.sites), else module names."""
    from probe.capture.sites import Site, discover_sites
    from probe.models.architectures import ATTENTION_LAYOUTS, STACK_ORDER

    if getattr(model.config, "model_type", "") in ATTENTION_LAYOUTS:
        paths = find_attention_modules(model)
        return paths, {p: Site(p[0], p[1], path, "function") for p, path in paths.items()}, {}, "layout table"
    try:
        found, unreadable = discover_sites(model, tokenizer, task)
    except Exception as exc:  # noqa: BLE001 - any failure of the watched forward falls back to module names
        paths = find_attention_modules(model)
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
        return paths, {p: Site(p[0], p[1], path, "function") for p, path in paths.items()}, {}, \
            f"module names (the watched forward pass failed: {reason})"
    sites = {(site.stack, site.layer): site for site in found if site.stack in STACK_ORDER}
    return {p: site.path for p, site in sites.items()}, sites, unreadable, "a watched forward pass"


def build_contract(model, tokenizer, task: str | None = None, *, random_weights: tuple[str, ...] = (),
                   random_weights_allowed: bool = False, pooling: dict | None = None) -> AttentionContract:
    from probe.models.tasks import _infer_task

    config = model.config
    task = task or _infer_task(config)
    paths, sites, unreadable, detected_by = _locate(model, tokenizer, task)
    modules = dict(model.named_modules())
    by_stack: dict[str, dict[int, object]] = {}
    for (stack, layer), path in paths.items():
        by_stack.setdefault(stack, {})[layer] = modules[path]
    stacks = {}
    for stack in STACK_ORDER:
        if stack in by_stack:
            stacks[stack] = _stack_contract(stack, by_stack[stack], config, task, sites)
    parameter = next(model.parameters())
    special = tuple(sorted(set(getattr(tokenizer, "all_special_tokens", []) or [])))
    return AttentionContract(
        model_type=config.model_type,
        task=task,
        stacks=stacks,
        implementation=str(getattr(config, "_attn_implementation", None) or "eager"),
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
