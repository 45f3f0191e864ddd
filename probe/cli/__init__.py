"""The ``probe`` command line. Imports of torch and transformers happen inside commands, so
``probe --help`` stays fast.

Size: one function per command with its options, which typer reads from the signature (and the docs'
CLI page from typer); the work of each command lives elsewhere, and what is left is the options' text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from typing import TYPE_CHECKING

import typer

from probe import registry
from probe.cli import terminal
from probe.cli.options import (
    MODEL_OPTIONS,
    TARGET_OPTIONS,
    ModelArg,
    ModelOptions,
    quiet_libraries,
    target_options,
    with_options,
)
from probe.cli.terminal import plain as _plain
from probe.errors import InputError
from probe.names import printable

if TYPE_CHECKING:
    from click.exceptions import ClickException
    from typer._click.exceptions import ClickException as TyperClickException

    from probe.models.core import AttentionContract, ProbeModel
    from probe.rows.target import TargetSpec

#: ``--steps``' default: integrated gradients' registered default
IG_STEPS = registry.method("integrated_gradients").defaults().steps

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Audit whether a transformer's attention weights explain its predictions.")

#: a command that loads a model takes the model options, handed to it as one ``options: ModelOptions``
model_options = with_options("options", MODEL_OPTIONS, ModelOptions)


def _say(text, *, err: bool = False) -> None:
    """Print one line of text that may hold user-derived parts (paths, names, tokens, claims): every
    control character shows as an escape (:func:`probe.names.printable`); ``err``: on standard error."""
    print(printable(text), file=sys.stderr if err else sys.stdout)


def _log(text) -> None:
    """A run's progress line, on standard error (see :func:`_say`)."""
    _say(text, err=True)


def _warn_one_line(message, category, filename, lineno, file=None, line=None):
    _say(f"warning: {message}", err=True)


def _random_weights_text(contract) -> str:
    if not contract.random_weights:
        return "none: every weight was loaded from the checkpoint"
    return (f"{len(contract.random_weights)} left at random initialisation ("
            + ("allowed explicitly" if contract.random_weights_allowed else "probe explain / run refuse this model")
            + "): " + ", ".join(contract.random_weights))


def _maps_text(stack) -> str:
    """What a stack's maps are where some are a token mixer's implicit matrix (probe.hooks.implicit)."""
    if stack.implicit:
        return f"implicit: every layer is a {stack.mixer_class or stack.module_class} matrix, not editable"
    kinds = ", ".join(f"{layer} {kind}" + (f" ({stack.layer_heads[layer]} heads)" if stack.layer_heads else "")
                      for layer, kind in enumerate(stack.layer_maps))
    return f"hybrid, by layer: {kinds}; implicit layers are {stack.mixer_class} matrices, not editable"


def contract_table(contract: AttentionContract) -> object:
    from rich.table import Table

    table = Table(title="attention contract", show_header=False)
    info = contract.to_dict()
    for key in ("model_type", "task", "implementation", "dtype", "device", "max_positions", "padding_side"):
        table.add_row(key, _plain(info[key]))
    table.add_row("random weights", _plain(_random_weights_text(contract)))
    if contract.pooling:
        table.add_row("pooling", f"{contract.pooling['mode']}{', normalised' if contract.pooling['normalize'] else ''} "
                                 f"(from {contract.pooling['source']})")
    for name, stack in contract.stacks.items():
        kv = stack.kv_head_of_query
        kv_text = "one per query head (MHA)" if stack.n_kv_heads == stack.n_heads else \
            ", ".join(f"q{h}->kv{g}" for h, g in enumerate(kv))
        table.add_row(f"{name} stack", _plain(f"{stack.n_layers} layers x {stack.n_heads} query heads, "
                                              f"{stack.n_kv_heads} kv heads, "
                                       f"head dim {stack.head_dim}, mask {stack.mask_kind}, {stack.module_class}"))
        table.add_row(f"{name} kv map", kv_text)
        if not stack.softmax:
            table.add_row(f"{name} maps", _plain(_maps_text(stack)))
    for method, why in contract.context_mixing.items():
        table.add_row(method, "supported" if why is None else _plain(why))
    return table


@app.command()
@with_options("options", MODEL_OPTIONS, ModelOptions, leave_out=("allow_random_weights",))
def contract(
    model: str = ModelArg,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    *, options: ModelOptions,
) -> None:
    """Print the model's attention contract and run the invariance checks (exit 1 if one fails).

    Weights the checkpoint leaves random are listed, not refused: the contract describes the model."""
    pm = dataclasses.replace(options, allow_random_weights=True).load(model)
    from probe.models.checks import run_checks

    results = run_checks(pm)
    if as_json:
        print(json.dumps({"model_path": pm.path, "contract": pm.contract.to_dict(),
                          "checks": [r.to_dict() for r in results]}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(contract_table(pm.contract))
        table = Table(title="invariance checks")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail")
        for r in results:
            table.add_row(r.name, "[green]pass[/]" if r.passed else "[red]FAIL[/]", _plain(r.detail))
        console.print(table)
    if not all(r.passed for r in results):
        raise typer.Exit(1)


@app.command()
@model_options
def inspect(
    model: str = ModelArg,
    text: str = typer.Argument(..., help="the text to predict and inspect"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    top: int = typer.Option(3, "--top", min=1, help="tokens shown per head"),
    strict_length: bool = typer.Option(False, "--strict-length", help="refuse text longer than the model's window "
                                                                      "instead of truncating"),
    *, options: ModelOptions,
) -> None:
    """Predict TEXT and show where the target query's attention goes, per layer and head."""
    pm = options.load(model)
    if pm.task.embeds:
        raise InputError("inspect shows one target query's attention and a headless encoder pools every position: "
                         "use probe explain MODEL TEXT --target similarity --reference TEXT")
    from probe.cli.predict import target_attention

    result = target_attention(pm, text, strict_length=strict_length)
    attention = result["attention"]
    sinks = _text_sinks(pm, text, strict_length)
    if as_json:
        print(json.dumps({
            "model_path": pm.path, "tokens": result["tokens"], "token_ids": result["token_ids"],
            "prediction": result["prediction"], "stack": result["stack"], "query_position": result["query_position"],
            "attention": attention.tolist(), "sinks": sinks,
        }))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(contract_table(pm.contract))
    console.print(_plain(f"prediction: {json.dumps(result['prediction'])}"))
    tokens = result["tokens"]
    query = tokens[result["query_position"]] if result["stack"] != "cross" else "last decoder position"
    table = Table(title=_plain(f"where the target query ({query}) attends, {result['stack']} stack"))
    table.add_column("layer", justify="right")
    table.add_column(f"mean over heads: top {top}")
    table.add_column("per head: most-attended key")
    for layer in range(attention.shape[0]):
        mean = attention[layer].mean(dim=0)
        best = mean.topk(min(top, mean.numel()))
        mean_text = "  ".join(f"{tokens[int(i)]} {float(w):.2f}" for w, i in zip(best.values, best.indices))
        heads = "  ".join(f"h{h}:{tokens[int(attention[layer, h].argmax())]} {float(attention[layer, h].max()):.2f}"
                          for h in range(attention.shape[1]))
        table.add_row(str(layer), _plain(mean_text), _plain(heads))
    console.print(table)
    console.print(_sink_table(sinks))


def _text_sinks(pm, text: str, strict_length: bool) -> dict:
    """The attention sinks of one text (probe.explainers.sinks): the sentences naming them and the
    per-layer summary, or why they are not measured."""
    import pandas as pd

    from probe.explainers.sinks import attention_sinks, result_rows
    from probe.report.sinks import sink_layers, sink_lines
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec
    from probe.study.sinks import unmeasured_reason

    reason = unmeasured_reason(pm.contract.stacks[pm.task.target_stack(pm.contract)].maps)
    if reason is not None:
        return {"measured": False, "why": reason}
    examples = prepare(pm, [text], TargetSpec(), strict_length=strict_length)
    frame = result_rows(attention_sinks(pm, examples))
    tokens = {"example": [0] * len(examples[0].tokens), "position": list(range(len(examples[0].tokens))),
              "token": list(examples[0].tokens)}
    layers = sink_layers(frame, pd.DataFrame(tokens))
    return {"measured": True, "threshold": float(frame["threshold"].iloc[0]), "lines": sink_lines(frame),
            "layers": layers.to_dict(orient="records")}


def _sink_table(sinks: dict) -> object:
    from rich.table import Table

    if not sinks["measured"]:
        table = Table(title="attention sinks", show_header=False)
        table.add_row(_plain(f"not measured: {sinks['why']}"))
        return table
    table = Table(title=_plain("attention sinks of this text: " + " ".join(sinks["lines"])))
    for column in ("layer", "sink share", "heads with a sink", "first token a sink", "other sinks"):
        table.add_column(column, justify="right" if column != "other sinks" else "left")
    for row in sinks["layers"]:
        table.add_row(str(row["layer"]), f"{row['sink_share']:.2f}", f"{row['with_sink']:.0%}",
                      f"{row['first_token']:.0%}", _plain(row["other_sinks"]))
    return table


@app.command()
@model_options
@with_options("target", TARGET_OPTIONS, target_options, after="methods")
def explain(
    model: str = ModelArg,
    text: str = typer.Argument(..., help="the text to explain"),
    methods: str | None = typer.Option(None, "--methods", help=f"comma-separated method names "
                                                               f"({', '.join(registry.names())}), or all "
                                         "(default: every method that applies)"),
    layer: int | None = typer.Option(None, "--layer", help="layer shown in the terminal table for per-layer/per-head "
                                                           "methods (default: last)"),
    steps: str | None = typer.Option(None, "--steps", help=f"integrated gradients steps: a number, or auto (more until "
                                                           f"the "
                                     f"completeness delta is within tolerance); default auto with --generate, else "
                                     f"{IG_STEPS}"),
    site: str | None = typer.Option(None, "--site", help="where gradient methods are taken: word or embeddings "
                                                         "(default: decided from the model)"),
    seed: int = typer.Option(0, "--seed", help="seed for random replacements and sampling"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    words: bool = typer.Option(False, "--words", help="one row per word, its tokens' scores summed (JSON: tokens "
                                                      "are the words, token_ids each word's ids)"),
    strict_length: bool = typer.Option(False, "--strict-length", help="refuse text longer than the model's window "
                                                                      "instead of truncating"),
    *, target: TargetSpec, options: ModelOptions,
) -> None:
    """Explain one prediction with every method side by side (token x method)."""
    from probe.methods import applicable_methods, parse_methods

    # validate before the slow load; "all" is every method that applies to this model, as the default
    chosen = parse_methods(methods) if methods and methods.strip() != "all" else None
    if seed < 0:
        raise InputError(f"--seed {seed} is negative; give a seed >= 0")
    if words and target.steps:
        raise InputError("--words shows one text's words; with --generate, fold the tokens in Python: "
                         "probe.explain(...).to_pandas('word')")
    ig_steps = _steps_option(steps)
    pm = options.load(model)
    _check_continuation(pm, target.continuation)
    from probe import api
    from probe.rows.prepare import prepare

    # a contrast on the wrong kind of model, or with --target prob, is refused by prepare in one line
    examples = prepare(pm, [text], target, strict_length=strict_length)
    names, skipped = (chosen, {}) if chosen is not None else applicable_methods(pm, examples)
    if layer is not None and not -pm.contract.n_layers <= layer < pm.contract.n_layers:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{pm.contract.n_layers - 1}")
    if site is not None:
        from probe.explainers.gradient_forward import resolve_site

        resolve_site(pm, site)  # one-line error for an unknown site or one the model lacks
    params = terminal.explain_params(names, steps=ig_steps, seed=seed, site=site)
    explanation = api.explain(pm, examples, names, params={m: p for m, p in params.items() if m in names})
    _print_explanation(pm, explanation, skipped, params, layer, as_json=as_json, per_output=target.steps, words=words)


def _print_explanation(pm: ProbeModel, explanation, skipped: dict, params: dict, layer: int | None, *,
                       as_json: bool, per_output: bool, words: bool = False) -> None:
    """``probe explain``'s output: per output token with --generate (``per_output``), else the token x
    method table (or JSON) with the checks that read it."""
    examples, results = list(explanation.examples), dict(explanation.scores)
    if per_output:
        if as_json:
            terminal.print_generation_json(pm, explanation, skipped)
        else:
            terminal.print_generation_tables(pm, explanation, layer)
        return
    from probe.study.sanity import explain_checks

    checks = explain_checks(pm, examples, results, params)
    terminal.no_score_reasons(results, skipped)  # a method that gave no score for this input is listed, with why
    example = examples[0]
    if words:  # the checks above read the tokens; the rows shown are the words
        example, results = terminal.word_view(explanation)
    if as_json:
        terminal.print_explain_json(pm, example, results, skipped, checks)
    else:
        terminal.print_explain_tables(pm, example, results, skipped, checks, layer)


def _steps_option(steps: str | None) -> int | str | None:
    """``--steps``: a positive whole number or auto; None when not given (the method's default)."""
    if steps is None or steps.strip().lower() == "auto":
        return None if steps is None else "auto"
    if not steps.strip().isdigit() or int(steps) < 1:
        raise InputError(f"--steps {steps}: give a positive whole number of steps (e.g. {IG_STEPS}) or auto")
    return int(steps)


def _check_continuation(pm: ProbeModel, continuation: str | None) -> None:
    """``--continuation`` names a language model's output: refused in one line for other models."""
    if continuation is not None and not pm.task.continuations:
        instead = "--label (index or name)" if pm.task.labels else "--target similarity or dimension"
        raise InputError(f"--continuation applies to language models; this model is a {pm.task.head}: "
                         f"give {instead} instead")


def _set_threads(torch, threads: int) -> None:
    """``--threads``: 0 keeps torch's default; more threads than CPUs is refused (OpenMP runs out of
    memory making them)."""
    import os

    if not threads:
        return
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise InputError(f"--threads {threads} is more than the {cpus} CPUs of this machine; give 1..{cpus} "
                         "(0: torch's default)")
    torch.set_num_threads(threads)


@app.command()
def run(
    study: str = typer.Argument(..., help="a study file (YAML), e.g. studies/quickstart.yaml"),
    n: int = typer.Option(None, "--n", help="cut the study to its first N examples"),
    dataset: str = typer.Option(None, "--dataset", help="run on this CSV/JSONL file (text and label columns) instead"),
    device: str = typer.Option(None, "--device", help="override the study's device: cpu, cuda, cuda:N"),
    dtype: str = typer.Option(None, "--dtype", help="override the study's dtype: fp32, bf16, fp16"),
    out: str = typer.Option(None, "--out", help="result folder (default: the study's output, else results/NAME)"),
    shard: str = typer.Option(None, "--shard", help="I/N: compute only every N-th batch starting at I"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: torch's default)"),
    wait: bool = typer.Option(False, "--wait", help="if another run holds the result folder, wait for it instead of "
                                                    "exiting"),
    force_new: bool = typer.Option(False, "--force-new", help="start over in a result folder that holds another "
                                                              "study's "
                                   "results (or this study's on other data, weights or code), removing them"),
    plan: bool = typer.Option(False, "--plan", help="first predict the study's cost (probe plan) and print it; "
                                                    "refuse the run if its peak does not fit the device's memory"),
) -> None:
    """Run a study (or continue an interrupted one): tables, statistics and a verdict in the result folder."""
    from probe.spec.study import load_study
    from probe.study.plan import parse_shard

    shard_of = parse_shard(shard)  # both checked before the slow imports
    spec = load_study(study, n=n, dataset=dataset, device=device, dtype=dtype, out=out)
    from probe.study.sizes import check_sizes

    check_sizes(spec, file=study)  # the file's line, before the slow imports and the model
    quiet_libraries()
    import torch

    from probe.api import run_study

    _set_threads(torch, threads)
    with warnings.catch_warnings():
        warnings.showwarning = _warn_one_line
        model = _planned_model(spec) if plan else None
        result = run_study(spec, shard=shard_of, progress=progress, wait=wait, force_new=force_new,
                           log=_log, model=model)
    if result.verdict is not None:
        _say(f"{result.verdict.answer.upper()}: {result.verdict.headline}")
        _say(f"results: {result.root}")


def _planned_model(spec):
    """``probe run --plan``: the study's plan printed, a one-line refusal where its peak does not fit the
    device's memory, else the model the plan loaded (the run uses it)."""
    from probe.study.cost import granted_memory, plan_study
    from probe.study.runner import load_study_model

    granted_memory()  # a malformed PROBE_PLAN_MEMORY is refused before the model loads
    pm = load_study_model(spec)
    found = plan_study(spec, pm=pm, log=_log)
    for line in found.lines():
        _say(line)
    if not found.fits:
        raise InputError(f"the study's predicted peak memory ({found.peak_bytes / 2**30:.1f} GiB) exceeds the "
                         f"{found.available_bytes / 2**30:.1f} GiB available on {found.device}: see `probe plan "
                         "--memory` for settings that fit")
    return pm


@app.command()
def plan(
    study: str = typer.Argument(..., help="a study file (YAML), e.g. studies/quickstart.yaml"),
    n: int = typer.Option(None, "--n", help="plan for the study cut to its first N examples"),
    dataset: str = typer.Option(None, "--dataset", help="plan on this CSV/JSONL file (text and label columns) instead"),
    device: str = typer.Option(None, "--device", help="override the study's device: cpu, cuda, cuda:N"),
    dtype: str = typer.Option(None, "--dtype", help="override the study's dtype: fp32, bf16, fp16"),
    budget: str = typer.Option(None, "--budget", help="a time budget (2h, 90m, 600s): say which settings fit it"),
    memory: str = typer.Option(None, "--memory", help="a memory budget (40GiB, 16GB): say which settings fit it "
                                                      "(default: the device's available memory)"),
    json_out: str = typer.Option(None, "--json", help="also write the plan as JSON to this file"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: torch's default), as the run "
                                                            "will use them"),
) -> None:
    """Predict what a study will cost before running it: per step the model rows (forwards, backwards),
    the seconds and the peak memory on its device, from a short calibration on the real model."""
    from probe.spec.study import load_study
    from probe.study.budget import fit_budget
    from probe.study.cost import parse_budget, parse_memory

    seconds = parse_budget(budget) if budget is not None else None
    limit = parse_memory(memory) if memory is not None else None
    spec = load_study(study, n=n, dataset=dataset, device=device, dtype=dtype)
    from probe.study.sizes import check_sizes

    check_sizes(spec, file=study)
    quiet_libraries()
    import torch

    from probe.study.cost import plan_study

    _set_threads(torch, threads)
    with warnings.catch_warnings():
        warnings.showwarning = _warn_one_line
        found = plan_study(spec, log=_log)
    for line in found.lines():
        _say(line)
    fixes = fit_budget(found, spec, seconds=seconds, memory=limit)
    if fixes:
        _say("to fit " + " and ".join(w for w in (budget, memory) if w) + ":" if (budget or memory)
             else "to fit the device's memory:")
        for fix in fixes:
            _say(f"  {fix}")
    elif budget or memory:
        _say("fits " + " and ".join(w for w in (budget, memory) if w))
    if json_out:
        from pathlib import Path

        Path(json_out).write_text(json.dumps({**found.to_dict(), "fits_budget": fixes}, indent=2) + "\n")


@app.command()
def audit(
    claims: str = typer.Argument(..., help="a claim file (YAML), e.g. data/claims/minilm_rt.yaml"),
    out: str = typer.Option(None, "--out", help="report folder (default: the file's output, else results/audit_NAME)"),
    as_json: bool = typer.Option(False, "--json", help="print the audit as JSON instead of a verdict per line"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="say what runs, on stderr"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: torch's default)"),
    wait: bool = typer.Option(False, "--wait", help="if another audit holds the report folder, wait for it instead of "
                                                    "exiting"),
) -> None:
    """Test claims about the model's attention by intervention: supported, refuted or inconclusive, with evidence."""
    from pathlib import Path

    from probe.claims.file import load_claims

    spec = load_claims(claims)  # validate before the slow imports and the model load
    folder = out or spec.output or str(Path("results") / f"audit_{Path(claims).stem}")
    with _audit_folder(Path(folder), wait):  # refused or locked before the slow imports too
        quiet_libraries()
        import torch

        from probe.api import audit as run_audit

        _set_threads(torch, threads)
        with warnings.catch_warnings():
            warnings.showwarning = _warn_one_line
            result = run_audit(spec, out=folder, progress=progress and not as_json)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    for c in result.claims:
        low, high = c.ci
        ci = "n/a" if low != low or high != high else f"[{low:.3g}, {high:.3g}]"
        needed = f", n_needed {c.evidence.get('n_needed')}" if c.verdict == "inconclusive" else ""
        if c.verdict == "inconclusive" and c.evidence.get("why"):
            needed += f" ({c.evidence['why']})"
        _say(f"{c.verdict.upper():13s} {c.claim}  (effect {c.effect:.3g}, 95% CI {ci}, threshold {c.threshold:g}, "
             f"n {c.n}{needed})")
    _say(f"report: {Path(folder) / 'audit.html'}")


AUDIT_FILES = {"audit.json", "audit.md", "audit.html"}


@contextlib.contextmanager
def _audit_folder(folder, wait: bool):
    """The audit's report folder, locked for the audit (:mod:`probe.study.lock`): new, empty, or
    holding an earlier audit only; a folder this call made is removed again if the audit fails
    before writing into it."""
    from probe.study.lock import folder_lock

    if folder.exists() and not folder.is_dir():
        raise InputError(f"the audit folder {folder} is a file; give a folder as --out")
    made = not folder.exists()
    if not made:
        others = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name not in AUDIT_FILES)
        if others:
            raise InputError(f"the audit folder {folder} holds other files ({', '.join(others[:3])}"
                             f"{', ...' if len(others) > 3 else ''}); give an empty or new --out, or an earlier "
                             f"audit's folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot create the audit folder {folder}: {err.strerror}; give a writable --out") from err
    try:
        with folder_lock(folder, wait=wait):
            yield
    finally:
        if made and not any(p.name in AUDIT_FILES for p in folder.iterdir()):
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


@app.command()
def planted(
    study: str = typer.Argument("studies/planted.yaml", help="the study to run on every planted model"),
    only: str = typer.Option(None, "--only",
                             help="comma-separated planted models (default: every model of the self-test)"),
    n: int = typer.Option(None, "--n", min=1, help="examples per model (default: the study's)"),
    results: str = typer.Option("results/planted", "--results", help="where each model's study result goes"),
    out: str = typer.Option("reports/planted", "--out", help="where planted.md, planted.csv and planted.json go"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: torch's default)"),
    calibrate: int = typer.Option(200, "--calibrate", min=0,
                                  help="statistics seeds each verdict is recomputed at from its tables (0: none)"),
    small_n: int = typer.Option(40, "--small-n", min=0,
                                help="random subsets per size each verdict is re-judged on at small n (0: none)"),
) -> None:
    """The verdict's self-test: the study on every planted-truth model, each answer beside the known truth,
    and how the answer holds over many statistics seeds."""
    from pathlib import Path

    from probe.spec.study import load_study

    spec = load_study(study)
    quiet_libraries()
    import torch

    from probe.study.planted import planted_small_n, run_planted, write_planted

    _set_threads(torch, threads)
    names = [x.strip() for x in only.split(",") if x.strip()] if only else None
    with warnings.catch_warnings():
        warnings.showwarning = _warn_one_line
        frame = run_planted(spec, names=names, results=Path(results), n=n, calibrate=calibrate,
                            log=_log)
        small = planted_small_n(Path(results), list(frame.model), draws=small_n) if small_n else None
    paths = write_planted(frame, Path(out), command=f"probe planted {study}" + (f" --n {n}" if n else "")
                          + (f" --calibrate {calibrate}" if calibrate != 200 else "")
                          + (f" --small-n {small_n}" if small_n != 40 else ""), small_n=small)
    for r in frame.itertuples():
        _say(f"{'ok   ' if r.right else 'WRONG'} {r.model}: {r.answer} (expected {r.expected})")
    _say(f"{int(frame.right.sum())}/{len(frame)} right; {paths[0]}")
    if not frame.right.all():
        raise typer.Exit(1)


@app.command()
def report(
    result_dir: str = typer.Argument(..., help="a study's result folder (written by probe run)"),
    out: str = typer.Option(None, "--out", help="report folder (default: RESULT_DIR/report)"),
) -> None:
    """Render a study's stored results: one self-contained HTML file, Markdown with figures, CSV tables."""
    from probe.report.build import build_report  # probe.build_report: torch-free, no model

    files = build_report(result_dir, out)
    if files.partial:
        _say("PARTIAL: the run has not finished; the report covers its finished batches", err=True)
    _say(f"report: {files.html}")
    _say(f"markdown: {files.markdown}")


@app.command()
def compare(
    result_dirs: list[str] = typer.Argument(..., help="two or more study result folders"),
    out: str = typer.Option(None, "--out", help="report folder (default: ./comparison)"),
) -> None:
    """Several studies side by side: verdicts, headline numbers and per-layer agreement."""
    from probe.report.build import build_comparison  # probe.build_comparison: torch-free

    files = build_comparison(result_dirs, out)
    _say(f"report: {files.html}")
    _say(f"markdown: {files.markdown}")


def usage_error_classes() -> tuple[type[ClickException] | type[TyperClickException], ...]:
    """The usage-error roots of the click that typer uses: typer >= 0.25 ships its own copy
    (``typer._click``); older typers use the ``click`` package. Both are caught, whichever is present."""
    import importlib

    roots: list[type[ClickException] | type[TyperClickException]] = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            roots.append(importlib.import_module(module).ClickException)
        except ImportError:
            continue
    return tuple(roots)


def _usage_line(exc) -> str:
    """A click usage error as one line that names the command's --help."""
    message = " ".join(str(exc.format_message()).split())
    ctx = getattr(exc, "ctx", None)
    where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{where}"


def main() -> None:
    """Entry point: user errors (usage errors included) print one line and exit 2, without a traceback."""
    from probe.errors import ProbeError

    warnings.showwarning = _warn_one_line
    try:
        app(standalone_mode=False)
    except ProbeError as exc:
        _say(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:  # a write or read the code did not wrap: still one line, naming the path
        from probe.errors import storage_error

        if getattr(exc, "errno", None) is None:
            raise
        _say(f"error: {storage_error(exc, exc.filename or 'a file', 'write')}", err=True)
        sys.exit(2)
    except MemoryError as exc:  # e.g. --steps 100000000: say so in one line, not 200 lines of traceback
        print(f"error: out of memory ({' '.join(str(exc).split()) or 'MemoryError'}); lower --steps, --n or the "
              "study's engine.batch_size", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # usage errors arrive here in standalone_mode=False
        if not isinstance(exc, usage_error_classes()):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command: its help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        _say(_usage_line(exc), err=True)
        sys.exit(2)

