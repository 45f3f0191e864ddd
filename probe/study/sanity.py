"""Sanity checks that guard each explainer's assumption (house rule 13), run by every study and by
``probe explain``; results are data (:class:`Check` rows, a table in the result folder and a list in
``verdict.json``). On an explanation (``probe.explain``) the checks that need no rerun mark the scores
they failed on, per example where the check is (:class:`ScoreFlag`, :func:`explanation_flags`).

    degeneracy     gradient methods: is the target invariant along the direction the method
                   measures? ``input_x_gradient`` scores x_t . g_t, the derivative along scaling
                   token t's site vector; where the site's vector is one part of a sum that a norm
                   then normalises (BERT's word embedding inside word + position + type ->
                   LayerNorm), the derivative along scaling the *whole* sum w_t is zero, so
                   x_t . g_t = -(w_t - x_t) . g_t, a ranking set by the rest of the sum. Measured
                   as sum_t |w_t . g_t| / sum_t ||w_t|| ||g_t|| (0: scale invariant). The signed
                   gradient sum (``saliency_sum``) is zero when the model is invariant to adding a
                   constant to every coordinate (LayerNorm's mean subtraction): measured as
                   sum_t |sum_d g_td| / sum_t sum_d |g_td|. Every method: score vectors constant
                   or zero to float precision on every sampled example.
    completeness   integrated gradients: |sum of attributions - (f(x) - f(baseline))| relative to
                   |f(x) - f(baseline)| (the completeness axiom), and the steps that bring it under
                   :data:`COMPLETENESS_TOLERANCE` when the study's do not (doubling, up to
                   :data:`MAX_STEPS`: the search reruns IG on the sample at every try, which on a
                   30-layer model took minutes at 1024; past it, ``steps: auto`` finds the steps
                   per example).
    randomisation  Adebayo et al. 2018, cascading from the logits down: first the output head (the
                   classifier, score or pooler modules that are not tied to the input embeddings),
                   then the layers from the top, each re-initialised (matrices N(0, init std),
                   biases 0, norm scales 1; three draws per step, averaged). At each step, each explainer's Spearman correlation
                   with its trained-model scores, mean over a small sample, and the same for the
                   study's reference (its own row: how far the step moved what the model does with
                   its input) with the mean |change| of the target. Judged once the head and the
                   top half of the layers are random: if the reference's own ranking still has
                   Spearman >= 0.5 with the trained one, the randomisation did not change the
                   function the explainers explain, and every explainer is ``not informative``
                   (not a failure: post-LN blocks at N(0, 0.02) are close to the identity);
                   otherwise an explainer whose correlation stays >= 0.5 does not depend on the
                   model (fail). The reference runs once on the trained model for every check
                   that reads it, and on the cascade's models its layers below the re-initialised
                   ones are replayed from that run, not computed (:class:`ReferenceRuns`: the same
                   numbers, bit for bit, for about half the work).
    sign           signed explainers (input x gradient, IG, GradientSHAP, attn_grad, saliency_sum):
                   on each sampled example's top tokens by |reference|, the share of the
                   reference's |effect| on tokens where the explainer's sign is the reference's;
                   below :data:`SIGN_LIMIT` the method is inverted (it says "pushes down" where
                   deleting the token lowers the target): fail.
    redundancy     explainer units whose rankings are identical (tau-b = 1) on >= 95% of the
                   examples form one group (``flow L1-L5 = attention_mean L0``).

A check that cannot run is a row with status ``not run`` and the reason, never an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from probe import registry
from probe.errors import ProbeError
from probe.rows.scores import score_unit_rows

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

DEGENERACY_TOLERANCE = 1e-4  # relative: below this the invariance holds to float precision
COMPLETENESS_TOLERANCE = 0.05  # |delta| / |f(x) - f(baseline)|, median over the sample
RANDOMISATION_LIMIT = 0.5  # Spearman with the trained scores once the top half of layers is random
REDUNDANT_SHARE = 0.95  # share of examples with identical rankings that makes two units one
MAX_STEPS = 256  # the completeness check's search for the steps that would do stops here
RANDOM_DRAWS = 3  # draws of random weights per cascade step, averaged
SIGN_LIMIT = 0.25  # |effect|-weighted share of top tokens whose sign agrees; 0.5 is chance
SIGN_TOP = 3  # the top tokens by |reference| the sign check reads per example
#: module names of output heads (classifiers, scorers, poolers, LM heads), randomised first
HEAD_NAMES = ("classifier", "score", "pooler", "lm_head", "qa_outputs", "pre_classifier", "classification_head")


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of one method: ``status`` pass, fail or not run; ``value`` the measured number."""

    method: str
    check: str
    status: str
    value: float | None
    detail: str
    curve: tuple = ()  # randomisation: ((fraction of layers randomised, mean Spearman), ...)
    layer: int = -1  # a check of one unit (randomisation of a bottom-up method): its layer and head
    head: int = -1

    @property
    def unit(self) -> tuple[str, int, int] | None:
        """``(method, layer, head)`` for a check of one unit, None for a check of the whole method."""
        return (self.method, self.layer, self.head) if self.layer >= 0 else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["curve"] = [list(point) for point in self.curve]
        return out


def failed_methods(checks: Sequence[Check]) -> dict[str, list[str]]:
    """Method -> the checks of the whole method it failed (a method failing any is unreliable for
    the study); a unit's own failed check marks that unit only (:func:`failed_units`)."""
    out: dict[str, list[str]] = {}
    for c in checks:
        if c.status == "fail" and c.unit is None:
            out.setdefault(c.method, []).append(c.check)
    return out


def failed_units(checks: Sequence[Check]) -> dict[tuple[str, int, int], list[str]]:
    """``(method, layer, head)`` -> the checks of that unit alone it failed (it never tracks)."""
    out: dict[tuple[str, int, int], list[str]] = {}
    for c in checks:
        if c.status == "fail" and c.unit is not None:
            out.setdefault(c.unit, []).append(c.check)
    return out



# --------------------------------------------------------------------------- degeneracy


def _site_gradients(pm: ProbeModel, examples, site_name: str | None):
    """(site, x [rows, seq, dim] at the site, g = d target / d x, w = the vector a scale invariance
    would act on (the norm's input where the site feeds a norm inside the embeddings module, else x),
    g_w = d target / d w, mask [rows, seq]) by plain autograd over forward hooks."""
    from probe.explainers.gradient_forward import (
        embeddings_module,
        hooked,
        is_norm,
        resolve_site,
    )
    from probe.rows.forward import build_rows
    from probe.rows.queries import eval_mode
    from probe.rows.values import target_values

    site = resolve_site(pm, site_name)
    batch = build_rows(pm, [(e.input_ids, e) for e in examples])
    held: dict[str, torch.Tensor] = {}
    module = site.module if site.module is not None else pm.model.get_input_embeddings()

    def keep_site(mod, args, output):
        output.retain_grad()
        held["x"] = output

    norm = None
    if site.name == "word" and site.normalising is not None:
        found = embeddings_module(pm.model)
        norm = next((m for m in found[1].modules() if is_norm(m)), None) if found else None

    def keep_norm_input(mod, args):
        args[0].retain_grad()
        held["w"] = args[0]

    with eval_mode(pm.model, grad=True), contextlib.ExitStack() as stack:
        stack.enter_context(hooked(module, keep_site))
        if norm is not None:
            handle = norm.register_forward_pre_hook(keep_norm_input)
            stack.callback(handle.remove)
        values = target_values(pm, batch, pm.model(**batch.inputs).logits)  # [rows]
        values.sum().backward()
    pm.model.zero_grad(set_to_none=True)
    if "x" not in held or held["x"].grad is None:
        raise ProbeError(f"site {site.name}: the forward pass of the target did not reach it with a gradient "
                         "(on a seq2seq model the encoder's site may be bypassed), so its degeneracy cannot be "
                         "measured")
    x, g = held["x"].detach().float(), held["x"].grad.detach().float()  # [rows, seq, dim]
    if "w" in held:
        w, gw = held["w"].detach().float(), held["w"].grad.detach().float()
    else:
        w, gw = x, g
    seq = batch.inputs["input_ids"].shape[1]
    mask = torch.arange(seq)[None, :].to(batch.input_lengths.device) < batch.input_lengths[:, None]  # [rows, seq]
    return site, x, g, w, gw, mask


def degeneracy(pm: ProbeModel, examples, methods: Sequence[str], *, params: Mapping[str, Mapping] | None = None) -> list[Check]:
    """The degeneracy checks of the gradient ``methods`` at each one's site (module docstring)."""
    params = params or {}
    checks = []
    probes: dict[str | None, tuple] = {}
    for method in methods:
        site_name = (params.get(method) or {}).get("site")
        try:
            if site_name not in probes:
                probes[site_name] = _site_gradients(pm, examples, site_name)
        except ProbeError as error:
            checks.append(Check(method, "degeneracy", "not run", None, str(error)))
            continue
        site, x, g, w, gw, mask = probes[site_name]
        m = mask[..., None]
        entry = registry.method(method)
        if entry.reduction == "sum" and entry.times_input:  # x . grad: zero where the model ignores |x|
            scale = float(((w * gw).sum(-1).abs() * mask).sum() / ((w.norm(dim=-1) * gw.norm(dim=-1)) * mask).sum()
                          .clamp_min(1e-30))
            bad = scale <= DEGENERACY_TOLERANCE
            whole = "the embedding sum entering the norm" if w is not x else "the site's vector"
            detail = (f"site {site.name}: sum|w.g| / sum|w||g| = {scale:.1e} with w = {whole}"
                      + ("; the model is invariant to scaling it, so x . grad = -(rest of the sum) . grad: "
                         "use site embeddings" if bad else ""))
            checks.append(Check(method, "degeneracy", "fail" if bad else "pass", scale, detail))
        elif entry.reduction == "sum":  # sum_d grad: zero where a mean-subtracting norm follows
            cancel = float(((g * m).sum(-1).abs()).sum() / (g.abs() * m).sum().clamp_min(1e-30))
            bad = cancel <= DEGENERACY_TOLERANCE
            detail = (f"site {site.name}: sum|sum_d g| / sum|g| = {cancel:.1e}"
                      + ("; the gradient sums to zero over the hidden axis (a mean-subtracting norm follows): "
                         "use site embeddings" if bad else ""))
            checks.append(Check(method, "degeneracy", "fail" if bad else "pass", cancel, detail))
    return checks


def constant_scores(method: str, scores: Sequence[torch.Tensor], scored: Sequence[Sequence[bool]]) -> Check:
    """Fails when every example's scored token vector is constant (zero included) to float precision."""
    flat = 0
    total = 0
    for values, keep in zip(scores, scored):
        values = values.detach().double().reshape(-1, values.shape[-1])[:, torch.tensor(list(keep), dtype=torch.bool)]
        if values.shape[-1] < 2:
            continue
        total += values.shape[0]
        spread = values.max(-1).values - values.min(-1).values
        size = values.abs().max(-1).values
        flat += int(((spread <= 1e-6 * size) | (size <= 1e-12)).sum())
    if not total:
        return Check(method, "constant", "not run", None, "no example has 2 scored tokens")
    share = flat / total
    bad = share == 1.0
    return Check(method, "constant", "fail" if bad else "pass", share,
                 f"{flat}/{total} score vectors constant or zero to float precision")


# --------------------------------------------------------------------------- completeness


def completeness(pm: ProbeModel, examples, result, *, params: Mapping | None = None) -> Check:
    """Completeness of a path method (registry ``completeness``: integrated gradients) on ``result``
    (its convergence deltas in ``extras``); when too far off, the steps that would do, found by
    running the method's own registry entry with more steps."""
    name = result.method
    entry = registry.method(name)
    relative = _relative_delta(result)
    if relative is None:
        return Check(name, "completeness", "not run", None,
                     "f(x) = f(baseline) on every example: the relative delta is undefined")
    default = entry.defaults().steps
    steps = int(result.params.get("steps", default)) if isinstance(result.params.get("steps"), int) else default
    if relative <= COMPLETENESS_TOLERANCE:
        return Check(name, "completeness", "pass", relative,
                     f"median |delta| / |f(x) - f(baseline)| = {relative:.3f} at {steps} steps")
    needed = None
    kwargs = {**dict(entry.preset), **{k: v for k, v in dict(params or {}).items() if k != "steps"}}
    compute = entry.load()
    trial = steps
    while trial * 2 <= MAX_STEPS:
        trial *= 2
        again = _relative_delta(compute(pm, examples, steps=trial, **kwargs))
        if again is not None and again <= COMPLETENESS_TOLERANCE:
            needed = trial
            break
    more = f"; {needed} steps bring it under {COMPLETENESS_TOLERANCE}" if needed else \
        f"; still above {COMPLETENESS_TOLERANCE} at {trial} steps (steps: auto finds them per example)"
    return Check(name, "completeness", "fail", relative,
                 f"median |delta| / |f(x) - f(baseline)| = {relative:.3f} at {steps} steps{more}")


def _relative_delta(result) -> float | None:
    extras = result.extras
    delta = np.abs(np.asarray(extras["convergence_delta"], dtype=float))
    gap = np.abs(np.asarray(extras["target_value"], dtype=float) - np.asarray(extras["baseline_value"], dtype=float))
    ok = gap > 1e-9
    return float(np.median(delta[ok] / gap[ok])) if ok.any() else None


# --------------------------------------------------------------------------- randomisation


def layer_stack(model, n_layers: int) -> torch.nn.ModuleList | None:
    """The model's list of ``n_layers`` transformer layers (the first ``ModuleList`` of that length)."""
    return next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)


def head_parameters(model, layers: torch.nn.ModuleList) -> list[tuple[str, torch.nn.Parameter]]:
    """The output head's parameters (:data:`HEAD_NAMES` modules outside the layer stack), less any
    shared with the input embeddings (a tied LM head: randomising it would change the input too)."""
    inside = {id(p) for p in layers.parameters()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    found: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in HEAD_NAMES:
            for pname, param in module.named_parameters():
                if id(param) not in inside and id(param) not in tied:
                    found.setdefault(id(param), (f"{name}.{pname}", param))
    return list(found.values())


@contextlib.contextmanager
def randomised(params: Sequence[tuple[str, torch.nn.Parameter]], *, seed: int, std: float) -> Iterator[None]:
    """Within the block ``params`` have fresh random values (matrices ~ N(0, std), biases 0, norm
    scales 1), drawn with ``seed``; the trained values come back in ``finally``."""
    saved = []
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for name, param in params:
                saved.append((param, param.detach().clone()))
                if param.ndim >= 2:
                    fresh = torch.randn(param.shape, generator=generator) * std
                elif name.endswith("bias"):
                    fresh = torch.zeros(param.shape)
                else:
                    fresh = torch.ones(param.shape)
                param.copy_(fresh.to(param.dtype))
        yield
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)


@contextlib.contextmanager
def randomised_top(model, layers: torch.nn.ModuleList, count: int, *, seed: int, std: float,
                   head: bool = False) -> Iterator[list[torch.nn.Parameter]]:
    """Within the block the top ``count`` layers (and with ``head`` the output head first) have
    fresh random weights (:func:`randomised`); the block is given the parameters re-initialised."""
    params = head_parameters(model, layers) if head else []
    for index in range(len(layers) - count, len(layers)):
        params += [(name, param) for name, param in layers[index].named_parameters()]
    with randomised(params, seed=seed, std=std):
        yield [param for _, param in params]


# --------------------------------------------------------------------------- the reference's runs

#: bytes of layer outputs :class:`ReferenceRuns` keeps from the reference's trained run to replay
REPLAY_BYTES = 2**29
#: a layer's keyword arguments that carry a cache: a call with one has state, and is never replayed
_STATE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past", "cache", "cache_params")


class _ReplayUnsafe(BaseException):
    """A re-initialised parameter was used before the last replayed layer of a call: that call is
    not the trained run's up to there, and is computed instead. A BaseException so that no ``except
    Exception`` between the model and :class:`ReferenceRuns` can swallow it."""


class _NotKept(Exception):
    """A value :class:`ReferenceRuns` does not keep (neither tensor, tuple of them nor plain)."""


def _call_key(args: Sequence, kwargs: Mapping) -> tuple | None:
    """What a model call computes from, by content: each tensor's dtype, shape and bytes (digest),
    each plain value as it is, and the autograd mode; None where an argument is neither (a cache
    object: the call has state)."""
    import hashlib

    parts: list[tuple] = []
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1)
            digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
            parts.append((name, str(value.dtype), tuple(value.shape), str(value.device), digest))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, value))
        else:
            return None
    return torch.is_grad_enabled(), tuple(parts)


def _kept(value):
    """A copy of a layer's output that nothing done later to the output can change."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) is tuple:
        return tuple(_kept(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotKept(type(value).__name__)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value) if isinstance(value, tuple) else 0


def _has_state(args: Sequence, kwargs: Mapping) -> bool:
    """A layer call that reads or writes a cache (its effect is more than its output)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        Cache = ()  # noqa: N806
    values = [*args, *kwargs.values()]
    return (any(isinstance(v, Cache) for v in values)
            or any(kwargs.get(name) is not None for name in _STATE_ARGUMENTS))


class ReferenceRuns:
    """The study's reference (``scorer(pm, examples)``, a leave-one-out) on the trained model, run
    once however many checks read it (:meth:`trained`), and on models whose parameters ``changed``
    were re-initialised (:meth:`randomised`), where the layers below the lowest changed one are not
    computed again: their outputs are the trained run's, kept during it.

    Exact, not an approximation: a layer whose parameters, and everything computed before it, are
    the trained model's gives, on the same call (the same rows in the same batch: the key is the
    call's tensors by content), the output it gave in the trained run. What that rests on is
    checked on every call: the layers ran in order, once each, without a cache (a call with state
    is never kept); no changed parameter's module runs before the last replayed layer (else that
    call is computed in full, and no call is replayed again); a call not seen in the trained run is
    computed. Outputs are kept up to ``max_bytes`` (calls past it are computed).

    The cascade (:func:`randomisation`) re-initialises the head and the top layers only: at its
    head step no layer runs again, at half the layers half of them do."""

    def __init__(self, pm: ProbeModel, examples, name: str, scorer: Callable, *, replay: bool = True,
                 max_bytes: int | None = None):
        self.pm = pm
        self.examples = examples
        self.name = name
        self.scorer = scorer
        self.max_bytes = int(REPLAY_BYTES if max_bytes is None else max_bytes)
        self.layers = layer_stack(pm.model, pm.contract.n_layers) if replay else None
        self._trained = None
        self._error: ProbeError | None = None
        self._kept: dict[tuple, list] = {}
        self._bytes = 0
        self.runs = 0  # calls of the scorer
        self.replayed = 0  # model calls that replayed layers
        self.layers_replayed = 0  # layer outputs replayed instead of computed

    @property
    def kept_bytes(self) -> int:
        """Bytes of layer outputs kept from the trained run (0 where nothing can be replayed)."""
        return self._bytes

    def trained(self):
        """The reference on the trained model (computed on the first call, with the outputs of every
        layer kept for :meth:`randomised`; a ProbeError it raised is raised again)."""
        if self._error is not None:
            raise self._error
        if self._trained is None:
            try:
                with self._recording():
                    self._trained = self._run()
            except ProbeError as error:
                self._error = error
                raise
        return self._trained

    def randomised(self, changed: Sequence[torch.nn.Parameter]):
        """The reference while ``changed`` hold re-initialised values (the caller's block): the
        layers below the lowest one holding a changed parameter are replayed from the trained run."""
        boundary = self._boundary(changed)
        if boundary < 0 or not self._kept:
            return self._run()
        try:
            with self._replaying(boundary, changed):
                return self._run()
        except _ReplayUnsafe:
            self._kept.clear()  # the model does not run as the replay assumes: compute every call from now on
            return self._run()

    def _run(self):
        self.runs += 1
        return self.scorer(self.pm, self.examples)

    def _boundary(self, changed) -> int:
        """The last layer that holds no changed parameter and has none below it (-1: none)."""
        if self.layers is None:
            return -1
        ids = {id(p) for p in changed}
        for index, layer in enumerate(self.layers):
            if any(id(p) in ids for p in layer.parameters()):
                return index - 1
        return len(self.layers) - 1

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        if self.layers is None:
            yield
            return
        model, n = self.pm.model, len(self.layers)
        state: dict = {"key": None, "calls": [], "outputs": [], "size": 0}

        def before(module, args, kwargs):
            key = _call_key(args, kwargs)
            state.update(key=key if key not in self._kept else None, calls=[], outputs=[], size=0)

        def layer_hook(index):
            def hook(module, args, kwargs, output):
                if state["key"] is None:
                    return
                size = state["size"] + _nbytes(output)
                try:
                    if _has_state(args, kwargs):
                        raise _NotKept("a cache")
                    if self._bytes + size > self.max_bytes:  # checked before the copy: memory stays bounded
                        raise _NotKept("over the budget")
                    state["outputs"].append(_kept(output))
                except _NotKept:
                    state.update(key=None, outputs=[])
                    return
                state["calls"].append(index)
                state["size"] = size
            return hook

        def after(module, args, kwargs, output):
            key, calls, outputs, size = state["key"], state["calls"], state["outputs"], state["size"]
            state.update(key=None, calls=[], outputs=[], size=0)
            if key is not None and calls == list(range(n)):  # each layer once, in order
                self._kept[key] = outputs
                self._bytes += size

        handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                   model.register_forward_hook(after, with_kwargs=True)]
        handles += [layer.register_forward_hook(layer_hook(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _replaying(self, boundary: int, changed) -> Iterator[None]:
        model = self.pm.model
        ids = {id(p) for p in changed}
        state: dict = {"kept": None, "done": 0}

        def before(module, args, kwargs):
            key = _call_key(args, kwargs)
            state.update(kept=self._kept.get(key) if key is not None else None, done=0)
            if state["kept"] is not None:
                self.replayed += 1

        def after(module, args, kwargs, output):
            state.update(kept=None, done=0)

        def replayed(index, original):
            def forward(*args, **kwargs):
                kept = state["kept"]
                if kept is None:
                    return original(*args, **kwargs)
                if state["done"] != index:  # the layers do not run in order, once each
                    raise _ReplayUnsafe(f"layer {index} ran after {state['done']} replayed layers")
                state["done"] = index + 1
                self.layers_replayed += 1
                return _kept(kept[index])
            return forward

        def guard(module, args):
            if state["kept"] is not None and state["done"] <= boundary:
                raise _ReplayUnsafe(f"{type(module).__name__} holds a re-initialised parameter and ran before "
                                    f"layer {boundary}")

        handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                   model.register_forward_hook(after, with_kwargs=True)]
        handles += [m.register_forward_pre_hook(guard) for m in model.modules()
                    if any(id(p) in ids for p in m.parameters(recurse=False))]
        patched = []
        try:
            for index in range(boundary + 1):
                layer = self.layers[index]
                own = layer.__dict__.get("forward")
                patched.append((layer, own))
                layer.forward = replayed(index, layer.forward)
            yield
        finally:
            for layer, own in reversed(patched):
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own
            for handle in handles:
                handle.remove()


def _reference_runs(pm: ProbeModel, examples, reference) -> ReferenceRuns | None:
    """``reference`` as :class:`ReferenceRuns` (a ``(name, scorer)`` pair is wrapped)."""
    if reference is None or isinstance(reference, ReferenceRuns):
        return reference
    name, scorer = reference
    return ReferenceRuns(pm, examples, name, scorer)


def cascade_steps(model, layers: torch.nn.ModuleList, fractions: Sequence[float]) -> list[int]:
    """The cascade's steps as numbers of top layers re-initialised: 0 (the output head alone, where
    the model has one), then each fraction's count of layers."""
    counts = sorted({max(1, min(len(layers), round(fraction * len(layers)))) for fraction in fractions})
    return ([0] if head_parameters(model, layers) else []) + counts


def output_unit(values: torch.Tensor) -> torch.Tensor:
    """An explainer's output-level score vector: the last layer (head mean) of a per-layer/head method."""
    if values.ndim == 3:
        return values[-1].float().nanmean(dim=0)
    if values.ndim == 2:
        return values[-1]
    return values


def _mean_spearman(trained: Sequence[np.ndarray], values: Sequence[np.ndarray],
                   scored: Sequence[Sequence[bool]] | None = None, top: int | None = None) -> float:
    """Mean over examples of Spearman's rho between trained and randomised scores (scored tokens);
    with ``top`` the chance-corrected overlap of their top-``top`` tokens instead ((o - k/n) / (1 - k/n):
    1 the same top tokens, 0 what chance gives), for a reference whose effect sits on a few tokens."""
    from probe.metrics.agreement import agreement

    rhos = []
    for i, (a, b) in enumerate(zip(trained, values)):
        ok = np.isfinite(a) & np.isfinite(b)
        if scored is not None:
            ok &= np.asarray(list(scored[i]), dtype=bool)
        n = int(ok.sum())
        if top is not None and n > top:
            overlap = float(agreement(b[ok], a[ok], k=top)[f"top{top}"][0])
            chance = top / n
            rhos.append((overlap - chance) / (1 - chance))
        elif top is None and n >= 2:
            rhos.append(float(agreement(b[ok], a[ok], k=1)["spearman"][0]))
    rhos = [r for r in rhos if np.isfinite(r)]
    return float(np.mean(rhos)) if rhos else float("nan")


def randomisation(pm: ProbeModel, examples, scorers: Mapping[str, Callable], *, fractions: Sequence[float] = (0.25, 0.5, 1.0),
                  seed: int = 0, trained_scores: Mapping[str, Sequence[torch.Tensor]] | None = None,
                  reference: tuple[str, Callable] | ReferenceRuns | None = None,
                  scored: Sequence[Sequence[bool]] | None = None, top: int | None = None,
                  draws: int = RANDOM_DRAWS, step: Callable[[], None] | None = None) -> list[Check]:
    """Cascading randomisation (module docstring). ``scorers`` maps a name to ``f(pm, examples) ->
    list of per-example score tensors``; each one's output unit is compared by Spearman.
    ``trained_scores``: a scorer's output on the trained model where the caller already has it
    (the same call, so the same numbers); the others are run first. ``reference``: (name, scorer)
    of the study's reference, a leave-one-out whose result carries ``original_values``: its own
    row (first) says whether the randomisation changed the model's function, and where it did not
    every explainer is ``not informative`` (or :class:`ReferenceRuns`, which the caller shares with
    :func:`unit_randomisation`: the trained run once, and the layers below the re-initialised ones
    replayed instead of computed). ``scored``: per example, the tokens the study scores
    (special tokens are left out of the correlations as they are of the agreement). ``top``: compare
    the top-``top`` tokens (chance-corrected overlap) instead of Spearman over every token, as the
    verdict does where the reference's effect sits on one or two tokens. ``draws``: random weights
    drawn per step (seeds ``seed``, ``seed + 1``, ...), the correlations averaged over them.
    ``step``: called after each draw (progress)."""
    layers = layer_stack(pm.model, pm.contract.n_layers)
    reference = _reference_runs(pm, examples, reference)
    ref_name = reference.name if reference is not None else None
    names = ([ref_name] if reference else []) + [n for n in scorers if n != ref_name]
    if layers is None:
        reason = f"no list of {pm.contract.n_layers} layers found in the model to re-initialise"
        return [Check(name, "randomisation", "not run", None, reason) for name in names]
    std = float(getattr(pm.model.config, "initializer_range", 0.02) or 0.02)
    trained, checks, outputs = {}, {}, {}

    def run(name, changed=None):
        """``name``'s scores on the trained model, or with ``changed`` re-initialised (the block's)."""
        if name != ref_name:
            result = scorers[name](pm, examples)
        else:
            result = reference.trained() if changed is None else reference.randomised(changed)
            outputs.setdefault("values", []).append(np.asarray(result.extras.get("original_values", []), dtype=float))
            result = result.scores
        return [output_unit(v).double().numpy() for v in result]

    for name in names:
        try:
            given = (trained_scores or {}).get(name)
            trained[name] = ([output_unit(v).double().numpy() for v in given] if given is not None else run(name))
        except ProbeError as error:
            checks[name] = Check(name, "randomisation", "not run", None, str(error))
    steps = cascade_steps(pm.model, layers, fractions)
    head = steps[:1] == [0]  # the model has an output head, re-initialised first
    curves: dict[str, list[tuple[float, float]]] = {name: [(0.0, 1.0)] for name in trained}
    changes: list[float] = []
    for count in steps:
        sums: dict[str, list[float]] = {name: [] for name in trained}
        moved = []
        # one draw's fixed random function of the inputs can rank like the trained one by luck
        for draw in range(draws):
            with randomised_top(pm.model, layers, count, seed=seed + draw, std=std, head=True) as changed:
                for name in trained:
                    sums[name].append(_mean_spearman(trained[name], run(name, changed), scored, top))
                if reference and ref_name in trained and len(outputs.get("values", [])) > 1:
                    first, last = outputs["values"][0], outputs["values"][-1]
                    moved.append(float(np.mean(np.abs(last - first))) if len(first) == len(last) else float("nan"))
            if step is not None:
                step()
        for name in trained:
            curves[name].append((count / len(layers), float(np.nanmean(sums[name])) if np.isfinite(sums[name]).any()
                                 else float("nan")))
        if moved:
            changes.append(float(np.mean(moved)))
    judged = next((i for i, c in enumerate(steps) if c / len(layers) >= 0.5 - 1e-9), len(steps) - 1) + 1
    where = ("the head and the top half of the layers" if head else "the top half of the layers")
    word = "Spearman" if top is None else f"top-{top} agreement (chance-corrected)"
    ref_rho = curves[ref_name][judged][1] if reference and ref_name in curves else None
    informative = ref_rho is None or not (ref_rho >= RANDOMISATION_LIMIT)
    for name, curve in curves.items():
        at_half = curve[judged][1]
        if reference and name == ref_name:
            moved = changes[judged - 1] if len(changes) >= judged else float("nan")
            detail = (f"the reference's own {word} with its trained ranking once {where} are random: {at_half:+.2f}; "
                      f"the target moved by {moved:.2g} on average"
                      + ("" if informative else f" (>= {RANDOMISATION_LIMIT}: the randomisation did not change what "
                                                f"the "
                                                "model does with its input, so the check cannot tell explainers "
                                                "apart)"))
            checks[name] = Check(name, "randomisation", "pass" if informative else "not informative", at_half, detail,
                                 tuple(curve))
            continue
        if not informative:
            checks[name] = Check(name, "randomisation", "not informative", at_half,
                                 f"{word} with the trained scores {at_half:+.2f} once {where} are random, but the "
                                 f"reference's own ranking stayed at {ref_rho:+.2f}: not informative", tuple(curve))
            continue
        bad = bool(at_half >= RANDOMISATION_LIMIT)
        detail = (f"{word} with the trained scores {at_half:+.2f} once {where} are random"
                  + (f" (>= {RANDOMISATION_LIMIT}: the scores do not depend on the model's upper layers)" if bad else ""))
        checks[name] = Check(name, "randomisation", "fail" if bad else "pass", at_half, detail, tuple(curve))
    return [checks[name] for name in names if name in checks]


def _unit_rows(values: torch.Tensor) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A bottom-up method's per-example scores as unit rows ``[unit, tokens]`` with ``(layer, head)``."""
    rows, layer, head = score_unit_rows(values)
    return rows, [(int(la), int(h)) for la, h in zip(layer, head)]


def unit_randomisation(pm: ProbeModel, examples, scorers: Mapping[str, Callable], *, seed: int = 0,
                       trained_scores: Mapping[str, Sequence[torch.Tensor]] | None = None,
                       reference: tuple[str, Callable] | ReferenceRuns | None = None,
                       scored: Sequence[Sequence[bool]] | None = None, top: int | None = None, draws: int = RANDOM_DRAWS,
                       step: Callable[[], None] | None = None) -> list[Check]:
    """Model-parameter randomisation asked of every unit of the bottom-up methods (``scorers``:
    name -> ``f(pm, examples)`` per-example score tensors ``[layer, (head,) tokens]``), one check per
    unit. A layer-l unit is computed from the embeddings and layers 0..l only, so that is what is
    re-initialised for it: every weight of the model is drawn afresh (matrices N(0, init std), biases
    0, norm scales 1; ``draws`` draws, correlations averaged), which changes what a unit is computed
    from entirely and nothing else it could depend on. The unit fails where its scores keep Spearman
    (or, with ``top``, chance-corrected top-k agreement) >= :data:`RANDOMISATION_LIMIT` with its
    trained scores while the reference's own ranking moved below it: its ranking does not come from
    the weights. Where the reference did not move, every unit is ``not informative``. Units whose
    trained rankings are identical get identical randomised rankings too, hence the same answer.
    ``reference`` and ``step`` as :func:`randomisation` takes them."""
    names = list(scorers)
    reference = _reference_runs(pm, examples, reference)
    params = [(name, p) for name, p in pm.model.named_parameters()]
    std = float(getattr(pm.model.config, "initializer_range", 0.02) or 0.02)
    trained: dict[str, list[np.ndarray]] = {}
    units: dict[str, list[tuple[int, int]]] = {}
    out: list[Check] = []
    for name in names:
        try:
            given = (trained_scores or {}).get(name)
            values = given if given is not None else scorers[name](pm, examples)
        except ProbeError as error:
            out.append(Check(name, "randomisation", "not run", None, str(error)))
            continue
        rows = [_unit_rows(v) for v in values]
        trained[name] = [r for r, _ in rows]
        units[name] = rows[0][1] if rows else []
    ref_trained = None
    if reference is not None:
        try:
            ref_trained = [output_unit(v).double().numpy() for v in reference.trained().scores]
        except ProbeError:
            ref_trained = None
    rhos: dict[str, list[np.ndarray]] = {name: [] for name in trained}
    ref_rhos: list[float] = []
    for draw in range(draws):
        with randomised(params, seed=seed + draw, std=std):
            changed = [p for _, p in params]
            for name in trained:
                try:
                    fresh = [_unit_rows(v)[0] for v in scorers[name](pm, examples)]
                except ProbeError as error:
                    out.append(Check(name, "randomisation", "not run", None, f"on the randomised model: {error}"))
                    trained.pop(name)
                    break
                per_unit = [_mean_spearman([t[u] for t in trained[name]], [f[u] for f in fresh], scored, top)
                            for u in range(len(units[name]))]
                rhos[name].append(np.array(per_unit))
            if ref_trained is not None:
                moved = [output_unit(v).double().numpy() for v in reference.randomised(changed).scores]
                ref_rhos.append(_mean_spearman(ref_trained, moved, scored, top))
        if step is not None:
            step()
    word = "Spearman" if top is None else f"top-{top} agreement (chance-corrected)"
    ref_rho = float(np.nanmean(ref_rhos)) if ref_rhos and np.isfinite(ref_rhos).any() else None
    informative = ref_rho is None or not (ref_rho >= RANDOMISATION_LIMIT)
    if reference is not None:
        detail = (f"the reference's own {word} with its trained ranking once every weight is re-initialised: "
                  + ("not computed" if ref_rho is None else f"{ref_rho:+.2f}")
                  + ("" if informative else f" (>= {RANDOMISATION_LIMIT}: the randomisation did not change what the "
                                            "model does with its input, so the check cannot tell units apart)"))
        out.append(Check(reference.name, "randomisation (units)", "pass" if informative else "not informative", ref_rho,
                         detail, ((0.0, 1.0), (1.0, ref_rho if ref_rho is not None else float("nan")))))
    for name in trained:
        if not rhos[name]:
            continue
        mean = np.nanmean(np.stack(rhos[name]), axis=0) if np.isfinite(np.stack(rhos[name])).any() else \
            np.full(len(units[name]), np.nan)
        for (layer, head), rho in zip(units[name], mean):
            rho = float(rho)
            where = f"the embeddings and layers 0..{layer}" if layer >= 0 else "every weight"
            if not informative:
                status = "not informative"
            elif not np.isfinite(rho):
                status = "not run"
            else:
                status = "fail" if rho >= RANDOMISATION_LIMIT else "pass"
            detail = (f"{word} {rho:+.2f} with the trained scores once what it is computed from ({where}) is "
                      "re-initialised" + (" (its ranking does not come from the weights)" if status == "fail" else ""))
            out.append(Check(name, "randomisation", status, rho if np.isfinite(rho) else None, detail,
                             ((0.0, 1.0), (1.0, rho)), layer=int(layer), head=int(head)))
    return out


def sign_check(method: str, scores: Sequence[torch.Tensor], reference: Sequence[torch.Tensor],
               scored: Sequence[Sequence[bool]], *, top: int = SIGN_TOP) -> Check:
    """Does a signed explainer's sign agree with the signed reference's on each example's top tokens
    (by |reference|)? The share of the reference's |effect| on agreeing tokens (module docstring)."""
    agree = total = 0.0
    for values, ref, keep in zip(scores, reference, scored):
        x = output_unit(values).double().numpy()
        y = ref.double().numpy()
        ok = np.asarray(list(keep), dtype=bool) & np.isfinite(x) & np.isfinite(y) & (np.abs(y) > 0)
        idx = np.flatnonzero(ok)
        if not len(idx):
            continue
        chosen = idx[np.argsort(-np.abs(y[idx]), kind="stable")[:top]]
        weight = np.abs(y[chosen])
        agree += float((weight * (np.sign(x[chosen]) == np.sign(y[chosen]))).sum())
        total += float(weight.sum())
    if total <= 0:
        return Check(method, "sign", "not run", None, "the reference is zero on every sampled token")
    share = agree / total
    bad = share < SIGN_LIMIT
    return Check(method, "sign", "fail" if bad else "pass", share,
                 f"{100 * share:.0f}% of the reference's |effect| on the top {top} tokens has this method's sign"
                 + (f" (< {100 * SIGN_LIMIT:.0f}%: inverted, it scores the tokens that raise the target as lowering "
                    "it)" if bad else ""))


# --------------------------------------------------------------------------- redundancy


def redundancy_groups(rankings: Mapping[str, Sequence[np.ndarray]], *, share: float = REDUNDANT_SHARE) -> list[list[str]]:
    """Groups (2+ units, in the given order) whose score vectors rank tokens identically (tau-b = 1,
    i.e. the same order and the same ties) on at least ``share`` of the examples they share.
    ``rankings`` maps a unit name to one score vector per example (NaN-free, same length per example)."""
    names = list(rankings)
    parent = {n: n for n in names}
    # tau-b = 1 exactly when both vectors have the same dense ranks (same order, same ties) and are
    # not constant; comparing ranks is exact and far cheaper than a tau per pair.
    dense = {n: [np.unique(np.asarray(x, dtype=float), return_inverse=True)[1] if len(x) else np.array([], int)
                 for x in rankings[n]] for n in names}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if root(a) == root(b):
                continue
            same = total = 0
            for x, y in zip(dense[a], dense[b]):
                if len(x) < 2 or len(x) != len(y):
                    continue
                total += 1
                same += bool(x.max() > 0 and np.array_equal(x, y))
            if total and same / total >= share:
                parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    return [g for g in groups.values() if len(g) > 1]


# --------------------------------------------------------------------------- for one explained input


def explain_checks(pm: ProbeModel, examples, results: Mapping, params: Mapping[str, Mapping] | None = None) -> list[Check]:
    """The checks that fit one ``probe explain`` call (no randomisation: it would rerun every
    method several times): degeneracy of the gradient methods, constant scores, IG completeness."""
    from probe.names import method_family

    params = params or {}
    scored = [[not s for s in e.special] for e in examples]
    checks = [constant_scores(name, [output_unit(v) for v in r.scores], scored)
              for name, r in results.items() if method_family(name) != "intervention"]
    gradients = [m for m in results if method_family(m) == "gradient"]
    checks += degeneracy(pm, examples, gradients, params={m: {"site": results[m].params.get("site")} for m in gradients})
    for name in results:
        if registry.find(name).completeness:
            checks.append(completeness(pm, examples, results[name],
                                       params={k: v for k, v in (params.get(name) or {}).items() if k != "steps"}))
    return checks


def summary_lines(checks: Sequence[Check]) -> list[str]:
    """One line per method: ``sanity input_x_gradient: ok (degeneracy 3.1e-01, constant 0.0e+00)``
    or ``sanity saliency_sum: FAILED degeneracy: ...``."""
    by_method: dict[str, list[Check]] = {}
    for c in checks:
        by_method.setdefault(c.method, []).append(c)
    lines = []
    for method, items in by_method.items():
        failed = [c for c in items if c.status == "fail"]
        if failed:
            lines.append(f"sanity {method}: FAILED " + "; ".join(f"{c.check}: {c.detail}" for c in failed))
        else:
            ran = [f"{c.check} {c.status}" for c in items]
            lines.append(f"sanity {method}: ok ({', '.join(ran)})")
    return lines


# --------------------------------------------------------------------------- marks on an explanation's scores

#: the words a display puts beside a method's scores where one of its own checks failed
FLAG_WORDS = {"completeness": "not converged", "constant": "constant scores", "degeneracy": "degenerate site"}


@dataclasses.dataclass(frozen=True)
class ScoreFlag:
    """A method's own check failed on the scores of an explanation (``Explanation.flags``): every
    display of those scores marks them. ``examples``: the examples (indices into the explanation's)
    it failed on, each with its line in ``notes``; empty where the check is of the method as a
    whole (a degenerate site), which marks every example."""

    method: str
    check: str  # a key of FLAG_WORDS
    detail: str
    examples: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def words(self) -> str:
        """``not converged``, ``constant scores`` or ``degenerate site``."""
        return FLAG_WORDS.get(self.check, f"{self.check} failed")

    def covers(self, example: int) -> bool:
        return not self.examples or example in self.examples

    def note(self, example: int) -> str:
        """Why example ``example`` is marked (the whole method's detail where the check is the method's)."""
        if example in self.examples:
            return self.notes[self.examples.index(example)]
        return self.detail

    def to_dict(self) -> dict:
        return {"method": self.method, "check": self.check, "detail": self.detail, "examples": list(self.examples),
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, record: Mapping) -> ScoreFlag:
        return cls(str(record["method"]), str(record["check"]), str(record["detail"]),
                   tuple(int(i) for i in record.get("examples", ())), tuple(str(n) for n in record.get("notes", ())))


def completeness_flag(result) -> ScoreFlag | None:
    """The examples on which a path method (registry ``completeness``) breaks completeness: |delta|
    above ``tolerance`` x |f(x) - f(baseline)| (the method's ``tolerance``, which ``steps: auto``
    records, else its default) and above the absolute floor ``steps: auto`` uses; where ``steps:
    auto`` says per example whether it converged, that. None when every example is within."""
    from probe.explainers.integrated_gradients import AUTO_ABSOLUTE_TOLERANCE

    entry = registry.find(result.method)
    extras = result.extras
    if entry is None or not entry.completeness or "convergence_delta" not in extras:
        return None
    tolerance = result.params.get("tolerance", getattr(entry.defaults(), "tolerance", COMPLETENESS_TOLERANCE))
    steps = result.params.get("steps")
    bad, notes = [], []
    for i, delta in enumerate(extras["convergence_delta"]):
        gap = float(extras["target_value"][i]) - float(extras["baseline_value"][i])
        delta = float(delta)
        converged = extras.get("converged")
        failed = (not converged[i]) if converged is not None else \
            not abs(delta) <= max(float(tolerance) * abs(gap), AUTO_ABSOLUTE_TOLERANCE)  # NaN fails too
        if failed:
            used = extras["steps_used"][i] if "steps_used" in extras else steps
            bad.append(i)
            notes.append(f"completeness delta {delta:+.4g} against f(x) - f(baseline) = {gap:+.4g} at {used} steps "
                         f"(tolerance {float(tolerance):g} x |f(x) - f(baseline)|)")
    if not bad:
        return None
    more = ("; steps: auto found no convergence up to max_steps " f"{result.params.get('max_steps')}"
            if steps == "auto" else "; try steps='auto' (or more steps)")
    return ScoreFlag(result.method, "completeness", f"integral not converged on {len(bad)} of "
                     f"{len(extras['convergence_delta'])} examples{more}", tuple(bad), tuple(notes))


def constant_flag(result, examples) -> ScoreFlag | None:
    """The examples whose scored tokens (not special, finite) all have the same score, zero
    included, to float precision (as :func:`constant_scores` counts them); None when none do."""
    bad, notes = [], []
    for i, (values, example) in enumerate(zip(result.scores, examples)):
        row = output_unit(values).detach().double()
        keep = torch.tensor([not s for s in example.special], dtype=torch.bool)[: row.shape[-1]] & torch.isfinite(row)
        kept = row[keep]
        if kept.numel() < 2:
            continue
        spread, size = float(kept.max() - kept.min()), float(kept.abs().max())
        if spread <= 1e-6 * size or size <= 1e-12:
            bad.append(i)
            notes.append(f"every scored token has the score {float(kept[0]):.3g}: the scores rank nothing")
    if not bad:
        return None
    return ScoreFlag(result.method, "constant", f"constant scores on {len(bad)} of {len(result.scores)} examples",
                     tuple(bad), tuple(notes))


def score_flags(examples, results: Mapping) -> list[ScoreFlag]:
    """The marks that need no model: completeness per example (path methods) and constant scores
    per example (every method but the interventions, whose all-zero effect can be the truth)."""
    from probe.names import method_family

    flags = []
    for name, result in results.items():
        if not len(result.scores):
            continue
        found = [completeness_flag(result)]
        if method_family(name) != "intervention":
            found.append(constant_flag(result, examples))
        flags += [f for f in found if f is not None]
    return flags


def explanation_flags(pm: ProbeModel, examples, results: Mapping) -> list[ScoreFlag]:
    """:func:`score_flags`, and the degeneracy of each gradient method that sums over the hidden
    axis (registry ``reduction == "sum"``) on the word embedding where it enters a norm inside the
    embeddings module (BERT family), the one place the invariance it measures is exact (one gradient
    pass of the model; elsewhere none is spent): a method whose check failed, marked on every example."""
    from probe.explainers.gradient_forward import resolve_site
    from probe.names import method_family

    flags = score_flags(examples, results)
    gradients = []
    for m in results:
        if method_family(m) != "gradient" or not len(results[m].scores) or registry.method(m).reduction != "sum":
            continue
        try:
            site = resolve_site(pm, results[m].params.get("site"))
        except ProbeError:
            continue
        if site.name == "word" and site.normalising is not None:  # the word vector is one part of a normalised sum
            gradients.append(m)
    if gradients:
        sites = {m: {"site": results[m].params.get("site")} for m in gradients}
        flags += [ScoreFlag(c.method, c.check, c.detail) for c in degeneracy(pm, examples, gradients, params=sites)
                  if c.status == "fail"]
    return flags
