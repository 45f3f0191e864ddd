"""The row layer: targets and prepared examples (:mod:`.target`), texts prepared into them
(:mod:`.prepare`), rows built into a model batch (:mod:`.forward`) and their target values
(:mod:`.values`), token scores (:mod:`.scores`), where the target query is (:mod:`.queries`) and
out-of-memory halving (:mod:`.memory`). Below :mod:`probe.explainers` and :mod:`probe.intervene`,
which both use it."""
