"""The one resolver of a model spec: what `-e` names for train, eval and sample.

What it is: `peek_config(spec)` (the GPT2Config a spec will build, from a checkpoint header or a
descriptor alone: cheap, for checks before anything is allocated) and `load(spec, **kw)` (the
GPT2 itself). A spec is, as for llm.c's `-e` (train_gpt2.cu `gpt2_build_from_checkpoint` /
`gpt2_build_from_descriptor`): an llm.c checkpoint path (v3 fp32, or v5 bf16 widened exactly)
or a descriptor ("d12", "gpt2:d12", "gpt3:c768") for llm.c's seeded random init. Any new kind of
spec (a pretrained name, a directory) or load option belongs here, so every command gains it.
What it is not: the checkpoint format (llmctl/formats.py) or the model (llmctl/model/gpt2.py).
"""
import os

from llmctl.errors import FormatError
from llmctl.model.config import GPT2Config
from llmctl.model.gpt2 import GPT2, INIT_SEED


def _checkpoint_path(spec):
    """The checkpoint path spec names, or None for a descriptor; FormatError for a missing file."""
    s = str(spec)
    if os.path.exists(s):
        return s
    if s.endswith(".bin") or os.sep in s:
        raise FormatError(f"{s}: checkpoint file not found",
                          hint="pass an existing llm.c checkpoint .bin, or a descriptor such as "
                               "-e d6 or -e d12 for llm.c's random init")
    return None


def peek_config(spec):
    """The GPT2Config that load(spec) builds, reading at most a checkpoint header."""
    path = _checkpoint_path(spec)
    if path is not None:
        from llmctl.formats import read_checkpoint_header

        return read_checkpoint_header(path).config()
    return GPT2Config.from_descriptor(spec)


def load(spec, seed=INIT_SEED, exact_libm=None, **kw):
    """A GPT2 from a spec. seed/exact_libm apply to descriptors only (GPT2.from_descriptor);
    **kw (n_threads, matmul, recompute_gelu) go to GPT2()."""
    path = _checkpoint_path(spec)
    if path is not None:
        return GPT2.from_checkpoint(path, **kw)
    return GPT2.from_descriptor(str(spec), seed=seed, exact_libm=exact_libm, **kw)
