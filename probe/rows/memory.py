"""Running out of memory without losing work: split a batch in halves and retry (OOM halving).
Shared by the explainers and the interventions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from probe.errors import ProbeError

_T = TypeVar("_T")
_R = TypeVar("_R")


class _SplitCounter(Protocol):
    """What :func:`halving` counts its splits on: an engine's stats (``probe.intervene.rowcache.EngineStats``)."""

    oom_splits: int


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's / a backend's "out of memory" RuntimeError."""
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device: torch.device | str) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def halving(items: list[_T], run: Callable[[list[_T]], object], stats: _SplitCounter | None = None,
            device: torch.device | str = "cpu", what: str = "rows",
            size: Callable[[list[_T]], int] = len) -> int | None:
    """``run(items)``; when it runs out of memory, free what can be freed and run each half in turn
    (recursively). ``run`` must store its results only once it has them all, so a failed attempt
    leaves nothing behind and a retried item is computed exactly once. One item that does not fit
    is an error.

    ``size``: how big a part is (the number of items unless told; an engine gives its tokens). A part
    as big as one that ran out of memory is split without being tried, so after the first error the
    rest runs in parts that fit rather than failing again at every level. Returns None where
    ``run(items)`` ran at once, else what fitted: the size of the largest part that ran, for the
    caller to plan its later batches with (:class:`SettledSize`)."""
    learned = _Learned()
    _halving(items, run, stats, device, what, size, learned)
    if learned.failed is None:
        return None
    return max(1, min(learned.ran, learned.failed - 1))


class _Learned:
    """What one :func:`halving` learned: the smallest size that ran out of memory (None: none did)
    and the largest size that ran after that."""

    def __init__(self) -> None:
        self.failed: int | None = None
        self.ran = 0


def _halving(items: list[_T], run: Callable[[list[_T]], object], stats: _SplitCounter | None,
             device: torch.device | str, what: str, size: Callable[[list[_T]], int], learned: _Learned) -> None:
    n = size(items)
    if learned.failed is None or n < learned.failed or len(items) <= 1:
        try:
            run(items)
            if learned.failed is not None:
                learned.ran = max(learned.ran, n)
            return
        except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_out_of_memory(error):
                raise
            if len(items) <= 1:
                raise ProbeError(f"out of memory on a single batch item ({what}) on {device}: use a smaller "
                                 "dtype (--dtype bf16), a shorter text, or a device with more memory") from None
        free_memory(device)
        if stats is not None:
            stats.oom_splits += 1
        learned.failed = n if learned.failed is None else min(learned.failed, n)
    half = len(items) // 2
    _halving(items[:half], run, stats, device, what, size, learned)
    _halving(items[half:], run, stats, device, what, size, learned)


class SettledSize:
    """The size a run settled on after running out of memory: ``size`` is None until then, afterwards
    the size of the largest part that ran (:func:`halving`'s answer), only ever lowered, so a later
    call is cut at it from the start rather than running out of memory again."""

    def __init__(self, size: int | None = None) -> None:
        self.size = None if size is None else max(1, int(size))

    def lower(self, fitted: int | None) -> bool:
        """Take ``fitted`` (None: nothing ran out of memory); True where that lowered ``size``."""
        if fitted is None or (self.size is not None and self.size <= fitted):
            return False
        self.size = max(1, int(fitted))
        return True


def in_halves(items: Sequence[_T], run: Callable[[list[_T], int], _R], device: torch.device | str = "cpu",
              what: str = "examples", settled: SettledSize | None = None,
              stats: _SplitCounter | None = None) -> list[_R]:
    """``[run(items, 0)]``; when that runs out of memory, the results of ``run(part, start)`` on
    consecutive parts of ``items`` (halves, recursively: :func:`halving`), in item order, ``start``
    being the index of the part's first item. A part's result is kept only once it is complete,
    so no item is lost or run twice.

    ``settled``: the number of items per call an earlier call settled on, lowered here by what fits
    after running out of memory (:class:`SettledSize`); the items are cut into parts of at most
    that many from the start, and the items left after a part that ran out of memory are cut
    again at the lowered size. ``stats``: where the splits are counted (as :func:`halving` counts them)."""
    settled = settled if settled is not None else SettledSize()
    parts: list[_R] = []

    def run_part(chosen: list[int]) -> None:
        parts.append(run([items[i] for i in chosen], chosen[0] if chosen else 0))

    start = 0
    while True:  # at least once: no items is one call on none
        stop = len(items) if settled.size is None else min(len(items), start + settled.size)
        settled.lower(halving(list(range(start, stop)), run_part, stats, device, what))
        start = stop
        if start >= len(items):
            return parts


def available_memory() -> int | None:
    """Bytes of memory this process could still take (MemAvailable, bounded by a cgroup limit), or None
    where the platform does not say."""
    free = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        free = None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            room = max(int(limit) - usage, 0)
            free = room if free is None else min(free, room)
        break
    return free


def check_bootstrap_memory(bootstrap: int, n_examples: int, key: str = "statistics.bootstrap") -> None:
    """Refuse a bootstrap whose resamples cannot be held: it draws ``bootstrap`` resamples of the
    examples at once (an index and a value each, 16 bytes a cell), within half the free memory."""
    from probe.errors import InputError

    n = max(int(n_examples), 1)
    need = 16 * int(bootstrap) * n
    free = available_memory()
    if free is not None and need > free // 2:
        fits = max(100, int(free // 2 // (16 * n)))
        raise InputError(f"{key}: {bootstrap} resamples of {n} examples need about {need / 2**30:.1f} GiB and this "
                         f"machine has {free / 2**30:.1f} GiB free; give {key} <= {fits}")
