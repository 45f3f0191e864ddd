"""The softmax capture path's machinery: a torch function mode that is active while one
attention module runs and sees its softmax calls (used by the watched forward in
:mod:`probe.hooks.sites` and by the capture session in :mod:`probe.hooks.capture`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: the softmax entry points an inline attention calls (``softmax`` path)
SOFTMAX_FUNCTIONS = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax,
                               torch.special.softmax})


class SoftmaxWatch(torch.overrides.TorchFunctionMode):
    """Active while one attention module runs: hands the first softmax result that ``accept``s to
    ``handle`` (which may return a replacement) and lets every other call through unchanged."""

    def __init__(self, accept: Callable[[torch.Tensor], bool], handle: Callable[[torch.Tensor], torch.Tensor | None]):
        super().__init__()
        self.accept = accept
        self.handle = handle
        self.done = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not self.done and func in SOFTMAX_FUNCTIONS and isinstance(result, torch.Tensor) and self.accept(result):
            self.done = True
            replaced = self.handle(result)
            return result if replaced is None else replaced
        return result


class ModuleModes:
    """Enter a :class:`SoftmaxWatch` when a module's forward starts and leave it when it returns
    (forward pre-hook and hook); :meth:`close` leaves any still open (a forward that raised)."""

    def __init__(self):
        self.open: list[torch.overrides.TorchFunctionMode] = []
        self.handles: list = []

    def watch(self, module: torch.nn.Module, make: Callable[[], SoftmaxWatch]) -> None:
        def enter(mod, args):
            mode = make()
            mode.__enter__()
            self.open.append(mode)

        def leave(mod, args, output):
            if self.open:
                self.open.pop().__exit__(None, None, None)

        self.handles.append(module.register_forward_pre_hook(enter))
        self.handles.append(module.register_forward_hook(leave))

    def close(self) -> None:
        while self.open:
            self.open.pop().__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
