"""Running out of memory without losing work: split a batch in halves and retry (OOM halving).
Shared by the explainers and the interventions."""

from __future__ import annotations

import torch

from probe.errors import ProbeError


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's / a backend's "out of memory" RuntimeError."""
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def halving(items: list, run, stats=None, device="cpu", what: str = "rows") -> None:
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


def in_halves(items: Sequence, run, device="cpu", what: str = "examples") -> list:
    """``[run(items, 0)]``; when that runs out of memory, the results of ``run(part, start)`` on
    consecutive parts of ``items`` (halves, recursively: :func:`halving`), in item order, ``start``
    being the index of the part's first item. A part's result is kept only once it is complete,
    so no item is lost or run twice."""
    parts: list = []
    halving(list(range(len(items))),
            lambda chosen: parts.append(run([items[i] for i in chosen], chosen[0] if chosen else 0)),
            device=device, what=what)
    return parts
