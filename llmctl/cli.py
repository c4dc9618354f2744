"""The `llmctl` command line: parse, call one library function, render. Nothing else lives here.

Each subcommand is a small function whose body calls into a module (prepro, inspect, train,
evaluate, sample); everything a command does is callable from Python without this file.
Exit codes: 0 ok, 1 runtime error (an LlmctlError), 2 usage error, 130 interrupted.
Messages and progress go to stderr, results to stdout; `--json` prints machine output only.
"""
import sys
from typing import List, Optional

import typer
from rich.console import Console

from llmctl import __version__
from llmctl.errors import LlmctlError

err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)

app = typer.Typer(
    name="llmctl",
    help="Prepare data for, train, evaluate and sample GPT-2 models on CPUs (llm.c-compatible).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["--help"]},
)
prepro_app = typer.Typer(help="Text -> GPT-2 tokens -> llm.c .bin files.", no_args_is_help=True)
eval_app = typer.Typer(help="Evaluate a checkpoint (HellaSwag, loss).", no_args_is_help=True)
app.add_typer(prepro_app, name="prepro")
app.add_typer(eval_app, name="eval")


def _version_callback(value: bool):
    if value:
        from llmctl.info import runtime_info, format_info

        out_console.print(format_info(runtime_info()))
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Show the version, OpenMP/BLAS build and thread count, then exit."),
):
    pass


@app.command()
def info(json_out: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """Version, OpenMP build, thread count and BLAS in use."""
    import json

    from llmctl.info import format_info, runtime_info

    inf = runtime_info()
    if json_out:
        print(json.dumps(inf))
    else:
        out_console.print(format_info(inf))


# ---------------------------------------------------------------------------------------------
# Commands are added below, one small function each, by the module that owns them.
# (prepro: llmctl/prepro/, inspect-bin: llmctl/inspect.py, train: llmctl/train.py,
#  eval: llmctl/evaluate.py, sample: llmctl/sample.py)
# ---------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None):
    """Entry point: run the typer app, mapping user errors to one line and a non-zero exit."""
    # Standalone mode: typer prints usage errors (exit 2) and maps Ctrl-C to exit 130.
    try:
        app(args=argv, prog_name="llmctl")
    except LlmctlError as e:
        err_console.print(f"[bold red]Error:[/] {e.message}", soft_wrap=True)
        if e.hint:
            err_console.print(f"[bold]Hint:[/] {e.hint}", soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("Interrupted.")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    main()
