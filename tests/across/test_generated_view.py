"""What a researcher sees of a generated explanation (issue 43, item 3) and the small things of
item 6: one prompt x output matrix per method, whitespace visible, word pieces recognisable,
counts of prompts and output tokens; built-ins' progress on standard error; an all-convolution
LFM2's cache named as the cause of its refusal; each output token's own target query position;
terminal tables that never break a number.

Oracles: the matrices shown are :meth:`Explanation.matrix`'s numbers; token texts are checked
against hand-written expectations; query positions against len(input_ids)-1+step (the row
``probe.rows.queries.target_queries`` reads, whose scores tests/test_target.py checks)."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch

import probe
from probe.display import clean_token, prompt_text, shown_token
from probe.errors import InputError
from probe.explanation import Explanation
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

TAG = re.compile(r"<[^>]+>")
NUMBER = re.compile(r"-?\d+\.\d{3}")


def _generated(tokens, outputs, *, special=None, text="the prompt", messages=(), layers=3) -> Explanation:
    """A hand-made step explanation of one prompt: ``outputs`` its output tokens (decoded text),
    ``loo_delete`` (token-level) and ``attention_mean`` (``[layer, token]``) scores that differ per
    output token and per layer."""
    n = len(tokens)
    special = special or [False] * n
    examples = tuple(PreparedExample(text=text, input_ids=list(range(n)), special=list(special), tokens=list(tokens),
                                     kind="logprob", target_ids=list(range(100, 100 + len(outputs))), label_name=out,
                                     original_value=-0.5 - j, step=j, messages=tuple(messages))
                     for j, out in enumerate(outputs))
    loo = [torch.tensor([np.nan if s else 0.1 * (p + 1) * (j + 1) for p, s in enumerate(special)])
           for j in range(len(outputs))]
    attention = [torch.arange(layers * n, dtype=torch.float32).reshape(layers, n) / (layers * n) + j
                 for j in range(len(outputs))]
    return Explanation(model="m", examples=examples, scores={
        "loo_delete": TokenScores("loo_delete", loo),
        "attention_mean": TokenScores("attention_mean", attention, per_layer=True)})


# --------------------------------------------------------------------------- one helper for every view


@pytest.mark.parametrize("token, shown", [
    ("Ġcapital", "capital"), (" Paris", "Paris"), ("▁Paris", "Paris"),  # a word's starting space dropped
    ("\n", "\u21b5"), ("Ċ", "\u21b5"), ("ĊĊ", "\u21b5\u21b5"), ("<0x0A>", "\u21b5"),  # newlines visible
    (" ", "\u2423"), ("Ġ", "\u2423"), ("ĠĠ", "\u2423\u2423"), ("▁", "\u2423"), ("  Paris", "\u2423Paris"),
    ("\t", "\u21e5"), ("ĉ", "\u21e5"), (" \n", "\u2423\u21b5"),
    ("##ing", "##ing"), ("##", "##"),  # a word piece keeps its marker
    ("[CLS]", "[CLS]"), ("<|im_start|>", "<|im_start|>"), ("<0x41>", "<0x41>"), (".", "."),
])
def test_shown_token_makes_whitespace_visible_and_keeps_word_pieces(token, shown):
    assert shown_token(token) == shown


def test_the_data_column_still_strips_markers():
    """The tables' ``clean_token`` column and the words joined from pieces are data, not display:
    they keep stripping ``##`` (``playing``, not ``play##ing``)."""
    example = PreparedExample(text="playing", input_ids=[0, 1, 2, 3], special=[True, False, False, True],
                              tokens=["[CLS]", "play", "##ing", "[SEP]"], kind="prob", label=0)
    ex = Explanation(model="m", examples=(example,), scores={"s": TokenScores("s", [torch.tensor([0.0, 1, 2, 3])])})
    assert clean_token("##ing") == "ing"
    assert list(ex.to_pandas()["clean_token"]) == ["[CLS]", "play", "ing", "[SEP]"]
    assert [w for w, _ in ex.word_groups(0)] == ["[CLS]", "playing", "[SEP]"]
    # ... while the HTML and the plot show the piece as a piece
    html = ex._repr_html_()
    assert ">##ing</td>" in html
    labels = [t.get_text() for t in ex.plot(0).axes[-1].get_xticklabels()]
    assert labels == ["[CLS]", "play", "##ing", "[SEP]"]


# --------------------------------------------------------------------------- counts


def test_top_tokens_and_the_table_show_tokens_as_the_views_do():
    """top_tokens gave the tokenizer's 'Ġis' where every view shows 'is'; the table of a step explanation
    says which output token each example explains."""
    ex = _generated(["The", "\u0120capital", "\u0120of", "\u0120France", "\u0120is"], [" Paris", "\n"])
    top = ex.top_tokens(2, "loo_delete", example=1)
    assert [t for _, t, _ in top] == ["is", "France"] and ex.examples[1].tokens[top[0][0]] == "\u0120is"
    frame = ex.to_pandas()
    assert list(frame.columns[:4]) == ["example", "text", "output_index", "output_token"]
    first = frame[frame["example"] == 1].iloc[0]
    assert (first["text"], first["output_index"], first["output_token"]) == (0, 1, "\u21b5")
    assert set(frame.loc[frame["example"] == 0, "output_token"]) == {"Paris"}
    assert list(ex.to_pandas("word").columns[:4]) == ["example", "text", "output_index", "output_token"]


def test_the_repr_counts_prompts_and_output_tokens(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, ["the movie was good and", "bad plot"], ["attention_mean", "loo_delete"], generate=3)
    n = len(ex.examples)
    assert len(ex.outputs()) == 2 and n >= 2
    assert repr(ex).startswith(f"<Explanation {pm.name}: 2 prompts, {n} output tokens x 2 methods (")
    one = _generated(["a", "b"], [" x", "\n", "y"])
    assert "1 prompt, 3 output tokens x 2 methods" in repr(one)
    plain = probe.explain(pm, ["the movie was good and"], ["loo_delete"])
    assert ": 1 text x 1 method" in repr(plain)


# --------------------------------------------------------------------------- the HTML


def test_the_html_of_a_generated_explanation_is_one_matrix_per_method(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, ["the movie was good and"], ["attention_mean", "loo_delete"], generate=3)
    group = ex.outputs()[0]
    html = ex._repr_html_()
    assert html.count("<table") == 2 and "more example" not in html  # one matrix per method, not one table per token
    prompt = ex.examples[group[0]]
    for method, table in zip(ex.scores, html.split("<table")[1:]):
        header, body = table.split("</thead>")
        # columns: the prompt's tokens; rows: the output tokens, in order
        columns = re.findall(r"<th[^>]*title=\"\d+: [^\"]*\">([^<]*)</th>", header)
        assert columns == [shown_token(t) for t in prompt.tokens]
        rows = re.findall(r"<tr>(.*?)</tr>", body)
        assert [TAG.sub("", re.search(r"<th[^>]*>(.*?)</th>", r).group(1)) for r in rows] == \
            [f"{ex.examples[i].step}: {shown_token(ex.examples[i].label_name)}" for i in group]
        # every cell is the matrix's number
        cells = [[TAG.sub("", c) for c in re.findall(r"<td[^>]*>.*?</td>", r)] for r in rows]
        expected = ex.matrix(method).to_numpy()
        assert np.allclose([[float(c) for c in row] for row in cells], expected, rtol=1e-2, atol=1e-6)
    n_layers = ex["attention_mean"].scores[0].shape[0]
    assert f"attention_mean (layer {n_layers - 1} of 0..{n_layers - 1}, the last)" in html
    assert "prompt 0: the movie was good and" in html


def test_the_html_shows_five_prompts_and_counts_the_rest(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, [f"the movie was {w}" for w in ["good", "bad", "fun", "long", "slow", "nice"]],
                       ["loo_delete"], generate=2)
    html = ex._repr_html_()
    assert html.count("<table") == 5 and "prompt 4:" in html and "prompt 5:" not in html
    assert "and 1 more prompt " in html


def test_target_side_columns_include_the_output_written_before(loaded):
    pm = loaded("gpt2")
    units = probe.prepare(pm, ["the movie was good and"], generate=3, target_side=True)
    ex = probe.explain(pm, units, ["loo_delete"])
    html = ex._repr_html_()
    widest = max(ex.examples, key=lambda e: len(e.tokens))
    header = html.split("</thead>")[0]
    shown = re.findall(r"<th[^>]*title=\"\d+: [^\"]*\">([^<]*)</th>", header)
    assert shown == [shown_token(t) for t in widest.tokens]
    assert header.count("text-decoration:underline") == len(widest.tokens) - len(ex.examples[0].tokens) == 2
    assert "target_side=True scores" not in html  # said only where the output is not a source


def test_a_newline_output_token_is_visible_in_the_matrix_html_plot_and_terminal(capsys):
    ex = _generated(["The", "Ġcapital", "Ġis", "Ċ"], [" Paris", "\n", "\n\n"])
    matrix = ex.matrix("loo_delete")
    assert list(matrix.index) == ["0: Paris", "1: \u21b5", "2: \u21b5\u21b5"]
    assert list(matrix.columns) == ["0: The", "1: capital", "2: is", "3: \u21b5"]
    html = ex._repr_html_()
    assert ">1: \u21b5</th>" in html and "logprob of  =" not in html and "\u2423 a space" in html
    assert "output (3 tokens): Paris\u21b5\u21b5\u21b5" in TAG.sub("", html).replace(" Paris", "Paris")
    fig = ex.plot_matrix("loo_delete")
    rows = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert all(r.split(": ", 1)[1].strip() for r in rows) and rows[1].endswith("\u21b5")
    pm = types.SimpleNamespace(contract=types.SimpleNamespace(implementation="sdpa", dtype="float32", device="cpu",
                                                              n_layers=3), random_weights=())
    from probe.cli import terminal

    terminal.print_generation_tables(pm, ex, None)
    out = capsys.readouterr().out
    assert "1:\u21b5" in out and "per token: Paris -0.500, \u21b5 -1.500" in out
    assert "\u0120" not in out and "capital" in out


# --------------------------------------------------------------------------- the plot


def test_plot_matrix_names_its_layer_takes_layer_and_keeps_the_prompt(loaded):
    pm = loaded("gpt2")
    prompt = "the movie was good and the acting was great but the plot was slow and the ending was bad and"
    ex = probe.explain(pm, [prompt], ["attention_mean"], generate=2)
    n_layers = ex["attention_mean"].scores[0].shape[0]
    fig = ex.plot_matrix("attention_mean")
    assert f"layer {n_layers - 1} of 0..{n_layers - 1}, the last" in fig._suptitle.get_text()
    subtitle = fig.axes[0].get_title(loc="left")
    assert " ".join(subtitle.split()).endswith(prompt)  # wrapped, not cut to "the..."
    fig = ex.plot_matrix("attention_mean", layer=0)
    assert f"(layer 0 of 0..{n_layers - 1})" in fig._suptitle.get_text()
    np.testing.assert_allclose(np.asarray(fig.axes[0].get_images()[0].get_array()),
                               ex.matrix("attention_mean", layer=0).to_numpy())
    assert not np.allclose(ex.matrix("attention_mean", layer=0).to_numpy(), ex.matrix("attention_mean").to_numpy())
    with pytest.raises(InputError, match="layer=9"):
        ex.plot_matrix("attention_mean", layer=9)
    assert "layer" not in probe.explain(pm, [prompt], ["loo_delete"], generate=2).plot_matrix(
        "loo_delete")._suptitle.get_text()


# --------------------------------------------------------------------------- chat


def test_a_chat_prompt_is_headed_by_its_user_message_not_the_system_prompt():
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    start = text.index("What")
    message = (start, start + len("What is the capital of France?"), "user")
    tokens = ["<|im_start|>", "system", "Ċ", "What", "?", "<|im_end|>"]
    ex = _generated(tokens, [" Paris"], special=[True, True, True, False, False, True], text=text, messages=[message])
    assert prompt_text(ex.examples[0]) == "What is the capital of France?"
    html = ex._repr_html_()
    assert "prompt 0: What is the capital of France?" in html and "helpful AI" not in html
    assert "What is the capital of France?" in ex.plot_matrix("loo_delete").axes[0].get_title(loc="left")
    system = (text.index("You"), text.index("<|im_end|>"), "system")
    two = types.SimpleNamespace(text=text, messages=(system, message))
    assert prompt_text(two).startswith("system: You are") and prompt_text(two).endswith("| user: What is the "
                                                                                        "capital of France?")


# --------------------------------------------------------------------------- item 6: small things


def test_a_builtin_s_training_progress_goes_to_standard_error(capsys):
    from probe.models.training import progress_bar

    with progress_bar(True, "training minilm-rt", 3) as advance:
        for _ in range(3):
            advance("loss 0.1")
    captured = capsys.readouterr()
    assert captured.out == "" and "training minilm-rt" in captured.err


def _all_conv_lfm2(use_cache: bool):
    import transformers

    from tiny_models import eot_tokenizer

    tok, vocab = eot_tokenizer(("<|endoftext|>",))
    torch.manual_seed(0)
    config = transformers.Lfm2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, bos_token_id=0,
                                     eos_token_id=0, layer_types=["conv", "conv"], conv_L_cache=3, use_cache=use_cache)
    return transformers.Lfm2ForCausalLM(config).eval(), tok


def test_an_all_convolution_lfm2_with_a_cache_is_refused_naming_the_cache():
    model, tok = _all_conv_lfm2(use_cache=True)
    with pytest.raises(InputError, match=r"use_cache=False.*transformers' key/value cache") as caught:
        probe.wrap(model, tok)
    assert "model.config.use_cache = False" in str(caught.value) and "\n" not in str(caught.value)
    assert model.config.use_cache is True  # the config the caller gave is left as it was
    model.config.use_cache = False  # as the message says: it then loads, read as implicit attention
    pm = probe.wrap(model, tok)
    assert pm.contract.stacks and "cache" not in pm.contract.detected_by


def test_each_output_token_s_target_query_names_its_own_position(loaded):
    pm = loaded("gpt2")
    ex = probe.explain(pm, ["the movie was good and", "bad plot"], ["attention_mean", "attention"], generate=3)
    expected = [len(e.input_ids) - 1 + e.step for e in ex.examples]
    assert len(set(expected)) > 1
    for method in ("attention_mean", "attention"):
        params = ex[method].params
        assert params["target_query_positions"] == expected
        assert "len(input_ids)-1+step" in params["target_query"]
        assert f"here positions {', '.join(map(str, expected[:3]))}," in params["target_query"]
    whole = probe.explain(pm, ["the movie was good and"], ["attention_mean"])
    assert whole["attention_mean"].params["target_query"] == pm.task.target_query_note
    assert "target_query_positions" not in whole["attention_mean"].params
    t5 = loaded("t5")
    steps = probe.explain(t5, ["the movie was good and"], ["attention_mean"], generate=3)
    assert steps["attention_mean"].params["target_query_positions"] == [e.step for e in steps.examples]
    assert "averaged" not in steps["attention_mean"].params["target_query"]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_terminal_tables_at_80_columns_never_break_a_number(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    from probe.cli import terminal

    tokens = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    ex = _generated(tokens, [f" w{j}" for j in range(14)])
    pm = types.SimpleNamespace(contract=types.SimpleNamespace(implementation="sdpa", dtype="float32", device="cpu",
                                                              n_layers=3), random_weights=())
    terminal.print_generation_tables(pm, ex, None)
    out = capsys.readouterr().out
    assert max(len(line) for line in _lines(out)) <= 80
    assert "\u0120" not in out and "capital" in out and "(1 of " in out  # split into tables that fit
    # every cell whole: each method's 5 x 14 numbers, each on one line, as the matrix has them
    tables = out[out.index("\u250f"):]  # from the first table's top border on
    numbers = [float(v) for v in NUMBER.findall(tables)]
    expected = np.concatenate([ex.matrix(m).to_numpy().T.ravel() for m in ex.scores])
    assert sorted(np.round(numbers, 3)) == sorted(np.round(expected, 3))
    # the one-target tables: eight methods' columns in a family table at 80 columns
    example = ex.examples[0]
    columns = {f"method number {k}": (torch.full((len(tokens),), -0.2234 * (k + 1)), False) for k in range(8)}
    from rich.console import Console

    console = Console()
    console.print(terminal._family_table("gradient methods", example, columns))
    out = capsys.readouterr().out
    assert max(len(line) for line in _lines(out)) <= 80 and "\u0120" not in out and "France" in out
    assert sorted(float(v) for v in NUMBER.findall(out)) == sorted(
        float(f"{-0.2234 * (k + 1):.3f}") for k in range(8) for _ in tokens)
