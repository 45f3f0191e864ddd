"""Benchmark: peak memory of attention capture against sequence length, row-only vs full.

A random Llama with GQA (4 layers, 8 query heads sharing 2 kv heads, hidden 256, 32k positions)
reads T random tokens, T in {128, 512, 2048, 4096}. Modes, each measured in a fresh process:

* ``forward``  the plain forward pass (the baseline every mode includes)
* ``row``      capture of the last token's row at every layer and head: [layer, head, T]
* ``rollout``  probe's rollout of the last token: its row carried from the top layer down, each
               layer's attention formed 256 query rows at a time from the kept queries and keys
               (memory linear in T)
* ``stream``   the rollout before issue 18: one [T, T] product streamed through the layers
* ``full``     capture of every row at every layer and head: [layer, head, T, T]

Modes quadratic in T (``stream``, ``full``) run only up to ``--quadratic-max`` tokens (4096), so
``--lengths 128 512 2048 4096 32768`` shows the linear modes at 32k.

Peak memory is what the operation adds above the loaded model: CUDA's peak allocated memory on a
GPU, the process's peak resident set on the CPU (coarser: it includes the allocator's slack).

    python benchmarks/bench_memory.py [--device cpu|cuda] [--lengths 128 512 2048 4096] [--quadratic-max 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

MODES = ("forward", "row", "rollout", "stream", "full")
QUADRATIC = ("stream", "full")


def build_model(folder: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            model_max_length=32768, padding_side="right").save_pretrained(folder)


def peak_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def child(folder: str, mode: str, length: int, device: str) -> None:
    import torch

    from probe.explainers.rollout import rollout
    from probe.hooks.capture import capture_attention
    from probe.models.loading import load_model
    from probe.rows.target import PreparedExample

    pm = load_model(folder, device=device)
    ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(length), device=pm.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        pm.model(input_ids=ids[:, :16], attention_mask=mask[:, :16])  # warm-up: one-off allocations
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device)
    held = 0
    with torch.no_grad():
        if mode == "forward":
            pm.model(input_ids=ids, attention_mask=mask)
        elif mode in ("row", "full"):
            with capture_attention(pm, queries="last" if mode == "row" else "all", attention_mask=mask) as cap:
                pm.model(input_ids=ids, attention_mask=mask)
                weights = cap.maps().weights  # [1, layer, head, rows, T]
            held = weights.numel() * weights.element_size()
        elif mode == "stream":
            from probe.explainers.rollout import encoder_stream
            from probe.rows.queries import row_batches

            example = PreparedExample(text="", input_ids=ids[0].tolist(), special=[False] * length, tokens=[""] * length,
                                      kind="logprob", target_ids=[3])
            for batch, tq in row_batches(pm, [example], 1):
                encoder_stream(pm, batch, tq)
        else:
            example = PreparedExample(text="", input_ids=ids[0].tolist(), special=[False] * length, tokens=[""] * length,
                                      kind="logprob", target_ids=[3])
            rollout(pm, [example], batch_size=1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(json.dumps({"mode": mode, "length": length, "extra_bytes": max(0, peak_bytes(device) - before),
                      "held_bytes": held}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--quadratic-max", type=int, default=4096, help="longest T for the modes quadratic in T")
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.device)
        return
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        results = {}
        print(f"{'T':>6} " + " ".join(f"{m + ' (MiB)':>15}" for m in MODES) + f" {'full/row':>10} "
                                                                              f"{'held full/row':>14}",
              flush=True)
        for length in args.lengths:
            for mode in MODES:
                if mode in QUADRATIC and length > args.quadratic_max:
                    continue
                out = subprocess.run([sys.executable, __file__, "--device", args.device, "--child", folder, mode,
                                      str(length)], capture_output=True, text=True, env={**os.environ})
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-2000:])
                results[(length, mode)] = json.loads(out.stdout.strip().splitlines()[-1])
            mib = {m: results[(length, m)]["extra_bytes"] / 2**20 if (length, m) in results else float("nan")
                   for m in MODES}
            if (length, "full") not in results:
                print(f"{length:>6} " + " ".join(f"{mib[m]:>15.1f}" for m in MODES), flush=True)
                continue
            held_row = results[(length, "row")]["held_bytes"]
            held_full = results[(length, "full")]["held_bytes"]
            ratio = mib["full"] / max(mib["row"], 1e-9)
            print(f"{length:>6} " + " ".join(f"{mib[m]:>15.1f}" for m in MODES)
                  + f" {ratio:>10.1f} {held_full / max(held_row, 1):>14.0f}", flush=True)
        compared = [length for length in args.lengths if (length, "full") in results and (length, "row") in results]
        if not compared:  # every length past --quadratic-max: the full capture was not run to compare with
            longest = max(args.lengths)
            measured = ", ".join(f"{m} {results[(longest, m)]['extra_bytes'] / 2**20:.0f} MiB" for m in MODES
                                 if (longest, m) in results)
            print(f"at T = {longest}: {measured}; the modes quadratic in T ({', '.join(sorted(QUADRATIC))}) were "
                  f"not run past --quadratic-max {args.quadratic_max}, so there is no full-capture ratio")
            return
        last = max(compared)
        row, full = results[(last, "row")], results[(last, "full")]
        print(f"at T = {last}: full capture adds {full['extra_bytes'] / 2**20:.0f} MiB, row capture "
              f"{row['extra_bytes'] / 2**20:.0f} MiB (ratio {full['extra_bytes'] / max(row['extra_bytes'], 1):.1f}x); "
              f"maps held: {full['held_bytes'] / 2**20:.0f} MiB vs {row['held_bytes'] / 2**20:.3f} MiB "
              f"({full['held_bytes'] / max(row['held_bytes'], 1):.0f}x)")


if __name__ == "__main__":
    main()
