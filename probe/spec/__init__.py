"""Study files and claim files: their schemas, the YAML reading and the one-line errors they share.

Torch-free and below every computing package, so the CLI validates a file before the slow imports
and the report reads a result folder's study as a typed :class:`Study`.

- :mod:`probe.spec.validation`: the primitives (``fail``, ``show``, ``suggest``, the YAML reader
  with duplicate-key and line-numbered errors, :func:`located_error`), for any schema.
- :mod:`probe.spec.parts`: the sections both files share (model, dataset, target).
- :mod:`probe.spec.study`: the :class:`Study` and its loader.
- :mod:`probe.spec.claims`: the claim file (:class:`ClaimFile`) and its loader.
"""

from probe.spec.claims import CLAIM_KINDS, ClaimFile, claims_from_dict, load_claims
from probe.spec.parts import DatasetSpec, Filters, ModelSpec, TargetConfig
from probe.spec.study import Study, load_study, parse_ranking, study_from_dict
from probe.spec.validation import Document, SpecModel, fail, located_error, read_yaml_mapping, show, suggest

__all__ = [
    "CLAIM_KINDS", "ClaimFile", "DatasetSpec", "Document", "Filters", "ModelSpec", "SpecModel", "Study",
    "TargetConfig", "claims_from_dict", "fail", "load_claims", "load_study", "located_error", "parse_ranking",
    "read_yaml_mapping", "show", "study_from_dict", "suggest",
]
