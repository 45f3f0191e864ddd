"""A claim file: a model, some data, and claims about the model's attention to test by intervention.

Kept as an import path: the schema and the loader live in :mod:`probe.spec.claims` (torch-free,
sharing the study file's validation helpers); the decision rules are in :mod:`probe.audit.rules`.
"""

from probe.spec.claims import (
    CLAIM_CLASSES, CLAIM_KINDS, INTERVENTIONS, PER_HEAD_METHODS, AttentionRanking, AuditStatistics, Claim,
    ClaimFile, CounterfactualClaim, DataSpec, FaithfulnessClaim, HeadRoleClaim, SpecificTokensClaim,
    TokenImportanceClaim, claims_from_dict, load_claims, parse_attention, parse_head,
)

__all__ = [
    "AttentionRanking", "AuditStatistics", "CLAIM_CLASSES", "CLAIM_KINDS", "Claim", "ClaimFile", "CounterfactualClaim",
    "DataSpec", "FaithfulnessClaim", "HeadRoleClaim", "INTERVENTIONS", "PER_HEAD_METHODS", "SpecificTokensClaim",
    "TokenImportanceClaim", "claims_from_dict", "load_claims", "parse_attention", "parse_head",
]
