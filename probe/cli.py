"""The ``probe`` command line. Imports of torch and transformers happen inside commands, so
``probe --help`` stays fast."""

from __future__ import annotations

import json
import sys
import warnings

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Audit whether a transformer's attention weights explain its predictions.")

ModelArg = typer.Argument(..., help="builtin:minilm-rt, builtin:smollm2-135m, a local folder, or a hub id")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto")
DtypeOpt = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16")
AttnOpt = typer.Option(None, "--attn-implementation", help="load with this attention implementation (default: transformers' own, sdpa)")


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _warn_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


def _load(model: str, device: str, dtype: str, attn: str | None):
    _quiet_libraries()
    from probe.models import load_model

    return load_model(model, device=device, dtype=dtype, attn_implementation=attn)


def _contract_table(contract) -> "object":
    from rich.table import Table

    table = Table(title="attention contract", show_header=False)
    info = contract.to_dict()
    for key in ("model_type", "task", "implementation", "dtype", "device", "max_positions", "padding_side"):
        table.add_row(key, str(info[key]))
    for name, stack in contract.stacks.items():
        kv = stack.kv_head_of_query
        kv_text = "one per query head (MHA)" if stack.n_kv_heads == stack.n_heads else \
            ", ".join(f"q{h}->kv{g}" for h, g in enumerate(kv))
        table.add_row(f"{name} stack", f"{stack.n_layers} layers x {stack.n_heads} query heads, {stack.n_kv_heads} kv heads, "
                                       f"head dim {stack.head_dim}, mask {stack.mask_kind}, {stack.module_class}")
        table.add_row(f"{name} kv map", kv_text)
    return table


@app.command()
def contract(
    model: str = ModelArg,
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    attn_implementation: str | None = AttnOpt,
) -> None:
    """Print the model's attention contract and run the invariance checks (exit 1 if one fails)."""
    pm = _load(model, device, dtype, attn_implementation)
    from probe.models.checks import run_checks

    results = run_checks(pm)
    if as_json:
        print(json.dumps({"model_path": pm.path, "contract": pm.contract.to_dict(),
                          "checks": [r.to_dict() for r in results]}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(_contract_table(pm.contract))
        table = Table(title="invariance checks")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail")
        for r in results:
            table.add_row(r.name, "[green]pass[/]" if r.passed else "[red]FAIL[/]", r.detail)
        console.print(table)
    if not all(r.passed for r in results):
        raise typer.Exit(1)


@app.command()
def inspect(
    model: str = ModelArg,
    text: str = typer.Argument(..., help="the text to predict and inspect"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    top: int = typer.Option(3, "--top", min=1, help="tokens shown per head"),
    strict_length: bool = typer.Option(False, "--strict-length", help="refuse text longer than the model's window instead of truncating"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    attn_implementation: str | None = AttnOpt,
) -> None:
    """Predict TEXT and show where the target query's attention goes, per layer and head."""
    pm = _load(model, device, dtype, attn_implementation)
    from probe.predict import target_attention

    result = target_attention(pm, text, strict_length=strict_length)
    attention = result["attention"]
    if as_json:
        print(json.dumps({
            "model_path": pm.path, "tokens": result["tokens"], "token_ids": result["token_ids"],
            "prediction": result["prediction"], "stack": result["stack"], "query_position": result["query_position"],
            "attention": attention.tolist(),
        }))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(_contract_table(pm.contract))
    console.print(f"prediction: {json.dumps(result['prediction'])}")
    tokens = result["tokens"]
    query = tokens[result["query_position"]] if result["stack"] != "cross" else "last decoder position"
    table = Table(title=f"where the target query ({query}) attends, {result['stack']} stack")
    table.add_column("layer", justify="right")
    table.add_column(f"mean over heads: top {top}")
    table.add_column("per head: most-attended key")
    for layer in range(attention.shape[0]):
        mean = attention[layer].mean(dim=0)
        best = mean.topk(min(top, mean.numel()))
        mean_text = "  ".join(f"{tokens[int(i)]} {float(w):.2f}" for w, i in zip(best.values, best.indices))
        heads = "  ".join(f"h{h}:{tokens[int(attention[layer, h].argmax())]} {float(attention[layer, h].max()):.2f}"
                          for h in range(attention.shape[1]))
        table.add_row(str(layer), mean_text, heads)
    console.print(table)


def main() -> None:
    """Entry point: user errors print one line and exit 2, without a traceback."""
    from probe.errors import ProbeError

    warnings.showwarning = _warn_one_line
    try:
        app(standalone_mode=False)
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here in standalone_mode=False
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
