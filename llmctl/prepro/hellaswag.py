"""`llmctl prepro hellaswag`: HellaSwag jsonl -> hellaswag_val.bin in llm.c's eval format.

What it is: a byte-exact re-statement of the .bin writing in llm.c's `dev/data/hellaswag.py`
(llm.c's `dev/data/hellaswag.py`, format `data_common.py` `write_evalfile`): examples in jsonl order; ctx = example["ctx"] verbatim,
ctx_tokens = encode(ctx) (tiktoken `encode`: special-token text is an error, not a token);
each of the 4 endings -> encode(" " + ending); label = example["label"].
What it is not: the evaluator (llmctl/evaluate.py) or a HellaSwag test-split writer (no labels).
"""
import json
import os

from llmctl.errors import ConfigError, DataError
from llmctl.paths import DATA_DIR
from llmctl.prepro import sources
from llmctl.prepro.writer import check_out_dir, make_out_dir
from llmctl.tokenizer import get_tokenizer

URLS = {
    "train": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_train.jsonl",
    "val": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
}
HF_DATASET = "Rowan/hellaswag"
HF_SPLITS = {"train": "train", "val": "validation"}


def _from_datasets_fn(split):
    def load(ds):
        rows = ds.load_dataset(HF_DATASET, split=HF_SPLITS[split])
        lines = []
        for r in rows:
            r = dict(r)
            r["label"] = int(r["label"])  # the HF copy stores labels as strings
            lines.append(json.dumps(r))
        return ("\n".join(lines) + "\n").encode("utf-8")
    return load


def read_examples(path):
    """Parse and validate the jsonl; return [(line_no, ctx, label, endings)]."""
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})", hint="check the path and its permissions") from None
    with f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{no}: not UTF-8 text ({e.reason} at byte {e.start} of the line)",
                                hint="is this a HellaSwag .jsonl file?") from None
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
                if not isinstance(ex, dict):
                    raise DataError(f"{path}:{no}: a JSON {type(ex).__name__}, not an object with ctx, label, endings",
                                    hint="is this a HellaSwag .jsonl file?")
                ctx, label, endings = ex["ctx"], int(ex["label"]), ex["endings"]
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{no}: not valid JSON ({e.msg})", hint="is this a HellaSwag .jsonl file?") from None
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise DataError(f"{path}:{no}: missing or bad field {e} (need ctx, label, endings)",
                                hint="is this a HellaSwag .jsonl file with labels (not the test split)?") from None
            if not isinstance(ctx, str) or not isinstance(endings, list) or len(endings) != 4 \
                    or not all(isinstance(e, str) for e in endings):
                raise DataError(f"{path}:{no}: need a ctx string and exactly 4 ending strings", hint="is this a HellaSwag .jsonl file with labels (not the test split)?")
            if not 0 <= label < 4:
                raise DataError(f"{path}:{no}: label {label} is not in 0..3", hint="is this a HellaSwag .jsonl file with labels (not the test split)?")
            out.append((no, ctx, label, endings))
    if not out:
        raise DataError(f"{path}: no examples", hint="is this a HellaSwag .jsonl file?")
    return out


def tokenize_examples(rows, path="<jsonl>"):
    """The dicts formats.write_evalfile takes, in input order."""
    tok = get_tokenizer()
    examples = []
    for no, ctx, label, endings in rows:
        try:
            ctx_tokens = tok.encode(ctx)
            ending_tokens = [tok.encode(" " + e) for e in endings]
        except ValueError as e:  # tiktoken refuses special-token text under `encode`
            raise DataError(f"{path}:{no}: {_first_line(e)}",
                            hint="remove the special-token text from that line (llm.c's hellaswag.py refuses it too)") from None
        examples.append({"label": label, "ctx_tokens": ctx_tokens, "ending_tokens": ending_tokens})
    return examples


def _first_line(e):
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def check_split(split):
    """ConfigError unless --split is one with labels (val or train)."""
    if split not in URLS:
        raise ConfigError(f"--split {split!r}: only 'val' and 'train' have labels",
                          hint="use --split val (what llm.c writes)")


def prepro_hellaswag(out_dir=DATA_DIR, source=None, split="val", cache_dir=None, url=None,
                     timeout=sources.DEFAULT_TIMEOUT, log=None):
    """Write DIR/hellaswag_{split}.bin (default data/); return a summary dict.

    Source order: `source` jsonl, the cache `cache_dir/hellaswag_{split}.jsonl` (cache_dir
    defaults to out_dir, like llm.c's DATA_CACHE_DIR: data/hellaswag_val.jsonl), `datasets`, then `url` (rowanz/hellaswag).
    """
    from llmctl.formats import write_evalfile

    check_split(split)
    out_dir = check_out_dir(out_dir)
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else out_dir
    got = sources.obtain(f"HellaSwag {split}", source=source,
                         cache_path=os.path.join(cache_dir, f"hellaswag_{split}.jsonl"),
                         url=url or URLS[split], from_datasets=_from_datasets_fn(split),
                         hub_dataset=HF_DATASET, timeout=timeout, log=log)
    rows = read_examples(got["path"])
    examples = tokenize_examples(rows, got["path"])
    make_out_dir(out_dir)
    path = os.path.join(out_dir, f"hellaswag_{split}.bin")
    write_evalfile(path, examples)
    return {"source": got["path"], "origin": got["origin"], "notes": got["notes"], "path": path,
            "examples": len(examples), "bytes": os.path.getsize(path)}
