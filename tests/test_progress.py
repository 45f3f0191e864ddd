"""probe's progress bars: one kind everywhere, and no "IProgress not found" warning in a notebook
without ipywidgets (where transformers' own import of ``tqdm.auto`` would print one)."""

from __future__ import annotations

import io
import sys
import types
import warnings

from probe.progress import progress_bar, quiet_notebook_import


def test_outside_a_notebook_the_bar_is_tqdm_text_following_the_window():
    from tqdm.std import tqdm

    out = io.StringIO()
    with progress_bar(total=3, desc="steps", file=out) as bar:
        bar.update(3)
    assert type(bar) is tqdm and bar.dynamic_ncols
    assert "steps: 100%" in out.getvalue() and "\x1b[" not in out.getvalue()  # no cursor escapes


def _a_notebook_without_widgets(monkeypatch) -> None:
    """What tqdm.autonotebook sees in a Jupyter kernel where ipywidgets is not installed."""
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails
    for name in ("tqdm.autonotebook", "tqdm.notebook", "tqdm.auto"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_notebook_without_ipywidgets_gets_no_iprogress_warning(monkeypatch):
    _a_notebook_without_widgets(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import tqdm.autonotebook  # noqa: F401  (what transformers' import does, unguarded)
    assert any("IProgress not found" in str(w.message) for w in caught)  # the warning the user saw

    _a_notebook_without_widgets(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_notebook_import()
        import tqdm.auto  # noqa: F401  (transformers' import, after probe.load_model's)
    assert not [w for w in caught if "IProgress" in str(w.message)]
    from tqdm.std import tqdm

    assert type(progress_bar(total=1, disable=True)) is tqdm  # no widgets: the text bar
