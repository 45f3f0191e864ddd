"""Writing files and folders whole or not at all: the one atomic writer of probe.

A file is written to a temporary name beside it and renamed into place (:func:`write_file`,
:func:`write_files`: study folders, reports, audits, explanations, the planted self-test). A folder
is built in a staging folder beside it and swapped into place once complete (:func:`staged_folder`:
the built-in and planted models; a report's :func:`new_staging` and :func:`commit_folder`). A file
or folder gets the permissions a plain ``open(path, "w")`` or ``mkdir`` gives under the process
umask (not ``tempfile``'s 0600 or 0700), and every ``OSError`` is one
:class:`~probe.errors.StorageError` line naming the path, the cause and the fix.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from probe.errors import storage_error

#: what :func:`write_file` writes: text (as UTF-8), bytes, or a function that writes into the open binary file
FileData = str | bytes | Callable[[BinaryIO], object]


def write_file(path: str | Path, data: FileData) -> None:
    """Write ``data`` to ``path`` whole or not at all, as :func:`write_files` writes each file: the
    one atomic writer of probe (study folders, reports, audits, explanations, the planted self-test)."""
    write_files({Path(path): data})


def write_files(files: Mapping[Path, FileData]) -> None:
    """Write each file to a temporary name beside it (``.NAME.XXXXXXXX.tmp``) and, only once all are
    complete, rename them into place in order: a failure while writing (a full disk, a read-only
    folder) leaves every earlier file as it was, and no temporary file behind. Missing folders are
    made. A file gets the permissions a plain ``open(path, "w")`` gives under the process umask
    (not ``tempfile.mkstemp``'s 0600). Every ``OSError`` is one :class:`~probe.errors.StorageError`
    line naming the file."""
    temps: dict[Path, Path] = {}
    current = None
    try:
        for path, data in files.items():
            current = path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp, fd = _create_beside(path)
            temps[path] = tmp
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode("utf-8") if isinstance(data, str) else data)
        for path, tmp in temps.items():
            current = path
            os.replace(tmp, path)
    except OSError as err:
        raise storage_error(err, current) from None
    finally:
        for tmp in temps.values():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _create_beside(path: Path) -> tuple[Path, int]:
    """A new temporary file beside ``path``, created (exclusively) with mode 0666 less the umask, as
    ``open(path, "w")`` would: its name and open descriptor."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


# --------------------------------------------------------------------------------------- folders


def new_staging(final: Path, prefix: str, doing: str = "write into", fix: str | None = None) -> Path:
    """A new empty folder beside ``final`` (``PREFIX`` and 8 random characters), with the mode a
    plain ``mkdir`` gives under the umask, to build ``final`` in and :func:`commit_folder` into its
    place. An ``OSError`` is a :class:`~probe.errors.StorageError` naming ``final``'s parent."""
    parent = Path(final).parent
    try:
        for _ in range(100):
            staging = parent / f"{prefix}{secrets.token_hex(4)}"
            try:
                os.mkdir(staging, 0o777)
                return staging
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no free staging name", str(parent))
    except OSError as err:
        raise storage_error(err, parent, doing, fix) from None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EINVAL)):
        return False
    raise OSError(code, os.strerror(code), str(b))


def commit_folder(staging: Path, out: Path, fix: str | None = None) -> None:
    """Put the finished ``staging`` folder in the place of ``out`` (the earlier one, if any, is
    whole until this moment) and remove the earlier one. An ``OSError`` is a
    :class:`~probe.errors.StorageError` naming ``out``."""
    try:
        if not out.exists():
            os.rename(staging, out)
            return
        if _exchange(staging, out):
            shutil.rmtree(staging, ignore_errors=True)  # it now holds the earlier folder
            return
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        raise storage_error(err, out, "write", fix) from None


@contextmanager
def staged_folder(final: Path, prefix: str, fix: str | None = None) -> Iterator[Path]:
    """Build ``final`` whole or not at all: the block fills a new staging folder beside it
    (:func:`new_staging`), which replaces ``final`` once the block ends (:func:`commit_folder`); a
    block that raises (or is interrupted) leaves no staging folder behind and ``final`` as it was."""
    staging = new_staging(final, prefix, fix=fix)
    try:
        yield staging
        commit_folder(staging, final, fix)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_leftovers(parent: Path, prefix: str) -> None:
    """Remove the staging folders (``PREFIX*``) that killed builds left in ``parent``; only for a
    caller that holds the build's lock, so that no live build owns them."""
    for leftover in parent.glob(f"{prefix}*"):
        shutil.rmtree(leftover, ignore_errors=True)
