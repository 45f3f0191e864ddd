"""Sphinx inventories (objects.inv) compiled from docs/_inventories/*.txt.

Each text file is one project: its first line ``# base-url: https://...``, then one object per
line, ``name domain:role relative/address.html#anchor``. The compiled inventories are written to
docs/_build/inventories/ and handed to intersphinx, so the build needs no network.
"""

from __future__ import annotations

import zlib
from pathlib import Path


def compiled_inventories(docs: Path) -> dict[str, tuple[str, Path]]:
    """``{project: (base_url, path of its compiled objects.inv)}`` for every list in _inventories."""
    out = docs / "_build" / "inventories"
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for source in sorted((docs / "_inventories").glob("*.txt")):
        lines = source.read_text(encoding="utf-8").splitlines()
        if not lines or not lines[0].startswith("# base-url:"):
            raise ValueError(f"{source}: the first line must be '# base-url: URL'")
        base = lines[0].split(":", 1)[1].strip()
        entries = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 3 or ":" not in parts[1]:
                raise ValueError(f"{source}:{number}: expected 'name domain:role address', got {line!r}")
            name, role, address = parts
            entries.append(f"{name} {role} 1 {address} -")
        header = (f"# Sphinx inventory version 2\n# Project: {source.stem}\n# Version: \n"
                  "# The remainder of this file is compressed using zlib.\n").encode()
        target = out / f"{source.stem}.inv"
        target.write_bytes(header + zlib.compress(("\n".join(entries) + "\n").encode()))
        found[source.stem] = (base, target)
    return found
