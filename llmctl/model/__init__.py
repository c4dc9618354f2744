"""GPT-2, the one model llmctl trains, evaluates and samples.

What it is: the package of llm.c's `train_gpt2.c` GPT-2, in five modules:
  config.py  GPT2Config, llm.c's -e descriptors, the parameter-shape table (checkpoint order)
  gpt2.py    GPT2: the flat parameter buffer with named views, one forward / backward per layer
             for training, evaluation and the KV-cached forward (KVCache), AdamW
  ops.py     the precision's kernels (fp32 / bf16) behind one object
  spec.py    load / peek_config: the one resolver of what -e names (checkpoint or descriptor)
What it is not: a trainer (llmctl/train.py), an evaluator (llmctl/evaluate.py) or a sampler
(llmctl/sample.py); those use this package and not each other.
"""
from llmctl.model.config import (GPT2_DEPTHS, GPT3_CHANNELS, PARAM_NAMES, GPT2Config, num_parameters,
                                 param_offsets, param_shapes)
from llmctl.model.gpt2 import DECAY_PARAMS, GPT2, INIT_SEED, init_llmc_
from llmctl.model.spec import load, peek_config

__all__ = ["DECAY_PARAMS", "GPT2", "GPT2Config", "GPT2_DEPTHS", "GPT3_CHANNELS", "INIT_SEED", "PARAM_NAMES",
           "init_llmc_", "load", "num_parameters", "param_offsets", "param_shapes", "peek_config"]
