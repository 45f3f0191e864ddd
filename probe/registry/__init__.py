"""The one list of methods: each explainer, reference and counterfactual is one registered entry.

An entry owns its name, family, what it applies to, whether it takes a seed, its implementation
(a lazy ``module:function`` path, so importing this module imports no torch) and a frozen
dataclass of its parameters with their defaults (:mod:`probe.registry.params`). :mod:`probe.names`, :mod:`probe.methods`,
the CLI and the README's method table read it; nothing else lists method names.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from probe.errors import InputError
from probe.registry.params import (
    AdversarialParams,
    AtpParams,
    AttentionParams,
    AttnGradParams,
    AttnNormParams,
    DecompositionParams,
    FlowParams,
    GradientParams,
    GradientShapParams,
    IntegratedGradientsParams,
    KnockoutParams,
    LeaveOneOutParams,
    NoSinkParams,
    PermutedParams,
    ShapleyParams,
    UniformParams,
    ValueZeroingParams,
    limit_problem,
)

FAMILIES = ("attention", "gradient", "intervention")
#: the kinds of attention explanation the verdict answers for separately, in its order; the first
#: (the attention weights themselves) is the headline's
VERDICT_FAMILIES = ("attention weights", "attention-derived", "context mixing", "attention x gradient")


# ---------------------------------------------------------------------------
# what a method applies to
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Applies:
    """When a method runs by default; each field, when set, is one reason to leave it out.

    ``tasks``: the model tasks it needs (None: any); ``token``: a tokenizer token it needs
    (``mask`` or ``unk``); ``max_tokens``: the longest input it takes; ``support``: a
    ``module:function(pm, method) -> reason | None`` checking the model's layout (loaded lazily);
    ``by_name``: why it is only run when asked for by name."""
    tasks: tuple[str, ...] | None = None
    task_reason: str = ""
    token: str | None = None
    max_tokens: int | None = None
    support: str | None = None
    by_name: str | None = None


TOKEN_ATTRIBUTES = {"mask": "mask_token_id", "unk": "unk_token_id"}
TOKEN_WORDS = {"mask": "mask token", "unk": "unknown token"}


def _load(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


#: the ways a leave-one-out perturbs a whole span (probe.intervene.spans.span_loo)
SPAN_MODES = ("delete", "mask", "unk", "pad")


@dataclass(frozen=True)
class Method:
    """One registered method.

    ``family`` is attention, gradient or intervention; ``group`` the row of the README's table
    (context mixing is attention-family); ``note`` the README's words beside the name;
    ``implementation`` computes it (``module:function``), with ``preset`` keywords fixed for this
    name (``attn_norm_sum`` = attn_norm with per_head False; ``loo_mask`` = loo with mode mask);
    ``scorer`` is the family's by-name entry that runs it (``scorer(pm, examples, name, **params)``,
    or with ``engine`` True ``scorer(engine, examples, **preset, **params)`` on the shared
    intervention engine); ``listed`` False for a variant that is
    run by name only and is not one of :data:`METHODS` (its name is still unique here);
    ``per_head`` True where it scores every layer x head (a claim may name one head);
    ``query_max`` the function (``module:function(pm, examples, **params)``) that computes it with
    ``query: max`` (the maximum over every query row), None where it takes only the target query;
    ``verdict_family`` the kind of attention explanation the verdict counts it under (one of
    :data:`VERDICT_FAMILIES`; attention family only); ``signed`` True where the sign of a score says
    whether the token pushes the target up or down (the sign check compares it with a signed reference).

    Gradient methods: ``reduction`` (``"l2"``, ``"l1"`` or ``"sum"`` over the embedding axis) marks one computed
    from a single gradient of the target, shared between such methods, with ``times_input`` True
    where it is embedding x gradient; ``points`` names the parameter that says how many inputs one
    example becomes (IG's steps, GradientSHAP's samples; ``"auto"`` there: the method picks, and
    buckets its own rounds); ``completeness`` True where the scores should sum to f(x) - f(baseline)
    (the completeness check runs on them). ``needs_gradients`` True where it runs a backward pass
    (every gradient method, and attention x gradient): not under ``torch.no_grad`` or
    ``inference_mode``."""
    name: str
    family: str
    group: str
    implementation: str
    params: type
    scorer: str
    applies: Applies = Applies()
    preset: tuple[tuple[str, Any], ...] = ()
    takes_seed: bool = False
    note: str = ""
    label: str | None = None
    listed: bool = True
    engine: bool = False
    per_head: bool = False
    query_max: str | None = None
    verdict_family: str | None = None
    signed: bool = False
    reduction: str | None = None
    times_input: bool = False
    points: str | None = None
    completeness: bool = False
    needs_gradients: bool = False
    #: what the method assumes of softmax attention, where it does: it is then left out on a model
    #: whose maps are implicit (a state-space mixer's signed matrix, probe.hooks.implicit); None
    #: where it only reads the captured [query, key] map
    needs_softmax: str | None = None
    #: an intervention whose whole-span form is not a leave-one-out (``span_mode``): the function
    #: (``module:function(engine, examples, spans, **params)``, one vector per example in span order)
    #: that scores each example's spans as its units (Shapley values with the spans as players)
    span_scorer: str | None = None

    @property
    def bottom_up(self) -> bool:
        """Whether its layer-l scores are computed from the embeddings and layers 0..l alone (a forward
        read of attention, rolled or decomposed up to layer l): the randomisation check then asks
        each unit about exactly those weights. Attention x gradient reads the gradient of the target,
        which flows from every layer above: not bottom-up."""
        return self.family == "attention" and not self.needs_gradients

    @property
    def reads_attention(self) -> bool:
        """Whether it reads (or edits) the model's attention modules through probe's hooks."""
        return self.family == "attention"

    def load(self) -> Callable[..., Any]:
        """The implementation function (imports its module, and torch, on first use)."""
        return _load(self.implementation)

    def load_scorer(self) -> Callable[..., Any]:
        return _load(self.scorer)

    def load_span_scorer(self) -> Callable[..., Any]:
        return _load(self.span_scorer)

    def load_query_max(self) -> Callable[..., Any]:
        """The function computing this method with ``query: max`` (an error where it takes none)."""
        if self.query_max is None:
            raise ValueError(f"{self.name} takes only the target query")
        return _load(self.query_max)

    def defaults(self) -> Any:
        """The frozen parameters with their defaults (the preset applied)."""
        return self.params(**dict(self.preset))

    def settings(self, params: Mapping[str, Any] | None = None) -> str:
        """The settings that make its numbers differ from captum's or inseq's usual ones, as words
        (``"L2"``: the gradient's norm over the embedding axis, where captum users sum |grad|;
        ``"baseline pad, specials replaced"``: a path method's baseline, at [CLS]/[SEP] too unless
        ``keep_special``, where captum's tutorial keeps them); "" where none. ``params``: the
        parameters given or the ones a result recorded (``baseline_keeps_special``); defaults fill the rest."""
        words = [REDUCTION_WORDS[self.reduction]] if self.reduction is not None and not self.times_input else []
        given, defaults = dict(params or {}), self.defaults()
        if hasattr(defaults, "baseline") and hasattr(defaults, "keep_special"):
            baseline = given.get("baseline", defaults.baseline)
            kept = given.get("baseline_keeps_special", given.get("keep_special", defaults.keep_special))
            shown = "+".join(map(str, baseline)) if isinstance(baseline, (list, tuple)) else baseline
            words.append(f"baseline {shown}, specials {'kept' if kept else 'replaced'}")
        return ", ".join(words)

    @property
    def span_mode(self) -> str | None:
        """How this leave-one-out perturbs a whole span (:data:`SPAN_MODES`: its tokens deleted, or each
        replaced by the mask, unk or pad token), or None where it has no span form (a resampled or
        language-model replacement, or not an intervention)."""
        mode = dict(self.preset).get("mode")
        return mode if self.family == "intervention" and mode in SPAN_MODES else None

    @property
    def has_span_form(self) -> bool:
        """Whether it can score whole spans as its units: a leave-one-out with a span form
        (:attr:`span_mode`) or a ``span_scorer`` (Shapley values with the spans as players)."""
        return self.span_mode is not None or self.span_scorer is not None

    def skip_reason(self, check: str, pm: Any, longest: int) -> str | None:
        """Why ``check`` (one of :data:`CHECKS`) leaves this method out for ``pm``, or None."""
        a = self.applies
        if check == "task" and a.tasks is not None and pm.task.name not in a.tasks:
            return a.task_reason
        if check == "token" and a.token is not None and getattr(pm.tokenizer, TOKEN_ATTRIBUTES[a.token]) is None:
            return f"the tokenizer has no {TOKEN_WORDS[a.token]}"
        if check == "length" and a.max_tokens is not None and longest > a.max_tokens:
            return f"{self.label or self.name} is limited to {a.max_tokens} tokens (longest input has {longest})"
        if check == "by_name" and a.by_name is not None:
            return a.by_name
        if check == "maps" and self.needs_softmax is not None:
            stacks = getattr(getattr(pm, "contract", None), "stacks", None) or {}
            implicit = [s for s in stacks.values() if not getattr(s, "softmax", True)]
            if implicit:
                s = implicit[0]
                which = "are" if s.implicit else "include"  # every layer implicit, or some (a hybrid)
                return (f"{self.label or self.name} {self.needs_softmax}; this model's {s.stack} maps {which} "
                        f"the implicit matrices of {s.mixer_class or s.module_class} (signed, rows need not sum to "
                        f"one)")
        if check == "support" and a.support is not None:
            return _load(a.support)(pm, self.name)
        return None


#: the order in which :func:`skipped` asks each method's applicability (the reasons keep this order)
CHECKS = ("task", "token", "length", "by_name", "maps", "support")
_DECOMPOSES = "decomposes a softmax attention block through its value and output projections"


@dataclass(frozen=True)
class Group:
    """A row of the README's method table: the methods of one kind and what they are."""
    name: str
    what: str


@dataclass(frozen=True)
class Counterfactual:
    """Counterfactual attention injected at one layer (and head): not a token-scoring method.
    ``needs_gradients`` True where it runs a backward pass (the adversarial search)."""
    name: str
    implementation: str
    params: type
    takes_seed: bool = False
    needs_gradients: bool = False

    def load(self) -> Callable[..., Any]:
        return _load(self.implementation)

    def defaults(self) -> Any:
        return self.params()


#: how a gradient method that is not embedding x gradient folds the embedding axis, as its label says
REDUCTION_WORDS = {"l2": "L2", "l1": "L1", "sum": "signed sum"}


def labelled(name: str, params: Mapping[str, Any] | None = None) -> str:
    """``name`` with the settings that make its numbers differ from captum's or inseq's
    (:meth:`Method.settings`): ``"saliency (L2)"``, ``"integrated_gradients (baseline pad, specials
    replaced)"``; the name alone where there are none or the name is not registered."""
    entry = _BY_NAME.get(name)
    words = entry.settings(params) if entry is not None else ""
    return f"{name} ({words})" if words else name


# ---------------------------------------------------------------------------
# the entries
# ---------------------------------------------------------------------------

_ATT = "probe.explainers.attention"
_ROLL = "probe.explainers.rollout"
_MIX = "probe.explainers.context_mixing"
_GRAD = "probe.explainers.gradients"
_IG = "probe.explainers.integrated_gradients"
_LOO = "probe.intervene.tokens:loo"
_SUPPORT = "probe.models.architectures:context_mixing_support"
FLOW_MAX_TOKENS = FlowParams.max_tokens


def _attention(name: str, params: type = AttentionParams, *, verdict_family: str = "attention weights",
               module: str = _ATT, **kw: Any) -> Method:
    return Method(name, "attention", "attention", f"{module}:{name}", params, f"{_ATT}:attention_scores",
                  verdict_family=verdict_family, **kw)


def _mixing(name: str, params: type = DecompositionParams, *, support: str = _SUPPORT) -> Method:
    return Method(name, "attention", "context mixing", f"{_MIX}:{name}", params, f"{_MIX}:context_mixing_scores",
                  applies=Applies(support=support), verdict_family="context mixing", needs_softmax=_DECOMPOSES)


def _gradient(name: str, params: type = GradientParams, *, module: str = _GRAD, **kw: Any) -> Method:
    return Method(name, "gradient", "gradient", f"{module}:{name}", params, f"{_GRAD}:gradient_scores",
                  needs_gradients=True, **kw)


def _loo(mode: str, **kw: Any) -> Method:
    return Method(f"loo_{mode}", "intervention", "intervention", _LOO, LeaveOneOutParams, _LOO,
                  preset=(("mode", mode),), engine=True, signed=True, **kw)


REGISTRY: tuple[Method, ...] = (
    _attention("attention", note="per layer x head", per_head=True),
    _attention("attention_mean", query_max=f"{_ATT}:attention_mean_max_over_queries"),
    _attention("rollout", query_max=f"{_ATT}:rollout_max_over_queries", verdict_family="attention-derived",
               module=_ROLL, needs_softmax="mixes each layer's map with 0.5 I and multiplies the layers, reading "
                                           "rows as probability distributions"),
    _attention("flow", FlowParams, module=_ROLL, applies=Applies(max_tokens=FLOW_MAX_TOKENS),
               label="attention flow", query_max=f"{_ROLL}:flow_max_over_queries", verdict_family="attention-derived",
               needs_softmax="uses the maps' weights as max-flow capacities, which must be non-negative probabilities"),
    _attention("attn_norm", AttnNormParams, per_head=True, verdict_family="context mixing",
               applies=Applies(support="probe.models.architectures:attn_norm_support"),
               needs_softmax="weights softmax attention by the norms of its value vectors"),
    _attention("attn_grad", AttnGradParams, per_head=True, verdict_family="attention x gradient", signed=True,
               needs_gradients=True, needs_softmax="differentiates the target through edited softmax weights"),
    _attention("attention_nosink", NoSinkParams, module="probe.explainers.sinks", per_head=True,
               verdict_family="attention-derived", note="per layer x head, sink keys left out",
               applies=Applies(by_name="a variant of attention (sink keys left out, the row renormalised); ask for "
                                       "attention_nosink by name"),
               needs_softmax="finds sinks as keys receiving most of the softmax rows' mass and renormalises the rows"),
    _mixing("value_zeroing", ValueZeroingParams, support="probe.models.architectures:value_zeroing_support"),
    _mixing("alti"),
    _mixing("globenc"),
    _gradient("saliency", note="L2", reduction="l2"),
    # captum's Saliency (abs=True) summed over the embedding axis, as captum's tutorials sum it (and inseq's
    # 2021 sources did); inseq 0.7 takes the L2 norm, as `saliency` does (README: Coming from captum, inseq or bertviz)
    _gradient("saliency_l1", note="L1", reduction="l1",
              applies=Applies(by_name="a variant of saliency (L1 norm, captum's Saliency summed); ask for it by name")),
    _gradient("saliency_sum", applies=Applies(by_name="a variant of saliency; ask for it by name"), signed=True,
              reduction="sum"),
    _gradient("input_x_gradient", signed=True, reduction="sum", times_input=True),
    _gradient("integrated_gradients", IntegratedGradientsParams, signed=True, module=_IG, points="steps",
              completeness=True),
    _gradient("gradient_shap", GradientShapParams, takes_seed=True, signed=True, module=_IG, points="n_samples"),
    _loo("delete"),
    _loo("mask", applies=Applies(token="mask")),
    _loo("unk", applies=Applies(token="unk")),
    _loo("pad"),
    _loo("random", takes_seed=True),
    _loo("lm", takes_seed=True, applies=Applies(tasks=("causal_lm",),
                                                task_reason="needs a causal LM to draw in-context replacements")),
    Method("shapley", "intervention", "intervention", "probe.intervene.shapley:shapley", ShapleyParams,
           "probe.intervene.shapley:shapley", engine=True, signed=True, takes_seed=True,
           note="exact or sampled", span_scorer="probe.intervene.shapley:span_shapley",
           applies=Applies(by_name="Shapley values cost 2^n coalitions (exact) or permutations x tokens rows per "
                                   "example; ask for shapley by name")),
    Method("knockout", "intervention", "intervention", "probe.intervene.knockout:knockout", KnockoutParams,
           "probe.intervene.knockout:knockout_scores", signed=True, note="attention edges to the token blocked",
           span_scorer="probe.intervene.spans:span_knockout",
           applies=Applies(by_name="edge knockout edits the attention weights (one row per token, or per layer x "
                                   "head x token with per_head); ask for knockout by name"),
           needs_softmax="blocks edges of softmax attention rows and renormalises them"),
    Method("atp", "intervention", "intervention", "probe.intervene.atp:atp", AtpParams,
           "probe.intervene.atp:atp_scores", signed=True, needs_gradients=True,
           note="first-order estimate of knockout",
           applies=Applies(by_name="atp estimates knockout to first order (one backward per batch), a screen for "
                                   "which edges and heads to run exactly; ask for atp by name"),
           needs_softmax="linearises the target in the weights of softmax attention rows and renormalises them"),
    # attn_norm summed over heads: a variant, run by name only (probe.explainers.attention.attention_scores)
    Method("attn_norm_sum", "attention", "attention", f"{_ATT}:attn_norm", AttnNormParams, f"{_ATT}:attention_scores",
           preset=(("per_head", False),), listed=False, verdict_family="context mixing",
           applies=Applies(support="probe.models.architectures:attn_norm_support"),
           needs_softmax="weights softmax attention by the norms of its value vectors"),
)

GROUPS: tuple[Group, ...] = (
    Group("attention", "the target query's row: [CLS] for classifiers, the last prompt token for causal LMs, the "
          "decoder's cross-attention for seq2seq; rollout and flow as Abnar & Zuidema (residual 0.5 I); `attn_norm` "
          "is Kobayashi et al.'s `‖α f(x)‖`; `attn_grad` is α x ∂target/∂α. Flow is limited to "
          f"{FLOW_MAX_TOKENS} tokens."),
    Group("context mixing", "attention measures that also count the values, the residual stream and the LayerNorms, "
          "per layer and rolled out to the target query's row (no identity added): value zeroing (Mohebbi et al. "
          "2023) is the cosine distance of each token's layer output when one token's value is zeroed in every head "
          "(one extra pass of one layer per token per layer, batched); ALTI (Ferrando et al. 2022) the L1-distance "
          "share of each token's exact term in the attention block's output; GlobEnc (Modarressi et al. 2022) the "
          "norm of that term through both LayerNorms. Post-LN encoders (BERT family), pre-LN decoders (Llama/GQA, "
          "GPT-2) and the encoders of BART, Marian, mBART and T5 (each decoder layer's head-mean cross-attention row "
          "times the encoder's rolled-out matrix: that hop is raw attention, not decomposed); `probe contract` "
          "states per model which of the three run, and other layouts are refused in one line."),
    Group("gradient", "captum at a named site (`--site`, study `params`): `word` (the word embeddings, before "
          "position embeddings) or `embeddings` (the output of the model's embeddings module, what enters the first "
          "layer). The default is `embeddings` where that module normalises its sum (BERT family: there x . grad on "
          "the word embedding is 0 exactly, PROTOCOLS.md), else `word`; recorded in params and provenance. IG "
          "baseline the pad embedding by default, special tokens included (`keep_special: true` keeps [CLS]/[SEP], "
          "as captum's tutorial reference does), Gauss-Legendre steps (or `steps: auto`), convergence delta "
          "reported. `saliency` is the L2 norm over the embedding axis (inseq's), `saliency_l1` the L1 norm "
          "(captum's Saliency summed)"),
    Group("intervention", "leave-one-out references: f(x) - f(x with the token deleted or replaced), on token ids, "
          "never re-tokenised text; `shapley`: each token's (or word's) Shapley value with absent tokens deleted or "
          "replaced as leave-one-out's, exact up to `exact_max` players, else sampled orders in antithetic pairs "
          "with a standard error; it sees tokens that stand in for each other, which single deletion cannot; `atp` "
          "(attribution patching): the first-order estimate of `knockout` per edge and of head ablation per head, "
          "from one backward"),
)

COUNTERFACTUALS: tuple[Counterfactual, ...] = (
    Counterfactual("uniform", "probe.intervene.counterfactual:uniform_attention", UniformParams),
    Counterfactual("permuted", "probe.intervene.counterfactual:permuted_attention", PermutedParams, takes_seed=True),
    Counterfactual("adversarial", "probe.intervene.counterfactual:adversarial_attention", AdversarialParams,
                   takes_seed=True, needs_gradients=True),
)

_BY_NAME = {m.name: m for m in REGISTRY}


# ---------------------------------------------------------------------------
# reading it
# ---------------------------------------------------------------------------

def _spelling(name: str) -> str:
    """A family or group name as compared: case, ``_`` and ``-`` do not matter (``context_mixing`` is
    ``context mixing``, ``attention-derived`` is ``attention derived``)."""
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


def family_names() -> tuple[str, ...]:
    """Every name ``family=`` takes: the registry's families (:data:`FAMILIES`), the rows of the
    README's method table (:data:`GROUPS`, e.g. ``context mixing``) and the verdict's kinds
    (:data:`VERDICT_FAMILIES`, e.g. ``attention-derived``), each once, in that order."""
    return tuple(dict.fromkeys((*FAMILIES, *(g.name for g in GROUPS), *VERDICT_FAMILIES)))


def _family_test(family: str) -> Callable[[Method], bool]:
    """Whether a method belongs to ``family`` (any spelling of :func:`family_names`). A registry
    family wins where a name is also a table row (``attention`` includes the context-mixing methods,
    as the verdict counts them); a table row next; then a verdict kind. An unknown name is a
    one-line error naming the valid ones."""
    wanted = _spelling(family)
    if wanted in FAMILIES:
        return lambda m: m.family == wanted
    if wanted in {g.name for g in GROUPS}:
        return lambda m: m.group == wanted
    kinds = {_spelling(v): v for v in VERDICT_FAMILIES}
    if wanted in kinds:
        return lambda m: m.verdict_family == kinds[wanted]
    raise InputError(f"unknown method family {family!r}: valid families are {', '.join(family_names())} "
                     "(spaces, '_' and '-' alike)")


def _group_name(group: str) -> str:
    wanted = _spelling(group)
    valid = [g.name for g in GROUPS]
    if wanted not in valid:
        raise InputError(f"unknown method group {group!r}: valid groups are {', '.join(valid)} "
                         "(spaces, '_' and '-' alike)")
    return wanted


def methods(*, family: str | None = None, group: str | None = None, listed: bool = True) -> tuple[Method, ...]:
    """The registered methods in order (only the listed ones unless ``listed`` is False).

    ``family``: a registry family (attention, gradient, intervention), a row of the README's method
    table (``context mixing``) or a verdict kind (``attention-derived``): :func:`family_names`, in
    any spelling (``context_mixing``); ``group``: a row of the table. Unknown names are refused in one line."""
    in_family = (lambda m: True) if family is None else _family_test(family)
    group = None if group is None else _group_name(group)
    return tuple(m for m in REGISTRY if (m.listed or not listed) and in_family(m)
                 and (group is None or m.group == group))


def names(**kw: Any) -> tuple[str, ...]:
    return tuple(m.name for m in methods(**kw))


def per_head_methods() -> tuple[str, ...]:
    """The listed methods that score every layer x head (a claim may name one head)."""
    return tuple(m.name for m in methods() if m.per_head)


def query_max_methods() -> tuple[str, ...]:
    """The listed methods that take ``query: max`` (the maximum over query rows)."""
    return tuple(m.name for m in methods() if m.query_max is not None)


def find(name: str) -> Method | None:
    return _BY_NAME.get(name)


def method(name: str) -> Method:
    """The entry called ``name`` (a listed method); a one-line error naming the valid ones."""
    entry = _BY_NAME.get(name)
    if entry is None or not entry.listed:
        raise InputError(f"unknown method {name!r}: valid methods are {', '.join(names())}")
    return entry


def seeded(names_: Iterable[str] | None = None) -> tuple[str, ...]:
    """The listed methods that take a ``seed`` (of ``names_`` when given)."""
    wanted = None if names_ is None else set(names_)
    return tuple(m.name for m in methods() if m.takes_seed and (wanted is None or m.name in wanted))


def counterfactual(name: str) -> Counterfactual:
    for entry in COUNTERFACTUALS:
        if entry.name == name:
            return entry
    raise InputError(f"unknown counterfactual {name!r}: use one of {', '.join(c.name for c in COUNTERFACTUALS)}")


def skipped(pm: Any, longest: int, *, checks: Iterable[str] = CHECKS) -> dict[str, str]:
    """``{method: why}`` for every listed method left out of the default set on ``pm`` with inputs
    of up to ``longest`` tokens; the first reason of ``checks`` (in :data:`CHECKS` order) wins."""
    out: dict[str, str] = {}
    for check in checks:
        for entry in methods():
            if entry.name not in out and (why := entry.skip_reason(check, pm, longest)) is not None:
                out[entry.name] = why
    return out


def method_table() -> list[str]:
    """The README's "### Methods" table, one markdown line per row, header included."""
    lines = ["| family | names | what |", "|---|---|---|"]
    for group in GROUPS:
        cells = [f"`{m.name}`" + (f" ({m.note})" if m.note else "") for m in methods(group=group.name)]
        lines.append(f"| {group.name} | {', '.join(cells)} | {group.what} |")
    return lines


def param_fields(entry: Method | Counterfactual) -> dict[str, Any]:
    """``{parameter: default}`` of an entry's parameter dataclass."""
    return {f.name: f.default for f in dataclasses.fields(entry.params)}


def _fits(value: Any, annotation: str) -> bool:
    """Whether ``value`` (from YAML or a Python call) is of the parameter's annotated type."""
    for part in (p.strip() for p in annotation.split("|")):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part.startswith("tuple[") and isinstance(value, (list, tuple)):
            item = part[len("tuple["):].split(",")[0].strip()
            if item == "str" and all(isinstance(v, str) for v in value):
                return True
            if item == "int" and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return True
    return False


def params_problem(name: str, values: Any) -> tuple[str | None, str] | None:
    """Why ``values`` are not valid parameters of method ``name``: ``(the bad key or None, the
    sentence)``, or None when they are. Read from the entry's parameter dataclass (its fields,
    their annotated types, their declared ranges and choices; the preset's keys are fixed by the name)."""
    entry = find(name)
    if entry is None:
        return None, f"unknown method {name!r}"
    if not isinstance(values, dict):
        return None, (f"{values!r} is not a mapping of parameters; write e.g. "
                      f"{{{next(iter(param_fields(entry)), 'key')}: "
                      f"...}} (valid: {', '.join(param_fields(entry)) or 'none'})")
    fields = {f.name: f for f in dataclasses.fields(entry.params)}
    preset = dict(entry.preset)
    settable = [k for k in fields if k not in preset] + (["query"] if getattr(entry, "query_max", None) else [])
    values = dict(values)
    if "query" in values and getattr(entry, "query_max", None):
        if values["query"] not in ("target", "max"):
            return "query", f"{values['query']!r} is not a query of {name}; give target or max"
        values.pop("query")
    for key, value in values.items():
        if key not in settable:
            import difflib

            close = difflib.get_close_matches(str(key), settable, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return key, (f"unknown parameter {key!r} of {name} (valid: {', '.join(settable) or 'none'}){hint}")
        annotation = str(fields[key].type)
        if not _fits(value, annotation):
            return key, f"{value!r} is not valid for {name}.{key}; give a value of type {annotation}"
        # the declared range or choices (probe.registry.params), which the implementation checks again
        problem = limit_problem(entry.params, name, key, value)
        if problem is not None:
            return key, problem
    try:
        entry.params(**{**preset, **values})
    except (TypeError, ValueError) as err:
        return None, f"invalid parameters for {name}: {err}"
    return None


__all__ = [
    "Applies", "CHECKS", "COUNTERFACTUALS", "Counterfactual", "FAMILIES", "FLOW_MAX_TOKENS",
    "GROUPS", "Group", "Method", "REGISTRY", "counterfactual", "family_names", "find", "method", "method_table",
    "methods", "names", "param_fields", "params_problem", "seeded", "skipped",
]
