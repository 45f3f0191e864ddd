"""probe.files' atomic writer (write_file, write_files): the one every file probe writes goes
through (study folders, reports, audits, explanations, the planted self-test)."""

from __future__ import annotations

import errno
import os
import stat

import pandas as pd
import pytest

from probe.errors import StorageError
from probe.files import write_file, write_files
from probe.study.store import write_json, write_table


def _plain_mode(folder) -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask."""
    plain = folder / "plain.txt"
    with open(plain, "w") as f:
        f.write("x")
    return stat.S_IMODE(plain.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_written_file_has_the_mode_a_plain_open_gives(tmp_path, umask):
    """Not tempfile.mkstemp's 0600 (the planted self-test's and the study folder's writers left 0600)."""
    old = os.umask(umask)
    try:
        expected = _plain_mode(tmp_path)
        write_file(tmp_path / "a.txt", "text")
        write_file(tmp_path / "b.bin", b"\x00\x01")
        write_json(tmp_path / "c.json", {"a": 1})
        write_table(tmp_path / "d.parquet", pd.DataFrame({"x": [1, 2]}))
        write_files({tmp_path / "e.md": "# e\n", tmp_path / "sub" / "f.html": "<p>f</p>"})
    finally:
        os.umask(old)
    assert expected == 0o666 & ~umask
    for name in ["a.txt", "b.bin", "c.json", "d.parquet", "e.md", "sub/f.html"]:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name
    assert (tmp_path / "a.txt").read_text() == "text" and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert pd.read_parquet(tmp_path / "d.parquet").x.tolist() == [1, 2]
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_write_into_a_read_only_folder_is_one_storage_error_naming_the_path(tmp_path, monkeypatch):
    """Not a bare OSError (the planted self-test's writer raised one), and no temporary file left."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    (folder / "kept.txt").write_text("earlier")
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes into any folder: refuse as the kernel refuses everyone else
        real = os.open

        def refused(path, flags, *args, **kwargs):
            if os.path.dirname(os.fspath(path)) == str(folder) and flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refused)
    try:
        for write, named in ((lambda: write_file(folder / "new.txt", "text"), folder / "new.txt"),
                             (lambda: write_file(folder / "kept.txt", b"bytes"), folder / "kept.txt"),
                             (lambda: write_files({tmp_path / "fine.txt": "ok", folder / "kept.txt": "again"}),
                              folder / "kept.txt")):
            with pytest.raises(StorageError) as caught:
                write()
            message = str(caught.value)
            assert message.startswith(f"cannot write {named}: Permission denied; ") and "\n" not in message
    finally:
        folder.chmod(0o755)
    assert (folder / "kept.txt").read_text() == "earlier"
    assert not (tmp_path / "fine.txt").exists()  # several files: none renamed into place when one fails
    assert sorted(p.name for p in folder.iterdir()) == ["kept.txt"] and not list(tmp_path.rglob("*.tmp"))
