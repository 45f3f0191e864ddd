"""Loading models (HF id, folder, builtin:NAME) and describing their attention."""
