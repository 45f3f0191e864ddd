"""Re-initialising a model's weights for the randomisation checks (:mod:`probe.study.randomisation`):
which parameters a step re-initialises (the output head first, then the layers from the top) and the
fresh values they hold within a block (matrices N(0, init std), biases 0, norm scales 1; the trained
values come back after it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

#: module names of output heads (classifiers, scorers, poolers, LM heads), randomised first
HEAD_NAMES = ("classifier", "score", "pooler", "lm_head", "qa_outputs", "pre_classifier", "classification_head")


def layer_stack(model: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList | None:
    """The model's list of ``n_layers`` transformer layers (the first ``ModuleList`` of that length)."""
    return next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)


def head_parameters(model: torch.nn.Module, layers: torch.nn.ModuleList) -> list[tuple[str, torch.nn.Parameter]]:
    """The output head's parameters (:data:`HEAD_NAMES` modules outside the layer stack), less any
    shared with the input embeddings (a tied LM head: randomising it would change the input too)."""
    inside = {id(p) for p in layers.parameters()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    found: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in HEAD_NAMES:
            for pname, param in module.named_parameters():
                if id(param) not in inside and id(param) not in tied:
                    found.setdefault(id(param), (f"{name}.{pname}", param))
    return list(found.values())


@contextlib.contextmanager
def randomised(params: Sequence[tuple[str, torch.nn.Parameter]], *, seed: int, std: float) -> Iterator[None]:
    """Within the block ``params`` have fresh random values (matrices ~ N(0, std), biases 0, norm
    scales 1), drawn with ``seed``; the trained values come back in ``finally``."""
    saved = []
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for name, param in params:
                saved.append((param, param.detach().clone()))
                if param.ndim >= 2 and param.dtype == torch.float32 and param.device.type == "cpu" \
                        and param.numel() >= 16:  # in place, one pass: randn(...) * std's numbers (torch's
                    param.normal_(0.0, std, generator=generator)  # vectorised kernel; below 16 it rounds otherwise)
                elif param.ndim >= 2:
                    param.copy_((torch.randn(param.shape, generator=generator) * std).to(param.dtype))
                else:
                    param.fill_(0.0 if name.endswith("bias") else 1.0)
        yield
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)


@contextlib.contextmanager
def randomised_top(model: torch.nn.Module, layers: torch.nn.ModuleList, count: int, *, seed: int, std: float,
                   head: bool = False) -> Iterator[list[torch.nn.Parameter]]:
    """Within the block the top ``count`` layers (and with ``head`` the output head first) have
    fresh random weights (:func:`randomised`); the block is given the parameters re-initialised."""
    params = head_parameters(model, layers) if head else []
    for index in range(len(layers) - count, len(layers)):
        params += [(name, param) for name, param in layers[index].named_parameters()]
    with randomised(params, seed=seed, std=std):
        yield [param for _, param in params]


def cascade_steps(model: torch.nn.Module, layers: torch.nn.ModuleList, fractions: Sequence[float]) -> list[int]:
    """The cascade's steps as numbers of top layers re-initialised (each with the output head, where
    the model has one): each fraction's count of layers, and where that is more than one stage (a
    curve), first 0, the output head alone. One fraction is the judged stage alone: the check's
    answer is read there, and the other stages only draw the curve (about a third of the check's
    models each, the head alone the dearest for integrated gradients: the trained layers under a
    random head need more points)."""
    counts = sorted({max(1, min(len(layers), round(fraction * len(layers)))) for fraction in fractions})
    return ([0] if len(counts) > 1 and head_parameters(model, layers) else []) + counts
