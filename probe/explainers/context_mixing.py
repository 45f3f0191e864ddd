"""Context-mixing explainers: value zeroing, ALTI and GlobEnc, per layer and rolled out.

Each builds, for every attention layer l, a matrix C_l[i, j] >= 0 (rows sum to 1) saying how much
token j's layer input went into token i's layer output, then rolls the layers out like rollout,
without adding an identity (each measure already carries the residual stream):

    R_0 = C_0,  R_l = C_l R_{l-1};  the score of layer l is the target query's row of R_l.

    value_zeroing  Mohebbi et al. (EACL 2023). C_l[i, j] = cosine distance between token i's layer
                   output and its output when token j's value vector is zeroed in every head of
                   layer l (same layer input); rows normalised to sum 1. Zeroing v_j is the same
                   as zeroing key column j of every head's weights without renormalising, so it runs
                   on probe's attention editors. Cost: one extra pass of one layer per explained token
                   per layer (= about one full forward per token), batched: every (example, token)
                   variant of a layer runs in one stacked batch from the captured layer input, cut to
                   ``token_budget`` tokens per pass.
    alti           Ferrando et al. (EMNLP 2022). The attention block's output for token i is
                   decomposed exactly into one vector per input token, T_i(x_j) = sum_h alpha_h,ij
                   f_h(x_j) + [i = j] x_i passed through the (linearised) LayerNorm, plus a bias; the
                   contribution is c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised.
    globenc        Modarressi et al. (NAACL 2022). ||T_i(x_j)|| (Euclidean) carried through both
                   LayerNorms of a post-LN layer (the FFN left out), rows normalised.

Where the decomposition is defined (``MIXING_LAYOUTS``, keyed by model type):

    post-LN encoders (BERT family)  y_i = LN1(x_i + attn_i + b_O): LN1 linearised with the
                   token's own standard deviation (the model's), LN1's beta and LN1(b_O) go to the bias.
    pre-LN decoders (Llama/GQA, GPT-2)  y_i = x_i + attn(norm(x))_i + b_O: the pre-norm acts on
                   token j alone, so it is part of f(x_j); the stream is not normalised, and GlobEnc's
                   "both LayerNorms" reduce to the norm of T_i(x_j) (stated in the params).

    encoder-decoder (BART, Marian: post-LN; mBART, T5: pre-LN)  the encoder's layers are decomposed
                   as above and rolled out over the whole encoder, R_enc = C_(L-1) ... C_0; the
                   score of decoder layer l is its head-mean cross-attention at the target rows
                   times R_enc, the same hop probe's seq2seq rollout takes. The cross-attention hop
                   itself is the raw weights (ALTI+'s decomposition of cross-attention is not done).

Value zeroing needs no layout, only the layer block (found from the model's structure: the
nearest ancestor of the attention module that sits in a ModuleList; on T5 that is the attention
sub-layer, so its layer output is the residual stream after attention). A seq2seq model it
knows no layout for is refused in one line, like any other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from probe import registry
from probe.errors import CaptureError, InputError
from probe.explainers.attention import (
    head_value_norms,
    in_out_weight,
    record_value_inputs,
    value_output_modules,
)
from probe.explainers.attention_params import attention_params as _params
from probe.hooks.capture import capture_attention
from probe.hooks.types import EditContext
from probe.models.architectures import (
    MixingLayout,
    block_modules,
    mixing_layout,
    refuse_seq2seq,
    relative_path,
)
from probe.names import CONTEXT_MIXING_METHODS
from probe.rows.queries import capture_masks, eval_mode, mixing_widths, row_batches
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample, RowBatch

if TYPE_CHECKING:
    from probe.models.core import ProbeModel



def _mixing_stack(pm: ProbeModel, tq) -> str:
    """The stack the matrices are built on: the encoder for seq2seq, else the target's stack."""
    return pm.task.input_stack(pm.contract)


def _cross_rows(pm: ProbeModel, batch: RowBatch, tq) -> torch.Tensor:
    """seq2seq: head-mean cross-attention of every decoder layer at the target rows [batch, layer, key]."""
    with torch.no_grad(), capture_attention(pm, layers={"cross": None},  # None: every layer of the stack
                                            queries={"cross": tq.rows},
                                            stacks=["cross"], **capture_masks(batch)) as capture:
        pm.model(**batch.inputs)
    return tq.mean_over_rows(capture.maps("cross").weights.float().mean(dim=2))


def _scores_from_matrices(matrices: Sequence[torch.Tensor], tq, row: int, cross: torch.Tensor | None) -> torch.Tensor:
    """[layer, n]: the target row of each rolled-out layer, or (seq2seq) each decoder layer's cross
    row times the whole encoder's rolled-out product."""
    if cross is None:
        return rolled_rows(matrices, int(tq.rows[row, 0]))
    product = None
    for matrix in matrices:
        product = matrix.double() if product is None else matrix.double() @ product
    n = product.shape[0]
    return (cross[row, :, :n].to(product.device).double() @ product).float()


# ---------------------------------------------------------------------------
# one recording forward
# ---------------------------------------------------------------------------


@dataclass
class LayerRecords:
    """What one forward shows of every layer of a stack (batch width W, hidden D)."""

    weights: torch.Tensor | None  # [batch, layer, head, W, W] fp32 full attention (None: not asked for)
    value_inputs: dict[int, torch.Tensor]  # layer -> [batch, W, in] what W_V reads (ALTI/GlobEnc only)
    block_inputs: dict[int, tuple[tuple, dict]]  # layer -> (args, kwargs) of the block call
    ln_inputs: dict[tuple[int, str], torch.Tensor]  # (layer, ln1|ln2) -> [batch, W, D]


@contextmanager
def _module_hooks(targets: dict, ins: dict, outs: dict, *, with_kwargs: bool = False) -> Iterator[None]:
    """Keep inputs and outputs of ``targets`` {key: module}; handles removed in ``finally``."""
    handles = []
    try:
        for key, module in targets.items():
            def pre(module, args, kwargs=None, key=key):
                ins[key] = (args, kwargs or {}) if with_kwargs else (args[0] if args else next(iter(kwargs.values())))

            def post(module, args, output, key=key):
                out = output[0] if isinstance(output, tuple) else output
                outs[key] = out.detach()

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=with_kwargs))
            handles.append(module.register_forward_hook(post))
        yield
    finally:
        for handle in handles:
            handle.remove()


def record_layers(pm: ProbeModel, batch: RowBatch, stack: str, *, norms: MixingLayout | None, weights: bool = True) -> LayerRecords:
    """One forward of ``batch`` keeping full attention (unless ``weights=False``), value inputs, block
    inputs and the LayerNorms' inputs (every block's output is seen, to check that each ran)."""
    blocks = block_modules(pm, stack)
    named = dict(pm.model.named_modules())
    norm_modules = {}
    if norms is not None:
        for layer in blocks:
            path = pm.contract.module_paths[(stack, layer)]
            for which in ("ln1", "ln2"):
                norm_modules[(layer, which)] = named[relative_path(path, getattr(norms, which))]
    block_ins: dict = {}
    block_outs: dict = {}
    ln_ins: dict = {}
    ln_outs: dict = {}
    values: AbstractContextManager[dict[int, torch.Tensor]] = (record_value_inputs(pm, stack) if norms is not None
                                                                else nullcontext({}))
    with torch.no_grad(), values as value_inputs, \
            _module_hooks(blocks, block_ins, block_outs, with_kwargs=True), \
            _module_hooks(norm_modules, ln_ins, ln_outs), \
            capture_attention(pm, stacks=[stack], layers=None if weights else {stack: ()},
                              **capture_masks(batch)) as capture:
        pm.model(**batch.inputs)
    if len(block_outs) != len(blocks):
        raise CaptureError(f"context mixing saw {len(block_outs)} of {len(blocks)} {stack} layer blocks run")
    return LayerRecords(weights=capture.maps(stack).weights if weights else None, value_inputs=dict(value_inputs),
                        block_inputs=block_ins, ln_inputs={k: v.detach() for k, v in ln_ins.items()})


# ---------------------------------------------------------------------------
# the decomposition (ALTI, GlobEnc)
# ---------------------------------------------------------------------------


def _layer_norm_parts(module) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    weight = module.weight.float()
    bias = getattr(module, "bias", None)
    return weight, (bias.float() if bias is not None else None), float(getattr(module, "eps", None)
                                                                       or getattr(module, "variance_epsilon", 1e-12))


def _centre(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=-1, keepdim=True)


def _scale(pre: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(var(pre) + eps) per token, as LayerNorm computes it: [n, 1]."""
    return (pre.float().var(dim=-1, unbiased=False, keepdim=True) + eps).rsqrt()


def mixing_terms(pm: ProbeModel, records: LayerRecords, stack: str, layer: int, row: int, n: int,
                 layout: MixingLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention block's output of example ``row``'s first ``n`` tokens, decomposed by input token.

    Returns (terms [n (i), n (j), D], bias [n, D]) with ``terms.sum(1) + bias`` = the block output y:
    LN1's output for a post-LN layer, the residual stream after attention for a pre-LN one.
    terms[i, j] = sum_h alpha_h,ij f_h(x_j) + [i = j] x_i (post-LN: times LN1's linear part).
    """
    per_query, out_weight, _ = head_value_norms(pm, stack, layer, records.value_inputs[layer][row: row + 1, :n])
    f = torch.einsum("khd,hdo->kho", per_query[0], out_weight)  # [n (j), head, D] f_h(x_j)
    alpha = records.weights[row, layer, :, :n, :n].float()  # [head, n (i), n (j)]
    terms = torch.einsum("hij,jho->ijo", alpha, f)  # [n, n, D]
    args, kwargs = records.block_inputs[layer]
    residual = (args[0] if args else kwargs["hidden_states"])[row, :n].float()  # [n, D] x_i
    idx = torch.arange(n)
    terms[idx, idx] += residual
    _, _, output_module = value_output_modules(pm, stack, layer)
    _, out_bias = in_out_weight(output_module)
    bias = (out_bias if out_bias is not None else torch.zeros(terms.shape[-1], device=terms.device)).expand(n, -1).clone()  # [n, D]
    if layout.placement == "post":
        ln = dict(pm.model.named_modules())[relative_path(pm.contract.module_paths[(stack, layer)], layout.ln1)]
        gamma, beta, eps = _layer_norm_parts(ln)
        scale = _scale(records.ln_inputs[(layer, "ln1")][row, :n], eps)  # [n, 1]
        terms = gamma * _centre(terms) * scale[:, None]
        bias = gamma * _centre(bias) * scale + (beta if beta is not None else 0.0)
    return terms, bias


def _normalise_rows(matrix: torch.Tensor) -> torch.Tensor:
    """Rows divided by their sum; a row that sums to 0 becomes the identity row (the token keeps itself)."""
    total = matrix.sum(dim=-1, keepdim=True)
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    return torch.where(total > 0, matrix / total.clamp(min=1e-30), eye)


def alti_matrix(terms: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ALTI's contributions [n, n] from the decomposition: max(0, ||y||_1 - ||y - T_ij||_1), rows normalised."""
    y = terms.sum(dim=1) + bias  # [n, D]
    distance = (y[:, None, :] - terms).abs().sum(dim=-1)  # [n, n]
    return _normalise_rows((y.abs().sum(dim=-1, keepdim=True) - distance).clamp(min=0))


def globenc_matrix(pm: ProbeModel, records: LayerRecords, stack: str, layer: int, row: int, terms: torch.Tensor,
                   layout: MixingLayout) -> torch.Tensor:
    """GlobEnc's ||T_i(x_j)|| [n, n], through LN2 for a post-LN layer (the FFN left out), rows normalised."""
    if layout.placement == "post":
        n = terms.shape[0]
        ln = dict(pm.model.named_modules())[relative_path(pm.contract.module_paths[(stack, layer)], layout.ln2)]
        gamma, _, eps = _layer_norm_parts(ln)
        scale = _scale(records.ln_inputs[(layer, "ln2")][row, :n], eps)  # [n, 1]
        terms = gamma * _centre(terms) * scale[:, None]
    return _normalise_rows(terms.norm(dim=-1))


def rolled_rows(matrices: Sequence[torch.Tensor], target: int) -> torch.Tensor:
    """[layer, n]: the target row of R_l = C_l ... C_0 (no identity added), fp64 product."""
    product = None
    rows = []
    for matrix in matrices:
        product = matrix.double() if product is None else matrix.double() @ product
        rows.append(product[target])
    return torch.stack(rows).float()


def _alti_layer(pm, records, stack, layer, row, terms, bias, layout) -> torch.Tensor:
    return alti_matrix(terms, bias)


def _globenc_layer(pm, records, stack, layer, row, terms, bias, layout) -> torch.Tensor:
    return globenc_matrix(pm, records, stack, layer, row, terms, layout)


def _alti_formula(layout: MixingLayout) -> str:
    return "c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised"


def _globenc_formula(layout: MixingLayout) -> str:
    return ("||T_i(x_j)||_2" + (" through LN1 and LN2 (FFN left out)" if layout.placement == "post"
                                else " of the residual stream after attention (pre-LN: the norms act "
                                     "inside f(x_j); no LayerNorm on the stream)") + ", rows normalised")


def _decomposition_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str, batch_size: int, *,
                          matrix, formula) -> TokenScores:
    """A decomposition method's scores: ``matrix`` builds one layer's [n, n] contributions from its
    terms, ``formula(layout)`` says how (stored with the result)."""
    layout = mixing_layout(pm, method)
    scores: list[torch.Tensor] = []
    stack = None
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            stack = _mixing_stack(pm, tq)
            records = record_layers(pm, batch, stack, norms=layout)
            cross = _cross_rows(pm, batch, tq) if pm.task.encoder_decoder else None
            n_layers = pm.contract.stacks[stack].n_layers
            for row, (n, width) in enumerate(zip(tq.lengths.tolist(), mixing_widths(tq))):
                matrices = []
                for layer in range(n_layers):
                    terms, bias = mixing_terms(pm, records, stack, layer, row, width, layout)
                    matrices.append(matrix(pm, records, stack, layer, row, terms, bias, layout))
                scores.append(_scores_from_matrices(matrices, tq, row, cross)[:, :n])
    return TokenScores(method, scores, per_layer=True, params=_params(
        pm, pm.task.target_stack(pm.contract), layer_norm=layout.placement, formula=formula(layout),
        **_seq2seq_params(pm),
        decomposition="T_i(x_j) = sum_h alpha_h,ij (x_j W_V + b_V) W_O^h + [i=j] x_i" +
                      (", times LN1's linear part (the token's own std)" if layout.placement == "post" else ""),
        rollout="R_l = C_l R_(l-1), no identity added (the residual is in C)", dtype="float32 (rollout float64)"))


def _seq2seq_params(pm: ProbeModel) -> dict:
    if not pm.task.encoder_decoder:
        return {}
    return {"seq2seq": "encoder layers decomposed and rolled out over the whole encoder; decoder layer l = its "
                       "head-mean cross-attention at the target rows times that product (the cross-attention "
                       "hop is raw weights, not decomposed)"}


def alti(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8) -> TokenScores:
    """ALTI (Ferrando et al. 2022): [layer, tokens], the target row of the rolled-out contributions."""
    return _decomposition_scores(pm, examples, "alti", batch_size, matrix=_alti_layer, formula=_alti_formula)


def globenc(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8) -> TokenScores:
    """GlobEnc (Modarressi et al. 2022): [layer, tokens], the target row of the rolled-out norms."""
    return _decomposition_scores(pm, examples, "globenc", batch_size, matrix=_globenc_layer,
                                 formula=_globenc_formula)


# ---------------------------------------------------------------------------
# value zeroing
# ---------------------------------------------------------------------------


def _select_rows(value, index: torch.Tensor, batch: int):
    """Stack rows ``index`` of every batch-shaped tensor in ``value`` (dim >= 2, first dim batch or 1);
    caches are dropped (a block run again must not extend the forward's cache)."""
    from transformers.cache_utils import Cache

    if isinstance(value, Cache):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return value.index_select(0, index.to(value.device))
        if value.dim() >= 2 and value.shape[0] == 1:
            return value.expand(len(index), *value.shape[1:])
        return value
    if isinstance(value, tuple):
        return tuple(_select_rows(v, index, batch) for v in value)
    if isinstance(value, list):
        return [_select_rows(v, index, batch) for v in value]
    if isinstance(value, dict):
        return {k: _select_rows(v, index, batch) for k, v in value.items()}
    return value


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 - cos(a, b) over the last dim, in float64 (small moves are small differences of ~1)."""
    return (1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-30)).clamp(min=0)


def value_zeroing_distances(pm: ProbeModel, batch: RowBatch, lengths: Sequence[int], stack: str, *,
                            token_budget: int = 8192) -> list[torch.Tensor]:
    """Per row of ``batch``: [layer, n (i), n (j)] cosine distance between token i's block output and
    its output with token j's value vector zeroed in every head of that layer (float64, not normalised).

    Each layer's variants (every row's tokens j, plus one unzeroed reference per row, which runs
    through the same editor so that the comparison sees no kernel difference) are stacked in a batch
    and run through that layer's block alone, from the block's recorded inputs.
    """
    records = record_layers(pm, batch, stack, norms=None, weights=False)
    blocks = block_modules(pm, stack)
    n_rows = len(lengths)
    width = batch.inputs["input_ids"].shape[1]
    out = [torch.zeros((len(blocks), n, n), dtype=torch.float64) for n in lengths]
    # variant v = (row, zeroed key or -1 for the reference)
    variants = [(r, j) for r, n in enumerate(lengths) for j in [-1, *range(n)]]
    per_pass = max(1, token_budget // max(width, 1))
    for layer, block in blocks.items():
        args, kwargs = records.block_inputs[layer]
        outputs = []
        for start in range(0, len(variants), per_pass):
            chunk = variants[start: start + per_pass]
            index = torch.tensor([r for r, _ in chunk], dtype=torch.long)
            zeroed = torch.tensor([j for _, j in chunk], dtype=torch.long)  # [chunk]

            def zero_value(weights: torch.Tensor, context: EditContext, zeroed=zeroed) -> torch.Tensor:
                keys = torch.arange(weights.shape[-1], device=weights.device)
                keep = keys[None, :] != zeroed.to(weights.device)[:, None]  # [chunk, key]
                return weights * keep[:, None, None, :].to(weights.dtype)  # [chunk, head, query, key]

            with torch.no_grad(), capture_attention(pm, editors={(stack, layer): zero_value}, stacks=[stack],
                                                    layers={stack: ()}):
                result = block(*_select_rows(args, index, n_rows), **_select_rows(kwargs, index, n_rows))
            outputs.append((result[0] if isinstance(result, tuple) else result).detach())  # [chunk, W, D]
        stacked = torch.cat(outputs)  # [variants, W, D]
        at = 0
        for r, n in enumerate(lengths):
            reference = stacked[at, :n]  # [n, D]
            moved = stacked[at + 1: at + 1 + n, :n]  # [n (j), n (i), D]
            out[r][layer] = _cosine_distance(moved, reference[None]).t().cpu()  # [i, j]
            at += 1 + n
    return out


def value_zeroing(pm: ProbeModel, examples: Sequence[PreparedExample], *, batch_size: int = 8,
                  token_budget: int = 8192) -> TokenScores:
    """Value zeroing (Mohebbi et al. 2023): [layer, tokens], the target row of the rolled-out matrices."""
    refuse_seq2seq(pm, "value_zeroing")
    scores: list[torch.Tensor] = []
    stack = None
    if not isinstance(token_budget, int) or token_budget < 1:
        raise InputError(f"value_zeroing token_budget must be a positive integer, got {token_budget!r}")
    with eval_mode(pm.model):
        for batch, tq in row_batches(pm, examples, batch_size):
            stack = _mixing_stack(pm, tq)
            lengths = tq.lengths.tolist()
            distances = value_zeroing_distances(pm, batch, mixing_widths(tq), stack, token_budget=token_budget)
            cross = _cross_rows(pm, batch, tq) if pm.task.encoder_decoder else None
            for row, matrices in enumerate(distances):
                rolled = _scores_from_matrices([_normalise_rows(m) for m in matrices], tq, row, cross)
                scores.append(rolled[:, : lengths[row]])
    block = next(iter(block_modules(pm, pm.task.input_stack(pm.contract)).values()),
                 None)
    return TokenScores("value_zeroing", scores, per_layer=True, params=_params(
        pm, pm.task.target_stack(pm.contract), **_seq2seq_params(pm),
        formula="C_ij = cosine distance of token i's layer output when v_j is zeroed in every head, "
                "rows normalised", layer_output=f"the output of the block holding the attention "
                                                f"({type(block).__name__ if block is not None else '?'})",
        rollout="R_l = C_l R_(l-1), no identity added (the residual is in C)",
        cost="one extra pass of one layer per explained token per layer (about one full forward per token), "
             "variants stacked in batches", token_budget=token_budget))


#: the registry's by-name entry for the context-mixing methods (this module's :func:`context_mixing_scores`)
SCORER = f"{__name__}:context_mixing_scores"


def context_mixing_scores(pm: ProbeModel, examples: Sequence[PreparedExample], method: str,
                          **params: Any) -> TokenScores:
    entry = registry.find(method)
    if entry is None or entry.scorer != SCORER:
        raise InputError(f"unknown context-mixing method {method!r}: use one of {', '.join(CONTEXT_MIXING_METHODS)}")
    return entry.load()(pm, examples, **{**dict(entry.preset), **params})


__all__ = [
    "alti", "alti_matrix", "context_mixing_scores", "globenc", "globenc_matrix", "mixing_terms",
    "record_layers", "rolled_rows", "value_zeroing", "value_zeroing_distances",
]
