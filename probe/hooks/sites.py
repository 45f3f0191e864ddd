"""Find where each attention layer of a model can be read, by watching one small forward pass.

The paths (house rule 4: what the model's forward actually does, never its source) are the rows of
:data:`probe.hooks.readers.READERS`, tried in that order; each :class:`Site` holds its own:

``function``       the module hands query, key and value to the shared attention-function registry
                   (``ALL_ATTENTION_FUNCTIONS``): probe wraps that function (hooks.py).
``probabilities``  the module computes attention inline but passes its probabilities through a
                   child module (an ``nn.Dropout``, identity in eval, or an ``nn.Softmax``) whose
                   output is ``[batch, head, query, key]`` with non-negative rows summing to at most
                   1: probe reads, and for interventions replaces, that output with a forward hook.
``softmax``        the module computes attention inline with a softmax function call (``F.softmax``,
                   ``torch.softmax``, ``Tensor.softmax``) and hands the result to no module: while
                   the module runs, a torch function mode (:class:`SoftmaxWatch`) sees its first
                   softmax whose result is ``[batch, head, query, key]`` probabilities over the
                   input's positions, and probe reads, or replaces, that result.
``banded``         the module computes a sliding window plus global tokens (Longformer, LED's
                   encoder: :data:`probe.hooks.banded.BANDED_ATTENTION_CLASSES`): probe reads the
                   layer's own banded probabilities and scatters them into a dense map
                   (:mod:`probe.hooks.banded`); it cannot edit them. BigBird's block-sparse
                   layers too (:mod:`probe.hooks.blocksparse`): HF swaps them for full attention
                   while a short input runs, so the site is their parent (which HF keeps), and
                   the watched pass puts the model's own modules back afterwards.

A module that calls the registry is an attention module whatever its name; other candidates are the
innermost modules whose class name ends in ``Attention``. Layers are numbered by the order in which
the stack calls them, and a module called several times in one forward (a shared layer) is one layer
per call. A token mixer that :mod:`probe.hooks.implicit` reads (Mamba, Mamba-2, RWKV, a gated short
convolution) is a layer of kind ``implicit`` at its place in that order, so a hybrid's stack holds
every token-mixing layer, softmax or not, in model order. A candidate that neither calls the registry nor exposes probabilities is returned with the
reason it cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from probe.hooks.attention_functions import implementation_of, open_session, sink_logits
from probe.hooks.implicit import find_mixers, mixer_kind
from probe.hooks.modes import ModuleModes, SoftmaxWatch
from probe.hooks.readers import IMPLICIT, READERS, ReadPath, detect, guarded
from probe.tasks import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROBABILITY_MODULES = (torch.nn.Dropout, torch.nn.Softmax)
#: words in a module path that name a cross-attention (read here and by the fallback layout of
#: probe.models.architectures, which sits above the capture)
CROSS_ATTENTION_WORDS = ("cross", "encoder_attn", "encdec")
# rows of a softmax sum to 1; a row whose keys are all masked may sum to 0; an attention sink
# takes some mass out of the row (sum < 1)
_ROW_SUM_TOL = 1e-3


@dataclass(frozen=True)
class Site:
    """One attention layer as probe reads it."""

    stack: str  # encoder | decoder | cross
    layer: int  # the stack's own attention-layer index (call order)
    path: str  # the attention module
    reader: ReadPath  # how probe reads it: a row of probe.hooks.readers.READERS
    probability_path: str | None = None  # the child module whose output is the probabilities
    call: int = 0  # which call of ``path`` in one forward this layer is (shared modules)
    #: the probabilities seen in the watched pass put weight on later keys (False) or never did
    #: (True); None where probe did not see them (the function path reads the mask instead)
    causal: bool | None = None
    #: the softmax path: the probabilities come as [batch * head, query, key] (older BART-style code)
    folded_heads: bool = False
    #: the module handed the attention function sink logits (``sinks`` / ``s_aux``) in the watched pass
    sinks: bool = False

    @property
    def kind(self) -> str:
        """The read path's name: function | probabilities | softmax | banded | implicit."""
        return self.reader.name


def stack_of(path: str) -> str:
    lowered = path.lower()
    if any(word in lowered for word in CROSS_ATTENTION_WORDS):
        return "cross"
    if "encoder" in lowered and "decoder" not in lowered:
        return "encoder"
    if "decoder" in lowered:
        return "decoder"
    return "encoder" if "encoder" in lowered else "decoder"


def attention_candidates(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Innermost modules whose class name ends in ``Attention``, by path."""
    named = [(p, m) for p, m in model.named_modules() if p and type(m).__name__.lower().endswith("attention")]
    paths = [p for p, _ in named]
    return {p: m for p, m in named if not any(other.startswith(p + ".") for other in paths)}


def probe_inputs(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None, task: Task) -> dict:
    """A one-example batch of six tokens: enough to see which modules run and what they hand on."""
    vocab = int(getattr(model.config, "vocab_size", None) or 100)
    ids = None
    if tokenizer is not None:
        try:
            ids = tokenizer(["the film is good"], return_tensors="pt")["input_ids"]
        except Exception:  # noqa: BLE001 - any tokenizer problem: fall back to plain ids
            ids = None
    if ids is None or ids.shape[1] < 2 or int(ids.max()) >= vocab:
        ids = torch.arange(1, 7, dtype=torch.long)[None] % vocab
    device = next(model.parameters()).device
    inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    if task.encoder_decoder:
        start = getattr(model.config, "decoder_start_token_id", None)
        start = start if isinstance(start, int) else (getattr(model.config, "pad_token_id", None) or 0)
        decoder = torch.cat([torch.full_like(ids[:, :1], start), ids[:, :-1]], dim=1)
        inputs.update(decoder_input_ids=decoder.to(device), decoder_attention_mask=torch.ones_like(decoder).to(device))
    return inputs


def _looks_like_probabilities(tensor) -> bool:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or not tensor.is_floating_point():
        return False
    t = tensor.detach().float()
    if bool((t < 0).any()):
        return False
    sums = t.sum(-1)
    return bool((sums <= 1 + _ROW_SUM_TOL).all()) and bool((sums > 1 - _ROW_SUM_TOL).any())


def _never_looks_ahead(t: torch.Tensor) -> bool:
    """No weight above the diagonal of the last two axes (square maps only; others: True)."""
    if t.shape[-1] != t.shape[-2]:
        return True
    return not bool((t.detach().float().triu(1) > 1e-6).any())


class _Watch:
    """Stands in for a capture session in the registry wrapper: records who calls, changes nothing."""

    def __init__(self, width: int | None = None):
        self.callers: set[int] = set()
        #: callers whose keys are not the input's positions (attention over layers or memory slots)
        self.elsewhere: dict[int, int] = {}
        #: callers that hand the function attention-sink logits (per head, or per head and token)
        self.with_sinks: set[int] = set()
        self.width = width
        self.where = self  # the wrapper asks ``where.get(id(module))``

    def get(self, key, default=None):
        return key

    def call(self, place, original, module, query, key, *args, **kwargs):
        # place is the module's id (see get); keys [batch, kv head, key, dim]
        if self.width is None or int(key.shape[-2]) >= self.width:
            self.callers.add(place)
        else:
            self.elsewhere[place] = int(key.shape[-2])
        if sink_logits(kwargs) is not None:
            self.with_sinks.add(place)
        return original(module, query, key, *args, **kwargs)


def discover_sites(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None,
                   task: Task) -> tuple[list[Site], dict[str, str]]:
    """Every readable attention layer of ``model`` and, by path, the modules that cannot be read and why."""
    watched = _WatchedPass(model, tokenizer, task)
    watched.run(model)
    unreadable = watched.attending_elsewhere()
    return watched.sites(unreadable), unreadable


class _WatchedPass:
    """One small forward pass with every attention-looking module watched: which modules call the
    attention-function registry (and over how many keys), which hand probabilities through a child
    module or compute them with a softmax call, and in which order the modules run."""

    def __init__(self, model, tokenizer, task: Task):
        self.named = dict(model.named_modules())
        self.candidates = attention_candidates(model)
        self.modules_by_id = {id(m): p for p, m in self.named.items()}
        self.inputs = probe_inputs(model, tokenizer, task)
        self.width = int(self.inputs["input_ids"].shape[1])
        self.order: list[int] = []  # id of each module, per call, in call order
        self.seen_probabilities: dict[int, set[str]] = {}
        self.seen_softmax: dict[int, tuple[bool, bool]] = {}  # module id -> (folded heads, never looks ahead)
        self.causal_seen: dict[int, bool] = {}
        self.watch = _Watch(self.width)
        # a layer the model may swap out (BigBird's block-sparse attention, for a short input): its parent is the site
        self.stand_ins = {id(m) for m in self.named.values() if any(r.stands_in(m) for r in READERS)}

    def _over_positions(self, t: torch.Tensor) -> bool:
        # [batch, head, query, key] (or [batch * head, query, key], batch 1 here) over the input's
        # positions: not a chunked or windowed layout
        if t.dim() not in (3, 4) or t.shape[-1] != self.width or t.shape[-2] not in (1, self.width):
            return False
        return _looks_like_probabilities(t if t.dim() == 4 else t[None])

    def _saw_softmax(self, t: torch.Tensor, module) -> None:
        self.seen_softmax[id(module)] = (t.dim() == 3, _never_looks_ahead(t))

    def _probability_hooks(self) -> list:
        """Forward hooks on the probability modules (dropout, softmax) inside attention candidates."""
        handles = []
        for path, module in self.named.items():
            if not isinstance(module, PROBABILITY_MODULES):
                continue
            owner = max((c for c in self.candidates if path.startswith(c + ".")), key=len, default=None)
            if owner is None:
                continue

            def record(mod, args, output, path=path, owner=owner):
                if _looks_like_probabilities(output):
                    self.seen_probabilities.setdefault(id(self.candidates[owner]), set()).add(path)
                    self.causal_seen[id(self.candidates[owner])] = _never_looks_ahead(output)

            handles.append(module.register_forward_hook(record))
        return handles

    def run(self, model) -> None:
        """The forward pass, every hook and mode removed again in ``finally``."""
        handles = []
        modes = ModuleModes()
        try:
            for module in self.candidates.values():
                def make(module: torch.nn.Module = module) -> SoftmaxWatch:
                    return SoftmaxWatch(self._over_positions, lambda t: self._saw_softmax(t, module))

                modes.watch(module, make)
            for module in self.named.values():
                handles.append(module.register_forward_pre_hook(lambda mod, args: self.order.append(id(mod))))
            handles += self._probability_hooks()
            with open_session(self.watch, implementation_of(model)), torch.no_grad(), guarded(model):
                model(**self.inputs)
        finally:
            modes.close()
            for handle in handles:
                handle.remove()

    def attending_elsewhere(self) -> dict[str, str]:
        """Modules that called the registry only over keys that are not the input's positions."""
        unreadable: dict[str, str] = {}
        for module_id, keys in self.watch.elsewhere.items():
            if module_id not in self.watch.callers:
                path = self.modules_by_id[module_id]
                unreadable.setdefault(path, f"{type(self.named[path]).__name__} attends over {keys} keys that are not "
                                            f"the input's {self.width} positions (attention across layers or memory "
                                            "slots, not tokens): not an attention layer over the text")
        return unreadable

    def sites(self, unreadable: dict[str, str]) -> list[Site]:
        """The readable layers in call order, numbered per stack; candidates that cannot be read are
        added to ``unreadable`` with the reason."""
        # token mixers read as implicit attention (probe.hooks.implicit) are layers too, in call order
        mixer_ids = {id(m) for m in self.named.values() if mixer_kind(m) is not None}
        attention_ids = (self.watch.callers | {id(m) for m in self.candidates.values() if not any(r.hides(m) for r in READERS)}
                         | mixer_ids)
        calls: dict[int, int] = {}
        counters: dict[str, int] = {}
        sites: list[Site] = []
        for module_id in self.order:
            if module_id not in attention_ids and module_id not in self.stand_ins:
                continue
            path = self.modules_by_id[module_id]
            call = calls.get(module_id, 0)
            calls[module_id] = call + 1
            stack = stack_of(path)
            found = detect(self, module_id, self.named[path])
            if found is None:
                if call == 0:
                    unreadable[path] = (f"{type(self.named[path]).__name__} neither calls the attention-function "
                                        "registry, nor passes [batch, head, query, key] probabilities through a child "
                                        "module, nor computes them with a softmax over the input's positions (linear, "
                                        "kernelised or chunked attention has none)")
                continue
            reader, fields = found
            sites.append(Site(stack=stack, layer=counters.get(stack, 0), path=path, reader=reader, call=call,
                              sinks=module_id in self.watch.with_sinks, **fields))
            counters[stack] = counters.get(stack, 0) + 1
        return sites


def implicit_sites(model: torch.nn.Module) -> list[Site]:
    """One :class:`Site` of kind ``implicit`` per token mixer (probe.hooks.implicit), numbered in module order
    (the decoder stack: these mixers are causal)."""
    return [Site(stack="decoder", layer=i, path=path, reader=IMPLICIT, causal=True)
            for i, (path, _) in enumerate(find_mixers(model))]

