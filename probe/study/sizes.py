"""A study's layer and head indices checked against the model's size before the model loads.

A study file names layers and heads in several places: edge knockout's ``params.knockout.layers`` /
``heads``, the counterfactual sites (``metrics.counterfactual``), the per-head causal test
(``metrics.heads_causal``). Their syntax is checked
with the file; whether they exist depends on the model. :func:`check_sizes` reads the two counts
from the model's ``config.json`` (:func:`probe.models.loading.config_sizes`: a built model or a local
folder, nothing loaded or downloaded) and refuses an index the model lacks in one line naming the
file, the line and the key, before the model loads. Where the config cannot tell (a hub id, an
encoder-decoder) the same functions check the loaded model's contract as the run reaches them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import InputError

if TYPE_CHECKING:
    from probe.spec.study import CounterfactualSpec, HeadsCausalSpec, Study


def _layer_indices(layers, n_layers: int) -> list:
    """A study part's ``layers`` (all, or indices, first and last) as indices of ``n_layers`` layers."""
    return list(range(n_layers)) if layers == "all" else [{"first": 0, "last": n_layers - 1}.get(layer, layer)
                                                          for layer in layers]


def counterfactual_sites(spec: CounterfactualSpec, n_layers: int, n_heads: int) -> list[tuple[int, int | None]]:
    """The (layer, head) sites ``metrics.counterfactual`` replaces attention at (head None: the whole
    layer), in a stack of ``n_layers`` layers and ``n_heads`` query heads; one line for one it lacks."""
    sites: list[tuple[int, int | None]] = []
    for layer in _layer_indices(spec.layers, n_layers):
        if not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise InputError(f"counterfactual layer {layer!r} does not exist: the model has layers 0..{n_layers - 1}")
        if spec.heads == "layer":
            sites.append((layer, None))
            continue
        for head in range(n_heads) if spec.heads == "all" else spec.heads:
            if not 0 <= head < n_heads:
                raise InputError(f"counterfactual head {head} does not exist: the model has heads 0..{n_heads - 1}")
            sites.append((layer, head))
    return sites


def heads_causal_window(spec: HeadsCausalSpec, n_layers: int, n_heads: int) -> tuple[list[int], list[int]]:
    """The layers and query heads the per-head causal test (``metrics.heads_causal``) covers;
    one line naming one the model lacks."""
    layers = _layer_indices(spec.layers, n_layers)
    for layer in layers:
        if not 0 <= layer < n_layers:
            raise InputError(f"metrics.heads_causal: layer {layer} does not exist: the model has layers "
                             f"0..{n_layers - 1} (or first, last, all)")
    heads = list(range(n_heads)) if spec.heads == "all" else list(spec.heads)
    for head in heads:
        if not 0 <= head < n_heads:
            raise InputError(f"metrics.heads_causal: head {head} does not exist: the model has query heads "
                             f"0..{n_heads - 1} (or all)")
    return sorted(set(layers)), sorted(set(heads))


def _checks(study: Study, n_layers: int, n_heads: int) -> list[tuple[tuple[str, ...], object]]:
    """(key path in the study file, a check that raises for an index the model lacks), in file order."""
    from probe.intervene.knockout import knockout_window
    from probe.study.plan import methods_needed

    # each check asks about its own key alone (the other dimension at its widest), so the key blamed is
    # the one whose index the model lacks
    checks: list[tuple[tuple[str, ...], object]] = []
    knockout = study.params.get("knockout", {})
    if "knockout" in methods_needed(study):
        if "layers" in knockout:
            checks.append((("params", "knockout", "layers"),
                           lambda: knockout_window(knockout["layers"], None, n_layers, n_heads)))
        if "heads" in knockout:
            checks.append((("params", "knockout", "heads"),
                           lambda: knockout_window(None, knockout["heads"], n_layers, n_heads)))
    for section, check, whole in (("counterfactual", counterfactual_sites, "layer"),
                                  ("heads_causal", heads_causal_window, "all")):
        spec = getattr(study.metrics, section)
        if spec is not None:
            checks.append((("metrics", section, "layers"),
                           lambda spec=spec, check=check, whole=whole:
                           check(spec.model_copy(update={"heads": whole}), n_layers, n_heads)))
            checks.append((("metrics", section, "heads"),
                           lambda spec=spec, check=check: check(spec.model_copy(update={"layers": "all"}),
                                                                n_layers, n_heads)))
    return checks


def check_sizes(study: Study, file: str | Path | None = None) -> None:
    """Refuse, before the model loads, a layer or head index of ``study`` that its model lacks, where
    the model's config gives its size (:func:`probe.models.loading.config_sizes`); ``file``: the study
    file, named with the line of the key. Nothing where the config cannot tell."""
    from probe.models.loading import config_sizes

    sizes = config_sizes(study.model.id)
    if sizes is None:
        return
    for keys, check in _checks(study, *sizes):
        try:
            check()
        except InputError as exc:
            message = str(exc).removeprefix("metrics.heads_causal: ")
            raise InputError(f"{_where(file, keys)}: {'.'.join(keys)}: {message} (layers and heads of "
                             f"{study.model.id}, read from its config)") from None


def _where(file: str | Path | None, keys: tuple[str, ...]) -> str:
    """``FILE line N`` for the key path (as far as the file has it), ``FILE``, or ``the study``."""
    if file is None:
        return "the study"
    from probe.spec.validation import line_of, read_yaml_mapping

    try:
        _, root = read_yaml_mapping(Path(file), "study file", "study", "", "")
    except InputError:
        return str(file)
    line = line_of(root, keys)
    return f"{file} line {line}" if line is not None else str(file)


__all__ = ["check_sizes", "counterfactual_sites", "heads_causal_window"]
