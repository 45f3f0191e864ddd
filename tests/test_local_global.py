"""LongT5's local and transient-global encoder attention read as its layers ran it.

Oracles on a tiny random LongT5 encoder built from its config (fp32, seeded, eval; local_radius 2,
so blocks of 3; global blocks of 4; lengths that are not block multiples, so the layer's padding
is cropped, and one shorter than a global block, which has no side keys): (a) the local map times
the layer's own values plus the unfolded side weights times the side values is the layer's
attention output before its output projection, (b) the weights off the structure are exactly 0
(HF's mask, not probe's: the reader masks nothing but padded query rows), (c) real rows sum to one
(the folded map too), (d) a batch of one equals the right-padded batch (HF numbers global blocks by
absolute position, so a left-padded transient-global batch is another computation, shown too), and
HF's own ``output_attentions`` densified the same way are the reader's map. Wired into probe: the
contract, every ``probe contract`` check, explain, and the one-line refusal of edits.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from probe.hooks.local_global import LocalGlobalReader, dense_from_output_attentions, is_local_global

TOL = 1e-5
RADIUS, GLOBAL = 2, 4  # blocks of 3; global blocks of 4
LENGTHS = (13, 10, 6, 3)  # 13: an orphan token joins block 2; 3 < 4: no global block
KINDS = ("local", "transient-global")
HEADS, D_KV = 4, 8


def _config(kind: str, dropout: float = 0.0, vocab: int = 40):
    import transformers

    return transformers.LongT5Config(
        vocab_size=vocab, d_model=32, d_kv=D_KV, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=HEADS,
        local_radius=RADIUS, global_block_size=GLOBAL, encoder_attention_type=kind, dropout_rate=dropout,
        pad_token_id=0, eos_token_id=3, decoder_start_token_id=2)


def _encoder(kind: str, dropout: float = 0.0):
    import transformers

    torch.manual_seed(0)
    model = transformers.LongT5EncoderModel(_config(kind, dropout)).eval()
    with torch.no_grad():  # peaked maps, so that equality means something
        for module in model.modules():
            if is_local_global(module):
                module.q.weight.mul_(6.0)
                module.k.weight.mul_(6.0)
    return model


def _batch(lengths=LENGTHS, left: bool = False):
    torch.manual_seed(1)
    width = max(lengths)
    ids = torch.randint(4, 40, (len(lengths), width))
    positions = torch.arange(width)[None]
    n = torch.tensor(lengths)[:, None]
    mask = (positions >= width - n) if left else (positions < n)
    return ids * mask, mask.long()


def _run(model, ids, mask, **kwargs):
    """Per layer path: the reader's call, the layer's values [batch, rows, E] as each v projection
    ran (tokens, then side keys), its output before the output projection [batch, seq, E]; and the
    model's output."""
    layers = {p: m for p, m in model.named_modules() if is_local_global(m)}
    seen: dict[str, dict] = {p: {"values": []} for p in layers}
    handles = []
    for path, module in layers.items():
        handles.append(module.v.register_forward_hook(lambda mod, a, out, path=path: seen[path]["values"].append(out)))
        handles.append(module.o.register_forward_pre_hook(lambda mod, a, path=path: seen[path].__setitem__("mixed", a[0])))
    reader = LocalGlobalReader(model, layers, lambda mod, call: seen[next(p for p, m in layers.items() if m is mod)]
                               .__setitem__("call", call))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        reader.close()
        for handle in handles:
            handle.remove()
    return seen, out


def _largest(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _heads(x):  # [batch, rows, E] -> [batch, head, rows, d]
    b, s, _ = x.shape
    return x.view(b, s, HEADS, D_KV).transpose(1, 2)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("kind", KINDS)
def test_dense_map_reproduces_the_layer_and_lives_on_its_structure(kind, mode):
    warnings.simplefilter("ignore")
    model = _encoder(kind, dropout=0.1 if mode == "train" else 0.0)
    model.train(mode == "train")  # dropout on the weights: the reader takes them as they were used
    torch.manual_seed(2)
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    batch, length = ids.shape
    real = mask.bool()
    gaps = {"values": 0.0, "outside": 0.0, "sums": 0.0}
    for record in seen.values():
        call = record["call"]
        assert call.length == length and call.weights.shape[1] * call.block_len > length  # padding cropped
        local, local_structure = call.local()  # [batch, head, query, key], [batch, query, key]
        assert local.shape == (batch, HEADS, length, length)
        mixed = local @ _heads(record["values"][0])
        side, side_structure = call.side()  # [batch, head, query, G], [batch, query, G]
        if kind == "local":
            assert side.shape[-1] == 0 and len(record["values"]) == 1
        else:
            assert side.shape == (batch, HEADS, length, length // GLOBAL)
            mixed = mixed + side @ _heads(record["values"][1])
        mixed = mixed.transpose(1, 2).reshape(batch, length, -1)
        # (a) local @ V + side @ V_side is the layer's output before its output projection
        gaps["values"] = max(gaps["values"], (mixed - record["mixed"])[real].abs().max().item())
        # (b) the layer's own weights off the structure: exactly 0 (the reader masks no key)
        dense, structure = call.dense()
        gaps["outside"] = max(gaps["outside"], _largest(local.masked_fill(local_structure[:, None], 0)),
                              _largest(side.masked_fill(side_structure[:, None], 0)),
                              _largest(dense.masked_fill(structure[:, None], 0)))
        near = (torch.arange(length)[:, None] - torch.arange(length)).abs() <= RADIUS
        assert torch.equal(local_structure, near & real[:, :, None] & real[:, None, :])
        assert not bool(structure[~real].any()) and not bool(structure.transpose(1, 2)[~real].any())
        if mode == "eval":
            # (c) real rows sum to one: the layer's own split, and the folded map over real tokens
            rows = (local.sum(-1) + side.sum(-1), dense.sum(-1))
            gaps["sums"] = max(gaps["sums"], *((s - 1)[real[:, None].expand_as(s)].abs().max().item() for s in rows))
    print(f"{kind} {mode}: max |diff| local@V + side@V_side {gaps['values']:.2e}, off the structure "
          f"{gaps['outside']:.1e}, row sums {gaps['sums']:.2e}")
    assert gaps["values"] <= TOL and gaps["outside"] == 0.0 and gaps["sums"] <= TOL, gaps


def test_side_weights_fold_evenly_onto_hfs_global_blocks():
    """HF's blocks: 0-3, 4-7, 8-12 (the orphan 12 joins block 2) for 13 tokens; 6 tokens have one
    block (0-5); 3 tokens, fewer than a block, none: their rows are local only."""
    warnings.simplefilter("ignore")
    model = _encoder("transient-global")
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    call = next(iter(seen.values()))["call"]
    assert call.structure().global_blocks == (3, 2, 1, 0)
    assert "global blocks of 4" in call.structure().describe()
    share = call.fold()  # [batch, G, length]
    assert torch.allclose(share[0, 2, 8:13], torch.full((5,), 0.2)) and share[0, 2, :8].abs().sum() == 0
    assert torch.allclose(share[2, 0, :6], torch.full((6,), 1 / 6)) and share[2, 1:].abs().sum() == 0
    assert share[3].abs().sum() == 0
    local, _ = call.local()
    side, _ = call.side()
    dense, _ = call.dense()
    # a token's folded weight: its local weight plus its block's side weight over the block's size
    expected = local[0, :, :, 9] + side[0, :, :, 2] / 5
    assert (dense[0, :, :, 9] - expected).abs().max().item() <= 1e-7
    assert torch.equal(dense[3], local[3])  # no global block: the local map


@pytest.mark.parametrize("kind", KINDS)
def test_batch_of_one_equals_the_right_padded_batch(kind):
    warnings.simplefilter("ignore")
    model = _encoder(kind)
    ids, mask = _batch()
    seen, out = _run(model, ids, mask)
    worst = out_gap = 0.0
    for b, n in enumerate(LENGTHS):
        alone, out_1 = _run(model, ids[b:b + 1, :n], mask[b:b + 1, :n])
        out_gap = max(out_gap, (out.last_hidden_state[b, :n] - out_1.last_hidden_state[0]).abs().max().item())
        for path in seen:
            full, structure = seen[path]["call"].dense()
            one, one_structure = alone[path]["call"].dense()
            assert torch.equal(structure[b, :n, :n], one_structure[0])
            worst = max(worst, (full[b, :, :n, :n] - one[0]).abs().max().item())
    print(f"{kind}: batch of 1 vs right-padded batch: maps {worst:.2e}, outputs {out_gap:.2e}")
    assert worst <= TOL and out_gap <= TOL


def test_left_padding_moves_the_global_blocks_but_not_the_local_window():
    """HF numbers global blocks by absolute position in the padded row: left padding shifts them
    (another computation, not probe's doing); the local window is relative and stays."""
    warnings.simplefilter("ignore")
    moved = {}
    for kind in KINDS:
        model = _encoder(kind)
        ids, mask = _batch(left=True)
        seen, _ = _run(model, ids, mask)
        width, worst, lowest = ids.shape[1], 0.0, 1.0
        for b, n in enumerate(LENGTHS):
            alone, _ = _run(model, ids[b:b + 1, width - n:], mask[b:b + 1, width - n:])
            for path in seen:
                full, _ = seen[path]["call"].dense()
                one, _ = alone[path]["call"].dense()
                worst = max(worst, (full[b, :, width - n:, width - n:] - one[0]).abs().max().item())
                lowest = min(lowest, full[b, :, width - n:].sum(-1).min().item())
        # 6 tokens after 7 pads: HF's block 0 (positions 0-3) has no real token but is scored (a
        # zero value); its weight has no token to fold onto
        assert kind == "local" or lowest < 1 - 1e-3
        moved[kind] = worst
    print(f"left padding, batch of 1 vs batch: local {moved['local']:.2e}, transient-global "
          f"{moved['transient-global']:.2e}")
    assert moved["local"] <= TOL and moved["transient-global"] > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_hf_output_attentions_densified_are_the_readers_map(kind):
    warnings.simplefilter("ignore")
    model = _encoder(kind)
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    worst = 0.0
    for layer, (path, record) in enumerate(seen.items()):
        ours, _ = record["call"].dense()
        theirs = dense_from_output_attentions(hf[layer], dict(model.named_modules())[path], mask)
        worst = max(worst, (ours - theirs).abs().max().item())
    print(f"{kind}: reader vs HF output_attentions densified {worst:.2e}")
    assert worst <= TOL


@pytest.mark.parametrize("asked", [False, True])
def test_the_reader_leaves_the_models_output_as_it_was(asked):
    warnings.simplefilter("ignore")
    model = _encoder("transient-global")
    ids, mask = _batch()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, output_attentions=asked)
    _, read = _run(model, ids, mask, output_attentions=asked)
    assert torch.equal(plain.last_hidden_state, read.last_hidden_state)
    assert (read.attentions is not None) == asked
    if asked:
        assert all(torch.equal(a, b) for a, b in zip(plain.attentions, read.attentions))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_rows_asked_for_are_those_rows_of_the_full_map():
    warnings.simplefilter("ignore")
    model = _encoder("transient-global")
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    call = next(iter(seen.values()))["call"]
    rows = torch.tensor([[0, 12], [9, 1], [5, 0], [2, 1]])
    full, structure = call.dense()
    some, some_structure = call.dense(rows)
    picked = full.gather(2, rows[:, None, :, None].expand(-1, HEADS, -1, full.shape[-1]))
    assert torch.equal(some, picked)
    assert torch.equal(some_structure, structure.gather(1, rows[:, :, None].expand(-1, -1, structure.shape[-1])))


# --------------------------------------------------------------------------- wired into probe


@pytest.fixture(scope="module", params=KINDS)
def seq2seq(request):
    """A tiny random LongT5 seq2seq model wrapped by probe, on the sweep's word-level tokenizer."""
    import transformers

    import probe

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = transformers.LongT5ForConditionalGeneration(_config(request.param, vocab=160)).eval()
    texts = [sweep.TEXTS[0], sweep.TEXTS[1], f"{sweep.TEXTS[2]} {sweep.TEXTS[1]}"]
    return probe.wrap(model, sweep.tokenizer()), texts, request.param


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def test_the_contract_reads_the_encoder_through_the_banded_reader(seq2seq):
    pm, _, kind = seq2seq
    info = pm.contract.stacks["encoder"]
    assert not pm.contract.unreadable
    assert (info.n_layers, info.n_heads, info.capture_path, info.can_edit) == (2, HEADS, "banded reader", False)
    assert f"keys i-{RADIUS}..i+{RADIUS}" in info.structure and "\n" not in info.structure
    if kind == "transient-global":
        assert "global block of 4" in info.structure and "rows still sum to one" in info.structure
    assert pm.contract.stacks["decoder"].can_edit and pm.contract.stacks["cross"].can_edit


def test_every_contract_check_passes(seq2seq):
    from probe.models.checks import run_checks

    pm, texts, _ = seq2seq
    results = run_checks(pm, texts)
    failed = [(c.name, c.detail) for c in results if not c.passed]
    assert not failed, failed
    names = {c.name for c in results}
    assert {"capture_equals_eager_output_attentions", "batch_of_one_equals_batch_of_n", "rows_sum_to_one"} <= names


def test_explain_gives_finite_scores(seq2seq):
    import probe

    pm, texts, _ = seq2seq
    explanation = probe.explain(pm, texts, methods=["attention_mean", "loo_delete"])
    for method in ("attention_mean", "loo_delete"):
        for scores in explanation[method].scores:
            scores = torch.as_tensor(scores)
            scored = scores[..., 1:-1] if method == "loo_delete" else scores  # specials are not deleted
            assert bool(torch.isfinite(scored).all()) and bool(scored.abs().sum() > 0), method


def test_editing_the_encoder_is_refused_in_one_line(seq2seq):
    import probe
    from probe.errors import CaptureError

    pm, _, _ = seq2seq
    with pytest.raises(CaptureError, match="local attention") as refused, \
            probe.capture(pm, editors={("encoder", 1): lambda weights, context: weights}):
        pass
    assert "\n" not in str(refused.value) and "encoder layer 1" in str(refused.value)


def test_no_hook_survives_an_exception_inside_the_capture(seq2seq):
    import probe

    pm, texts, _ = seq2seq
    batch = pm.encode(texts)
    hooks_before = _hook_counts(pm.model)
    with pytest.raises(RuntimeError, match="inside"), probe.capture(pm, attention_mask=batch["attention_mask"],
                                                                   stacks=["encoder"]):
        pm.model(**batch, decoder_input_ids=batch["input_ids"][:, :3])
        raise RuntimeError("inside")
    assert _hook_counts(pm.model) == hooks_before
