"""Capture overhead and memory on builtin:minilm-rt.

Prints (1) wall time of forward passes over held-out sentences with and without capture (the
[CLS] row, and every row), and (2) peak memory of row-only versus full capture at T = 512, each
mode measured in its own process (peak resident set size minus the same process's peak for the
forward pass alone), beside the bytes the capture holds.

    python benchmarks/bench_capture.py [--n 100] [--batch 32] [--length 512] [--memory-batch 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _timing(n: int, batch_size: int, repeats: int) -> dict:
    import torch

    from probe.data import load_dataset
    from probe.hooks.capture import capture_attention
    from probe.models.loading import load_model

    started = time.perf_counter()
    pm = load_model("builtin:minilm-rt")
    load_seconds = time.perf_counter() - started
    texts = [e.text for e in load_dataset("builtin:rotten_tomatoes", split="test", n=n, seed=0)]
    batches = [pm.encode(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]

    def run(mode):
        with torch.no_grad():
            for batch in batches:
                if mode == "none":
                    pm.model(**batch)
                else:
                    queries = "first" if mode == "row" else None
                    with capture_attention(pm, queries=queries, attention_mask=batch["attention_mask"]) as cap:
                        pm.model(**batch)
                    cap.maps()

    run("none")  # warm-up
    best = {}
    for mode in ("none", "row", "full"):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run(mode)
            times.append(time.perf_counter() - t)
        best[mode] = min(times)
    return {"load_seconds": load_seconds, "n": n, "batch": batch_size, **{f"{k}_seconds": v for k, v in best.items()}}


def _memory_child(mode: str, length: int, batch_size: int) -> None:
    import torch

    from probe.hooks.capture import capture_attention
    from probe.models.loading import load_model

    pm = load_model("builtin:minilm-rt")
    ids = torch.randint(1000, 20000, (batch_size, length))
    ids[:, 0] = pm.tokenizer.cls_token_id
    ids[:, -1] = pm.tokenizer.sep_token_id
    mask = torch.ones_like(ids)
    held = 0
    with torch.no_grad():
        if mode == "none":
            pm.model(input_ids=ids, attention_mask=mask)
        else:
            with capture_attention(pm, queries="first" if mode == "row" else None, attention_mask=mask) as cap:
                pm.model(input_ids=ids, attention_mask=mask)
            held = cap.maps().weights.nbytes
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "peak_mib": peak_kib / 1024, "held_mib": held / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--memory-batch", type=int, default=8)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _memory_child(args.child, args.length, args.memory_batch)
        return

    timing = _timing(args.n, args.batch, args.repeats)
    print(f"builtin:minilm-rt loaded in {timing['load_seconds']:.2f} s")
    print(f"forward over {timing['n']} held-out sentences, batch {timing['batch']} (best of {args.repeats}):")
    base = timing["none_seconds"]
    for mode, label in (("none", "no capture"), ("row", "capture [CLS] row"), ("full", "capture all rows")):
        seconds = timing[f"{mode}_seconds"]
        print(f"  {label:<18} {seconds:7.3f} s   x{seconds / base:.2f} of no capture")

    results = {}
    for mode in ("none", "row", "full"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--length", str(args.length),
                              "--memory-batch", str(args.memory_batch)], capture_output=True, text=True, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak memory at T = {args.length}, batch {args.memory_batch} (own process each):")
    for mode in ("none", "row", "full"):
        r = results[mode]
        extra = r["peak_mib"] - results["none"]["peak_mib"]
        print(f"  {mode:<5} peak {r['peak_mib']:8.1f} MiB   over forward alone {extra:+8.1f} MiB   capture holds "
              f"{r['held_mib']:8.2f} MiB")
    row_extra = max(results["row"]["peak_mib"] - results["none"]["peak_mib"], 0.0)
    full_extra = results["full"]["peak_mib"] - results["none"]["peak_mib"]
    print(f"  held bytes full/row: x{results['full']['held_mib'] / max(results['row']['held_mib'], 1e-9):.0f}; "
          f"extra peak full {full_extra:.1f} MiB vs row {row_extra:.1f} MiB")


if __name__ == "__main__":
    main()
