"""Checks of the tiny random test models built by ``tests/tiny_models.py``."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tiny_models import TINY_AUTO_CLASS, TINY_KINDS, WORDS, build_tiny
from tolerances import assert_fp_close

TEXTS = ["the movie was good and the acting was great", "terrible plot"]
TARGETS = ["it was good", "bad"]  # decoder side of the seq2seq models

SEQ2SEQ = ("bart", "t5")


def _load(folder, kind, impl):
    auto = getattr(transformers, TINY_AUTO_CLASS[kind])
    model = auto.from_pretrained(folder, attn_implementation=impl).eval()
    assert model.config._attn_implementation == impl
    return model


def _inputs(tok, kind):
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    if kind in SEQ2SEQ:
        labels = tok(text_target=TARGETS, padding=True, return_tensors="pt")["input_ids"]
        labels[labels == tok.pad_token_id] = -100  # the model shifts labels right into decoder_input_ids
        enc["labels"] = labels
    return enc


def _check_attn(attns, n_layers, batch, heads, q_len, k_len):
    assert isinstance(attns, tuple) and len(attns) == n_layers
    peak = 0.0
    for a in attns:
        assert a.shape == (batch, heads, q_len, k_len)
        # attention rows sum to 1: a bounded quantity, absolute tolerance
        torch.testing.assert_close(a.sum(-1), torch.ones(batch, heads, q_len), atol=1e-5, rtol=0)
        assert (a >= 0).all()
        peak = max(peak, a.max().item())
    return peak


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_forward(kind, tiny_dirs):
    folder = tiny_dirs[kind]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.padding_side == "right"
    assert tok.pad_token_id is not None
    enc = _inputs(tok, kind)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    B, T = ids.shape
    assert B == 2 and mask[1].sum() < mask[0].sum() == T  # second text is padded on the right
    assert not (ids[mask.bool()] == tok.unk_token_id).any(), "test words missing from WORDS"

    eager = _load(folder, kind, "eager")
    sdpa = _load(folder, kind, "sdpa")
    cfg = eager.config
    with torch.no_grad():
        out_e = eager(**enc, output_attentions=True)
        out_s = sdpa(**enc)

    if kind == "bert":
        assert out_e.logits.shape == (B, cfg.num_labels) == (B, 2)
    elif kind in SEQ2SEQ:
        assert out_e.logits.shape == (B, enc["labels"].shape[1], cfg.vocab_size)
        assert torch.isfinite(out_e.loss)
    else:
        assert out_e.logits.shape == (B, T, cfg.vocab_size)
    # logits (unbounded) of two attention kernels: one forward in another order, at their scale
    n_stages = cfg.num_hidden_layers + (cfg.decoder_layers if kind == "bart" else
                                        cfg.num_decoder_layers if kind == "t5" else 0) + 2
    assert_fp_close(out_s.logits, out_e.logits, depth=n_stages)

    heads = cfg.num_attention_heads
    n_layers = cfg.num_hidden_layers
    if kind in SEQ2SEQ:
        D = enc["labels"].shape[1]
        n_dec = cfg.decoder_layers if kind == "bart" else cfg.num_decoder_layers
        peak = _check_attn(out_e.encoder_attentions, n_layers, B, heads, T, T)
        peak = max(peak, _check_attn(out_e.decoder_attentions, n_dec, B, heads, D, D))
        _check_attn(out_e.cross_attentions, n_dec, B, heads, D, T)
        # decoder self-attention is causal
        for a in out_e.decoder_attentions:
            assert a.triu(1).abs().max() == 0
    else:
        peak = _check_attn(out_e.attentions, n_layers, B, heads, T, T)
        if kind != "bert":
            for a in out_e.attentions:  # causal
                assert a.triu(1).abs().max() == 0
        # padding keys get no attention (right padding: padded keys of row 1)
        pad_keys = mask[1] == 0
        for a in out_e.attentions:
            assert a[1][..., pad_keys].abs().max() < 1e-6  # attention weights: bounded by 1 (absolute)
    assert peak > 0.5, f"{kind}: attention is near-uniform (max weight {peak:.3f})"


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_attention_peaked_but_not_one_hot(kind, tiny_dirs):
    """Every (layer, head) has a dominant key somewhere, many rows are peaked, few are one-hot."""
    folder = tiny_dirs[kind]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = _load(folder, kind, "eager")
    enc = tok(["the movie was good and the acting was great but the ending was bad"], return_tensors="pt")
    if kind in SEQ2SEQ:
        enc["decoder_input_ids"] = tok(text_target=TARGETS[:1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    attns = out.encoder_attentions if kind in SEQ2SEQ else out.attentions
    row_max = torch.stack([a[0].amax(-1) for a in attns])  # [layers, heads, T]
    if kind in ("gpt2", "llama_gqa"):
        row_max = row_max[..., 2:]  # the first causal rows see only 1-2 keys
    assert (row_max.amax(-1) > 0.5).all(), row_max.amax(-1)
    assert (row_max > 0.5).float().mean() > 0.25
    assert row_max.mean() < 0.9, "attention is (nearly) one-hot"
    if kind in SEQ2SEQ:  # only a few decoder rows: ask less of the cross-attention
        cross_max = torch.stack([a[0].amax(-1) for a in out.cross_attentions])
        assert (cross_max.amax(-1) > 0.5).float().mean() >= 0.5, cross_max.amax(-1)


def test_bert_tokenizer(tiny_dirs):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs["bert"])
    assert tok.convert_ids_to_tokens(tok("The movie was good")["input_ids"]) == [
        "[CLS]", "the", "movie", "was", "good", "[SEP]",
    ]
    assert (tok.pad_token_id, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token) == (
        0, "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    )
    enc = tok(["the movie was good", "bad"], padding=True)
    assert enc["input_ids"][1] == [tok.cls_token_id, tok.convert_tokens_to_ids("bad"), tok.sep_token_id, 0, 0, 0]
    assert enc["attention_mask"][1] == [1, 1, 1, 0, 0, 0]
    assert tok.convert_ids_to_tokens(tok("zyzzyva")["input_ids"]) == ["[CLS]", "[UNK]", "[SEP]"]
    assert tok.decode(tok("the movie was good")["input_ids"], skip_special_tokens=True) == "the movie was good"
    pair = tok("the movie", "was good")
    assert pair["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("gpt2", ["the", "movie"]),
        ("llama_gqa", ["<s>", "the", "movie"]),
        ("bart", ["<s>", "the", "movie", "</s>"]),
        ("t5", ["the", "movie", "</s>"]),
    ],
)
def test_other_tokenizers(kind, expected, tiny_dirs):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs[kind])
    assert tok.convert_ids_to_tokens(tok("The movie")["input_ids"]) == expected
    cfg = transformers.AutoConfig.from_pretrained(tiny_dirs[kind])
    assert cfg.pad_token_id == tok.pad_token_id
    if tok.eos_token_id is not None:
        assert cfg.eos_token_id == tok.eos_token_id
    if kind == "t5":
        assert tok.convert_tokens_to_ids(["<pad>", "</s>", "<unk>"]) == [0, 1, 2]
        assert cfg.decoder_start_token_id == tok.pad_token_id
    if kind == "bart":
        assert cfg.decoder_start_token_id == tok.eos_token_id
        assert cfg.bos_token_id == tok.bos_token_id
    if kind == "llama_gqa":
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)


def test_saved_config_has_no_attn_implementation(tiny_dirs):
    for kind, folder in tiny_dirs.items():
        cfg = json.loads((folder / "config.json").read_text())
        assert not any("attn_implementation" in k for k in cfg), kind


def test_seed_is_deterministic(tmp_path):
    import safetensors.torch

    a = safetensors.torch.load_file(build_tiny("gpt2", tmp_path / "a", seed=1) / "model.safetensors")
    b = safetensors.torch.load_file(build_tiny("gpt2", tmp_path / "b", seed=1) / "model.safetensors")
    c = safetensors.torch.load_file(build_tiny("gpt2", tmp_path / "c", seed=2) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_words_constant():
    assert len(WORDS) == len(set(WORDS)) >= 60
    assert all(w == w.lower() for w in WORDS)


def test_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny("gpt5", tmp_path)
