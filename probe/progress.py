"""probe's progress bars, in one style wherever they appear: tqdm's notebook widget in a notebook
that has ipywidgets, else tqdm's text bar on standard error (in a notebook without ipywidgets too,
where ``tqdm.auto`` would warn "IProgress not found" first), its width following the window."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm.std import tqdm

__all__ = ["progress_bar", "quiet_notebook_import"]


def progress_bar(iterable: Iterable | None = None, **options: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (or of ``total=...`` steps), with tqdm's own ``options``."""
    options.setdefault("dynamic_ncols", True)
    if _notebook_with_widgets():
        from tqdm.notebook import tqdm as widget_bar

        return widget_bar(iterable, **options)
    from tqdm.std import tqdm as text_bar

    return text_bar(iterable, **options)


def _notebook_with_widgets() -> bool:
    """Whether this process is a Jupyter kernel that can draw ipywidgets."""
    import importlib.util
    import sys

    ipython = sys.modules.get("IPython")
    if ipython is None or importlib.util.find_spec("ipywidgets") is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def quiet_notebook_import() -> None:
    """Import tqdm's notebook module once with its "IProgress not found" warning silenced: transformers
    imports ``tqdm.auto`` as it loads, which in a notebook without ipywidgets warns with a path of
    the machine's; probe's bars are text there and say nothing of it. Later imports are cached."""
    import sys
    import warnings

    if "tqdm.autonotebook" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.autonotebook  # noqa: F401
