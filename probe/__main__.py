"""``python -m probe ...``: the same as the ``probe`` command (and what torchrun starts with ``-m probe``)."""

from probe.cli import main

main()
