"""GPT-2, the one model llmctl trains, evaluates and samples (llm.c's `train_gpt2.c` `GPT2`)."""
from llmctl.model.gpt2 import *  # noqa: F401,F403
from llmctl.model.gpt2 import (DECAY_PARAMS, GPT2, GPT2_DEPTHS, GPT3_CHANNELS, INIT_SEED, PARAM_NAMES,  # noqa: F401
                               GPT2Config, init_llmc_, num_parameters, param_shapes)
