"""Attention sinks in the views of the model: a study's ``sinks`` table (probe.study.sinks), the
report's model section (probe.report.setup_section) and ``probe inspect``, against a hand
computation from transformers' eager ``output_attentions`` (one example per forward, no padding);
and ``attention_nosink`` as a unit family of a study.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest
import torch

from probe.explainers.sinks import SINK_COLUMNS
from probe.report.build import build_report
from probe.report.sinks import sink_layers, sink_lines
from probe.spec.study import study_from_dict
from probe.study.runner import run_study
from probe.study.sinks import SINK_EXAMPLES

from tiny_models import WORDS
from tolerances import fp_tol

_rng = random.Random(5)
TEXTS = [" ".join(_rng.choice(WORDS[5:60]) for _ in range(_rng.randint(3, 8))) for _ in range(10)]
THRESHOLD = 0.3


def _study(model: Path, data: Path, out: Path, explainers) -> dict:
    return {"name": "sinks", "model": {"id": str(model)}, "dataset": {"name": str(data), "n": len(TEXTS)},
            "explainers": list(explainers), "references": ["loo_delete"],
            "metrics": {"top_k": [1], "sanity": {"randomisation": False}},
            "statistics": {"bootstrap": 200, "reference": "loo_delete"}, "engine": {"batch_size": 4},
            "output": str(out)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sink_data") / "texts.csv"
    pd.DataFrame({"text": TEXTS, "label": [0] * len(TEXTS)}).to_csv(path, index=False)
    return path


_RUNS: dict = {}


def _run(tiny_dirs, data, tmp_path_factory, kind, explainers):
    key = (kind, tuple(explainers))
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"sinks_{kind}") / "result"
        run_study(study_from_dict(_study(tiny_dirs[kind], data, out, explainers)), progress=False, log=lambda _: None)
        _RUNS[key] = out
    return _RUNS[key]


@torch.no_grad()
def _hand_rows(folder: Path, texts_by_example: dict[int, list[int]]) -> pd.DataFrame:
    """The sink table by hand: per example (its token ids as the study read them), layer and head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    rows = []
    for example, ids in texts_by_example.items():
        maps = torch.stack(model(input_ids=torch.tensor([ids]), output_attentions=True).attentions)[:, 0].double()
        received = maps.mean(dim=2)  # [layer, head, key]: mean over every query row
        sinks = received > THRESHOLD
        target = maps[:, :, -1]  # the last prompt token's row
        for layer in range(maps.shape[0]):
            for head in range(maps.shape[1]):
                keys = torch.nonzero(sinks[layer, head]).flatten().tolist()
                rows.append({"example": example, "layer": layer, "head": head,
                             "share": float(target[layer, head, keys].sum()), "n_sinks": len(keys),
                             "first": bool(sinks[layer, head, 0]), "positions": ",".join(map(str, keys))})
    return pd.DataFrame(rows)


def _ids(result: Path) -> dict[int, list[int]]:
    tokens = pd.read_parquet(result / "tokens.parquet")
    return {int(e): g.sort_values("position")["token_id"].tolist() for e, g in tokens.groupby("example")}


def _check_against_hand(folder: Path, result: Path, examples: list[int]) -> pd.DataFrame:
    table = pd.read_parquet(result / "sinks.parquet")
    assert list(table.columns) == list(SINK_COLUMNS)
    assert sorted(table["example"].unique()) == examples
    hand = _hand_rows(folder, {e: ids for e, ids in _ids(result).items() if e in examples})
    merged = table.merge(hand, on=["example", "layer", "head"], suffixes=("", "_hand"))
    assert len(merged) == len(hand) == len(table)
    assert (merged["positions"] == merged["positions_hand"]).all()
    assert (merged["first"] == merged["first_hand"]).all() and (merged["n_sinks"] == merged["n_sinks_hand"]).all()
    assert (merged["share"] - merged["share_hand"]).abs().max() <= fp_tol(1.0, depth=2)
    assert (table["n_sinks"] > 0).any(), "no sink in the tiny model: the comparison would be empty"
    return table


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_a_study_with_attention_nosink_finds_every_examples_sinks_from_its_pass(tiny_dirs, data, tmp_path_factory,
                                                                               kind):
    result = _run(tiny_dirs, data, tmp_path_factory, kind, ["attention", "attention_nosink"])
    _check_against_hand(tiny_dirs[kind], result, list(range(len(TEXTS))))
    # attention_nosink is a unit family of its own, one unit per layer x head, as attention is
    summary = pd.read_parquet(result / "summary.parquet")
    units = summary[summary["explainer"] == "attention_nosink"]
    assert len(units[["layer", "head"]].drop_duplicates()) == 2 * 4
    assert set(units["head"]) == {0, 1, 2, 3}
    agreement = pd.read_parquet(result / "agreement.parquet")
    assert (agreement["explainer"] == "attention_nosink").sum() == (agreement["explainer"] == "attention").sum()
    verdict = json.loads((result / "verdict.json").read_text())
    assert "attention_nosink" in json.dumps(verdict)


def test_a_study_without_it_finds_the_first_examples_sinks_in_one_pass(tiny_dirs, data, tmp_path_factory):
    result = _run(tiny_dirs, data, tmp_path_factory, "gpt2", ["attention"])
    _check_against_hand(tiny_dirs["gpt2"], result, list(range(min(SINK_EXAMPLES, len(TEXTS)))))


def test_the_report_names_the_sinks(tiny_dirs, data, tmp_path_factory):
    result = _run(tiny_dirs, data, tmp_path_factory, "gpt2", ["attention", "attention_nosink"])
    files = build_report(result, tmp_path_factory.mktemp("sink_report") / "report")
    markdown = Path(files.markdown).read_text(encoding="utf-8")
    table = pd.read_parquet(result / "sinks.parquet")
    first = sink_lines(table)[0]
    assert "### Attention sinks" in markdown and first in markdown
    assert "attention sinks (keys)" in markdown and "by attention\\_nosink's own pass" in markdown
    layers = pd.read_csv(Path(files.markdown).parent / "tables" / "sinks_layers.csv")
    expected = sink_layers(table)
    assert (layers["sink_share"] - expected["sink_share"]).abs().max() < 1e-5
    assert (Path(files.markdown).parent / "figures" / "sinks.png").is_file()


def test_sentences_name_runs_of_layers_and_a_model_without_sinks_in_one_line():
    rows = []
    for layer in range(6):
        for head in range(4):
            first = layer >= 2 and not (layer == 3 and head == 0)
            rows.append((0, layer, head, 0.9 if first else 0.0, int(first), first, "0" if first else "", 7, 0.3))
    frame = pd.DataFrame(rows, columns=list(SINK_COLUMNS))
    lines = sink_lines(frame)
    assert lines[0] == "The first token is a sink in 94% of the heads of layers 2-5."
    assert lines[-1].startswith("The target row puts a mean 0.56 of its attention on sink keys")
    none = frame.assign(share=0.0, n_sinks=0, first=False, positions="")
    assert sink_lines(none) == ["No attention sinks: no key receives a mean attention above 0.3 in any head of any "
                                "layer (1 example)."]


def test_probe_inspect_shows_the_texts_sinks(tiny_dirs):
    from typer.testing import CliRunner

    from probe.cli import app

    text = TEXTS[0]
    out = CliRunner().invoke(app, ["inspect", str(tiny_dirs["gpt2"]), text, "--json"])
    assert out.exit_code == 0, out.output
    sinks = json.loads(out.output.strip().splitlines()[-1])["sinks"]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])(text)["input_ids"]
    hand = _hand_rows(tiny_dirs["gpt2"], {0: ids})
    expected = hand.groupby("layer")["share"].mean()
    assert [round(r["sink_share"], 5) for r in sinks["layers"]] == [round(v, 5) for v in expected]
    assert sinks["lines"] == sink_lines(hand.assign(threshold=THRESHOLD, n_tokens=len(ids)))
    table = CliRunner().invoke(app, ["inspect", str(tiny_dirs["gpt2"]), text])
    assert table.exit_code == 0 and "attention sinks of this text" in table.output
