"""Read and write attention per layer and head through the attention-function registry."""

from probe.capture.hooks import AttentionMaps, Capture, EditContext, capture_attention, installed_wrappers

__all__ = ["AttentionMaps", "Capture", "EditContext", "capture_attention", "installed_wrappers"]
