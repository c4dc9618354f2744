"""GPT-2, the one model llmctl trains, evaluates and samples.

What it is: the package of llm.c's `train_gpt2.c` GPT-2, in five modules:
  config.py  GPT2Config, llm.c's -e descriptors, the parameter-shape table (checkpoint order)
  gpt2.py    GPT2: the flat parameter buffer with named views, one forward / backward per layer
             for training, evaluation and the KV-cached forward (KVCache), AdamW
  ops.py     the precision's kernels (fp32 / bf16) behind one object
  spec.py    load / peek_config / default_init / resolve_init: the one resolver of what -e names (or means when not given)
config.py loads alone (no NumPy, no kernels); the other names load their module on first use.
What it is not: a trainer (llmctl/train.py), an evaluator (llmctl/evaluate.py) or a sampler
(llmctl/sample.py); those use this package and not each other.
"""
import importlib

from llmctl.model.config import (GPT2_DEPTHS, GPT3_CHANNELS, PARAM_NAMES, GPT2Config, num_parameters,
                                 param_offsets, param_shapes)

# gpt2.py and spec.py load on first use of one of their names: the checkpoint format
# (llmctl/formats.py) reads the shape table in config.py and must not load the model with it.
_LAZY = {"DECAY_PARAMS": "gpt2", "GPT2": "gpt2", "INIT_SEED": "gpt2", "init_llmc_": "gpt2",
         "load": "spec", "peek_config": "spec", "default_init": "spec", "resolve_init": "spec"}

__all__ = ["DECAY_PARAMS", "GPT2", "GPT2Config", "GPT2_DEPTHS", "GPT3_CHANNELS", "INIT_SEED", "PARAM_NAMES",
           "default_init", "init_llmc_", "load", "num_parameters", "param_offsets", "param_shapes", "peek_config",
           "resolve_init"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
