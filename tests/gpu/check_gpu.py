"""The GPU check (issue 47): probe on CUDA against probe on the CPU, section by section, with stated
tolerances; the quickstart's time on the GPU against the CPU; peak GPU memory at long inputs. Run by
tests/gpu/run.sh on a lent GPU machine, in one call of under 8 minutes.

Sections (each prints PASS/FAIL/INFO/SKIP lines; a section that raises is one FAIL naming the error):
  tiny      every tiny test architecture (BERT, GPT-2, Llama with grouped-query heads, BART, T5, Mamba):
            capture, target, saliency, leave-one-out by deletion, fp32 CUDA against fp32 CPU; the same
            model under sdpa on CUDA (probe recomputes the weights from q/k) against the CPU's eager maps;
            bf16 leave-one-out ranks (printed only: on random tiny models bf16 rounding decides ranks)
  implicit  the implicit matrices of Mamba, LFM2 (short convolutions) and Gated DeltaNet (Qwen3-Next)
            on CUDA against the CPU, and the implicit oracle (the matrices rebuild each mixer's output) on CUDA
  generate  per-generated-token explanations (generate=3: the truncated backward through a cached prefix)
            of a GPT-2 and a Llama: the same greedy output, and every method's rows within tolerance
  contrast  a continuation against a foil (GPT-2, T5): the contrastive target's scores within tolerance
  device_map  device_map="auto" (accelerate's placement) against the plain CUDA load
  builtin   builtin:minilm-rt as in tiny, bf16 and fp16 leave-one-out ranks checked (Spearman >= 0.9)
  memory    peak GPU memory of capture and saliency at long inputs (minilm-rt at 512 tokens, a tiny
            Llama at 2,048 and 8,192 tokens)
  flash     flash_attention_2 where the flash_attn package is installed (else SKIP, saying so)
  time      the quickstart study (--n N) on cuda and on cpu, whole process

Tolerances: fp32 on both devices with TF32 off (CUDA matmuls are true fp32). Attention weights 1e-4
absolute (they are bounded by 1); targets and leave-one-out changes tests/tolerances.py's fp32
rounding at their scale; gradient rows 1e-3 relative to the row's largest score; sdpa bf16 maps 2e-2
absolute. Everything measured is also written to $PROBE_GPU_OUT/gpu_check.json when that is set.

A dry run on a machine without CUDA: PROBE_GPU_CHECK_DEVICE=cpu (the "GPU" side then runs on the CPU too).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tests/ for tiny_models and tolerances
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))  # the architecture sweep's tiny configs

from tolerances import fp_tol, model_depth  # noqa: E402

TEXTS = ["the movie was good and fun", "bad film , not fun at all , the acting was awful", "i loved it"]
PROMPTS = ["the movie was good and", "bad film , not"]
FAILED: list[str] = []
FIGURES: dict[str, object] = {}
STARTED = time.perf_counter()
DEVICE = os.environ.get("PROBE_GPU_CHECK_DEVICE", "cuda:0")
ON_CUDA = DEVICE.startswith("cuda")


def check(name: str, ok: bool, detail: str, **figures) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    FIGURES[name] = {"ok": bool(ok), "detail": detail, **figures}
    if not ok:
        FAILED.append(name)


def info(name: str, detail: str, **figures) -> None:
    print(f"INFO  {name}: {detail}", flush=True)
    FIGURES[name] = {"detail": detail, **figures}


@contextlib.contextmanager
def section(name: str):
    began = time.perf_counter()
    print(f"== {name} (at {began - STARTED:.0f} s)", flush=True)
    try:
        yield
    except Exception as exc:  # one section's failure must not hide the others' results
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        check(f"{name} section", False, f"{type(exc).__name__}: {first}")
        traceback.print_exc(limit=4)
    print(f"   {name}: {time.perf_counter() - began:.1f} s", flush=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |a| (NaN where both are NaN counts as equal)."""
    a, b = a.float().cpu(), b.float().cpu()
    both_nan = torch.isnan(a) & torch.isnan(b)
    gap = (a - b).abs().masked_fill(both_nan, 0.0)
    if bool(torch.isnan(gap).any()):
        return float("inf")
    return float(gap.max() / a.nan_to_num().abs().max().clamp(min=1e-12)) if a.numel() else 0.0


def absolute(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    gap = (a - b).abs().masked_fill(torch.isnan(a) & torch.isnan(b), 0.0)
    return float(gap.max()) if gap.numel() else 0.0


def spearman_min(ref: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    from scipy.stats import spearmanr

    rhos = []
    for a, b in zip(ref, other):
        keep = torch.isfinite(a) & torch.isfinite(b.float())
        if int(keep.sum()) >= 3:
            rhos.append(float(spearmanr(a[keep].numpy(), b[keep].float().numpy())[0]))
    return min(rhos) if rhos else float("nan")


# ------------------------------------------------------------------------------------------ pieces


def run_core(pm, texts=TEXTS):
    """Capture maps (every stack, CPU fp32), target values, saliency and deletion LOO rows of ``pm``."""
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo
    from probe.methods import run_method
    from probe.models.checks import capture_all
    from probe.rows.forward import build_rows
    from probe.rows.prepare import prepare

    examples = prepare(pm, texts)
    batch = build_rows(pm, [(e.input_ids, e) for e in examples])
    _, maps, _ = capture_all(pm, dict(batch.inputs))
    maps = on_cpu(maps)
    values = torch.tensor([e.original_value for e in examples])
    saliency = run_method(pm, examples, "saliency").scores
    deletion = loo(Engine(pm), examples, "delete").scores
    return maps, values, saliency, deletion


def on_cpu(maps: dict) -> dict:
    """{stack: fp32 CPU tensor} of capture_all's maps (AttentionMaps per stack, or a tensor / a list of them)."""
    from probe.models.checks import layer_weights

    return {stack: [w.float().cpu() for w in layer_weights(value)] for stack, value in maps.items()}


def map_gap(m0: dict, m1: dict) -> float:
    worst = 0.0
    for stack in m0:
        a, b = m0[stack], m1[stack]
        worst = max([worst] + [absolute(x, y) for x, y in zip(a, b)])
    return worst


def compare_core(label: str, cpu, gpu, depth: int) -> None:
    (m0, v0, s0, l0), (m1, v1, s1, l1) = cpu, gpu
    gap = map_gap(m0, m1)
    check(f"{label} capture", gap <= 1e-4, f"max |diff| {gap:.2e} (tolerance 1e-4)", max_abs=gap)
    tol = fp_tol(float(v0.abs().max()), depth=depth)
    gap = float((v0 - v1).abs().max())
    check(f"{label} target", gap <= tol, f"max |diff| {gap:.2e} (tolerance {tol:.2e})", max_abs=gap, tol=tol)
    worst = max(relative(a, b) for a, b in zip(s0, s1))
    check(f"{label} saliency", worst <= 1e-3, f"max relative diff {worst:.2e} (tolerance 1e-3)", max_rel=worst)
    worst = max(absolute(a, b) for a, b in zip(l0, l1))
    tol = fp_tol(2 * float(v0.abs().max()) + max(float(a.nan_to_num().abs().max()) for a in l0), depth=depth)
    check(f"{label} loo_delete", worst <= tol, f"max |diff| {worst:.2e} (tolerance {tol:.2e})", max_abs=worst, tol=tol)


def low_precision_ranks(label: str, path: str, l0: list[torch.Tensor], strict: bool, dtypes=("bf16",)) -> None:
    from probe.intervene.engine import Engine
    from probe.intervene.tokens import loo
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare

    for dtype in dtypes:
        pm = load_model(path, device=DEVICE, dtype=dtype, allow_random_weights=True)
        rho = spearman_min(l0, loo(Engine(pm), prepare(pm, TEXTS), "delete").scores)
        if strict:
            check(f"{label} {dtype} loo ranks", rho >= 0.9, f"min Spearman vs fp32 CPU {rho:.3f} (>= 0.9)", rho=rho)
        else:
            info(f"{label} {dtype} loo ranks", f"min Spearman vs fp32 CPU {rho:.3f} (not checked on a random model)",
                 rho=rho)
        del pm


def sdpa_against_eager(label: str, path: str, eager_maps: dict, dtype: str = "fp32") -> None:
    """The model loaded with sdpa on the GPU: probe recomputes the weights from q/k; they must equal the
    CPU's eager maps, and capturing must leave the sdpa model's logits as they are."""
    from probe.models.checks import capture_all
    from probe.models.loading import load_model
    from probe.rows.forward import build_rows
    from probe.rows.prepare import prepare

    pm = load_model(path, device=DEVICE, dtype=dtype, attn_implementation="sdpa", allow_random_weights=True)
    if pm.model.config._attn_implementation != "sdpa":
        info(f"{label} sdpa {dtype}", f"the model loaded as {pm.model.config._attn_implementation!r}, not sdpa")
        return
    examples = prepare(pm, TEXTS)
    inputs = dict(build_rows(pm, [(e.input_ids, e) for e in examples]).inputs)
    with torch.no_grad():
        plain = pm.model(**inputs).logits.float()
    logits, maps, _ = capture_all(pm, inputs)
    maps = on_cpu(maps)
    if dtype == "fp32":
        gap = map_gap(eager_maps, maps)
        check(f"{label} sdpa fp32 capture vs eager cpu", gap <= 1e-4, f"max |diff| {gap:.2e} (tolerance 1e-4)",
              max_abs=gap)
    else:  # against the eager model in the same dtype on the same device: the first layers share their input
        # exactly; deeper layers differ by the kernels' own low-precision rounding carried up the stack
        eager = load_model(path, device=DEVICE, dtype=dtype, attn_implementation="eager", allow_random_weights=True)
        _, reference, _ = capture_all(eager, inputs)
        reference = on_cpu(reference)
        first = max(absolute(reference[stack][0], maps[stack][0]) for stack in maps)
        check(f"{label} sdpa {dtype} capture vs eager {dtype}, first layer", first <= 1e-2,
              f"max |diff| {first:.2e} (tolerance 1e-2)", max_abs=first)
        gap = map_gap(reference, maps)
        info(f"{label} sdpa {dtype} capture vs eager {dtype}, every layer", f"max |diff| {gap:.2e}", max_abs=gap)
    moved = float((logits.float() - plain.float()).abs().max())
    check(f"{label} sdpa {dtype} capture leaves the output", moved == 0.0, f"max |logit change| {moved:.2e}",
          max_abs=moved)


# ---------------------------------------------------------------------------------------- sections


def tiny_section(root: Path) -> None:
    from probe.models.loading import load_model

    from tiny_models import TINY_KINDS, build_tiny

    for kind in (*TINY_KINDS, "mamba"):
        path = str(build_tiny(kind, root / kind, seed=0))
        results = {}
        for device in ("cpu", DEVICE):
            pm = load_model(path, device=device, attn_implementation="eager", allow_random_weights=True)
            results[device] = run_core(pm)
            depth = model_depth(pm)
            del pm
        compare_core(kind, results["cpu"], results[DEVICE], depth)
        if kind != "mamba":
            sdpa_against_eager(kind, path, results["cpu"][0])
        low_precision_ranks(kind, path, results["cpu"][3], strict=False)


def implicit_section() -> None:
    import copy

    import bench_architectures as sweep

    from probe.models.checks import capture_all, implicit_oracle

    tok = sweep.tokenizer()
    for model_type in ("mamba", "lfm2", "qwen3_next"):
        model = sweep.build(model_type, "causal_lm", "eager")
        inputs = dict(tok(TEXTS, return_tensors="pt", padding=True))
        inputs.pop("token_type_ids", None)
        maps = {}
        for device in ("cpu", DEVICE):
            pm = sweep.wrap(copy.deepcopy(model).to(device), tok, "causal_lm")
            on = {k: v.to(device) for k, v in inputs.items()}
            _, captured, _ = capture_all(pm, on)
            maps[device] = on_cpu(captured)
            if device != "cpu":
                result = implicit_oracle(pm, on, sweep.READ_TOL)
                check(f"{model_type} implicit oracle on {DEVICE}", result is not None and result.passed,
                      "no implicit layer found" if result is None else result.detail or "matrices rebuild the mixers")
        gap = map_gap(maps["cpu"], maps[DEVICE])
        check(f"{model_type} implicit matrices", gap <= 1e-4, f"max |diff| vs cpu {gap:.2e} (tolerance 1e-4)",
              max_abs=gap)


def explained(pm, methods, **kwargs):
    import probe

    ex = probe.explain(pm, PROMPTS if "generate" in kwargs else TEXTS[:2], methods, **kwargs)
    return ex, {m: list(ex.scores[m].scores) for m in methods}


def compare_explanations(label: str, cpu, gpu, methods) -> None:
    (e0, r0), (e1, r1) = cpu, gpu
    same = [(e.input_ids, e.target_ids) for e in e0.examples] == [(e.input_ids, e.target_ids) for e in e1.examples]
    check(f"{label} same rows", same, f"{len(e0.examples)} explained outputs on the CPU, {len(e1.examples)} on the GPU")
    if not same:
        return
    for m in methods:
        if m.startswith("attention"):
            gap = max(absolute(a, b) for a, b in zip(r0[m], r1[m]))
            check(f"{label} {m}", gap <= 1e-4, f"max |diff| {gap:.2e} (tolerance 1e-4)", max_abs=gap)
        else:
            gap = max(relative(a, b) for a, b in zip(r0[m], r1[m]))
            check(f"{label} {m}", gap <= 1e-3, f"max relative diff {gap:.2e} (tolerance 1e-3)", max_rel=gap)


def methods_section(root: Path, cache: Path) -> None:
    """Every method that applies, and the ones run only by name, on CUDA against the CPU."""
    from probe.methods import applicable_methods, run_method
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare

    from tiny_models import build_tiny

    models = [("gpt2", str(build_tiny("gpt2", root / "gpt2", seed=0))),
              ("t5", str(build_tiny("t5", root / "t5", seed=0)))]
    if (cache / "minilm-rt" / "config.json").exists():
        models.insert(0, ("builtin:minilm-rt", "builtin:minilm-rt"))
    for label, path in models:
        runs = {}
        for device in ("cpu", DEVICE):
            pm = load_model(path, device=device, allow_random_weights=True)
            examples = prepare(pm, TEXTS[:2])
            chosen, skipped = applicable_methods(pm, examples)
            chosen += [m for m in ("attention_nosink", "shapley", "knockout") if m in skipped]
            runs[device] = {}
            for method in chosen:
                try:
                    params = {"mode": "pad"} if method == "shapley" and label == "gpt2" else None  # no special token
                    runs[device][method] = run_method(pm, examples, method, params=params).scores
                except Exception as exc:
                    runs[device][method] = exc
                    if device != "cpu":
                        traceback.print_exc(limit=-6)
        for method, ref in runs["cpu"].items():
            got = runs[DEVICE].get(method)
            if isinstance(ref, Exception) or isinstance(got, Exception):
                bad = got if isinstance(got, Exception) else ref
                check(f"{label} {method}", False, f"{type(bad).__name__}: {str(bad).splitlines()[0][:200]}")
                continue
            gap = max(relative(a, b) for a, b in zip(ref, got))
            check(f"{label} {method}", gap <= 1e-3, f"max relative diff {gap:.2e} (tolerance 1e-3)", max_rel=gap)


def generate_section(root: Path) -> None:
    from probe.models.loading import load_model

    from tiny_models import build_tiny

    methods = ["attention_mean", "saliency", "integrated_gradients", "loo_delete"]
    for kind in ("gpt2", "llama_gqa"):
        path = str(build_tiny(kind, root / kind, seed=0))
        runs = [explained(load_model(path, device=d, allow_random_weights=True), methods, generate=3,
                          params={"integrated_gradients": {"steps": 16}}) for d in ("cpu", DEVICE)]
        compare_explanations(f"{kind} generate=3", runs[0], runs[1], methods)


def contrast_section(root: Path) -> None:
    from probe.models.loading import load_model

    from tiny_models import build_tiny

    methods = ["saliency", "input_x_gradient", "loo_delete"]
    for kind in ("gpt2", "t5"):
        path = str(build_tiny(kind, root / kind, seed=0))
        runs = [explained(load_model(path, device=d, allow_random_weights=True), methods, continuation="the movie",
                          contrast="a film") for d in ("cpu", DEVICE)]
        compare_explanations(f"{kind} contrast", runs[0], runs[1], methods)


def device_map_section(root: Path) -> None:
    from probe.models.loading import load_model

    from tiny_models import build_tiny

    path = str(build_tiny("llama_gqa", root / "llama_gqa", seed=0))
    plain = run_core(load_model(path, device=DEVICE, allow_random_weights=True))
    pm = load_model(path, device_map="auto", allow_random_weights=True)
    placed = sorted({str(p.device) for p in pm.model.parameters()})
    mapped = run_core(pm)
    info("device_map auto placement", f"parameters on {', '.join(placed)}")
    compare_core("llama_gqa device_map=auto vs cuda", plain, mapped, model_depth(pm))


def builtin_section(cache: Path) -> None:
    from probe.models.loading import load_model

    if not (cache / "minilm-rt" / "config.json").exists():
        print(f"SKIP  builtin:minilm-rt: not in PROBE_CACHE={cache}", flush=True)
        return
    results = {}
    for device in ("cpu", DEVICE):
        pm = load_model("builtin:minilm-rt", device=device, attn_implementation="eager")
        results[device] = run_core(pm)
        depth = model_depth(pm)
    compare_core("builtin:minilm-rt", results["cpu"], results[DEVICE], depth)
    sdpa_against_eager("builtin:minilm-rt", "builtin:minilm-rt", results["cpu"][0])
    sdpa_against_eager("builtin:minilm-rt", "builtin:minilm-rt", results["cpu"][0], dtype="bf16")
    low_precision_ranks("builtin:minilm-rt", "builtin:minilm-rt", results["cpu"][3], strict=True,
                        dtypes=("bf16", "fp16") if ON_CUDA else ("bf16",))


def shapley_section(cache: Path) -> None:
    """Issue 42's speed bar: probe's sampled Shapley values against captum's ShapleyValueSampling on the
    same model, texts and number of permutations, both on the device (benchmarks/bench_shapley.py's
    captum side): probe at least 5x faster than captum's default of one coalition per forward."""
    from bench_shapley import captum_sampling, load_texts

    from probe.intervene.engine import Engine
    from probe.intervene.shapley import shapley
    from probe.models.loading import load_model
    from probe.rows.prepare import prepare

    if not (cache / "minilm-rt" / "config.json").exists():
        print(f"SKIP  shapley: builtin:minilm-rt not in PROBE_CACHE={cache}", flush=True)
        return
    pm = load_model("builtin:minilm-rt", device=DEVICE)
    examples = prepare(pm, load_texts(4 if ON_CUDA else 2))
    mask, permutations = pm.tokenizer.mask_token_id, 50 if ON_CUDA else 6  # a dry run checks the code path
    shapley(Engine(pm), examples[:1], "mask", exact_max=0, permutations=2, seed=0)  # warm the kernels
    ours_s, _ = peak(lambda: shapley(Engine(pm), examples, "mask", exact_max=0, permutations=permutations, seed=0))
    theirs = {per_eval: peak(lambda per_eval=per_eval: captum_sampling(pm, examples, mask, permutations, per_eval,
                                                                       seed=0))[0] for per_eval in (1, 64)}
    figures = {"probe_seconds": ours_s, "captum_seconds": theirs, "permutations": permutations,
               "examples": len(examples)}
    judge = check if ON_CUDA else (lambda name, ok, detail, **f: info(name, detail, **f))  # a dry run: no bar
    judge("shapley speed", theirs[1] / ours_s >= 5,
          f"{len(examples)} sentences x {permutations} permutations: probe {ours_s:.2f} s, captum "
          f"{theirs[1]:.2f} s at one coalition per forward ({theirs[1] / ours_s:.1f}x), {theirs[64]:.2f} s at 64 "
          f"({theirs[64] / ours_s:.1f}x); the bar is 5x against captum's default", **figures)


def peak(fn) -> tuple[float, float]:
    """(seconds, peak GPU memory in GiB above what was allocated before) of fn()."""
    if not ON_CUDA:  # a dry run: the code path, no memory figure
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began, float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began, (torch.cuda.max_memory_allocated() - base) / 2**30


def memory_section(cache: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import probe
    from probe.models.checks import capture_all
    from probe.models.loading import load_model

    if (cache / "minilm-rt" / "config.json").exists():
        pm = load_model("builtin:minilm-rt", device=DEVICE)
        long = " ".join(["the acting was good but the plot was thin and slow"] * 45)
        for method in ("attention", "saliency", "integrated_gradients", "loo_delete"):
            seconds, gib = peak(lambda m=method: probe.explain(pm, [long] * 8, [m]))
            info(f"memory minilm-rt 8 x 512 tokens {method}", f"{seconds:.2f} s, peak {gib:.2f} GiB", seconds=seconds,
                 peak_gib=gib)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(DEVICE)
    wrapped = probe.wrap(model, _long_tokenizer(), task="causal_lm")
    for length in ((2048, 8192) if ON_CUDA else (256, 512)):
        ids = torch.randint(4, 128, (1, length), device=DEVICE)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        seconds, gib = peak(lambda inputs=inputs: capture_all(wrapped, inputs))
        maps_gib = 4 * 8 * length * length * 4 / 2**30  # layers x heads x L x L fp32
        info(f"memory llama 4x8 heads {length} tokens capture", f"{seconds:.2f} s, peak {gib:.2f} GiB (the maps "
             f"themselves: {maps_gib:.2f} GiB)", seconds=seconds, peak_gib=gib, maps_gib=maps_gib)


def _long_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, **{f"w{i}": i for i in range(4, 128)}}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=8192, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def flash_section(cache: Path) -> None:
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        print("SKIP  flash_attention_2: the flash_attn package is not installed on this machine (no wheel can be "
              "carried under the device's 64 MiB limit); sdpa's fused kernels are checked above", flush=True)
        FIGURES["flash_attention_2"] = {"skipped": "flash_attn not installed"}
        return
    from tiny_models import build_tiny

    path = str(build_tiny("llama_gqa", Path(tempfile.mkdtemp()) / "llama_gqa", seed=0))
    from probe.models.loading import load_model

    eager = run_core(load_model(path, device="cpu", attn_implementation="eager", allow_random_weights=True))
    sdpa_against_eager("llama_gqa flash", path, eager[0], dtype="bf16")


def time_section() -> None:
    """The quickstart study, whole process, on the GPU and then on the CPU, within what is left of the
    check's deadline ($PROBE_GPU_DEADLINE seconds from the start, default 290): a run cut off says so."""
    n = int(os.environ.get("PROBE_GPU_STUDY_N", "40"))
    deadline = STARTED + float(os.environ.get("PROBE_GPU_DEADLINE", "290"))
    times = {}
    devices = [DEVICE if d == "cuda" else d for d in os.environ.get("PROBE_GPU_TIME_DEVICES", "cuda,cpu").split(",")]
    for device in (devices if ON_CUDA else ("cpu",)):
        out = tempfile.mkdtemp()
        left = deadline - time.perf_counter() - 5
        if left < 20:
            info(f"quickstart --n {n} on {device}", "not run: the check's deadline is near")
            break
        began = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "probe", "run", "studies/quickstart.yaml", "--n", str(n),
                                   "--device", device.split(":")[0], "--out", f"{out}/r", "--no-progress"],
                                  capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            info(f"quickstart --n {n} on {device}", f"cut off after {left:.0f} s (the check's deadline)",
                 seconds_at_least=left)
            times[device] = float("inf")
            break
        times[device] = time.perf_counter() - began
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["?"]
            print("\n".join(lines[-30:]), flush=True)
            check(f"quickstart on {device}", False, lines[-1])
            return
        verdict = json.loads(Path(f"{out}/r/verdict.json").read_text())
        answer = verdict.get("answer")
        info(f"quickstart --n {n} on {device}", f"{times[device]:.1f} s whole process, answer {answer!r}",
             seconds=times[device], answer=answer)
    if ON_CUDA and set(times) == {DEVICE, "cpu"}:
        info(f"quickstart --n {n} speed-up", f"cpu {times['cpu']:.1f} s / cuda {times[DEVICE]:.1f} s = "
             f"{times['cpu'] / times[DEVICE]:.1f}x", ratio=times["cpu"] / times[DEVICE])


def main() -> None:
    if ON_CUDA and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU (PROBE_GPU_CHECK_DEVICE=cpu for a dry run)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import transformers

    name = torch.cuda.get_device_name(0) if ON_CUDA else "cpu (dry run)"
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": name, "cpu_threads": torch.get_num_threads()}
    print(" ".join(f"{k} {v}," for k, v in env.items()), flush=True)
    FIGURES["environment"] = env
    root = Path(tempfile.mkdtemp())
    cache = Path(os.environ.get("PROBE_CACHE", ""))
    only = set(filter(None, os.environ.get("PROBE_GPU_SECTIONS", "").split(",")))
    sections = [("tiny", lambda: tiny_section(root)), ("implicit", implicit_section),
                ("methods", lambda: methods_section(root, cache)),
                ("generate", lambda: generate_section(root)), ("contrast", lambda: contrast_section(root)),
                ("device_map", lambda: device_map_section(root)), ("builtin", lambda: builtin_section(cache)),
                ("memory", lambda: memory_section(cache)), ("flash", lambda: flash_section(cache)),
                ("shapley", lambda: shapley_section(cache)), ("time", time_section)]
    for label, run in sections:
        if only and label not in only:
            continue
        with section(label):
            run()
    FIGURES["failed"] = list(FAILED)
    FIGURES["seconds"] = time.perf_counter() - STARTED
    out = os.environ.get("PROBE_GPU_OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(FIGURES, indent=1, default=str) + "\n")
    print(f"{len(FAILED)} check(s) failed" + (f": {', '.join(FAILED)}" if FAILED else "") +
          f" ({time.perf_counter() - STARTED:.0f} s)")
    raise SystemExit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
