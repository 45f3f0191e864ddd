"""Study files and claim files: their schemas, the YAML reading and the one-line errors they share.

Torch-free and below every computing package, so the CLI validates a file before the slow imports
and the report reads a result folder's study as a typed :class:`Study`.

- :mod:`probe.spec.validation`: the primitives (``fail``, ``show``, ``suggest``, the YAML reader
  with duplicate-key and line-numbered errors, :func:`located_error`), for any schema.
- :mod:`probe.spec.parts`: the sections both files share (model, dataset, target).
- :mod:`probe.spec.study`: the :class:`Study` and its loader.
- :mod:`probe.spec.claim_values`: the values a claim's keys hold; the claim file itself and its
  loader are the audit's (:mod:`probe.claims.file`), since each claim kind's keys live with the kind.
"""
