"""`SampleConfig`: every `llmctl sample` setting of its own, once: default, flags, help, range.

What it is: the TrainConfig pattern (llmctl/train_config.py: one field per flag, `flag(...)`
metadata, the CLI generated from the fields by `cli_options`) for `llmctl sample`. `validate()`
raises ConfigError (exit 2) naming the flag. The options every model command shares (-e,
--threads, --precision, --json) are not fields here: the CLI adds them (llmctl/options.py).
What it is not: the sampling loop (llmctl/sample.py) or reading --prompt-file (the CLI does).
"""
from dataclasses import dataclass
from typing import Optional

from llmctl.errors import ConfigError
from llmctl.train_config import flag


@dataclass
class SampleConfig:
    """Every `llmctl sample` setting (see the module docstring)."""

    prompt: Optional[str] = flag(None, "--prompt", "-p",
                                 help="Prompt text (<|endoftext|> is the EOT token). Default: "
                                      "start from EOT like llm.c.")
    prompt_file: Optional[str] = flag(None, "--prompt-file",
                                      help="Read the prompt from a UTF-8 file (verbatim; "
                                           "default: none, see --prompt).")
    num_tokens: int = flag(64, "-n", "--max-new-tokens", min=1,
                           help="Tokens to generate; truncated with a message if prompt + n > "
                                "maxT (llm.c train: -g).")
    temperature: float = flag(1.0, "--temperature", min=0.0,
                              help="Softmax temperature; 0 = greedy.")
    top_k: int = flag(0, "--top-k", min=0, help="Sample among the K most likely tokens (0 = off).")
    top_p: float = flag(1.0, "--top-p", min=0.0, max=1.0,
                        help="Nucleus sampling: smallest set with probability >= P (1 = off).")
    seed: int = flag(1337, "--seed",
                     help="Sampler seed, 1..2^64-1 (llm.c's xorshift64*; same seed -> same text).")
    num_samples: int = flag(1, "--num-samples", min=1,
                            help="Samples to draw, one after another from one RNG stream.")
    no_cache: bool = flag(False, "--no-cache",
                          help="Recompute the full forward every token (llm.c's way; slow).")

    def validate(self):
        """ConfigError for a setting that cannot work (the sampler's ranges, the seed)."""
        from llmctl.sample import check_sampling

        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)

    def check_prompt_source(self):
        """ConfigError if both --prompt and --prompt-file are given."""
        if self.prompt is not None and self.prompt_file is not None:
            raise ConfigError("give --prompt or --prompt-file, not both", hint="drop one of the two")
