"""``python -m probe.cli ...``: the command line, as ``probe`` and ``python -m probe`` run it."""

from probe.cli import main

main()
