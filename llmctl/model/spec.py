"""The one resolver of a model spec: what `-e` names for train, eval and sample.

What it is: `peek_config(spec)` (the GPT2Config a spec will build, from a checkpoint header or a
descriptor alone: cheap, for checks before anything is allocated) and `load(spec, **kw)` (the
GPT2 itself); `default_init()`, the spec `-e` means when it is not given. A spec is, as for
llm.c's `-e` (train_gpt2.cu `gpt2_build_from_checkpoint` / `gpt2_build_from_descriptor`): an llm.c checkpoint path (v3 fp32, or v5 bf16 widened exactly)
or a descriptor ("d12", "gpt2:d12", "gpt3:c768") for llm.c's seeded random init; and, as
train_gpt2.py's `--model`, pretrained GPT-2 ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "hf:ORG/NAME",
or a Hugging Face model directory), which llmctl/hf/ turns into a cached llm.c checkpoint. Any
new kind of spec or load option belongs here, so every command gains it.
What it is not: the checkpoint format (llmctl/formats.py) or the model (llmctl/model/gpt2.py).
"""
import os
import sys

from llmctl.errors import DataError, FormatError, LlmctlError
from llmctl.formats import read_checkpoint_header
from llmctl.hf import is_pretrained_spec, pretrained_checkpoint, pretrained_header
from llmctl.model.config import GPT2Config
from llmctl.model.gpt2 import GPT2, INIT_SEED
from llmctl.paths import GPT2_124M_CHECKPOINT, PRETRAINED_DEFAULT

SPEC_HINT = ("-e takes an llm.c checkpoint .bin, a descriptor for llm.c's random init (d6, d12, ...), "
             "pretrained gpt2 / gpt2-medium / gpt2-large / gpt2-xl, or a Hugging Face model directory")


def _pretrained(s):
    """A pretrained spec (a file of that name is still a checkpoint, as before)."""
    return not os.path.isfile(s) and is_pretrained_spec(s)


def _checkpoint_path(spec):
    """The checkpoint path spec names (a pretrained spec's cached conversion), or None for a
    descriptor; FormatError for a missing file."""
    s = str(spec)
    if _pretrained(s):
        return str(pretrained_checkpoint(s, log=lambda msg: print(msg, file=sys.stderr, flush=True)))
    if os.path.isdir(s):
        raise FormatError(f"{s}: is a directory without config.json or model.safetensors", SPEC_HINT)
    if os.path.exists(s):
        return s
    if s.endswith(".bin") or os.sep in s:
        raise FormatError(f"{s}: checkpoint file not found", SPEC_HINT)
    return None


def peek_config(spec):
    """The GPT2Config that load(spec) builds, reading at most a checkpoint header (for a
    pretrained spec, its config.json: nothing is downloaded but that, nothing converted)."""
    if _pretrained(str(spec)):
        return pretrained_header(str(spec)).config()
    path = _checkpoint_path(spec)
    if path is not None:
        return read_checkpoint_header(path).config()
    return GPT2Config.from_descriptor(spec)


def load(spec, seed=INIT_SEED, exact_libm=None, **kw):
    """A GPT2 from a spec. seed/exact_libm apply to descriptors only (GPT2.from_descriptor);
    **kw (n_threads, engine, recompute, precision) go to GPT2()."""
    path = _checkpoint_path(spec)
    if path is not None:
        return GPT2.from_checkpoint(path, **kw)
    return GPT2.from_descriptor(str(spec), seed=seed, exact_libm=exact_libm, **kw)


def default_init(log=None, progress=True):
    """The checkpoint `-e` means when not given, and how it was found: (path, note).

    As llm.c's train_gpt2.c: GPT2_124M_CHECKPOINT in the working directory if it is there, else
    pretrained GPT-2 124M (`-e gpt2`, from the Hugging Face cache or downloaded once, ~500 MB).
    If neither can be had (offline and not cached, say): one DataError whose hint names
    `-e d12` and how to fetch the weights.
    """
    if os.path.isfile(GPT2_124M_CHECKPOINT):
        return GPT2_124M_CHECKPOINT, f"{GPT2_124M_CHECKPOINT} in the working directory"
    try:
        path = pretrained_checkpoint(PRETRAINED_DEFAULT, progress=progress, log=log)
        return os.fspath(path), f"pretrained {PRETRAINED_DEFAULT} (GPT-2 124M)"
    except LlmctlError as e:
        why, inner_hint = e.message, e.hint
    hint = (f"pass -e d12 to start from random weights (llm.c's -e d12), or fetch GPT-2 124M once "
            f"with network: `llmctl prepro gpt2` (writes {GPT2_124M_CHECKPOINT} here) or any command "
            f"with -e {PRETRAINED_DEFAULT}")
    if inner_hint and inner_hint.startswith("install"):  # huggingface_hub/safetensors missing
        hint = f"{inner_hint}; or {hint}"
    raise DataError(f"no -e given: there is no {GPT2_124M_CHECKPOINT} here and pretrained "
                    f"{PRETRAINED_DEFAULT} cannot be loaded: {why}", hint=hint)


def resolve_init(spec, log=None, progress=True):
    """The model `-e` names, and a note when it was not given: (spec, None) for a given spec,
    else (default_init()'s path, "PATH (no -e: how it was found)"). The one place every command
    (train, eval, sample) turns a missing -e into llm.c's default."""
    if spec is not None:
        return spec, None
    path, how = default_init(log=log, progress=progress)
    return path, f"{path} (no -e: {how})"
