"""The row layer: prepared examples and their targets (:mod:`.target`), token scores
(:mod:`.scores`), where the target query is (:mod:`.queries`) and out-of-memory halving
(:mod:`.memory`). Below :mod:`probe.explainers` and :mod:`probe.intervene`, which both use it."""
