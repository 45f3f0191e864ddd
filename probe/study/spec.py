"""A study file, validated into a frozen :class:`Study`: kept as an import path; the schema and the
loader live in :mod:`probe.spec.study` (torch-free, shared with claim files)."""

from probe.spec.parts import DatasetSpec, Filters, ModelSpec, TargetConfig
from probe.spec.study import (
    CounterfactualSpec, EngineSpec, ErasureSpec, HeadsSpec, MetricsSpec, PublishedNumber, SanitySpec,
    StatisticsSpec, Study, load_study, parse_ranking, study_from_dict,
)
from probe.spec.validation import check_dataset_name, read_yaml_mapping

__all__ = [
    "CounterfactualSpec", "DatasetSpec", "EngineSpec", "ErasureSpec", "Filters", "HeadsSpec", "MetricsSpec",
    "ModelSpec", "PublishedNumber", "SanitySpec", "StatisticsSpec", "Study", "TargetConfig", "check_dataset_name",
    "load_study", "parse_ranking", "read_yaml_mapping", "study_from_dict",
]
