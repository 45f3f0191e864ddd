"""What the built-in recipes that train share: seeding and a progress bar."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str, total: int) -> Iterator[Callable[[str], None]]:
    if not enabled:
        def skip(status: str = "") -> None:
            return None

        yield skip
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )
    from rich.console import Console

    # standard error: a built-in built on first use must not write into a command's JSON on stdout
    with Progress(*columns, transient=False, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total, status="")

        def advance(status: str = "") -> None:
            bar.update(task, advance=1, status=status)

        yield advance

