"""The verdict's false-positive rate over statistics seeds, before and after rule 1 became a
permutation test with family-wise control (issue 40), on finished study folders.

    python benchmarks/calibration_before_after.py results/planted/position-heads results/planted/one-head

For each folder and each seed 0..N-1, both rules are applied to the same stored tables:

- before: rule 1 as it was, a unit tracks when the lower bound of its bootstrap CI (seeded by the
  statistics seed) is above the upper bound of the CI of ONE seeded random ranking of each example's
  scored tokens (redrawn per seed, as the seed redraws it in a study) against the reference;
- after: :func:`probe.study.calibration.calibration` (rule 1: the max-T permutation test).

Rules 2 and 3 are the folder's own in both (the paired test against the best gradient does not
depend on the seed; the sanity checks are those stored in the folder). Prints, per folder, the share
of seeds whose answer is "yes" or "heads only", the share with any unit tracking, and the share with
any unit of the headline family passing rule 1 alone (the statistic's own false positives on a null); with
``--expect UNIT`` the share where exactly that unit tracks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from probe.metrics.agreement import agreement
from probe.metrics.statistics import summarize, summarize_groups
from probe.study.calibration import calibration_summary, folder_calibration, read_folder
from probe.study.summary import GROUP, judge_tables


def _old_rule(folder: Path, seeds) -> pd.DataFrame:
    tables, study, dtype, checks = read_folder(folder)
    judged = judge_tables(tables, study, dtype=dtype, sanity=checks)
    verdict, paired, per_example = judged["verdict"], judged["paired"], judged["agreement"]
    ref, measure, headline = verdict["reference"], verdict["measure"], verdict["headline_family"]
    own = paired[paired.family == headline]
    rows = per_example[(per_example.reference == ref) & (per_example.role == "explainer")]
    units = rows.merge(own[["explainer", "layer", "head"]], on=["explainer", "layer", "head"])
    k = int(measure[3:]) if measure.startswith("top") else None
    scores, tokens = tables["scores"], tables["tokens"]
    refs = scores[scores.method == ref]
    kept = set(per_example[(per_example.reference == ref)].example)
    reference = {e: g.sort_values("position") for e, g in refs.groupby("example") if e in kept}
    scored = {e: g.sort_values("position").scored.to_numpy(bool) for e, g in tokens.groupby("example")}
    out = []
    for seed in seeds:
        summary = summarize_groups(units, GROUP, measure, n_boot=study.statistics.bootstrap, level=study.statistics.level,
                                   seed=seed)
        values = []
        for e, g in reference.items():
            y = g.score.to_numpy(float)
            keep = scored[e] & np.isfinite(y)
            if keep.sum() < 2:
                continue
            rng = np.random.default_rng([seed, int(e)])
            x = rng.permutation(int(keep.sum())).astype(float)
            values.append(agreement(x, y[keep], k=[k] if k else [1])[measure][0])
        random = summarize(np.array(values), n_boot=study.statistics.bootstrap, level=study.statistics.level,
                           seed=seed + 7919)
        s = summary.merge(own[["explainer", "layer", "head", "below_gradient", "reliable"]],
                          on=["explainer", "layer", "head"])
        tracks = (s.ci_low > random["ci_high"]) & ~s.below_gradient.astype(bool) & s.reliable.astype(bool)
        layers, heads = int((tracks & (s["head"] < 0)).sum()), int((tracks & (s["head"] >= 0)).sum())
        names = [f"{r.explainer} L{r.layer}" + (f".H{r.head}" if r.head >= 0 else "") for r in s[tracks].itertuples()]
        out.append({"seed": seed, "answer": "yes" if layers else ("heads only" if heads else "no"),
                    "layer_units": layers, "heads": heads, "tracking": "; ".join(names),
                    "above_chance": int((s.ci_low > random["ci_high"]).sum())})
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--expect", action="append", default=[], help="FOLDER_NAME=UNIT, e.g. one-head='attention "
                                                                      "L5.H7'")
    args = parser.parse_args()
    expected = dict(e.split("=", 1) for e in args.expect)
    for folder in args.folders:
        want = [expected[folder.name]] if folder.name in expected else []
        started = time.perf_counter()
        before = calibration_summary(_old_rule(folder, range(args.seeds)), want)
        after = calibration_summary(folder_calibration(folder, seeds=range(args.seeds)), want)
        print(f"{folder.name}: {args.seeds} seeds ({time.perf_counter() - started:.0f} s)")
        for name, s in (("before (one random ranking)", before), ("after (max-T permutation test)", after)):
            line = (f"  {name:32s} yes or heads only {100 * s['positive']:5.1f}%   any unit tracking "
                    f"{100 * s['any_tracking']:5.1f}%   any unit passing rule 1 {100 * s['rule1_any']:5.1f}%")
            if want:
                line += f"   exactly {want[0]} {100 * s['exactly_expected']:5.1f}%"
            print(line)


if __name__ == "__main__":
    main()
