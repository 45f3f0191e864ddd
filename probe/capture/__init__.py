"""Read and write attention per layer and head through the attention-function registry.

Calling the package, ``with probe.capture(pm, ...) as cap:``, runs :func:`probe.api.capture`.
"""

from probe.capture.hooks import AttentionMaps, Capture, EditContext, capture_attention, installed_wrappers

__all__ = ["AttentionMaps", "Capture", "EditContext", "capture_attention", "installed_wrappers"]

from probe.callable_module import make_callable  # noqa: E402

make_callable(__name__, "capture")
