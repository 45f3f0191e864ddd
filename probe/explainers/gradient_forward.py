"""Where gradients are taken (the *site*) and the one forward function every gradient method
differentiates, the per-example TokenScores it turns into, and the width buckets that keep gradient
passes free of padding waste. Shared by :mod:`probe.explainers.gradients` (saliency, input x gradient)
and :mod:`probe.explainers.integrated_gradients` (integrated gradients, GradientSHAP); the module
docstring of :mod:`probe.explainers.gradients` says what the sites and the attributed tokens are."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from probe.errors import InputError, ProbeError
from probe.rows.forward import build_rows, forward_accepts, keep_target_logits, plain_kv_cache
from probe.rows.queries import eval_mode
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, RowBatch, same_row_groups
from probe.rows.values import position_values, target_values

if TYPE_CHECKING:
    from probe.models.core import ProbeModel

SITES = ("word", "embeddings")
SPACE = "word_embeddings"  # params["space"] of the word site (the only site before sites were named)
SPACE_NOTE = ("output of get_input_embeddings(): before position/token-type embeddings, LayerNorm "
              "and embedding scaling")
SITE_SPACES = {"word": (SPACE, SPACE_NOTE),
               "embeddings": ("embeddings_output", "output of the model's embeddings module: word + position "
                              "(+ token type) embeddings after its normalisation, what enters the first layer")}


# ---------------------------------------------------------------------------
# the attributed site
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """Where gradients are taken: ``name`` in :data:`SITES`, the module whose output is attributed
    (``None`` for ``word``: the model is then fed ``inputs_embeds``) and its dotted name."""

    name: str
    module_name: str
    module: object = dataclasses.field(compare=False, repr=False, default=None)
    normalising: str | None = None  # class name of the norm inside the embeddings module, if any


def is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in type(module).__name__.lower()


def embeddings_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(dotted name, module) of the model's embeddings module, or None when it has none.

    Found from the structure: the parent of ``get_input_embeddings()`` when that parent holds no
    ``ModuleList`` (no layer stack). BERT's ``bert.embeddings`` qualifies; GPT-2's and Llama's word
    embeddings sit directly in the model beside the layers, so they have none.
    """
    word = model.get_input_embeddings()
    word_name = next((name for name, module in model.named_modules() if module is word), None)
    if not word_name or "." not in word_name:
        return None
    parent_name = word_name.rsplit(".", 1)[0]
    parent = model.get_submodule(parent_name)
    if any(isinstance(module, torch.nn.ModuleList) for module in parent.modules()):
        return None
    return parent_name, parent


def _word_name(model) -> str:
    word = model.get_input_embeddings()
    return next((name for name, module in model.named_modules() if module is word), "get_input_embeddings()")


def reads_token_ids(model: torch.nn.Module) -> bool:
    """Whether a module inside the model's layer stack takes ``input_ids`` in its forward (a layer
    that routes by token id), so the model needs its ids even when given embeddings."""
    import inspect

    for stack in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
        for module in stack.modules():
            try:
                if "input_ids" in inspect.signature(module.forward).parameters:
                    return True
            except (TypeError, ValueError):
                continue
    return False


def normalising_module(model: torch.nn.Module) -> str | None:
    """Class name of the norm applied inside the embeddings module (None: no module, or no norm)."""
    found = embeddings_module(model)
    if found is None:
        return None
    return next((type(m).__name__ for m in found[1].modules() if is_norm(m)), None)


def default_site(pm: ProbeModel) -> str:
    """``embeddings`` where the embeddings module normalises (input x gradient and the signed
    gradient sum are degenerate on the word embedding there), else ``word``."""
    return "embeddings" if normalising_module(pm.model) is not None else "word"


def resolve_site(pm: ProbeModel, site: str | None = None) -> Site:
    """The :class:`Site` called ``site`` (None or ``auto``: :func:`default_site`) on this model."""
    if site is None or site == "auto":
        site = default_site(pm)
    if site not in SITES:
        raise InputError(f"unknown gradient site {site!r}: use one of {', '.join(SITES)} (or auto)")
    if site == "word":
        # a model whose layers read the token ids themselves (deepseek_v4 routes experts by id)
        # cannot be fed embeddings instead of ids: it is fed its ids and the word embedding's output replaced
        module = pm.model.get_input_embeddings() if reads_token_ids(pm.model) else None
        return Site("word", _word_name(pm.model), module, normalising_module(pm.model))
    found = embeddings_module(pm.model)
    if found is None:
        raise InputError(f"gradient site 'embeddings' needs an embeddings module: looked for the parent module of "
                         f"the word embeddings ({_word_name(pm.model)}) holding no layer stack, and this model has "
                         f"none: use site word")
    name, module = found
    return Site("embeddings", name, module, normalising_module(pm.model))


class _StopForward(Exception):
    """Raised by a capture hook once the site's output is read, so the rest of the forward is skipped."""


@contextlib.contextmanager
def hooked(module: torch.nn.Module, hook: Callable[..., Any]) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _site_tensor(site: Site, output) -> torch.Tensor:
    """The embeddings module's output tensor: the output itself, or the first item of a tuple whose
    other items are side values (ibert hands on (embeddings, scaling factor))."""
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ProbeError(f"the embeddings module {site.module_name} returned {type(output).__name__}, not a "
                         f"tensor: use gradient site word")
    return output


def _replace_site_output(replaced: torch.Tensor):
    """A forward hook that puts ``replaced`` where the embeddings module's tensor was (in a tuple: its first item)."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (replaced, *output[1:])
        return replaced
    return hook


def site_values(pm: ProbeModel, site: Site, inputs: dict) -> torch.Tensor:
    """[rows, seq, dim] fp32 output of ``site`` for the model inputs ``inputs`` (no gradient)."""
    if site.module is None:
        with torch.no_grad():
            return pm.model.get_input_embeddings()(inputs["input_ids"]).float()
    held = {}

    def keep(module, args, output):
        held["output"] = _site_tensor(site, output)
        raise _StopForward

    with torch.no_grad(), hooked(site.module, keep):
        try:
            pm.model(**inputs)
        except _StopForward:
            pass
    return held["output"].float()


# ---------------------------------------------------------------------------
# the one forward function every gradient method differentiates
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class EmbeddingForward:
    """The target as a function of the explained tokens' word embeddings, for a fixed set of rows.

    ``embeds`` (what captum differentiates) covers only the explained positions ``[rows, width, dim]``
    with ``width = max explained length``; everything else the model sees (causal continuation,
    decoder inputs, padding) comes from ``fixed``. Call with ``(embeds [n, width, dim], row [n])``
    where ``row`` says which prepared row each of the ``n`` inputs is (captum repeats rows along
    its interpolation steps; the row index lets every step find its mask and target).
    """

    pm: ProbeModel
    batch: RowBatch
    embeds: torch.Tensor  # [rows, width, dim] fp32, zero at padding
    fixed: torch.Tensor  # [rows, seq, dim] fp32: embeddings of the whole model input
    explained: torch.Tensor  # [rows, seq] bool: positions taken from ``embeds``
    rows: torch.Tensor  # [rows] long: 0..rows-1, the ``row`` argument for the unexpanded inputs
    site: Site = Site("word", "get_input_embeddings()")
    #: rows that differ only in the output token they explain (:func:`step_groups`), or None
    groups: list[list[int]] | None = None

    @property
    def mask(self) -> torch.Tensor:
        """[rows, width] bool: explained (attributed) positions."""
        return self.explained[:, : self.embeds.shape[1]]

    def __call__(self, embeds: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        selected, logits = self._logits(embeds, row)
        return target_values(self.pm, selected, logits)  # [n] fp32

    def positions(self, embeds: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """``[n, n_target]`` fp32: a language model's value at each output position of each input
        (:func:`probe.rows.values.position_values`), of which every step target is one column."""
        selected, logits = self._logits(embeds, row)
        return position_values(self.pm, selected, logits)

    def position_pieces(self, embeds: torch.Tensor, row: torch.Tensor,
                        span: int | None) -> list[tuple[list[int], torch.Tensor]]:
        """:meth:`positions` in pieces ``[(outputs, values [n, len(outputs)])]``, each output
        position of each input in exactly one piece (0 elsewhere).

        ``span`` None: one piece, one forward. Else (a causal LM fed its embeddings, with a plain
        key/value cache: :func:`truncates`) the input is fed ``span`` columns at a time through
        the cache, the first piece ending ``span`` columns after the first output position. The
        values are those of one forward; but the graph of an output position then reaches only
        the columns up to it, so its backward (one per output token) runs through those alone.
        """
        if span is None:
            values = self.positions(embeds, row)
            return [(list(range(values.shape[1])), values)]
        from transformers import DynamicCache

        full, inputs = self._inputs(embeds, row)
        batch = _select_rows(self.batch, row)
        where, valid = batch.target_positions, batch.target_valid  # [n, n_target] logit positions
        seq = full.shape[1]
        first = int(where[valid].min())
        cache = DynamicCache(config=self.pm.model.config)
        pieces, start = [], 0
        for end in [*range(first + span, seq, span), seq]:
            inside = valid & (where >= start) & (where < end)  # [n, n_target]
            outputs = inside.any(0).nonzero()[:, 0]  # the output positions read in this piece
            kept = torch.unique(where[:, outputs][inside[:, outputs]])  # [kept] their columns, sorted
            step = {"inputs_embeds": full[:, start:end], "attention_mask": inputs["attention_mask"][:, :end],
                    "cache": cache, "use_cache": True,
                    "logits_to_keep": kept - start if len(kept) else 1}
            logits = self.pm.model(**step).logits  # [n, kept, vocab]
            if len(outputs):
                at = torch.searchsorted(kept, where[:, outputs].contiguous()).clamp(max=len(kept) - 1)
                sub = dataclasses.replace(
                    batch, target_positions=at, target_tokens=batch.target_tokens[:, outputs],
                    target_valid=inside[:, outputs],
                    foil_tokens=None if batch.foil_tokens is None else batch.foil_tokens[:, outputs])
                pieces.append((outputs.tolist(), position_values(self.pm, sub, logits)))
            start = end
        return pieces

    def _inputs(self, embeds: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """``[n, seq, dim]`` the whole input at the site (``embeds`` at the explained positions,
        the fixed rest elsewhere) and the model's other inputs for ``row``."""
        seq = self.fixed.shape[1]
        padded = F.pad(embeds, (0, 0, 0, seq - embeds.shape[1]))  # [n, seq, dim]
        full = torch.where(self.explained[row][..., None], padded, self.fixed[row])  # [n, seq, dim]
        inputs = {key: value[row] for key, value in self.batch.inputs.items() if key != "input_ids"}
        return full.to(_model_dtype(self.pm)), inputs

    def _logits(self, embeds: torch.Tensor, row: torch.Tensor) -> tuple[RowBatch, torch.Tensor]:
        full, inputs = self._inputs(embeds, row)
        if self.site.module is None:
            inputs["inputs_embeds"] = full
        else:  # the model embeds the ids as usual; its embeddings module's output is replaced by ``full``
            inputs["input_ids"] = self.batch.inputs["input_ids"][row]
        selected = keep_target_logits(self.pm, _select_rows(self.batch, row), inputs)
        if self.site.module is None:
            logits = self.pm.model(**inputs).logits
        else:
            with hooked(self.site.module, _replace_site_output(full)):
                logits = self.pm.model(**inputs).logits
        return selected, logits


def _select_rows(batch: RowBatch, row: torch.Tensor) -> RowBatch:
    picked = row.tolist()

    def take(tensor):
        return None if tensor is None else tensor[row]

    return dataclasses.replace(
        batch,
        inputs={key: value[row] for key, value in batch.inputs.items()},
        examples=[batch.examples[i] for i in picked],
        input_lengths=batch.input_lengths[row],
        target_positions=take(batch.target_positions),
        target_tokens=take(batch.target_tokens),
        target_valid=take(batch.target_valid),
        foil_tokens=take(batch.foil_tokens),
    )


def _model_dtype(pm: ProbeModel) -> torch.dtype:
    return next(pm.model.parameters()).dtype


def embedding_forward(pm: ProbeModel, examples: Sequence[PreparedExample], site: str | None = None) -> EmbeddingForward:
    where = resolve_site(pm, site)
    if not examples:
        raise InputError("no examples to explain: give at least one prepared example")
    batch = build_rows(pm, [(example.input_ids, example) for example in examples])
    input_ids = batch.inputs["input_ids"]  # [rows, seq]
    with eval_mode(pm.model, grad=True):
        fixed = site_values(pm, where, batch.inputs)  # [rows, seq, dim]
    # the site's positions: more than the input's where the model pads inside its forward
    # (Longformer, to a multiple of its window); those extra positions stay fixed
    seq = fixed.shape[1]
    lengths = batch.input_lengths  # [rows]
    explained = torch.arange(seq, device=input_ids.device)[None, :] < lengths[:, None]  # [rows, seq]
    width = int(lengths.max())
    embeds = fixed[:, :width] * explained[:, :width, None]  # [rows, width, dim]
    rows = torch.arange(len(examples), device=input_ids.device)  # [rows]
    return EmbeddingForward(pm=pm, batch=batch, embeds=embeds, fixed=fixed, explained=explained, rows=rows,
                             site=where, groups=step_groups(pm, examples))


# ---------------------------------------------------------------------------
# the output tokens of one text: one forward serves every step
# ---------------------------------------------------------------------------


def step_groups(pm: ProbeModel, examples: Sequence[PreparedExample]) -> list[list[int]] | None:
    """Indices of ``examples`` in groups whose model rows are the same but for the output token
    each explains (:attr:`PreparedExample.step`): one prompt, one output, one foil, one target kind.

    A step row feeds the whole output (teacher forced) and reads one output position, so one
    forward of a group's sequence gives every step's value (a column of
    :meth:`EmbeddingForward.positions`) and a gradient method needs one forward per point for the
    group and one backward per step, not one forward per step. None when the examples are not all
    steps of log-prob or logit targets (a ``prob`` step is the exponential of its column) or no two
    share a row.
    """
    if not pm.task.continuations or not examples:
        return None
    if any(e.step is None or e.kind not in ("logprob", "logit") for e in examples):
        return None
    found = same_row_groups(examples)
    return None if all(len(group) == 1 for group in found) else found


def _group_members(problem: EmbeddingForward) -> tuple[torch.Tensor, torch.Tensor]:
    """``[groups]`` the row whose sequence stands for each group, and ``[groups, n_target]`` the
    row explaining each output position of it (-1: none)."""
    device = problem.embeds.device
    groups = problem.groups
    n_target = problem.batch.target_tokens.shape[1]
    member = torch.full((len(groups), n_target), -1, dtype=torch.long, device=device)
    for u, group in enumerate(groups):
        for r in group:
            member[u, problem.batch.examples[r].step] = r
    return torch.tensor([group[0] for group in groups], device=device), member


#: Tokens (inputs x columns) each piece of a truncated forward (:meth:`EmbeddingForward.position_pieces`)
#: holds at least, as a multiple of :data:`GRADIENT_CALL_OVERHEAD_TOKENS`: every piece costs a call
#: in the forward and in each backward that reaches it, so thin pieces lose what truncation saves.
#: Measured on 2 CPU cores with SmolLM2-135M, 16 output tokens after a 6-token prompt: 96 inputs
#: fed 2 columns at a time took 0.70x the one-forward path's time (one column at a time 0.82x),
#: 16 inputs fed 4 at a time about 1.0x.
TRUNCATION_CALLS = 3


def truncates(pm: ProbeModel, problem: EmbeddingForward) -> bool:
    """Whether the output tokens' backward passes can be truncated at their own position: a causal
    LM fed its embeddings (the word site, its layers not reading token ids), whose only other input
    is the attention mask, and whose key/value cache is plain (:func:`~probe.rows.forward.plain_kv_cache`)."""
    return (pm.task.next_token and problem.site.module is None and problem.groups is not None
            and set(problem.batch.inputs) <= {"input_ids", "attention_mask"}
            and forward_accepts(pm.model, "logits_to_keep") and plain_kv_cache(pm))


def truncation_span(pm: ProbeModel, problem: EmbeddingForward, inputs: int) -> int | None:
    """Columns per piece for a forward of ``inputs`` rows (None: one forward, no pieces): at
    least :data:`TRUNCATION_CALLS` call overheads of tokens a piece, and at least two pieces."""
    if not truncates(pm, problem):
        return None
    device = str(getattr(pm, "device", "cpu")).split(":")[0]
    tokens = TRUNCATION_CALLS * GRADIENT_CALL_OVERHEAD_TOKENS.get(device, 256)
    span = max(1, math.ceil(tokens / max(1, inputs)))
    where = problem.batch.target_positions[problem.batch.target_valid]
    return span if int(where.min()) + span < problem.fixed.shape[1] else None


def grouped_gradients(problem: EmbeddingForward, base: torch.Tensor, alphas: Sequence[float],
                      weights: Sequence[float], chunk: int | None) -> torch.Tensor:
    """``[rows, width, dim]`` fp32: for every row r, the sum over points i of ``weights[i]`` x
    d target_r / d e at ``e = base_r + alphas[i] (embeds_r - base_r)``, with the rows of each of
    ``problem.groups`` sharing one forward per point (one backward per output position).

    ``alphas=[1], weights=[1]`` is the plain gradient at the embeddings (saliency); a quadrature
    rule's points and weights are integrated gradients' path sum. ``chunk``: at most this many
    (group, point) inputs per forward (None: all).
    """
    reps, member = _group_members(problem)
    x, b = problem.embeds[reps], base[reps]  # [groups, width, dim]
    device = x.device
    alphas_t = torch.tensor(list(alphas), dtype=torch.float32, device=device)
    weights_t = torch.tensor(list(weights), dtype=torch.float32, device=device)
    point_of = torch.arange(len(alphas), device=device).repeat_interleave(len(reps))  # [points * groups]
    group_of = torch.arange(len(reps), device=device).repeat(len(alphas))
    out = torch.zeros_like(problem.embeds)
    size = len(point_of) if chunk is None else max(1, chunk)
    for start in range(0, len(point_of), size):
        at, group = point_of[start:start + size], group_of[start:start + size]
        alpha = alphas_t[at][:, None, None]
        points = (b[group] + alpha * (x[group] - b[group])).detach().requires_grad_(True)  # [c, width, dim]
        # every output position's value, in pieces whose graphs end at their own columns
        pieces = problem.position_pieces(points, reps[group], truncation_span(problem.pm, problem, len(group)))
        who = member[group]  # [c, n_target]
        present = [k for k in range(who.shape[1]) if bool((who[:, k] >= 0).any())]
        for n, k in enumerate(present):
            wanted = who[:, k] >= 0
            roots = [values[:, outputs.index(k)] for outputs, values in pieces if k in outputs]
            (grad,) = torch.autograd.grad(roots, points, grad_outputs=[wanted.to(roots[0].dtype)] * len(roots),
                                          retain_graph=n < len(present) - 1)
            scale = weights_t[at][wanted][:, None, None]
            out.index_add_(0, who[wanted, k], grad[wanted].float() * scale)
    return out


def grouped_values(problem: EmbeddingForward, *embeds: torch.Tensor) -> torch.Tensor:
    """``[len(embeds) * rows]`` every row's target at each ``[rows, width, dim]`` set of embeddings
    (rows of a group equal within each set), one forward per group and set."""
    reps, _ = _group_members(problem)
    steps = torch.tensor([e.step for e in problem.batch.examples], device=reps.device)  # [rows]
    group_of = torch.empty(len(steps), dtype=torch.long, device=reps.device)
    for u, group in enumerate(problem.groups):
        group_of[group] = u
    with torch.no_grad():
        values = problem.positions(torch.cat([e[reps] for e in embeds]), reps.repeat(len(embeds)))
    values = values.reshape(len(embeds), len(reps), -1)  # [sets, groups, n_target]
    return values[:, group_of, steps].reshape(-1)


# ---------------------------------------------------------------------------
# turning [rows, width, dim] attributions into TokenScores
# ---------------------------------------------------------------------------


def per_example(values: torch.Tensor, problem: EmbeddingForward) -> list[torch.Tensor]:
    """[rows, width] -> one ``[tokens]`` tensor per example; padding is zeroed, then cut off."""
    values = values * problem.mask
    return [values[r, : int(n)] for r, n in enumerate(problem.batch.input_lengths.tolist())]


#: attention implementations whose kernel keeps no [T, T] map for the backward pass
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def attention_kernel_note(pm: ProbeModel) -> str:
    """The attention a gradient runs through and what its backward pass holds (``params["attention_kernel"]``).

    The gradient methods run the model's own kernel, never a switch to eager: under a fused kernel
    (sdpa, flash) no [T, T] map is kept, so their memory grows as T; a model whose attention
    is eager or computed inline keeps every layer's weights for the backward pass, T x T per head."""
    implementation = pm.contract.implementation
    through_function = all(s.capture_path == "attention function" for s in pm.contract.stacks.values())
    if implementation in FUSED_ATTENTION and through_function:
        return (f"{implementation}: fused, no [T, T] map kept for the backward pass (memory linear in T; a padded "
                "batch still carries its [batch, 1, T, T] mask)")
    advice = "; load the model with attn_implementation='sdpa' for memory linear in T" if through_function else ""
    return (f"{implementation}: every layer's [head, T, T] weights kept for the backward pass (memory quadratic in "
            f"T){advice}")


def common_params(pm: ProbeModel, problem: EmbeddingForward) -> dict:
    examples = problem.batch.examples
    space, note = SITE_SPACES[problem.site.name]
    return {
        "site": problem.site.name,
        "site_module": problem.site.module_name,
        "site_default": default_site(pm),
        "embedding_norm": problem.site.normalising,
        "space": space,
        "space_note": note,
        "target_kind": examples[0].kind,
        "attributed": pm.task.attributed,
        "gradient_dtype": "float32",
        "model_dtype": str(_model_dtype(pm)).replace("torch.", ""),
        "attention_kernel": attention_kernel_note(pm),
    }


#: Tokens (rows x model input width) one gradient forward/backward may hold when the chunk size is
#: "auto": the activations kept for the backward pass grow with tokens x layers x hidden size
#: (about 0.2 MB a token for MiniLM, 1.4 MB for SmolLM2-135M in fp32).
GRADIENT_TOKEN_BUDGET = 4096


# ---------------------------------------------------------------------------
# width buckets: no padding waste in gradient passes
# ---------------------------------------------------------------------------

#: Cost of one gradient forward/backward beyond its tokens, in token-equivalents; it decides only
#: how examples of different widths are grouped, never the values. Measured on a shared 2-core CPU
#: with builtin:minilm-rt: a call costs ~15 ms beyond ~0.25 ms per token and row (forward and
#: backward), i.e. ~64 tokens; GPUs are launch bound.
GRADIENT_CALL_OVERHEAD_TOKENS = {"cpu": 64, "cuda": 1024, "mps": 256}


def _row_width(example: PreparedExample) -> int:
    return len(example.input_ids) + len(example.target_ids)


def width_buckets(pm: ProbeModel, examples: Sequence[PreparedExample], *, points: int) -> list[list[int]]:
    """Indices of ``examples`` in groups of similar width, each group one explainer call.

    Every example becomes ``points`` model inputs padded to its group's widest row (the output
    tokens of one text, :func:`step_groups`, are one row between them and are never split), and
    every pass holds at most :data:`GRADIENT_TOKEN_BUDGET` tokens; a dynamic programme over the
    rows sorted by width picks the cuts that minimise padded tokens plus
    :data:`GRADIENT_CALL_OVERHEAD_TOKENS` per pass. Within a group the order is the examples'
    own. Grouping changes which rows share a pass, never a value (padding is masked and
    attributions are per row: batch of 1 equals batch of N).
    """
    if not examples:
        return [[]]
    device = str(getattr(pm, "device", "cpu")).split(":")[0]
    overhead = GRADIENT_CALL_OVERHEAD_TOKENS.get(device, 256)
    units = step_groups(pm, examples) or [[i] for i in range(len(examples))]  # one model row each
    widths = [_row_width(examples[unit[0]]) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (widths[u], units[u][0]))
    best = [0.0] + [math.inf] * len(order)  # best[j]: cost of the first j rows (sorted)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]
        per_pass = max(1, GRADIENT_TOKEN_BUDGET // width)  # inputs per pass
        for i in range(j):
            inputs = (j - i) * points
            cost = best[i] + inputs * width + math.ceil(inputs / per_pass) * overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(sorted(i for u in order[cut[j]:j] for i in units[u]))
        j = cut[j]
    return groups[::-1]


def join_buckets(parts: Sequence[TokenScores], buckets: Sequence[Sequence[int]]) -> TokenScores:
    """One TokenScores in example order from one per bucket: scores and per-example ``extras``
    lists are put back in place; params and other extras are the first part's."""
    if len(parts) == 1 and list(buckets[0]) == list(range(len(buckets[0]))):
        return parts[0]
    n = sum(len(bucket) for bucket in buckets)
    scores: list = [None] * n
    for part, bucket in zip(parts, buckets):
        for position, index in enumerate(bucket):
            scores[index] = part.scores[position]
    first = parts[0]
    extras = {}
    for key, value in first.extras.items():
        if all(isinstance(part.extras.get(key), list) for part in parts):
            joined: list = [None] * n
            for part, bucket in zip(parts, buckets):
                for position, index in enumerate(bucket):
                    joined[index] = part.extras[key][position]
            extras[key] = joined
        else:
            extras[key] = value
    return TokenScores(method=first.method, scores=scores, params=first.params, per_head=first.per_head,
                       per_layer=first.per_layer, extras=extras)
