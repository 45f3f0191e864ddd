"""A study's ``sinks`` table: the attention sinks of its model, found on its own examples.

Sinks (:mod:`probe.explainers.sinks`: a key whose mean received attention over the query rows
exceeds a threshold) need every query row of every layer, which the study's attention explainers do
not capture (they read the target rows only). So:

* a study that runs ``attention_nosink`` has found every example's sinks already: its ``extras``
  are the table (no second pass, every example);
* any other study pays one forward pass with full maps over its first :data:`SINK_EXAMPLES`
  dataset examples (in a step study: their output tokens), in whichever batches hold them, and
  the report says so.

The threshold is ``attention_nosink``'s (the study's ``params`` for it, else Gu et al.'s 0.3). A
stack whose maps are not softmax rows (implicit or hybrid mixers) has no sinks in this sense and no
table; neither has a stack read with downsampled keys (the report names the reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from probe.models.core import maps_are_softmax

if TYPE_CHECKING:
    import pandas as pd

    from probe.models.core import ProbeModel
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample
    from probe.spec.study import Study

__all__ = ["SINK_EXAMPLES", "sink_threshold", "study_sinks", "unmeasured_reason"]

#: dataset examples whose sinks a study finds when it does not run attention_nosink
SINK_EXAMPLES = 8
NOSINK = "attention_nosink"


def sink_threshold(study: Study) -> float:
    from probe.explainers.sinks import SINK_THRESHOLD

    return float((study.params.get(NOSINK) or {}).get("threshold", SINK_THRESHOLD))


def unmeasured_reason(maps: str | None) -> str | None:
    """Why a stack whose maps are ``maps`` (the contract's word) has no sinks table, or None."""
    if maps_are_softmax(maps):
        return None
    return (f"its maps are {maps} (a token mixer's signed matrix in some layers), not softmax rows, so no key "
            "'receives' a share of attention")


def study_sinks(pm: ProbeModel, study: Study, examples: list[PreparedExample], first_index: int, data_index: int,
                scores: dict[str, TokenScores]) -> pd.DataFrame | None:
    """The batch's part of the ``sinks`` table (:data:`probe.explainers.sinks.SINK_COLUMNS`), or
    None: ``first_index`` numbers the batch's units as its other tables do, ``data_index`` is its
    first dataset example (the same but in a step study). Imports torch (this module's other names
    do not: the report reads them)."""
    from probe.errors import CaptureError
    from probe.explainers.sinks import attention_sinks, result_rows, sink_rows
    from probe.rows.target import sources

    stack = pm.task.target_stack(pm.contract)
    if unmeasured_reason(pm.contract.stacks[stack].maps) is not None:
        return None
    nosink = scores.get(NOSINK)
    if nosink is not None and "sinks" in nosink.extras:
        return sink_rows(nosink.extras["sinks"], nosink.extras["sink_share"],
                         threshold=float(nosink.params["threshold"]), first_index=first_index)
    owners = sources(examples)
    take = sum(1 for owner in owners if data_index + owner < SINK_EXAMPLES)  # the owners come in order
    if not take:
        return None
    try:
        found = attention_sinks(pm, examples[:take], threshold=sink_threshold(study))
    except CaptureError:  # downsampled keys: the report says sinks were not measured
        return None
    return result_rows(found, first_index)
