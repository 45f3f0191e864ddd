"""What a calibration batch measures of each step of a study (:class:`StepMeter`): its largest model
call in tokens and its peak memory, CUDA's peak allocation or, on a CPU, the process's resident set
sampled as it runs (:func:`resident_bytes`, after :func:`trim_allocator` hands freed memory back)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

__all__ = ["StepMeter", "resident_bytes", "trim_allocator"]


class StepMeter:
    """Per step of a batch: the largest call's tokens and the peak memory above where the step started
    (CUDA's peak allocation, or the process's resident set sampled every 2 ms on a CPU)."""

    def __init__(self, pm: ProbeModel):
        self.pm = pm
        self.cuda = torch.device(pm.device).type == "cuda"
        self.step: str | None = None
        self.call_tokens: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._start = 0
        self._high = 0
        self._stop = threading.Event()
        self._thread = None if self.cuda else threading.Thread(target=self._sample, daemon=True)
        self._handle = pm.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def __enter__(self) -> StepMeter:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.on_step(None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._handle.remove()

    def _now(self) -> int:
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.pm.device))
        return resident_bytes()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._high = max(self._high, resident_bytes())

    def _hook(self, module, args, kwargs) -> None:
        x = kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds")
        if self.step is not None and x is not None:
            self.call_tokens[self.step] = max(self.call_tokens.get(self.step, 0), int(x.shape[0] * x.shape[1]))

    def on_step(self, name: str | None) -> None:
        """A step starts (None: the batch ended): the last one's peak is kept."""
        if self.step is not None:
            high = int(torch.cuda.max_memory_allocated(self.pm.device)) if self.cuda else max(self._high, self._now())
            self.peak[self.step] = max(self.peak.get(self.step, 0), high - self._start)
        self.step = name
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.pm.device)
        else:
            trim_allocator()  # memory freed by the last step goes back to the system: this step's growth is its own
        self._start = self._now()
        self._high = self._start


def trim_allocator() -> None:
    """Hand the C allocator's freed memory back to the system (glibc's ``malloc_trim``; nothing elsewhere),
    so that the resident set measures what is live."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resident_bytes() -> int:
    """This process's resident set (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
