"""Parallel, order-preserving document tokenization and llm.c's fineweb shard-splitting rule.

What it is:
- `tokenize_chunks(docs, workers, parallelism)`: yields, per chunk of input documents in order,
  the uint16 concatenation of [EOT] + encode_ordinary(doc) (what llm.c's fineweb.py and
  tinystories.py emit per document) and the per-document lengths.
  Each chunk is one tiktoken call (Tokenizer.encode_documents_numpy), no Python int lists.
  Parallelism (--parallelism): "threads" (tiktoken releases the GIL while encoding; a bounded window of chunk
  futures keeps memory flat and order fixed) or "processes" (a spawn-safe multiprocessing Pool,
  `imap` over chunks, order preserved, like fineweb.py's `pool.imap(tokenize, ..., chunksize=16)`).
- `ShardWriter`: llm.c `dev/data/fineweb.py`'s rule: shard 0 is "val", later shards
  "train"; a document is appended while `count + len(doc) < capacity` (strict); otherwise the
  shard is filled to exactly `capacity` with the document's head, written, and the remainder
  starts the next shard. The last partial shard is written if non-empty. The net effect is
  that the token stream is cut at fixed capacities, so the writer takes whole chunks of
  documents at once (same bytes, far less per-document Python). Unlike llm.c, a document
  longer than a whole shard spills over as many shards as it needs (llm.c would crash).
  Each shard is written by formats.write_datafile (temp name + rename), so an interrupted run
  leaves only complete shards, never a valid-looking partial one.
- `Progress`: a rich progress line on stderr (documents, tokens, tokens/s), or nothing.
What it is not: a source of text (see sources.py / text.py) or a binary-format writer (formats.py).
"""
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from llmctl.atomic import missing_dirs, remove_empty
from llmctl.errors import ConfigError, DataError
from llmctl.tokenizer import get_tokenizer

# Work unit: up to CHUNK_DOCS documents / ~CHUNK_CHARS characters, encoded by one tiktoken call
# (Tokenizer.encode_documents_numpy) that runs ~50 ms without the GIL. Big enough that GIL
# hand-offs and per-unit Python are negligible, small enough that the last unit leaves the other
# worker idle only briefly and memory stays flat (window = 2 units per worker in flight).
CHUNK_DOCS = 256
CHUNK_CHARS = 1 << 18

# A shard's token count: llm.c's header stores it as int32. The command line also refuses shards
# under CLI_MIN_SHARD_SIZE tokens (each shard is one file); the library takes any size >= 1.
MAX_SHARD_SIZE = 2**31 - 1
CLI_MIN_SHARD_SIZE = 1024


def check_shard_size(shard_size, minimum=1):
    """ConfigError unless minimum <= shard_size <= MAX_SHARD_SIZE (the one shard-size range)."""
    if shard_size < minimum and minimum > 1:
        raise ConfigError(f"--shard-size {shard_size}: must be at least {minimum} tokens "
                          f"(each shard is one file)", hint="llm.c uses 10**8; try e.g. --shard-size 1000000")
    if not 1 <= shard_size <= MAX_SHARD_SIZE:
        raise ConfigError(f"--shard-size {shard_size}: must be in 1..2^31-1",
                          hint="pass a count in 1..2147483647 (llm.c's header stores it as int32; llm.c uses 10**8)")


def check_out_dir(path):
    """DataError unless `path` is a directory or can be created (nothing is created here).

    Called before any slow work, so a typo'd --out-dir fails in a second, not after tokenizing."""
    path = os.fspath(path)
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if os.path.exists(p) and not os.path.isdir(p):
        what = "exists and is not a directory" if p == os.path.abspath(path) else f"{p} is not a directory"
        raise DataError(f"--out-dir {path}: {what}", hint="pass a directory path for --out-dir")
    if not os.access(p, os.W_OK | os.X_OK):
        raise DataError(f"--out-dir {path}: {p} is not writable", hint="pass a directory you can write to")
    return path


def make_out_dir(path):
    """Create the output directory `path` (and parents) or raise one DataError naming it."""
    path = check_out_dir(path)
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DataError(f"--out-dir {path}: a path component is a file, not a directory",
                        hint="pass a directory path for --out-dir") from None
    except OSError as e:
        raise DataError(f"--out-dir {path}: cannot create the directory ({e.strerror})",
                        hint="pass a directory you can write to") from None
    return path


class ShardsInterrupted(KeyboardInterrupt):
    """Ctrl-C during write_sharded; `kept` says which complete shards are on disk."""

    def __init__(self, kept):
        super().__init__(kept)
        self.kept = kept


def _kept_shards(written):
    if not written:
        return "no shard was complete, nothing was written"
    names = [os.path.basename(w["path"]) for w in written]
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return f"kept {len(names)} complete shard(s): {span} (the rest of the input was not written)"


def _encode_docs(texts):
    """Worker body (module-level so it pickles under spawn): one flat uint16 array + lengths."""
    ids, lengths = get_tokenizer().encode_documents_numpy(texts)
    return ids.astype(np.uint16), lengths


def _chunks(docs):
    """Group an iterable of strings into lists of <= CHUNK_DOCS docs / ~CHUNK_CHARS chars."""
    chunk, chars = [], 0
    for d in docs:
        chunk.append(d)
        chars += len(d)
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _warm_worker():
    from llmctl.interrupt import ignore_in_child

    ignore_in_child()  # the parent's `with` block terminates the pool on Ctrl-C
    get_tokenizer()


PARALLELISMS = ("threads", "processes")


def check_parallelism(parallelism):
    """ConfigError unless --parallelism is threads or processes."""
    if parallelism not in PARALLELISMS:
        raise ConfigError(f"--parallelism {parallelism!r}: use threads or processes",
                          hint="threads (the default) tokenizes GIL-free with tiktoken")


def tokenize_chunks(docs, workers=1, parallelism="threads"):
    """Yield (tokens, lengths) per chunk of documents, in input order: `tokens` is the uint16
    concatenation of [EOT] + encode_ordinary(doc) for the chunk's docs, `lengths` their sizes.
    Working per chunk, not per document, keeps the single-threaded consumer cheap."""
    check_parallelism(parallelism)  # now, not at the generator's first step
    return _tokenize_chunks(docs, max(1, int(workers or 1)), parallelism)


def _tokenize_chunks(docs, workers, parallelism):
    if workers == 1:
        for chunk in _chunks(docs):
            yield _encode_docs(chunk)
    elif parallelism == "threads":
        get_tokenizer()  # build once before the threads race for it
        with ThreadPoolExecutor(workers) as ex:
            window = deque()
            for chunk in _chunks(docs):
                window.append(ex.submit(_encode_docs, chunk))
                if len(window) >= 2 * workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
    else:
        import multiprocessing as mp

        # spawn: safe whatever threads the parent runs; each worker builds its own tokenizer
        with mp.get_context("spawn").Pool(workers, initializer=_warm_worker) as pool:
            yield from pool.imap(_encode_docs, _chunks(docs))


class ShardWriter:
    """Accumulate documents' tokens into fixed-size shards named llm.c's way.

    name_fn(split, index) -> file name, e.g. lambda s, i: f"fineweb_{s}_{i:06d}.bin".
    val_tokens: capacity of shard 0 (the val shard); None means shard_size, as in fineweb.py.
    max_shards: stop after writing that many shards (None: all).
    """

    def __init__(self, out_dir, name_fn, shard_size, val_tokens=None, max_shards=None, kind="gpt2"):
        check_shard_size(shard_size)
        if val_tokens is not None and not 0 < val_tokens <= MAX_SHARD_SIZE:
            raise ConfigError(f"--val-tokens {val_tokens}: must be in 1..2^31-1",
                              hint="pass a count in 1..2147483647 (llm.c's header stores it as int32)")
        self.out_dir = os.fspath(out_dir)
        self.name_fn = name_fn
        self.shard_size = int(shard_size)
        self.val_tokens = val_tokens
        self.kind = kind
        self.max_shards = max_shards
        self.full = False
        self.index = 0
        self.count = 0
        self.buf = np.empty(self._capacity(), dtype=np.uint16)
        self.written = []
        self.total_tokens = 0
        self.n_docs = 0

    def _capacity(self):
        if self.index == 0 and self.val_tokens is not None:
            return int(self.val_tokens)
        return self.shard_size

    def _flush(self):
        from llmctl.formats import write_datafile
        from llmctl.interrupt import held

        split = "val" if self.index == 0 else "train"
        path = os.path.join(self.out_dir, self.name_fn(split, self.index))
        with held():  # a Ctrl-C after the rename must still find the shard in `written`
            write_datafile(path, self.buf[:self.count], kind=self.kind)
            self.written.append({"path": path, "split": split, "tokens": int(self.count)})
        self.index += 1
        self.count = 0
        cap = self._capacity()
        if len(self.buf) != cap:
            self.buf = np.empty(cap, dtype=np.uint16)

    def add(self, tokens, n_docs=1):
        """Append tokens: one document (starting with EOT) or several concatenated.
        Returns False once `max_shards` shards are written (the rest is dropped)."""
        tokens = np.asarray(tokens, dtype=np.uint16)
        if self.full:
            return False
        self.n_docs += n_docs
        self.total_tokens += len(tokens)
        while self.count + len(tokens) >= len(self.buf):  # llm.c: append only if strictly below
            head = len(self.buf) - self.count
            self.buf[self.count:] = tokens[:head]
            self.count = len(self.buf)
            self._flush()
            tokens = tokens[head:]
            if self.max_shards is not None and len(self.written) >= self.max_shards:
                self.full = True
                self.count = 0
                return False
        self.buf[self.count:self.count + len(tokens)] = tokens
        self.count += len(tokens)
        return True

    def close(self):
        """Write the final partial shard (if any); return the list of written shards."""
        if self.count and not self.full:
            self._flush()
        return self.written


class Progress:
    """A rich progress line on stderr: documents, tokens, tokens/s. Disabled -> does nothing."""

    def __init__(self, description, enabled):
        self.enabled = enabled
        self.docs = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self._progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress as RichProgress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = RichProgress(
                SpinnerColumn(), TextColumn("{task.description}"),
                TextColumn("{task.fields[docs]:,} docs"), TextColumn("{task.fields[tokens]:,} tokens"),
                TextColumn("{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False)
            self._task = self._progress.add_task(description, total=None, docs=0, tokens=0, rate=0.0)

    def __enter__(self):
        if self._progress:
            self._progress.start()
        return self

    def update(self, n_docs, n_tokens):
        self.docs += n_docs
        self.tokens += n_tokens
        if self._progress:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self._progress.update(self._task, docs=self.docs, tokens=self.tokens, rate=rate)

    def __exit__(self, *exc):
        if self._progress:
            self._progress.stop()
        return False

    @property
    def seconds(self):
        return time.perf_counter() - self.t0


def write_sharded(docs, out_dir, name_fn, shard_size, val_tokens=None, workers=1,
                  parallelism="threads", progress=False, description="tokenizing", max_shards=None):
    """Tokenize `docs` (iterable of str) in parallel and write llm.c shards; return a summary.
    max_shards: stop once that many full shards are written (the partial rest is dropped)."""
    writer = ShardWriter(out_dir, name_fn, shard_size, val_tokens=val_tokens, max_shards=max_shards)
    chunks = tokenize_chunks(docs, workers=workers, parallelism=parallelism)
    created = missing_dirs(out_dir)
    make_out_dir(out_dir)
    try:
        with Progress(description, progress) as prog:
            for flat, lengths in chunks:
                if not writer.add(flat, n_docs=len(lengths)):
                    break
                prog.update(len(lengths), len(flat))
            shards = writer.close()
            seconds = prog.seconds
        if not shards:
            raise DataError("no documents: nothing to write", hint="check the input is non-empty text")
    except KeyboardInterrupt:
        remove_empty(created)
        raise ShardsInterrupted(_kept_shards(writer.written)) from None
    except BaseException:
        remove_empty(created)
        raise
    return {"out_dir": os.fspath(out_dir), "documents": writer.n_docs, "tokens": writer.total_tokens,
            "shards": shards, "seconds": round(seconds, 3),
            "tokens_per_s": round(writer.total_tokens / max(seconds, 1e-9))}
