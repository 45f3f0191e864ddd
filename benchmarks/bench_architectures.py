"""Coverage sweep: capture, editing, contract and explainers on every Hugging Face text architecture.

For every ``model_type`` in the installed transformers' causal-LM, sequence-classification and
seq2seq-LM auto mappings, builds a tiny random model (hidden 64, 2 layers, 4 heads, 2 kv heads where
the config takes them; fp32 CPU; a small word-level tokenizer) and, for the ``eager`` and ``sdpa``
implementations, records:

    oracle    the eager model runs and returns attention with ``output_attentions=True``
    read      probe's capture equals that oracle on every example's real rows and keys (max |diff| <=
              READ_TOL) and leaves the logits unchanged
    edit      an identity editor on every captured layer leaves the logits unchanged, and uniform
              attention on the last layer changes them
    contract  ``run_checks`` runs and every check passes (a failing check is named)
    explain   attention, rollout, loo_delete and integrated_gradients run and give finite scores
              (rollout, which reads rows as probabilities, only where every map is a softmax)
    maps      which maps probe reads: softmax, implicit (every layer a token mixer's matrix,
              probe.hooks.implicit) or hybrid (both, layer by layer)

A model whose layers are all token mixers returns no ``output_attentions``: its oracle is
``implicit`` (every mixer's matrices, applied to its value path, rebuild the mixer's output within
READ_TOL), ``edit`` is ``n/a`` (probe refuses edits of implicit maps) and ``read`` is that oracle with
the logits unchanged by the capture. In a hybrid, ``read`` and ``edit`` cover its softmax layers (and
``read`` also the mixers' oracle).

Each architecture runs under a time limit; a failure is recorded with its reason, never raised.
Writes ``reports/architectures.csv`` and ``reports/architectures.md`` (or ``--out``).

    nice python benchmarks/bench_architectures.py [--only bert,gpt2] [--limit-s 60] [--out reports/architectures]
"""

from __future__ import annotations

import argparse
import csv
import signal
import time
import warnings
from pathlib import Path

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 2, 4, 2, 16, 160
MAX_PARAMETERS = 20_000_000
READ_TOL = 1e-5  # fp32 capture vs the model's own eager output_attentions
SDPA_READ_TOL = 1e-4  # sdpa model read against the eager oracle: the kernels differ in fp32 rounding
EDIT_TOL = 1e-4  # identity edit: probe's softmax(QK^T) @ V against the model's own kernel
TEXTS = ("the movie was great and the acting was good", "not funny", "a boring story , bad ending")
IMPLEMENTATIONS = ("eager", "sdpa")
COLUMNS = ("model_type", "task", "implementation", "maps", "oracle", "read", "edit", "contract", "explain", "reason",
           "seconds")

# Sizes, under every name configs use for them; set only where the config has the attribute.
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "dim": HIDDEN, "embed_dim": HIDDEN,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "encoder_layers": LAYERS, "decoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "d_kv": HEAD_DIM,
    "intermediate_size": 128, "ffn_dim": 128, "d_ff": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "n_inner": 128, "hidden_dim": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128, "max_seq_len": 128,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "embedding_size": HIDDEN, "rotary_dim": 8,
}
_MAMBA2_HEADS = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}
# Per model type: what a two-layer tiny model needs so that it has attention at all.
OVERRIDES: dict[str, dict] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # block-sparse only above (5 + 2r) x block_size tokens (HF runs full attention below): blocks of
    # one token and one random block, so that the sample texts (up to 11 tokens) run block-sparse
    "big_bird": {"block_size": 1, "num_random_blocks": 1},
    "bigbird_pegasus": {"block_size": 1, "num_random_blocks": 1},
    # Mamba-2 mixers: 8 heads of 16 channels (expand 2 x hidden 64) and a small state, so that the
    # tiny model's scan (and probe's maps, heads x T^2) stay small
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16},
    # hybrids: layer 0 a token mixer, layer 1 softmax attention
    "bamba": {"attn_layer_indices": [1], **_MAMBA2_HEADS},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], **_MAMBA2_HEADS},
    "falcon_h1": {**_MAMBA2_HEADS, "mamba_d_ssm": 128},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1], "n_mamba_heads": 8,
               "mamba_headdim": 16, "mamba_d_state": 16},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # Kimi Linear: the delta-attention layer 4 heads of 16 channels (the default 32 x 128 is larger
    # than the whole tiny model), then an MLA attention layer
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16,
                    "layer_types": ["linear_attention", "full_attention"]},
    # zamba (v1): a Mamba layer and two hybrid ones (a Mamba mixer behind the shared attention
    # block; HF ties the shared block across hybrid layers, so it needs two of them)
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    # local_radius 127 and global blocks of 16 would put the sample texts in one block: radius 2
    # (blocks of 3) and global blocks of 4, transient-global (the local layer is its part)
    # xLSTM: the mLSTM kernels in fp32 (bfloat16 by default), chunks of 4 so that the chunkwise
    # kernel and the recurrent one both run on the sample texts
    "xlstm": {"autocast_kernel_dtype": "float32", "chunk_size": 4},
    "longt5": {"local_radius": 2, "global_block_size": 4, "encoder_attention_type": "transient-global"},
}

WORDS = ("the movie was great and acting good not funny a boring story , bad ending . film is very "
         "really love hate plot actor scene music best worst").split()
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("time limit")


def model_types() -> list[tuple[str, str]]:
    """(model_type, task) for every type in the three auto mappings.

    One task per type: seq2seq where it has a seq2seq head; a classifier for encoders (types with a
    masked-LM head, whose causal-LM head is an add-on); else a causal LM.
    """
    from transformers.models.auto import modeling_auto as auto

    chosen: dict[str, str] = {}
    for model_type in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and model_type not in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            chosen[model_type] = "classification"
    for task, mapping in (("seq2seq", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                          ("causal_lm", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("classification", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)):
        for model_type in mapping:
            chosen.setdefault(model_type, task)
    return sorted((t, task) for t, task in chosen.items() if _text_only(t))


def _text_only(model_type: str) -> bool:
    """A text model: its config class composes no other configs (vision, audio, text towers)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return not getattr(CONFIG_MAPPING[model_type], "sub_configs", None)


def tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + tuple(dict.fromkeys(WORDS)))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=64, padding_side="right", pad_token="[PAD]",
                                   unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   bos_token="[CLS]", eos_token="[SEP]")


def tiny_config(model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    kwargs = {name: value for name, value in SIZES.items() if (name in config.to_dict() or hasattr(config, name))
              and not isinstance(getattr(type(config), name, None), property)}  # a derived size (xlstm's v_head_dim)
    kwargs.update(pad_token_id=0, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2, num_labels=2)
    overrides = OVERRIDES.get(model_type, {})
    for name in ("layer_types", "layers_block_type"):
        default = getattr(config, name, None)
        if isinstance(default, list) and default and not overrides:
            # a hybrid keeps its first kind of layer and gains one softmax-attention layer behind it
            softmax = [t for t in default if "attention" in str(t) and "linear" not in str(t)]
            second = softmax[0] if softmax and default[0] != softmax[0] else default[1 % len(default)]
            kwargs[name] = [default[0], second]
    if hasattr(config, "attn_layer_indices"):
        kwargs["attn_layer_indices"] = [1]
    if "kv_lora_rank" in kwargs:  # multi-head latent attention expands its latent to one key/value head per query head
        kwargs["num_key_value_heads"] = HEADS
    kwargs.update(overrides)
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except Exception:
        for name in ("layer_types", "layers_block_type", "attn_layer_indices"):
            kwargs.pop(name, None)
        config = AutoConfig.for_model(model_type, **kwargs)
    config.use_cache = False
    return config


def build(model_type: str, task: str, implementation: str):
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    auto = {"seq2seq": AutoModelForSeq2SeqLM, "causal_lm": AutoModelForCausalLM,
            "classification": AutoModelForSequenceClassification}[task]
    torch.manual_seed(0)
    config = tiny_config(model_type)
    with torch.device("meta"):  # count first: a config the tiny sizes do not reach would build for minutes
        size = sum(p.numel() for p in auto.from_config(config, attn_implementation=implementation).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {size / 1e6:.0f}M parameters")
    model = auto.from_config(config, attn_implementation=implementation)
    return model.eval()


def wrap(model, tok, task):
    from probe.models.contract import build_contract
    from probe.models.core import ProbeModel

    return ProbeModel(name=f"tiny:{model.config.model_type}", path="", model=model, tokenizer=tok, task=task,
                      contract=build_contract(model, tok, task), load_seconds=0.0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:160]


def _oracle(pm, inputs):
    """HF eager output_attentions per stack: {stack: [layer tensors]}, or a reason string."""
    import torch

    from probe.models.checks import eager_attentions

    try:
        eager = eager_attentions(pm, inputs)
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure
        return f"output_attentions: {_first_line(exc)}"
    eager = {s: [a for a in (layers or ()) if isinstance(a, torch.Tensor)] for s, layers in eager.items()}
    eager = {s: layers for s, layers in eager.items() if layers}
    return eager or "output_attentions returns no attention"


def check_read(pm, inputs, oracle, tol) -> str:
    import torch

    from probe.models.checks import capture_all, softmax_layer_weights

    with torch.no_grad():
        plain = pm.model(**inputs).logits.float()
    logits, maps, calls = capture_all(pm, inputs)
    if (logits - plain).abs().max().item() > 1e-6:
        return "capture changed the output"
    gap = 0.0
    source = inputs["attention_mask"].sum(1).tolist()
    target = inputs.get("decoder_attention_mask", inputs["attention_mask"]).sum(1).tolist()
    for stack, layers in oracle.items():
        if stack not in maps:
            return f"no {stack} stack captured"
        # per layer (stacks whose layers differ, canine, too); a hybrid's mixer layers have no HF map
        captured = softmax_layer_weights(pm, stack, maps[stack])
        if len(captured) != len(layers):
            return f"{stack}: captured {len(captured)} layers, HF returns {len(layers)}"
        # real query rows and real keys of each example: what padded rows hold is no model's answer
        queries = source if stack == "encoder" else target
        keys = target if stack == "decoder" else source
        for li, hf in enumerate(layers):
            hf = hf.float()
            if hf.shape != captured[li].shape:
                return f"{stack} layer {li}: shape {tuple(captured[li].shape)} vs HF {tuple(hf.shape)}"
            for i, (q, k) in enumerate(zip(queries, keys)):
                gap = max(gap, (hf[i, :, :q, :k] - captured[li][i, :, :q, :k]).abs().max().item())
    return "" if gap <= tol else f"max |captured - HF| {gap:.1e} > {tol:.0e}"


def check_edit(pm, inputs) -> str:
    import torch

    from probe.hooks.capture import capture_attention

    with torch.no_grad():
        plain = pm.model(**inputs).logits.float()
    # the softmax layers: probe refuses edits of a mixer's implicit matrix (a hybrid's other layers)
    paths = {place: path for place, path in pm.contract.module_paths.items()
             if pm.contract.stacks[place[0]].layer_kind(place[1]) == "softmax"}
    masks = {"attention_mask": inputs["attention_mask"], "decoder_attention_mask": inputs.get("decoder_attention_mask")}
    with torch.no_grad(), capture_attention(pm, editors={p: (lambda w, c: w) for p in paths}, layers=(), **masks):
        same = pm.model(**inputs).logits.float()
    gap = (same - plain).abs().max().item()
    if gap > EDIT_TOL:
        return f"identity edit moved logits by {gap:.1e}"

    def uniform(weights, context):
        allowed = context.allowed if context.allowed is not None else torch.ones_like(weights, dtype=torch.bool)
        flat = allowed.expand_as(weights).float()
        return flat / flat.sum(-1, keepdim=True).clamp(min=1)

    stack = pm.contract.primary_stack
    last = max(layer for s, layer in paths if s == stack)
    with torch.no_grad(), capture_attention(pm, editors={(stack, last): uniform}, layers=(), **masks):
        moved = pm.model(**inputs).logits.float()
    if (moved - plain).abs().max().item() == 0:
        return "uniform attention did not change the output"
    return ""


def maps_kind(pm) -> str:
    """softmax | implicit | hybrid: what probe reads of the model's layers."""
    kinds = {info.maps for info in pm.contract.stacks.values()}
    return kinds.pop() if len(kinds) == 1 else "hybrid"


def check_implicit_read(pm, inputs) -> str:
    """A model of token mixers only: the capture leaves the logits unchanged and every mixer's
    matrices rebuild its output (probe.models.checks' implicit oracle)."""
    import torch

    from probe.models.checks import capture_all, implicit_oracle

    with torch.no_grad():
        plain = pm.model(**inputs).logits.float()
    logits, _, _ = capture_all(pm, inputs)
    if (logits - plain).abs().max().item() > 1e-6:
        return "capture changed the output"
    result = implicit_oracle(pm, inputs, READ_TOL)
    return "" if result.passed else result.detail


def check_edit_refused(pm) -> str:
    """Edits of implicit maps are refused in one line."""
    from probe.errors import CaptureError
    from probe.hooks.capture import capture_attention

    try:
        with capture_attention(pm, editors={next(iter(pm.contract.module_paths)): lambda w, c: w}):
            pass
    except CaptureError as exc:
        return "" if "\n" not in str(exc) else "refusal spans several lines"
    return "an edit of an implicit map was accepted"


def check_contract(pm) -> str:
    from probe.models.checks import run_checks

    failed = [c for c in run_checks(pm) if not c.passed]
    return "" if not failed else "; ".join(f"{c.name} ({c.detail})" for c in failed)[:200]


def check_explain(pm) -> str:
    import torch

    from probe.methods import run_methods
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec

    examples = prepare(pm, [TEXTS[0]], TargetSpec(), max_new_tokens=3)
    softmax = all(info.maps == "softmax" for info in pm.contract.stacks.values())
    methods = ["attention", "rollout", "loo_delete", "integrated_gradients"] if softmax else \
        ["attention", "loo_delete", "integrated_gradients"]  # rollout reads rows as probabilities
    results = run_methods(pm, examples, methods,
                          params={"integrated_gradients": {"steps": 8}})
    bad = [name for name, r in results.items() if not bool(torch.isfinite(r.scores[0][~torch.isnan(r.scores[0])]).all())
           or bool(torch.isnan(r.scores[0]).all())]
    return "" if not bad else f"non-finite scores: {', '.join(bad)}"


def _stage(fn, *args) -> str:
    try:
        return fn(*args)
    except Timeout:
        raise
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure with its reason
        return _first_line(exc)


def sweep_one(model_type: str, task: str, implementation: str, tok) -> dict:
    import torch

    row = {"model_type": model_type, "task": task, "implementation": implementation, "maps": "",
           "oracle": "", "read": "", "edit": "", "contract": "", "explain": "", "reason": ""}
    try:
        eager_model = build(model_type, task, "eager")
    except Exception as exc:  # noqa: BLE001
        row["reason"] = f"does not build: {_first_line(exc)}"
        return row
    try:
        pm_eager = wrap(eager_model, tok, task)
    except Exception as exc:  # noqa: BLE001
        pm_eager = None
        contract_error = f"contract: {_first_line(exc)}"
    batch = {k: v for k, v in tok(list(TEXTS), padding=True, return_tensors="pt").items()
             if k in ("input_ids", "attention_mask")}
    batch_inputs = dict(batch)
    if task == "seq2seq":  # the source shifted right behind the start token, padded like the source
        ids, mask = batch["input_ids"], batch["attention_mask"]
        decoder = torch.cat([torch.full_like(ids[:, :1], 2), ids[:, :-1]], dim=1)
        batch_inputs.update(decoder_input_ids=decoder * mask, decoder_attention_mask=mask)
    try:
        with torch.no_grad():
            out = eager_model(**batch_inputs, output_attentions=True)
    except Exception as exc:  # noqa: BLE001
        row["reason"] = f"does not run: {_first_line(exc)}"
        return row
    attentions = [a for name in ("attentions", "encoder_attentions", "decoder_attentions")
                  for a in (getattr(out, name, None) or ()) if isinstance(a, torch.Tensor)]
    if pm_eager is not None and pm_eager.contract.stacks:
        row["maps"] = maps_kind(pm_eager)
    if row["maps"] == "implicit":  # rwkv returns attentions of its own: not [query, key] maps
        return _sweep_implicit(row, model_type, task, implementation, tok, pm_eager, batch_inputs)
    if not attentions:
        row["reason"] = "reports no attention with output_attentions"
        return row
    row["oracle"] = "yes"
    if pm_eager is None:
        for col in ("read", "edit", "contract", "explain"):
            row[col] = "fail"
        row["reason"] = contract_error
        return row
    oracle = _oracle(pm_eager, batch_inputs)
    if isinstance(oracle, str):
        # HF reports attention, but none of it is a [batch, head, query, key] map over the input's
        # positions (a chunked or windowed layout): the architecture stays counted, and fails
        why = "; ".join(sorted(set(pm_eager.contract.unreadable.values())))
        row["reason"] = f"{oracle} over the input's positions" + (f"; probe: {why}" if why else "")
        for col in ("read", "edit", "contract", "explain"):
            row[col] = "fail"
        return row
    if implementation == "eager":
        pm = pm_eager
    else:
        try:
            pm = wrap(build(model_type, task, implementation), tok, task)
            if pm.model.config._attn_implementation != implementation:
                row["oracle"] = ""
                row["reason"] = f"{implementation} not supported (loaded as {pm.model.config._attn_implementation})"
                return row
        except Exception as exc:  # noqa: BLE001
            row["oracle"] = ""
            row["reason"] = f"{implementation} not available: {_first_line(exc)}"
            return row
    reasons = []
    if not pm.contract.stacks:
        why = "; ".join(sorted(set(pm.contract.unreadable.values())))
        reasons.append(f"probe finds no attention it can read ({why or 'no attention module'})")
        for col in ("read", "edit", "contract", "explain"):
            row[col] = "fail"
    else:
        tol = READ_TOL if implementation == "eager" else SDPA_READ_TOL
        for col, fn, args in (("read", check_read, (pm, batch_inputs, oracle, tol)), ("edit", check_edit, (pm, batch_inputs)),
                              ("contract", check_contract, (pm,)), ("explain", check_explain, (pm,))):
            why = _stage(fn, *args)
            row[col] = "ok" if not why else "fail"
            if why:
                reasons.append(f"{col}: {why}")
    row["reason"] = " | ".join(reasons)
    return row


def _sweep_implicit(row: dict, model_type: str, task: str, implementation: str, tok, pm_eager, inputs) -> dict:
    """A model of token mixers only (no output_attentions): the mixers' own oracle, edits refused."""
    row["oracle"] = "implicit"
    if implementation == "eager":
        pm = pm_eager
    else:
        try:
            pm = wrap(build(model_type, task, implementation), tok, task)
        except Exception as exc:  # noqa: BLE001
            row["oracle"] = ""
            row["reason"] = f"{implementation} not available: {_first_line(exc)}"
            return row
    reasons = []
    for col, fn, args in (("read", check_implicit_read, (pm, inputs)), ("edit", check_edit_refused, (pm,)),
                          ("contract", check_contract, (pm,)), ("explain", check_explain, (pm,))):
        why = _stage(fn, *args)
        row[col] = ("n/a" if col == "edit" else "ok") if not why else "fail"
        if why:
            reasons.append(f"{col}: {why}")
    row["reason"] = " | ".join(reasons) or "implicit maps: edits refused (not a softmax)"
    return row


def summarise(rows: list[dict]) -> dict:
    out = {}
    for implementation in IMPLEMENTATIONS:
        part = [r for r in rows if r["implementation"] == implementation and r["oracle"] == "yes"]
        out[implementation] = {"oracle": len(part), **{c: sum(r[c] == "ok" for r in part) for c in ("read", "edit",
                                                                                                    "contract",
                                                                                                    "explain")}}
    return out


def ran(row: dict) -> bool:
    """The tiny model built and ran a forward pass (whatever it reports: softmax attention, a token
    mixer's own output, or no attention at all)."""
    return row["oracle"] in ("yes", "implicit") or row["reason"] == "reports no attention with output_attentions"


def runs_summary(rows: list[dict]) -> dict:
    """Per implementation: the architectures that run (token-mixer and recurrent models included) and
    how many of them probe reads (read ok), and reads and explains (read, contract and explain ok)."""
    out = {}
    for implementation in IMPLEMENTATIONS:
        part = [r for r in rows if r["implementation"] == implementation and ran(r)]
        out[implementation] = {"run": len(part), "read": sum(r["read"] == "ok" for r in part),
                               "explained": sum(r["read"] == r["contract"] == r["explain"] == "ok" for r in part)}
    return out


def maps_summary(rows: list[dict]) -> dict[str, int]:
    """How many architectures (eager rows) probe reads as softmax, implicit or hybrid maps, all checks ok."""
    out: dict[str, int] = {}
    for r in rows:
        if r["implementation"] == "eager" and r.get("maps") and r["read"] == "ok" and r["contract"] == "ok" \
                and r["explain"] == "ok":
            out[r["maps"]] = out.get(r["maps"], 0) + 1
    return out


def write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    import transformers

    summary = summarise(rows)
    lines = [f"# Architecture coverage (transformers {transformers.__version__})", "",
             "Tiny random models (hidden 64, 2 layers, 4 heads, 2 kv heads where the config takes them; fp32 CPU), "
             "one per text model_type of the causal-LM, sequence-classification and seq2seq-LM auto mappings. "
             "`oracle`: the eager model returns attention with `output_attentions`; the other columns count among "
             "those. "
             f"`read`: capture equals the oracle within {READ_TOL:g} (eager) / {SDPA_READ_TOL:g} (sdpa) and leaves "
             f"logits "
             f"unchanged; `edit`: an identity edit moves logits by at most {EDIT_TOL:g} and uniform attention moves "
             f"them; "
             "`contract`: every `probe contract` check passes; `explain`: attention, rollout, loo_delete and "
             "integrated "
             "gradients give finite scores. Made by `benchmarks/bench_architectures.py`.", "",
             "| implementation | report attention | read | edit | contract | explain |", "|---|---|---|---|---|---|"]
    for implementation, s in summary.items():
        n = max(s["oracle"], 1)
        lines.append(f"| {implementation} | {s['oracle']} | " + " | ".join(
            f"{s[c]} ({100 * s[c] / n:.0f}%)" for c in ("read", "edit", "contract", "explain")) + " |")
    runs = runs_summary(rows)
    lines += ["", "Every architecture that runs, token-mixer (state-space, recurrent, convolution) and hybrid models "
              "included: `read` counts those probe reads (softmax attention against `output_attentions`, a token "
              "mixer's matrices against the mixer's own output), `read and explained` those whose contract checks "
              "and explainers pass too.", "",
              "| implementation | run | read | read and explained |", "|---|---|---|---|"]
    for implementation, s in runs.items():
        n = max(s["run"], 1)
        lines.append(f"| {implementation} | {s['run']} | {s['read']} ({100 * s['read'] / n:.0f}%) | "
                     f"{s['explained']} ({100 * s['explained'] / n:.0f}%) |")
    by_maps = maps_summary(rows)
    lines += ["", "Read (eager, read + contract + explain ok) by maps: " + (", ".join(
        f"{kind} {n}" for kind, n in sorted(by_maps.items())) or "none") + " (implicit: token mixers read as their "
              "[query, key] matrices, probe.hooks.implicit; hybrid: softmax and implicit layers in one stack).", ""]
    lines += ["| model_type | task | impl | maps | read | edit | contract | explain | reason |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reason = r["reason"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['model_type']} | {r['task']} | {r['implementation']} | {r.get('maps', '')} | {r['read']} | "
                     f"{r['edit']} | {r['contract']} | {r['explain']} | {reason} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--limit-s", type=int, default=60, help="time limit per architecture and implementation")
    parser.add_argument("--out", default="reports/architectures", help="path stem of the .csv and .md written")
    args = parser.parse_args(argv)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    tok = tokenizer()
    wanted = {t for t in args.only.split(",") if t}
    todo = [(t, task) for t, task in model_types() if not wanted or t in wanted]
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    for model_type, task in todo:
        for implementation in args.implementations.split(","):
            t0 = time.perf_counter()
            signal.alarm(args.limit_s)
            try:
                row = sweep_one(model_type, task, implementation, tok)
            except Timeout:
                row = {"model_type": model_type, "task": task, "implementation": implementation, "maps": "", "oracle": "",
                       "read": "", "edit": "", "contract": "", "explain": "", "reason": f"time limit {args.limit_s}s"}
            except BaseException as exc:  # noqa: BLE001
                if isinstance(exc, KeyboardInterrupt):
                    raise
                row = {"model_type": model_type, "task": task, "implementation": implementation, "maps": "", "oracle": "",
                       "read": "", "edit": "", "contract": "", "explain": "", "reason": f"sweep error: "
                                                                                        f"{_first_line(exc)}"}
            finally:
                signal.alarm(0)
            row["seconds"] = f"{time.perf_counter() - t0:.1f}"
            rows.append(row)
            if len(rows) % 20 == 0:
                write(rows, Path(args.out))  # a sweep cut short still leaves its table
            print(f"{model_type:28s} {implementation:6s} {row['maps'] or '-':8s} {row['read'] or '-':4s} "
                  f"{row['edit'] or '-':4s} "
                  f"{row['contract'] or '-':4s} {row['explain'] or '-':4s} {row['seconds']:>5s}s {row['reason'][:110]}",
                  flush=True)
    write(rows, Path(args.out))
    print(f"{len(todo)} model types in {time.perf_counter() - started:.0f}s")
    for implementation, s in summarise(rows).items():
        print(implementation, s)


if __name__ == "__main__":
    main()
