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

# name -> module that defines it
_EXPORTS = {
    "load_model": "probe.api", "wrap": "probe.api", "prepare": "probe.api", "loo": "probe.api",
    "span_loo": "probe.api", "find_spans": "probe.api",
    "erasure": "probe.api", "head_ablation": "probe.api", "head_importance": "probe.api",
    "counterfactual_attention": "probe.api", "load_study": "probe.api", "study_from_dict": "probe.api",
    "run_study": "probe.api", "load_results": "probe.api", "load_claims": "probe.api",
    "build_report": "probe.report.build", "build_comparison": "probe.report.build",
    "load_explanation": "probe.explanation",
    "Explanation": "probe.explanation", "StudyResult": "probe.report.results",
    "explain": "probe.api", "capture": "probe.api", "audit": "probe.api", "api": "probe.api",
    "registry": "probe.registry", "spec": "probe.spec",
    "ProbeModel": "probe.models.core", "TokenScores": "probe.rows.scores",
    "PreparedExample": "probe.rows.target", "TargetSpec": "probe.rows.target",
    "AttentionContract": "probe.models.core", "Verdict": "probe.study.verdict",
    "ProbeError": "probe.errors", "InputError": "probe.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # what a type checker sees (``X as X``: re-exported); at run time each name loads on first use
    from probe import (
        api as api,
    )
    from probe import (
        registry as registry,
    )
    from probe import (
        spec as spec,
    )
    from probe.api import (
        audit as audit,
    )
    from probe.api import (
        capture as capture,
    )
    from probe.api import (
        counterfactual_attention as counterfactual_attention,
    )
    from probe.api import (
        erasure as erasure,
    )
    from probe.api import (
        explain as explain,
    )
    from probe.api import (
        find_spans as find_spans,
    )
    from probe.api import (
        head_ablation as head_ablation,
    )
    from probe.api import (
        head_importance as head_importance,
    )
    from probe.api import (
        load_claims as load_claims,
    )
    from probe.api import (
        load_model as load_model,
    )
    from probe.api import (
        load_results as load_results,
    )
    from probe.api import (
        load_study as load_study,
    )
    from probe.api import (
        loo as loo,
    )
    from probe.api import (
        prepare as prepare,
    )
    from probe.api import (
        run_study as run_study,
    )
    from probe.api import (
        span_loo as span_loo,
    )
    from probe.api import (
        study_from_dict as study_from_dict,
    )
    from probe.api import (
        wrap as wrap,
    )
    from probe.errors import (
        InputError as InputError,
    )
    from probe.errors import (
        ProbeError as ProbeError,
    )
    from probe.explanation import (
        Explanation as Explanation,
    )
    from probe.explanation import (
        load_explanation as load_explanation,
    )
    from probe.models.core import (
        AttentionContract as AttentionContract,
    )
    from probe.models.core import (
        ProbeModel as ProbeModel,
    )
    from probe.report.build import (
        build_comparison as build_comparison,
    )
    from probe.report.build import (
        build_report as build_report,
    )
    from probe.report.results import (
        StudyResult as StudyResult,
    )
    from probe.rows.scores import (
        TokenScores as TokenScores,
    )
    from probe.rows.target import (
        PreparedExample as PreparedExample,
    )
    from probe.rows.target import (
        TargetSpec as TargetSpec,
    )
    from probe.study.verdict import (
        Verdict as Verdict,
    )


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
