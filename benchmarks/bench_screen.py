"""Benchmark: the per-head causal test with an AtP screen against the same test run on every head.

Reads two finished study folders of the same study, one run with ``metrics.heads_causal.screen`` and
one without (the yardstick), and prints the per-head test's seconds in each (``provenance.json``'s
``step_seconds``; the screened one includes AtP's forward and backward), the rows saved, and how the
screened answers compare with the full ones: of the heads the full run says matter, how many the
screened run finds, how many it cannot decide (screened out on too many examples), and whether it
says "matters" of any head the full run says does not. Then the screen's own record: the audit and
its bound on what was missed.

    python benchmarks/bench_screen.py [--full results/smollm2_edges] [--screened results/smollm2_screen]

Both folders come from ``probe run studies/smollm2_edges.yaml`` and ``probe run studies/smollm2_screen.yaml``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(folder: Path) -> tuple[dict, dict]:
    verdict = json.loads((folder / "verdict.json").read_text())
    provenance = json.loads((folder / "provenance.json").read_text())
    if "heads_causal" not in verdict:
        raise SystemExit(f"{folder}: no per-head causal test in its verdict.json; run a study with "
                         "metrics.heads_causal first")
    return verdict["heads_causal"], provenance


def compare(full: dict, screened: dict) -> dict:
    """Per answer of the full run, what the screened run says of the same heads."""
    answers = {u["unit"]: u["answer"] for u in full["units"]}
    got = {u["unit"]: u["answer"] for u in screened["units"]}
    matters = [u for u, a in answers.items() if a == "matters"]
    return {"full_matters": len(matters),
            "found": sum(got.get(u) == "matters" for u in matters),
            "undecidable": sum(got.get(u) == "undecidable" for u in matters),
            "said_not": sum(got.get(u) == "does not matter" for u in matters),
            "false_matters": sorted(u for u, a in got.items() if a == "matters" and answers.get(u) != "matters"),
            "agree_where_both_decided": _agreement(answers, got)}


def _agreement(answers: dict, got: dict) -> tuple[int, int]:
    both = [u for u in answers if answers[u] != "undecidable" and got.get(u, "undecidable") != "undecidable"]
    return sum(answers[u] == got[u] for u in both), len(both)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", type=Path, default=Path("results/smollm2_edges"))
    parser.add_argument("--screened", type=Path, default=Path("results/smollm2_screen"))
    args = parser.parse_args()
    full, full_prov = _load(args.full)
    screened, screened_prov = _load(args.screened)
    screen = screened.get("screen")
    if not screen:
        raise SystemExit(f"{args.screened}: its per-head test ran without a screen (metrics.heads_causal.screen)")
    seconds = (full_prov["step_seconds"].get("heads_causal", float("nan")),
               screened_prov["step_seconds"].get("heads_causal", float("nan")))
    run = screen["pairs_kept"] + screen["pairs_audited"]
    print(f"per-head causal test: {seconds[0]:.1f} s on every head, {seconds[1]:.1f} s screened "
          f"({seconds[0] / seconds[1]:.1f}x less); (example, head) pairs run exactly {run:,} of "
          f"{run + screen['pairs_screened']:,}")
    c = compare(full, screened)
    agree, both = c["agree_where_both_decided"]
    print(f"heads the full run says matter: {c['full_matters']}; the screened run finds {c['found']}, cannot decide "
          f"{c['undecidable']}, says 'does not matter' of {c['said_not']}")
    print(f"'matters' where the full run says not: {len(c['false_matters'])} {c['false_matters'] or ''}".rstrip())
    print(f"same answer where both decide: {agree} of {both} heads")
    print(f"full run: {full['headline']}")
    print(f"screened: {screen['words']}")


if __name__ == "__main__":
    main()
