"""llmctl.formats and the tokens extension against independent references.

References: headers and payloads built here with struct.pack from llm.c's documented layouts
(llm.c's `data_common.py`, `train_gpt2.py`, `train_gpt2.cu`), llm.c's documented sizes (d6/d12 parameter counts, the
372,108-byte GPT-2 tokenizer file), bf16 rounding computed in float64 from its definition, and
NumPy for token statistics.
"""
import os
import struct

import numpy as np
import pytest
from errcheck import raises_error

from llmctl import formats as F
from llmctl import tokenizer as tkz  # part of the package: a broken import fails, never skips
from llmctl._ext.tokens import token_stats
from llmctl.errors import DataError, FormatError


def hdr(*vals):
    return struct.pack("<256i", *(list(vals) + [0] * (256 - len(vals))))


def write(path, data):
    path.write_bytes(data)
    return path


def expect_problem(fn, path, *facts):
    """fn() raises FormatError whose one-line message starts with `path`, states each of `facts`
    (the sizes, values and fields the reader found) and carries a hint."""
    with raises_error(FormatError, names=facts) as ei:
        fn()
    msg = str(ei.value)
    assert msg.startswith(f"{path}: "), msg
    assert "\n" not in msg
    return ei.value


# ---------------------------------------------------------------------------------------------
# token shards


def test_shard_gpt2_bytes_exact(tmp_path):
    toks = [50256, 5962, 22307, 25, 198, 8421, 356, 5120, 0, 65535]
    p = tmp_path / "s.bin"
    F.write_datafile(p, toks)
    assert p.read_bytes() == hdr(20240520, 1, len(toks)) + struct.pack(f"<{len(toks)}H", *toks)
    h = F.read_shard_header(p)
    assert (h.magic, h.version, h.num_tokens, h.dtype) == (20240520, 1, 10, np.uint16)
    m = F.open_shard(p)
    assert isinstance(m, np.memmap) and not m.flags.writeable
    assert m.tolist() == toks
    assert F.identify(p) == "shard"
    assert sorted(os.listdir(tmp_path)) == ["s.bin"]  # no temp file left behind


def test_shard_llama3_bytes_exact(tmp_path):
    toks = np.array([128000, 0, 2**32 - 1, 70000], dtype=np.int64)
    p = tmp_path / "l.bin"
    F.write_datafile(p, toks, kind="llama3")
    assert p.read_bytes() == hdr(20240801, 7, 4) + struct.pack("<4I", *toks.tolist())
    h = F.read_shard_header(p)
    assert (h.version, h.dtype, h.num_tokens) == (7, np.uint32, 4)
    assert F.open_shard(p).tolist() == toks.tolist()
    assert F.identify(p) == "shard-llama3"


def test_shard_writer_rejects_bad_tokens(tmp_path):
    # the writers are called by programs, not users: the value, no hint
    with raises_error(DataError, names=["70000", "65,536"], hint=None):
        F.write_datafile(tmp_path / "a.bin", [1, 70000])
    with raises_error(DataError, names="-1", hint=None):
        F.write_datafile(tmp_path / "a.bin", [-1, 3])
    with raises_error(DataError, names="0 tokens", hint=None):
        F.write_datafile(tmp_path / "a.bin", [])
    with pytest.raises(ValueError):
        F.write_datafile(tmp_path / "a.bin", [1], kind="gpt5")
    assert not os.listdir(tmp_path)


def test_shard_truncated_message_matches_spec(tmp_path):
    # tinyshakespeare train: 305,772 tokens would be 611,544 bytes; cut the payload to 611,000
    n = 611_544 // 2
    p = write(tmp_path / "train.bin", hdr(20240520, 1, n) + bytes(611_000))
    e = expect_problem(lambda: F.read_shard_header(p), p, "expected 611,544 bytes of tokens, found 611,000: file truncated?")
    assert e.problem == "expected 611,544 bytes of tokens, found 611,000: file truncated?"


@pytest.mark.parametrize("header,payload,fragment", [
    ((20240521, 1, 4), 8, "bad magic 20240521"),
    ((20240520, 2, 4), 8, "unsupported version 2"),
    ((20240801, 1, 4), 16, "unsupported version 1"),
    ((20240520, 1, 0), 0, "0 tokens"),
    ((20240520, 1, -5), 0, "-5 tokens"),
    ((20240520, 1, 2**31 - 1), 8, "expected 4,294,967,294 bytes of tokens, found 8"),
    ((20240520, 1, 4), 10, "found 10: trailing bytes"),
    ((20240801, 7, 4), 8, "expected 16 bytes"),
])
def test_shard_header_problems(tmp_path, header, payload, fragment):
    p = write(tmp_path / "x.bin", hdr(*header) + bytes(payload))
    expect_problem(lambda: F.read_shard_header(p), p, fragment)
    expect_problem(lambda: F.open_shard(p), p, fragment)


def test_short_missing_and_odd_files(tmp_path):
    missing = tmp_path / "missing.bin"
    expect_problem(lambda: F.read_shard_header(missing), missing, "no such file")
    expect_problem(lambda: F.identify(missing), missing, "no such file")
    expect_problem(lambda: F.read_shard_header(tmp_path), tmp_path, "is a directory")
    empty = write(tmp_path / "empty.bin", b"")
    expect_problem(lambda: F.read_shard_header(empty), empty, "empty (0 bytes)")
    three = write(tmp_path / "three.bin", b"abc")
    expect_problem(lambda: F.identify(three), three, "3 bytes")
    expect_problem(lambda: F.read_checkpoint(three), three, "3 bytes, shorter than the 1,024-byte header")
    short = write(tmp_path / "short.bin", struct.pack("<3i", 20240520, 1, 1))
    assert F.identify(short) == "shard"
    expect_problem(lambda: F.read_shard_header(short), short, "12 bytes, shorter than")
    rnd = write(tmp_path / "rnd.bin", b"\x12\x34\x56\x78" + bytes(2000))
    expect_problem(lambda: F.identify(rnd), rnd, "unknown magic 2018915346")
    ll = write(tmp_path / "llama.bin", hdr(20240803, 1) + bytes(8))
    expect_problem(lambda: F.identify(ll), ll, "llama-3 checkpoint")


def test_unusable_files_carry_a_hint(tmp_path):
    """Missing, directory, empty, short, truncated: each error has a Hint (the CLI prints it)."""
    empty = write(tmp_path / "empty.bin", b"")
    short = write(tmp_path / "short.bin", hdr(20240326, 3)[:100])
    cut = write(tmp_path / "cut.bin", hdr(20240326, 3, 32, 256, 2, 2, 32, 256) + bytes(400))
    cases = [(F.read_shard_header, tmp_path / "missing.bin", "check the path"),
             (F.read_shard_header, tmp_path, "'DIR/*.bin'"),
             (F.read_shard_header, empty, "re-create it"),
             (F.read_checkpoint_header, short, "re-create it"),
             (F.read_checkpoint_header, cut, "re-create it"),
             (F.identify, write(tmp_path / "two.bin", b"ab"), "re-create it")]
    for fn, path, frag in cases:
        err = expect_problem(lambda fn=fn, path=path: fn(path), path)
        assert err.hint and frag in err.hint, (path, err.hint)


def test_wrong_kind_hint_names_what_the_file_is(tmp_path):
    shard = write(tmp_path / "shard.bin", hdr(20240520, 1, 4) + bytes(8))
    state = write(tmp_path / "state.bin", hdr(20240527, 1) + bytes(64))
    err = expect_problem(lambda: F.read_checkpoint_header(shard), shard, "not a GPT-2 checkpoint")
    assert "this is a GPT-2 token shard" in err.hint
    err = expect_problem(lambda: F.read_checkpoint_header(state), state, "not a GPT-2 checkpoint")
    assert "optimizer state" in err.hint and "model_*.bin" in err.hint
    err = expect_problem(lambda: F.read_eval_header(shard), shard, "not an eval file")
    assert "this is a GPT-2 token shard" in err.hint and "prepro hellaswag" in err.hint
    junk = write(tmp_path / "junk.bin", hdr(12345) + bytes(8))
    assert "not an llm.c file" in expect_problem(lambda: F.read_eval_header(junk), junk).hint


def test_identify_every_kind(tmp_path):
    for magic, kind in [(20240520, "shard"), (20240801, "shard-llama3"), (20240522, "eval"),
                        (20240326, "checkpoint"), (20240328, "tokenizer"), (20240527, "state"),
                        (20240327, "debug-state")]:
        assert F.identify(write(tmp_path / f"{kind}.bin", hdr(magic))) == kind


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "s.bin"
    F.write_datafile(p, [1, 2, 3])
    before = p.read_bytes()

    def boom(f, a, dtype):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(F, "_write_array", boom)
    with pytest.raises(KeyboardInterrupt):
        F.write_datafile(p, [4, 5, 6, 7])
    assert p.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.bin"]


def test_atomic_write_onto_a_fifo_writes_into_it_instead_of_replacing_the_node(tmp_path):
    # the same path as /dev/null, /dev/stdout or /dev/full given to --out: renaming a temp file
    # onto it would replace the device node itself (as root, in /dev)
    import stat

    from llmctl.atomic import atomic_write

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open does not block
    try:
        atomic_write(fifo, b"tokens")
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert os.read(r, 100) == b"tokens"
    finally:
        os.close(r)
    assert os.listdir(tmp_path) == ["fifo"]


def test_a_full_disk_is_one_error_whose_hint_is_about_space_and_leaves_nothing(tmp_path):
    # RLIMIT_FSIZE: writes past 100 kB fail with EFBIG, as on a full disk (SIGXFSZ ignored); the
    # tokenizer file is 372,108 bytes
    import resource
    import signal
    import subprocess
    import sys

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    r = subprocess.run([sys.executable, "-m", "llmctl", "prepro", "tokenizer", "--out", "tok.bin"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == ["Error: tok.bin: cannot write file: File too large",
                                     "Hint: free some disk space (or write somewhere else) and run again; "
                                     "nothing half-written was left"]
    assert os.listdir(tmp_path) == []


def test_atomic_write_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    from llmctl.atomic import atomic_write

    (tmp_path / "real.bin").write_bytes(b"old")
    os.symlink("real.bin", tmp_path / "link.bin")
    atomic_write(tmp_path / "link.bin", b"new")
    assert os.path.islink(tmp_path / "link.bin") and (tmp_path / "real.bin").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["link.bin", "real.bin"]


# ---------------------------------------------------------------------------------------------
# eval files

EXAMPLES = [
    dict(label=2, ctx_tokens=[10, 11, 12], ending_tokens=[[1], [2, 3], [4], [5, 6, 7]]),
    dict(label=0, ctx_tokens=[65534], ending_tokens=[[8], [9], [0], [50256]]),
]


def hand_made_eval_bytes():
    # delimiter, EXAMPLE_BYTES, index, label, 4, n_ctx, ctx..., then (n_i, ending i...) x 4
    # example 0: 6 + 3 ctx + (1+1) + (1+2) + (1+1) + (1+3) = 20 uint16 = 40 bytes
    ex0 = [65535, 40, 0, 2, 4, 3, 10, 11, 12, 1, 1, 2, 2, 3, 1, 4, 3, 5, 6, 7]
    # example 1: 6 + 1 ctx + 4 x (1+1) = 15 uint16 = 30 bytes
    ex1 = [65535, 30, 1, 0, 4, 1, 65534, 1, 8, 1, 9, 1, 0, 1, 50256]
    assert (2 * len(ex0), 2 * len(ex1)) == (40, 30)
    stream = ex0 + ex1
    return hdr(20240522, 1, 2, 40) + struct.pack(f"<{len(stream)}H", *stream)


def test_eval_bytes_exact_and_roundtrip(tmp_path):
    p = tmp_path / "e.bin"
    F.write_evalfile(p, EXAMPLES)
    assert p.read_bytes() == hand_made_eval_bytes()
    h = F.read_eval_header(p)
    assert (h.num_examples, h.longest_example_bytes) == (2, 40)
    exs = F.read_evalfile(p)
    assert [e.index for e in exs] == [0, 1]
    assert [e.label for e in exs] == [2, 0]
    assert exs[0].context.tolist() == [10, 11, 12]
    assert [e.tolist() for e in exs[1].endings] == [[8], [9], [0], [50256]]
    assert [e.nbytes for e in exs] == [40, 30]
    p2 = tmp_path / "e2.bin"
    F.write_evalfile(p2, exs)  # EvalExample objects are accepted too
    assert p2.read_bytes() == p.read_bytes()


def _patch_u16(data, u16_index, value):
    b = bytearray(data)
    struct.pack_into("<H", b, 1024 + 2 * u16_index, value)
    return bytes(b)


@pytest.mark.parametrize("idx,value,fragment", [
    (0, 7, "example 0 (byte 1,024): expected START_EXAMPLE delimiter 65535, found 7"),
    (20, 1, "example 1 (byte 1,064): expected START_EXAMPLE delimiter"),
    (22, 0, "example 1 (byte 1,064): EXAMPLE_INDEX is 0, expected the running index 1"),
    (23, 4, "example 1 (byte 1,064): label is 4"),
    (4, 3, "example 0 (byte 1,024): NUM_COMPLETIONS is 3"),
    (5, 0, "example 0 (byte 1,024): context is empty"),
    (5, 30, "example 0 (byte 1,024): context length 30 runs past"),
    (9, 0, "example 0 (byte 1,024): completion 0 is empty"),
    (16, 9, "example 0 (byte 1,024): completion 3 length 9 runs past"),
    (1, 42, "EXAMPLE_BYTES is 42 but the fields take 40"),
    (21, 90, "example 1 (byte 1,064): example is 90 bytes but only 30 remain"),
    (7, 65535, "example 0 (byte 1,024): token id 65535 (the delimiter) inside the example"),
])
def test_eval_structural_problems(tmp_path, idx, value, fragment):
    p = write(tmp_path / "bad.bin", _patch_u16(hand_made_eval_bytes(), idx, value))
    expect_problem(lambda: F.read_evalfile(p), p, fragment)


def test_eval_header_problems(tmp_path):
    good = hand_made_eval_bytes()
    cases = [
        (hdr(20240522, 2, 2, 40) + good[1024:], "unsupported eval file version 2"),
        (hdr(20240522, 1, 0, 40) + good[1024:], "0 examples"),
        (hdr(20240522, 1, 70000, 40) + good[1024:], "70,000 examples"),
        (hdr(20240522, 1, 2, 0) + good[1024:], "longest example is 0 bytes"),
        (hdr(20240522, 1, 2, 38) + good[1024:], "header says the longest example is 38 bytes, but it is 40"),
        (hdr(20240522, 1, 3, 40) + good[1024:], "too small for 3 examples"),
        (hdr(20240522, 1, 1, 40) + good[1024:], "30 trailing bytes after the 1 examples"),
        (good[:-1], "not a whole number of uint16"),
        (good[:-2], "only 28 remain"),
    ]
    for i, (data, frag) in enumerate(cases):
        p = write(tmp_path / f"h{i}.bin", data)
        expect_problem(lambda p=p: F.read_evalfile(p), p, frag)


def test_eval_writer_asserts(tmp_path):
    p = tmp_path / "w.bin"
    bad = [
        dict(label=0, ctx_tokens=[1], ending_tokens=[[1], [2], [3]]),
        dict(label=4, ctx_tokens=[1], ending_tokens=[[1], [2], [3], [4]]),
        dict(label=0, ctx_tokens=[65535], ending_tokens=[[1], [2], [3], [4]]),
        dict(label=0, ctx_tokens=[1] * 33000, ending_tokens=[[1], [2], [3], [4]]),
        dict(label=0, ctx_tokens=[], ending_tokens=[[1], [2], [3], [4]]),
    ]
    for ex in bad:
        with raises_error(DataError, names="example 0", hint=None):
            F.write_evalfile(p, [ex])
    with raises_error(DataError, names="examples", hint=None):
        F.write_evalfile(p, [])
    assert not p.exists()


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_param_counts_match_llmc():
    assert F.checkpoint_num_params(1024, 50257, 6, 6, 384, 50304) == 30_357_504
    n12 = F.checkpoint_num_params(1024, 50257, 12, 12, 768, 50304)
    assert n12 == 124_475_904
    assert F.checkpoint_num_params(1024, 50257, 12, 12, 768, 50257) == 124_439_808  # unpadded
    h = F.CheckpointHeader(3, 1024, 50257, 12, 12, 768, 50304)
    assert h.num_params == n12 and h.file_bytes == 497_904_640
    assert sum(int(np.prod(s)) for _, s in h.param_shapes()) == n12


def test_checkpoint_d12_size_validation_without_writing_it(tmp_path):
    # a sparse file of the exact d12 size validates; one byte less does not (no 500 MB written)
    p = tmp_path / "d12.bin"
    with open(p, "wb") as f:
        f.write(hdr(20240326, 3, 1024, 50257, 12, 12, 768, 50304))
        f.truncate(497_904_640)
    h = F.read_checkpoint_header(p)
    assert (h.num_layers, h.channels, h.dtype) == (12, 768, "float32")
    with open(p, "r+b") as f:
        f.truncate(497_904_639)
    expect_problem(lambda: F.read_checkpoint_header(p), p, "expected 497,904,640 bytes (124,475,904 float32 parameters",
                   "found 497,904,639: file truncated?")


def small_cfg():
    return dict(max_seq_len=8, vocab_size=10, num_layers=2, num_heads=2, channels=4, padded_vocab_size=16)


def test_checkpoint_fp32_roundtrip_bytes(tmp_path):
    n = F.checkpoint_num_params(8, 10, 2, 2, 4, 16)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    p = tmp_path / "m.bin"
    F.write_checkpoint(p, small_cfg(), params)
    assert p.read_bytes() == hdr(20240326, 3, 8, 10, 2, 2, 4, 16) + params.astype("<f4").tobytes()
    h, mm = F.read_checkpoint(p)
    assert isinstance(mm, np.memmap) and mm.dtype == np.float32
    assert np.array_equal(mm, params)
    h2, full = F.read_checkpoint_params(p)
    assert h2 == h and full.dtype == np.float32 and np.array_equal(full, params)
    # letters and a header object are accepted as the config too
    F.write_checkpoint(tmp_path / "m2.bin", dict(maxT=8, V=10, L=2, NH=2, C=4, Vp=16), params)
    F.write_checkpoint(tmp_path / "m3.bin", h, params)
    assert (tmp_path / "m2.bin").read_bytes() == (tmp_path / "m3.bin").read_bytes() == p.read_bytes()
    with raises_error(ValueError, names=str(len(params) - 1), hint=None):
        F.write_checkpoint(tmp_path / "m4.bin", small_cfg(), params[:-1])


def bf16_reference(x):
    """bf16 bits by definition: nearest representable value in float64, ties to even mantissa."""
    x32 = np.float32(x)
    u = int(np.array(x32).view(np.uint32))
    if np.isnan(x32):
        return 0x7FC0
    if np.isinf(x32):
        return u >> 16
    sign = u & 0x80000000
    mag_bits = u & 0x7FFFFFFF
    e = mag_bits >> 23
    ulp = 2.0 ** ((e if e > 0 else 1) - 127 - 7)  # spacing of bf16 values at this exponent
    lo_bits = mag_bits >> 16
    lo = float(np.array(lo_bits << 16, dtype=np.uint32).view(np.float32))
    v = abs(float(x32))
    d_lo, d_hi = v - lo, lo + ulp - v
    up = d_hi < d_lo or (d_hi == d_lo and lo_bits & 1)
    return (sign >> 16) | (lo_bits + up)


def test_bf16_rounding_matches_definition():
    rng = np.random.default_rng(1)
    vals = np.concatenate([
        rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 38, 2000),
        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38,
                  1.0 + 2**-8,       # exactly halfway: ties to even -> 1.0
                  1.0 + 3 * 2**-8,   # exactly halfway: ties to even -> 1 + 2**-6
                  1.0 + 2**-8 + 2**-20, 1e-45, 1e-39, -2.5e-40]),
    ]).astype(np.float32)
    got = F.fp32_to_bf16_bits(vals)
    assert got.dtype == np.uint16
    ref = np.array([bf16_reference(v) for v in vals], dtype=np.uint16)
    assert np.array_equal(got, ref)
    assert got[-6] == 0x3F80 and got[-5] == 0x3F82   # the two ties
    assert got[2007] == 0x7F80 and got[2008] == 0xFF80  # FLT_MAX rounds up to inf, as PyTorch does
    assert got[2006] == 0x7FC0                           # NaN -> PyTorch's canonical quiet NaN
    back = F.bf16_bits_to_fp32(got)
    finite = np.isfinite(vals) & np.isfinite(back)
    # bf16 keeps 8 significant bits: rounding error <= half an ulp = 2**-8 relative, for normal numbers
    normal = finite & (np.abs(vals) > 1e-37)
    assert np.all(np.abs(back[normal] - vals[normal]) <= np.abs(vals[normal]) * 2.0**-8)


def test_checkpoint_bf16_roundtrip_bytes(tmp_path):
    n = F.checkpoint_num_params(8, 10, 2, 2, 4, 16)
    params = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    p = tmp_path / "m.bin"
    F.write_checkpoint(p, small_cfg(), params, dtype="bfloat16")
    ref_bits = np.array([bf16_reference(v) for v in params], dtype="<u2")
    assert p.read_bytes() == hdr(20240326, 5, 8, 10, 2, 2, 4, 16) + ref_bits.tobytes()
    h, mm = F.read_checkpoint(p)
    assert h.dtype == "bfloat16" and mm.dtype == np.uint16 and np.array_equal(mm, ref_bits)
    _, full = F.read_checkpoint_params(p)
    assert np.array_equal(full.view(np.uint32), ref_bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("fields,payload,fragment", [
    ((20240326, 1, 8, 10, 2, 2, 4, 16), 0, "version 1 (unpadded vocab) is no longer supported"),
    ((20240326, 4, 8, 10, 2, 2, 4, 16), 0, "unsupported checkpoint version 4"),
    ((20240326, 3, 8, 10, -2, 2, 4, 16), 0, "L = -2; must be positive"),
    ((20240326, 3, 8, 10, 2, 3, 4, 16), 0, "C = 4 is not divisible by NH = 3"),
    ((20240326, 3, 8, 20, 2, 2, 4, 16), 0, "Vp = 16 is smaller than V = 20"),
    # 16*4 + 8*4 + 2*(12*16 + 13*4) + 2*4 = 592 params -> 1024 + 4*592 = 3,392 bytes
    ((20240326, 3, 8, 10, 2, 2, 4, 16), 10, "expected 3,392 bytes (592 float32 parameters + header), found 1,064"),
    ((20240326, 3, 2**31 - 1, 10, 2**31 - 1, 1, 2**31 - 1, 16), 4, "float32 parameters + header), found 1,040"),  # no int overflow
])
def test_checkpoint_header_problems(tmp_path, fields, payload, fragment):
    p = write(tmp_path / "c.bin", hdr(*fields) + bytes(4 * payload))
    expect_problem(lambda: F.read_checkpoint(p), p, fragment)


# ---------------------------------------------------------------------------------------------
# tokenizer files


def test_tokenizer_v2_and_v1_bytes(tmp_path):
    toks = [b"a", b"\xe2\x80", b"<|endoftext|>"]
    p = tmp_path / "t.bin"
    F.write_tokenizer_file(p, toks, eot=2)
    assert p.read_bytes() == hdr(20240328, 2, 3, 2) + b"\x01a\x02\xe2\x80\x0d<|endoftext|>"
    tf = F.read_tokenizer_file(p)
    assert (tf.version, tf.vocab_size, tf.eot, tf.tokens) == (2, 3, 2, toks)
    v1 = [bytes([i % 256]) for i in range(50257)]
    p1 = tmp_path / "t1.bin"
    F.write_tokenizer_file(p1, v1, version=1)
    assert p1.read_bytes()[:1024] == hdr(20240328, 1, 50257)
    tf1 = F.read_tokenizer_file(p1)
    assert (tf1.version, tf1.eot, tf1.vocab_size) == (1, 50256, 50257) and tf1.tokens == v1


def test_tokenizer_gpt2_file_size(tmp_path):
    p = tmp_path / "gpt2_tokenizer.bin"
    tkz.write_gpt2_tokenizer_bin(p)
    assert p.stat().st_size == 372_108  # llm.c's gpt2_tokenizer.bin
    tf = F.read_tokenizer_file(p)
    assert (tf.version, tf.vocab_size, tf.eot) == (2, 50257, 50256)
    assert tf.tokens[50256] == b"<|endoftext|>" and tf.tokens[464] == b"The"


def test_tokenizer_problems(tmp_path):
    body = b"\x01a\x02bc\x01d"
    cases = [
        (hdr(20240328, 3, 3, 2) + body, "unsupported tokenizer version 3"),
        (hdr(20240328, 1, 3) + body, "version 1 tokenizer has 3 tokens; llm.c requires 50,257"),
        (hdr(20240328, 2, 3, 3) + body, "EOT id 3 is outside the 3-token vocabulary"),
        (hdr(20240328, 2, 3, 2) + b"\x01a\x00\x01d\x01e", "token 1 has length 0"),
        (hdr(20240328, 2, 3, 2) + body[:-1], "token 2 (1 bytes) runs past the end"),
        (hdr(20240328, 2, 3, 2) + body + b"zz", "2 trailing bytes after the 3 tokens"),
        (hdr(20240328, 2, -1, 2) + body, "cannot hold 4,294,967,295 tokens"),
    ]
    for i, (data, frag) in enumerate(cases):
        p = write(tmp_path / f"t{i}.bin", data)
        expect_problem(lambda p=p: F.read_tokenizer_file(p), p, frag)


# ---------------------------------------------------------------------------------------------
# state files


def mt_blob(seed=42):
    """A plausible mt19937_state: seed_, left_=1, next_=0, state_[624], MATRIX_A = {0, 0x9908b0df}."""
    state = [seed]
    for j in range(1, 624):
        state.append((1812433253 * (state[-1] ^ (state[-1] >> 30)) + j) & 0xFFFFFFFF)
    return struct.pack("<QiI624I2I", 0xDEADBEEF, 1, 0, *state, 0, 0x9908B0DF)


def make_state(P=37, master=True, shuffle=True, seed=0):
    rng = np.random.default_rng(seed)
    return F.StateFile(
        num_processes=4, process_rank=3, use_master_weights=master, should_shuffle=shuffle, step=1234,
        rng_state=2**64 - 3, rng_state_last_update=13371337, current_shard_idx=1, current_sample_idx=2**40 + 5,
        m=rng.standard_normal(P).astype(np.float32), v=rng.random(P).astype(np.float32),
        master=rng.standard_normal(P).astype(np.float32) if master else None,
        shard_indices=rng.permutation(3).astype(np.int32) if shuffle else None,
        intra_shard_indices=rng.permutation(11).astype(np.int32) if shuffle else None,
        mt_state=mt_blob() if shuffle else None)


def test_state_file_layout_exact(tmp_path):
    s = make_state()
    p = tmp_path / "state_00001234_00003.bin"
    F.write_state_file(p, s)
    data = p.read_bytes()
    assert len(mt_blob()) == 2520
    h = struct.unpack("<256i", data[:1024])
    assert h[:6] == (20240527, 1, 4, 3, 1, 1) and h[10] == 1234
    assert struct.unpack_from("<QQQQ", data, 80) == (2**64 - 3, 13371337, 0, 0)
    assert struct.unpack_from("<QQ", data, 120) == (1, 2**40 + 5)
    assert set(h[6:10]) | set(h[11:20]) | set(h[24:30]) | set(h[34:]) == {0}
    expect = (s.m.tobytes() + s.v.tobytes() + s.master.tobytes() + struct.pack("<Q", 3) + s.shard_indices.tobytes()
              + struct.pack("<Q", 11) + s.intra_shard_indices.tobytes() + mt_blob())
    assert data[1024:] == expect


@pytest.mark.parametrize("master,shuffle", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("give_P", [True, False])
def test_state_file_roundtrip(tmp_path, master, shuffle, give_P):
    s = make_state(P=53, master=master, shuffle=shuffle)
    p = tmp_path / "s.bin"
    F.write_state_file(p, s)
    r = F.read_state_file(p, 53 if give_P else None)
    assert r.num_parameters == 53 and isinstance(r.m, np.memmap)
    for f in ("num_processes", "process_rank", "use_master_weights", "should_shuffle", "step", "rng_state",
              "rng_state_last_update", "current_shard_idx", "current_sample_idx", "mt_state"):
        assert getattr(r, f) == getattr(s, f), f
    assert np.array_equal(r.m, s.m) and np.array_equal(r.v, s.v)
    assert (r.master is None) == (not master) and (not master or np.array_equal(r.master, s.master))
    if shuffle:
        assert r.shard_indices.dtype == np.int32 and np.array_equal(r.shard_indices, s.shard_indices)
        assert np.array_equal(r.intra_shard_indices, s.intra_shard_indices)
    else:
        assert r.shard_indices is None and r.intra_shard_indices is None and r.mt_state is None
    assert F.identify(p) == "state"


def test_state_file_problems(tmp_path):
    p = tmp_path / "s.bin"
    F.write_state_file(p, make_state(P=20))
    good = p.read_bytes()
    expect_problem(lambda: F.read_state_file(p, 21), p, "does not fit the file")
    bad_rank = bytearray(good)
    struct.pack_into("<i", bad_rank, 12, 4)
    q = write(tmp_path / "rank.bin", bytes(bad_rank))
    expect_problem(lambda: F.read_state_file(q), q, "process_rank 4 is not in [0, 4)")
    bad_mt = bytearray(good)
    struct.pack_into("<I", bad_mt, len(good) - 4, 0)
    q = write(tmp_path / "mt.bin", bytes(bad_mt))
    expect_problem(lambda: F.read_state_file(q, 20), q, "MATRIX_A")
    q = write(tmp_path / "trunc.bin", good[:-100])
    expect_problem(lambda: F.read_state_file(q, 20), q, f"{len(good) - 100:,}")  # the size it found
    with raises_error(FormatError, names=str(q)):
        F.read_state_file(q)
    noshuf = tmp_path / "n.bin"
    F.write_state_file(noshuf, make_state(P=20, master=False, shuffle=False))
    q = write(tmp_path / "n2.bin", noshuf.read_bytes()[:-4])
    expect_problem(lambda: F.read_state_file(q), q, "payload of 156 bytes is not 2 equal float32 arrays")
    expect_problem(lambda: F.read_state_file(noshuf, 19), noshuf, "expected 152 bytes of optimizer state for 19 parameters, found 160")


@pytest.mark.parametrize("field,bad", [("shard_indices", [0, 0, 2]), ("shard_indices", [1, 2, 3]),
                                       ("shard_indices", [-1, 0, 1]), ("intra_shard_indices", [0] * 11)])
def test_state_file_index_arrays_must_be_permutations(tmp_path, field, bad):
    import dataclasses

    p = tmp_path / "s.bin"
    F.write_state_file(p, dataclasses.replace(make_state(P=20), **{field: np.array(bad, dtype=np.int32)}))
    expect_problem(lambda: F.read_state_file(p, 20), p, f"{field} ({len(bad)} values) is not a permutation of "
                                                        f"0..{len(bad) - 1}")
    with raises_error(FormatError, names=str(p)):  # without P, only permutations are recognised
        F.read_state_file(p)


# ---------------------------------------------------------------------------------------------
# the tokens extension


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_token_stats_vs_numpy(dtype):
    rng = np.random.default_rng(3)
    hi = 60000 if dtype == np.uint16 else 200000
    a = rng.integers(0, hi, size=100_003).astype(dtype)
    a[::13] = 50256
    ref_sum = int((np.arange(1, a.size + 1, dtype=np.uint64) * a.astype(np.uint64)).sum())  # wraps mod 2^64
    results = [token_stats(a, 50256, 50257, n) for n in (1, 2, 3, 7)]
    for r in results:
        assert r == results[0]  # any thread count gives the identical result
    r = results[0]
    assert r == dict(count=a.size, min=int(a.min()), max=int(a.max()), eot_count=int((a == 50256).sum()),
                     out_of_vocab=int((a >= 50257).sum()), checksum=ref_sum)


def test_token_stats_checksum_wraps_and_is_positional():
    a = np.full(300_000, 65535, dtype=np.uint16)
    r = token_stats(a, 0, 65536, 2)
    n = a.size
    assert r["checksum"] == (65535 * n * (n + 1) // 2) % 2**64
    b = np.array([1, 2, 3], dtype=np.uint16)
    assert token_stats(b, 0, 10)["checksum"] != token_stats(b[::-1].copy(), 0, 10)["checksum"]
    assert token_stats(b[::-1], 0, 10)["checksum"] == 3 * 1 + 2 * 2 + 1 * 3  # non-contiguous input


def test_token_stats_memmap_and_edges(tmp_path):
    p = tmp_path / "s.bin"
    F.write_datafile(p, [50256, 5, 7, 50256, 60000])
    r = token_stats(F.open_shard(p), 50256, 50257, 4)  # more threads than needed: empty chunks
    assert (r["min"], r["max"], r["eot_count"], r["out_of_vocab"]) == (5, 60000, 2, 1)
    assert token_stats(np.zeros(0, np.uint16), 1, 2)["min"] is None
    assert token_stats(np.array([7], np.uint16), -1, 5)["eot_count"] == 0
    for bad in (np.zeros((2, 2), np.uint16), np.zeros(3, np.int32), np.zeros(3, np.uint8)):
        with pytest.raises(ValueError):
            token_stats(bad, 0, 10)
    with pytest.raises(ValueError):
        token_stats(np.zeros(3, np.uint16), 0, 10, 0)
    with pytest.raises(ValueError):
        token_stats(np.zeros(3, np.uint16), 0, 0)
