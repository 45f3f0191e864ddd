"""The one exception root of probe.

A ``ProbeError`` is a user-facing problem: its message names the bad value and the fix, and the CLI
prints it on one line without a traceback.
"""


class ProbeError(Exception):
    """Root of every error probe raises on purpose."""


class ModelLoadError(ProbeError):
    """A model could not be found, loaded or understood."""


class InputError(ProbeError):
    """A text, label, option or file the user gave is unusable."""


class CaptureError(ProbeError):
    """Attention could not be captured (or edited) as asked."""
