"""Banded attention (Longformer's sliding window + global tokens) read as the model runs it.

Oracles on a tiny random Longformer built from its config (fp32, seeded, eval): the dense map the
reader builds (a) mixes the layer's own values into the layer's own output (before the output
projection) and equals an independent dense softmax of q k^T over the band and global structure
built here, (b) is exactly 0 outside its structure, (c) sums to one over it on every real query
row, and (d) is the same for a batch of one as for a padded batch. Lengths are not multiples of
the window, so the model's internal padding is cropped.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from probe.hooks.banded import BandedReader, is_banded

WINDOW = 4  # attention_window: one-sided w = 2
LENGTHS = (7, 10, 5)  # none a multiple of the window
TOL = 1e-5


def _longformer(cls_name: str = "LongformerModel"):
    import transformers

    config = transformers.LongformerConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_window=WINDOW, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        sep_token_id=3, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # peaked maps, so that equality means something
        for module in model.modules():
            if is_banded(module):
                for name in ("query", "key", "query_global", "key_global"):
                    getattr(module, name).weight.mul_(12.0)
    return model


def _batch(global_positions: tuple[int, ...]):
    torch.manual_seed(1)
    width = max(LENGTHS)
    ids = torch.randint(4, 40, (len(LENGTHS), width))
    mask = (torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = ids * mask  # right padding with pad id 0
    glob = torch.zeros_like(ids)
    for p in global_positions:
        glob[:, p] = 1
    return ids, mask, glob * mask


def _run(model, ids, mask, glob):
    """(per layer: the reader's BandedCall, the layer's input hidden states [batch, seq, E], its
    output before the output projection [batch, seq, E], its kwargs), and the model's output."""
    layers = {p: m for p, m in model.named_modules() if is_banded(m)}
    seen: dict[str, dict] = {p: {} for p in layers}
    handles = []
    for path, module in layers.items():
        def before(mod, args, kwargs, path=path):
            seen[path]["hidden"] = args[0] if args else kwargs["hidden_states"]
            seen[path]["kwargs"] = dict(kwargs)

        def after(mod, args, kwargs, output, path=path):
            seen[path]["output"] = output[0]

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    reader = BandedReader(model, layers, lambda mod, call: seen[_path_of(layers, mod)].__setitem__("call", call))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob)
    finally:
        reader.close()
        for handle in handles:
            handle.remove()
    return seen, out


def _path_of(layers, module):
    return next(p for p, m in layers.items() if m is module)


def _heads(x, heads):  # [batch, seq, E] -> [batch, head, seq, d]
    b, s, e = x.shape
    return x.view(b, s, heads, e // heads).transpose(1, 2)


def _independent_dense(module, hidden, kwargs, length):
    """softmax(q k^T) over the structure, recomputed densely from the layer's projections:
    [batch, head, length, length]."""
    heads, w = module.num_heads, module.one_sided_attn_window_size
    d = module.head_dim
    masked, is_global = kwargs["is_index_masked"], kwargs["is_index_global_attn"]
    seq = hidden.shape[1]
    pos = torch.arange(seq)
    band = (pos[:, None] - pos[None]).abs() <= w
    real = ~masked
    local_allowed = ((band[None] & ~is_global[:, None, :]) | is_global[:, None, :]) & real[:, None, :]
    q = _heads(module.query(hidden), heads) / math.sqrt(d)
    k = _heads(module.key(hidden), heads)
    local = (q @ k.transpose(-1, -2)).masked_fill(~local_allowed[:, None], float("-inf")).softmax(-1)
    qg = _heads(module.query_global(hidden), heads) / math.sqrt(d)
    kg = _heads(module.key_global(hidden), heads)
    glob = (qg @ kg.transpose(-1, -2)).masked_fill(~real[:, None, None, :], float("-inf")).softmax(-1)
    dense = torch.where(is_global[:, None, :, None], glob, local)
    dense = dense.masked_fill(masked[:, None, :, None], 0.0)
    return dense[:, :, :length, :length]


GLOBALS = {"no global": (), "first token global": (0,), "first and fourth global": (0, 3)}


@pytest.mark.parametrize("case", sorted(GLOBALS))
def test_dense_map_reproduces_the_layer_and_lives_on_its_structure(case):
    warnings.simplefilter("ignore")
    model = _longformer()
    ids, mask, glob = _batch(GLOBALS[case])
    seen, _ = _run(model, ids, mask, glob)
    modules = dict(model.named_modules())
    gaps = {}
    for path, record in seen.items():
        module, call = modules[path], record["call"]
        length = ids.shape[1]
        assert call.length == length and call.local.shape[1] % WINDOW == 0 and call.local.shape[1] > length
        weights, structure = call.dense()  # [batch, head, query, key], [batch, query, key]
        assert weights.shape == (len(LENGTHS), 4, length, length) and structure.shape == (len(LENGTHS), length, length)
        hidden = record["hidden"]
        # (a) the map times the layer's values is the layer's output (global rows: the global values)
        value = _heads(module.value(hidden), 4)[:, :, :length]
        value_global = _heads(module.value_global(hidden), 4)[:, :, :length]
        is_global = record["kwargs"]["is_index_global_attn"][:, :length]
        mixed = torch.where(is_global[:, None, :, None], weights @ value_global, weights @ value)  # [b, h, q, d]
        mixed = mixed.transpose(1, 2).reshape(len(LENGTHS), length, -1)
        real = mask.bool()
        output = record["output"][:, :length]
        gaps["values"] = max(gaps.get("values", 0.0), (mixed - output)[real].abs().max().item())
        # (a') an independent dense softmax over the structure built here
        dense = _independent_dense(module, hidden, record["kwargs"], length)
        gaps["dense"] = max(gaps.get("dense", 0.0), (weights - dense).abs().max().item())
        # (b) nothing outside the structure
        assert bool((weights.masked_fill(structure[:, None], 0.0) == 0).all())
        # (c) every real query row sums to one over the structure; padded rows are empty
        sums = (weights * structure[:, None]).sum(-1)  # [batch, head, query]
        assert (sums[real[:, None].expand_as(sums)] - 1).abs().max().item() <= TOL
        assert not bool(structure[~real].any())
        # the structure: the band, the global rows and columns, real keys only
        pos = torch.arange(length)
        for b, n in enumerate(LENGTHS):
            expect = (pos[:n, None] - pos[None, :n]).abs() <= 2
            for g in GLOBALS[case]:
                expect[g, :] = True
                expect[:, g] = True
            assert torch.equal(structure[b, :n, :n], expect) and not bool(structure[b, :, n:].any())
        assert call.structure().global_positions == tuple(GLOBALS[case] for _ in LENGTHS)
    print(f"{case}: max |diff| values {gaps['values']:.2e}, dense {gaps['dense']:.2e}")
    assert gaps["values"] <= TOL and gaps["dense"] <= TOL, gaps


@pytest.mark.parametrize("case", sorted(GLOBALS))
def test_batch_of_one_equals_the_padded_batch(case):
    warnings.simplefilter("ignore")
    model = _longformer()
    ids, mask, glob = _batch(GLOBALS[case])
    seen, _ = _run(model, ids, mask, glob)
    worst = 0.0
    for b, n in enumerate(LENGTHS):
        alone, _ = _run(model, ids[b:b + 1, :n], mask[b:b + 1, :n], glob[b:b + 1, :n])
        for path in seen:
            full, structure = seen[path]["call"].dense()
            one, one_structure = alone[path]["call"].dense()
            assert torch.equal(structure[b, :n, :n], one_structure[0])
            worst = max(worst, (full[b, :, :n, :n] - one[0]).abs().max().item())
            assert not bool(full[b, :, :, n:].any()) and not bool(full[b, :, n:, :].any())
    print(f"{case}: batch 1 vs batch N max |diff| {worst:.2e}")
    assert worst <= TOL


def test_rows_asked_for_are_those_rows_of_the_full_map():
    model = _longformer()
    ids, mask, glob = _batch((0,))
    seen, _ = _run(model, ids, mask, glob)
    call = next(iter(seen.values()))["call"]
    full, structure = call.dense()
    rows = torch.tensor([[0, 3], [5, 1], [2, 4]])
    some, some_structure = call.dense(rows)
    for b in range(3):
        assert torch.equal(some[b], full[b][:, rows[b]]) and torch.equal(some_structure[b], structure[b][rows[b]])


@pytest.mark.parametrize("asked", [False, True])
def test_the_reader_leaves_the_models_output_as_it_was(asked):
    model = _longformer()
    ids, mask, glob = _batch((0,))
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob, output_attentions=asked)
    layers = {p: m for p, m in model.named_modules() if is_banded(m)}
    reader = BandedReader(model, layers, lambda mod, call: None)
    try:
        with torch.no_grad():
            read = model(input_ids=ids, attention_mask=mask, global_attention_mask=glob, output_attentions=asked)
    finally:
        reader.close()
    assert torch.equal(plain.last_hidden_state, read.last_hidden_state)
    assert (read.attentions is None) == (not asked) and (read.global_attentions is None) == (not asked)
    if asked:
        assert all(torch.equal(a, b) for a, b in zip(plain.attentions, read.attentions))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# --------------------------------------------------------------------------- wired into probe


@pytest.fixture(scope="module")
def classifier():
    """A tiny random Longformer classifier wrapped by probe (its forward makes the first token global)."""
    import sys
    from pathlib import Path

    import probe

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    warnings.simplefilter("ignore")
    tokenizer = sweep.tokenizer()
    return probe.wrap(_longformer("LongformerForSequenceClassification"), tokenizer), list(sweep.TEXTS)


def test_the_contract_reads_longformer_through_the_banded_reader(classifier):
    pm, _ = classifier
    info = pm.contract.stacks["encoder"]
    assert not pm.contract.unreadable and {s.kind for s in pm.contract.sites.values()} == {"banded"}
    assert (info.n_layers, info.n_heads, info.capture_path, info.can_edit) == (2, 4, "banded reader", False)
    assert info.mask_kind == "bidirectional" and "i-2..i+2" in info.structure and "global" in info.structure


def test_capture_returns_the_maps_the_layers_ran(classifier):
    import probe

    pm, texts = classifier
    batch = pm.encode(texts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        plain = pm.model(**batch).logits
        with probe.capture(pm, attention_mask=mask) as cap:
            captured = pm.model(**batch).logits
        with probe.capture(pm, queries="first", attention_mask=mask) as first:
            pm.model(**batch)
    assert torch.equal(plain, captured)
    maps = cap.maps("encoder")
    n = ids.shape[1]
    assert maps.weights.shape == (len(texts), 2, 4, n, n) and bool(maps.row_has_keys.eq(mask.bool()[:, None]).all())
    glob = torch.zeros_like(ids)
    glob[:, 0] = 1  # what the classifier's forward sets when it is given no global_attention_mask
    seen, _ = _run(pm.model, ids, mask, glob)
    modules = dict(pm.model.named_modules())
    worst = 0.0
    for layer in range(2):
        record = seen[pm.contract.module_paths[("encoder", layer)]]
        dense = _independent_dense(modules[pm.contract.module_paths[("encoder", layer)]], record["hidden"],
                                   record["kwargs"], n)
        worst = max(worst, (maps.weights[:, layer] - dense).abs().max().item())
    assert worst <= TOL, worst
    rows = first.maps("encoder")
    assert rows.weights.shape == (len(texts), 2, 4, 1, n) and torch.equal(rows.weights[..., 0, :], maps.weights[..., 0, :])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pm.model.modules())


def test_explain_runs_attention_rollout_and_leave_one_out(classifier):
    import probe

    pm, texts = classifier
    explanation = probe.explain(pm, texts, methods=["attention_mean", "rollout", "loo_delete"])
    for method in ("attention_mean", "rollout", "loo_delete"):
        for scores in explanation[method].scores:
            scores = torch.as_tensor(scores)
            # leave-one-out scores no special token ([CLS], [SEP]: NaN by design)
            scored = scores[..., 1:-1] if method == "loo_delete" else scores
            assert bool(torch.isfinite(scored).all()) and bool(scored.abs().sum() > 0), method


def test_editing_banded_attention_is_refused_in_one_line(classifier):
    import probe
    from probe.errors import CaptureError

    pm, _ = classifier
    with pytest.raises(CaptureError, match="banded attention") as refused, \
            probe.capture(pm, editors={("encoder", 0): lambda weights, context: weights}):
        pass
    assert "\n" not in str(refused.value)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pm.model.modules())


def test_no_hook_survives_an_exception_inside_the_capture(classifier):
    import probe

    pm, texts = classifier
    batch = pm.encode(texts)
    with pytest.raises(RuntimeError, match="inside"), probe.capture(pm, attention_mask=batch["attention_mask"]):
        pm.model(**batch)
        raise RuntimeError("inside")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pm.model.modules())


def test_led_encoder_is_read_as_its_layers_ran():
    """LED's encoder self-attention is Longformer's: read through the banded path (with and without a
    global first token), equal to HF's own output_attentions densified; decoder and cross stay editable."""
    import sys
    from pathlib import Path

    import transformers

    import probe
    from probe.models.checks import eager_attentions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    warnings.simplefilter("ignore")
    config = transformers.LEDConfig(
        vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, attention_window=WINDOW,
        max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, pad_token_id=0, bos_token_id=2,
        eos_token_id=3, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    pm = probe.wrap(transformers.LEDForConditionalGeneration(config).eval(), sweep.tokenizer())
    info = pm.contract.stacks["encoder"]
    assert (info.capture_path, info.can_edit) == ("banded reader", False) and "i-2..i+2" in info.structure
    assert pm.contract.stacks["decoder"].can_edit and pm.contract.stacks["cross"].can_edit
    texts = list(sweep.TEXTS)
    for first_global in (False, True):
        batch = dict(pm.encode(texts))
        if first_global:
            batch["global_attention_mask"] = torch.zeros_like(batch["input_ids"])
            batch["global_attention_mask"][:, 0] = 1
        with torch.no_grad(), probe.capture(pm, attention_mask=batch["attention_mask"], stacks=["encoder"]) as cap:
            pm.model(**batch)
        maps = cap.maps("encoder")
        hf = eager_attentions(pm, batch)["encoder"]
        gap = max((maps.weights[:, i] - hf[i]).abs().max().item() for i in range(2))
        print(f"LED encoder, first token global {first_global}: max |diff| vs HF output_attentions {gap:.2e}")
        assert gap <= TOL
        assert bool(maps.weights[:, :, :, 0, :].gt(0).any(-1).all()) if first_global else True
    explanation = probe.explain(pm, texts, methods=["attention_mean", "rollout", "loo_delete"])
    assert all(bool(torch.isfinite(torch.as_tensor(s)).all()) for s in explanation["rollout"].scores)
