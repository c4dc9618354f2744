"""`TrainConfig`: every `llmctl train` setting, once: its default, help text, llm.c flag and range.

What it is: a dataclass with one field per setting, in the order `llmctl train --help` lists them.
Each field's metadata (`flag(...)`) holds what the CLI and the checks need:
  "flags"    the command-line names, llm.c's short flag first (("-b", "--batch-size")); () for a
             setting the CLI does not expose (AdamW eps, hard-coded in llm.c too)
  "help"     the --help text
  "name"     how error messages call it ("micro batch size")
  "check"    its own range, one of CHECKS or a `Range` (None: checked with the others)
  "cli_default", "min"   where the CLI's option differs from the field (--threads 0 = unset)
  "argument"  a positional argument, not an option (`arg(...)`: other commands' file lists)
`validate(P)` checks every field and the settings that depend on each other, raising
ConfigError (exit 2) naming the flag, and returns (total batch size, grad accumulation steps).
`cli_options()` yields (field, typer keyword arguments) for the CLI, which builds `llmctl train`
from them. Defaults are llm.c's train_gpt2.cu ones.

What it is not: the loop (llmctl/train.py) or the launch options (--nproc, --transport, ...: those
belong to llmctl/jobs/run.py's `run_train`).
"""
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import NamedTuple, Optional

from llmctl import paths
from llmctl.errors import ConfigError
from llmctl.info import DEFAULT_PRECISION
from llmctl.options import MODEL_HELP, PRECISION_HELP, THREADS_HELP


class Range(NamedTuple):
    """A finite real in [lo, hi] (open ends where asked); `why` is appended to the message."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def ok(self, x):
        return (math.isfinite(x) and (x > self.lo if self.lo_open else x >= self.lo)
                and (x < self.hi if self.hi_open else x <= self.hi))

    def text(self):
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")


def _float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# check name -> (test, message, hint); {name} {flag} {v} {default} are filled in
CHECKS = {
    "positive": (lambda v: v > 0, "{name} ({flag}) must be positive, got {v}",
                 "pass {flag} N with N >= 1 (default: {default})"),
    "nonnegative": (lambda v: v >= 0, "{name} ({flag}) must be >= 0, got {v}",
                    "pass {flag} N with N >= 0 (default: {default})"),
    "zscore": (lambda v: math.isfinite(_float(v)) and _float(v) >= 0,
               "{name} ({flag}) must be a z-score >= 0 (0 = off), got {v}",
               "pass e.g. {flag} 3 (skip updates beyond 3 standard deviations), or {flag} 0 for off"),
    "bool01": (lambda v: v in (0, 1), "{flag} must be 0 or 1, got {v}",
               "pass {flag} 1 (on) or {flag} 0 (off; default: {default})"),
}


def flag(default, *flags, help, name=None, check=None, **cli):
    """A TrainConfig field: `flags` as on the command line, llm.c's short flag first."""
    return field(default=default, metadata={"flags": flags, "help": help, "name": name,
                                            "check": check, **cli})


def arg(default=MISSING, *, help, **cli):
    """A positional argument of a command's config (no default: a required one)."""
    return field(default=default, metadata={"flags": (), "argument": True, "help": help, **cli})


@dataclass
class TrainConfig:
    """Every `llmctl train` setting (see the module docstring for the field metadata)."""

    train_data: str = flag(paths.TINYSHAKESPEARE_TRAIN, "-i", "--train-data",
                           help="Train shards glob (quote it). Val shards it matches (*_val*) "
                                "validate instead, other llm.c files (eval files, checkpoints) "
                                "are left out.")
    val_data: Optional[str] = flag(None, "-j", "--val-data",
                                   help="Val shards glob (quote it) (default: the *_val* shards "
                                        f"-i matches, else {paths.TINYSHAKESPEARE_VAL}).")
    init: Optional[str] = flag(None, "-e", "--init", help=MODEL_HELP)
    output_dir: Optional[str] = flag(None, "-o", "--output-dir",
                                     help="Directory for main.log, metrics.jsonl and checkpoints: "
                                          "the last step's always, more with -n (default: none).")
    batch_size: int = flag(4, "-b", "--batch-size", help="Micro batch size B per process.",
                           name="micro batch size", check="positive")
    seq_len: int = flag(1024, "-t", "--seq-len", help="Sequence length T (<= the model's maxT).",
                        name="sequence length", check="positive")
    total_batch_size: int = flag(-1, "-d", "--total-batch-size",
                                 help="Tokens per step; a multiple of B*T*P gives gradient "
                                      "accumulation (-1 = B*T*P).")
    max_steps: int = flag(-1, "-x", "--max-steps",
                          help="Optimization steps (-1 = one epoch of the train data).")
    lr_scheduler: str = flag("cosine", "-k", "--lr-scheduler",
                             help="cosine, linear, constant or wsd.")
    learning_rate: float = flag(3e-4, "-l", "--learning-rate", help="Peak learning rate.",
                                name="learning rate", check=Range(0, math.inf, hi_open=True))
    warmup_iters: int = flag(0, "-u", "--warmup-iters", help="Linear warmup steps.",
                             name="warmup iterations", check="nonnegative")
    final_lr_frac: float = flag(1.0, "-q", "--final-lr-frac",
                                help="Final lr as a fraction of -l (1.0 = no decay).",
                                name="final lr fraction", check=Range(0, 1))
    weight_decay: float = flag(0.0, "-c", "--weight-decay",
                               help="AdamW weight decay (2-D tensors only).",
                               name="weight decay", check=Range(0, math.inf, hi_open=True))
    skip_update_lossz: float = flag(0.0, "-sl", "--skip-update-lossz",
                                    help="Skip the update when the loss z-score over the last "
                                         "128 steps exceeds this (0 = off).",
                                    name="--skip-update-lossz", check="zscore")
    skip_update_gradz: float = flag(0.0, "-sg", "--skip-update-gradz",
                                    help="Skip the update when the grad-norm z-score over the "
                                         "last 128 steps exceeds this (0 = off).",
                                    name="--skip-update-gradz", check="zscore")
    beta1: float = flag(0.9, "--beta1", help="AdamW beta1.", name="AdamW beta1",
                        check=Range(0, 1, hi_open=True))  # hard-coded in llm.c
    beta2: float = flag(0.95, "--beta2", help="AdamW beta2.", name="AdamW beta2",
                        check=Range(0, 1, hi_open=True))  # hard-coded in llm.c
    eps: float = flag(1e-8, help="AdamW eps (hard-coded in llm.c).", name="AdamW eps",
                      check=Range(0, math.inf, lo_open=True, hi_open=True), long="--eps")
    grad_clip: float = flag(1.0, "--grad-clip",
                            help="Clip the global grad norm to this (0 disables).",
                            name="gradient clip",
                            check=Range(0, math.inf, hi_open=True, why=" (0 disables)"))
    val_loss_every: int = flag(20, "-v", "--val-loss-every",
                               help="Evaluate val loss every N steps (0 = never).",
                               name="val loss every", check="nonnegative")
    val_max_steps: int = flag(20, "-m", "--val-max-steps",
                              help="Val batches per evaluation (-1 = whole split).")
    sample_every: int = flag(20, "-s", "--sample-every",
                             help="Generate a sample every N steps (0 = never).",
                             name="sample every", check="nonnegative")
    gen_tokens: int = flag(64, "-g", "--gen-tokens",
                           help="Sample length in tokens, including the start token.")
    checkpoint_every: int = flag(0, "-n", "--checkpoint-every",
                                 help="Write a checkpoint every N steps too (0 = only the last "
                                      "step's; needs -o).",
                                 name="checkpoint every", check="nonnegative")
    checkpoints_keep: int = flag(0, "-nk", "--checkpoints-keep",
                                 help="Keep only the last N checkpoints (0 = all).",
                                 name="checkpoints keep", check="nonnegative")
    major_checkpoint_every: int = flag(0, "-nm", "--major-checkpoint-every",
                                       help="Checkpoints at multiples of N steps are never "
                                            "deleted (0 = none).",
                                       name="major checkpoint every", check="nonnegative")
    resume: int = flag(0, "-y", "--resume",
                       help="1 = resume from the newest checkpoint in -o; 0 = start over.",
                       check="bool01")
    overwrite: bool = flag(False, "--overwrite",
                           help="Start over in an -o that holds an earlier run: its checkpoints "
                                "are deleted and main.log / metrics.jsonl replaced (without it "
                                "such an -o is refused unless -y 1).")
    overfit_single_batch: int = flag(0, "-a", "--overfit-single-batch",
                                     help="1 = train on one val batch over and over "
                                          "(debugging).", check="bool01")
    hellaswag: int = flag(0, "-h", "--run-hellaswag",
                          help="1 = HellaSwag accuracy (llm.c's acc_norm) every -v steps and at "
                               "the last step.", check="bool01")
    hellaswag_path: str = flag(paths.HELLASWAG_VAL, "--hellaswag",
                               help="llm.c eval file for -h 1 (written by `llmctl prepro "
                                    "hellaswag`).")
    hellaswag_limit: Optional[int] = flag(None, "--hellaswag-limit",
                                          help="With -h 1: score only the first N examples "
                                               "(default: all).", min=1)
    sampler: str = flag("llmc", "--sampler",
                        help="Train batches: llmc (llm.c's DataLoader, its shuffled order) or "
                             "windows (shuffled random windows of -t+1 tokens, "
                             "llmctl.windows.TokenWindows; seeded, drop-last, resumable).")
    seed: int = flag(42, "--seed", help="Shuffle seed: rank r uses seed + r (llm.c: 42).")
    threads: Optional[int] = flag(None, "--threads", cli_default=0,
                                  help=THREADS_HELP + " With --nproc N: per process, >= 1 "
                                                      "(default: cores / N).")
    precision: str = flag(DEFAULT_PRECISION, "--precision",
                          help=PRECISION_HELP + " Weights, gradients and AdamW state stay fp32.")
    recompute: int = flag(-1, "-r", "--recompute",
                          help="Recompute in backward instead of keeping per layer: 0 = none, "
                               "1 = GELU, 2 = GELU and layernorms; the same bits either way, "
                               "less memory, a little more time (-1 = auto: 2 once L*B*T*4C "
                               "floats pass 256 MiB, in bf16 3 once also B*T >= 3C; below that 1 "
                               "in fp32, where it is free, and 0 in bf16; llm.c's -r, whose "
                               "default is 1). 3 (llmctl's own) = 2, plus the attention "
                               "projection's residual (one GEMM a layer) and, in bf16, no bf16 "
                               "copy of the layers' weights (each layer casts its own as it runs).",
                          name="recompute")
    zero_stage: int = flag(0, "-z", "--zero-stage",
                           help="ZeRO stage (llm.c's -z): 0 = every rank holds all AdamW state; "
                                "1 = each rank updates only its shard of every tensor "
                                "(reduce-scatter, AdamW on 1/P of m and v, all-gather).",
                           name="zero stage")

    def validate(self, P=1):
        """Raise ConfigError for settings that cannot work with P processes, before any file is
        touched. -> (total batch size in tokens, gradient accumulation steps)."""
        for f in fields(self):
            check, v = f.metadata["check"], getattr(self, f.name)
            if check is None:
                continue
            flag_ = _short(f)
            if isinstance(check, Range):
                if not check.ok(_float(v)):
                    raise ConfigError(f"{f.metadata['name']} ({flag_}) must be a finite number "
                                      f"in {check.text()}{check.why}, got {v}",
                                      hint=f"pass {flag_} X with X in {check.text()} "
                                           f"(default: {f.default:g})")
                continue
            test, msg, hint = CHECKS[check]
            if not test(v):
                kw = dict(name=f.metadata["name"], flag=flag_, v=v, default=f.default)
                raise ConfigError(msg.format(**kw), hint=hint.format(**kw))
        self._validate_together()
        tokens_per_fwdbwd = self.batch_size * self.seq_len * P
        total = tokens_per_fwdbwd if self.total_batch_size == -1 else self.total_batch_size
        if total <= 0 or total % tokens_per_fwdbwd:
            raise ConfigError(
                f"total batch size -d {total} is not a positive multiple of B*T*P = "
                f"{self.batch_size}*{self.seq_len}*{P} = {tokens_per_fwdbwd}",
                hint=f"use -d {tokens_per_fwdbwd * max(1, round(total / tokens_per_fwdbwd))} "
                     "or -1")
        return total, total // tokens_per_fwdbwd

    def _validate_together(self):
        from llmctl.schedulers import SCHEDULERS
        from llmctl.threads import check_oversubscription

        if self.threads is not None and self.threads > 0:
            check_oversubscription(1, self.threads, "--threads")
        if self.sampler not in ("llmc", "windows"):
            raise ConfigError(f"unknown --sampler {self.sampler!r}",
                              hint="pass --sampler llmc or --sampler windows")
        if self.lr_scheduler not in SCHEDULERS:
            raise ConfigError(f"unknown learning-rate schedule -k {self.lr_scheduler!r}",
                              hint=f"pass -k with one of: {', '.join(SCHEDULERS)}")
        if self.max_steps < -1:
            raise ConfigError(f"max steps (-x) must be -1 (one epoch) or >= 0, got "
                              f"{self.max_steps}", hint="pass -x N for N steps, or -x -1 for "
                                                        "one epoch of the train data")
        if self.val_max_steps < -1 or self.val_max_steps == 0 and self.val_loss_every > 0:
            raise ConfigError(f"val max steps (-m) must be -1 (whole split) or >= 1, got "
                              f"{self.val_max_steps}", hint="pass -m N with N >= 1, -m -1 for the "
                                                            "whole split, or -v 0 to skip validation")
        if self.hellaswag_limit is not None and self.hellaswag_limit < 1:
            raise ConfigError(f"--hellaswag-limit must be >= 1, got {self.hellaswag_limit}",
                              hint="pass --hellaswag-limit N with N >= 1, or leave it out to "
                                   "score every example")
        if self.resume == 1 and self.overwrite:
            raise ConfigError("-y 1 resumes the run in -o, --overwrite replaces it: not both",
                              hint="drop one of the two")
        if self.recompute not in (-1, 0, 1, 2, 3):
            raise ConfigError(f"recompute (-r) must be 0, 1, 2 or 3 (or -1 = auto), got "
                              f"{self.recompute}",
                              hint="pass -r 0 (keep all), -r 1 (recompute GELU), -r 2 (GELU "
                                   "and layernorms) or -r 3 (also the attention residual and "
                                   "the bf16 weights)")
        if self.zero_stage not in (0, 1):
            raise ConfigError(f"zero stage (-z) must be 0 or 1, got {self.zero_stage} (llm.c "
                              "falls back to 0 for stages 2 and 3, which it does not implement)",
                              hint="pass -z 1 to shard the AdamW state, or -z 0")
        if self.resume == 1 and not self.output_dir:
            raise ConfigError("-y 1 resumes from the checkpoints in -o, but no -o was given",
                              hint="pass -o DIR, the output directory of the run to resume")
        from llmctl.info import check_precision

        check_precision(self.precision)   # unknown, or bf16 on a CPU without it: one clear line
        if self.gen_tokens < 1 and self.sample_every > 0:
            raise ConfigError(f"gen tokens (-g) must be >= 1, got {self.gen_tokens}",
                              hint="pass -g N with N >= 1, or -s 0 to generate no samples")

    @classmethod
    def from_cli(cls, **values):
        """A TrainConfig from the CLI's option values (keyed by field name)."""
        kw = {}
        for f in fields(cls):
            if f.name in values:
                v = values[f.name]
                if "cli_default" in f.metadata and v == f.metadata["cli_default"]:
                    v = f.default  # e.g. --threads 0 = unset
                kw[f.name] = v
        return cls(**kw)


def _short(f):
    """llm.c's short flag of field f (or its long option)."""
    m = f.metadata
    return m["flags"][0] if m["flags"] else m.get("long", f.name)


def cli_options(config=None):
    """(field, typer.Option or typer.Argument keyword arguments) for each field the CLI exposes
    of `config`, a dataclass of `flag(...)` and `arg(...)` fields (default: TrainConfig;
    llmctl/sample_config.py is another). A required argument's default is `...`."""
    for f in fields(config or TrainConfig):
        m = f.metadata
        if not m["flags"] and not m.get("argument"):
            continue
        default = m.get("cli_default", f.default)
        opt = {"default": ... if default is MISSING else default, "param_decls": m["flags"],
               "help": m["help"]}
        for key in ("min", "max", "show_default", "metavar", "argument"):
            if key in m:
                opt[key] = m[key]
        yield f, opt
