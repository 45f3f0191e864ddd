"""The command line's option groups, each declared once: the model options of every command that
loads a model (:data:`MODEL_OPTIONS`, handed to the command as one :class:`ModelOptions`) and the
target options of ``probe explain`` (:data:`TARGET_OPTIONS`, handed to it as one
:class:`~probe.rows.target.TargetSpec`, folded by :func:`~probe.rows.target.target_from` as the
Python API folds its keywords). :func:`with_options` adds a group to a command's signature, where
typer reads its options."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

from probe.errors import InputError
from probe.spec.target import TARGET_FIELDS
from probe.tasks import TASKS

if TYPE_CHECKING:  # torch loads inside the commands, so ``probe --help`` stays fast
    from probe.models.core import ProbeModel
    from probe.rows.target import TargetSpec

ModelArg = typer.Argument(..., help="builtin:minilm-rt, builtin:smollm2-135m, planted:NAME, a local folder, or a hub "
                                    "id")


def quiet_libraries() -> None:
    """transformers' logging and progress bars off (the command line prints its own lines)."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How a command loads its model: ``--device``, ``--dtype``, ``--attn-implementation``, ``--task``
    and ``--allow-random-weights``."""

    device: str = "cpu"
    dtype: str = "fp32"
    attn_implementation: str | None = None
    task: str | None = None
    allow_random_weights: bool = False

    def load(self, model: str) -> ProbeModel:
        """``model`` loaded with these options (:func:`probe.models.loading.load_model`)."""
        quiet_libraries()
        from probe.models.loading import load_model

        return load_model(model, device=self.device, dtype=self.dtype, attn_implementation=self.attn_implementation,
                          task=self.task, allow_random_weights=self.allow_random_weights)


#: (parameter, type, typer option) of each model option
MODEL_OPTIONS = (
    ("device", str, typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto")),
    ("dtype", str, typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16")),
    ("attn_implementation", str | None, typer.Option(None, "--attn-implementation", help="load with this attention "
                                                     "implementation (default: transformers' own, sdpa)")),
    ("task", str | None, typer.Option(None, "--task", help=f"load as {', '.join(list(TASKS)[:-1])} or "
                                      f"{list(TASKS)[-1]} (default: read from the model)")),
    ("allow_random_weights", bool, typer.Option(False, "--allow-random-weights", help="explain a model even though "
                                                "its checkpoint leaves some weights random (e.g. a missing head)")),
)

#: (parameter, type, typer option) of each target option, made from the target's table
#: (:data:`probe.spec.target.TARGET_FIELDS`: flag, type, help, place); ``target_kind`` is ``--target``
TARGET_OPTIONS = tuple(
    (f.option_param or f.name, f.option_type,
     typer.Option(False if f.option_type is bool else None, f.option, help=f.help))
    for f in sorted((f for f in TARGET_FIELDS if f.option is not None), key=lambda f: f.option_rank)
)


def target_options(*, target_kind: str | None = None, generate: int | None = None, target_side: bool = False,
                   **options: Any) -> TargetSpec:
    """The target the options name, as one :class:`~probe.rows.target.TargetSpec`."""
    from probe.rows.target import target_from

    if generate is not None and generate < 1:
        raise InputError(f"--generate {generate}: give a number of tokens to generate, 1 or more")
    if target_side and generate is None:
        raise InputError("--target-side scores the output written before each output token: add --generate N")
    return target_from(kind=target_kind, generate=generate, target_side=target_side, **options)


def with_options(name: str, group: tuple, build: Callable[..., Any], *, after: str | None = None,
                 leave_out: tuple[str, ...] = ()) -> Callable:
    """A decorator: the command with ``group``'s options in its signature (after parameter ``after``,
    else at the end; but those in ``leave_out``), called with them built into one value, its
    parameter ``name`` (``build(**options)``)."""
    def decorate(command: Callable) -> Callable:
        options = [(n, t, o) for n, t, o in group if n not in leave_out]
        own = [p for p in inspect.signature(command).parameters.values() if p.name != name]
        at = len(own) if after is None else [p.name for p in own].index(after) + 1
        added = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o, annotation=t)
                 for n, t, o in options]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            value = build(**{n: kwargs.pop(n) for n, _, _ in options})
            return command(**kwargs, **{name: value})

        # typer reads the signature, and the annotations of the command's own parameters
        wrapper.__annotations__ = {k: v for k, v in command.__annotations__.items() if k != name}
        wrapper.__signature__ = inspect.signature(command).replace(  # type: ignore[attr-defined]  # read by inspect
            parameters=own[:at] + added + own[at:])
        return wrapper

    return decorate
