"""probe: audit whether a transformer's attention weights explain its predictions.

From Python (every name loads on first use, so ``import probe`` does not import torch)::

    import probe
    pm = probe.load_model("builtin:minilm-rt")          # or probe.wrap(model, tokenizer)
    ex = probe.explain(pm, ["a gripping film"], methods="attention_mean,loo_delete")
    ex.to_pandas()

The functions live in :mod:`probe.api` (plain functions: ``help(probe.explain)`` shows their
parameters); every other name here is imported from the module that defines it.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The one list of the top-level names: what a type checker sees (``X as X``: re-exported, imported from
# the module that defines it); at run time ``_EXPORTS`` (name -> that module) is read from this block and
# each name loads on first use.
if TYPE_CHECKING:
    from probe import api as api
    from probe import registry as registry
    from probe import spec as spec
    from probe.api import audit as audit
    from probe.api import capture as capture
    from probe.api import counterfactual_attention as counterfactual_attention
    from probe.api import erasure as erasure
    from probe.api import explain as explain
    from probe.api import find_spans as find_spans
    from probe.api import head_ablation as head_ablation
    from probe.api import head_importance as head_importance
    from probe.api import load_claims as load_claims
    from probe.api import load_model as load_model
    from probe.api import load_results as load_results
    from probe.api import load_study as load_study
    from probe.api import loo as loo
    from probe.api import prepare as prepare
    from probe.api import run_study as run_study
    from probe.api import span_loo as span_loo
    from probe.api import study_from_dict as study_from_dict
    from probe.api import wrap as wrap
    from probe.errors import InputError as InputError
    from probe.errors import ProbeError as ProbeError
    from probe.explanation import Explanation as Explanation
    from probe.explanation import load_explanation as load_explanation
    from probe.models.core import AttentionContract as AttentionContract
    from probe.models.core import ProbeModel as ProbeModel
    from probe.report.build import build_comparison as build_comparison
    from probe.report.build import build_report as build_report
    from probe.report.results import StudyResult as StudyResult
    from probe.rows.scores import TokenScores as TokenScores
    from probe.rows.target import PreparedExample as PreparedExample
    from probe.rows.target import TargetSpec as TargetSpec
    from probe.study.verdict import Verdict as Verdict


def _exports() -> dict[str, str]:
    """name -> the module that defines it, read from the ``if TYPE_CHECKING:`` block above."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    # every line of the block is ``from <module> import <name> as <name>``: asname and module are set
    return {a.asname or a.name: f"probe.{a.name}" if n.module == "probe" else n.module or ""
            for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


_EXPORTS = _exports()

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'probe' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(module_name)
    value = module if module_name == f"probe.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
