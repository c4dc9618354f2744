"""Every llm.c binary file format in one place: read, write, validate.

What it is: readers and writers for the files karpathy/llm.c reads and writes (spec:
llm.c's `dev/data/data_common.py`, `train_gpt2.py`, `train_gpt2.cu`), byte for byte where llm.c defines the bytes:
  token shards     magic 20240520 v1 uint16 / llama-3 20240801 v7 uint32  (dev/data/data_common.py write_datafile,
                                                                           llmc/dataloader.h)
  eval files       magic 20240522 v1                                       (data_common.write_evalfile, EvalLoader)
  checkpoints      magic 20240326 v3 fp32 / v5 bf16                         (train_gpt2.py write_model, gpt2_build_from_checkpoint)
  tokenizer files  magic 20240328 v1 / v2                                   (train_gpt2.py write_tokenizer, llmc/tokenizer.h)
  state files      magic 20240527 v1                                        (train_gpt2.cu save_state / load_state)
  debug state      magic 20240327 v2 (header only)                          (train_gpt2.py write_state, test_gpt2.c)

What it is not: no model math, no dataloader policy, no tokenization. Readers never load a large
payload into RAM: token, parameter and optimizer payloads come back as read-only numpy.memmap.

Every header is 256 little-endian int32 (1024 bytes). Readers check the magic, the version, every
size field, and that the file length is exactly what the header implies; any problem raises
FormatError("<path>: <problem>", hint). Headers are parsed with Python ints, so negative or huge
fields can never overflow a size computation. Writers go to a temp file in the same directory and
os.replace it into place, so an interrupted write never leaves a valid-looking partial file.
"""
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from llmctl.atomic import atomic_open
from llmctl.constants import GPT2_EOT, GPT2_VOCAB_SIZE
from llmctl.errors import DataError, FormatError
from llmctl.model.config import GPT2Config, num_parameters, param_shapes

HEADER_INTS = 256
HEADER_BYTES = 1024

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_MAGIC_LLAMA3 = 20240801
SHARD_VERSION_LLAMA3 = 7
EVAL_MAGIC = 20240522
EVAL_VERSION = 1
MODEL_MAGIC = 20240326
MODEL_MAGIC_LLAMA3 = 20240803  # recognised only to say it is unsupported
TOKENIZER_MAGIC = 20240328
STATE_MAGIC = 20240527
STATE_VERSION = 1
DEBUG_STATE_MAGIC = 20240327

EVAL_DELIMITER = 65535          # START_EXAMPLE; token ids must be < 65535
EVAL_NUM_COMPLETIONS = 4
MT19937_STATE_BYTES = 2520      # sizeof(mt19937_state) on x86-64 (llmc/rand.h)
MT19937_MATRIX_A = (0x0, 0x9908B0DF)

KIND_NAMES = {
    SHARD_MAGIC: "shard",
    SHARD_MAGIC_LLAMA3: "shard-llama3",
    EVAL_MAGIC: "eval",
    MODEL_MAGIC: "checkpoint",
    TOKENIZER_MAGIC: "tokenizer",
    STATE_MAGIC: "state",
    DEBUG_STATE_MAGIC: "debug-state",
}

# ---------------------------------------------------------------------------------------------
# low-level helpers


def _fail(path, problem, hint=None):
    """Raise FormatError('<path>: <problem>'); the bare problem is kept on the exception. Without
    a hint of its own the error says how to re-create or identify the file (_DAMAGED_HINT)."""
    err = FormatError(f"{path}: {problem}", hint or _DAMAGED_HINT)
    err.path = str(path)
    err.problem = problem
    raise err


_DAMAGED_HINT = "re-create it (`llmctl prepro ...`, `llmctl train -o`, llm.c); `llmctl inspect-bin FILE` says what a file is"

_KIND_TEXT = {"shard": "a GPT-2 token shard", "shard-llama3": "a llama-3 token shard", "eval": "an eval file",
              "checkpoint": "a model checkpoint", "tokenizer": "a tokenizer file",
              "state": "an optimizer state file (the model is the model_*.bin next to it)",
              "debug-state": "a debug state file"}


def _wrong_kind_hint(magic, wanted):
    """Hint for a bad magic: what the file is instead (llm.c kinds), and what was wanted."""
    kind = KIND_NAMES.get(magic)
    if kind is None:
        return f"not an llm.c file; pass {wanted}"
    return f"this is {_KIND_TEXT[kind]}; pass {wanted}"


def _n(x):
    return f"{x:,}"


def _file_size(path):
    """Size of a regular file, or FormatError saying why it cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _fail(path, "no such file", "check the path (and quote globs so the shell leaves them alone)")
    except OSError as e:
        _fail(path, f"cannot stat file: {e.strerror or e}")
    if stat.S_ISDIR(st.st_mode):
        _fail(path, "is a directory, not a file", "pass a file in it, or a quoted glob such as 'DIR/*.bin'")
    if not stat.S_ISREG(st.st_mode):
        _fail(path, "is not a regular file")
    return st.st_size


def _read_bytes(path, offset, count):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(count)
    except OSError as e:
        _fail(path, f"cannot read file: {e.strerror or e}")


def _read_header(path, what):
    """(header int32[256] as a list of Python ints, raw 1024 bytes, file size)."""
    size = _file_size(path)
    if size == 0:
        _fail(path, f"file is empty (0 bytes); expected a {what}", _DAMAGED_HINT)
    if size < HEADER_BYTES:
        _fail(path, f"file is {_n(size)} bytes, shorter than the {_n(HEADER_BYTES)}-byte header of a {what}: "
                    "truncated or not an llm.c file?", _DAMAGED_HINT)
    raw = _read_bytes(path, 0, HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        _fail(path, f"could read only {_n(len(raw))} of the {_n(HEADER_BYTES)} header bytes")
    return list(struct.unpack("<256i", raw)), raw, size


def _memmap(path, dtype, offset, count):
    if count == 0:
        return np.zeros(0, dtype=dtype)
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    except (OSError, ValueError) as e:
        _fail(path, f"cannot map {_n(count)} values at byte {_n(offset)}: {e}")


def _header(*values):
    """A 1024-byte header: int32 values in slots 0.., zeros elsewhere."""
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[: len(values)] = values
    return h.tobytes()


def _write_array(f, a, dtype):
    """Write a 1-D array as `dtype` (little-endian) in chunks, without a full-size temp copy."""
    a = np.asarray(a).reshape(-1)
    step = 1 << 22
    for i in range(0, a.size, step):
        f.write(memoryview(np.ascontiguousarray(a[i:i + step], dtype=dtype)))  # no copy if already dtype


def identify(path):
    """The kind of llm.c file at `path`, from its magic: 'shard', 'shard-llama3', 'eval',
    'checkpoint', 'tokenizer', 'state' or 'debug-state'. Raises FormatError otherwise."""
    size = _file_size(path)
    if size < 4:
        _fail(path, f"file is {_n(size)} bytes, too short to hold a magic number (llm.c files start "
                    f"with a {_n(HEADER_BYTES)}-byte header)", _DAMAGED_HINT)
    (magic,) = struct.unpack("<i", _read_bytes(path, 0, 4))
    if magic in KIND_NAMES:
        return KIND_NAMES[magic]
    if magic == MODEL_MAGIC_LLAMA3:
        _fail(path, f"llama-3 checkpoint (magic {MODEL_MAGIC_LLAMA3}) is not supported")
    _fail(path, f"unknown magic {magic} (0x{magic & 0xFFFFFFFF:08x}): not an llm.c file",
          "llm.c files start with a dated magic such as 20240520 (token shard) or 20240326 (checkpoint)")


# ---------------------------------------------------------------------------------------------
# 1.1 token shards


@dataclass
class ShardHeader:
    magic: int
    version: int
    num_tokens: int
    dtype: type  # np.uint16 (GPT-2) or np.uint32 (llama-3)
    path: str

    @property
    def kind(self):
        return "shard" if self.magic == SHARD_MAGIC else "shard-llama3"

    @property
    def itemsize(self):
        return np.dtype(self.dtype).itemsize


_SHARD_KINDS = {"gpt2": (SHARD_MAGIC, SHARD_VERSION, "<u2"), "gpt-2": (SHARD_MAGIC, SHARD_VERSION, "<u2"),
                "llama3": (SHARD_MAGIC_LLAMA3, SHARD_VERSION_LLAMA3, "<u4"),
                "llama-3": (SHARD_MAGIC_LLAMA3, SHARD_VERSION_LLAMA3, "<u4")}


def write_datafile(path, tokens, kind="gpt2"):
    """Write a token shard exactly as llm.c's data_common.write_datafile does (atomic).

    kind "gpt2": magic 20240520 v1, uint16 tokens; "llama3": magic 20240801 v7, uint32 tokens.
    """
    if kind not in _SHARD_KINDS:
        raise ValueError(f"kind must be 'gpt2' or 'llama3', not {kind!r}")
    magic, version, dt = _SHARD_KINDS[kind]
    a = np.asarray(tokens)
    if a.ndim != 1:
        a = a.reshape(-1)
    n = int(a.size)
    if n == 0:
        raise DataError(f"{path}: refusing to write a shard with 0 tokens (llm.c's reader asserts N > 0)")
    if n >= 2**31:
        raise DataError(f"{path}: {_n(n)} tokens is too many for one shard (must be < 2^31)")
    if a.dtype != np.dtype(dt):
        hi = 2**16 if dt == "<u2" else 2**32
        if a.dtype.kind not in "iu":
            raise DataError(f"{path}: tokens must be integers, got dtype {a.dtype}")
        lo_v, hi_v = int(a.min()), int(a.max())
        if lo_v < 0 or hi_v >= hi:
            raise DataError(f"{path}: token ids must be in [0, {_n(hi)}) for a {kind} shard, "
                            f"found {lo_v if lo_v < 0 else hi_v}")
    with atomic_open(path) as f:
        f.write(_header(magic, version, n))
        _write_array(f, a, dt)


def read_shard_header(path):
    """Validated ShardHeader of a token shard (magic/version/0 < N < 2^31/exact file size)."""
    h, _, size = _read_header(path, "token shard")
    magic, version, n = h[0], h[1], h[2]
    if magic == SHARD_MAGIC:
        want_version, dtype, what = SHARD_VERSION, np.uint16, "GPT-2 (uint16)"
    elif magic == SHARD_MAGIC_LLAMA3:
        want_version, dtype, what = SHARD_VERSION_LLAMA3, np.uint32, "llama-3 (uint32)"
    else:
        _fail(path, f"bad magic {magic}: not a token shard (expected {SHARD_MAGIC} or {SHARD_MAGIC_LLAMA3})",
              "token shards are written by `llmctl prepro` or llm.c's dev/data/*.py")
    if version != want_version:
        _fail(path, f"unsupported version {version} for a {what} token shard with magic {magic} "
                    f"(expected {want_version})")
    if n <= 0:
        _fail(path, f"header says {_n(n)} tokens; a shard needs at least 1 (llm.c asserts N > 0)")
    itemsize = np.dtype(dtype).itemsize
    want = n * itemsize
    got = size - HEADER_BYTES
    if got != want:
        why = "file truncated?" if got < want else "trailing bytes or wrong token count in header?"
        _fail(path, f"expected {_n(want)} bytes of tokens, found {_n(got)}: {why}",
              f"header says {_n(n)} tokens x {itemsize} bytes; re-create the shard")
    return ShardHeader(magic=magic, version=version, num_tokens=n, dtype=dtype, path=str(path))


def open_shard(path):
    """Read-only memmap of a validated shard's N tokens (uint16 or uint32)."""
    hdr = read_shard_header(path)
    return _memmap(path, np.dtype(hdr.dtype).newbyteorder("<"), HEADER_BYTES, hdr.num_tokens)


# ---------------------------------------------------------------------------------------------
# 1.2 multiple-choice eval files


@dataclass
class EvalExample:
    index: int
    label: int
    context: np.ndarray          # uint16 token ids
    endings: List[np.ndarray]    # exactly 4 uint16 arrays

    @property
    def nbytes(self):
        """EXAMPLE_BYTES as stored: 2 bytes x (5 fields + 1 + n_ctx + sum(1 + n_i))."""
        return 2 * (6 + len(self.context) + sum(1 + len(e) for e in self.endings))


@dataclass
class EvalHeader:
    num_examples: int
    longest_example_bytes: int
    path: str


def _eval_fields(ex):
    if isinstance(ex, EvalExample):
        return ex.label, list(ex.context), [list(e) for e in ex.endings]
    return ex["label"], list(ex["ctx_tokens"]), [list(e) for e in ex["ending_tokens"]]


def write_evalfile(path, examples):
    """Write a multiple-choice eval file exactly as data_common.write_evalfile (atomic).

    examples: dicts with label, ctx_tokens, ending_tokens (exactly 4 lists), or EvalExample.
    header[3] = the longest example in bytes.
    """
    stream = []
    longest = 0
    count = 0
    for idx, ex in enumerate(examples):
        label, ctx, endings = _eval_fields(ex)
        if len(endings) != EVAL_NUM_COMPLETIONS:
            raise DataError(f"{path}: example {idx} has {len(endings)} endings, expected exactly 4")
        if not 0 <= int(label) < EVAL_NUM_COMPLETIONS:
            raise DataError(f"{path}: example {idx} has label {label}, expected 0..3")
        if len(ctx) == 0 or any(len(e) == 0 for e in endings):
            raise DataError(f"{path}: example {idx} has an empty context or ending "
                            "(llm.c's EvalLoader asserts every length is > 0)")
        for toks in [ctx] + endings:
            for t in toks:
                if not 0 <= int(t) < EVAL_DELIMITER:
                    raise DataError(f"{path}: example {idx} has token id {t}; ids must be in [0, 65535)")
        ex_stream = [EVAL_DELIMITER, 0, idx, int(label), len(endings), len(ctx)]
        ex_stream.extend(int(t) for t in ctx)
        for e in endings:
            ex_stream.append(len(e))
            ex_stream.extend(int(t) for t in e)
        nbytes = 2 * len(ex_stream)
        if nbytes >= 2**16:
            raise DataError(f"{path}: example {idx} is {_n(nbytes)} bytes; must be < 65,536")
        ex_stream[1] = nbytes
        longest = max(longest, nbytes)
        stream.extend(ex_stream)
        count += 1
        if count >= 2**16:
            raise DataError(f"{path}: more than 65,535 examples; an eval file holds < 65,536")
    if count == 0:
        raise DataError(f"{path}: no examples to write")
    with atomic_open(path) as f:
        f.write(_header(EVAL_MAGIC, EVAL_VERSION, count, longest))
        f.write(np.asarray(stream, dtype="<u2").tobytes())


def read_eval_header(path):
    """Validated header fields of an eval file (no payload walk; read_evalfile does that)."""
    h, _, size = _read_header(path, "eval file")
    if h[0] != EVAL_MAGIC:
        _fail(path, f"bad magic {h[0]}: not an eval file (expected {EVAL_MAGIC})",
              _wrong_kind_hint(h[0], "an eval file such as data/hellaswag_val.bin (`llmctl prepro hellaswag`)"))
    if h[1] != EVAL_VERSION:
        _fail(path, f"unsupported eval file version {h[1]} (expected {EVAL_VERSION})")
    n, longest = h[2], h[3]
    if not 0 < n < 2**16:
        _fail(path, f"header says {_n(n)} examples; must be 1..65,535")
    if not 0 < longest < 2**16:
        _fail(path, f"header says the longest example is {_n(longest)} bytes; must be 1..65,535")
    payload = size - HEADER_BYTES
    if payload % 2:
        _fail(path, f"payload is {_n(payload)} bytes, not a whole number of uint16: file truncated?")
    min_bytes = n * 2 * 15  # 6 fixed fields + 1 context token + 4 x (length + 1 token), the smallest example
    if payload < min_bytes:
        _fail(path, f"payload is {_n(payload)} bytes, too small for {_n(n)} examples "
                    f"(at least {_n(min_bytes)}): file truncated?")
    return EvalHeader(num_examples=n, longest_example_bytes=longest, path=str(path))


def read_evalfile(path):
    """All examples of an eval file, with full structural validation.

    Checks per example: START delimiter, EXAMPLE_BYTES matches the fields and fits the file,
    EXAMPLE_INDEX equals the running index, label < 4, exactly 4 completions, every length > 0,
    no token id 65535; and that the header's example count and longest-example bytes are exact
    and nothing trails the last example. FormatError names the file and the example index.
    """
    hdr = read_eval_header(path)
    count = (_file_size(path) - HEADER_BYTES) // 2
    data = np.array(_memmap(path, "<u2", HEADER_BYTES, count))
    vals = data.tolist()
    out = []
    pos = 0
    longest = 0
    for idx in range(hdr.num_examples):
        example, end, nbytes = _read_example(path, data, vals, pos, count, idx, hdr.num_examples)
        longest = max(longest, nbytes)
        out.append(example)
        pos = end
    if pos != count:
        _fail(path, f"{_n(2 * (count - pos))} trailing bytes after the {_n(hdr.num_examples)} examples "
                    "the header announces")
    if longest != hdr.longest_example_bytes:
        _fail(path, f"header says the longest example is {_n(hdr.longest_example_bytes)} bytes, "
                    f"but it is {_n(longest)}")
    return out


def _read_example(path, data, vals, pos, count, idx, num_examples):
    """Example `idx`, starting at u16 index `pos` of `count`; -> (EvalExample, its end, its bytes)."""
    where = f"example {idx} (byte {_n(HEADER_BYTES + 2 * pos)})"
    if pos + 6 > count:
        _fail(path, f"{where}: file ends inside the example header; header says {_n(num_examples)} "
                    f"examples but only {idx} fit: file truncated?")
    delim, nbytes, index, label, ncomp, nctx = vals[pos:pos + 6]
    if delim != EVAL_DELIMITER:
        _fail(path, f"{where}: expected START_EXAMPLE delimiter 65535, found {delim}")
    if nbytes % 2 or nbytes < 2 * 6:
        _fail(path, f"{where}: EXAMPLE_BYTES is {nbytes}, not a valid example size")
    end = pos + nbytes // 2
    if end > count:
        _fail(path, f"{where}: example is {_n(nbytes)} bytes but only {_n(2 * (count - pos))} remain: "
                    "file truncated?")
    if index != idx:
        _fail(path, f"{where}: EXAMPLE_INDEX is {index}, expected the running index {idx}")
    if label >= EVAL_NUM_COMPLETIONS:
        _fail(path, f"{where}: label is {label}, expected 0..3")
    if ncomp != EVAL_NUM_COMPLETIONS:
        _fail(path, f"{where}: NUM_COMPLETIONS is {ncomp}, expected 4")
    if nctx == 0:
        _fail(path, f"{where}: context is empty (llm.c's EvalLoader asserts n_ctx > 0)")
    p = pos + 6
    if p + nctx > end:
        _fail(path, f"{where}: context length {nctx} runs past the example's {_n(nbytes)} bytes")
    ctx = data[p:p + nctx]
    p += nctx
    endings = []
    for c in range(EVAL_NUM_COMPLETIONS):
        if p >= end:
            _fail(path, f"{where}: completion {c} starts past the example's {_n(nbytes)} bytes")
        nc = vals[p]
        if nc == 0:
            _fail(path, f"{where}: completion {c} is empty (llm.c's EvalLoader asserts each length > 0)")
        if p + 1 + nc > end:
            _fail(path, f"{where}: completion {c} length {nc} runs past the example's {_n(nbytes)} bytes")
        endings.append(data[p + 1:p + 1 + nc])
        p += 1 + nc
    if p != end:
        _fail(path, f"{where}: EXAMPLE_BYTES is {_n(nbytes)} but the fields take {_n(2 * (p - pos))}")
    body = data[pos + 6:end]
    if body.size and int(body.max()) == EVAL_DELIMITER:
        _fail(path, f"{where}: token id 65535 (the delimiter) inside the example")
    return EvalExample(index=idx, label=label, context=ctx, endings=endings), end, nbytes


# ---------------------------------------------------------------------------------------------
# 1.3 model checkpoints

CHECKPOINT_VERSIONS = {3: "float32", 5: "bfloat16"}


def checkpoint_param_shapes(maxT, V, L, NH, C, Vp):
    """The 16 tensors of a GPT-2 checkpoint, in file order: list of (name, shape)
    (llmctl.model.config's table, the only one)."""
    return param_shapes(GPT2Config(maxT, V, Vp, L, NH, C))


def checkpoint_num_params(maxT, V, L, NH, C, Vp):
    """Vp*C + maxT*C + L*(12C^2 + 13C) + 2C (V and NH do not change the count)."""
    return num_parameters(GPT2Config(maxT, V, Vp, L, NH, C))


@dataclass
class CheckpointHeader:
    version: int
    max_seq_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    channels: int
    padded_vocab_size: int

    @property
    def dtype(self):
        """'float32' (v3) or 'bfloat16' (v5)."""
        return CHECKPOINT_VERSIONS[self.version]

    @property
    def itemsize(self):
        return 4 if self.version == 3 else 2

    @property
    def num_params(self):
        return checkpoint_num_params(self.max_seq_len, self.vocab_size, self.num_layers, self.num_heads,
                                     self.channels, self.padded_vocab_size)

    @property
    def file_bytes(self):
        return HEADER_BYTES + self.itemsize * self.num_params

    def config(self):
        """The model's GPT2Config (llmctl/model/config.py), from this header alone."""
        return GPT2Config(self.max_seq_len, self.vocab_size, self.padded_vocab_size,
                          self.num_layers, self.num_heads, self.channels)

    def param_shapes(self):
        return checkpoint_param_shapes(self.max_seq_len, self.vocab_size, self.num_layers, self.num_heads,
                                       self.channels, self.padded_vocab_size)

    def to_bytes(self):
        return _header(MODEL_MAGIC, self.version, self.max_seq_len, self.vocab_size, self.num_layers,
                       self.num_heads, self.channels, self.padded_vocab_size)


_CONFIG_ALIASES = {
    "max_seq_len": ("max_seq_len", "maxT", "block_size", "n_positions"),
    "vocab_size": ("vocab_size", "V"),
    "num_layers": ("num_layers", "L", "n_layer"),
    "num_heads": ("num_heads", "NH", "n_head"),
    "channels": ("channels", "C", "n_embd"),
    "padded_vocab_size": ("padded_vocab_size", "Vp"),
}


def _config_get(cfg, name):
    for key in _CONFIG_ALIASES[name]:
        if isinstance(cfg, dict):
            if key in cfg:
                return int(cfg[key])
        elif hasattr(cfg, key):
            return int(getattr(cfg, key))
    return None


def _as_checkpoint_header(cfg, version):
    vals = {k: _config_get(cfg, k) for k in _CONFIG_ALIASES}
    missing = [k for k in ("max_seq_len", "vocab_size", "num_layers", "num_heads", "channels") if vals[k] is None]
    if missing:
        raise ValueError(f"checkpoint config is missing {', '.join(missing)}")
    if vals["padded_vocab_size"] is None:  # train_gpt2.py pads V up to a multiple of 128
        vals["padded_vocab_size"] = (vals["vocab_size"] + 127) // 128 * 128
    return CheckpointHeader(version=version, **vals)


def _validate_checkpoint_header(path, h, size):
    if h[0] != MODEL_MAGIC:
        if h[0] == MODEL_MAGIC_LLAMA3:
            _fail(path, f"llama-3 checkpoint (magic {MODEL_MAGIC_LLAMA3}) is not supported")
        _fail(path, f"bad magic {h[0]}: not a GPT-2 checkpoint (expected {MODEL_MAGIC})",
              _wrong_kind_hint(h[0], "an llm.c GPT-2 checkpoint (model_*.bin, gpt2_124M.bin)"))
    version = h[1]
    if version in (1, 2):
        _fail(path, f"checkpoint version {version} (unpadded vocab) is no longer supported",
              "re-run llm.c's train_gpt2.py to export a version 3 (fp32) or 5 (bf16) checkpoint")
    if version not in CHECKPOINT_VERSIONS:
        _fail(path, f"unsupported checkpoint version {version} (expected 3 = fp32 or 5 = bf16)")
    hdr = CheckpointHeader(version, *h[2:8])
    names = [("maxT", hdr.max_seq_len), ("V", hdr.vocab_size), ("L", hdr.num_layers), ("NH", hdr.num_heads),
             ("C", hdr.channels), ("Vp", hdr.padded_vocab_size)]
    for name, v in names:
        if v <= 0:
            _fail(path, f"header field {name} = {_n(v)}; must be positive")
    if hdr.padded_vocab_size < hdr.vocab_size:
        _fail(path, f"padded vocab Vp = {_n(hdr.padded_vocab_size)} is smaller than V = {_n(hdr.vocab_size)}")
    if hdr.channels % hdr.num_heads:
        _fail(path, f"C = {_n(hdr.channels)} is not divisible by NH = {_n(hdr.num_heads)}")
    want = hdr.file_bytes
    if size != want:
        why = "file truncated?" if size < want else "trailing bytes or wrong config in header?"
        _fail(path, f"expected {_n(want)} bytes ({_n(hdr.num_params)} {hdr.dtype} parameters + header), "
                    f"found {_n(size)}: {why}", _DAMAGED_HINT)
    return hdr


def read_checkpoint_header(path):
    """Validated CheckpointHeader (the file size must match the config exactly)."""
    h, _, size = _read_header(path, "model checkpoint")
    return _validate_checkpoint_header(path, h, size)


def read_checkpoint(path):
    """(header, payload memmap): float32 for v3, uint16 raw bf16 bits for v5."""
    hdr = read_checkpoint_header(path)
    dt = "<f4" if hdr.version == 3 else "<u2"
    return hdr, _memmap(path, dt, HEADER_BYTES, hdr.num_params)


def read_checkpoint_params(path):
    """(header, float32 copy of all parameters); bf16 is expanded exactly (bits << 16)."""
    hdr, data = read_checkpoint(path)
    if hdr.version == 3:
        return hdr, np.array(data, dtype=np.float32)
    return hdr, bf16_bits_to_fp32(data)


def fp32_to_bf16_bits(a):
    """bfloat16 bits of float32 values, rounded to nearest even (PyTorch's rule; NaN -> 0x7FC0)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_fp32(b):
    """float32 values of bfloat16 bits (exact: bits << 16)."""
    b = np.ascontiguousarray(b, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_checkpoint(path, header_or_config, params, dtype="float32"):
    """Write a GPT-2 checkpoint (v3 fp32 or v5 bf16) as train_gpt2.py's write_model does (atomic).

    header_or_config: a CheckpointHeader, a dict, or any object with llm.c's GPT2Config names
    (max_seq_len, vocab_size, num_layers, num_heads, channels, padded_vocab_size) or the letters
    maxT, V, L, NH, C, Vp. params: the flat fp32 parameters in checkpoint order.
    """
    p = np.asarray(params).reshape(-1)
    hdr = _as_checkpoint_header(header_or_config, _checkpoint_version(dtype))
    if p.size != hdr.num_params:
        raise ValueError(f"params has {_n(p.size)} values but the config needs {_n(hdr.num_params)}")
    step = 1 << 22  # bf16 is converted a chunk at a time, not as a second copy of the model
    write_checkpoint_tensors(path, hdr, (p[i:i + step] for i in range(0, p.size, step)), dtype)


def _checkpoint_version(dtype):
    if dtype in ("float32", "fp32"):
        return 3
    if dtype in ("bfloat16", "bf16"):
        return 5
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")


def write_checkpoint_tensors(path, header_or_config, tensors, dtype="float32"):
    """write_checkpoint from an iterable of fp32 arrays that together are the flat parameters in
    checkpoint order (any split: a tensor, one layer of a tensor, ...), so a converter never holds
    the whole model twice. Atomic; the count must come out exactly at num_params."""
    version = _checkpoint_version(dtype)
    hdr = _as_checkpoint_header(header_or_config, version)
    written = 0
    with atomic_open(path) as f:
        f.write(hdr.to_bytes())
        for a in tensors:
            a = np.asarray(a).reshape(-1)
            written += a.size
            if written > hdr.num_params:
                raise ValueError(f"tensors hold more than the config's {_n(hdr.num_params)} parameters")
            if version == 3:
                _write_array(f, a, "<f4")
            else:
                f.write(fp32_to_bf16_bits(a).astype("<u2").tobytes())
        if written != hdr.num_params:
            raise ValueError(f"tensors hold {_n(written)} parameters, the config needs {_n(hdr.num_params)}")


# ---------------------------------------------------------------------------------------------
# 1.4 tokenizer files


@dataclass
class TokenizerFile:
    version: int
    vocab_size: int
    eot: int
    tokens: List[bytes]


def write_tokenizer_file(path, token_bytes, eot=GPT2_EOT, version=2):
    """Write a tokenizer file as train_gpt2.py's write_tokenizer (v2: with EOT; v1: without)."""
    if version not in (1, 2):
        raise ValueError(f"tokenizer version must be 1 or 2, not {version}")
    n = len(token_bytes)
    if version == 1 and n != GPT2_VOCAB_SIZE:
        raise ValueError(f"a version 1 tokenizer file must hold 50,257 tokens, not {_n(n)}")
    if version == 2 and not 0 <= eot < n:
        raise ValueError(f"eot {eot} is not a token id of a {_n(n)}-token vocabulary")
    for i, b in enumerate(token_bytes):
        if not 0 < len(b) < 256:
            raise DataError(f"{path}: token {i} is {len(b)} bytes; must be 1..255")
    with atomic_open(path) as f:
        f.write(_header(TOKENIZER_MAGIC, version, n, eot) if version == 2 else _header(TOKENIZER_MAGIC, 1, n))
        f.write(b"".join(bytes([len(b)]) + bytes(b) for b in token_bytes))


def read_tokenizer_file(path):
    """Validated tokenizer file: every length byte > 0 and the tokens end exactly at EOF."""
    _, raw, size = _read_header(path, "tokenizer file")
    h = struct.unpack("<256I", raw)  # llm.c reads this header as uint32
    if h[0] != TOKENIZER_MAGIC:
        _fail(path, f"bad magic {h[0]}: not a tokenizer file (expected {TOKENIZER_MAGIC})")
    version, n = h[1], h[2]
    if version == 1:
        if n != GPT2_VOCAB_SIZE:
            _fail(path, f"version 1 tokenizer has {_n(n)} tokens; llm.c requires 50,257")
        eot = GPT2_EOT
    elif version == 2:
        eot = h[3]
    else:
        _fail(path, f"unsupported tokenizer version {version} (expected 1 or 2)")
    if n == 0:
        _fail(path, "header says 0 tokens")
    if eot >= n:
        _fail(path, f"EOT id {_n(eot)} is outside the {_n(n)}-token vocabulary")
    payload = size - HEADER_BYTES
    if payload < 2 * n:
        _fail(path, f"{_n(payload)} payload bytes cannot hold {_n(n)} tokens (at least {_n(2 * n)}): "
                    "file truncated?")
    if payload > 256 * n:
        _fail(path, f"{_n(payload)} payload bytes is more than {_n(n)} tokens of <= 255 bytes can take")
    buf = _read_bytes(path, HEADER_BYTES, payload)
    tokens = []
    p = 0
    for i in range(n):
        if p >= len(buf):
            _fail(path, f"file ends before token {_n(i)} of {_n(n)}: file truncated?")
        ln = buf[p]
        if ln == 0:
            _fail(path, f"token {_n(i)} has length 0 (llm.c asserts every token length > 0)")
        if p + 1 + ln > len(buf):
            _fail(path, f"token {_n(i)} ({ln} bytes) runs past the end of the file: file truncated?")
        tokens.append(bytes(buf[p + 1:p + 1 + ln]))
        p += 1 + ln
    if p != len(buf):
        _fail(path, f"{_n(len(buf) - p)} trailing bytes after the {_n(n)} tokens")
    return TokenizerFile(version=version, vocab_size=n, eot=eot, tokens=tokens)


# ---------------------------------------------------------------------------------------------
# 1.5 optimizer / dataloader state files (train_gpt2.cu)


@dataclass
class StateFile:
    num_processes: int = 1
    process_rank: int = 0
    use_master_weights: bool = False
    should_shuffle: bool = False
    step: int = 0
    rng_state: int = 0               # uint64
    rng_state_last_update: int = 0   # uint64
    current_shard_idx: int = 0       # size_t
    current_sample_idx: int = 0      # size_t
    m: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    v: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    master: Optional[np.ndarray] = None
    shard_indices: Optional[np.ndarray] = None        # int32, num_shards
    intra_shard_indices: Optional[np.ndarray] = None  # int32, shard_num_samples
    mt_state: Optional[bytes] = None                  # raw mt19937_state, 2520 bytes

    @property
    def num_parameters(self):
        return int(np.asarray(self.m).size)


def _state_header_bytes(s):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = STATE_MAGIC, STATE_VERSION
    h[2], h[3] = s.num_processes, s.process_rank
    h[4], h[5] = int(bool(s.use_master_weights)), int(bool(s.should_shuffle))
    h[10] = s.step
    raw = bytearray(h.tobytes())
    struct.pack_into("<QQ", raw, 20 * 4, s.rng_state, s.rng_state_last_update)
    struct.pack_into("<QQ", raw, 30 * 4, s.current_shard_idx, s.current_sample_idx)
    return bytes(raw)


def write_state_file(path, state):
    """Write a train_gpt2.cu state file (`save_state`'s layout, atomic)."""
    s = state
    m = np.asarray(s.m).reshape(-1)
    v = np.asarray(s.v).reshape(-1)
    if m.size != v.size or m.size == 0:
        raise ValueError(f"m and v must be non-empty and the same size (got {_n(m.size)} and {_n(v.size)})")
    if bool(s.use_master_weights) != (s.master is not None):
        raise ValueError("master weights must be given exactly when use_master_weights is set")
    if s.master is not None and np.asarray(s.master).size != m.size:
        raise ValueError("master weights must have as many values as m")
    if s.should_shuffle:
        if s.shard_indices is None or s.intra_shard_indices is None or s.mt_state is None:
            raise ValueError("should_shuffle needs shard_indices, intra_shard_indices and mt_state")
        if len(s.mt_state) != MT19937_STATE_BYTES:
            raise ValueError(f"mt_state must be {MT19937_STATE_BYTES} bytes, not {len(s.mt_state)}")
    if not 0 <= s.process_rank < s.num_processes:
        raise ValueError(f"process_rank {s.process_rank} is not in [0, {s.num_processes})")
    with atomic_open(path) as f:
        f.write(_state_header_bytes(s))
        _write_array(f, m, "<f4")
        _write_array(f, v, "<f4")
        if s.use_master_weights:
            _write_array(f, s.master, "<f4")
        if s.should_shuffle:
            si = np.asarray(s.shard_indices).reshape(-1)
            ii = np.asarray(s.intra_shard_indices).reshape(-1)
            f.write(struct.pack("<Q", si.size))
            _write_array(f, si, "<i4")
            f.write(struct.pack("<Q", ii.size))
            _write_array(f, ii, "<i4")
            f.write(bytes(s.mt_state))


def _is_perm(a):
    """a holds each of 0..a.size-1 exactly once (an empty array does)."""
    n = a.size
    return n == 0 or (int(a.min()) == 0 and int(a.max()) == n - 1 and np.unique(a).size == n)


def _check_mt_state(path, blob):
    left, nxt = struct.unpack_from("<iI", blob, 8)
    mat = struct.unpack_from("<II", blob, MT19937_STATE_BYTES - 8)
    if mat != MT19937_MATRIX_A:
        _fail(path, f"mt19937 state has MATRIX_A = (0x{mat[0]:x}, 0x{mat[1]:x}), expected (0x0, 0x9908b0df): "
                    "corrupt shuffle RNG state")
    if not (1 <= left <= 625 and nxt <= 624):
        _fail(path, f"mt19937 state has left_ = {left}, next_ = {nxt}; expected 1..625 and 0..624")


def _find_counted_tail(u, end, lo):
    """Candidate n for a layout '... [n as uint64][n int32 values]' ending at u32 index `end`:
    yields (n, j) where u[j], u[j+1] hold n, scanning n = 0, 1, ... while j >= lo."""
    n = 0
    chunk = 1 << 16
    while True:
        # j = end - 2 - n for n in [n, n + chunk)
        ns = np.arange(n, n + chunk, dtype=np.int64)
        js = end - 2 - ns
        keep = js >= lo
        if not keep.any():
            return
        ns, js = ns[keep], js[keep]
        lo_words = np.asarray(u[js[-1]:js[0] + 2])  # contiguous slice covering all js, js+1
        base = js[-1]
        hit = (lo_words[js - base] == ns) & (lo_words[js - base + 1] == 0)
        for k in np.nonzero(hit)[0]:
            yield int(ns[k]), int(js[k])
        n += chunk


def read_state_file(path, num_parameters=None):
    """Validated state file. m, v (and master) come back as float32 memmaps; the shuffle
    indices as int32 arrays; mt_state as the raw 2520 bytes.

    num_parameters (the shard's parameter count) may be None: it is then inferred from the file
    size, which is unambiguous without shuffling; with shuffling the counted index arrays are
    located from the end of the file and must be exact permutations.
    """
    h, raw, size = _read_header(path, "state file")
    nproc, rank, master_flag, shuffle_flag, step = _check_state_header(path, h)
    rng, rng_last = struct.unpack_from("<QQ", raw, 20 * 4)
    shard_idx, sample_idx = struct.unpack_from("<QQ", raw, 30 * 4)
    k = 3 if master_flag else 2  # float arrays: m, v (, master)
    payload = size - HEADER_BYTES
    if payload % 4:
        _fail(path, f"payload is {_n(payload)} bytes, not a multiple of 4: file truncated?")
    shard_indices = intra = mt_state = None
    if not shuffle_flag:
        P = _unshuffled_parameters(path, payload, k, num_parameters)
    else:
        P, shard_indices, intra, mt_state = _shuffled_tail(path, size, payload, k, num_parameters)
    if P <= 0:
        _fail(path, "optimizer state holds 0 parameters")
    m = _memmap(path, "<f4", HEADER_BYTES, P)
    v = _memmap(path, "<f4", HEADER_BYTES + 4 * P, P)
    master = _memmap(path, "<f4", HEADER_BYTES + 8 * P, P) if master_flag else None
    return StateFile(num_processes=nproc, process_rank=rank, use_master_weights=bool(master_flag),
                     should_shuffle=bool(shuffle_flag), step=step, rng_state=rng, rng_state_last_update=rng_last,
                     current_shard_idx=shard_idx, current_sample_idx=sample_idx, m=m, v=v, master=master,
                     shard_indices=shard_indices, intra_shard_indices=intra, mt_state=mt_state)


def read_state_header(path):
    """The checked header of a state file, nothing past it: (num_processes, process_rank,
    use_master_weights, should_shuffle, step)."""
    return _check_state_header(path, _read_header(path, "state file")[0])


def _check_state_header(path, h):
    """The state header's fields that must hold; -> (nproc, rank, master, shuffle, step)."""
    if h[0] != STATE_MAGIC:
        _fail(path, f"bad magic {h[0]}: not a state file (expected {STATE_MAGIC})")
    if h[1] != STATE_VERSION:
        _fail(path, f"unsupported state file version {h[1]} (expected {STATE_VERSION})")
    nproc, rank, master_flag, shuffle_flag, step = h[2], h[3], h[4], h[5], h[10]
    if nproc <= 0:
        _fail(path, f"num_processes is {nproc}; must be >= 1")
    if not 0 <= rank < nproc:
        _fail(path, f"process_rank {rank} is not in [0, {nproc})")
    if master_flag not in (0, 1):
        _fail(path, f"use_master_weights is {master_flag}; must be 0 or 1")
    if shuffle_flag not in (0, 1):
        _fail(path, f"should_shuffle is {shuffle_flag}; must be 0 or 1")
    if step < 0:
        _fail(path, f"step is {step}; must be >= 0")
    return nproc, rank, master_flag, shuffle_flag, step


def _unshuffled_parameters(path, payload, k, num_parameters):
    """Without shuffling the payload is k float32 arrays only; -> their length P."""
    if num_parameters is None:
        if payload == 0 or payload % (4 * k):
            _fail(path, f"payload of {_n(payload)} bytes is not {k} equal float32 arrays (m, v"
                        f"{', master' if k == 3 else ''}): file truncated?")
        return payload // (4 * k)
    P = int(num_parameters)
    if 4 * k * P != payload:
        _fail(path, f"expected {_n(4 * k * P)} bytes of optimizer state for {_n(P)} parameters, "
                    f"found {_n(payload)}")
    return P


def _shuffled_tail(path, size, payload, k, num_parameters):
    """With shuffling, k float32 arrays of P, then the counted shard and sample index arrays and the
    mt19937 state; -> (P, shard_indices, intra_shard_indices, mt_state), all checked."""
    tail = MT19937_STATE_BYTES + 16  # two size_t counts + the RNG blob, at least
    if payload < tail:
        _fail(path, f"payload is {_n(payload)} bytes, too small for a shuffled dataloader state: file truncated?")
    u = _memmap(path, "<u4", HEADER_BYTES, (payload - MT19937_STATE_BYTES) // 4)
    end = u.size  # u32 index where the RNG blob starts
    if num_parameters is not None:
        P = int(num_parameters)
        ns, nsamp, j, js = _counted_tail(path, u, end, k * P, P, size, tail)
    else:
        P, ns, nsamp, j, js = _find_shuffled_tail(path, u, end, k)
    shard_indices = np.array(np.asarray(u[j + 2:j + 2 + ns]).view("<i4"), dtype=np.int32)
    intra = np.array(np.asarray(u[js + 2:end]).view("<i4"), dtype=np.int32)
    for what, a in (("shard_indices", shard_indices), ("intra_shard_indices", intra)):
        if not _is_perm(a):
            _fail(path, f"{what} ({_n(a.size)} values) is not a permutation of 0..{_n(a.size - 1)}")
    mt_state = _read_bytes(path, size - MT19937_STATE_BYTES, MT19937_STATE_BYTES)
    _check_mt_state(path, mt_state)
    return P, shard_indices, intra, mt_state


def _counted_tail(path, u, end, j, P, size, tail):
    """The index arrays' counts when the float arrays end at u32 index j; -> (ns, nsamp, j, js)."""
    min_size = HEADER_BYTES + 4 * j + tail
    if size < min_size:
        _fail(path, f"expected at least {_n(min_size)} bytes for {_n(P)} parameters and a shuffled "
                    f"dataloader state, found {_n(size)}: file truncated?")
    ns = int(u[j]) | (int(u[j + 1]) << 32)
    if ns == 0 or j + 2 + ns + 2 > end:
        _fail(path, f"shard count {_n(ns)} at byte {_n(HEADER_BYTES + 4 * j)} does not fit the file")
    js = j + 2 + ns
    nsamp = int(u[js]) | (int(u[js + 1]) << 32)
    if js + 2 + nsamp != end:
        _fail(path, f"expected {_n(4 * (js + 2 + nsamp) + MT19937_STATE_BYTES + HEADER_BYTES)} bytes for "
                    f"{_n(P)} parameters, {_n(ns)} shards and {_n(nsamp)} samples, found {_n(size)}")
    return ns, nsamp, j, js


def _find_shuffled_tail(path, u, end, k):
    """Without a parameter count: the one split, searched from the end, whose two counted arrays
    are permutations; -> (P, ns, nsamp, j, js)."""
    for nsamp, js in _find_counted_tail(u, end, 2):
        for ns, j in _find_counted_tail(u, js, 0):
            if ns == 0 or j % k or j == 0:
                continue
            si = np.asarray(u[j + 2:j + 2 + ns]).view(np.int32)
            ii = np.asarray(u[js + 2:end]).view(np.int32)
            if _is_perm(si) and _is_perm(ii):
                return j // k, ns, nsamp, j, js
    _fail(path, "cannot locate the shuffled dataloader state (shard and sample index arrays) "
                "in the file: truncated or corrupt?",
          "with the model_NNNNNNNN.bin of the same step beside it, `llmctl inspect-bin` says where a "
          "single-process run's state breaks; resume from an earlier step's checkpoint and state, or start over")


# ---------------------------------------------------------------------------------------------
# 1.6 debug state (header only: written by llm.c's train_gpt2.py, read by test_gpt2.c)


@dataclass
class DebugStateHeader:
    version: int
    B: int
    T: int
    num_params: Optional[int]  # inferred assuming V = 50,257 logits per position; None if it does not fit


def read_debug_state_header(path, V=GPT2_VOCAB_SIZE):
    """Header of a gpt2_124M_debug_state.bin: x, y int32[B*T]; logits fp32[B*T*V]; loss; grads."""
    h, _, size = _read_header(path, "debug state file")
    if h[0] != DEBUG_STATE_MAGIC:
        _fail(path, f"bad magic {h[0]}: not a debug state file (expected {DEBUG_STATE_MAGIC})")
    if h[1] != 2:
        _fail(path, f"unsupported debug state version {h[1]} (expected 2)")
    B, T = h[2], h[3]
    if B <= 0 or T <= 0:
        _fail(path, f"B = {B}, T = {T}; both must be positive")
    fixed = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 1)
    if size < fixed:
        _fail(path, f"expected at least {_n(fixed)} bytes for B={B}, T={T}, V={_n(V)}, found {_n(size)}: "
                    "file truncated?")
    rest = size - fixed
    return DebugStateHeader(version=h[1], B=B, T=T, num_params=rest // 4 if rest % 4 == 0 and rest else None)


def write_debug_state(path, x, y, logits, loss, grads):
    """Write a debug state file as llm.c's train_gpt2.py write_state (atomic): header (magic,
    version 2, B, T), x and y int32 (B,T), logits fp32 (B,T,V) unpadded, the mean loss fp32, then
    the gradients fp32 in checkpoint order with the padded wte rows (what test_gpt2.c reads)."""
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x and y must both be (B, T); got {x.shape} and {y.shape}")
    B, T = x.shape
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[:2] != (B, T):
        raise ValueError(f"logits must be (B, T, V) with B, T = {B}, {T}; got {logits.shape}")
    with atomic_open(path) as f:
        f.write(_header(DEBUG_STATE_MAGIC, 2, B, T))
        f.write(np.ascontiguousarray(x, dtype="<i4").tobytes())
        f.write(np.ascontiguousarray(y, dtype="<i4").tobytes())
        _write_array(f, logits, "<f4")
        f.write(np.float32(loss).astype("<f4").tobytes())
        _write_array(f, grads, "<f4")
