"""Invariance checks of a model's attention and of probe's capture (the seeds' Minimal Acceptance).

Each check returns a :class:`CheckResult`; ``probe contract`` prints them as a table. Model-level
checks run the real model on a small padded batch; function-level checks call the model's own
attention function (the one its layers use) on seeded random query/key/value tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, cast

import torch

from probe.errors import CaptureError
from probe.hooks import math as amath
from probe.hooks.attention_functions import original_attention_function
from probe.hooks.capture import capture_attention
from probe.hooks.readers import FUNCTION, guarded
from probe.models.core import encode_texts
from probe.models.text import forward_inputs

if TYPE_CHECKING:
    from probe.hooks.types import AttentionMaps
    from probe.models.core import ProbeModel

DEFAULT_TEXTS = (
    "the film is a quiet , moving portrait of grief and it works",
    "not funny",
    "an utterly predictable mess , yet the actors try hard",
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def _tolerance(pm: ProbeModel) -> float:
    return 1e-5 if pm.contract.dtype == "float32" else 2e-2


def _eager_tolerance(pm: ProbeModel) -> float:
    """Capture under the loaded implementation against HF's eager ``output_attentions``.

    The same kernel (eager) agrees to fp32 rounding; sdpa/flash kernels sum in another order, and
    their drift from eager alone reaches 1.7e-5 in T5/UMT5 logits without probe in the loop.
    """
    if pm.contract.dtype != "float32":
        return 2e-2
    return 1e-5 if pm.contract.implementation == "eager" else 1e-4


def _guarded(name: str, check) -> list[CheckResult]:
    """Run one check; whatever it raises becomes a failed result that says why, never a traceback."""
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - `probe contract` reports every failure as a row
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [CheckResult(name, False, f"could not run: {type(exc).__name__}: {first}"[:240])]
    if result is None:
        return []
    return result if isinstance(result, list) else [result]


def _outputs(out):
    return out.logits.float()


def _real_outputs(pm: ProbeModel, logits: torch.Tensor, inputs: dict, index: int) -> torch.Tensor:
    """Logits of example ``index`` at its real positions only."""
    if pm.task.pooled:  # [batch, classes] or [batch, hidden] pooled
        return logits[index]
    mask = inputs["decoder_attention_mask"] if pm.task.encoder_decoder else inputs["attention_mask"]
    return logits[index, : int(mask[index].sum())]


class PerLayerMaps:
    """A stack whose layers differ in heads or length (canine's downsampled layers): its maps one
    per layer. Checks that need one stacked map say they cannot run; the comparison with HF's own
    attentions goes layer by layer (:func:`layer_weights`)."""

    def __init__(self, stack: str, per_layer: dict, why: str):
        self.stack, self.per_layer, self.why = stack, per_layer, why

    @property
    def weights(self) -> NoReturn:
        raise CaptureError(self.why)


def layer_weights(maps: AttentionMaps | PerLayerMaps) -> list[torch.Tensor]:
    """[batch, head, query, key] per captured layer, from stacked or per-layer maps."""
    if isinstance(maps, PerLayerMaps):
        return [m.weights[:, 0] for _, m in sorted(maps.per_layer.items())]
    return [maps.weights[:, i] for i in range(maps.weights.shape[1])]


def _stack_maps(cap, stack: str):
    """One stacked map of ``stack``, or its maps per layer where the layers' shapes differ."""
    try:
        return cap.maps(stack)
    except CaptureError as error:
        try:
            per_layer = cap.layer_maps(stack)
        except CaptureError:
            raise error from None
        if len({tuple(m.weights.shape) for m in per_layer.values()}) == 1:
            raise
        return PerLayerMaps(stack, per_layer, str(error))


def capture_all(pm: ProbeModel, inputs: Mapping[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, AttentionMaps | PerLayerMaps], dict[tuple[str, int], int]]:
    decoder_mask = inputs.get("decoder_attention_mask")
    with torch.no_grad(), capture_attention(
        pm, attention_mask=inputs["attention_mask"], decoder_attention_mask=decoder_mask
    ) as cap:
        out = pm.model(**inputs)
    return _outputs(out), {stack: _stack_maps(cap, stack) for stack in pm.contract.stacks}, cap.calls


def _lengths(pm: ProbeModel, inputs, stack):
    if pm.task.encoder_decoder and stack in ("decoder", "cross"):
        return inputs["decoder_attention_mask"].sum(1)
    return inputs["attention_mask"].sum(1)


def _key_lengths(pm: ProbeModel, inputs, stack):
    if pm.task.encoder_decoder and stack == "decoder":
        return inputs["decoder_attention_mask"].sum(1)
    return inputs["attention_mask"].sum(1)


def _real_block(pm: ProbeModel, inputs, maps, stack, index):
    """[head, real query, real key] of one example per layer, flattened into one vector (layers may
    differ in heads: a hybrid's mixers)."""
    q = int(_lengths(pm, inputs, stack)[index])
    k = int(_key_lengths(pm, inputs, stack)[index])
    return torch.cat([w[index, :, :q, :k].reshape(-1) for w in layer_weights(maps[stack])])


def softmax_layer_weights(pm: ProbeModel, stack: str, maps: AttentionMaps | PerLayerMaps) -> list[torch.Tensor]:
    """[batch, head, query, key] of the captured layers whose maps are a softmax (all but a hybrid's
    implicit mixers), in layer order: what HF's ``output_attentions`` returns and rows sum to one in."""
    info = pm.contract.stacks[stack]
    layers = sorted(maps.per_layer) if isinstance(maps, PerLayerMaps) else list(maps.layers)
    return [w for layer, w in zip(layers, layer_weights(maps), strict=True) if not info.layer_implicit(layer)]


def eager_attentions(pm: ProbeModel, inputs: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...] | None]:
    """HF's own eager ``output_attentions``, the model switched to eager and back."""
    model = pm.model
    before = model.config._attn_implementation
    try:
        if before != "eager":
            model.set_attn_implementation("eager")
        with torch.no_grad(), guarded(model):  # HF's short-input fallback stays with this input
            out = model(**inputs, output_attentions=True)
    finally:
        if before != "eager":
            model.set_attn_implementation(before)
    if pm.task.encoder_decoder:
        found = {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions, "cross": out.cross_attentions}
    else:
        found = {pm.contract.primary_stack: out.attentions}
    widths = {int(v.shape[1]) for k, v in inputs.items() if k in ("input_ids", "decoder_input_ids")}
    found = _dense_banded(pm, found, getattr(out, "global_attentions", None) or getattr(out,
                                                                                        "encoder_global_attentions",
                                                                                        None), inputs)
    return {stack: _as_probabilities(layers, widths) for stack, layers in found.items()}


def _dense_banded(pm: ProbeModel, found: dict, global_layers, inputs) -> dict:
    """A stack's HF attentions in its layers' own layout (banded: [batch, head, query, G + 2w + 1] and
    the global rows; block-sparse; local-global) as dense maps, by the stack's read path
    (:meth:`probe.hooks.readers.ReadPath.dense_maps`); other stacks as they are."""
    modules = dict(pm.model.named_modules())
    sites = getattr(pm.contract, "sites", None) or {}
    out = dict(found)
    for stack, layers in found.items():
        places = [(stack, i) for i in range(len(layers or ())) if (stack, i) in pm.contract.module_paths]
        readers = {site.reader for (s, _), site in sites.items() if s == stack}  # as the contract's capture_path
        if not layers or not places or len(readers) != 1:
            continue
        dense = readers.pop().dense_maps(layers, modules, [pm.contract.module_paths[p] for p in places],
                                         global_layers, inputs)
        if dense is not None:
            out[stack] = dense
    return out


def _as_probabilities(layers, widths: set[int]):
    """HF's "attentions" as probability maps. A tensor with a negative entry is no probability map:
    over the input's positions it is the masked pre-softmax scores a few models return
    (squeezebert), taken through the softmax they feed; otherwise it is a linear-attention layer's
    state (minimax), left out, so the layers left are the softmax layers, in order. Non-negative
    maps stay, whatever their length (canine's downsampled layers)."""
    if not layers:
        return layers
    out = []
    for a in layers:
        if isinstance(a, torch.Tensor) and a.dim() == 4 and bool((a < 0).any()):
            if int(a.shape[-1]) not in widths:
                continue
            a = torch.softmax(a.float(), dim=-1).to(a.dtype)
        out.append(a)
    return tuple(out)


@dataclass(frozen=True)
class _Observed:
    """What the model-level checks share: one padded batch run without and with capture."""

    texts: tuple[str, ...]
    inputs: dict  # the model's keyword arguments for the batch
    plain: torch.Tensor  # fp32 outputs without capture ([batch, classes] or [batch, seq, vocab])
    logits: torch.Tensor  # the same outputs with capture open
    maps: dict  # stack -> AttentionMaps (or PerLayerMaps)
    calls: dict[tuple[str, int], int]  # how often each (stack, layer) ran through the capture
    n: int  # batch size
    tol: float


def _observe(pm: ProbeModel, texts) -> _Observed:
    batch = encode_texts(pm, list(texts))
    inputs = forward_inputs(pm, batch)
    with torch.no_grad():
        plain = _outputs(pm.model(**inputs))
    logits, maps, calls = capture_all(pm, inputs)
    return _Observed(texts=tuple(texts), inputs=inputs, plain=plain, logits=logits, maps=maps, calls=calls,
                     n=batch["input_ids"].shape[0], tol=_tolerance(pm))


def _model_checks(pm: ProbeModel, texts) -> list[CheckResult]:
    observed: list[_Observed] = []
    failed = _guarded("capture_runs", lambda: observed.append(_observe(pm, texts)))
    if failed:
        return failed
    results: list[CheckResult] = []
    for name, check in _MODEL_CHECKS:
        results += _guarded(name, lambda check=check: check(pm, observed[0]))
    return results


def _every_layer(pm: ProbeModel, o: _Observed) -> CheckResult:
    expected = sum(s.n_layers for s in pm.contract.stacks.values())
    seen = sum(1 for count in o.calls.values() if count >= 1)
    return CheckResult("every_layer_captured", seen == expected and all(c == 1 for c in o.calls.values()),
                       f"{seen} of {expected} attention layers ran once each through the capture")


def _unchanged(pm: ProbeModel, o: _Observed) -> CheckResult:
    diff = (o.logits - o.plain).abs().max().item()
    return CheckResult("capture_leaves_output_unchanged", diff <= 1e-6, f"max |logit change| {diff:.2e}")


def _row_sums(pm: ProbeModel, o: _Observed) -> CheckResult | None:
    worst = 0.0
    sink_low = 1.0
    sink_stacks = [s for s, c in pm.contract.stacks.items() if c.sinks]
    checked = 0
    for stack, m in o.maps.items():
        has_keys = m.row_has_keys if not isinstance(m, PerLayerMaps) else None
        for weights in softmax_layer_weights(pm, stack, m):  # implicit maps' rows need not sum to one
            checked += 1
            sums = weights.sum(-1)  # [batch, head, query]
            rows = has_keys[:, 0] if has_keys is not None else weights.abs().sum(-1).amax(1) > 0
            valid = rows[:, None, :].expand_as(sums)
            if stack in sink_stacks:  # 1 minus the sink mass: in (0, 1]
                worst = max(worst, (sums[valid] - 1).clamp(min=0).max().item())
                sink_low = min(sink_low, sums[valid].min().item())
            else:
                worst = max(worst, (sums[valid] - 1).abs().max().item())
    if not checked:
        return None  # every map is a mixer's implicit matrix: signed, its rows are no probabilities
    if sink_stacks:
        return CheckResult("rows_sum_to_one", worst <= o.tol and sink_low > 0,
                           f"attention sinks in {', '.join(sink_stacks)}: rows sum to 1 minus the sink mass "
                           f"(smallest {sink_low:.3f}, largest excess over 1 {worst:.2e})")
    return CheckResult("rows_sum_to_one", worst <= o.tol, f"max |row sum - 1| over the key axis {worst:.2e}")


def _padded_keys(pm: ProbeModel, o: _Observed) -> CheckResult:
    leak = 0.0
    for stack, m in o.maps.items():
        key_len = _key_lengths(pm, o.inputs, stack)
        for weights in layer_weights(m):  # [batch, head, query, key]
            keys = torch.arange(weights.shape[-1], device=key_len.device)
            padded = keys[None, :] >= key_len[:, None]  # [batch, key]
            if padded.any():
                leak = max(leak, weights.masked_select(padded[:, None, None, :].expand_as(weights)).abs().max().item())
    return CheckResult("padded_keys_get_zero", leak == 0.0, f"max weight on a padded key {leak:.2e}")


def _equals_eager(pm: ProbeModel, o: _Observed) -> CheckResult:
    eager_tol = _eager_tolerance(pm)
    eager = eager_attentions(pm, o.inputs)
    gap = 0.0
    for stack, layers in eager.items():
        if stack not in o.maps or not layers:
            continue
        captured = softmax_layer_weights(pm, stack, o.maps[stack])  # HF returns no map for a mixer layer
        if len(layers) != len(captured):
            return CheckResult("capture_equals_eager_output_attentions", False,
                               f"{stack}: probe captured {len(captured)} layers, HF returns {len(layers)}")
        for li, layer in enumerate(layers):
            full = layer.float()
            if full.shape != captured[li].shape:
                return CheckResult("capture_equals_eager_output_attentions", False,
                                   f"{stack} layer {li}: captured {tuple(captured[li].shape)}, HF {tuple(full.shape)}")
            for i in range(o.n):
                q = int(_lengths(pm, o.inputs, stack)[i])
                k = int(_key_lengths(pm, o.inputs, stack)[i])
                gap = max(gap, (full[i, :, :q, :k] - captured[li][i, :, :q, :k]).abs().max().item())
    return CheckResult("capture_equals_eager_output_attentions", gap <= eager_tol,
                       f"max |captured - HF eager output_attentions| {gap:.2e}, tolerance {eager_tol:.0e} "
                       f"(implementation {pm.contract.implementation})")


def _padding_tokens(pm: ProbeModel, o: _Observed) -> CheckResult | None:
    # Changing what sits in padded positions must change nothing real.
    inputs, n = o.inputs, o.n
    swapped = {k: v.clone() for k, v in inputs.items()}
    pad_positions = swapped["attention_mask"] == 0
    if not pad_positions.any():
        return None
    other = (swapped["input_ids"].max() + 1) % pm.model.config.vocab_size
    swapped["input_ids"][pad_positions] = other
    logits_b, maps_b, _ = capture_all(pm, swapped)
    out_gap = max((_real_outputs(pm, o.logits, inputs, i) - _real_outputs(pm, logits_b, inputs, i)).abs().max().item()
                  for i in range(n))
    att_gap = max((_real_block(pm, inputs, o.maps, s, i) - _real_block(pm, inputs, maps_b, s, i)).abs().max().item()
                  for s in o.maps for i in range(n))
    return CheckResult("padding_tokens_change_nothing", max(out_gap, att_gap) <= o.tol,
                       f"changing padded tokens moved real outputs by {out_gap:.2e} and real attention by "
                       f"{att_gap:.2e}")


def _causal_future(pm: ProbeModel, o: _Observed) -> CheckResult | None:
    causal = [s for s, c in pm.contract.stacks.items() if c.mask_kind.startswith(("causal", "sliding"))]
    if not (causal and pm.task.next_token):
        return None
    inputs, logits, maps = o.inputs, o.logits, o.maps
    i = int(inputs["attention_mask"].sum(1).argmax())
    last = int(inputs["attention_mask"][i].sum()) - 1
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["input_ids"][i, last] = (changed["input_ids"][i, last] + 1) % pm.model.config.vocab_size
    logits_c, maps_c, _ = capture_all(pm, changed)
    out_gap = (logits[i, :last] - logits_c[i, :last]).abs().max().item()
    att_gap = max((a[i, :, :last] - b[i, :, :last]).abs().max().item()
                  for s in causal for a, b in zip(layer_weights(maps[s]), layer_weights(maps_c[s]), strict=True))
    moved = (logits[i, last] - logits_c[i, last]).abs().max().item()
    return CheckResult("causal_future_changes_nothing_earlier", max(out_gap, att_gap) <= o.tol and moved > 0,
                       f"changing the last token moved earlier outputs by {out_gap:.2e}, earlier attention by "
                       f"{att_gap:.2e} (its own output by {moved:.2e})")


def _padded_like(pm: ProbeModel, single: dict, batch: dict) -> dict:
    """``single`` with its source padded to the batch's width: block-sparse attention's blocks
    (which are global, whether it runs block-sparse at all) depend on the padded length, so only
    an example padded the same way runs the same computation."""
    width = int(batch["input_ids"].shape[1])
    extra = width - int(single["input_ids"].shape[1])
    if extra <= 0:
        return single
    pad = pm.model.config.pad_token_id or 0
    out = dict(single)
    out["input_ids"] = torch.nn.functional.pad(single["input_ids"], (0, extra), value=pad)
    out["attention_mask"] = torch.nn.functional.pad(single["attention_mask"], (0, extra), value=0)
    return out


def _batch_of_one(pm: ProbeModel, o: _Observed) -> CheckResult:
    out_gap = att_gap = 0.0
    same_width = any(site.reader.width_dependent for site in (getattr(pm.contract, "sites", None) or {}).values())
    for i, text in enumerate(o.texts):
        single = forward_inputs(pm, encode_texts(pm, [text]))
        if same_width:
            single = _padded_like(pm, single, o.inputs)
        logits_1, maps_1, _ = capture_all(pm, single)
        out_gap = max(out_gap, (_real_outputs(pm, logits_1, single, 0) - _real_outputs(pm, o.logits, o.inputs, i)).abs().max().item())
        for s in o.maps:
            att_gap = max(att_gap, (_real_block(pm, single, maps_1, s, 0) - _real_block(pm, o.inputs, o.maps, s, i)).abs().max().item())
    # Logits are compared relative to their size: a 30-layer LM's logits reach tens, and fp32 sums
    # in a padded batch run through other kernels than a single sequence.
    scale = max(1.0, o.logits.abs().max().item())
    return CheckResult("batch_of_one_equals_batch_of_n", out_gap <= o.tol * scale and att_gap <= o.tol,
                       f"max gap, batch of 1 vs batch of {o.n}: outputs {out_gap:.2e} (logits up to {scale:.1f}), "
                       f"attention {att_gap:.2e}" + (" (block-sparse: each example padded to the batch's length, "
                                                     "on which its blocks depend)" if same_width else ""))


def _implicit_oracle(pm: ProbeModel, o: _Observed) -> CheckResult | None:
    return implicit_oracle(pm, o.inputs, o.tol)


def implicit_oracle(pm: ProbeModel, inputs: dict, tol: float) -> CheckResult | None:
    """Every implicit layer's matrices, applied to its value path, rebuild its mixer's output (within
    ``tol`` times the outputs' size) on the model's keyword arguments ``inputs``; None without mixers."""
    from probe.hooks import implicit

    paths = {path for place, path in pm.contract.module_paths.items()
             if pm.contract.stacks[place[0]].layer_implicit(place[1])}
    if not paths:
        return None
    seen: dict[str, float] = {}
    scale = 0.0
    handles = []

    def compare(module, args, kwargs, output):
        hidden, mask = implicit.call_inputs(module, args, kwargs)
        terms = implicit.mixer_kind(module).terms(module, hidden, mask)
        own = (output[0] if isinstance(output, tuple) else output).float()
        real = terms.key_mask
        gap = (implicit.mixer_output(module, terms).float() - own)[real].abs().max().item()
        seen[path_of[id(module)]] = max(seen.get(path_of[id(module)], 0.0), gap)
        nonlocal scale
        scale = max(scale, own[real].abs().max().item())

    modules = dict(pm.model.named_modules())
    path_of = {id(modules[p]): p for p in paths}
    try:
        for path in paths:
            handles.append(modules[path].register_forward_hook(compare, with_kwargs=True))
        with torch.no_grad():
            pm.model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    gap = max(seen.values()) if seen else float("inf")
    tol = tol * max(1.0, scale)
    return CheckResult("implicit_matrices_rebuild_mixer_outputs", len(seen) == len(paths) and gap <= tol,
                       f"{len(seen)} of {len(paths)} mixers: max |M x through gate and out_proj - the mixer's "
                       f"output| {gap:.2e} (outputs up to {scale:.2f}, tolerance {tol:.0e})")


def _eager_where_softmax(pm: ProbeModel, o: _Observed) -> CheckResult | None:
    """HF's eager output_attentions against the softmax layers; no check where there are none."""
    if all(info.implicit for info in pm.contract.stacks.values()):
        return None  # a state-space model returns no attention: the mixers' oracle is the check
    return _equals_eager(pm, o)


#: the model-level checks, in the order ``probe contract`` lists them; a check returning None does
#: not apply to the model (no padding in the batch, not a causal LM)
_MODEL_CHECKS = (
    ("every_layer_captured", _every_layer), ("capture_leaves_output_unchanged", _unchanged),
    ("rows_sum_to_one", _row_sums), ("padded_keys_get_zero", _padded_keys),
    ("capture_equals_eager_output_attentions", _eager_where_softmax),
    ("implicit_matrices_rebuild_mixer_outputs", _implicit_oracle),
    ("padding_tokens_change_nothing", _padding_tokens),
    ("causal_future_changes_nothing_earlier", _causal_future),
    ("batch_of_one_equals_batch_of_n", _batch_of_one),
)


def _mask_for(implementation: str, allowed: torch.Tensor, dtype) -> torch.Tensor:
    """The mask format each implementation's mask builder produces: bool for sdpa, additive otherwise."""
    if implementation == "sdpa":
        return allowed
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


class _FunctionProbe:
    """The model's own attention function (the one its primary stack's first layer uses), called on
    seeded random query ``[1, head, 4, head_dim]`` and key/value ``[1, kv_head, 6, head_dim]``."""

    q_len, k_len = 4, 6

    def __init__(self, pm: ProbeModel):
        contract = pm.contract
        stack = contract.primary_stack
        self.info = info = contract.stacks[stack]
        first = next(layer for layer in range(info.n_layers) if not info.layer_implicit(layer))
        self.module = dict(pm.model.named_modules())[contract.module_paths[(stack, first)]]
        self.implementation = contract.implementation
        self.original = original_attention_function(self.implementation, self.module)
        # pm.model is a PreTrainedModel: its dtype is a torch.dtype (nn.Module's stubs type attributes Tensor | Module)
        self.device, self.dtype = device, dtype = pm.device, cast("torch.dtype", pm.model.dtype)
        self.gen = gen = torch.Generator().manual_seed(0)
        # key/value heads as the module's own function repeats them (num_key_value_groups), which is
        # what it was written for even where the config names another count (gpt_bigcode, inkling)
        groups = getattr(self.module, "num_key_value_groups", None)
        self.n_kv = n_kv = info.n_heads // groups if isinstance(groups, int) and groups > 0 \
            and info.n_heads % groups == 0 else info.n_kv_heads
        self.query = torch.randn(1, info.n_heads, self.q_len, info.head_dim, generator=gen).to(device, dtype) * 2
        self.key = torch.randn(1, n_kv, self.k_len, info.head_dim, generator=gen).to(device, dtype) * 2
        self.value = torch.randn(1, n_kv, self.k_len, info.head_dim, generator=gen).to(device, dtype)
        self.scaling = getattr(self.module, "scaling", None) or info.head_dim ** -0.5
        self.tol = _tolerance(pm)
        self.everything = torch.ones(1, 1, self.q_len, self.k_len, dtype=torch.bool, device=device)

    def run(self, q, k, v, allowed, bias=None) -> torch.Tensor:
        """The function's output [1, head, query, head_dim] (fp32) under the keys ``allowed``."""
        mask = _mask_for(self.implementation, allowed, self.dtype).to(self.device)
        if bias is not None:
            mask = _mask_for("eager", allowed, self.dtype).to(self.device) + bias.to(self.device, self.dtype)
        with torch.no_grad():
            out, _ = self.original(self.module, q, k, v, mask, scaling=self.scaling, dropout=0.0, is_causal=False)
        return out.float()


def _function_checks(pm: ProbeModel) -> list[CheckResult]:
    f = _FunctionProbe(pm)
    # in this order: the permutation draws from the generator after query, key and value
    return [_all_masked_row(f), _key_permutation(f), _duplicate_key(f)]


def _all_masked_row(f: _FunctionProbe) -> CheckResult:
    """What the implementation does with a row whose keys are all masked, and what probe does."""
    blocked = f.everything.clone()
    blocked[..., 0, :] = False
    row = f.run(f.query, f.key, f.value, blocked)[0, 0]
    if torch.isnan(row).any():
        native = "NaN"
    elif row.abs().max() == 0:
        native = "zeros"
    else:
        uniform = f.value.float().mean(dim=2)  # [1, kv, dim]: uniform weights give the mean value
        native = "uniform" if torch.allclose(
            row, amath.repeat_kv(uniform[:, :, None], f.info.n_heads // f.n_kv)[0, :, 0], atol=1e-4) else "other"
    scores = amath.attention_scores(f.query, f.key, scaling=f.scaling)
    weights, has_keys = amath.masked_softmax(scores, blocked)
    probe_ok = bool(torch.isfinite(weights).all()) and weights[0, :, 0].abs().max().item() == 0 and not bool(has_keys[0,
                                                                                                                      0,
                                                                                                                      0])
    return CheckResult("all_masked_row_is_defined", probe_ok,
                       f"{f.implementation} returns {native} for a row with every key masked; probe records zeros "
                       "and flags the row (row_has_keys=False), never NaN")


def _key_permutation(f: _FunctionProbe) -> CheckResult:
    """Permuting keys with their values permutes the weights and leaves the output unchanged."""
    perm = torch.randperm(f.k_len, generator=f.gen).to(f.device)
    out_a = f.run(f.query, f.key, f.value, f.everything)
    out_b = f.run(f.query, f.key[:, :, perm], f.value[:, :, perm], f.everything)
    weights_b, _ = amath.masked_softmax(amath.attention_scores(f.query, f.key[:, :, perm], scaling=f.scaling), None)
    weights_a, _ = amath.masked_softmax(amath.attention_scores(f.query, f.key, scaling=f.scaling), None)
    gap = max((out_a - out_b).abs().max().item(), (weights_a[..., perm] - weights_b).abs().max().item())
    return CheckResult("key_permutation_equivariance", gap <= f.tol,
                       f"permuting keys+values: output moved {gap:.2e}, weights follow the permutation")


def _duplicate_key(f: _FunctionProbe) -> CheckResult:
    """A duplicated key/value pair acts like one key with its logit raised by ln 2."""
    j = 2
    key_dup = torch.cat([f.key, f.key[:, :, j:j + 1]], dim=2)
    value_dup = torch.cat([f.value, f.value[:, :, j:j + 1]], dim=2)
    out_dup = f.run(f.query, key_dup, value_dup,
                    torch.ones(1, 1, f.q_len, f.k_len + 1, dtype=torch.bool, device=f.device))
    bias = torch.zeros(1, 1, f.q_len, f.k_len)
    bias[..., j] = math.log(2.0)
    out_bias = f.run(f.query, f.key, f.value, f.everything, bias=bias)
    gap = (out_dup - out_bias).abs().max().item()
    return CheckResult("duplicate_key_equals_ln2_bias", gap <= f.tol,
                       f"duplicating key {j} matches adding ln 2 to its logit within {gap:.2e}")


def run_checks(pm: ProbeModel, texts: Sequence[str] = DEFAULT_TEXTS) -> list[CheckResult]:
    """Every check on ``pm``; model-level first, then function-level. A check that cannot run is a
    failed row that says why; nothing here raises."""
    pm.model.eval()
    results = _model_checks(pm, texts)
    stack = pm.contract.primary_stack if pm.contract.stacks else None
    sites = getattr(pm.contract, "sites", None) or {}
    # the first softmax layer: a hybrid's first layer may be a mixer
    site = next((sites[place] for place in sorted(sites) if place[0] == stack and not sites[place].reader.implicit),
                sites.get((stack, 0)))
    if site is not None and site.reader.implicit:
        results.append(CheckResult("attention_function_checks", True,
                                   f"skipped: the {stack}'s layers are token mixers read as implicit attention, "
                                   "so there is no attention function to call on chosen inputs"))
        return results
    if site is not None and site.reader is not FUNCTION:
        results.append(CheckResult("attention_function_checks", True,
                                   f"skipped: the {stack} computes attention inline (read through its probability "
                                   "module), so there is no attention function to call on chosen inputs"))
        return results
    return results + _guarded("attention_function_checks", lambda: _function_checks(pm))
