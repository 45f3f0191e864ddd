"""probe from Python: the functions and types ``import probe`` exports.

Thin, typed wrappers over the modules that do the work, so a notebook needs one import::

    pm = probe.load_model("builtin:minilm-rt")          # or probe.wrap(model, tokenizer)
    ex = probe.explain(pm, ["a gripping film"], methods=["attention_mean", "loo_delete"])
    ex.to_pandas()                                       # example, position, token, method, layer, head, score

Every function takes texts (a string or a list of strings, prepared here with the target options)
or examples already prepared by :func:`prepare`, so several calls can explain the same targets.
Shapes: a :class:`TokenScores` holds per example ``[tokens]`` (token-level methods),
``[layer, head, tokens]`` (per-head methods) or ``[layer, tokens]`` (per-layer methods).

This module imports torch; ``import probe`` does not (its names load on first use).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import pandas as pd
import torch

from probe import registry
from probe.errors import InputError
from probe.frozen import PicklableFrozen
from probe.models.core import ProbeModel
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, TargetSpec

if TYPE_CHECKING:
    from transformers import Pipeline, PreTrainedModel, PreTrainedTokenizerBase

    from probe.claims.run import AuditResult
    from probe.hooks.capture import Capture
    from probe.hooks.types import Editor
    from probe.intervene.counterfactual import CounterfactualResult
    from probe.intervene.heads import HeadEffects, HeadImportance
    from probe.report.results import StudyResult
    from probe.spec.claims import ClaimFile
    from probe.spec.study import Study

# a text, texts, examples from prepare(), or an Explanation (its examples: the same targets again)
Texts = Union[str, Sequence[str], Sequence[PreparedExample], "Explanation", pd.Series, pd.DataFrame]
# a class index or name
Label = int | str
COUNTERFACTUALS = tuple(c.name for c in registry.COUNTERFACTUALS)

# --------------------------------------------------------------------------------------- checks of arguments


def _model(pm: Any, argument: str = "pm") -> ProbeModel:
    """``pm`` as a :class:`ProbeModel`, or a one-line error naming the argument and the fix."""
    if isinstance(pm, ProbeModel):
        return pm
    if isinstance(pm, (str, Path)):
        raise InputError(f"{argument} is the name {str(pm)!r}, not a loaded model: load it first, "
                         f"pm = probe.load_model({str(pm)!r})")
    if _is_pipeline(pm):
        raise InputError(f"{argument} is a transformers pipeline, not a ProbeModel: wrap it first, "
                         f"pm = probe.wrap(pipeline)")
    if isinstance(pm, torch.nn.Module):
        raise InputError(f"{argument} is a {type(pm).__name__} (a model in memory), not a ProbeModel: wrap it with "
                         f"its tokenizer first, pm = probe.wrap(model, tokenizer)")
    raise InputError(f"{argument} must be a ProbeModel from probe.load_model or probe.wrap, got {type(pm).__name__}")


def _is_pipeline(value: Any) -> bool:
    """Whether ``value`` is a transformers Pipeline (checked only where transformers is imported already)."""
    pipelines = sys.modules.get("transformers.pipelines.base")
    return pipelines is not None and isinstance(value, pipelines.Pipeline)


def _no_gradients_here(methods: Sequence[str], doing: str = "probe.explain") -> None:
    """Refuse, in one line, methods that need gradients under ``torch.inference_mode()``."""
    from probe.methods import refuse_gradients_under_inference_mode

    refuse_gradients_under_inference_mode(methods, doing)


def _positive(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{argument}={value!r} is not a positive whole number; give e.g. {argument}=8")
    return value


def _flag(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{argument}={value!r}: give True or False")
    return value


def _method_names(methods: Any) -> list[str] | None:
    """``methods`` validated; None for every method that applies (None or ``"all"``)."""
    from probe.methods import parse_methods

    if methods is None:
        return None
    if isinstance(methods, str):
        if methods.strip() == "all":
            return None
        return parse_methods(methods)
    if not isinstance(methods, Sequence) or not all(isinstance(m, str) for m in methods):
        raise InputError(f"methods={methods!r} is not a method name, 'a,b', 'all' or a list of names "
                         f"(valid: {', '.join(registry.names())})")
    if [m.strip() for m in methods] == ["all"]:
        return None
    return parse_methods(list(methods))


def _method_params(params: Any) -> dict[str, dict[str, Any]]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InputError(f"params={params!r} is not a mapping of method to parameters; write e.g. "
                         "params={'integrated_gradients': {'steps': 32}}")
    out = {}
    for method, values in params.items():
        if registry.find(method) is None:
            raise InputError(f"params: unknown method {method!r} (valid: {', '.join(registry.names())})")
        problem = registry.params_problem(method, dict(values) if isinstance(values, Mapping) else values)
        if problem is not None:
            raise InputError(f"params[{method!r}]: {problem[1]}")
        out[method] = dict(values)
    return out


def _unknown_keywords(options: Mapping[str, Any], accepted: Sequence[str], doing: str) -> None:
    """Refuse, in one line, keyword arguments ``doing`` does not take, naming the first and the accepted ones."""
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise InputError(f"{doing} got an unknown keyword {unknown[0]!r}; it accepts: {', '.join(accepted)}")


def _arguments_checked(function):
    """``function`` with its arguments bound before it runs: an unknown keyword, a missing argument or
    too many positional ones is one :class:`InputError` line (naming the accepted keywords), not
    Python's TypeError. Keywords a function passes on (``**options``) it checks itself."""
    import functools
    import inspect

    signature = inspect.signature(function)
    parameters = signature.parameters
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = [n for n, p in parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    doing = f"probe.{function.__name__}()"

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not passes_on:
            _unknown_keywords(kwargs, accepted, doing)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise InputError(f"{doing}: {err}; its parameters: {', '.join(accepted)}") from None
        return function(*args, **kwargs)

    return wrapper


def _in_eval(function):
    """Run an API function with its model in eval mode (dropout off for every pass, the targets'
    included); the model's mode is restored afterwards."""
    import functools

    @functools.wraps(function)
    def wrapper(pm, *args, **kwargs):
        from probe.rows.queries import eval_mode

        pm = _model(pm)
        with eval_mode(pm.model):
            return function(pm, *args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------- models


def load_model(name: str, *, device: str | None = "cpu", dtype: str | None = "fp32",
               attn_implementation: str | None = None, task: str | None = None,
               cache_dir: str | Path | None = None, **options: Any) -> ProbeModel:
    """Load ``builtin:NAME``, a local folder saved with ``save_pretrained``, or a hub id, in eval mode.

    ``device``: cpu, cuda, cuda:N or auto; ``dtype``: fp32, bf16 or fp16; ``task``: classification,
    causal_lm or seq2seq (default: read from the config). Other keyword ``options`` go to
    ``probe.models.loading.load_model``.
    """
    import inspect

    from probe.models.loading import load_model as _load
    from probe.models.loading import not_a_model_name

    own = [p for p in inspect.signature(load_model).parameters if p != "options"]
    _unknown_keywords(options, [*own, *(p for p in inspect.signature(_load).parameters if p not in own)],
                      "probe.load_model()")
    if not isinstance(name, (str, Path)):
        raise InputError(not_a_model_name(name))
    return _load(str(name), device=device, dtype=dtype, attn_implementation=attn_implementation, task=task,
                 cache_dir=cache_dir, **options)


def wrap(model: PreTrainedModel | Pipeline, tokenizer: PreTrainedTokenizerBase | None = None, *,
         name: str | None = None, task: str | None = None) -> ProbeModel:
    """A :class:`ProbeModel` for a Hugging Face model and tokenizer already in memory, with the
    same contract :func:`load_model` builds; or for a transformers ``Pipeline`` (its ``model`` and
    ``tokenizer``; then no ``tokenizer``). The model is switched to eval mode; the tokenizer is
    copied (right padding, a pad token). A pair that does not fit (a tokenizer larger than the
    model's embedding, a model without a head or without attention) is refused in one line."""
    from probe.models.loading import wrap_model

    if _is_pipeline(model):
        if tokenizer is not None:
            raise InputError("a pipeline brings its own tokenizer: call probe.wrap(pipeline) without one")
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"this {type(model).__name__} has no tokenizer: use probe.wrap(model, tokenizer)")
        model, tokenizer = model.model, model.tokenizer
    elif tokenizer is None:
        raise InputError(f"probe.wrap needs the model's tokenizer: probe.wrap(model, tokenizer) (got the "
                         f"{type(model).__name__} alone)")
    return wrap_model(model, tokenizer, name=name, task=task)


# --------------------------------------------------------------------------------------- targets


@_in_eval
def prepare(pm: ProbeModel, texts: str | Sequence[str], *, label: Label | Sequence[Label] | None = None,
            continuation: str | Sequence[str] | None = None, kind: str | None = None,
            strict_length: bool = False, generate: int | None = None,
            steps: bool = False, chat: bool = False, contrast: str | Sequence[str] | None = None,
            contrast_label: Label | Sequence[Label] | None = None, target_side: bool = False) -> list[PreparedExample]:
    """Tokenise ``texts`` and resolve each target: the predicted class (or ``label``) of a
    classifier, the greedy next token (or ``continuation``) of a causal LM, the greedy output of a
    seq2seq model; ``kind`` is prob, logit or logprob (default prob for classifiers, logprob for
    language models). ``example.original_value`` is the target on the unperturbed text.

    ``contrast_label`` (classifiers) explains ``logit[label] - logit[contrast_label]``; ``contrast``
    (language models) a foil text: the log-prob of the continuation minus that of the foil's tokens
    at the same positions ("why this rather than that"; see :class:`~probe.rows.target.TargetSpec`).

    ``label``, ``continuation`` and the contrasts are one value for every text, or a list with one per
    text. ``texts`` may be a pandas Series (its values) or a DataFrame with a ``text`` column.

    A language model's output token by token: ``generate=N`` explains each token of its greedy
    output of up to N tokens, ``steps=True`` each token of ``continuation`` (or of the greedy
    output of 16). Every output token is then its own example (``example.step``; text 0's steps
    first), whose target is that token's log-prob given the input and the output before it.
    ``target_side=True`` (causal LMs, with ``generate`` or ``steps``): the output before each token
    is scored too, as part of that token's input (``example.written``: the token's index in the
    output), so the matrices run over the prompt and the output written so far.

    ``chat=True`` (chat models): each text is the user's message in the tokenizer's chat template,
    the assistant's turn opened; the template's tokens stay in the input, marked special (never
    scored or perturbed), and ``example.text`` is the laid-out prompt. A text may instead be a
    conversation, a list of ``{"role": ..., "content": ...}`` messages (one conversation alone, or a
    list of them): every message's content is scored, and ``spans="@roles"`` reads each message as
    one span named by its role (``example.messages`` says where they lie). A message is always read
    as plain text: a control token's text in it (``<|im_end|>``) is spelled by ordinary tokens and
    scored, never a turn of its own (a tokenizer that cannot spell it refuses it in one line)."""
    from probe.rows.target import prepare as _prepare

    texts = _text_list(texts, chat=chat)
    if generate is not None:
        _positive(generate, "generate")
    target = TargetSpec(kind=kind, label=_one_or_each(label), continuation=_one_or_each(continuation),
                        steps=_flag(steps, "steps") or generate is not None, max_new_tokens=generate,
                        chat=_flag(chat, "chat"), contrast=_one_or_each(contrast),
                        contrast_label=_one_or_each(contrast_label), target_side=_flag(target_side, "target_side"))
    if target.target_side and not target.steps:
        raise InputError("target_side=True scores the output written before each output token: give generate=N "
                         "(or steps=True with a continuation)")
    return _prepare(pm, texts, target, strict_length=strict_length)


def _one_or_each(value: Any) -> Any:
    """A list of per-text targets as a tuple (a TargetSpec is frozen); one value as it is."""
    if isinstance(value, (list, tuple, np.ndarray, pd.Series, pd.Index)):
        return tuple(value.tolist() if hasattr(value, "tolist") else value)
    return value


def _text_list(texts: Any, *, chat: bool = False) -> list:
    """``texts`` as a non-empty list; with ``chat``, a list of messages is one conversation."""
    if texts is None:
        raise InputError("texts is None: give a string or a non-empty list of strings")
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, pd.DataFrame):
        # iterating a DataFrame gives its column names, never its rows
        if "text" not in texts.columns:
            columns = ", ".join(repr(c) for c in texts.columns) or "none"
            raise InputError(f"texts is a DataFrame without a 'text' column (its columns: {columns}): pass the "
                             "column of texts, e.g. texts=df['review']")
        texts = texts["text"]
    if isinstance(texts, pd.Series):
        texts = texts.tolist()
    from collections.abc import Iterable

    if not isinstance(texts, Iterable) or isinstance(texts, (bytes, bytearray, Mapping)):
        raise InputError(f"texts={texts!r} is not a string or a list of strings; write e.g. texts=['a gripping film']")
    items = list(texts)
    if not items:
        raise InputError("no text given: give a string or a non-empty list of strings")
    if chat and isinstance(items[0], Mapping):  # one conversation: a list of messages
        return [items]
    return items


def _check_prepared_by(pm: ProbeModel, examples: list[PreparedExample]) -> None:
    """Refuse examples that another model's tokenizer prepared: their ids and tokens must be this one's."""
    rows = getattr(pm.model.get_input_embeddings(), "num_embeddings", None)
    for i, e in enumerate(examples):
        too_big = isinstance(rows, int) and any(t >= rows for t in e.input_ids)
        if too_big or list(pm.tokenizer.convert_ids_to_tokens(list(e.input_ids))) != list(e.tokens):
            raise InputError(f"example #{i} was prepared by another model's tokenizer (its token ids are not "
                             f"{pm.name}'s): prepare the texts with probe.prepare(pm, texts) for this model")


def _examples(pm: ProbeModel, texts: Texts, *, label: int | str | None = None, continuation: str | None = None,
              kind: str | None = None, strict_length: bool = False, generate: int | None = None,
              steps: bool = False, chat: bool = False, contrast: str | None = None,
              contrast_label: int | str | None = None, target_side: bool = False) -> list[PreparedExample]:
    """Texts prepared with the target options, or prepared examples as they are (then no options)."""
    if isinstance(texts, Explanation):
        texts = texts.examples
    items = _text_list(texts, chat=chat)
    if all(isinstance(e, PreparedExample) for e in items):
        if any(v is not None for v in (label, continuation, kind, contrast, contrast_label, generate)) or steps or chat \
                or target_side:
            raise InputError("label, continuation, kind, the contrasts, generate, steps and chat apply to texts; these "
                             "examples are prepared already (their targets are fixed): pass the texts instead")
        _check_prepared_by(pm, items)
        return items
    conversation = chat and all(isinstance(e, (str, list, tuple)) for e in items)
    if not conversation and not all(isinstance(e, str) for e in items):
        kinds = sorted({type(e).__name__ for e in items})
        raise InputError(f"texts must be strings or examples from probe.prepare, got {', '.join(kinds)}"
                         + ("" if chat else " (a conversation, a list of messages, needs chat=True)"))
    return prepare(pm, items, label=label, continuation=continuation, kind=kind, strict_length=strict_length,
                   generate=generate, steps=steps, chat=chat, contrast=contrast, contrast_label=contrast_label,
                   target_side=target_side)


# --------------------------------------------------------------------------------------- explain


class ScoresWarning(UserWarning):
    """Scores asked for come from a method whose own check failed on them (not converged, constant,
    a degenerate site): :meth:`Explanation.top_tokens <probe.Explanation.top_tokens>` warns with why."""


class TopTokens(list):
    """:meth:`Explanation.top_tokens <probe.Explanation.top_tokens>`' ``[(position, token, score), ...]``; ``flags``: a line per
    failed check of the method on this example (empty when none), which the repr shows below the list;
    ``read_at``: which layer and head a per-layer or per-head method was read at (``"layer 5 of 0..5,
    the last, head mean"``; "" for a token-level method), which the repr shows where heads were averaged."""

    flags: tuple[str, ...] = ()
    read_at: str = ""

    def __repr__(self) -> str:
        shown = [f"read at {self.read_at}"] if self.read_at.endswith("head mean") else []
        return super().__repr__() + "".join(f"\n# {line}" for line in (*shown, *self.flags))


@dataclass(frozen=True, repr=False)
class Explanation(PicklableFrozen):
    """Token scores of several methods on the same prepared examples.

    ``scores[method]`` is that method's :class:`TokenScores` (per example ``[tokens]``,
    ``[layer, head, tokens]`` or ``[layer, tokens]``); ``skipped`` says why default methods were
    left out (only when the methods were not chosen). ``words``: per example, each word's text and
    the positions of its tokens, as the tokenizer's offsets and word ids (:func:`explain` fills it)
    split them; None when made without a tokenizer (then the token markers decide, see
    :meth:`to_pandas`).

    In a notebook it shows itself as a token x method table (``_repr_html_``); :meth:`plot` draws
    one example's scores.

    A score is NaN where the method does not score the token: special tokens ([CLS], [SEP], <s>,
    ...; ``examples[i].special``) under the interventions, which never delete them. Attention and
    gradient methods do score special tokens. So ``scores.argmax()`` and ``topk`` can return a
    special token (torch sorts NaN above every number): :meth:`top_tokens` ranks real tokens only.
    An explanation pickles, and :meth:`save` / :func:`load_explanation` keep it in a folder.
    """

    model: str
    examples: tuple[PreparedExample, ...]
    scores: Mapping[str, TokenScores]
    skipped: Mapping[str, str] = field(default_factory=dict)
    words: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...] | None = field(default=None, compare=False)
    #: per example, the spans ``explain(..., spans=...)`` found (:class:`probe.rows.spans.Span`)
    spans: tuple[tuple[Any, ...], ...] | None = field(default=None, compare=False)
    #: the methods' own checks that failed on these scores (:class:`probe.study.sanity.ScoreFlag`:
    #: IG completeness above its tolerance, constant scores, a degenerate site), per example where
    #: the check is; every display marks them. None: not recorded, found from the scores when asked
    #: (:meth:`failed_checks`; a degenerate site needs the model, so only :func:`explain` finds it)
    flags: tuple[Any, ...] | None = field(default=None, compare=False)

    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    def failed_checks(self, method: str | None = None, example: int | None = None) -> list:
        """The failed checks (:class:`~probe.study.sanity.ScoreFlag`) of ``method`` (default: every
        method) that mark example ``example`` (default: any): e.g. integrated gradients whose
        completeness delta on that example is above its tolerance (not converged)."""
        flags = self.flags
        if flags is None:
            from probe.study.sanity import score_flags

            flags = tuple(score_flags(self.examples, self.scores))
            object.__setattr__(self, "flags", flags)  # found once; the scores are frozen
        return [f for f in flags if (method is None or f.method == method)
                and (example is None or f.covers(example % max(len(self.examples), 1)))]

    def _flag_words(self, method: str, example: int) -> str:
        """``"⚠ not converged"`` (the failed checks' words) where ``method`` is marked on ``example``, else ''."""
        from probe.names import FLAG_MARK

        words = list(dict.fromkeys(f.words for f in self.failed_checks(method, example)))
        return f"{FLAG_MARK} {', '.join(words)}" if words else ""

    def _flag_lines(self, example: int | None = None, method: str | None = None) -> list[str]:
        """One line per failed check (of ``method`` or any, on ``example``'s scores or any), with why."""
        from probe.names import FLAG_MARK

        lines = []
        for f in self.failed_checks(method, example):
            if example is None:
                named = [f"{i} ({self.examples[i].label_name!r})" if self.examples[i].step is not None else str(i)
                         for i in f.examples]  # an output token: its text beside its index
                where = f" on examples {', '.join(named)}" if f.examples else ""
                lines.append(f"{FLAG_MARK} {f.method} {f.words}{where}: {f.detail}")
            else:
                lines.append(f"{FLAG_MARK} {f.method} {f.words} here: {f.note(example)}")
        return lines

    def top_tokens(self, k: int = 5, method: str | None = None, example: int = 0, *, layer: int = -1,
                   head: int | None = None) -> TopTokens:
        """``(position, token, score)`` of the ``k`` highest scored tokens of ``examples[example]``
        by ``method`` (default: the only method), highest first: special tokens and NaN scores are
        left out (ties keep the token order). A per-layer method is read at ``layer`` (default the
        last), a per-head one at ``layer`` and ``head`` (default None: the mean over heads, NaN-aware,
        as :meth:`matrix`, :meth:`plot` and the HTML table show it; the list's ``read_at`` and repr
        say so). Where the method's own check failed on this
        example (e.g. integrated gradients not converged), the list's ``flags`` say why (its repr
        shows them) and a :class:`~probe.api.ScoresWarning` is issued."""
        _positive(k, "k")
        if method is None:
            if len(self.scores) != 1:
                raise InputError(f"this explanation has {len(self.scores)} methods ({', '.join(self.scores)}): "
                                 "give method=NAME")
            method = next(iter(self.scores))
        result = self[method]
        if isinstance(example, bool) or not isinstance(example, int) or not -len(self.examples) <= example < len(self.examples):
            raise InputError(f"example={example!r} does not exist: this explanation has examples "
                             f"0..{len(self.examples) - 1}")
        values = result.scores[example]
        if result.per_head or result.per_layer:
            n_layers = values.shape[0]
            if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
                raise InputError(f"layer={layer!r} does not exist: {method} has layers 0..{n_layers - 1} "
                                 "(-1 is the last)")
            values = values[layer]
        if result.per_head:
            n_heads = values.shape[0]
            if head is None:  # [head, tokens] -> [tokens]: the head mean the table and the plots show
                values = torch.nanmean(values.double(), dim=0)
            elif isinstance(head, bool) or not isinstance(head, int) or not -n_heads <= head < n_heads:
                raise InputError(f"head={head!r} does not exist: {method} has heads 0..{n_heads - 1}")
            else:
                values = values[head]
        chosen = self.examples[example]
        scores = values.double().numpy()
        real = [p for p in range(len(scores)) if not chosen.special[p] and not np.isnan(scores[p])]
        ranked = sorted(real, key=lambda p: -scores[p])[:k]  # sorted is stable: ties keep the token order
        top = TopTokens((p, chosen.tokens[p], float(scores[p])) for p in ranked)
        top.read_at = self._read_at(method, layer, head)
        top.flags = tuple(self._flag_lines(example % len(self.examples), method))
        if top.flags:
            from probe.errors import warn_at_caller

            warn_at_caller(f"top_tokens(method={method!r}, example={example}): " + "; ".join(top.flags), ScoresWarning)
        return top

    def outputs(self) -> list[tuple[int, ...]]:
        """A step-by-step explanation (``generate=`` / ``steps=True``): per explained text, the
        indices into :attr:`examples` of its output tokens, in order (empty when the targets are
        not steps)."""
        from probe.rows.target import sources

        groups: dict[int, list[int]] = {}
        for i, (e, text) in enumerate(zip(self.examples, sources(self.examples))):
            if e.output_index is not None:
                groups.setdefault(text, []).append(i)
        return [tuple(g) for g in groups.values()]

    def _output_group(self, text: int) -> tuple[int, ...]:
        groups = self.outputs()
        if not groups:
            raise InputError("this explanation explains one target per text, not its output token by token: explain "
                             "with generate=N (or steps=True and a continuation) for output x source matrices")
        if isinstance(text, bool) or not isinstance(text, int) or not -len(groups) <= text < len(groups):
            raise InputError(f"text={text!r} does not exist: this explanation has texts 0..{len(groups) - 1}")
        return groups[text]

    def _generated_groups(self) -> list[tuple[int, ...]]:
        """:meth:`outputs` where every example is an output token (a generated or step explanation), else []."""
        groups = self.outputs()
        return groups if groups and sum(len(g) for g in groups) == len(self.examples) else []

    def _read_at(self, method: str, layer: int = -1, head: int | None = None) -> str:
        """Which layer (and head) a one-layer view of ``method`` shows, as words: ``"layer 5 of 0..5,
        head mean"``; "" for a token-level method."""
        result = self[method]
        if not (result.per_head or result.per_layer) or not len(result.scores):
            return ""
        n_layers = int(result.scores[0].shape[0])
        shown = layer % n_layers if isinstance(layer, int) and -n_layers <= layer < n_layers else layer
        words = f"layer {shown} of 0..{n_layers - 1}" + (", the last" if shown == n_layers - 1 else "")
        if result.per_head:
            words += ", head mean" if head is None else f", head {head}"
        return words

    def stacked(self, method: str, text: int = 0) -> torch.Tensor:
        """``method``'s scores of text ``text``'s output tokens stacked: ``[output token, ...,
        source token]`` (``...``: the method's layer and head axes, if any); a row per output token,
        whose target is that token's log-prob given the prompt and the output before it."""
        result = self[method]
        rows = [result.scores[i] for i in self._output_group(text)]
        width = max(r.shape[-1] for r in rows)  # target-side rows grow by the output written before them
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=float("nan")) for r in rows])

    def matrix(self, method: str, text: int = 0, *, layer: int = -1, head: int | None = None) -> pd.DataFrame:
        """The ``[output token x source token]`` matrix of ``method`` for text ``text``: one row per
        output token (index: ``"step: token"``), one column per source token (``"position: token"``),
        each token as ``probe.display.shown_token`` shows it (whitespace visible: ``2: ↵``).
        A per-layer method is read at ``layer`` (default the last), a per-head one at ``layer`` and
        ``head`` (None: the mean over heads). NaN where the method does not score a token."""
        from probe.display import shown_token

        values = self.stacked(method, text)
        result = self[method]
        if result.per_head or result.per_layer:
            n_layers = values.shape[1]
            if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
                raise InputError(f"layer={layer!r} does not exist: {method} has layers 0..{n_layers - 1} (-1 is the "
                                 f"last)")
            values = values[:, layer]
        if result.per_head:
            n_heads = values.shape[1]
            if head is None:
                values = values.mean(dim=1)
            elif isinstance(head, bool) or not isinstance(head, int) or not -n_heads <= head < n_heads:
                raise InputError(f"head={head!r} does not exist: {method} has heads 0..{n_heads - 1}")
            else:
                values = values[:, head]
        group = self._output_group(text)
        widest = self.examples[max(group, key=lambda i: len(self.examples[i].tokens))]
        rows = [f"{self.examples[i].output_index}: {shown_token(self.examples[i].label_name)}" for i in group]
        columns = [f"{p}: {shown_token(t)}" for p, t in enumerate(widest.tokens)]
        return pd.DataFrame(values.double().numpy(), index=pd.Index(rows, name="output token"),
                            columns=pd.Index(columns, name="source token"))

    def plot_matrix(self, method: str, text: int = 0, *, layer: int = -1, head: int | None = None):
        """:meth:`matrix` as a heatmap: output tokens down, source tokens across; a per-layer or
        per-head method at ``layer`` (default the last) and ``head`` (default their mean), which the
        title names; the prompt (a chat prompt's messages) above the map, wrapped, not cut. Returns
        a :class:`matplotlib.figure.Figure`."""
        from probe.display import prompt_text
        from probe.names import FLAG_MARK
        from probe.plots import matrix_figure

        frame = self.matrix(method, text, layer=layer, head=head)
        at = self._read_at(method, layer, head)  # which layer (and head) a per-layer method shows
        group = self._output_group(text)
        first = self.examples[group[0]]
        marks = [self._flag_words(method, i) for i in group]
        rows = [f"{FLAG_MARK} {r}" if mark else str(r) for r, mark in zip(frame.index, marks)]
        flagged = sum(bool(m) for m in marks)
        words = ", ".join(dict.fromkeys(m.split(" ", 1)[1] for m in marks if m))
        fig = matrix_figure(frame.to_numpy(), rows, [str(c) for c in frame.columns],
                            title=(f"{FLAG_MARK} {words} on {flagged} of {len(group)} output tokens; " if flagged
                                   else "") + (f"{method} ({at})" if at else method),
                            subtitle=f"{self.model}, text {text}: {prompt_text(first)}",
                            label=f"{method} score")
        for label, mark in zip(fig.axes[0].get_yticklabels(), marks):
            if mark:
                label.set_color(FLAG_COLOUR)
        return fig

    def save(self, path: str | Path) -> Path:
        """Write the explanation into the folder ``path`` (made if missing): ``scores.parquet``
        (:meth:`to_pandas`) and ``explanation.json`` (model, examples, methods with their
        parameters, flags, extras and score shapes, skipped); :func:`load_explanation` reads it
        back equal, every score exactly. Returns the folder."""
        import json

        from probe.study.store import write_file, write_table

        folder = Path(path)
        _check_explanation_folder(folder)
        record = {
            "format": EXPLANATION_FORMAT, "model": self.model,
            "examples": [_example_record(e) for e in self.examples],
            "methods": [{"name": m, "per_head": s.per_head, "per_layer": s.per_layer, "params": _json_value(s.params),
                         "extras": _json_value(s.extras), "shapes": [list(v.shape) for v in s.scores]}
                        for m, s in self.scores.items()],
            "skipped": dict(self.skipped),
            # the methods' failed checks, as found when explained (a degenerate site needs the model): a loaded
            # explanation marks the same scores
            "flags": [f.to_dict() for f in self.failed_checks()],
        }
        # each file whole or not at all, a failed write's temporary file removed (the store's own writers)
        write_table(folder / "scores.parquet", self.to_pandas())
        write_file(folder / "explanation.json", json.dumps(record, indent=1))
        return folder

    def __getitem__(self, method: str) -> TokenScores:
        if method not in self.scores:
            raise InputError(f"method {method!r} was not run: this explanation has {', '.join(self.scores)}")
        return self.scores[method]

    def __repr__(self) -> str:
        from probe.display import name_list

        n = len(self.examples)
        groups = self._generated_groups()
        counted = (f"{len(groups)} prompt{'s' if len(groups) != 1 else ''}, {n} output token{'s' if n != 1 else ''}"
                   if groups else f"{n} text{'s' if n != 1 else ''}")
        text = f"<Explanation {self.model}: {counted} x {len(self.scores)} method"
        text += f"{'s' if len(self.scores) != 1 else ''} ({name_list(self.scores)})"
        return text + (f", {len(self.skipped)} skipped>" if self.skipped else ">")

    def to_pandas(self, level: str = "token", *, agg: str = "sum") -> pd.DataFrame:
        """The scores as a tidy table.

        ``level="token"`` (default): one row per (example, method, layer, head, token): columns
        ``example`` (index into ``examples``), ``position``, ``token`` (the tokenizer's string),
        ``clean_token`` (the same without the ``##`` / ``Ġ`` / ``▁`` markers), ``special``,
        ``method``, ``layer``, ``head`` (-1 where the method has none), ``score`` (float64; NaN
        where a method does not score the token, e.g. special tokens under leave-one-out). The
        ``scores`` table a study stores, with the token text beside each position.

        ``level="span"`` (an explanation made with ``spans=``): one row per (example, span, method,
        layer, head): columns ``example``, ``span_index``, ``span`` (its text), ``start``, ``end``
        (character offsets), ``n_tokens``, ``method``, ``layer``, ``head``, ``score``, the span's
        token scores folded by ``agg`` as words are.

        ``level="word"``: one row per (example, method, layer, head, word), the sub-word scores of
        each word folded by ``agg`` (``sum``, ``max`` or ``mean``): columns ``example``, ``word_index``,
        ``word`` (its text), ``first_position`` and ``n_tokens`` (its tokens), ``special``,
        ``method``, ``layer``, ``head``, ``score``. Words are split as :func:`explain` recorded them
        from the tokenizer's offsets and word ids (``words``); an explanation without them splits at
        the token markers (a ``##`` piece continues a word; a ``Ġ`` / ``▁`` piece starts one). A
        special token is always a word of its own (``special`` True, its score as the token's).
        NaN-aware: NaN tokens are left out of a word's sum, max or mean, and a word whose tokens
        are all NaN is NaN (not 0, which would read as unimportant). ``max`` is the largest
        signed value.
        """
        if level == "word":
            return self._word_frame(agg)
        if level == "span":
            from probe.rows.spans import span_table

            if self.spans is None:
                raise InputError("this explanation has no spans: explain with spans=PATTERN (a regular expression) or "
                                 "spans=[(start, end), ...] (character offsets)")
            return span_table(self.scores, self.spans, agg)
        if level != "token":
            raise InputError(f"level={level!r} is not a level of the table: use 'token', 'word' or 'span'")
        from probe.display import clean_token

        columns = ["example", "position", "token", "clean_token", "special", "method", "layer", "head", "score"]
        tokens = np.array([t for e in self.examples for t in e.tokens], dtype=object)
        clean = np.array([clean_token(t) for t in tokens], dtype=object)
        special = np.array([bool(s) for e in self.examples for s in e.special], dtype=bool)
        starts = np.cumsum([0] + [len(e.tokens) for e in self.examples])[:-1]
        frames = []
        for method, result in self._checked_scores():
            frame = result.to_pandas()
            at = starts[frame["example"].to_numpy()] + frame["position"].to_numpy()
            frame["token"], frame["clean_token"], frame["special"] = tokens[at], clean[at], special[at]
            frame["method"] = method
            frames.append(frame[columns])
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True)

    def _checked_scores(self):
        """(method, TokenScores) of the methods that scored something, each tensor's length checked."""
        for method, result in self.scores.items():
            if not len(result.scores):
                continue
            for i, values in enumerate(result.scores):
                if values.shape[-1] != len(self.examples[i].tokens):
                    raise ValueError(f"{method} scores {values.shape[-1]} tokens of example #{i}, which has "
                                     f"{len(self.examples[i].tokens)}")
            yield method, result

    def word_groups(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Example ``index``'s words: each one's text and the positions of its tokens (see :meth:`to_pandas`)."""
        if self.words is not None:
            return [(text, tuple(group)) for text, group in self.words[index]]
        from probe.display import clean_token
        from probe.explainers.words import groups_from_prefixes

        example = self.examples[index]
        groups = groups_from_prefixes(list(example.tokens), [bool(s) for s in example.special])
        return [(example.tokens[g[0]] if example.special[g[0]] else "".join(clean_token(example.tokens[i]) for i in g),
                 tuple(g)) for g in groups]

    def _word_frame(self, agg: str) -> pd.DataFrame:
        from probe.explainers.words import AGGREGATIONS, aggregate

        if agg not in AGGREGATIONS:
            raise InputError(f"agg={agg!r} is not a word aggregation: use one of {', '.join(AGGREGATIONS)}")
        columns = ["example", "word_index", "word", "first_position", "n_tokens", "special", "method", "layer",
                   "head", "score"]
        words = [self.word_groups(i) for i in range(len(self.examples))]
        frames = []
        for method, result in self._checked_scores():
            for i in range(len(result.scores)):
                groups = [list(g) for _, g in words[i]]
                folded = TokenScores(method, [aggregate(result.scores[i], groups, agg)],
                                     per_head=result.per_head, per_layer=result.per_layer)
                frame = folded.to_pandas().rename(columns={"position": "word_index"})
                at = frame["word_index"].to_numpy()
                frame["example"] = i
                frame["word"] = np.array([text for text, _ in words[i]], dtype=object)[at]
                frame["first_position"] = np.array([g[0] for _, g in words[i]], dtype=np.int64)[at]
                frame["n_tokens"] = np.array([len(g) for _, g in words[i]], dtype=np.int64)[at]
                frame["special"] = np.array([len(g) == 1 and bool(self.examples[i].special[g[0]])
                                             for _, g in words[i]], dtype=bool)[at]
                frame["method"] = method
                frames.append(frame[columns])
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True)

    def _rows(self, index: int, methods: Sequence[str] | None = None, *, marked: bool = False) -> dict[str, np.ndarray]:
        """Method label -> example ``index``'s ``[tokens]`` row (per-layer and per-head methods: their
        last layer, heads averaged; the label says so). ``marked``: a method whose own check failed
        on this example says so in its label (``integrated_gradients ⚠ not converged``)."""
        from probe.display import unit_row

        chosen = list(self.scores) if methods is None else [methods] if isinstance(methods, str) else list(methods)
        rows = {}
        for method in chosen:
            values, what = unit_row(self[method].scores[index].double().numpy())
            label = f"{method} ({what})" if what else method
            flagged = self._flag_words(method, index) if marked else ""
            rows[f"{label} {flagged}" if flagged else label] = values
        return rows

    def _repr_html_(self) -> str:
        from probe.display import MAX_EXAMPLES, block_html, clip, prompt_text, token_table_html

        if self._generated_groups():
            return self._generated_html()
        parts = [block_html(repr(self), _warning_html(self._flag_lines()),
                            "cells shaded by each method's score over its largest |score| on the text's scored "
                            "tokens, written under its name (red positive, blue negative); a method at the "
                            "target's noise floor or whose own check failed is not shaded; grey: special tokens")]
        for i, example in enumerate(self.examples[:MAX_EXAMPLES]):
            target = example.label_name if example.label_name is not None else example.label
            value = "" if example.original_value is None else f" = {example.original_value:.4g}"
            title = f"example {i}: {clip(prompt_text(example), 120)}"
            note = f"explained: {example.kind} of {target if target is not None else 'the continuation'}{value}"
            rows = self._rows(i, marked=True)
            table = token_table_html(example.tokens, example.special, rows, self._faded(i, rows))
            parts.append(block_html(title, _warning_html(self._flag_lines(i)) + table, note))
        more = len(self.examples) - MAX_EXAMPLES
        if more > 0:
            parts.append(block_html(f"... and {more} more example{'s' if more != 1 else ''} "
                                    "(ex.to_pandas() has them all)", ""))
        return "<div>" + "".join(parts) + "</div>"

    def _faded(self, index: int, rows: Mapping[str, np.ndarray]) -> dict[str, str]:
        """The columns of example ``index``'s table (``rows``: :meth:`_rows` with ``marked``, in the
        order of ``scores``) left unshaded, each with why: a method whose own check failed on it,
        and an intervention whose largest |effect| on the scored tokens is at or below the target's
        noise floor (:data:`probe.study.decide.NOISE_ULPS` float32 epsilons times the target's
        |value|: an explanation does not record its dtype, and float32's is the lowest floor)."""
        from probe.names import method_family
        from probe.study.decide import noise_floor

        example = self.examples[index]
        special = np.asarray([bool(s) for s in example.special], dtype=bool)
        value = example.original_value
        floor = noise_floor(abs(float(value))) if value is not None and np.isfinite(value) else None
        faded = {}
        for method, (label, values) in zip(self.scores, rows.items()):
            if self._flag_words(method, index):
                faded[label] = "its own check failed"
                continue
            scored = np.abs(values[~special & np.isfinite(values)])
            if floor is not None and method_family(method) == "intervention" and scored.size and scored.max() <= floor:
                faded[label] = f"at the target's noise floor ({floor:.1e})"
        return faded

    def _generated_html(self) -> str:
        """A generated (step) explanation as inseq shows one: per prompt (at most ``MAX_EXAMPLES``),
        its output, then one output x source matrix per method (:meth:`matrix`; a per-layer method
        at its last layer, heads averaged, as its title says)."""
        from probe.display import (
            MAX_EXAMPLES,
            WHITESPACE_SIGNS,
            block_html,
            clip,
            matrix_table_html,
            prompt_text,
            shown_token,
        )

        groups = self._generated_groups()
        parts = [block_html(repr(self), _warning_html(self._flag_lines()),
                            "per prompt, one matrix per method: a row per output token (explained: that token given "
                            "the prompt and the output before it), a column per source token; cells shaded by the "
                            "method's score over the matrix's scored tokens (red positive, blue negative); grey: "
                            "special tokens; \u2423 a space, \u21b5 a newline, ## a word piece")]
        for t, group in enumerate(groups[:MAX_EXAMPLES]):
            steps = [self.examples[i] for i in group]
            first, widest = steps[0], max(steps, key=lambda e: len(e.tokens))
            written = len(widest.tokens) - len(first.tokens)  # target-side: the output written before the last
            output = "".join(str(e.label_name) for e in steps)
            output = "".join(c if c == " " else WHITESPACE_SIGNS.get(c, c) for c in output)
            values = ", ".join(f"{shown_token(e.label_name)} {e.original_value:.3f}" for e in steps
                               if e.original_value is not None)
            note = (f"output ({len(steps)} token{'s' if len(steps) != 1 else ''}): {output}; {first.kind} of each: "
                    f"{values}" + ("" if written else "; sources: the prompt (target_side=True scores the output "
                                                      "written before each token too)"))
            body = []
            for method, result in self.scores.items():
                if not len(result.scores):
                    continue
                marks = [self._flag_words(method, i) for i in group]
                rows = [f"{e.output_index}: {shown_token(e.label_name)}" + (f" {mark}" if mark else "")
                        for e, mark in zip(steps, marks)]
                at = self._read_at(method)
                table = matrix_table_html(self.matrix(method, t).to_numpy(), rows, widest.tokens, widest.special,
                                          written)
                body.append(block_html(f"{method} ({at})" if at else method, table))
            parts.append(block_html(f"prompt {t}: {clip(prompt_text(first), 200)}", "".join(body), note))
        more = len(groups) - MAX_EXAMPLES
        if more > 0:
            parts.append(block_html(f"... and {more} more prompt{'s' if more != 1 else ''} "
                                    "(ex.matrix(method, text) has each)", ""))
        return "<div>" + "".join(parts) + "</div>"

    def plot(self, example: int = 0, methods: str | Sequence[str] | None = None):
        """Example ``example``'s token scores, one bar panel per method (default: all), the tokens
        on the x axis; per-layer and per-head methods show their last layer (heads averaged).
        Returns a :class:`matplotlib.figure.Figure` (on its own Agg canvas; nothing global changed)."""
        from probe.display import clip, prompt_text, shown_token
        from probe.names import FLAG_MARK
        from probe.plots import token_scores_figure

        if isinstance(example, bool) or not isinstance(example, int) or not 0 <= example < len(self.examples):
            raise InputError(f"example={example!r} is not an example of this explanation: use "
                             f"0..{len(self.examples) - 1}")
        e = self.examples[example]
        chosen = list(self.scores) if methods is None else [methods] if isinstance(methods, str) else list(methods)
        marks = [self._flag_words(m, example) for m in chosen]
        flagged = [m for m, mark in zip(chosen, marks) if mark]
        fig = token_scores_figure([shown_token(t) for t in e.tokens], self._rows(example, chosen),
                                  [bool(s) for s in e.special],
                                  title=(f"{FLAG_MARK} {', '.join(flagged)}: own check failed; " if flagged else "")
                                  + f"{self.model}, example {example}: {clip(prompt_text(e), 70)}")
        for ax, mark in zip(fig.axes, marks):
            _mark_axes(ax, mark)
        return fig


FLAG_COLOUR = "#b00000"


def _warning_html(lines: Sequence[str]) -> str:
    """Failed checks' lines as HTML, in the colour of a warning (each line escaped)."""
    from probe.document import escape_html

    return "".join(f'<div style="color:{FLAG_COLOUR}">{escape_html(line)}</div>' for line in lines)


def _mark_axes(ax, mark: str) -> None:
    """A panel of a method whose check failed: its label in the warning colour and ``mark`` inside it."""
    if not mark:
        return
    ax.yaxis.label.set_color(FLAG_COLOUR)
    ax.text(0.005, 0.96, mark, transform=ax.transAxes, ha="left", va="top", fontsize=7, color=FLAG_COLOUR,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1})


#: the version of the folder :meth:`Explanation.save` writes
EXPLANATION_FORMAT = 1
_TENSOR = "__tensor__"


def _json_value(value: Any) -> Any:
    """``value`` as JSON: tensors (and numpy arrays) as ``{"__tensor__": values, "dtype": ...}``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and _TENSOR in value:
        return torch.tensor(value[_TENSOR], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _example_record(example: PreparedExample) -> dict[str, Any]:
    import dataclasses

    return {f.name: _json_value(getattr(example, f.name)) for f in dataclasses.fields(example)}


def _example_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A saved example's fields as the example holds them (JSON keeps a chat prompt's messages as lists)."""
    if "messages" in fields:
        fields["messages"] = tuple(tuple(m) for m in fields["messages"])
    if "offsets" in fields:
        fields["offsets"] = tuple(tuple(o) for o in fields["offsets"])
    return fields


#: what a folder :meth:`Explanation.save` may write into holds besides these: nothing (hidden files aside)
EXPLANATION_FILES = ("explanation.json", "scores.parquet")


def _check_explanation_folder(folder: Path) -> None:
    """Refuse, in one line, a folder :meth:`Explanation.save` would overwrite something else in: a file,
    a study's result folder (its ``scores.parquet`` is the study's), any folder with other files; a
    new folder, an empty one and an earlier save's are fine."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder} is a file; Explanation.save writes a folder: give a new or empty folder")
    if not folder.is_dir():
        return
    others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name not in EXPLANATION_FILES)
    earlier = (folder / "explanation.json").is_file()
    if others or ((folder / "scores.parquet").exists() and not earlier):
        what = ("a study's result folder" if (folder / "study.json").exists() or (folder / "complete.json").exists()
                else "other files")
        shown = ", ".join(others[:3] or ["scores.parquet"]) + (", ..." if len(others) > 3 else "")
        raise InputError(f"{folder} holds {what} ({shown}); Explanation.save would overwrite its scores.parquet: "
                         "give a new or empty folder (or one an earlier Explanation.save wrote)")


def load_explanation(path: str | Path) -> Explanation:
    """The :class:`Explanation` :meth:`Explanation.save` wrote into the folder ``path``, equal to
    the one saved (every score exactly; no model is loaded)."""
    import json

    folder = Path(path)
    files = [folder / "explanation.json", folder / "scores.parquet"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise InputError(f"{folder} is not a saved explanation (it lacks {', '.join(missing)}): give the folder "
                         "Explanation.save(path) wrote")
    try:
        record = json.loads(files[0].read_text(encoding="utf-8"))
        table = pd.read_parquet(files[1], columns=["example", "method", "layer", "head", "position", "score"])
    except (OSError, ValueError) as err:
        raise InputError(f"{folder} holds an unreadable explanation ({' '.join(str(err).split())[:120]}); "
                         "save it again") from None
    if record.get("format") != EXPLANATION_FORMAT:
        raise InputError(f"{folder}: explanation format {record.get('format')!r} is not {EXPLANATION_FORMAT}, the one "
                         "this probe reads; save it again with this version")
    examples = tuple(PreparedExample(**_example_fields(_from_json(e))) for e in record["examples"])
    table = table.sort_values(["method", "example", "layer", "head", "position"], kind="stable")
    grouped = {key: part["score"].to_numpy() for key, part in table.groupby(["method", "example"], sort=False)}
    scores = {}
    for entry in record["methods"]:
        name = entry["name"]
        values = [torch.from_numpy(grouped[(name, i)].astype(np.float32)).reshape(shape)
                  for i, shape in enumerate(entry["shapes"])]
        scores[name] = TokenScores(method=name, scores=values, params=_from_json(entry["params"]),
                                   per_head=entry["per_head"], per_layer=entry["per_layer"],
                                   extras=_from_json(entry["extras"]))
    from probe.study.sanity import ScoreFlag

    flags = None if "flags" not in record else tuple(ScoreFlag.from_dict(f) for f in record["flags"])
    return Explanation(model=record["model"], examples=examples, scores=MappingProxyType(scores),
                       skipped=MappingProxyType(dict(record.get("skipped") or {})), flags=flags)


@_in_eval
def explain(pm: ProbeModel, texts: Texts, methods: str | Sequence[str] | None = None, *,
            label: int | str | None = None, continuation: str | None = None, kind: str | None = None,
            params: Mapping[str, Mapping[str, Any]] | None = None, strict_length: bool = False,
            progress: bool = False, generate: int | None = None, steps: bool = False,
            chat: bool = False, contrast: str | None = None,
            contrast_label: int | str | None = None, spans: str | Sequence[tuple[int, int]] | None = None,
            target_side: bool = False) -> Explanation:
    """Explain each text's target with ``methods`` (names or ``"a,b"``; ``"all"``; default: every
    method that applies to this model and these texts), side by side on the same examples.

    ``params`` maps a method to its keyword parameters, e.g. ``{"integrated_gradients": {"steps":
    32}, "loo_random": {"k": 3, "seed": 1}}``. Interventions share one engine, so identical rows run once.
    ``progress``: show progress bars (over the methods and the interventions' batches); off by default.

    A language model's output token by token: ``generate=N`` (its greedy output of up to N tokens)
    or ``steps=True`` (each token of ``continuation``) make every output token an example of its
    own (see :func:`prepare`); :meth:`Explanation.matrix` then gives a method's
    ``[output token, ..., source token]`` matrix per text (``target_side=True``: over the prompt and
    the output written before each token). ``chat=True``: the texts are user
    messages in the model's chat template (see :func:`prepare`).
    ``contrast`` / ``contrast_label``: explain the target rather than a foil / another class (see :func:`prepare`).
    ``spans``: units to read the scores by, a regular expression (each match) or character offsets
    ``[(start, end), ...]`` into each text; ``to_pandas(level="span")`` then folds every method's
    token scores over them (``probe.rows.spans``).
    """
    from probe.methods import applicable_methods, run_methods

    chosen = _method_names(methods)  # validate before tokenising; None or "all": every method that applies
    params = _method_params(params)
    if chosen is not None:
        _no_gradients_here(chosen)
    if spans is not None:
        from probe.rows.spans import span_spec

        span_spec(spans)  # a wrong type or a bad pattern refused before any method runs
    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, strict_length=strict_length,
                         generate=generate, steps=steps, chat=chat, contrast=contrast, contrast_label=contrast_label,
                         target_side=target_side)
    skipped: dict[str, str] = {}
    if chosen is None:
        chosen, skipped = applicable_methods(pm, examples)
        _no_gradients_here(chosen)
    unused = [m for m in params if m not in chosen]
    if unused:
        raise InputError(f"params given for {unused[0]!r}, which is not among the methods run ({', '.join(chosen)})")
    params = _auto_steps_for_outputs(examples, chosen, params)
    results = run_methods(pm, examples, chosen, params=params, progress=_flag(progress, "progress"))
    found = None
    if spans is not None:
        from probe.rows.spans import spans_per_example

        found = tuple(tuple(f) for f in spans_per_example(pm, examples, spans))
    from probe.study.sanity import explanation_flags

    return Explanation(model=pm.name, examples=tuple(examples), scores=MappingProxyType(dict(results)), spans=found,
                       skipped=MappingProxyType(skipped), words=_words(pm, examples),
                       flags=tuple(explanation_flags(pm, examples, results)))


def _auto_steps_for_outputs(examples: Sequence[PreparedExample], methods: Sequence[str],
                            params: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``params`` with ``steps: "auto"`` for each path method (registry ``points == "steps"``) not
    given steps, where the targets are output tokens (``generate=`` / ``steps=True``): a generated
    token's log-prob often moves by several nats along the path, which a fixed number of steps
    may not integrate (see the README on integrated gradients' completeness)."""
    out = {m: dict(p) for m, p in params.items()}
    if not any(e.step is not None for e in examples):
        return out
    for method in methods:
        if registry.method(method).points == "steps" and "steps" not in out.get(method, {}):
            out.setdefault(method, {})["steps"] = "auto"
    return out


def _words(pm: ProbeModel, examples: Sequence[PreparedExample]) -> tuple:
    """Per example, each word's text and its token positions, from the tokenizer (see
    :func:`probe.explainers.words.word_groups`)."""
    from probe.explainers.words import word_groups

    out = []
    for e in examples:
        groups = word_groups(pm, e)
        out.append(tuple((e.tokens[g[0]] if e.special[g[0]] else
                          pm.tokenizer.convert_tokens_to_string([e.tokens[i] for i in g]).strip(), tuple(g))
                         for g in groups))
    return tuple(out)


# --------------------------------------------------------------------------------------- interventions


@_in_eval
def loo(pm: ProbeModel, texts: Texts, mode: str = "delete", *, k: int = 8, seed: int = 0,
        label: int | str | None = None, continuation: str | None = None, kind: str | None = None,
        progress: bool = False, generate: int | None = None, steps: bool = False,
        chat: bool = False, contrast: str | None = None, contrast_label: int | str | None = None,
        target_side: bool = False) -> TokenScores:
    """Leave-one-out: per example ``[tokens]`` scores f(x) - f(x with the token deleted or replaced),
    ``mode`` one of delete, mask, unk, pad, random, lm (``k`` seeded draws for random and lm).
    Special tokens get NaN. ``extras["original_values"]`` holds f(x) per example. ``progress``: a
    bar over the forward batches. ``contrast`` / ``contrast_label``: see :func:`prepare`."""
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo as _loo

    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, generate=generate, steps=steps,
                         chat=chat, contrast=contrast, contrast_label=contrast_label, target_side=target_side)
    return _loo(Engine(pm, progress=_flag(progress, "progress")), examples, mode, k=k, seed=seed)


@_in_eval
def span_loo(pm: ProbeModel, texts: Texts, spans: str | Sequence[tuple[int, int]], mode: str = "delete", *,
             label: int | str | None = None, continuation: str | None = None, kind: str | None = None,
             contrast: str | None = None, contrast_label: int | str | None = None, chat: bool = False,
             generate: int | None = None) -> pd.DataFrame:
    """Leave-one-out of whole spans: per (example, span), ``score`` = f(x) - f(x with every token of
    the span deleted, or replaced by the mask, unk or pad token: ``mode``). ``spans``: a regular
    expression (each match is a span), character offsets ``[(start, end), ...]`` into each
    text, or ``"@roles"`` with ``chat=True`` (each message of the conversation, a ``role`` column
    naming it); a token belongs to a span when its characters overlap it, special tokens never.
    ``generate=N``: every output token of the greedy output is its own example. Columns:
    example, span_index, span, start, end, n_tokens, mode, score, original_value."""
    from probe.intervene.engine import Engine
    from probe.intervene.spans import span_loo as _span_loo
    from probe.rows.spans import span_spec, spans_per_example

    span_spec(spans)  # a wrong type or a bad pattern refused before the texts are prepared
    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, contrast=contrast,
                         contrast_label=contrast_label, chat=chat, generate=generate)
    return _span_loo(Engine(pm), examples, spans_per_example(pm, examples, spans), mode)


def find_spans(pm: ProbeModel, example: PreparedExample, spans: str | Sequence[tuple[int, int]]) -> list:
    """The spans of one prepared example (:class:`probe.rows.spans.Span`: text, start, end,
    token positions), as :func:`span_loo` and ``explain(..., spans=)`` find them."""
    from probe.rows.spans import find_spans as _find

    return _find(pm, example, spans)


@_in_eval
def erasure(pm: ProbeModel, texts: Texts, rankings: Mapping[str, TokenScores | Sequence[torch.Tensor]] | None = None,
            *, bins: Sequence[float] | None = None, seed: int = 0, flips: bool = True,
            progress: bool = False) -> pd.DataFrame:
    """Erasure curves (comprehensiveness, sufficiency, AOPC, decision flips) of each ranking, always
    beside a seeded random ranking (``ranking == "random"``).

    ``texts`` is usually an :class:`Explanation`: its examples are used and, when ``rankings`` is
    None, its token-level methods (``[tokens]`` per example) are the rankings. A ranking is a
    :class:`TokenScores` or one ``[tokens]`` tensor per example, higher = more important. Returns
    one row per (example, ranking, bin); see ``probe.intervene.erasure.erasure``. ``bins``:
    fractions of the scorable tokens (default ``ERASURE_BINS``, 1% to 50%). ``progress``: a bar
    over the forward batches.
    """
    from probe.intervene.engine import Engine
    from probe.intervene.erasure import ERASURE_BINS
    from probe.intervene.erasure import erasure as _erasure

    if rankings is None:
        if not isinstance(texts, Explanation):
            raise InputError("give rankings (method -> TokenScores), or pass an Explanation whose methods rank the "
                             "tokens")
        rankings = {m: s for m, s in texts.scores.items() if not (s.per_head or s.per_layer)}
        if not rankings:
            raise InputError(f"the explanation's methods ({', '.join(texts.scores)}) all score per layer or head: "
                             "give rankings, e.g. {'attention_mean': [s[-1] for s in ex['attention_mean'].scores]}")
    examples = _examples(pm, texts)
    return _erasure(Engine(pm, progress=_flag(progress, "progress")), examples, dict(rankings), bins=ERASURE_BINS if bins is None else bins, seed=seed,
                    flips=flips)


@_in_eval
def head_ablation(pm: ProbeModel, texts: Texts, *, stack: str | None = None, batch_size: int = 32,
                  label: int | str | None = None, continuation: str | None = None,
                  kind: str | None = None, contrast: str | None = None,
                  contrast_label: int | str | None = None) -> HeadEffects:
    """Each head of ``stack`` (default: the one that reads the target) ablated alone.
    ``result.change`` is ``[example, layer, head]`` original - ablated target; ``result.mean_abs_change``
    ``[layer, head]``."""
    from probe.intervene.heads import head_ablation_effects

    _positive(batch_size, "batch_size")
    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, contrast=contrast,
                         contrast_label=contrast_label)
    return head_ablation_effects(pm, examples, stack=stack, batch_size=batch_size)


@_in_eval
def head_importance(pm: ProbeModel, texts: Texts, *, stack: str | None = None, loss: str = "nll",
                    ablation: bool = True, label: int | str | None = None, continuation: str | None = None,
                    kind: str | None = None, contrast: str | None = None,
                    contrast_label: int | str | None = None) -> HeadImportance:
    """Michel et al. head importance ``[layer, head]`` (``E_x |dL/dxi_h|``, L2-normalised per layer),
    with the single-head ablation effect beside it when ``ablation``."""
    from probe.intervene.heads import head_importance as _importance

    if torch.is_inference_mode_enabled():
        raise InputError("head importance needs gradients, which torch.inference_mode() switches off: call "
                         "probe.head_importance outside the `with torch.inference_mode():` block")
    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, contrast=contrast,
                         contrast_label=contrast_label)
    return _importance(pm, examples, stack=stack, loss=loss, ablation=ablation)


@_in_eval
def counterfactual_attention(pm: ProbeModel, texts: Texts, how: str = "uniform", *, layer: int = -1,
                             head: int | None = None, label: int | str | None = None,
                             continuation: str | None = None, kind: str | None = None,
                             contrast: str | None = None, contrast_label: int | str | None = None,
                             **options: Any) -> CounterfactualResult:
    """Inject ``how`` = uniform, permuted or adversarial attention at the target query's row of
    ``layer`` (negative counts from the last) and ``head`` (None: every head of the layer), and
    measure the output change: ``output_tvd``, ``output_jsd``, ``target_change`` ``[example,
    sample]``, and ``summary()`` per example. ``options`` go to the function of that name in
    ``probe.intervene.counterfactual`` (permuted: ``n``, ``seed``; adversarial: ``candidates``,
    ``steps``, ``bound``, ``seed``, ...)."""
    import inspect

    if how not in COUNTERFACTUALS:
        raise InputError(f"unknown counterfactual attention {how!r}: use one of {', '.join(COUNTERFACTUALS)}")
    own = [p for p in inspect.signature(counterfactual_attention).parameters if p not in ("pm", "texts", "options")]
    passed_on = [p for p in inspect.signature(registry.counterfactual(how).load()).parameters
                 if p not in ("pm", "examples", "layer", "head")]
    _unknown_keywords(options, [*own, *passed_on], f"probe.counterfactual_attention(how={how!r})")
    if registry.counterfactual(how).needs_gradients and torch.is_inference_mode_enabled():
        raise InputError(f"{how} attention searches by gradient, which torch.inference_mode() switches off: call "
                         "probe.counterfactual_attention outside the `with torch.inference_mode():` block")
    examples = _examples(pm, texts, label=label, continuation=continuation, kind=kind, contrast=contrast,
                         contrast_label=contrast_label)
    return registry.counterfactual(how).load()(pm, examples, layer=layer, head=head, **options)


# --------------------------------------------------------------------------------------- capture


def capture(pm: ProbeModel, *, queries: Any = None, layers: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
            heads: Sequence[int] | Mapping[str, Sequence[int]] | None = None, stacks: Sequence[str] | None = None,
            attention_mask: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
            editors: Mapping[tuple[str, int], Editor] | None = None,
            keep_grad: bool = False) -> AbstractContextManager[Capture]:
    """``with probe.capture(pm, ...) as cap:`` records the attention of every forward pass of
    ``pm.model`` run inside the block; ``cap.maps(stack)`` then gives
    :class:`~probe.hooks.types.AttentionMaps` with ``weights [batch, layer, head, query, key]``.
    Hooks are removed when the block ends, also on an exception.

    ``queries``: None/"all", "first", "last" (each row's last real token, from ``attention_mask``
    [batch, seq] or else the mask the forward is handed: ``pm.model(**batch)``), a list of
    positions or a long tensor ``[batch, rows]``. ``layers``: indices, negative ones from the last
    (-1 = the last layer). ``editors`` ``{(stack, layer): fn(weights,
    context)}`` replace attention weights ``[batch, head, query, key]`` before they mix the values.
    """
    from probe.hooks.capture import capture_attention

    return capture_attention(pm, queries=queries, layers=layers, heads=heads, stacks=stacks,
                             attention_mask=attention_mask, decoder_attention_mask=decoder_attention_mask,
                             editors=editors, keep_grad=keep_grad)


# --------------------------------------------------------------------------------------- studies


def load_study(path: str | Path, *, n: int | None = None, dataset: str | None = None, device: str | None = None,
               dtype: str | None = None, out: str | Path | None = None) -> Study:
    """Read and validate a study file (YAML), with the command line's overrides (``n``,
    ``dataset``, ``device``, ``dtype``, ``out``)."""
    from probe.spec.study import load_study as _load

    return _load(path, n=n, dataset=dataset, device=device, dtype=dtype, out=None if out is None else str(out))


def study_from_dict(data: Mapping[str, Any]) -> Study:
    """Validate a study given as a dict (the YAML's structure)."""
    from probe.spec.study import study_from_dict as _from_dict

    if not isinstance(data, Mapping):
        raise InputError(f"data must be a dict with the study file's keys (name, model, dataset, ...), got "
                         f"{type(data).__name__}")
    return _from_dict(dict(data))


def load_results(folder: str | Path) -> StudyResult:
    """Read a study's result folder (finished, or part-way through its batches) without a model:
    its tables, typed verdict and provenance (:class:`~probe.report.results.StudyResult`)."""
    from probe.report.results import load_result

    return load_result(folder)


def run_study(study: Study | str | Path, *, out: str | Path | None = None, progress: bool = False,
              report: bool = True, shard: tuple[int, int] | None = None, wait: bool = False,
              force_new: bool = False, log: Callable[[str], None] | None = None,
              model: ProbeModel | None = None) -> StudyResult:
    """Run (or continue) a study (a :class:`~probe.spec.study.Study`, or the path of a study file) into ``out``
    (default: the study's ``output``, else ``results/NAME``); with ``report`` the HTML/Markdown
    report is written there once complete. Returns the folder as :func:`load_results` reads it
    (tables, typed verdict, provenance), with ``computed`` the batches this call ran.

    ``shard`` ``(i, n)``: compute only every n-th batch from batch i (several processes share a
    study; the one that finds every batch done merges them). ``wait``: when another process holds
    the folder, wait for it instead of refusing. ``force_new``: start over in a folder that holds
    another study's results, or this study's on other data, weights or code. ``log``: where the
    run's one-line messages go (resuming, waiting, the report's path; default: standard error with
    ``progress``, else nowhere). ``model``: an already loaded :class:`ProbeModel` to run instead of
    loading the study's (its ``model.id`` becomes the model's name, so results and report say which
    model ran; the folder's identity check still compares its weights with a run to continue)."""
    import dataclasses

    from probe.report.results import load_result
    from probe.spec.study import Study as _Study
    from probe.study.runner import run_study as _run

    if isinstance(study, (str, Path)):
        study = load_study(study, out=out)
    elif isinstance(study, Mapping):
        study = study_from_dict(study)
        if out is not None:
            study = study.model_copy(update={"output": str(out)})
    elif not isinstance(study, _Study):
        raise InputError(f"study must be a study file's path, a Study or a dict, got {type(study).__name__} "
                         f"{str(study)[:40]!r}")
    elif out is not None:
        study = study.model_copy(update={"output": str(out)})

    if model is not None:
        model = _model(model, "model")
        if study.model.id != model.name:
            study = study.model_copy(update={"model": study.model.model_copy(update={"id": model.name})})
    if log is None:
        log = (lambda text: print(text, file=sys.stderr)) if progress else (lambda _: None)

    def write_report(root: Path) -> None:
        from probe.report.build import build_report, report_is_current

        if report_is_current(root):
            log(f"report: {root / 'report' / 'report.html'} (up to date)")
            return
        log(f"report: {build_report(root).html}")

    run = _run(study, shard=shard, progress=progress, log=log,
               on_complete=write_report if report else None, wait=wait, force_new=force_new, model=model)
    return dataclasses.replace(load_result(run.out), computed=tuple(run.computed))


# --------------------------------------------------------------------------------------- audits


def load_claims(path: str | Path) -> ClaimFile:
    """Read and validate a claim file (YAML)."""
    from probe.spec.claims import load_claims as _load

    return _load(path)


def audit(claims: ClaimFile | Mapping[str, Any] | str | Path, *, out: str | Path | None = None,
          model: ProbeModel | None = None, progress: bool = False) -> AuditResult:
    """Test the claims of a claim file (its path, a validated :class:`~probe.spec.claims.ClaimFile`, or a dict with the
    YAML's structure) by intervention: ``result.claims[i].verdict`` is supported, refuted or
    inconclusive, with effect, CI and evidence. ``model``: an already loaded :class:`ProbeModel`
    to audit instead of the file's. With ``out``, audit.json/.md/.html are written there."""
    from probe.claims.run import run_audit
    from probe.spec.claims import ClaimFile, claims_from_dict

    if isinstance(claims, (str, Path)):
        claim_file = load_claims(claims)
    elif isinstance(claims, ClaimFile):
        claim_file = claims
    elif isinstance(claims, Mapping):
        claim_file = claims_from_dict(dict(claims))
    else:
        raise InputError(f"claims must be a claim file's path, a ClaimFile or a dict, got {type(claims).__name__}")
    return run_audit(claim_file, out_dir=out, progress=progress, model=None if model is None else _model(model, "model"))


# Every public function binds its arguments first: a misspelt keyword is one line naming the accepted ones.
for _name in ("audit", "capture", "counterfactual_attention", "erasure", "explain", "find_spans", "head_ablation",
              "head_importance", "load_claims", "load_explanation", "load_model", "load_results", "load_study", "loo",
              "prepare", "run_study", "span_loo", "study_from_dict", "wrap"):
    globals()[_name] = _arguments_checked(globals()[_name])
del _name

__all__ = [
    "COUNTERFACTUALS", "Explanation", "ScoresWarning", "Texts", "TopTokens", "audit", "capture", "counterfactual_attention",
    "erasure", "explain", "head_ablation", "head_importance", "load_claims", "load_explanation", "load_model",
    "load_results", "load_study", "loo", "prepare", "run_study", "study_from_dict", "wrap",
]
