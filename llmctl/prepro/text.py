"""`llmctl prepro text | tinystories | fineweb | fineweb-edu`: documents -> llm.c token shards.

What it is: document sources (local text/jsonl/json/parquet files, or HF `datasets` streaming)
feeding writer.py's parallel tokenizer and fineweb sharding rule. Every document becomes
[EOT] + encode_ordinary(doc), as in llm.c's `dev/data/fineweb.py` and `tinystories.py`.
- text: a user's corpus. Plain-text files are split into documents on `<|endoftext|>` when the
  file contains that marker, otherwise on blank lines; documents are stripped, empty ones dropped.
  Shards `{name}_{val|train}_{%06d}.bin`: shard 0 is val (of `--val-tokens` tokens if given,
  else a full shard, as fineweb.py does), then train shards of exactly `--shard-size` tokens.
- tinystories: llm.c's layout, `TinyStories_val.bin` + `TinyStories_train.bin` (stories stripped);
  val = HF validation split, or the first local file when several are given (llm.c uses the first
  json shard), or the first `--val-tokens` tokens of a single file.
- fineweb / fineweb-edu: `HuggingFaceFW/fineweb[-edu]` sample-{10,100}BT, shards of 1e8 tokens
  named `{fineweb|edu_fineweb}_{val|train}_{%06d}.bin` in `{edu_}fineweb{10B,100B}/`.
What it is not: a downloader of bulk archives (TinyStories' tarball, fineweb parquet): those come
through `datasets` or as local files (`--source`).
"""
import json
import mmap
import os
import re

import numpy as np

from llmctl.errors import ConfigError, DataError
from llmctl.paths import DATA_DIR
from llmctl.prepro.sources import datasets_reachable, first_line
from llmctl.prepro.writer import Progress, check_out_dir, make_out_dir, tokenize_chunks, write_sharded
from llmctl.prepro_config import DEFAULT_SHARD_SIZE, check_fineweb_version
from llmctl.tokenizer import EOT_TEXT

READ_CHUNK = 1 << 20  # small: the main thread holds the GIL while decoding + splitting a chunk
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")
# Inputs at least this big get a progress bar from the CLI (smaller ones finish in ~1 s).
PROGRESS_MIN_BYTES = 8 << 20


def _file_has_marker(path, marker=EOT_TEXT.encode()):
    if os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(marker) != -1


def iter_text_documents(path, sep=None, chunk_chars=READ_CHUNK):
    """Stream documents from a UTF-8 text file. sep: "eot", "blank", or None (auto). The file is
    read chunk_chars characters at a time; the documents do not depend on it."""
    if sep is None:
        sep = "eot" if _file_has_marker(path) else "blank"
    split = (lambda s: s.split(EOT_TEXT)) if sep == "eot" else _BLANK_LINES.split
    tail = ""
    try:
        with open(path, "r", encoding="utf-8") as f:
            while True:
                chunk = f.read(chunk_chars)
                if not chunk:
                    break
                parts = split(tail + chunk)
                tail = parts.pop()  # may continue in the next chunk
                for p in parts:
                    p = p.strip()
                    if p:
                        yield p
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a chunk)",
                        hint="convert the file to UTF-8 (e.g. iconv -t utf-8)") from None
    tail = tail.strip()
    if tail:
        yield tail


def iter_json_documents(path, field):
    """Documents from .jsonl (one object per line) or .json (an array of objects)."""
    def get(obj, where):
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise DataError(f"{where}: expected an object with a string field {field!r}",
                            hint=f"each .jsonl line must be a JSON object with the text in {field!r}")
        return obj[field]

    if path.endswith(".json"):
        try:
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON array of objects")
        for i, obj in enumerate(data):
            yield get(obj, f"{path}[{i}]")
        return
    with open(path, "r", encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{no}: not valid JSON ({e.msg})",
                                hint="a .jsonl file holds one JSON object per line") from None
            yield get(obj, f"{path}:{no}")


def iter_parquet_documents(path, field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow", hint="pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        yield from batch.column(0).to_pylist()


def iter_documents(paths, field="text", strip=False):
    """Documents from local files, in the given order; the reader is chosen by extension."""
    for p in paths:
        p = os.fspath(p)
        _check_input(p)
        if p.endswith((".jsonl", ".json")):
            docs = iter_json_documents(p, field)
        elif p.endswith(".parquet"):
            docs = iter_parquet_documents(p, field)
        else:
            docs = iter_text_documents(p)
        for d in docs:
            if strip:
                d = d.strip()
            yield d


def _check_input(p, flag=""):
    """DataError unless p is an existing regular file (a directory is named as one)."""
    if os.path.isdir(p):
        raise DataError(f"{flag}{p}: is a directory, not a file",
                        hint="pass the file(s) inside it, e.g. DIR/*.txt")
    if not os.path.isfile(p):
        raise DataError(f"{flag}{p}: no such file", hint="check the path(s) given to --source / FILES")


def _datasets_or_error(what):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: no local files given and the `datasets` library is not installed",
                        hint="pip install datasets, or pass local files with --source") from None
    return datasets


_DATASETS_HINT = ("connect to the network (the first run fills the datasets cache), "
                  "or pass local files with --source")


def _load_streams(ds, what, path, *loads):
    """[datasets.load_dataset(path, streaming=True, **kw) for kw in loads], one look at the Hub
    for all of them (datasets_reachable): offline and not cached, a missing config, ... are one
    DataError, not the library's traceback."""
    with datasets_reachable(ds, path) as unreachable:
        try:
            return [ds.load_dataset(path, streaming=True, **kw) for kw in loads]
        except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError, ...)
            if unreachable is not None:
                raise DataError(f"{what}: the Hugging Face Hub cannot be reached ({type(unreachable).__name__}: "
                                f"{first_line(unreachable)}) and datasets' cache has no copy of {path}",
                                hint=_DATASETS_HINT) from None
            raise DataError(f"{what}: datasets could not load {path} ({type(e).__name__}: {first_line(e)})",
                            hint=_DATASETS_HINT) from None


def _stream_field(ds, field, what, strip=False):
    try:
        for row in ds:
            t = row[field]
            yield t.strip() if strip else t
    except (KeyError, TypeError) as e:
        raise DataError(f"{what}: a streamed row has no text field {field!r} ({type(e).__name__}: {e})") from None
    except (ConnectionError, OSError, ValueError) as e:  # a stream that breaks mid-way
        raise DataError(f"{what}: reading the datasets stream failed ({type(e).__name__}: {first_line(e)})",
                        hint=_DATASETS_HINT) from None


# ------------------------------------------------------------------------------------------------
# prepro text


def _safe_name(name):
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name or ""):
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (it becomes a file name)",
                          hint="put the shards elsewhere with --out-dir, not with a path in --name")
    return name


def prepro_text(files, out_dir=None, val_tokens=None, shard_size=DEFAULT_SHARD_SIZE, name=None,
                workers=1, parallelism="threads", progress=False):
    """Tokenize a user's corpus into `{name}_{val|train}_{%06d}.bin` shards; return a summary.

    name defaults to the first file's stem; out_dir to data/{name}.
    """
    files = [os.fspath(f) for f in files]
    if not files:
        raise DataError("no input files", hint="llmctl prepro text FILE [FILE ...]")
    for f in files:
        _check_input(f)
    name = _safe_name(name or os.path.splitext(os.path.basename(files[0]))[0])
    out_dir = check_out_dir(out_dir or os.path.join(DATA_DIR, name))
    summary = write_sharded(iter_documents(files), out_dir, lambda s, i: f"{name}_{s}_{i:06d}.bin",
                            shard_size, val_tokens=val_tokens, workers=workers, parallelism=parallelism,
                            progress=progress, description=f"tokenizing {name}")
    if not any(s["split"] == "train" for s in summary["shards"]):
        summary["warning"] = (f"all {summary['tokens']:,} tokens went to the val shard and no train shard "
                              f"was written; pass --val-tokens N (< total) or a smaller --shard-size")
    return summary


# ------------------------------------------------------------------------------------------------
# prepro tinystories


TINYSTORIES_DATASET = "roneneldan/TinyStories"


def _tokens_to_array(chunks, prog):
    parts, n_docs = [], 0
    for flat, lengths in chunks:
        parts.append(flat)
        n_docs += len(lengths)
        prog.update(len(lengths), len(flat))
    return (np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)), n_docs


def prepro_tinystories(out_dir=DATA_DIR, source=None, val_tokens=32768, workers=1,
                       parallelism="threads", progress=False):
    """Write DIR/TinyStories_{val,train}.bin (llm.c's names; default data/); return a summary.

    source: local files (TinyStories json shards with a "story" field, jsonl with "text"/"story",
    or text with <|endoftext|> between stories). Several files: the first is val, the rest train
    (llm.c's rule); one file: its first `val_tokens` tokens are val. No source: `datasets`
    streaming of roneneldan/TinyStories (validation -> val, train -> train).
    """
    from llmctl.formats import write_datafile

    out_dir = check_out_dir(out_dir)
    if source:
        files = [os.fspath(s) for s in ([source] if isinstance(source, (str, os.PathLike)) else source)]
        for f in files:
            _check_input(f, "--source ")

        def docs(fs):
            for f in fs:  # llm.c's json shards keep the text in "story"; other json(l) in "text"
                yield from iter_documents([f], field="story" if f.endswith(".json") else "text", strip=True)

        split_docs = [docs(files[:1]), docs(files[1:])] if len(files) > 1 else [docs(files)]
        origin = "source"
    else:
        ds = _datasets_or_error("tinystories")
        streams = _load_streams(ds, "tinystories", TINYSTORIES_DATASET, {"split": "validation"}, {"split": "train"})
        split_docs = [_stream_field(st, "text", "tinystories", strip=True) for st in streams]
        origin = "datasets"
    split_chunks = [tokenize_chunks(d, workers=workers, parallelism=parallelism) for d in split_docs]
    with Progress("tokenizing TinyStories", progress) as prog:
        arrays = [_tokens_to_array(c, prog)[0] for c in split_chunks]
        seconds = prog.seconds
    if len(arrays) == 2:
        val, train = arrays
    else:
        if len(arrays[0]) <= val_tokens:
            raise DataError(f"{files[0]}: only {len(arrays[0]):,} tokens, not more than --val-tokens "
                            f"{val_tokens:,}, so no train data would remain", hint="pass a smaller --val-tokens")
        val, train = arrays[0][:val_tokens], arrays[0][val_tokens:]
    if len(val) == 0 or len(train) == 0:
        raise DataError("TinyStories: an empty split (val or train has no tokens)")
    make_out_dir(out_dir)
    files_out = []
    for split, arr in (("val", val), ("train", train)):
        path = os.path.join(out_dir, f"TinyStories_{split}.bin")
        write_datafile(path, arr, kind="gpt2")
        files_out.append({"path": path, "split": split, "tokens": int(len(arr))})
    total = int(len(val) + len(train))
    return {"out_dir": out_dir, "origin": origin, "tokens": total, "files": files_out,
            "seconds": round(seconds, 3), "tokens_per_s": round(total / max(seconds, 1e-9))}


# ------------------------------------------------------------------------------------------------
# prepro fineweb / fineweb-edu


FINEWEB_DATASETS = {False: "HuggingFaceFW/fineweb", True: "HuggingFaceFW/fineweb-edu"}


def prepro_fineweb(edu=False, version="10B", out_dir=None, source=None, shard_size=DEFAULT_SHARD_SIZE,
                   max_shards=None, workers=1, parallelism="threads", progress=False):
    """llm.c's fineweb.py: shard 0 val, then train shards of exactly `shard_size` tokens.

    source: local files (jsonl/parquet with a "text" field, or plain text); otherwise `datasets`
    streams HuggingFaceFW/fineweb[-edu] config sample-{version}T. max_shards stops early.
    """
    check_fineweb_version(version)
    prefix = "edu_fineweb" if edu else "fineweb"
    out_dir = check_out_dir(out_dir or os.path.join(DATA_DIR, f"{prefix}{version}"))
    if source:
        files = [os.fspath(s) for s in ([source] if isinstance(source, (str, os.PathLike)) else source)]
        docs = iter_documents(files, field="text")
        origin = "source"
    else:
        what = "fineweb-edu" if edu else "fineweb"
        ds = _datasets_or_error(what)
        stream, = _load_streams(ds, what, FINEWEB_DATASETS[edu], {"name": f"sample-{version}T", "split": "train"})
        docs = _stream_field(stream, "text", what)
        origin = "datasets"
    summary = write_sharded(docs, out_dir, lambda s, i: f"{prefix}_{s}_{i:06d}.bin", shard_size,
                            workers=workers, parallelism=parallelism, progress=progress,
                            description=f"tokenizing {prefix}", max_shards=max_shards)
    summary["origin"] = origin
    return summary
