"""BigBird's block-sparse attention read as the forward that ran computed it.

Oracles on a tiny random BigBird built from its config (fp32, seeded, blocks of 2, one or two
random blocks, lengths that run block-sparse and are not block multiples, so the model's padding
is cropped): the dense map the reader builds (a) times the layer's own values is the layer's own
context output, (b) is exactly 0 outside its structure (per head), (c) sums to one over it on
every real query row, and (d) is the same for a batch of one as for the batch when the example
is padded to the batch's width (the blocks depend on the padded length; unpadded it is another
computation, shown too). HF's own ``output_attentions`` differ where a key is scored twice (in
eval every random slot is block 0), and equal the reader's once those weights are counted again.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from probe.hooks.blocksparse import BlockSparseReader, is_block_sparse, is_block_sparse_layer

TOL = 1e-5
BLOCK = 2
LENGTHS = (19, 16, 17)  # (5 + 2r) * 2 = 14 (r = 1) or 18 (r = 2) and below run full attention


def _bigbird(cls_name: str = "BigBirdModel", random_blocks: int = 1):
    import transformers

    config = transformers.BigBirdConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        block_size=BLOCK, num_random_blocks=random_blocks, max_position_embeddings=64, attention_type="block_sparse",
        pad_token_id=0, bos_token_id=2, eos_token_id=3, sep_token_id=3, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # peaked maps, so that equality means something
        for module in model.modules():
            if is_block_sparse(module):
                module.query.weight.mul_(8.0)
                module.key.weight.mul_(8.0)
    return model


def _batch(lengths=LENGTHS):
    torch.manual_seed(1)
    width = max(lengths)
    ids = torch.randint(4, 40, (len(lengths), width))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def _run(model, ids, mask):
    """Per layer path: the reader's call, the block-sparse child's input hidden states and context
    output [batch, seq, E] (over the padded length) and its HF attention_probs; the model's output."""
    layers = {p: m for p, m in model.named_modules() if is_block_sparse_layer(m)}
    seen: dict[str, dict] = {p: {} for p in layers}
    handles = []
    for path, layer in layers.items():
        def after(mod, args, kwargs, output, path=path):
            seen[path].update(hidden=args[0] if args else kwargs["hidden_states"], context=output[0], hf=output[1])

        handles.append(layer.self.register_forward_hook(after, with_kwargs=True))
    reader = BlockSparseReader(model, layers, lambda mod, call: seen[next(p for p, m in layers.items() if m is mod)]
                               .__setitem__("call", call))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask)
    finally:
        reader.close()
        for handle in handles:
            handle.remove()
    return seen, out


def _heads(x, heads=4):  # [batch, seq, E] -> [batch, head, seq, d]
    b, s, e = x.shape
    return x.view(b, s, heads, e // heads).transpose(1, 2)


@pytest.mark.parametrize("random_blocks", [1, 2])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_dense_map_reproduces_the_layer_and_lives_on_its_structure(random_blocks, mode):
    warnings.simplefilter("ignore")
    model = _bigbird(random_blocks=random_blocks)
    model.train(mode == "train")  # dropout is 0: training only makes HF draw random blocks
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    modules = dict(model.named_modules())
    length = ids.shape[1]
    gaps = {"values": 0.0, "outside": 0.0, "sums": 0.0}
    for path, record in seen.items():
        call = record["call"]
        assert call.mode == "block_sparse" and call.length == length and call.real.shape[1] % BLOCK == 0
        assert call.real.shape[1] > length  # the model padded to a block multiple: cropped here
        weights, structure = call.dense_per_head()  # [batch, head, query, key] both
        assert weights.shape == structure.shape == (3, 4, length, length)
        value = _heads(modules[path].self.value(record["hidden"]))[:, :, :length]
        mixed = (weights @ value).transpose(1, 2).reshape(3, length, -1)
        real = mask.bool()
        # (a) the map times the layer's values is the layer's context output
        gaps["values"] = max(gaps["values"], (mixed - record["context"][:, :length])[real].abs().max().item())
        # (b) nothing outside the structure, exactly
        gaps["outside"] = max(gaps["outside"], weights.masked_fill(structure, 0.0).abs().max().item())
        # (c) real rows sum to one over the structure; padded rows and keys are empty
        sums = (weights * structure).sum(-1)
        gaps["sums"] = max(gaps["sums"], (sums - 1)[real[:, None].expand_as(sums)].abs().max().item())
        union = structure.any(1)  # [batch, query, key]
        assert not bool(union[~real].any()) and not bool(union.transpose(1, 2)[~real].any())
        # the pattern: global first and last blocks of the padded length, a 3-block window, r random blocks
        nb = call.real.shape[1] // BLOCK
        rand = call.random_blocks  # [batch, head, nb - 2, r]
        assert rand.shape == (3, 4, nb - 2, random_blocks)
        for q in range(1, nb - 1):
            keys = {0, nb - 1, q - 1, q, q + 1} | set(rand[0, 0, q - 1].tolist())
            expect = torch.zeros(call.real.shape[1], dtype=torch.bool)
            for k in keys:
                expect[k * BLOCK:(k + 1) * BLOCK] = True
            expect = expect[:length] & real[0]
            for row in range(q * BLOCK, min((q + 1) * BLOCK, LENGTHS[0])):
                assert torch.equal(structure[0, 0, row], expect), (q, row)
        assert bool(structure[0, :, :BLOCK, :LENGTHS[0]].all())  # the first block attends to every real key
        if mode == "eval":
            assert not bool(rand.any()) and not call.structure().random_drawn  # HF draws none in eval
        else:
            assert bool(rand.any())
            # HF keeps no duplicates in training: its own map is the one that ran
            hf = record["hf"][:, :, :length, :length].float() * (real[:, None, :, None] & real[:, None, None, :])
            assert (hf - weights).abs().max().item() <= TOL
    print(f"r={random_blocks} {mode}: max |diff| values {gaps['values']:.2e}, outside {gaps['outside']:.1e}, "
          f"row sums {gaps['sums']:.2e}")
    assert gaps["values"] <= TOL and gaps["outside"] == 0.0 and gaps["sums"] <= TOL, gaps


def test_random_blocks_are_the_calls_own_and_eval_draws_none():
    """Eval: the random slots are all block 0 on every call (deterministic). Training: HF seeds
    numpy with the layer's index on every call, so the draw repeats call after call, differs
    between layers, and the reader takes it from the call."""
    warnings.simplefilter("ignore")
    model = _bigbird(random_blocks=2)
    ids, mask = _batch()
    draws = {}
    for mode in ("eval", "train"):
        model.train(mode == "train")
        first, _ = _run(model, ids, mask)
        again, _ = _run(model, ids, mask)
        draws[mode] = [first[p]["call"].random_blocks for p in sorted(first)]
        assert all(torch.equal(a, again[p]["call"].random_blocks) for a, p in zip(draws[mode], sorted(again)))
    assert not any(bool(d.any()) for d in draws["eval"])
    assert not torch.equal(draws["train"][0], draws["train"][1])


def test_hf_output_attentions_lose_the_weights_of_keys_scored_twice():
    """HF assigns (scatter_) the random blocks' weights over the global block's: in eval its rows
    do not sum to one; counted 1 + r times again (probe.models.checks' oracle) they equal the reader's."""
    from probe.hooks.blocksparse import dense_from_output_attentions

    warnings.simplefilter("ignore")
    model = _bigbird(random_blocks=2)
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    modules = dict(model.named_modules())
    worst_raw = worst = 0.0
    for path, record in seen.items():
        weights, _ = record["call"].dense()
        raw = record["hf"][:, :, :ids.shape[1], :ids.shape[1]].float() * mask[:, None, :, None] * mask[:, None, None, :]
        worst_raw = max(worst_raw, (raw - weights).abs().max().item())
        fixed = dense_from_output_attentions(record["hf"], modules[path], mask, ran_block_sparse=True)
        worst = max(worst, (fixed - weights).abs().max().item())
    print(f"HF output_attentions vs the map that ran: {worst_raw:.2e} raw, {worst:.2e} with duplicates counted")
    assert worst_raw > 0.01 and worst <= TOL


def test_batch_of_one_equals_the_batch_when_padded_the_same_way():
    warnings.simplefilter("ignore")
    model = _bigbird()
    ids, mask = _batch()
    seen, _ = _run(model, ids, mask)
    worst = moved = 0.0
    for b, n in enumerate(LENGTHS):
        padded, _ = _run(model, ids[b:b + 1], mask[b:b + 1])  # the batch's width, its own padding
        alone, _ = _run(model, ids[b:b + 1, :n], mask[b:b + 1, :n])  # unpadded: other blocks
        for path in seen:
            full, structure = seen[path]["call"].dense_per_head()
            one, one_structure = padded[path]["call"].dense_per_head()
            assert torch.equal(structure[b], one_structure[0])
            worst = max(worst, (full[b] - one[0]).abs().max().item())
            if n < ids.shape[1]:
                other, _ = alone[path]["call"].dense()
                moved = max(moved, (full[b, :, :n, :n] - other[0]).abs().max().item())
    print(f"batch of 1 (same width) vs batch of N: max |diff| {worst:.2e}; unpadded example: {moved:.2e}")
    assert worst <= TOL
    assert moved > TOL  # the last block (global) and the block count follow the padded length


def test_a_short_input_runs_full_attention_and_the_model_is_put_back():
    warnings.simplefilter("ignore")
    model = _bigbird()
    children = [m for m in model.modules() if is_block_sparse(m)]
    ids, mask = _batch((9, 7))  # <= 14 tokens: HF runs full attention
    seen, _ = _run(model, ids, mask)
    for record in seen.values():
        call = record["call"]
        weights, structure = call.dense()
        assert call.mode == "full" and weights.shape == (2, 4, 9, 9)
        assert "full attention" in call.structure().describe()
        sums = (weights * structure[:, None]).sum(-1)
        assert (sums - 1)[mask.bool()[:, None].expand_as(sums)].abs().max().item() <= TOL
    # the reader put the block-sparse modules back; without it HF keeps full attention for good
    assert [m for m in model.modules() if is_block_sparse(m)] == children
    long_ids, long_mask = _batch()
    assert next(iter(_run(model, long_ids, long_mask)[0].values()))["call"].mode == "block_sparse"
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert not any(is_block_sparse(m) for m in model.modules())  # HF's own fallback, kept


# --------------------------------------------------------------------------- wired into probe


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


@pytest.fixture(scope="module")
def classifier():
    """A tiny random BigBird classifier wrapped by probe; the sample texts are too short for blocks
    of 2, so the texts here repeat them."""
    import probe

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    warnings.simplefilter("ignore")
    texts = [f"{sweep.TEXTS[0]} {sweep.TEXTS[2]}", f"{sweep.TEXTS[2]} {sweep.TEXTS[0]} good"]
    return probe.wrap(_bigbird("BigBirdForSequenceClassification"), sweep.tokenizer()), texts


def test_the_contract_reads_bigbird_through_the_banded_reader(classifier):
    pm, _ = classifier
    info = pm.contract.stacks["encoder"]
    assert not pm.contract.unreadable and {s.kind for s in pm.contract.sites.values()} == {"banded"}
    assert (info.n_layers, info.n_heads, info.capture_path, info.can_edit) == (2, 4, "banded reader", False)
    assert "block-sparse" in info.structure and "blocks of 2" in info.structure and "14 tokens" in info.structure
    # building the contract ran a short input: the model keeps its block-sparse layers
    assert sum(is_block_sparse(m) for m in pm.model.modules()) == 2


def test_capture_equals_hf_counted_again_and_checks_pass(classifier):
    import probe
    from probe.models.checks import eager_attentions, run_checks

    pm, texts = classifier
    batch = pm.encode(texts)
    assert batch["input_ids"].shape[1] > 14
    with torch.no_grad():
        plain = pm.model(**batch).logits
        with probe.capture(pm, attention_mask=batch["attention_mask"]) as cap:
            captured = pm.model(**batch).logits
    assert torch.equal(plain, captured)
    maps = cap.maps("encoder")
    hf = eager_attentions(pm, batch)["encoder"]
    gap = max((maps.weights[:, i] - hf[i]).abs().max().item() for i in range(2))
    print(f"BigBird classifier: capture vs HF output_attentions (duplicates counted) {gap:.2e}")
    assert gap <= TOL
    hooks_before = _hook_counts(pm.model)  # transformers' output_attentions may leave its own
    with probe.capture(pm, attention_mask=batch["attention_mask"]):
        pm.model(**batch)
    assert _hook_counts(pm.model) == hooks_before
    failed = [(c.name, c.detail) for c in run_checks(pm, texts) if not c.passed]
    assert not failed, failed


def test_explain_runs_attention_rollout_and_leave_one_out(classifier):
    import probe

    pm, texts = classifier
    explanation = probe.explain(pm, texts, methods=["attention_mean", "rollout", "loo_delete"])
    for method in ("attention_mean", "rollout", "loo_delete"):
        for scores in explanation[method].scores:
            scores = torch.as_tensor(scores)
            scored = scores[..., 1:-1] if method == "loo_delete" else scores
            assert bool(torch.isfinite(scored).all()) and bool(scored.abs().sum() > 0), method
    assert sum(is_block_sparse(m) for m in pm.model.modules()) == 2


def test_editing_block_sparse_attention_is_refused_in_one_line(classifier):
    import probe
    from probe.errors import CaptureError

    pm, _ = classifier
    with pytest.raises(CaptureError, match="block-sparse attention") as refused, \
            probe.capture(pm, editors={("encoder", 0): lambda weights, context: weights}):
        pass
    assert "\n" not in str(refused.value)


def test_no_hook_or_mode_survives_an_exception_inside_the_capture(classifier):
    import probe

    pm, texts = classifier
    batch = pm.encode(texts)
    hooks_before = _hook_counts(pm.model)
    with pytest.raises(RuntimeError, match="inside"), probe.capture(pm, attention_mask=batch["attention_mask"]):
        pm.model(**batch)
        raise RuntimeError("inside")
    assert _hook_counts(pm.model) == hooks_before
    assert all("torch_gather_b2" not in m.__dict__ for m in pm.model.modules())
    assert torch.overrides._get_current_function_mode_stack() == []


def test_bigbird_pegasus_encoder_is_read_as_its_layers_ran():
    import transformers

    import probe
    from probe.models.checks import eager_attentions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_architectures as sweep

    warnings.simplefilter("ignore")
    config = transformers.BigBirdPegasusConfig(
        vocab_size=160, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, block_size=BLOCK, num_random_blocks=1,
        attention_type="block_sparse", max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    pm = probe.wrap(transformers.BigBirdPegasusForConditionalGeneration(config).eval(), sweep.tokenizer())
    info = pm.contract.stacks["encoder"]
    assert (info.capture_path, info.can_edit) == ("banded reader", False) and "block-sparse" in info.structure
    assert pm.contract.stacks["decoder"].can_edit
    texts = [f"{sweep.TEXTS[0]} {sweep.TEXTS[2]}", sweep.TEXTS[0]]
    batch = pm.encode(texts)
    with torch.no_grad(), probe.capture(pm, attention_mask=batch["attention_mask"], stacks=["encoder"]) as cap:
        pm.model(**batch, decoder_input_ids=batch["input_ids"][:, :3])
    maps = cap.maps("encoder")
    hf = eager_attentions(pm, {**batch, "decoder_input_ids": batch["input_ids"][:, :3]})["encoder"]
    gap = max((maps.weights[:, i] - hf[i]).abs().max().item() for i in range(2))
    print(f"BigBird-Pegasus encoder: capture vs HF output_attentions (duplicates counted) {gap:.2e}")
    assert gap <= TOL
