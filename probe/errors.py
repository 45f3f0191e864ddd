"""The one exception root of probe.

A ``ProbeError`` is a user-facing problem: its message names the bad value and the fix, and the CLI
prints it on one line without a traceback.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os


class ProbeError(Exception):
    """Root of every error probe raises on purpose."""


class ModelLoadError(ProbeError):
    """A model could not be found, loaded or understood."""


class InputError(ProbeError):
    """A text, label, option or file the user gave is unusable."""


class CaptureError(ProbeError):
    """Attention could not be captured (or edited) as asked."""


class StorageError(InputError):
    """A file or folder could not be written, read or locked: a full disk, a read-only file system,
    missing permissions. The message names the path, the cause and what to do; a run stopped by one
    continues where it stopped once the cause is gone."""


def storage_error(err: OSError, path: "str | os.PathLike[str]", doing: str = "write",
                  fix: str | None = None) -> StorageError:
    """``err`` (raised while ``doing`` ``path``) as one line naming the path, the cause and the fix:
    ``fix``, or by default one for the cause worded for a command's ``--out``."""
    import errno

    code = getattr(err, "errno", None)
    cause = " ".join(str(err.strerror or err).split()) or type(err).__name__
    if fix is None and code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        fix = "free some space there (or give another --out), then run the same command again to continue"
    elif fix is None and code == errno.EROFS:
        fix = "the file system is read-only: give a writable --out (or remount it writable)"
    elif fix is None and code in (errno.EACCES, errno.EPERM):
        fix = "give a folder you may write as --out (or fix its permissions)"
    elif fix is None:
        fix = "fix the cause, then run the same command again to continue"
    return StorageError(f"cannot {doing} {path}: {cause}; {fix}")


def check_flag(value: object, argument: str) -> bool:
    """``value`` if it is True or False, else a one-line :class:`InputError` naming ``argument``."""
    if not isinstance(value, bool):
        raise InputError(f"{argument}={value!r}: give True or False")
    return value


def positive_int(value: object, argument: str) -> int:
    """``value`` when it is a whole number of at least 1 (not a bool), else an :class:`InputError` naming
    ``argument`` and an example."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{argument}={value!r} is not a positive whole number; give e.g. {argument}=8")
    return value


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside the probe package:
    the line of the user's code (a script, a notebook cell, a test) that called into probe, whatever
    depth probe called it from."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    level = 2  # stacklevel 2 = the frame that called this function
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
