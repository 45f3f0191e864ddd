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

Size: the whole Python API a notebook calls, each function with the docstring help() and the API
page show and its argument check as a visible decorator; split, a user's one page would be several.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Union

import pandas as pd
import torch

from probe import registry
from probe.errors import InputError, check_flag, positive_int
from probe.explanation import Explanation, ScoresWarning, TopTokens, load_explanation
from probe.models.core import ProbeModel
from probe.rows.inputs import (
    arguments_checked,
    check_prepared_by,
    in_eval,
    is_pipeline,
    probe_model,
    text_list,
    unknown_keywords,
)
from probe.rows.scores import TokenScores
from probe.rows.target import TARGET_KEYWORDS, PreparedExample, TargetKeywords, TargetSpec, target_from

if TYPE_CHECKING:
    from transformers import Pipeline, PreTrainedModel, PreTrainedTokenizerBase
    from typing_extensions import Unpack

    from probe.claims.run import AuditResult
    from probe.claims.spec import ClaimFile
    from probe.hooks.capture import Capture
    from probe.hooks.types import Editor
    from probe.intervene.counterfactual import CounterfactualResult
    from probe.intervene.heads import HeadEffects, HeadImportance
    from probe.report.results import StudyResult
    from probe.spec.study import Study

# a text, texts, examples from prepare(), or an Explanation (its examples: the same targets again)
Texts = Union[str, Sequence[str], Sequence[PreparedExample], "Explanation", pd.Series, pd.DataFrame]
COUNTERFACTUALS = tuple(c.name for c in registry.COUNTERFACTUALS)
#: target keywords that counterfactual_attention passes on to its search instead (adversarial's ``steps``)
SEARCH_KEYWORDS = ("steps",)

# --------------------------------------------------------------------------------------- checks of arguments


def _no_gradients_here(methods: Sequence[str], doing: str = "probe.explain") -> None:
    """Refuse, in one line, methods that need gradients under ``torch.inference_mode()``."""
    from probe.methods import refuse_gradients_under_inference_mode

    refuse_gradients_under_inference_mode(methods, doing)


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


# --------------------------------------------------------------------------------------- models


@arguments_checked
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
    from probe.progress import quiet_notebook_import

    quiet_notebook_import()
    own = [p for p in inspect.signature(load_model).parameters if p != "options"]
    unknown_keywords(options, [*own, *(p for p in inspect.signature(_load).parameters if p not in own)],
                     "probe.load_model()")
    if not isinstance(name, (str, Path)):
        raise InputError(not_a_model_name(name))
    return _load(str(name), device=device, dtype=dtype, attn_implementation=attn_implementation, task=task,
                 cache_dir=cache_dir, **options)


@arguments_checked
def wrap(model: PreTrainedModel | Pipeline, tokenizer: PreTrainedTokenizerBase | None = None, *,
         name: str | None = None, task: str | None = None) -> ProbeModel:
    """A :class:`ProbeModel` for a Hugging Face model and tokenizer already in memory, with the
    same contract :func:`load_model` builds; or for a transformers ``Pipeline`` (its ``model`` and
    ``tokenizer``; then no ``tokenizer``). The model is switched to eval mode; the tokenizer is
    copied (right padding, a pad token). A pair that does not fit (a tokenizer larger than the
    model's embedding, a model without a head or without attention) is refused in one line."""
    from probe.models.loading import wrap_model

    if is_pipeline(model):
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


@arguments_checked
@in_eval
def prepare(pm: ProbeModel, texts: str | Sequence[str], *, target: TargetSpec | None = None,
            strict_length: bool = False, **keywords: Unpack[TargetKeywords]) -> list[PreparedExample]:
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
    scored, never a turn of its own (a tokenizer that cannot spell it refuses it in one line).

    The target is ``target`` (a :class:`~probe.rows.target.TargetSpec`) or the keywords
    (:class:`~probe.rows.target.TargetKeywords`, folded into one; beside ``target`` they must agree with
    it). A headless encoder's targets: ``kind="similarity", reference=TEXT`` (the cosine of the pooled
    embeddings) and ``kind="dimension", dimension=N`` (a component of the pooled embedding)."""
    target = target_from(target, **keywords)
    from probe.rows.prepare import prepare as _prepare

    return _prepare(pm, text_list(texts, chat=target.chat), target, strict_length=strict_length)


def _examples(pm: ProbeModel, texts: Texts, target: TargetSpec, *, strict_length: bool = False) -> list[PreparedExample]:
    """Texts prepared for ``target``, or prepared examples as they are (then no target options)."""
    if isinstance(texts, Explanation):
        texts = texts.examples
    items = text_list(texts, chat=target.chat)
    if all(isinstance(e, PreparedExample) for e in items):
        if target != TargetSpec():
            raise InputError("label, continuation, kind, the contrasts, generate, steps and chat apply to texts; these "
                             "examples are prepared already (their targets are fixed): pass the texts instead")
        check_prepared_by(pm, items)
        return items
    conversation = target.chat and all(isinstance(e, (str, list, tuple)) for e in items)
    if not conversation and not all(isinstance(e, str) for e in items):
        kinds = sorted({type(e).__name__ for e in items})
        raise InputError(f"texts must be strings or examples from probe.prepare, got {', '.join(kinds)}"
                         + ("" if target.chat else " (a conversation, a list of messages, needs chat=True)"))
    return prepare(pm, items, target=target, strict_length=strict_length)


# --------------------------------------------------------------------------------------- explain


@arguments_checked
@in_eval
def explain(pm: ProbeModel, texts: Texts, methods: str | Sequence[str] | None = None, *,
            params: Mapping[str, Mapping[str, Any]] | None = None, strict_length: bool = False,
            progress: bool = False, spans: str | Sequence[tuple[int, int]] | None = None,
            target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> Explanation:
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
    The target: ``target`` (a :class:`~probe.rows.target.TargetSpec`) or its keywords, as :func:`prepare` takes them.
    ``spans``: units to read the scores by, a regular expression (each match) or character offsets
    ``[(start, end), ...]`` into each text; ``to_pandas(level="span")`` then folds every method's
    token scores over them (``probe.rows.spans``).
    """
    target = target_from(target, **keywords)
    from probe.methods import applicable_methods, run_methods

    chosen = _method_names(methods)  # validate before tokenising; None or "all": every method that applies
    params = _method_params(params)
    if chosen is not None:
        _no_gradients_here(chosen)
    if spans is not None:
        from probe.rows.spans import span_spec

        span_spec(spans)  # a wrong type or a bad pattern refused before any method runs
    examples = _examples(pm, texts, target, strict_length=strict_length)
    skipped: dict[str, str] = {}
    if chosen is None:
        chosen, skipped = applicable_methods(pm, examples)
        _no_gradients_here(chosen)
    unused = [m for m in params if m not in chosen]
    if unused:
        raise InputError(f"params given for {unused[0]!r}, which is not among the methods run ({', '.join(chosen)})")
    params = _auto_steps_for_outputs(examples, chosen, params)
    results = run_methods(pm, examples, chosen, params=params, progress=check_flag(progress, "progress"))
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


@arguments_checked
@in_eval
def loo(pm: ProbeModel, texts: Texts, mode: str = "delete", *, k: int = 8, seed: int = 0, progress: bool = False,
        target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> TokenScores:
    """Leave-one-out: per example ``[tokens]`` scores f(x) - f(x with the token deleted or replaced),
    ``mode`` one of delete, mask, unk, pad, random, lm (``k`` seeded draws for random and lm).
    Special tokens get NaN. ``extras["original_values"]`` holds f(x) per example. ``progress``: a
    bar over the forward batches. The target: ``target`` or its keywords (see :func:`prepare`)."""
    target = target_from(target, **keywords)
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo as _loo

    examples = _examples(pm, texts, target)
    return _loo(Engine(pm, progress=check_flag(progress, "progress")), examples, mode, k=k, seed=seed)


@arguments_checked
@in_eval
def span_loo(pm: ProbeModel, texts: Texts, spans: str | Sequence[tuple[int, int]], mode: str = "delete", *,
             target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> pd.DataFrame:
    """Leave-one-out of whole spans: per (example, span), ``score`` = f(x) - f(x with every token of
    the span deleted, or replaced by the mask, unk or pad token: ``mode``). ``spans``: a regular
    expression (each match is a span), character offsets ``[(start, end), ...]`` into each
    text, or ``"@roles"`` with ``chat=True`` (each message of the conversation, a ``role`` column
    naming it); a token belongs to a span when its characters overlap it, special tokens never.
    ``generate=N``: every output token of the greedy output is its own example. Columns:
    example, span_index, span, start, end, n_tokens, mode, score, original_value. The target:
    ``target`` or its keywords (see :func:`prepare`)."""
    target = target_from(target, **keywords)
    from probe.intervene.engine import Engine
    from probe.intervene.spans import span_loo as _span_loo
    from probe.rows.spans import span_spec, spans_per_example

    span_spec(spans)  # a wrong type or a bad pattern refused before the texts are prepared
    examples = _examples(pm, texts, target)
    return _span_loo(Engine(pm), examples, spans_per_example(pm, examples, spans), mode)


@arguments_checked
def find_spans(pm: ProbeModel, example: PreparedExample, spans: str | Sequence[tuple[int, int]]) -> list:
    """The spans of one prepared example (:class:`probe.rows.spans.Span`: text, start, end,
    token positions), as :func:`span_loo` and ``explain(..., spans=)`` find them."""
    from probe.rows.spans import find_spans as _find

    return _find(pm, example, spans)


@arguments_checked
@in_eval
def erasure(pm: ProbeModel, texts: Texts, rankings: Mapping[str, TokenScores | Sequence[torch.Tensor]] | None = None,
            *, bins: Sequence[float] | None = None, seed: int = 0, flips: bool = True, progress: bool = False,
            target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> pd.DataFrame:
    """Erasure curves (comprehensiveness, sufficiency, AOPC, decision flips) of each ranking, always
    beside a seeded random ranking (``ranking == "random"``).

    ``texts`` is usually an :class:`Explanation`: its examples are used and, when ``rankings`` is
    None, its token-level methods (``[tokens]`` per example) are the rankings. A ranking is a
    :class:`TokenScores` or one ``[tokens]`` tensor per example, higher = more important. Returns
    one row per (example, ranking, bin); see ``probe.intervene.erasure.erasure``. ``bins``:
    fractions of the scorable tokens (default ``ERASURE_BINS``, 1% to 50%). ``progress``: a bar
    over the forward batches. The target of texts: ``target`` or its keywords (see :func:`prepare`).
    """
    target = target_from(target, **keywords)
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
    examples = _examples(pm, texts, target)
    return _erasure(Engine(pm, progress=check_flag(progress, "progress")), examples, dict(rankings), bins=ERASURE_BINS if bins is None else bins, seed=seed,
                    flips=flips)


@arguments_checked
@in_eval
def head_ablation(pm: ProbeModel, texts: Texts, *, stack: str | None = None, batch_size: int = 32,
                  target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> HeadEffects:
    """Each head of ``stack`` (default: the one that reads the target) ablated alone.
    ``result.change`` is ``[example, layer, head]`` original - ablated target; ``result.mean_abs_change``
    ``[layer, head]``. The target: ``target`` or its keywords (see :func:`prepare`)."""
    target = target_from(target, **keywords)
    from probe.intervene.heads import head_ablation_effects

    positive_int(batch_size, "batch_size")
    examples = _examples(pm, texts, target)
    return head_ablation_effects(pm, examples, stack=stack, batch_size=batch_size)


@arguments_checked
@in_eval
def head_importance(pm: ProbeModel, texts: Texts, *, stack: str | None = None, loss: str = "nll",
                    ablation: bool = True, target: TargetSpec | None = None, **keywords: Unpack[TargetKeywords]) -> HeadImportance:
    """Michel et al. head importance ``[layer, head]`` (``E_x |dL/dxi_h|``, L2-normalised per layer),
    with the single-head ablation effect beside it when ``ablation``. The target: ``target`` or its
    keywords (see :func:`prepare`)."""
    target = target_from(target, **keywords)
    from probe.intervene.heads import head_importance as _importance

    if torch.is_inference_mode_enabled():
        raise InputError("head importance needs gradients, which torch.inference_mode() switches off: call "
                         "probe.head_importance outside the `with torch.inference_mode():` block")
    examples = _examples(pm, texts, target)
    return _importance(pm, examples, stack=stack, loss=loss, ablation=ablation)


@arguments_checked(passed_on=SEARCH_KEYWORDS)
@in_eval
def counterfactual_attention(pm: ProbeModel, texts: Texts, how: str = "uniform", *, layer: int = -1,
                             head: int | None = None, target: TargetSpec | None = None,
                             **options: Any) -> CounterfactualResult:
    """Inject ``how`` = uniform, permuted or adversarial attention at the target query's row of
    ``layer`` (negative counts from the last) and ``head`` (None: every head of the layer), and
    measure the output change: ``output_tvd``, ``output_jsd``, ``target_change`` ``[example,
    sample]``, and ``summary()`` per example. ``options`` go to the function of that name in
    ``probe.intervene.counterfactual`` (permuted: ``n``, ``seed``; adversarial: ``candidates``,
    ``steps``, ``bound``, ``seed``, ...). The target: ``target`` or its keywords (see :func:`prepare`;
    ``steps`` is the adversarial search's, so output tokens one by one are ``generate=N`` or ``target=``)."""
    import inspect

    if how not in COUNTERFACTUALS:
        raise InputError(f"unknown counterfactual attention {how!r}: use one of {', '.join(COUNTERFACTUALS)}")
    own = [p for p in inspect.signature(counterfactual_attention).parameters if p not in ("pm", "texts", "options")]
    own += [k for k in TARGET_KEYWORDS if k not in SEARCH_KEYWORDS]
    passed_on = [p for p in inspect.signature(registry.counterfactual(how).load()).parameters
                 if p not in ("pm", "examples", "layer", "head")]
    unknown_keywords(options, [*own, *passed_on], f"probe.counterfactual_attention(how={how!r})")
    if registry.counterfactual(how).needs_gradients and torch.is_inference_mode_enabled():
        raise InputError(f"{how} attention searches by gradient, which torch.inference_mode() switches off: call "
                         "probe.counterfactual_attention outside the `with torch.inference_mode():` block")
    target = target_from(target, **{k: options.pop(k) for k in TARGET_KEYWORDS if k not in SEARCH_KEYWORDS and k in options})
    examples = _examples(pm, texts, target)
    return registry.counterfactual(how).load()(pm, examples, layer=layer, head=head, **options)


# --------------------------------------------------------------------------------------- capture


@arguments_checked
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


@arguments_checked
def load_study(path: str | Path, *, n: int | None = None, dataset: str | None = None, device: str | None = None,
               dtype: str | None = None, out: str | Path | None = None) -> Study:
    """Read and validate a study file (YAML), with the command line's overrides (``n``,
    ``dataset``, ``device``, ``dtype``, ``out``)."""
    from probe.spec.study import load_study as _load

    return _load(path, n=n, dataset=dataset, device=device, dtype=dtype, out=None if out is None else str(out))


@arguments_checked
def study_from_dict(data: Mapping[str, Any]) -> Study:
    """Validate a study given as a dict (the YAML's structure)."""
    from probe.spec.study import study_from_dict as _from_dict

    if not isinstance(data, Mapping):
        raise InputError(f"data must be a dict with the study file's keys (name, model, dataset, ...), got "
                         f"{type(data).__name__}")
    return _from_dict(dict(data))


@arguments_checked
def load_results(folder: str | Path) -> StudyResult:
    """Read a study's result folder (finished, or part-way through its batches) without a model:
    its tables, typed verdict and provenance (:class:`~probe.report.results.StudyResult`)."""
    from probe.report.results import load_result

    return load_result(folder)


@arguments_checked
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
        from probe.study.sizes import check_sizes

        study, file = load_study(study, out=out), study
        check_sizes(study, file=file)  # names the file's line; the runner checks again without it
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
        model = probe_model(model, "model")
        if study.model.id != model.name:
            study = study.model_copy(update={"model": study.model.model_copy(update={"id": model.name})})
    if log is None:
        log = (lambda text: print(text, file=sys.stderr)) if progress else (lambda _: None)

    def write_report(root: Path) -> None:
        from probe.report.build import build_report, report_is_current

        if report_is_current(root):
            log(f"report: {root / 'report' / 'report.html'} (up to date)")
            return
        started = time.perf_counter()
        html = build_report(root).html
        log(f"report: {html} (written in {time.perf_counter() - started:.1f} s)")

    run = _run(study, shard=shard, progress=progress, log=log,
               on_complete=write_report if report else None, wait=wait, force_new=force_new, model=model)
    return dataclasses.replace(load_result(run.out), computed=tuple(run.computed))


# --------------------------------------------------------------------------------------- audits


@arguments_checked
def load_claims(path: str | Path) -> ClaimFile:
    """Read and validate a claim file (YAML)."""
    from probe.claims.file import load_claims as _load

    return _load(path)


@arguments_checked
def audit(claims: ClaimFile | Mapping[str, Any] | str | Path, *, out: str | Path | None = None,
          model: ProbeModel | None = None, progress: bool = False) -> AuditResult:
    """Test the claims of a claim file (its path, a validated :class:`~probe.claims.spec.ClaimFile`, or a dict with the
    YAML's structure) by intervention: ``result.claims[i].verdict`` is supported, refuted or
    inconclusive, with effect, CI and evidence. ``model``: an already loaded :class:`ProbeModel`
    to audit instead of the file's. With ``out``, audit.json/.md/.html are written there."""
    from probe.claims.file import claims_from_dict
    from probe.claims.run import run_audit
    from probe.claims.spec import ClaimFile

    if isinstance(claims, (str, Path)):
        claim_file = load_claims(claims)
    elif isinstance(claims, ClaimFile):
        claim_file = claims
    elif isinstance(claims, Mapping):
        claim_file = claims_from_dict(dict(claims))
    else:
        raise InputError(f"claims must be a claim file's path, a ClaimFile or a dict, got {type(claims).__name__}")
    return run_audit(claim_file, out_dir=out, progress=progress, model=None if model is None else probe_model(model, "model"))


__all__ = [
    "COUNTERFACTUALS", "Explanation", "ScoresWarning", "Texts", "TopTokens", "audit", "capture", "counterfactual_attention",
    "erasure", "explain", "head_ablation", "head_importance", "load_claims", "load_explanation", "load_model",
    "load_results", "load_study", "loo", "prepare", "run_study", "study_from_dict", "wrap",
]
