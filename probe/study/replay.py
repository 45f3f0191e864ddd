"""The study's reference on the trained model and on the randomisation checks' re-initialised models
(:class:`ReferenceRuns`): run once on the trained model however many checks read it, and on a model
whose top layers were re-initialised, the layers below them replayed from the trained run instead of
computed (the same numbers, bit for bit, for about half the work). A causal LM whose engine reuses
prefixes runs every call with a key/value cache, which has state: nothing is replayed there
(:func:`replays_layers`), and the cascade's reference costs what the trained run does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from probe.errors import ProbeError
from probe.study.weights import layer_stack

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample

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

        caches: tuple[type, ...] = (Cache,)
    except ImportError:  # pragma: no cover - transformers is a dependency
        caches = ()
    values = [*args, *kwargs.values()]
    return (any(isinstance(v, caches) for v in values)
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

    The cascade (:func:`probe.study.randomisation.randomisation`) re-initialises the head and the top
    layers only: at its head step no layer runs again, at half the layers half of them do."""

    def __init__(self, pm: ProbeModel, examples: Sequence[PreparedExample], name: str, scorer: Callable, *,
                 replay: bool = True, max_bytes: int | None = None):
        self.pm = pm
        self.examples = examples
        self.name = name
        self.scorer = scorer
        self.max_bytes = int(REPLAY_BYTES if max_bytes is None else max_bytes)
        self.layers = layer_stack(pm.model, pm.contract.n_layers) if replay else None
        self._trained: TokenScores | None = None
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

    def trained(self) -> TokenScores:
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

    def randomised(self, changed: Sequence[torch.nn.Parameter]) -> TokenScores:
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


def replays_layers(pm: ProbeModel) -> bool:
    """Whether :class:`ReferenceRuns` can replay an engine reference's layers on ``pm``: not on a causal
    LM whose engine reuses prefixes (:func:`probe.intervene.prefix.model_supports_reuse`), where every
    model call carries a key/value cache, so has state and is never kept (there the cascade's reference
    runs in full, as on the trained model)."""
    from probe.intervene.prefix import model_supports_reuse

    return not (pm.task.next_token and model_supports_reuse(pm))


def reference_runs(pm: ProbeModel, examples: Sequence[PreparedExample],
                   reference: tuple[str, Callable] | ReferenceRuns | None) -> ReferenceRuns | None:
    """``reference`` as :class:`ReferenceRuns` (a ``(name, scorer)`` pair is wrapped)."""
    if reference is None or isinstance(reference, ReferenceRuns):
        return reference
    name, scorer = reference
    return ReferenceRuns(pm, examples, name, scorer)
