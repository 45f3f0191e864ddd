"""Benchmark: `probe plan`'s predictions against the runs they predict, on shipped studies.

For each study (cut to ``--n`` examples) it runs ``probe plan STUDY --json`` and then ``probe run``
on the same examples in a fresh folder, each its own process, one after the other, and prints per
study the predicted and measured seconds (the model's load, the steps, the checks after them) and
peak memory, with their ratios, then per step the predicted and measured rows and seconds. The
measured peak is the run's own (``provenance.json``'s ``peak_memory_bytes``: on a CPU the process's
peak resident set, on CUDA the peak allocation), the predicted one the plan's (the loaded model,
measured the same way, plus the largest step's activations scaled from the calibration batch).

The bars (issue 64): time within 30%, memory within 20%. Nothing is asserted: the machine's load
shows in the figures, and the script prints it beside them.

    python benchmarks/bench_plan.py [--threads 1] [--studies quickstart:8 context_mixing:8 smollm2_sentiment:4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("quickstart:8", "context_mixing:8", "smollm2_sentiment:4")


def _probe(args: list[str], threads: int) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "probe", *args, "--threads", str(threads)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"probe {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started, done.stdout + done.stderr


def measure(study: str, n: int, threads: int, folder: Path) -> dict:
    """The plan and the run of ``studies/STUDY.yaml`` cut to ``n`` examples."""
    plan_file = folder / f"{study}.plan.json"
    plan_wall, _ = _probe(["plan", f"studies/{study}.yaml", "--n", str(n), "--json", str(plan_file)], threads)
    out = folder / study
    run_wall, text = _probe(["run", f"studies/{study}.yaml", "--n", str(n), "--out", str(out), "--no-progress"],
                            threads)
    report = re.search(r"written in ([0-9.]+) s", text)
    return {"plan": json.loads(plan_file.read_text()), "plan_wall": plan_wall, "run_wall": run_wall,
            "provenance": json.loads((out / "provenance.json").read_text()),
            "report_seconds": float(report.group(1)) if report else 0.0}


def _ratio(predicted: float, measured: float) -> str:
    return f"{predicted / measured:.2f}" if measured > 0 else "-"


def show(name: str, n: int, m: dict) -> None:
    plan, prov = m["plan"], m["provenance"]
    measured_phases = dict(prov.get("phase_seconds", {}))
    if "sanity checks" in measured_phases:  # the randomisation and completeness checks run inside its seconds
        measured_phases.pop("randomisation check", None)
        measured_phases.pop("completeness check", None)
    phases = sum(measured_phases.values()) + m["report_seconds"]
    measured = prov["model_load_seconds"] + prov["wall_seconds"] + phases
    steps_predicted = sum(s["seconds"] for s in plan["steps"])
    print(f"\n{name} (--n {n}): plan {m['plan_wall']:.1f} s (calibration {plan['calibration_seconds']:.1f} s), "
          f"run process {m['run_wall']:.1f} s")
    print(f"  seconds   predicted {plan['seconds']:8.1f}  measured {measured:8.1f}  "
          f"ratio {_ratio(plan['seconds'], measured)}   "
          f"(steps {steps_predicted:.1f} against {prov['wall_seconds']:.1f}, "
          f"ratio {_ratio(steps_predicted, prov['wall_seconds'])})")
    peak = prov.get("peak_memory_bytes", -1)
    print(f"  peak MiB  predicted {plan['peak_bytes'] / 2**20:8.0f}  measured {peak / 2**20:8.0f}  "
          f"ratio {_ratio(plan['peak_bytes'], peak)}")
    rows = prov.get("step_rows", {})
    print(f"  {'step':28s} {'rows predicted':>16s} {'rows measured':>16s} {'s predicted':>11s} {'s measured':>10s}")
    for step in plan["steps"]:
        got = rows.get(step["step"], {})
        print(f"  {step['step']:28s} {step['forwards']:>8,}+{step['backwards']:<7,} "
              f"{got.get('forwards', 0):>8,}+{got.get('backwards', 0):<7,} {step['seconds']:11.2f} "
              f"{prov['step_seconds'].get(step['step'], 0.0):10.2f}")
    for phase, seconds in plan["phases"].items():
        print(f"  {phase:28s} {'':16s} {'':16s} {seconds:11.2f}")
    print(f"  measured after the steps: {prov.get('phase_seconds', {})}, report {m['report_seconds']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--studies", nargs="+", default=list(DEFAULT), help="STUDY:N (a file of studies/, N examples)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.studies:
            name, _, n = item.partition(":")
            show(name, int(n or 8), measure(name, int(n or 8), args.threads, Path(tmp)))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
