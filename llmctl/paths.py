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

# what `-e` is when it is not given (train, eval, sample): llm.c's pretrained GPT-2 124M
PRETRAINED_DEFAULT = "gpt2"

# the image `llmctl plot` writes when -o is not given (none with --terminal)
PLOT_OUTPUT = "runs.png"

