"""`PlotConfig`: the settings of `llmctl plot`, once: default, flags, help, range.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)` /
`arg(...)` metadata, the CLI generated from the fields by `cli_options`) for `llmctl plot`.
`validate(json_out)` raises ConfigError (exit 2) naming the flag before any run is read. --json
is not a field: the CLI adds it.
What it is not: reading the runs or drawing them (llmctl/runlog.py, llmctl/plot.py).
"""
from dataclasses import dataclass
from typing import List, Optional

from llmctl.errors import ConfigError
from llmctl.paths import PLOT_OUTPUT
from llmctl.train_config import arg, flag

# runlog.EMA_ALPHA, written out: the CLI builds its help without importing NumPy (runlog does);
# tests/test_plot.py checks that the two agree
SMOOTH = 0.9


@dataclass
class PlotConfig:
    """Every `llmctl plot` setting of its own (see the module docstring)."""

    runs: List[str] = arg(help="Runs: `llmctl train -o` directories (metrics.jsonl, else main.log), "
                               "metrics.jsonl or llm.c main.log files; NAME=PATH names a run in the "
                               "legend (default: its directory).")
    output: str = flag(PLOT_OUTPUT, "--output", "-o",
                       help="Image file, type by extension: .png, .svg or .pdf (with --terminal: "
                            "only when -o is given).")
    x: str = flag("step", "--x",
                  help="x axis: step, or tokens (tokens seen = step x tokens per step).")
    tokens_per_step: Optional[int] = flag(None, "--tokens-per-step", min=1,
                                          help="For --x tokens, the tokens per step of runs that do "
                                               "not record it (an llm.c main.log): llm.c's -d total "
                                               "batch size (default: none; such runs need it for "
                                               "--x tokens).")
    logy: bool = flag(False, "--logy", help="Log-scale y axis on the loss panels.")
    baseline: Optional[List[str]] = flag(None, "--baseline",
                                         help="[PANEL:]NAME=VALUE: a dashed horizontal line on panel "
                                              "train, val or hellaswag (no PANEL: both loss panels), "
                                              "e.g. 'hellaswag:GPT-2 124M=0.2955'. Repeatable "
                                              "(default: none).")
    smooth: float = flag(SMOOTH, "--smooth", min=0.0, max=0.999,
                         help="EMA weight of the past for the smoothed train-loss line; 0 = off.")
    terminal: bool = flag(False, "--terminal",
                          help="Draw the panels in the terminal (braille characters; no matplotlib "
                               "needed).")
    width: int = flag(0, "--width", min=0,
                      help="--terminal: chart width in columns (0 = the terminal's).")
    height: int = flag(14, "--height", min=6, help="--terminal: lines per panel.")

    def validate(self, json_out=False):
        """ConfigError for --terminal with --json, an --x that is not an axis, or a --baseline
        that does not parse."""
        if self.terminal and json_out:
            raise ConfigError("--terminal and --json both print to stdout", hint="use one of them")
        from llmctl.plot import check_x

        check_x(self.x)
        self.baselines()

    def baselines(self):
        """The --baseline values parsed (llmctl.plot.parse_baseline; ConfigError naming the flag)."""
        from llmctl.plot import parse_baseline

        return [parse_baseline(b) for b in self.baseline or []]
