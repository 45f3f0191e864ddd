"""Benchmark: peak memory of attention capture and of every method against sequence length.

The model is a random Llama with GQA: by default 4 layers, 8 query heads sharing 2 kv heads,
hidden 256, 32k positions; ``--deep`` a deep, narrow one (16 layers, hidden 128, 4 query heads
sharing 2 kv heads, 128k positions), where what a method keeps per layer shows. It reads T random
tokens. Modes, each measured in a fresh process:

* ``forward``  the plain forward pass (the baseline every mode includes)
* ``row``      capture of the last token's row at every layer and head: [layer, head, T]
* ``rollout``  probe's rollout of the last token: its row carried from the top layer down, each
               layer's attention formed 256 query rows at a time from the kept queries and keys
               (memory linear in T)
* ``stream``   the rollout before issue 18: one [T, T] product streamed through the layers
* ``full``     capture of every row at every layer and head: [layer, head, T, T] (held once: each
               layer is written into the stacked tensor as it runs, probe.hooks.stacked)

``--methods`` measures one row per method instead (issue 64), the modes above that a method is
(forward, row, rollout, full) and:

* ``saliency``, ``input_x_gradient``  one forward and backward through the model's own attention
               kernel (sdpa: no [T, T] map kept for the backward)
* ``integrated_gradients``  ``--ig-steps`` points, as many per pass as the gradient token budget holds
* ``loo_spans``      leave-one-out of ``--spans`` equal spans (the paragraphs of a long input) through
                     the engine, the causal prefix reused
* ``shapley_spans``  exact Shapley values of ``--shapley-players`` equal spans (2^n coalitions), the
                     causal prefix reused
* ``knockout_spans`` the edges from the target row to one span blocked in every head of the last
                     layer (``block_edges``), the prefix reused; the edited layer is recomputed whole

Modes quadratic in T (``stream``, ``full``) run only up to ``--quadratic-max``
tokens (4096), so ``--lengths 2048 4096 8192 16384`` shows the linear modes past it.

Peak memory is what the operation adds above the loaded model: CUDA's peak allocated memory on a
GPU, the process's peak resident set on the CPU (coarser: it includes the allocator's slack). The
methods table ends with each method's growth between its two longest lengths: the ratio of the
memory and its exponent log(ratio) / log(T2 / T1) (1: linear in T, 2: quadratic; a doubling of T
that at most doubles the memory, ratio <= 2.2, counts as linear).

    python benchmarks/bench_memory.py [--device cpu|cuda] [--lengths 128 512 2048 4096] [--quadratic-max 4096]
    python benchmarks/bench_memory.py --deep --methods --lengths 2048 4096 8192 16384
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

MODES = ("forward", "row", "rollout", "stream", "full")
METHODS = ("forward", "row", "rollout", "full", "saliency", "input_x_gradient", "integrated_gradients", "loo_spans",
           "shapley_spans", "knockout_spans")
QUADRATIC = ("stream", "full")
#: a doubling of T that multiplies the memory by at most this counts as linear growth
LINEAR_RATIO = 2.2
VOCAB = 512


def build_model(folder: str, deep: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    shape = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=16, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=131072) if deep else
             dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=32768))
    config = LlamaConfig(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            model_max_length=shape["max_position_embeddings"],
                            padding_side="right").save_pretrained(folder)


def peak_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _example(ids):
    from probe.rows.target import PreparedExample

    length = ids.shape[1]
    # token 0 is <s>, special: in no span, so a coalition that deletes every span still has a token
    return PreparedExample(text="", input_ids=[1, *ids[0, 1:].tolist()], special=[True] + [False] * (length - 1),
                           tokens=[""] * length, kind="logprob", target_ids=[3])


def _spans(length: int, n: int):
    """``n`` equal spans covering the T tokens but <s>: the paragraphs of a long input."""
    from probe.rows.spans import Span

    edges = [1 + round(i * (length - 1) / n) for i in range(n + 1)]
    return [Span(text=f"span {i}", start=a, end=b, positions=tuple(range(a, b)))
            for i, (a, b) in enumerate(zip(edges, edges[1:]))]


def _capture(pm, ids, mask, mode: str) -> int:
    from probe.hooks.capture import capture_attention

    with capture_attention(pm, queries="last" if mode == "row" else "all", attention_mask=mask) as cap:
        pm.model(input_ids=ids, attention_mask=mask)
        weights = cap.maps().weights  # [1, layer, head, rows, T]
    return weights.numel() * weights.element_size()


def _stream(pm, ids) -> None:
    from probe.explainers.rollout import encoder_stream
    from probe.rows.queries import row_batches

    for batch, tq in row_batches(pm, [_example(ids)], 1):
        encoder_stream(pm, batch, tq)


def _gradients(pm, ids, mode: str, options: dict) -> None:
    from probe.explainers import gradients as G
    from probe.explainers import integrated_gradients as IG

    examples = [_example(ids)]
    if mode == "integrated_gradients":
        IG.integrated_gradients(pm, examples, steps=options["ig_steps"])
    else:
        getattr(G, mode)(pm, examples)


def _interventions(pm, ids, mode: str, options: dict) -> None:
    from probe.intervene.engine import Engine
    from probe.intervene.knockout import EdgeSet, block_edges
    from probe.intervene.shapley import span_shapley
    from probe.intervene.spans import span_loo

    example = _example(ids)
    if mode == "loo_spans":
        span_loo(Engine(pm), [example], [_spans(ids.shape[1], options["spans"])])
    elif mode == "shapley_spans":
        span_shapley(Engine(pm), [example], [_spans(ids.shape[1], options["shapley_players"])])
    else:
        info = pm.contract.stacks[pm.contract.primary_stack]
        sites = tuple((info.n_layers - 1, head) for head in range(info.n_heads))
        keys = _spans(ids.shape[1], options["spans"])[0].positions
        block_edges(pm, [example], [EdgeSet(0, keys, sites)], batch_size=1)


def run_mode(pm, ids, mode: str, options: dict) -> int:
    """Run ``mode`` once on ``ids`` [1, T]; returns the bytes of the maps it hands back (0: none)."""
    import torch

    from probe.explainers.rollout import rollout

    mask = torch.ones_like(ids)
    if mode in ("saliency", "input_x_gradient", "integrated_gradients"):
        _gradients(pm, ids, mode, options)
        return 0
    with torch.no_grad():
        if mode == "forward":
            pm.model(input_ids=ids, attention_mask=mask)
        elif mode in ("row", "full"):
            return _capture(pm, ids, mask, mode)
        elif mode == "stream":
            _stream(pm, ids)
        elif mode == "rollout":
            rollout(pm, [_example(ids)], batch_size=1)
        else:
            _interventions(pm, ids, mode, options)
    return 0


def child(folder: str, mode: str, length: int, device: str, options: dict) -> None:
    import torch

    from probe.models.loading import load_model

    pm = load_model(folder, device=device)
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length)).to(pm.device)
    with torch.no_grad():
        pm.model(input_ids=ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]))  # warm-up: one-off allocations
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device)
    started = time.perf_counter()
    held = run_mode(pm, ids, mode, options)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(json.dumps({"mode": mode, "length": length, "extra_bytes": max(0, peak_bytes(device) - before),
                      "held_bytes": held, "seconds": time.perf_counter() - started,
                      "implementation": pm.contract.implementation}))


def _config(args) -> str:
    """What a record was measured with besides its mode and length (records of another are not reused)."""
    return (f"{'deep' if args.deep else 'default'} model on {args.device}, spans {args.spans}, shapley players "
            f"{args.shapley_players}, ig steps {args.ig_steps}")


def _saved(path: str | None, config: str) -> dict:
    """The records ``--results`` holds (one JSON object a line) measured with ``config``, by (length, mode)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return {(r["length"], r["mode"]): r for r in map(json.loads, filter(str.strip, f)) if r.get("config") == config}


def measure(folder: str, modes, args) -> dict:
    """``{(length, mode): child's record}`` for every mode at every length (quadratic modes up to
    ``--quadratic-max``), each in a fresh process; a record already in ``--results`` is not run again
    and a new one is appended there (a long table measured over several calls)."""
    saved = _saved(args.results, _config(args))
    results = {}
    options = ["--spans", str(args.spans), "--ig-steps", str(args.ig_steps), "--shapley-players",
               str(args.shapley_players)]
    for length in args.lengths:
        for mode in modes:
            if (mode in QUADRATIC and length > args.quadratic_max) or (args.only is not None and mode not in args.only):
                if (length, mode) in saved and not (mode in QUADRATIC and length > args.quadratic_max):
                    results[(length, mode)] = saved[(length, mode)]
                continue
            if (length, mode) in saved:
                results[(length, mode)] = saved[(length, mode)]
                continue
            out = subprocess.run([sys.executable, __file__, "--device", args.device, *options, "--child", folder, mode,
                                  str(length)], capture_output=True, text=True, env={**os.environ})
            if out.returncode != 0:
                raise SystemExit(f"{mode} at T = {length} failed:\n{out.stderr[-2000:]}")
            results[(length, mode)] = {**json.loads(out.stdout.strip().splitlines()[-1]), "config": _config(args)}
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(results[(length, mode)]) + "\n")
            if args.methods:
                record = results[(length, mode)]
                print(f"  {mode} T={length}: {record['extra_bytes'] / 2**20:.1f} MiB in {record['seconds']:.1f} s",
                      file=sys.stderr, flush=True)
        if not args.methods:
            print_modes_row(results, length)
    return results


def print_modes_header() -> None:
    print(f"{'T':>6} " + " ".join(f"{m + ' (MiB)':>15}" for m in MODES) + f" {'full/row':>10} {'held full/row':>14}",
          flush=True)


def print_modes_row(results: dict, length: int) -> None:
    mib = {m: results[(length, m)]["extra_bytes"] / 2**20 if (length, m) in results else float("nan") for m in MODES}
    line = f"{length:>6} " + " ".join(f"{mib[m]:>15.1f}" for m in MODES)
    if (length, "full") in results and (length, "row") in results:
        held = results[(length, "full")]["held_bytes"] / max(results[(length, "row")]["held_bytes"], 1)
        line += f" {mib['full'] / max(mib['row'], 1e-9):>10.1f} {held:>14.0f}"
    print(line, flush=True)


def print_modes_summary(results: dict, args) -> None:
    compared = [length for length in args.lengths if (length, "full") in results and (length, "row") in results]
    if not compared:  # every length past --quadratic-max: the full capture was not run to compare with
        longest = max(args.lengths)
        measured = ", ".join(f"{m} {results[(longest, m)]['extra_bytes'] / 2**20:.0f} MiB" for m in MODES
                             if (longest, m) in results)
        quadratic = ", ".join(sorted(set(QUADRATIC) & set(MODES)))
        print(f"at T = {longest}: {measured}; the modes quadratic in T ({quadratic}) were not run past "
              f"--quadratic-max {args.quadratic_max}, so there is no full-capture ratio")
        return
    last = max(compared)
    row, full = results[(last, "row")], results[(last, "full")]
    print(f"at T = {last}: full capture adds {full['extra_bytes'] / 2**20:.0f} MiB, row capture "
          f"{row['extra_bytes'] / 2**20:.0f} MiB (ratio {full['extra_bytes'] / max(row['extra_bytes'], 1):.1f}x); "
          f"maps held: {full['held_bytes'] / 2**20:.0f} MiB vs {row['held_bytes'] / 2**20:.3f} MiB "
          f"({full['held_bytes'] / max(row['held_bytes'], 1):.0f}x)")


def growth(results: dict, mode: str, lengths) -> tuple[int, int, float, float] | None:
    """(T1, T2, memory ratio, exponent) between the two longest lengths ``mode`` ran at; None below two."""
    ran = sorted(length for length in lengths if (length, mode) in results)
    if len(ran) < 2:
        return None
    t1, t2 = ran[-2], ran[-1]
    m1 = max(results[(t1, mode)]["extra_bytes"], 1)
    m2 = max(results[(t2, mode)]["extra_bytes"], 1)
    return t1, t2, m2 / m1, math.log(m2 / m1) / math.log(t2 / t1)


def print_methods_table(results: dict, args) -> None:
    """One row per method: MiB above the loaded model at each length (seconds beside), then its growth."""
    lengths = list(args.lengths)
    print("| method | " + " | ".join(f"T = {t} (MiB, s)" for t in lengths) + " | growth | exponent | linear |")
    print("|---|" + "---:|" * len(lengths) + "---|---:|---|")
    for mode in METHODS:
        cells = []
        for length in lengths:
            record = results.get((length, mode))
            skipped = "past --quadratic-max" if mode in QUADRATIC and length > args.quadratic_max else "not run"
            cells.append(f"{record['extra_bytes'] / 2**20:.0f} ({record['seconds']:.0f})" if record else skipped)
        found = growth(results, mode, lengths)
        if found is None:
            tail = "- | - | -"
        else:
            t1, t2, ratio, exponent = found
            doubling = 2 ** (math.log2(ratio) / math.log2(t2 / t1))  # the ratio a doubling of T would give
            tail = f"{ratio:.2f} ({t1}->{t2}) | {exponent:.2f} | {'yes' if doubling <= LINEAR_RATIO else 'no'}"
        print(f"| {mode} | " + " | ".join(cells) + f" | {tail} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--quadratic-max", type=int, default=4096, help="longest T for the modes quadratic in T")
    parser.add_argument("--deep", action="store_true", help="a deep, narrow Llama: 16 layers, hidden 128, 4 heads")
    parser.add_argument("--methods", action="store_true", help="one row per method (issue 64) instead of the modes")
    parser.add_argument("--spans", type=int, default=8, help="spans (players) of leave-one-out and knockout")
    parser.add_argument("--shapley-players", type=int, default=3, help="spans of the exact Shapley values")
    parser.add_argument("--ig-steps", type=int, default=4, help="integrated gradients' points")
    parser.add_argument("--only", nargs="*", choices=sorted(set(MODES) | set(METHODS)),
                        help="run only these modes (the others are read from --results where it has them); with "
                             "no mode, run none: the table of what --results holds")
    parser.add_argument("--results", help="a JSON-lines file: records found there are not run again, new ones "
                                          "are appended (the model is the same random one: seed 0)")
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = {"spans": args.spans, "shapley_players": args.shapley_players, "ig_steps": args.ig_steps}
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.device, options)
        return
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, deep=args.deep)
        if args.methods:
            print_methods_table(measure(folder, METHODS, args), args)
            return
        print_modes_header()
        print_modes_summary(measure(folder, MODES, args), args)


if __name__ == "__main__":
    main()
