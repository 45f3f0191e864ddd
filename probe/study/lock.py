"""A lock on a result folder, so two runs never compute into the same folder at once.

``OUT/.lock`` is locked with ``flock``: the kernel releases it when its holder exits, however it
exits (``kill -9`` included), so a stale lock file never blocks. The file holds who took it (pid,
host, start time, command) only to say so to the next one that asks.

Shards of one study may run at the same time into one folder (``--shard I/N``, torchrun): each
holds ``OUT/.lock`` shared and ``OUT/.lock-shard-I-of-N`` exclusive, so two processes of the same
shard exclude each other, and a whole run (which holds ``OUT/.lock`` exclusive) excludes all shards.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from probe.errors import InputError, storage_error

LOCK_NAME = ".lock"


def _holder() -> dict:
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    program = "probe" if program in ("probe", "__main__.py") else program
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([program, *sys.argv[1:]])}


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('started', '?')} "
            f"({info.get('command', '?')})")


@contextmanager
def _flock(path: Path, exclusive: bool, wait: bool, what: str, log: Callable[[str], None]) -> Iterator[None]:
    import fcntl

    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        handle = open(path, "a+", encoding="utf-8")
    except OSError as err:
        raise storage_error(err, path, "lock") from None
    try:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(path)
            if not wait:
                raise InputError(f"{what} is in use by {holder}; wait for it to finish (or pass --wait), "
                                 "or give another --out") from None
            log(f"{what} is in use by {holder}; waiting for it ...")
            fcntl.flock(handle, mode)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(_holder()))
            handle.flush()
        except OSError:
            pass  # who holds the lock is only said to the next one; a full disk must not stop the run here
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        try:
            handle.close()
        except OSError:
            pass  # the unflushed holder line of a full disk; the lock is released with the file


@contextmanager
def folder_lock(folder: str | Path, *, shard: tuple[int, int] | None = None, wait: bool = False,
                log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock on ``folder`` (which must exist) for the ``with`` block.

    Another holder: ``InputError`` naming it (pid, host, start time, command), or with ``wait``
    block until it is gone. ``shard``: lock only that shard against others of the same shard.
    """
    folder = Path(folder)
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    what = f"the result folder {folder}"
    if shard is None:
        with _flock(folder / LOCK_NAME, True, wait, what, log):
            yield
        return
    i, n = shard
    with _flock(folder / LOCK_NAME, False, wait, what, log), \
            _flock(folder / f"{LOCK_NAME}-shard-{i}-of-{n}", True, wait, f"shard {i}/{n} of {what}", log):
        yield


__all__ = ["folder_lock", "LOCK_NAME"]
