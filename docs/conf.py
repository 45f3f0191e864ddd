"""Sphinx configuration of probe's documentation.

Build it from the repository root (the contributing page says the same)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

``-W`` turns every warning into an error: a broken reference, a page missing from the table of
contents, an example that fails. The tutorial notebook is executed at every build; add
``-D nb_execution_mode=off`` to skip it while editing prose.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

import probe  # noqa: E402

from inventories import compiled_inventories  # noqa: E402
from results_pages import write_result_pages  # noqa: E402

# every committed report becomes a page of its own (docs/results/, generated)
write_result_pages(DOCS)
# the tutorial is examples/first_hour.ipynb, copied in (docs/tutorial/ is generated)
(DOCS / "tutorial").mkdir(exist_ok=True)
_NOTEBOOK = (ROOT / "examples" / "first_hour.ipynb").read_bytes()
if not (DOCS / "tutorial" / "first_hour.ipynb").is_file() or (DOCS / "tutorial" / "first_hour.ipynb").read_bytes() != _NOTEBOOK:
    (DOCS / "tutorial" / "first_hour.ipynb").write_bytes(_NOTEBOOK)

project = "probe"
author = "the probe developers"
copyright = "2026, the probe developers"
release = version = probe.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",
    "probe_docs",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
# reference/_generated holds the pages probe_docs writes at every build; they are included by the
# reference pages, not documents of their own
exclude_patterns = ["_build", "_draft", "_inventories", "_ext", "reference/_generated", "Thumbs.db", ".DS_Store",
                    "**.ipynb_checkpoints"]

# MyST: fenced directives with ::: as well, definition lists, anchors on headings up to ###
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The tutorial runs at every build; a failing cell fails the build.
nb_execution_mode = "force"
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# what a cell writes to stderr (library warnings, the loading bars of transformers) is the build
# machine's, with its paths: not shown
nb_output_stderr = "remove"
# the copy button leaves out the prompt and what a command prints
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True

# autodoc: signatures as written, members in source order
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"undoc-members": False}

# Every cross-reference must resolve: a name in a docstring or a signature that is neither documented
# here nor in an inventory of docs/_inventories/ is a warning (an error under -W).
nitpicky = True
# The one exception: private names of probe (a leading underscore, e.g. the ``_Contract`` protocol a
# Task's methods take) appear in signatures but are not documented, on purpose.
nitpick_ignore_regex = [(r"py:.*", r"probe\.(\w+\.)*_\w+")]

# The machines probe is built on reach no documentation site, so each project's inventory is
# compiled from a short list kept in docs/_inventories/ (name, role, address on that project's
# own site): links go to the real pages, and a name missing from the list is a broken reference.
intersphinx_mapping = {name: (url, str(path)) for name, (url, path) in compiled_inventories(DOCS).items()}
# Only links to whole documents need an explicit project prefix (Sphinx's default); "*" here would
# keep intersphinx from resolving any unprefixed name, so no signature could link torch.Tensor.
intersphinx_disabled_reftypes = ["std:doc"]

html_theme = "furo"
html_title = f"probe {release}"
html_static_path = ["_static"]
html_css_files = ["probe.css"]
