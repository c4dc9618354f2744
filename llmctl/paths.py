"""Where llmctl's files live (and come from) by default: the one source of every default path.

`llmctl prepro` writes under DATA_DIR with llm.c's own file names (`dev/data/tinyshakespeare.py`
writes `tiny_shakespeare_{val,train}.bin`, `dev/data/hellaswag.py` `hellaswag_val.bin`, ...), and
every other command's default input points there, so `llmctl prepro tinyshakespeare && llmctl
train -i 'data/*.bin'` works as written. llm.c keeps them in `dev/data/<dataset>/`; llmctl keeps
the small datasets side by side in one `data/` of the working directory (FineWeb's hundreds of
shards keep llm.c's `fineweb10B/` directory inside it).
"""
import os

DATA_DIR = "data"

TINYSHAKESPEARE_TEXT = os.path.join(DATA_DIR, "tiny_shakespeare.txt")
TINYSHAKESPEARE_TRAIN = os.path.join(DATA_DIR, "tiny_shakespeare_train.bin")
TINYSHAKESPEARE_VAL = os.path.join(DATA_DIR, "tiny_shakespeare_val.bin")
HELLASWAG_VAL = os.path.join(DATA_DIR, "hellaswag_val.bin")

# the canonical text llm.c's dev/data/tinyshakespeare.py downloads
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

# llm.c's train_gpt2.c starts from this file in the working directory (written by train_gpt2.py)
GPT2_124M_CHECKPOINT = "gpt2_124M.bin"
GPT2_TOKENIZER = "gpt2_tokenizer.bin"

# what `-e` is when it is not given (train, eval hellaswag): llm.c's pretrained GPT-2 124M
PRETRAINED_DEFAULT = "gpt2"

# the image `llmctl plot` writes when -o is not given (none with --terminal)
PLOT_OUTPUT = "runs.png"


def default_init(log=None, progress=True):
    """The checkpoint `-e` means when not given, and how it was found: (path, note).

    As llm.c's train_gpt2.c: GPT2_124M_CHECKPOINT in the working directory if it is there, else
    pretrained GPT-2 124M (`-e gpt2`, from the Hugging Face cache or downloaded once, ~500 MB).
    If neither can be had (offline and not cached, say): one DataError whose hint names
    `-e d12` and how to fetch the weights.
    """
    from llmctl.errors import DataError, LlmctlError

    if os.path.isfile(GPT2_124M_CHECKPOINT):
        return GPT2_124M_CHECKPOINT, f"{GPT2_124M_CHECKPOINT} in the working directory"
    from llmctl.hf import pretrained_checkpoint

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
