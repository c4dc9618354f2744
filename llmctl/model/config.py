"""GPT-2's shape: the config, its validation, llm.c's descriptors and the parameter table.

What it is: `GPT2Config` (llm.c's `GPT2Config` in train_gpt2.c: maxT, V, Vp, L, NH, C), the
`-e` descriptors of llm.c's `gpt2_build_from_descriptor` ("d12", "gpt2:d12", "gpt3:c768", as in
train_gpt2.cu's `gpt2_set_hyperparameters` / `gpt3_set_hyperparameters`), and the one table of
the 16 parameter tensors in checkpoint order (train_gpt2.c `fill_in_parameter_sizes`), which the
model, the cached forward and the checkpoint reader/writer (llmctl/formats.py) all use.
What it is not: memory (no arrays here), file I/O, or the model's math.
"""
import math
import re
from dataclasses import dataclass

from llmctl.constants import GPT2_PADDED_VOCAB_SIZE, GPT2_VOCAB_SIZE
from llmctl.errors import ConfigError

PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")

GPT2_DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
               60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}            # L -> (C, NH)
GPT3_CHANNELS = {384: (6, 64), 768: (12, 64), 1024: (24, 64), 1536: (24, 96), 2048: (24, 128),
                 2560: (32, 80), 4096: (32, 128), 5140: (40, 128), 12288: (96, 128)}  # C -> (L, hs)

_FIELDS = ("max_seq_len", "vocab_size", "padded_vocab_size", "num_layers", "num_heads", "channels")


@dataclass
class GPT2Config:
    max_seq_len: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    padded_vocab_size: int = GPT2_PADDED_VOCAB_SIZE
    num_layers: int = 12
    num_heads: int = 12
    channels: int = 768

    @classmethod
    def from_descriptor(cls, desc):
        """llm.c's -e descriptors: "d12", "gpt2:d12", "gpt3:c768". Unknown -> ConfigError."""
        d = str(desc).strip()
        hint = (f"use dN with N in {sorted(GPT2_DEPTHS)}, gpt2:dN, or gpt3:cC with C in "
                f"{sorted(GPT3_CHANNELS)}; or pretrained gpt2, gpt2-medium, gpt2-large, gpt2-xl; or a checkpoint "
                f".bin file or a Hugging Face model directory")
        m = re.fullmatch(r"(?:gpt2:)?d(\d+)", d)
        if m:
            L = int(m.group(1))
            if L not in GPT2_DEPTHS:
                raise ConfigError(f"unsupported model depth in descriptor {desc!r}", hint)
            C, NH = GPT2_DEPTHS[L]
            return cls(1024, GPT2_VOCAB_SIZE, GPT2_PADDED_VOCAB_SIZE, L, NH, C)
        m = re.fullmatch(r"gpt3:c(\d+)", d)
        if m:
            C = int(m.group(1))
            if C not in GPT3_CHANNELS:
                raise ConfigError(f"unsupported GPT-3 channel count in descriptor {desc!r}", hint)
            L, hs = GPT3_CHANNELS[C]
            cfg = cls(2048, GPT2_VOCAB_SIZE, GPT2_PADDED_VOCAB_SIZE, L, C // hs, C)
            cfg.validate(what=f"descriptor {desc!r}")
            return cfg
        raise ConfigError(f"unsupported model descriptor {desc!r}", hint)

    def as_tuple(self):
        """(maxT, V, Vp, L, NH, C), the fields in GPT2Config's order."""
        return tuple(int(getattr(self, k)) for k in _FIELDS)

    @property
    def head_size(self):
        return self.channels // self.num_heads

    def validate(self, what="model config"):
        for k in _FIELDS:
            if int(getattr(self, k)) <= 0:
                raise ConfigError(f"{what}: {k} = {getattr(self, k)} must be positive")
        if self.padded_vocab_size < self.vocab_size:
            raise ConfigError(f"{what}: padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")
        if self.channels % self.num_heads:
            raise ConfigError(f"{what}: channels {self.channels} not divisible by num_heads {self.num_heads}"
                              + (" (llm.c's gpt3:c5140 table entry has this problem)" if self.channels == 5140 else ""))
        return self


def param_shapes(cfg):
    """[(name, shape)] of the 16 parameter tensors in checkpoint order (fill_in_parameter_sizes)."""
    maxT, Vp, L, C = cfg.max_seq_len, cfg.padded_vocab_size, cfg.num_layers, cfg.channels
    return [("wte", (Vp, C)), ("wpe", (maxT, C)), ("ln1w", (L, C)), ("ln1b", (L, C)),
            ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)), ("attprojb", (L, C)),
            ("ln2w", (L, C)), ("ln2b", (L, C)), ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
            ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)), ("lnfw", (C,)), ("lnfb", (C,))]


def num_parameters(cfg):
    """Vp*C + maxT*C + L*(12C^2 + 13C) + 2C (V and NH do not change the count)."""
    return sum(math.prod(s) for _, s in param_shapes(cfg))


def param_offsets(cfg):
    """{name: (offset, size, shape)} of each tensor in the flat checkpoint-order buffer."""
    out, off = {}, 0
    for name, shape in param_shapes(cfg):
        n = math.prod(shape)
        out[name] = (off, n, shape)
        off += n
    return out
