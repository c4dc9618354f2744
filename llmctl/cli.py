"""The `llmctl` command line: parse, call one library function, render. Nothing else lives here.

Each subcommand is a small function whose body calls into a module (prepro, inspect, train,
evaluate, sample); everything a command does is callable from Python without this file.
Exit codes: 0 ok, 1 runtime error (an LlmctlError), 2 usage error (click's: a bad flag value, an
unknown option, a missing argument, rendered as Error/Hint by _Group; or a ConfigError), 130 interrupted.
Messages and progress go to stderr, results to stdout; `--json` prints machine output only.
"""
import functools
import sys
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from llmctl.constants import GPT2_VOCAB_SIZE
from llmctl import interrupt
from llmctl.errors import LlmctlError
from llmctl.info import DEFAULT_PRECISION
from llmctl.options import MODEL_HELP, PRECISION_HELP, THREADS_HELP
from llmctl.paths import DATA_DIR

err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)

try:  # recent typer carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # older typer runs on click (NoArgsIsHelpError: click >= 8.2)
    from click.exceptions import ClickException, UsageError

    try:
        from click.exceptions import NoArgsIsHelpError
    except ImportError:
        class NoArgsIsHelpError(Exception):
            pass


def _value_names_only():
    """typer's rich help prints each option's type after it, flags too (`--help <bool>`): keep
    that label where the option takes a value (`-b <int>`), drop it where it does not."""
    option = getattr(typer.core, "TyperOption", None)
    labelled = getattr(option, "display_type_rich", None)
    if labelled is None or getattr(labelled, "value_names_only", False):
        return  # an older typer prints no type labels

    def display_type_rich(self, ctx):
        return None if self.is_flag or self.count else labelled(self, ctx)
    display_type_rich.value_names_only = True
    option.display_type_rich = display_type_rich


_value_names_only()


def _print_error(message, hint=None):
    """llmctl's form of every user-facing error: `Error: ...` and, when there is one, `Hint: ...`."""
    err_console.print(f"[bold red]Error:[/] {escape(message)}", soft_wrap=True)
    if hint:
        err_console.print(f"[bold]Hint:[/] {escape(hint)}", soft_wrap=True)


def _bad_value(e):
    """(value, error type, its limits) a BadParameter rejected, when typer's converter says it
    (pydantic's `input`, `type`, `ctx`); (None, None, {}) otherwise."""
    errors = getattr(e.__cause__, "errors", None)
    try:
        first = errors()[0] if callable(errors) else {}
        return first.get("input"), first.get("type"), first.get("ctx") or {}
    except (IndexError, KeyError, TypeError, AttributeError):
        return None, None, {}


# pydantic's error types -> llmctl's words ({v}: the value, {le}/{ge}...: pydantic's limits)
_VALUE_ERRORS = {
    "int_parsing": "{v!r} is not an integer",
    "float_parsing": "{v!r} is not a number",
    "less_than_equal": "{v} is above the maximum {le}",
    "greater_than_equal": "{v} is below the minimum {ge}",
}


def _command_path(group, args):
    """`llmctl SUB [SUBSUB]` as named by args: for an error click raises without a context
    (an option missing its value is found while the subcommand's options are parsed)."""
    words, cmd = ["llmctl"], group
    for a in args:
        sub = getattr(cmd, "commands", {}).get(a)
        if sub is None:
            break
        words.append(a)
        cmd = sub
    return " ".join(words)


def _usage_error_text(e, path=None):
    """(message, hint) of a click usage error: its own text naming the flag, plus the bad value
    and, for a group run without its command, the commands it has. path: the command named by
    the arguments, for an error without a context."""
    ctx = e.ctx
    path = ctx.command_path if ctx is not None else (path or "llmctl")
    msg = e.format_message()
    value, kind, limits = _bad_value(e)
    param = getattr(e, "param", None)
    if kind in _VALUE_ERRORS and param is not None and param.opts:
        names = sorted(param.opts, key=lambda o: o.startswith("--"))  # -b/--batch-size
        msg = f"{'/'.join(names)}: " + _VALUE_ERRORS[kind].format(v=value, **limits)
    elif value is not None and repr(value) not in msg:
        prefix = "Invalid value for "
        msg = (f"Invalid value {value!r} for {msg[len(prefix):]}" if msg.startswith(prefix)
               else f"{msg} (got {value!r})")
    if ctx is not None and msg == "Missing command." and hasattr(ctx.command, "list_commands"):
        msg = f"'{path}' needs a command: {', '.join(ctx.command.list_commands(ctx))}"
    if path == "llmctl train" and getattr(e, "option_name", None) == "-h":
        msg = msg.rstrip(".") + " (-h is llm.c's HellaSwag flag: -h 1 or -h 0; the help is --help)"
    return msg, f"run '{path} --help'"


class _Group(typer.core.TyperGroup):
    """The root command. Usage errors (a bad flag value, an unknown option, a missing argument or
    command) get llmctl's `Error:` / `Hint:` lines and click's exit code 2 instead of typer's
    boxed usage panel: the one place they are rendered, whoever calls the app (main(), a test's
    CliRunner)."""

    def main(self, args=None, prog_name=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        args = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:  # bare `llmctl`: the help (rich help is printed already)
            if e.format_message().strip():
                e.show()
            sys.exit(e.exit_code)
        except UsageError as e:
            _print_error(*_usage_error_text(e, _command_path(self, args)))
            sys.exit(e.exit_code)
        except ClickException as e:
            _print_error(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            err_console.print("Aborted.")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)  # typer.Exit(n) in a command returns n here

    # Ctrl-C outside a command's body (@_interruptible covers that): while the root's options are
    # parsed (typer imports pydantic there), a subcommand's, or before the call. typer's core
    # would turn it into a silent exit 130.
    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            _interrupted("nothing was written")

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _interrupted("nothing was written")


app = typer.Typer(
    name="llmctl",
    cls=_Group,
    help="Prepare data for, train, evaluate and sample GPT-2 models on CPUs (llm.c-compatible).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["--help"]},
)
# no no_args_is_help: a bare `llmctl prepro` is a usage error naming its commands (_Group)
prepro_app = typer.Typer(help="Text -> GPT-2 tokens -> llm.c .bin files.")
eval_app = typer.Typer(help="Evaluate a checkpoint (HellaSwag, loss).")
app.add_typer(prepro_app, name="prepro")
app.add_typer(eval_app, name="eval")


# The options several commands share, defined once (their help: llmctl/options.py).
def _json_opt(prints):
    """--json: machine output only on stdout (`prints` says what); messages stay on stderr."""
    return typer.Option(False, "--json", help=f"Print {prints} on stdout.")


_MODEL_OPT = typer.Option(None, "--checkpoint", "-e", show_default=False, help=MODEL_HELP)
_THREADS_OPT = typer.Option(0, "--threads", help=THREADS_HELP)
_PRECISION_OPT = typer.Option(DEFAULT_PRECISION, "--precision", help=PRECISION_HELP)


def _command_signature(*groups):
    """A command's parameters, group by group: a config dataclass gives one option (or
    argument) per field (its flags, default and help live in its `flag(...)` / `arg(...)`
    metadata: llmctl/train_config.py, llmctl/sample_config.py), a (config, names) pair those
    fields only, a function its own typer options."""
    import dataclasses
    import inspect

    from llmctl.train_config import cli_options

    params = []
    for group in groups:
        config, names = group if isinstance(group, tuple) else (group, None)
        if not dataclasses.is_dataclass(config):
            params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                       for p in inspect.signature(config).parameters.values()]
            continue
        for f, opt in cli_options(config):
            if names is not None and f.name not in names:
                continue
            make = typer.Argument if opt.pop("argument", False) else typer.Option
            param = make(opt.pop("default"), *opt.pop("param_decls"), **opt)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=param,
                                            annotation=f.type))
    return inspect.Signature(params)


def _config_of(cls, options):
    """An instance of the config dataclass cls from a generated command's options, which lose
    those fields (the rest are the shared options)."""
    from dataclasses import fields

    return cls(**{f.name: options.pop(f.name) for f in fields(cls)})


def _version_callback(value: bool):
    if value:
        from llmctl.info import runtime_info, format_info

        out_console.print(escape(format_info(runtime_info())), soft_wrap=True)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Show the version, OpenMP/BLAS build and thread count, then exit."),
):
    pass


def _interruptible(kept="nothing was written"):
    """Ctrl-C inside a command -> one line on stderr ("Interrupted." + what was kept) and exit 130.

    typer's core turns a KeyboardInterrupt escaping a command into a silent Exit(130) before
    main() sees it, so the message has to be printed here, inside the command. An exception may
    carry its own `kept` text (prepro's ShardsInterrupted names the shards completed)."""
    def deco(fn):
        @functools.wraps(fn)  # typer reads the wrapped signature (inspect follows __wrapped__)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt as e:
                _interrupted(getattr(e, 'kept', None) or kept)
        return wrapper
    return deco


def _interrupted(kept):
    """The one "Interrupted: <what was kept>." line on stderr, then exit 130 (llmctl/interrupt.py)."""
    interrupt.say(f"{kept}.", lead=True)
    raise typer.Exit(interrupt.EXIT_CODE) from None


_PREPRO_KEPT = "every file is written under a temp name and renamed, so no partial .bin was left"


@app.command()
@_interruptible()
def info(json_out: bool = _json_opt("one JSON object")):
    """Version, OpenMP build, thread count and BLAS in use."""
    import json

    from llmctl.info import format_info, runtime_info

    inf = runtime_info()
    if json_out:
        print(json.dumps(inf))
    else:
        out_console.print(escape(format_info(inf)), soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# The commands, one small function each over the library function of the module that owns the
# work (prepro: llmctl/prepro/, inspect-bin: llmctl/inspect_bin.py, train: llmctl/train.py,
#  eval: llmctl/evaluate.py, sample: llmctl/sample.py)
# ---------------------------------------------------------------------------------------------


# --- prepro (llmctl/prepro/) -----------------------------------------------------------------


def _prepro_log(json_out):
    """Progress notes, dim on stderr; none with --json."""
    return None if json_out else (lambda msg: err_console.print(f"[dim]{escape(msg)}[/]", soft_wrap=True))


def _prepro_report(summary, json_out):
    """--json: the summary on stdout; otherwise one line per written file on stderr."""
    import json

    from rich.markup import escape

    if json_out:
        print(json.dumps(summary))
        return
    if summary.get("source"):
        err_console.print(f"[dim]input: {escape(summary['source'])} (from {summary['origin']})[/]")
    for f in summary.get("files") or summary.get("shards") or [summary]:
        err_console.print(f"wrote {escape(f['path'])}" + (f" ({f['tokens']:,} tokens)" if "tokens" in f else ""))
    if "tokens_per_s" in summary:
        err_console.print(f"{summary['tokens']:,} tokens in {summary['seconds']:.1f} s "
                          f"({summary['tokens_per_s']:,} tokens/s)")
    if summary.get("warning"):
        err_console.print(f"[yellow]Warning:[/] {summary['warning']}")


def _prepro_workers(workers):
    """-w (checked >= 0 by the config): 0 = the default thread count; more than 4x cores is capped."""
    from llmctl.info import default_threads, usable_cores
    from llmctl.threads import OVERSUBSCRIBE_LIMIT, oversubscribe_cap

    if workers == 0:
        return default_threads()
    cap = oversubscribe_cap()
    if workers > cap:
        err_console.print(f"[yellow]Warning:[/] --workers {workers} is more than {OVERSUBSCRIBE_LIMIT}x the "
                          f"{usable_cores()} usable cores; using {cap}")
        return cap
    return workers


_JSON_OPT = _json_opt("a JSON summary")


def _summary_json_option(json_out: bool = _JSON_OPT):
    """--json of prepro and export (a JSON summary), after their own settings in --help."""


def prepro_tinyshakespeare_cmd(**options):
    """Tiny Shakespeare -> tiny_shakespeare_{val,train}.bin, byte-identical to llm.c's dev/data/tinyshakespeare.py."""
    from llmctl.prepro import prepro_tinyshakespeare
    from llmctl.prepro_config import TinyShakespeareConfig

    cfg, json_out = _config_of(TinyShakespeareConfig, options), options["json_out"]
    cfg.validate()
    _prepro_report(prepro_tinyshakespeare(out_dir=cfg.out_dir, source=cfg.source, url=cfg.url, timeout=cfg.timeout,
                                          workers=_prepro_workers(cfg.workers), log=_prepro_log(json_out)), json_out)


def prepro_hellaswag_cmd(**options):
    """HellaSwag jsonl -> hellaswag_val.bin (llm.c eval format), byte-identical to llm.c's dev/data/hellaswag.py."""
    from llmctl.prepro import prepro_hellaswag
    from llmctl.prepro_config import HellaswagPreproConfig

    cfg, json_out = _config_of(HellaswagPreproConfig, options), options["json_out"]
    cfg.validate()
    _prepro_report(prepro_hellaswag(out_dir=cfg.out_dir, source=cfg.source, split=cfg.split, url=cfg.url,
                                    timeout=cfg.timeout, log=_prepro_log(json_out)), json_out)


def prepro_text_cmd(**options):
    """Your own corpus -> NAME_{val,train}_%06d.bin shards (llm.c's fineweb sharding rule)."""
    import os

    from llmctl.prepro import prepro_text
    from llmctl.prepro.text import PROGRESS_MIN_BYTES
    from llmctl.prepro_config import TextConfig

    cfg, json_out = _config_of(TextConfig, options), options["json_out"]
    cfg.validate()
    workers = _prepro_workers(cfg.workers)
    big = sum(os.path.getsize(f) for f in cfg.files if os.path.isfile(f)) >= PROGRESS_MIN_BYTES
    _prepro_report(prepro_text(cfg.files, out_dir=cfg.out_dir, val_tokens=cfg.val_tokens, shard_size=cfg.shard_size,
                               name=cfg.name, workers=workers, parallelism=cfg.parallelism,
                               progress=big and not json_out), json_out)


def prepro_tinystories_cmd(**options):
    """TinyStories -> TinyStories_{val,train}.bin (llm.c's dev/data/tinystories.py layout)."""
    from llmctl.prepro import prepro_tinystories
    from llmctl.prepro_config import TinyStoriesConfig

    cfg, json_out = _config_of(TinyStoriesConfig, options), options["json_out"]
    cfg.validate()
    _prepro_report(prepro_tinystories(out_dir=cfg.out_dir, source=cfg.source or None, val_tokens=cfg.val_tokens,
                                      workers=_prepro_workers(cfg.workers), parallelism=cfg.parallelism,
                                      progress=not json_out), json_out)


def _prepro_fineweb(edu, options):
    from llmctl.prepro import prepro_fineweb
    from llmctl.prepro_config import FinewebConfig, FinewebEduConfig

    cfg, json_out = _config_of(FinewebEduConfig if edu else FinewebConfig, options), options["json_out"]
    cfg.validate()
    _prepro_report(prepro_fineweb(edu=edu, version=cfg.version, out_dir=cfg.out_dir, source=cfg.source or None,
                                  shard_size=cfg.shard_size, max_shards=cfg.max_shards,
                                  workers=_prepro_workers(cfg.workers), parallelism=cfg.parallelism,
                                  progress=not json_out), json_out)


def prepro_fineweb_cmd(**options):
    """FineWeb -> fineweb_{val,train}_%06d.bin (llm.c's dev/data/fineweb.py -t classic)."""
    _prepro_fineweb(False, options)


def prepro_fineweb_edu_cmd(**options):
    """FineWeb-Edu -> edu_fineweb_{val,train}_%06d.bin (llm.c's dev/data/fineweb.py -t edu)."""
    _prepro_fineweb(True, options)


def prepro_tokenizer_cmd(**options):
    """Write llm.c's gpt2_tokenizer.bin (version 2, 372,108 bytes) from the offline GPT-2 tokenizer."""
    from llmctl.prepro_config import TokenizerConfig
    from llmctl.tokenizer import write_gpt2_tokenizer_bin

    cfg = _config_of(TokenizerConfig, options)
    _prepro_report(write_gpt2_tokenizer_bin(cfg.out), options["json_out"])


# --- pretrained GPT-2 in and out (llmctl/hf/, llmctl/prepro/gpt2.py) --------------------------


def prepro_gpt2_cmd(**options):
    """Pretrained GPT-2 -> gpt2_<size>.bin (fp32), gpt2_<size>_bf16.bin, gpt2_tokenizer.bin: llm.c's train_gpt2.py files, no PyTorch."""
    from llmctl.prepro.gpt2 import prepro_gpt2
    from llmctl.prepro_config import Gpt2Config

    cfg, json_out = _config_of(Gpt2Config, options), options["json_out"]
    cfg.validate()
    _prepro_report(prepro_gpt2(model=cfg.model, out_dir=cfg.out_dir, debug_state=cfg.debug_state,
                               input_bin=cfg.input_bin, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                               local_files_only=True if cfg.offline else None, progress=not json_out,
                               threads=cfg.threads or None, log=_prepro_log(json_out)),
                   json_out)


# name, command, its config (llmctl/prepro_config.py), in `llmctl prepro --help`'s order
PREPRO_COMMANDS = (
    ("tinyshakespeare", prepro_tinyshakespeare_cmd, "TinyShakespeareConfig"),
    ("hellaswag", prepro_hellaswag_cmd, "HellaswagPreproConfig"),
    ("text", prepro_text_cmd, "TextConfig"),
    ("tinystories", prepro_tinystories_cmd, "TinyStoriesConfig"),
    ("fineweb", prepro_fineweb_cmd, "FinewebConfig"),
    ("fineweb-edu", prepro_fineweb_edu_cmd, "FinewebEduConfig"),
    ("tokenizer", prepro_tokenizer_cmd, "TokenizerConfig"),
    ("gpt2", prepro_gpt2_cmd, "Gpt2Config"),
)


def _prepro_commands():
    """Each prepro command's parameters (its config's fields, then --json), then the command."""
    from llmctl import prepro_config

    for name, cmd, config in PREPRO_COMMANDS:
        cmd.__signature__ = _command_signature(getattr(prepro_config, config), _summary_json_option)
        prepro_app.command(name)(_interruptible(_PREPRO_KEPT)(cmd))


_prepro_commands()


def export_cmd(**options):
    """An llm.c checkpoint -> a Hugging Face GPT-2 directory (config.json, model.safetensors, tokenizer files) that transformers loads."""
    import json

    from llmctl.export_config import ExportConfig
    from llmctl.hf import export_checkpoint

    cfg, json_out = _config_of(ExportConfig, options), options["json_out"]
    res = export_checkpoint(cfg.checkpoint, cfg.out_dir, force=cfg.force)
    if json_out:
        print(json.dumps(res))
        return
    for f in res["files"]:
        err_console.print(f"wrote {escape(res['out_dir'])}/{escape(f)}")
    if not res["tokenizer"]:
        err_console.print(f"[yellow]Warning:[/] vocab_size {res['config']['vocab_size']} is not GPT-2's {GPT2_VOCAB_SIZE}: "
                          "no tokenizer files written")


def _export_signature():
    """`llmctl export`'s parameters: ExportConfig's fields, then --json."""
    from llmctl.export_config import ExportConfig

    return _command_signature(ExportConfig, _summary_json_option)


export_cmd.__signature__ = _export_signature()
app.command("export")(
    _interruptible("the output directory was not created (the export is written under a temp name)")(export_cmd))


def _inspect_json_option(json_out: bool = _json_opt("a JSON list, one object per file")):
    """`llmctl inspect-bin`'s --json, between FILES and --decode in --help."""


def inspect_bin_cmd(**options):
    """Identify llm.c binaries by their magic and validate them fully. Exit 1 if any is invalid."""
    from llmctl.inspect_bin import data_dir_files, inspect_files
    from llmctl.inspect_bin_config import InspectBinConfig

    cfg, json_out = _config_of(InspectBinConfig, options), options["json_out"]
    files, decode = cfg.files, cfg.decode
    if not files:
        files = data_dir_files()
        err_console.print(f"checking the {len(files)} .bin file(s) under {escape(DATA_DIR)}/")
    results = inspect_files(files, decode=decode)
    _inspect_report(results, decode, json_out)
    raise typer.Exit(0 if all(r["valid"] for r in results) else 1)


def _inspect_report(results, decode, json_out):
    """inspect-bin's output: --json, a table on a terminal or a line per valid file when piped,
    the decoded tokens, then each bad file's problem and hint on stderr."""
    import json

    from rich.table import Table

    from llmctl.inspect_bin import summary_line

    if json_out:
        print(json.dumps(results))
    elif out_console.is_terminal:
        table = Table(show_edge=False, box=None, pad_edge=False)
        for col in ("file", "kind", "status", "details"):
            table.add_column(col, overflow="fold")
        for r in results:
            if r["valid"]:
                table.add_row(escape(r["path"]), r["kind"], "[green]ok[/]", escape(summary_line(r)))
        if table.row_count:
            out_console.print(table)
    else:  # piped: one plain line per valid file
        for r in results:
            if r["valid"]:
                print(f"{r['path']}: {r['kind']} ok: {summary_line(r)}")
    if not json_out:
        for r in results:
            if r.get("decoded") is not None:
                print(f"--- {r['path']}: first {decode} tokens ---\n{r['decoded']}")
                for i, text in enumerate(r.get("decoded_endings") or []):
                    print(f"--- ending {i} ---\n{text}")
            elif r.get("decode_error"):
                sys.stderr.write(f"{r['path']}: cannot decode: {r['decode_error']}\n")
    for r in results:  # per bad file its problem and hint, plain text (paths may contain rich markup)
        if not r["valid"]:
            sys.stderr.write(f"{r['path']}: {r['problem']}\n" + (f"Hint: {r['hint']}\n" if r["hint"] else ""))


def _inspect_bin_signature():
    """`llmctl inspect-bin`'s parameters: FILES, --json, --decode (InspectBinConfig's fields)."""
    from llmctl.inspect_bin_config import InspectBinConfig

    return _command_signature((InspectBinConfig, ("files",)), _inspect_json_option,
                              (InspectBinConfig, ("decode",)))


inspect_bin_cmd.__signature__ = _inspect_bin_signature()
app.command("inspect-bin")(_interruptible()(inspect_bin_cmd))


# --- eval / sample (llmctl/evaluate.py, llmctl/sample.py) ------------------------------------


def _resolve_model(spec, precision, json_out=False, sampling=False):
    """What -e names (a checkpoint, descriptor, pretrained name or HF directory; None = llm.c's
    default, llmctl.model.resolve_init), after checking --precision (for sampling, or training
    and eval): before a large model is read or any data fetched. Says which model a missing -e
    meant."""
    from llmctl.info import check_precision
    from llmctl.model import resolve_init

    check_precision(precision, sampling=sampling)
    log = _prepro_log(json_out)
    spec, note = resolve_init(spec, log=log, progress=not json_out)
    if note and log:
        log(f"model: {note}")
    return spec


def _load_model(spec, threads, precision, json_out=False, sampling=False):
    """A GPT2 from -e (see _resolve_model); threads resolved as llmctl.threads does. Sampling in
    bf16 without oneDNN's bf16 GEMM (a copy of the bf16 GEMV decodes) emulates the prompt's GEMMs."""
    from llmctl.model import load

    spec = _resolve_model(spec, precision, json_out, sampling)
    emulate = True if sampling and precision == "bf16" else None
    return load(spec, n_threads=threads or None, precision=precision, bf16_emulate=emulate)


def _rate_progress(unit):
    """A rich progress bar on stderr showing done/total, <unit>/s and the ETA."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class _Rate(ProgressColumn):
        def render(self, task):
            return Text("-" if not task.speed else f"{task.speed:.2f} {unit}/s")

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _Rate(),
                    TimeRemainingColumn(), console=err_console, transient=True,
                    disable=not err_console.is_terminal)




def _eval_model_option(checkpoint: Optional[str] = _MODEL_OPT):
    """An eval command's -e, first in its --help."""


def _eval_run_options(
    threads: int = _THREADS_OPT,
    precision: str = _PRECISION_OPT,
    json_out: bool = _json_opt("one JSON object"),
):
    """An eval command's shared options, after its own settings in --help."""


def eval_hellaswag_cmd(**options):
    """Multiple-choice accuracy (HellaSwag) scored exactly as llm.c's EvalLoader: acc_norm, acc, correct/total."""
    from llmctl.eval_config import HellaswagConfig

    _eval_hellaswag(_config_of(HellaswagConfig, options), **options)


def _eval_hellaswag(cfg, checkpoint, threads, precision, json_out):
    import json
    import time

    from llmctl.evaluate import eval_hellaswag, hellaswag_file
    from llmctl.info import check_precision
    from llmctl.jobs.eval import eval_hellaswag_multiproc
    from llmctl.threads import check_threads

    cfg.validate()  # before any data is fetched
    nproc, limit, norm, batch_tokens = cfg.nproc, cfg.limit, cfg.norm, cfg.batch_tokens
    check_threads(threads, nproc)
    check_precision(precision)  # before any data is fetched or a model read
    input_file = cfg.input_file
    input_file = hellaswag_file(input_file, log=_prepro_log(json_out))
    checkpoint = _resolve_model(checkpoint, precision, json_out)
    t0 = time.time()
    if nproc > 1:
        res = eval_hellaswag_multiproc(checkpoint, input_file, nproc, threads=threads or None, limit=limit,
                                       norm=norm, batch_tokens=batch_tokens, precision=precision)
    else:
        model = _load_model(checkpoint, threads, precision)
        with _rate_progress("ex") as progress:
            task = progress.add_task("hellaswag", total=None)
            res = eval_hellaswag(model, input_file, limit=limit, norm=norm, per_example=cfg.per_example,
                                 batch_tokens=batch_tokens,
                                 on_start=lambda n: progress.update(task, total=n),
                                 on_progress=lambda d: progress.update(task, completed=d))
    res["seconds"] = round(time.time() - t0, 3)
    if json_out:
        print(json.dumps(res))
        return
    n = res["num_examples"]
    print(f"acc_norm: {res['correct_norm']}/{n} = {res['acc_norm']:.4f}  (norm: {res['norm']})")
    print(f"acc:      {res['correct']}/{n} = {res['acc']:.4f}")
    err_console.print(f"[dim]{n} examples in {res['seconds']:.1f} s ({n / max(res['seconds'], 1e-9):.2f} examples/s)[/]")


def eval_loss_cmd(**options):
    """Mean next-token loss and perplexity of a checkpoint over token shards (llm.c's val loss)."""
    from llmctl.eval_config import EvalLossConfig

    _eval_loss(_config_of(EvalLossConfig, options), **options)


def _eval_loss(cfg, checkpoint, threads, precision, json_out):
    import json
    import math

    from llmctl.errors import DataError
    from llmctl.evaluate import eval_loss
    from llmctl.threads import check_threads

    pattern = cfg.pattern
    check_threads(threads)
    model = _load_model(checkpoint, threads, precision, json_out)
    with _rate_progress("batch") as progress:
        task = progress.add_task("loss", total=None)
        res = eval_loss(model, pattern, B=cfg.batch_size, T=cfg.seq_len, max_batches=cfg.max_batches,
                        on_start=lambda n: progress.update(task, total=n),
                        on_progress=lambda d: progress.update(task, completed=d))
    if not math.isfinite(res["loss"]):
        raise DataError(f"{checkpoint or 'the default model'}: the mean loss over {pattern} is {res['loss']} (not finite)",
                        hint="the checkpoint's weights are probably corrupt (NaN/inf) or diverged")
    if json_out:
        print(json.dumps(res))
        return
    print(f"loss: {res['loss']:.4f}  perplexity: {res['perplexity']:.2f}")
    err_console.print(f"[dim]{res['num_batches']} batches x {res['B']}x{res['T']} tokens "
                      f"from {len(res['files'])} file(s)[/]")


def _eval_signatures():
    """The eval commands' parameters: -e, one option per field of their config, the shared ones."""
    from llmctl.eval_config import EvalLossConfig, HellaswagConfig

    for cmd, config in ((eval_hellaswag_cmd, HellaswagConfig), (eval_loss_cmd, EvalLossConfig)):
        cmd.__signature__ = _command_signature(_eval_model_option, config, _eval_run_options)


_eval_signatures()
eval_app.command("hellaswag")(_interruptible("no result")(eval_hellaswag_cmd))
eval_app.command("loss")(_interruptible("no result")(eval_loss_cmd))


def _plot_context(ctx: typer.Context):
    """`llmctl plot`'s click context (whether -o was given)."""


def _plot_json_option(
    json_out: bool = _json_opt("one JSON object (the image written, per run its series' points, last/min/max)"),
):
    """`llmctl plot`'s --json, after PlotConfig's settings in --help."""


def plot_cmd(**options):
    """Plot training curves: train loss (raw + EMA), val loss, HellaSwag acc_norm; runs overlaid (as llm.c's dev/vislog.ipynb)."""
    import json

    from llmctl.plot import panels_of, save_plot, terminal_panels
    from llmctl.plot_config import PlotConfig
    from llmctl.runlog import SERIES_TITLES, read_runs

    cfg, json_out, ctx = _config_of(PlotConfig, options), options["json_out"], options["ctx"]
    cfg.validate(json_out)
    baselines = cfg.baselines()
    loaded = read_runs(cfg.runs)
    for r in loaded:
        if r.partial_line:
            err_console.print(f"[dim]{escape(r.path)}: last line unfinished (run still writing?): "
                              f"read up to the last complete line[/]")
    shown = panels_of(loaded)
    for b in baselines:
        if not any(p in shown for p in b.panel):
            err_console.print(f"Note: no {' or '.join(SERIES_TITLES[p] for p in b.panel)} points: "
                              f"baseline {escape(b.name)!r} is not drawn")
    kw = dict(x=cfg.x, logy=cfg.logy, baselines=baselines, tokens_per_step=cfg.tokens_per_step,
              smooth=cfg.smooth)
    if cfg.terminal:
        w = cfg.width or out_console.width
        for block in terminal_panels(loaded, width=w, height=cfg.height, **kw):
            out_console.print(block, no_wrap=True, crop=True)
        if ctx.get_parameter_source("output").name.startswith("DEFAULT"):  # no -o: no image
            return
    res = save_plot(loaded, cfg.output, **kw)
    if json_out:
        print(json.dumps(res))
    else:
        err_console.print(f"wrote {escape(res['output'])} ({', '.join(res['panels'])}; "
                          f"{len(loaded)} run{'s' if len(loaded) != 1 else ''})")


def _plot_signature():
    """`llmctl plot`'s parameters: the context, PlotConfig's fields, then --json."""
    from llmctl.plot_config import PlotConfig

    return _command_signature(_plot_context, PlotConfig, _plot_json_option)


plot_cmd.__signature__ = _plot_signature()
app.command("plot")(_interruptible()(plot_cmd))


def _sample_model_option(checkpoint: Optional[str] = _MODEL_OPT):
    """`llmctl sample`'s -e, first in its --help."""


def _sample_run_options(
    threads: int = _THREADS_OPT,
    precision: str = _PRECISION_OPT,
    json_out: bool = _json_opt("one JSON object per sample (prompt_tokens, tokens, text)"),
):
    """`llmctl sample`'s shared options after SampleConfig's settings in --help."""


def sample_cmd(**options):
    """Generate text with a KV cache, streaming it as it is produced; stops at -n tokens or EOT."""
    from dataclasses import fields

    from llmctl.sample_config import SampleConfig

    cfg = SampleConfig(**{f.name: options.pop(f.name) for f in fields(SampleConfig)})
    _sample(cfg, **options)


def _sample(cfg, checkpoint, threads, precision, json_out):
    """`llmctl sample` with its settings parsed: check them, load the model, sample, report."""
    import time

    from llmctl.sample import check_sample_length, sample
    from llmctl.threads import check_threads
    from llmctl.tokenizer import get_tokenizer

    cfg.validate()
    check_threads(threads)
    prompt = _read_prompt(cfg)
    num_tokens, num_samples = cfg.num_tokens, cfg.num_samples
    tok = get_tokenizer()
    prompt_tokens = tok.encoding.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else []
    model = _load_model(checkpoint, threads, precision, json_out, sampling=True)
    prompt_tokens = prompt_tokens or [_start_token(model, tok)]
    n, msg = check_sample_length(model.config, len(prompt_tokens), num_tokens)
    if msg:
        err_console.print(f"[yellow]Warning:[/] {msg}")
    tty = sys.stdout.isatty()
    t0 = time.time()
    try:
        results = sample(model, prompt_tokens, num_samples=num_samples, max_new_tokens=n,
                         temperature=cfg.temperature, top_k=cfg.top_k or None,
                         top_p=cfg.top_p if cfg.top_p < 1.0 else None, seed=cfg.seed,
                         use_cache=not cfg.no_cache,
                         tokenizer=tok, escape=tty, **_sample_printers(prompt, num_samples, tty, json_out))
    except KeyboardInterrupt as e:  # --json prints whole samples only: say so (@_interruptible)
        if json_out:
            e.kept = "each JSON line above is a complete sample; the one being generated was dropped"
        raise
    if not json_out:
        dt = time.time() - t0
        ntok = sum(len(r["tokens"]) for r in results)
        err_console.print(f"[dim]{ntok} tokens in {dt:.2f} s ({ntok / max(dt, 1e-9):.1f} tokens/s)"
                          f"{escape(_eot_note(results, n))}[/]", soft_wrap=True)


def _read_prompt(cfg):
    """The prompt text of -p or --prompt-file (None: neither); ConfigError for both, or for a
    file that cannot be read as UTF-8."""
    from llmctl.errors import ConfigError

    cfg.check_prompt_source()
    prompt_file = cfg.prompt_file
    if prompt_file is None:
        return cfg.prompt
    try:
        with open(prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--prompt-file {prompt_file}: cannot read it ({e.strerror or e})",
                          hint="pass a UTF-8 text file, or the prompt itself with -p") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt-file {prompt_file}: not UTF-8 text (byte {e.start}: {e.reason})",
                          hint="pass a UTF-8 text file, or the prompt itself with -p") from None


def _start_token(model, tok):
    """The token a sample without a prompt starts from: llm.c starts from EOT; a model whose
    vocabulary lacks it starts from 0 (said on stderr)."""
    from llmctl.sample import default_start

    start, note = default_start(model.config.vocab_size, tok.eot)
    if note:
        err_console.print(f"[dim]{escape(note)}[/]", soft_wrap=True)
    return start


def _sample_printers(prompt, num_samples, tty, json_out):
    """sample()'s callbacks: stream the text to stdout (the prompt first, control characters
    escaped on a terminal), or with --json one JSON line per finished sample."""
    import json

    from llmctl.sample import escape_controls

    def on_text(i, piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    def on_sample_start(i):
        if num_samples > 1:
            err_console.print(f"[dim]--- sample {i + 1}/{num_samples} ---[/]")
        if prompt:
            sys.stdout.write(escape_controls(prompt) if tty else prompt)

    def on_sample_end(i, result):
        if json_out:   # one write: a Ctrl-C cannot fall between a sample's line and its newline
            sys.stdout.write(json.dumps(result) + "\n")
        else:
            sys.stdout.write("\n")
        sys.stdout.flush()

    return {"on_text": None if json_out else on_text,
            "on_sample_start": None if json_out else on_sample_start, "on_sample_end": on_sample_end}


def _sample_signature():
    """`llmctl sample`'s parameters: -e, one option per SampleConfig field, the shared options."""
    from llmctl.sample_config import SampleConfig

    return _command_signature(_sample_model_option, SampleConfig, _sample_run_options)


sample_cmd.__signature__ = _sample_signature()
app.command("sample")(_interruptible("the text above is what was generated")(sample_cmd))


def _eot_note(results, n):
    """Says which samples ended at <|endoftext|> instead of after -n tokens ('' for none)."""
    k = sum(r["stopped_at_eot"] for r in results)
    if k == 0:
        return ""
    if len(results) == 1:
        return f"; stopped at <|endoftext|>, token {len(results[0]['tokens'])} of -n {n}"
    return f"; {k} of {len(results)} samples stopped at <|endoftext|> (-n {n})"


# --- train (llmctl/train.py; its settings: llmctl/train_config.py) ---------------------------


def _train_launch_options(
    json_out: bool = _json_opt("one JSON object per event"),
    nproc: int = typer.Option(1, "--nproc", help="Data-parallel processes on this host (llm.c -pn); threads per process = cores / N unless --threads."),
    dist_timeout: float = typer.Option(30.0, "--dist-timeout", help="Seconds without a heartbeat before a rank counts as dead or hung and the job stops (--nproc > 1)."),
    master_port: int = typer.Option(0, "--master-port", help="Loopback TCP port of the --nproc control hub (0 = pick a free one). Across hosts: the rendezvous port on --master-addr (0 = MASTER_PORT or 29500)."),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Hosts in the job (default: NNODES, or SLURM_NNODES under srun with one task per node, else 1)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This host's index 0..nnodes-1 (default: NODE_RANK / GROUP_RANK / SLURM_NODEID, else 0)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Node 0's address, where the rendezvous listens (llm.c -ps; default: MASTER_ADDR, else 127.0.0.1)."),
    bind_addr: Optional[str] = typer.Option(None, "--bind-addr", help="This host's address for ring traffic (default: LLMCTL_BIND_ADDR, else the --master-addr on node 0 and the interface that routes to it elsewhere; never all interfaces unless you pass 0.0.0.0)."),
    transport: str = typer.Option("auto", "--transport", "--backend", help="How ranks exchange gradients: auto, shm, ring or mpi (auto: mpi under mpiexec, shm on one host, ring across hosts; llm.c -pi; --backend is an alias)."),
    rdzv_timeout: float = typer.Option(300.0, "--rdzv-timeout", help="Seconds to wait for every host to join the rendezvous."),
):
    """The launch options of `llmctl train` (after TrainConfig's settings in --help)."""


def train_cmd(**options):
    """Train GPT-2 with llm.c's loop (train_gpt2.cu flags); checkpoints llm.c can load; -y 1 resumes bit-exactly."""
    import inspect

    from llmctl.jobs.run import run_train
    from llmctl.train import TrainConfig, TrainInterrupted

    launch = {k: options.pop(k) for k in inspect.signature(_train_launch_options).parameters}
    cfg = TrainConfig.from_cli(**options)
    launch["timeout"] = launch.pop("dist_timeout")
    launch["backend"] = launch.pop("transport")
    try:
        run_train(cfg, threads=cfg.threads, **launch)
    except TrainInterrupted as e:
        interrupt.say(e.message)
        raise typer.Exit(interrupt.EXIT_CODE) from None


def _train_signature():
    """`llmctl train`'s parameters: one option per TrainConfig field, then the launch options."""
    from llmctl.train_config import TrainConfig

    return _command_signature(TrainConfig, _train_launch_options)


train_cmd.__signature__ = _train_signature()
app.command("train", context_settings={"help_option_names": ["--help"]})(train_cmd)


def main(argv: Optional[List[str]] = None):
    """Entry point: run the typer app, mapping user errors to one line and a non-zero exit."""
    # Usage errors (exit 2) are rendered by _Group.main; typer maps Ctrl-C to a silent exit 130,
    # so each command prints its own "Interrupted: ..." line (@_interruptible; train: train_cmd, from TrainInterrupted).
    try:
        app(args=argv, prog_name="llmctl")
    except LlmctlError as e:
        _print_error(e.message, e.hint)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # while typer builds the commands, before any runs
        interrupt.say("nothing was written.")
        sys.exit(interrupt.EXIT_CODE)
    except BrokenPipeError:
        sys.exit(1)
    except ImportError as e:   # a kernel module that does not load: built for another Python, a lost library
        from llmctl import _ext

        if not _ext.is_ours(e):
            raise
        _print_error(*_ext.load_error(e))
        sys.exit(1)


if __name__ == "__main__":
    main()
