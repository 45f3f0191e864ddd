"""Loading models (HF id, folder, builtin:NAME) and describing their attention."""

from probe.models.contract import AttentionContract, StackContract, build_contract
from probe.models.loading import ProbeModel, load_model

__all__ = ["AttentionContract", "ProbeModel", "StackContract", "build_contract", "load_model"]
