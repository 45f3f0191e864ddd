"""Read and write attention per layer and head through the attention-function registry.

:mod:`.capture` holds the hooks (``capture_attention``, ``Capture``, ``EditContext``),
:mod:`.attention_functions` the attention functions they wrap (probe's wrapper in transformers'
registry), :mod:`.math` the recomputations they check against. The public
entry is :func:`probe.api.capture` (``with probe.capture(pm, ...) as cap:``).
"""
