"""The read paths: how probe reads one attention layer, one row of ``READERS`` each.

A read path detects its layers in the watched forward pass (:mod:`probe.hooks.sites`), attaches
and detaches its hooks while a capture is open (:mod:`probe.hooks.capture`), says whether it can
edit, describes itself for the contract (:mod:`probe.models.contract`), rebuilds a dense map
from HF's own ``output_attentions`` where the contract checks need one, and supplies any guard the
model needs around a forward (BigBird's attention type). Every :class:`probe.hooks.sites.Site`
holds its read path; its ``name`` is the site kind the contract and its files know.

A new read path is one module (its reader), one row of ``READERS`` and its oracle test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch

from probe.errors import CaptureError
from probe.hooks import banded, blocksparse, implicit, local_global
from probe.hooks import math as amath
from probe.hooks.layer_calls import LayerCallReader
from probe.hooks.modes import ModuleModes, SoftmaxWatch
from probe.hooks.types import Place, ReaderSession
from probe.names import IMPLICIT_MAPS, SOFTMAX_MAPS

if TYPE_CHECKING:
    from probe.hooks.banded import BandedCall
    from probe.hooks.blocksparse import BlockSparseCall
    from probe.hooks.local_global import LocalGlobalCall

    LayerCall = BandedCall | BlockSparseCall | LocalGlobalCall

#: a site (:class:`probe.hooks.sites.Site`, whose module imports this one): what :meth:`ReadPath.key` reads of it
Site = Any


class SeenCalls(Protocol):
    """The watched pass's stand-in session: the modules that called the attention-function registry."""

    callers: set[int]


class WatchedPass(Protocol):
    """What a read path's :meth:`~ReadPath.detect` reads of the watched forward pass
    (``probe.hooks.sites.discover_sites``): module id -> what was seen of it."""

    watch: SeenCalls
    seen_probabilities: Mapping[int, set[str]]
    seen_softmax: Mapping[int, tuple[bool, bool]]
    causal_seen: Mapping[int, bool | None]


class ReadPath:
    """One way of reading an attention layer (a row of ``READERS``)."""

    #: the site kind: written in the contract, read back by nothing but this table
    name: str = ""
    #: how the contract's ``capture_path`` names it
    describe: str = ""
    #: whether editors (and readers of query and key) can work on its layers
    can_edit: bool = True
    #: the model's own full maps (True) or the query rows asked for, recomputed (False)
    full_maps: bool = False
    #: what its layers' maps are (``SOFTMAX_MAPS`` or ``IMPLICIT_MAPS``)
    maps: str = SOFTMAX_MAPS
    #: what its layers compute depends on the padded width of the batch (BigBird: block-sparse over a
    #: long input, full attention over a short one), so a batch of one is compared padded to the batch's width
    width_dependent: bool = False

    @property
    def implicit(self) -> bool:
        """Its maps are a token mixer's matrix (signed, rows need not sum to one), not a softmax."""
        return self.maps == IMPLICIT_MAPS

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        """The :class:`probe.hooks.sites.Site` fields of ``module`` (``probability_path``, ``causal``,
        ``folded_heads``) where this path reads it in the watched pass ``watched``, else None."""
        return None

    def stands_in(self, module: torch.nn.Module) -> bool:
        """``module`` is a site of this path though its attention is a child's (which the model may swap)."""
        return False

    def hides(self, module: torch.nn.Module) -> bool:
        """``module``, an attention candidate, is no site of its own (its parent stands in for it)."""
        return False

    def key(self, site: Site | None, path: str, modules: Mapping[str, torch.nn.Module]) -> object:
        """What the capture groups this path's layers by (a module path by default)."""
        return path

    def attach(self, session: ReaderSession, places: Mapping[object, list[Place]]) -> list[Callable[[], None]]:
        """Hooks for ``places`` (:meth:`key` -> the layers it serves, in call order) reporting to the
        capture ``session``; returns what undoes them."""
        return []

    def refuse(self, places: Mapping[object, list[Place]], modules: Mapping[str, torch.nn.Module],
               hooked: tuple[Mapping, ...]) -> None:
        """Raise where an editor or reader in ``hooked`` asks a layer this path cannot serve."""

    def structure(self, layers: Mapping[int, torch.nn.Module]) -> str:
        """The sparse pattern the maps of ``layers`` live on (for the contract), else ""."""
        return ""

    def dense_maps(self, attentions: Sequence[torch.Tensor], modules: Mapping[str, torch.nn.Module],
                   paths: Sequence[str], global_layers: Sequence[torch.Tensor] | None,
                   inputs: Mapping[str, Any]) -> tuple | None:
        """A stack's HF ``output_attentions`` as dense ``[batch, head, query, key]`` maps where this
        path's layers return them in their own layout (the contract checks), else None."""
        return None

    def guard(self, model: torch.nn.Module) -> AbstractContextManager:
        """A context manager the model's forwards run under while this path's layers may run."""
        return nullcontext()

    def __repr__(self) -> str:
        return f"<read path {self.name}: {type(self).__name__}>"

    def __reduce__(self) -> tuple:
        # one object per row: a pickled or copied site keeps the table's own read path (sites are
        # compared with the table's rows by identity)
        return row_of, (type(self),)


class FunctionPath(ReadPath):
    """The module hands query, key and value to the attention-function registry
    (:mod:`probe.hooks.attention_functions`)."""

    name, describe = "function", "attention function"

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        return {} if module_id in watched.watch.callers else None

    def key(self, site: Site | None, path: str, modules: Mapping[str, torch.nn.Module]) -> object:
        return id(modules[path])  # the registry wrapper knows the calling module, not its path


class ProbabilitiesPath(ReadPath):
    """The module passes its probabilities through a child module (dropout, softmax): a forward hook reads them."""

    name, describe, full_maps = "probabilities", "probability module", True

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        if not watched.seen_probabilities.get(module_id):
            return None
        return {"probability_path": sorted(watched.seen_probabilities[module_id])[0],
                "causal": watched.causal_seen.get(module_id)}

    def key(self, site: Site | None, path: str, modules: Mapping[str, torch.nn.Module]) -> object:
        return site.probability_path

    def attach(self, session: ReaderSession, places: Mapping[object, list[Place]]) -> list[Callable[[], None]]:
        handles = []
        for path, layer_places in places.items():
            def hook(module, args, output, path=path, layer_places=layer_places):
                if isinstance(output, torch.Tensor) and output.dim() < 4:
                    # the module's other call in the layer (xlnet's dropout also runs on the
                    # layer's [query, batch, hidden] output): not the probabilities, not a layer
                    return None
                return session.on_probabilities(session.next_place(path, layer_places), output)

            handles.append(session.modules[path].register_forward_hook(hook))
        return [handle.remove for handle in handles]


class SoftmaxPath(ReadPath):
    """The module computes its probabilities with a softmax call: a torch function mode takes them."""

    name, describe, full_maps = "softmax", "softmax call", True

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        if module_id not in watched.seen_softmax:
            return None
        folded, causal = watched.seen_softmax[module_id]
        return {"folded_heads": folded, "causal": causal}

    def attach(self, session: ReaderSession, places: Mapping[object, list[Place]]) -> list[Callable[[], None]]:
        if not places:
            return []
        modes = ModuleModes()
        for path, layer_places in places.items():
            folded = bool(session.sites[layer_places[0]].folded_heads)

            def make(path=path, layer_places=layer_places, folded=folded):
                place = session.next_place(path, layer_places)
                return SoftmaxWatch(lambda t: t.dim() == (3 if folded else 4) and t.is_floating_point(),
                                    lambda t, place=place: self.read(session, place, t, folded))

            modes.watch(session.modules[path], make)
        return [modes.close]

    @staticmethod
    def read(session: ReaderSession, place: Place, probabilities: torch.Tensor, folded: bool) -> torch.Tensor | None:
        """[batch, head, query, key], or [batch * head, query, key] unfolded with the layer's head
        count and folded back after an edit."""
        if not folded:
            return session.on_probabilities(place, probabilities)
        stack, layer = place
        info = session.contract.stacks[stack]
        heads = info.layer_heads[layer] if layer < len(info.layer_heads) else info.n_heads
        rows, q_len, k_len = probabilities.shape
        if rows % heads:
            raise CaptureError(f"{stack} layer {layer}: softmax over {rows} rows is not batch x {heads} heads")
        replaced = session.on_probabilities(place, probabilities.view(rows // heads, heads, q_len, k_len))
        return None if replaced is None else replaced.reshape(rows, q_len, k_len)


class ImplicitPath(ReadPath):
    """A token mixer (:mod:`probe.hooks.implicit`) read as its implicit matrix, recomputed from its input."""

    name, describe, can_edit, full_maps, maps = "implicit", "implicit matrix", False, True, IMPLICIT_MAPS

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        kind = implicit.mixer_kind(module)
        return None if kind is None else {"causal": kind.causal}

    def attach(self, session: ReaderSession, places: Mapping[object, list[Place]]) -> list[Callable[[], None]]:
        handles = []
        for path, layer_places in places.items():
            def read(module, args, kwargs, path=path, layer_places=layer_places):
                self.read(session, session.next_place(path, layer_places), module, args, kwargs)

            handles.append(session.modules[path].register_forward_pre_hook(read, with_kwargs=True))
        return [handle.remove for handle in handles]

    @staticmethod
    def read(session: ReaderSession, place: Place, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """One mixer call: its matrix, recomputed from its input, stored for the rows asked for."""
        stack, layer = place
        session.calls[place] = session.calls.get(place, 0) + 1
        if not session.wants(stack, layer):
            return
        if implicit.continues_a_state(module, args, kwargs):
            raise CaptureError(f"{stack} layer {layer}: the mixer continues a cached state (a generation step); "
                               "capture a full forward pass without a filled cache")
        hidden, mask = implicit.call_inputs(module, args, kwargs)
        if mask is None and not implicit.mixer_kind(module).takes_mask:  # padding from the batch's own mask
            given = session.batch_mask(stack)
            if isinstance(given, torch.Tensor) and given.dim() == 2 and tuple(given.shape) == tuple(hidden.shape[:2]):
                mask = given
        with torch.set_grad_enabled(session.keep_grad and torch.is_grad_enabled()):
            maps, has_keys = implicit.implicit_maps(module, implicit.mixer_kind(module), hidden, mask)
        rows = session.query_rows(stack, maps.shape[0], maps.shape[2], maps.device)
        session.store(place, amath.gather_rows(maps, rows), amath.gather_rows(has_keys[..., None], rows)[..., 0],
                      rows, maps.shape[2])


class SparseLayoutPath(ReadPath):
    """A layer that computes its attention in its own sparse layout, read densified from its own
    weights as it runs (site kind ``banded``), never edited; one row per layout family, each with its
    module's reader class (``reader``: hooks that hand each call of a layer on, densifiable)."""

    name, describe, can_edit = "banded", "banded reader", False
    #: the family's reader: ``reader(model, modules by path, handle(module, call))``, closed with ``close()``
    reader: Callable[..., LayerCallReader]

    def attach(self, session: ReaderSession, places: Mapping[object, list[Place]]) -> list[Callable[[], None]]:
        if not places:
            return []
        paths = {id(session.modules[path]): path for path in places}
        reader = self.reader(session.model, {path: session.modules[path] for path in places},
                             lambda module, call: self.read(session, places, paths[id(module)], call))
        return [reader.close]

    @staticmethod
    def read(session: ReaderSession, places: Mapping[object, list[Place]], path: str, call: LayerCall) -> None:
        """The layer's own sparse weights (a BandedCall, BlockSparseCall or LocalGlobalCall),
        densified over the rows asked for."""
        place = session.next_place(path, places[path])
        session.calls[place] = session.calls.get(place, 0) + 1
        rows = session.query_rows(place[0], call.batch, call.length, call.device)
        observer = session.observers.get(place)
        if observer is not None:
            with torch.no_grad():
                weights, structure = call.dense()  # [batch, head, query, key], [batch, query, key]
                context = session.context(place, session.modules[path], rows, structure[:, None], call.batch,
                                          call.length, weights.device)
                observer(weights.mean(dim=1).to(session.home), context)
        if session.wants(*place):
            weights, structure = call.dense(rows)  # [batch, head, rows, key], [batch, rows, key]
            session.store(place, weights, structure.any(-1)[:, None], rows, call.length)

    @staticmethod
    def pattern(module: torch.nn.Module) -> str:
        """The layer's sparse pattern in a few words, for one-line messages."""
        raise NotImplementedError

    def refuse(self, places: Mapping[object, list[Place]], modules: Mapping[str, torch.nn.Module],
               hooked: tuple[Mapping, ...]) -> None:
        banded.refuse_hooks(places, modules, hooked, self.pattern)


class LongformerBandPath(SparseLayoutPath):
    """Longformer's (and LED's encoder's) sliding window plus global tokens (:mod:`probe.hooks.banded`)."""

    reader, pattern = banded.BandedReader, staticmethod(banded.pattern)

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        return {} if banded.is_longformer_band(module) else None

    def structure(self, layers: Mapping[int, torch.nn.Module]) -> str:
        return banded.describe_layers(layers)

    def dense_maps(self, attentions: Sequence[torch.Tensor], modules: Mapping[str, torch.nn.Module],
                   paths: Sequence[str], global_layers: Sequence[torch.Tensor] | None,
                   inputs: Mapping[str, Any]) -> tuple | None:
        return tuple(banded.dense_from_output_attentions(
            local, global_layers[i] if global_layers else None, inputs["attention_mask"],
            banded.one_sided_window(modules[paths[i]])) for i, local in enumerate(attentions))


class BlockSparsePath(SparseLayoutPath):
    """BigBird's block-sparse attention (:mod:`probe.hooks.blocksparse`): HF swaps it for full
    attention while a short input runs, so the site is its parent, and the guard puts it back."""

    reader, pattern = blocksparse.BlockSparseReader, staticmethod(blocksparse.pattern)
    width_dependent = True

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        return {} if blocksparse.is_block_sparse_layer(module) else None

    def structure(self, layers: Mapping[int, torch.nn.Module]) -> str:
        return blocksparse.describe_layers(layers)

    def stands_in(self, module: torch.nn.Module) -> bool:
        return blocksparse.is_block_sparse_layer(module)

    def hides(self, module: torch.nn.Module) -> bool:
        return blocksparse.is_block_sparse(module)

    def dense_maps(self, attentions: Sequence[torch.Tensor], modules: Mapping[str, torch.nn.Module],
                   paths: Sequence[str], global_layers: Sequence[torch.Tensor] | None,
                   inputs: Mapping[str, Any]) -> tuple | None:
        first = modules[paths[0]]  # ran block-sparse: it is in place (the guard) and the input is long
        ran = blocksparse.is_block_sparse(first.self) and \
            int(inputs["input_ids"].shape[1]) > blocksparse.full_attention_limit(first.config)
        return tuple(blocksparse.dense_from_output_attentions(a, modules[path], inputs["attention_mask"], ran)
                     for a, path in zip(attentions, paths))

    def guard(self, model: torch.nn.Module) -> AbstractContextManager:
        # HF's BigBird falls back to full attention for a short input and keeps it: each forward runs
        # what its own input runs
        return blocksparse.AttentionTypeGuard(model)


class LocalGlobalPath(SparseLayoutPath):
    """LongT5's local and transient-global encoder attention (:mod:`probe.hooks.local_global`)."""

    reader, pattern = local_global.LocalGlobalReader, staticmethod(local_global.pattern)

    def detect(self, watched: WatchedPass, module_id: int, module: torch.nn.Module) -> dict | None:
        return {} if local_global.is_local_global(module) else None

    def structure(self, layers: Mapping[int, torch.nn.Module]) -> str:
        return local_global.describe_layers(layers)

    def dense_maps(self, attentions: Sequence[torch.Tensor], modules: Mapping[str, torch.nn.Module],
                   paths: Sequence[str], global_layers: Sequence[torch.Tensor] | None,
                   inputs: Mapping[str, Any]) -> tuple | None:
        # [batch, block, head, bl, 3 bl + G] per layer
        return tuple(local_global.dense_from_output_attentions(a, modules[path], inputs["attention_mask"])
                     for a, path in zip(attentions, paths))


FUNCTION, PROBABILITIES, SOFTMAX, IMPLICIT = FunctionPath(), ProbabilitiesPath(), SoftmaxPath(), ImplicitPath()
LONGFORMER_BAND, BLOCK_SPARSE, LOCAL_GLOBAL = LongformerBandPath(), BlockSparsePath(), LocalGlobalPath()

#: every read path, in detection order: a layer is read by the first that detects it
READERS: tuple[ReadPath, ...] = (LONGFORMER_BAND, BLOCK_SPARSE, LOCAL_GLOBAL, IMPLICIT, FUNCTION, PROBABILITIES,
                                 SOFTMAX)


def row_of(kind: type) -> ReadPath:
    """The row of ``READERS`` of class ``kind``."""
    return next(reader for reader in READERS if type(reader) is kind)


def detect(watched: WatchedPass, module_id: int, module: torch.nn.Module) -> tuple[ReadPath, dict] | None:
    """(the first read path of ``READERS`` that reads ``module`` in ``watched``, its site fields), or None."""
    for reader in READERS:
        fields = reader.detect(watched, module_id, module)
        if fields is not None:
            return reader, fields
    return None


@contextmanager
def guarded(model: torch.nn.Module) -> Iterator[None]:
    """Every read path's guard around the forwards run inside the block."""
    with ExitStack() as stack:
        for reader in READERS:
            stack.enter_context(reader.guard(model))
        yield
