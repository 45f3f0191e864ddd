"""GPU check: every tiny test architecture (and the built-ins when their cache is present) on CUDA
against the CPU, within stated tolerances, plus study timings GPU vs CPU. Run by tests/gpu/run.sh.

Tolerances (fp32 on both devices; TF32 is switched off so that CUDA matmuls are true fp32):
capture weights 1e-4 absolute (attention weights are bounded by 1); target values and LOO changes
(logits, log-probs: unbounded) tests/tolerances.py's fp32 rounding of a forward at their scale (the
values', for LOO that of the two values differenced); saliency 1e-3 relative to the largest score; bf16 on CUDA: ranks only (Spearman >= 0.9 of LOO with the fp32 CPU LOO, checked on the
built-ins; on random tiny models bf16 rounding decides the ranks, so it is printed only).
Prints one line per check and exits non-zero when any fails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for tiny_models and tolerances

from tolerances import fp_tol, model_depth  # noqa: E402

TEXTS = ["the movie was good and fun", "bad film , not fun at all , the acting was awful", "i loved it"]
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def compare_model(label: str, path: str, cuda: str, strict_bf16: bool = False) -> None:
    from scipy.stats import spearmanr

    from probe.hooks.capture import capture_attention
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo
    from probe.methods import run_method
    from probe.models.loading import load_model
    from probe.rows.target import build_rows, prepare

    results = {}
    for device in ("cpu", cuda):
        pm = load_model(path, device=device)
        examples = prepare(pm, TEXTS)
        batch = build_rows(pm, [(e.input_ids, e) for e in examples])
        with torch.no_grad(), capture_attention(pm, attention_mask=batch.inputs.get("attention_mask")) as cap:
            pm.model(**batch.inputs)
        maps = cap.maps().weights.cpu()
        values = torch.tensor([e.original_value for e in examples])
        sal = run_method(pm, examples, "saliency").scores
        deletion = loo(Engine(pm), examples, "delete").scores
        results[device] = (maps, values, sal, deletion)
        depth = model_depth(pm)
        del pm
    (m0, v0, s0, l0), (m1, v1, s1, l1) = results["cpu"], results[cuda]
    check(f"{label} capture", torch.allclose(m0, m1, atol=1e-4), f"max |diff| {float((m0 - m1).abs().max()):.2e}")
    tol = fp_tol(float(v0.abs().max()), depth=depth)
    check(f"{label} target", bool(((v0 - v1).abs() <= tol).all()),
          f"max |diff| {float((v0 - v1).abs().max()):.2e} (tolerance {tol:.2e})")
    worst = max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) for a, b in zip(s0, s1))
    check(f"{label} saliency", worst <= 1e-3, f"max relative diff {worst:.2e}")
    worst = max(float((a - b).nan_to_num().abs().max()) for a, b in zip(l0, l1))
    tol = fp_tol(2 * float(v0.abs().max()) + max(float(a.nan_to_num().abs().max()) for a in l0), depth=depth)
    check(f"{label} loo_delete", worst <= tol, f"max |diff| {worst:.2e} (tolerance {tol:.2e})")
    pm = load_model(path, device=cuda, dtype="bf16")
    examples = prepare(pm, TEXTS)
    lb = loo(Engine(pm), examples, "delete").scores
    rhos = []
    for a, b in zip(l0, lb):
        keep = torch.isfinite(a) & torch.isfinite(b)
        if int(keep.sum()) >= 3:
            rhos.append(spearmanr(a[keep].numpy(), b[keep].float().numpy())[0])
    rho = min(rhos) if rhos else float("nan")
    if strict_bf16:
        check(f"{label} bf16 loo ranks", rho >= 0.9 or not rhos, f"min Spearman vs fp32 CPU {rho:.3f}")
    else:  # random tiny models move their output by ~1e-3: bf16 rounding decides their ranks
        print(f"INFO  {label} bf16 loo ranks: min Spearman vs fp32 CPU {rho:.3f} (not checked on a random model)")


def time_study(device: str, n: int) -> float:
    import subprocess
    import tempfile

    out = tempfile.mkdtemp()
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "probe", "run", "studies/quickstart.yaml", "--n", str(n), "--device",
                           device, "--out", f"{out}/r", "--no-progress"], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
        return float("nan")
    return time.perf_counter() - started


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = "cuda:0"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    import tempfile

    from tiny_models import TINY_KINDS, build_tiny

    root = Path(tempfile.mkdtemp())
    for kind in TINY_KINDS:
        compare_model(kind, str(build_tiny(kind, root / kind, seed=0)), cuda)
    cache = Path(os.environ.get("PROBE_CACHE", ""))
    for name in ("minilm-rt", "smollm2-135m"):
        if (cache / name / "config.json").exists():
            compare_model(f"builtin:{name}", str(cache / name), cuda, strict_bf16=True)
        else:
            print(f"SKIP  builtin:{name}: not in PROBE_CACHE={cache} (built-ins are built on the CPU machine)")
    if (cache / "minilm-rt" / "config.json").exists():
        n = int(os.environ.get("PROBE_GPU_STUDY_N", "40"))
        gpu, cpu = time_study("cuda", n), time_study("cpu", n)
        print(f"TIME  quickstart --n {n}: cuda {gpu:.1f} s, cpu {cpu:.1f} s, speed-up {cpu / gpu:.1f}x", flush=True)
    print(f"{len(FAILED)} check(s) failed" + (f": {', '.join(FAILED)}" if FAILED else ""))
    raise SystemExit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
