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
            device: torch.device | str = "cpu", what: str = "rows") -> None:
    """``run(items)``; when it runs out of memory, free what can be freed and run each half in turn
    (recursively). ``run`` must store its results only once it has them all, so a failed attempt
    leaves nothing behind and a retried item is computed exactly once. One item that does not fit
    is an error."""
    try:
        run(items)
        return
    except Exception as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if not is_out_of_memory(error):
            raise
        if len(items) <= 1:
            raise ProbeError(f"out of memory on a single batch item ({what}) on {device}: use a smaller dtype "
                             "(--dtype bf16), a shorter text, or a device with more memory") from None
    free_memory(device)
    if stats is not None:
        stats.oom_splits += 1
    half = len(items) // 2
    halving(items[:half], run, stats, device, what)
    halving(items[half:], run, stats, device, what)


def in_halves(items: Sequence[_T], run: Callable[[list[_T], int], _R], device: torch.device | str = "cpu",
              what: str = "examples") -> list[_R]:
    """``[run(items, 0)]``; when that runs out of memory, the results of ``run(part, start)`` on
    consecutive parts of ``items`` (halves, recursively: :func:`halving`), in item order, ``start``
    being the index of the part's first item. A part's result is kept only once it is complete,
    so no item is lost or run twice."""
    parts: list[_R] = []
    halving(list(range(len(items))),
            lambda chosen: parts.append(run([items[i] for i in chosen], chosen[0] if chosen else 0)),
            device=device, what=what)
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
