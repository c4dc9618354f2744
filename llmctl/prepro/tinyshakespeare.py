"""`llmctl prepro tinyshakespeare`: Tiny Shakespeare -> tiny_shakespeare_{val,train}.bin.

What it is: a byte-exact re-statement of llm.c's `dev/data/tinyshakespeare.py` for GPT-2
(llm.c's `dev/data/tinyshakespeare.py`): read the text (Python universal newlines, UTF-8), split on "\n\n", emit
EOT then encode_ordinary(section + "\n\n") for every section but the last (which gets no "\n\n"),
val = the first 32,768 tokens, train = the rest. For the canonical input: 338,028 tokens,
val 32,768, train 305,260, stream starting 50256 5962 22307 25 198 8421 356 5120.
What it is not: the llama-3 variant (uint32 tokens) of the llm.c script.
"""
import hashlib
import os

import numpy as np

from llmctl.errors import DataError
from llmctl.paths import DATA_DIR, TINYSHAKESPEARE_URL
from llmctl.prepro import sources
from llmctl.prepro.writer import check_out_dir, make_out_dir
from llmctl.tokenizer import get_tokenizer

URL = TINYSHAKESPEARE_URL
CACHE_NAME = "tiny_shakespeare.txt"
CANONICAL_MD5 = "6fb458f1232090904fb40fe944165e91"
VAL_TOKENS = 32768
HF_DATASET = "karpathy/tiny_shakespeare"


def _from_datasets(ds):
    """Rebuild input.txt from the HF copy (train + validation + test texts, in file order).
    Accepted only if it equals the canonical file (md5), since byte-exactness is the point."""
    d = ds.load_dataset(HF_DATASET)
    text = "".join(row["text"] for split in ("train", "validation", "test") for row in d[split])
    data = text.encode("utf-8")
    if hashlib.md5(data).hexdigest() != CANONICAL_MD5:
        raise ValueError(f"{HF_DATASET} does not reassemble to the canonical input.txt (md5 differs)")
    return data


def read_text(path):
    """Read like llm.c's `open(path, 'r').read()`: UTF-8, universal newlines (\\r\\n -> \\n)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})",
                        hint="pass a UTF-8 text file with --source") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def tokenize_tinyshakespeare(text, workers=1):
    """The llm.c token stream for `text` as a uint16 array."""
    tok = get_tokenizer()
    sections = text.split("\n\n")
    last = len(sections) - 1
    pieces = [s + "\n\n" if i != last else s for i, s in enumerate(sections)]
    encoded = tok.encode_batch_ordinary(pieces, num_threads=workers)
    out = np.empty(sum(len(e) for e in encoded) + len(encoded), dtype=np.uint16)
    pos = 0
    for e in encoded:
        out[pos] = tok.eot
        out[pos + 1:pos + 1 + len(e)] = e
        pos += 1 + len(e)
    return out


def prepro_tinyshakespeare(out_dir=DATA_DIR, source=None, cache_dir=None, url=URL,
                           workers=1, timeout=sources.DEFAULT_TIMEOUT, log=None):
    """Write DIR/tiny_shakespeare_{val,train}.bin (default data/); return a summary dict.

    The text comes from `source`, else the cache `cache_dir/tiny_shakespeare.txt` (cache_dir
    defaults to out_dir, as llm.c caches next to its output: data/tiny_shakespeare.txt), else
    `datasets`, else `url`. A text dropped there by hand is used as is.
    """
    from llmctl.formats import write_datafile

    out_dir = check_out_dir(out_dir)
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else out_dir
    got = sources.obtain("Tiny Shakespeare", source=source, cache_path=os.path.join(cache_dir, CACHE_NAME),
                         url=url, from_datasets=_from_datasets, hub_dataset=HF_DATASET,
                         timeout=timeout, log=log)
    text = read_text(got["path"])
    tokens = tokenize_tinyshakespeare(text, workers=workers)
    if len(tokens) <= VAL_TOKENS:
        raise DataError(f"{got['path']}: only {len(tokens):,} tokens; Tiny Shakespeare's split needs more "
                        f"than {VAL_TOKENS:,} (the first {VAL_TOKENS:,} are val)",
                        hint="use `llmctl prepro text` for small corpora")
    make_out_dir(out_dir)
    val_path = os.path.join(out_dir, "tiny_shakespeare_val.bin")
    train_path = os.path.join(out_dir, "tiny_shakespeare_train.bin")
    write_datafile(val_path, tokens[:VAL_TOKENS], kind="gpt2")
    write_datafile(train_path, tokens[VAL_TOKENS:], kind="gpt2")
    return {"source": got["path"], "origin": got["origin"], "notes": got["notes"],
            "tokens": int(len(tokens)),
            "files": [{"path": val_path, "split": "val", "tokens": VAL_TOKENS},
                      {"path": train_path, "split": "train", "tokens": int(len(tokens) - VAL_TOKENS)}]}
