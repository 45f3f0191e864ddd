"""The first-hour notebook (examples/first_hour.ipynb) runs top to bottom in a real kernel, headless,
and shows what a researcher looks at: the explanation as a shaded table, figures, the verdict."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "first_hour.ipynb"


def test_the_notebook_is_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_the_first_hour_notebook_runs_and_displays(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env_before = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"
    try:
        nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = env_before
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert any("gripping" in h and "background" in h for h in html), "the explanation shows as a shaded table"
    assert any("undecidable" in h or "yes" in h or "no" in h for h in html), "the verdict shows itself"
    assert len(pngs) >= 2, "the token-score figure and the attention map"
    text = [o["data"]["text/plain"] for o in outputs if "text/plain" in o.get("data", {})]
    assert any(t.startswith("<ProbeModel builtin:minilm-rt") for t in text)
