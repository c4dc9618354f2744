"""llmctl.inspect_bin and `llmctl inspect-bin`: per-kind reports, a seeded fuzz loop, CLI exit codes.

The fuzz loop mutates valid files of every kind (truncate, extend, overwrite header ints with
extreme values, flip payload bytes, random bytes) and requires inspect_file to return a verdict,
never raise; each problem is one line; and a file known to be broken (truncated, wrong magic) is
never reported valid. A valid verdict must agree with the formats reader for that kind.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from errcheck import assert_cli_error

from llmctl import formats as F
from llmctl import tokenizer as tkz  # part of the package: a broken import fails, never skips
from llmctl.inspect_bin import inspect_file, inspect_files, summary_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_valid_files(d):
    """One small valid file of every kind; returns {kind: path}."""
    d = str(d)
    os.makedirs(d, exist_ok=True)
    out = {}
    out["shard"] = os.path.join(d, "shard.bin")
    F.write_datafile(out["shard"], [50256, 464, 3290, 318, 257, 1332, 13, 50256, 40, 716])
    out["shard-llama3"] = os.path.join(d, "llama.bin")
    F.write_datafile(out["shard-llama3"], [128000, 9906, 1917, 128000, 40], kind="llama3")
    out["eval"] = os.path.join(d, "eval.bin")
    F.write_evalfile(out["eval"], [
        dict(label=1, ctx_tokens=[464, 3290], ending_tokens=[[318], [373, 257], [13], [11, 12, 13]]),
        dict(label=3, ctx_tokens=[40], ending_tokens=[[1], [2], [3], [4, 5]]),
        dict(label=3, ctx_tokens=[7, 8, 9, 10], ending_tokens=[[1], [2], [3], [4]]),
    ])
    cfg = dict(maxT=8, V=10, L=1, NH=2, C=4, Vp=16)
    n = F.checkpoint_num_params(8, 10, 1, 2, 4, 16)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    params[10 * 4:16 * 4] = 0  # padded wte rows are zero, as llm.c requires
    out["checkpoint"] = os.path.join(d, "model.bin")
    F.write_checkpoint(out["checkpoint"], cfg, params)
    out["checkpoint-bf16"] = os.path.join(d, "model_bf16.bin")
    F.write_checkpoint(out["checkpoint-bf16"], cfg, params, dtype="bfloat16")
    out["tokenizer"] = os.path.join(d, "tok.bin")
    F.write_tokenizer_file(out["tokenizer"], [b"a", b"b", b" c", b"<|endoftext|>"], eot=3)
    state = [1] + [0] * 623
    mt = struct.pack("<QiI624I2I", 0, 1, 0, *state, 0, 0x9908B0DF)
    out["state"] = os.path.join(d, "state.bin")
    F.write_state_file(out["state"], F.StateFile(
        num_processes=1, process_rank=0, use_master_weights=True, should_shuffle=True, step=40,
        m=np.ones(n, np.float32), v=np.ones(n, np.float32), master=params,
        shard_indices=np.array([0], np.int32), intra_shard_indices=np.array([2, 0, 1, 3], np.int32), mt_state=mt))
    out["state-plain"] = os.path.join(d, "state_plain.bin")
    F.write_state_file(out["state-plain"], F.StateFile(step=3, m=np.zeros(n, np.float32), v=np.zeros(n, np.float32)))
    out["debug-state"] = os.path.join(d, "debug.bin")
    B, T, V = 1, 2, 50257
    with open(out["debug-state"], "wb") as f:
        f.write(struct.pack("<256i", 20240327, 2, B, T, *[0] * 252))
        f.write(bytes(4 * (2 * B * T + B * T * V + 1 + 100)))
    return out


@pytest.fixture
def valid_files(tmp_path):
    return make_valid_files(tmp_path)


def test_every_kind_reports_its_fields(valid_files):
    r = {k: inspect_file(p, n_threads=1) for k, p in valid_files.items()}
    for k, res in r.items():
        assert res["valid"], (k, res["problem"])
        assert res["problem"] is None and summary_line(res)
        json.dumps(res)  # machine output must be JSON-serialisable
    s = r["shard"]
    assert (s["kind"], s["num_tokens"], s["min_id"], s["max_id"], s["eot_count"], s["out_of_vocab"]) == \
        ("shard", 10, 13, 50256, 2, 0)
    toks = np.array([50256, 464, 3290, 318, 257, 1332, 13, 50256, 40, 716], dtype=np.uint64)
    assert s["checksum"] == int((np.arange(1, 11, dtype=np.uint64) * toks).sum())
    ll = r["shard-llama3"]
    assert (ll["kind"], ll["dtype"], ll["eot_id"], ll["eot_count"], ll["vocab_size"]) == \
        ("shard-llama3", "uint32", 128000, 2, 128256)
    e = r["eval"]
    assert (e["num_examples"], e["label_counts"], e["max_context_tokens"], e["max_row_tokens"]) == (3, [0, 1, 0, 2], 4, 5)
    assert e["longest_example_bytes"] == 2 * (6 + 2 + 2 + 3 + 2 + 4)
    c, cb = r["checkpoint"], r["checkpoint-bf16"]
    assert (c["L"], c["C"], c["NH"], c["V"], c["Vp"], c["maxT"], c["dtype"], c["hs"]) == (1, 4, 2, 10, 16, 8, "float32", 2)
    assert c["num_params"] == cb["num_params"] == 16 * 4 + 8 * 4 + (12 * 16 + 13 * 4) + 2 * 4
    assert cb["dtype"] == "bfloat16" and c["padded_rows_zero"] and c["nonfinite"] == 0
    t = r["tokenizer"]
    assert (t["version"], t["vocab_size"], t["eot"], t["eot_token"], t["max_token_bytes"]) == (2, 4, 3, "<|endoftext|>", 13)
    st = r["state"]
    assert (st["step"], st["num_parameters"], st["num_shards"], st["shard_num_samples"], st["use_master_weights"]) == \
        (40, c["num_params"], 1, 4, True)
    assert r["state-plain"]["num_parameters"] == c["num_params"] and r["state-plain"]["num_shards"] is None
    d = r["debug-state"]
    assert (d["B"], d["T"], d["num_params"]) == (1, 2, 100)


def test_content_problems(tmp_path):
    p = tmp_path / "oov.bin"
    F.write_datafile(p, [50256, 50257, 60000, 1])
    r = inspect_file(p)
    assert not r["valid"] and r["problem"] == "2 of 4 token ids are >= the vocab size 50,257 (max id 60,000)"
    assert r["out_of_vocab"] == 2  # the stats are still reported
    n = F.checkpoint_num_params(8, 10, 1, 2, 4, 16)
    params = np.zeros(n, np.float32)
    params[5] = np.nan
    F.write_checkpoint(tmp_path / "nan.bin", dict(maxT=8, V=10, L=1, NH=2, C=4, Vp=16), params, dtype="bfloat16")
    r = inspect_file(tmp_path / "nan.bin")
    assert not r["valid"] and r["problem"] == f"1 of {n:,} parameters are NaN or Inf"
    params[5] = 0
    params[10 * 4 + 1] = 1.0  # a padded wte row that is not zero
    F.write_checkpoint(tmp_path / "pad.bin", dict(maxT=8, V=10, L=1, NH=2, C=4, Vp=16), params)
    r = inspect_file(tmp_path / "pad.bin")
    assert not r["valid"] and "padding rows 10..15 are not zero" in r["problem"]


def test_state_file_checked_against_sibling_model(tmp_path, valid_files):
    d = tmp_path / "ckpt"
    d.mkdir()
    model = open(valid_files["checkpoint"], "rb").read()
    plain = open(valid_files["state-plain"], "rb").read()
    (d / "model_00000040.bin").write_bytes(model)
    (d / "state_00000040_00000.bin").write_bytes(plain)
    r = inspect_file(d / "state_00000040_00000.bin")
    assert r["valid"] and r["model_file"] == str(d / "model_00000040.bin")
    (d / "state_00000040_00000.bin").write_bytes(plain[:-8])  # still self-consistent: 347 params
    r = inspect_file(d / "state_00000040_00000.bin")
    assert not r["valid"]
    assert r["problem"] == ("holds optimizer state for 347 parameters but model_00000040.bin has 348: "
                            "truncated or from another model?")
    assert inspect_file(d / "state_00000040_00000.bin", num_parameters=348)["problem"] == \
        "expected 2,784 bytes of optimizer state for 348 parameters, found 2,776"


def test_damaged_shuffled_state_is_placed_by_its_sibling_model(tmp_path, valid_files):
    # a shuffled state's index arrays are searched for from the end of the file; when the search
    # fails, the model_ of the same step gives the exact layout and so the exact reason
    d = tmp_path / "ckpt"
    d.mkdir()
    state = open(valid_files["state"], "rb").read()
    (d / "state_00000040_00000.bin").write_bytes(state[:-3000])
    r = inspect_file(d / "state_00000040_00000.bin")
    assert not r["valid"] and r["problem"].startswith("cannot locate the shuffled dataloader state")
    assert "model_NNNNNNNN.bin of the same step" in r["hint"]
    (d / "model_00000040.bin").write_bytes(open(valid_files["checkpoint"], "rb").read())
    r = inspect_file(d / "state_00000040_00000.bin")
    assert not r["valid"]
    need = F.HEADER_BYTES + 3 * 4 * 348 + 16 + F.MT19937_STATE_BYTES   # m, v, master; two counts; the RNG
    assert r["problem"] == (f"expected at least {need:,} bytes for 348 parameters and a "
                            f"shuffled dataloader state, found {len(state) - 3000:,}: file truncated?")
    (d / "state_00000040_00000.bin").write_bytes(state)   # whole again: valid
    assert inspect_file(d / "state_00000040_00000.bin")["valid"]


def test_decode_uses_gpt2_tokenizer(tmp_path):
    tok = tkz.get_tokenizer()
    ids = [tok.eot] + tok.encode_ordinary("First Citizen:\nBefore we proceed any further, hear me speak.")
    p = tmp_path / "s.bin"
    F.write_datafile(p, ids)
    r = inspect_file(p, decode=4)
    assert r["valid"] and r["decoded"] == "<|endoftext|>First Citizen:"
    # a tokenizer .bin can be used instead of the built-in one
    tb = tmp_path / "tok.bin"
    tkz.write_gpt2_tokenizer_bin(tb)
    assert inspect_file(p, decode=4, tokenizer=str(tb))["decoded"] == "<|endoftext|>First Citizen:"


def test_real_hellaswag_examples(tmp_path, hellaswag_jsonl):
    """The first 12 HellaSwag val examples, tokenised as llm.c's hellaswag.py does, inspect cleanly."""
    tok = tkz.get_tokenizer()
    exs, labels = [], []
    with open(hellaswag_jsonl) as f:
        for _, line in zip(range(12), f):
            ex = json.loads(line)
            exs.append(dict(label=ex["label"], ctx_tokens=tok.encode(ex["ctx"]),
                            ending_tokens=[tok.encode(" " + e) for e in ex["endings"]]))
            labels.append(ex["label"])
    p = tmp_path / "hellaswag_val.bin"
    F.write_evalfile(p, exs)
    r = inspect_file(p, decode=5)
    assert r["valid"], r["problem"]
    assert r["num_examples"] == 12 and r["label_counts"] == [labels.count(i) for i in range(4)]
    assert r["decoded"] == tok.decode(exs[0]["ctx_tokens"][:5])
    assert [e.label for e in F.read_evalfile(p)] == labels


# ---------------------------------------------------------------------------------------------
# fuzz

EXTREMES = [-1, 0, 1, -2**31, 2**31 - 1, 65535, 65536, 2**20, -7]

READERS = {
    "shard": F.open_shard, "shard-llama3": F.open_shard, "eval": F.read_evalfile,
    "checkpoint": F.read_checkpoint, "tokenizer": F.read_tokenizer_file, "state": F.read_state_file,
    "debug-state": F.read_debug_state_header,
}


def mutate(rng, data):
    """(mutated bytes, must_be_invalid)."""
    op = rng.integers(0, 8)
    if op == 7:  # an extreme value in a random uint16 of the payload (eval fields, token lengths, ids)
        b = bytearray(data)
        if len(b) > 1026:
            i = 1024 + 2 * int(rng.integers(0, (len(b) - 1024) // 2))
            struct.pack_into("<H", b, i, int(rng.choice([0, 1, 3, 4, 5, 255, 65534, 65535])))
        return bytes(b), False
    if op == 0:  # truncate (anywhere, including inside the header)
        return data[:rng.integers(0, len(data))], True
    if op == 1:  # append junk
        return data + rng.bytes(int(rng.integers(1, 64))), False  # (a tokenizer/state may re-parse)
    if op == 2:  # an extreme value in one of the meaningful header slots
        b = bytearray(data)
        slot = int(rng.choice([1, 2, 3, 4, 5, 6, 7, 10]))
        struct.pack_into("<i", b, 4 * slot, int(rng.choice(EXTREMES)))
        return bytes(b), False
    if op == 3:  # wrong magic
        b = bytearray(data)
        struct.pack_into("<i", b, 0, int(rng.integers(-2**31, 2**31)) | 1)
        return bytes(b), True
    if op == 4:  # flip a few payload bytes
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(min(1024, len(b) - 1), len(b)))
            b[i] ^= int(rng.integers(1, 256))
        return bytes(b), False
    if op == 5:  # random bytes with a valid magic
        head = data[:4]
        return head + rng.bytes(int(rng.integers(0, 3000))), False
    return rng.bytes(int(rng.integers(0, 2000))), False  # pure noise


def test_fuzz_inspect_never_raises(tmp_path):
    valid = make_valid_files(tmp_path / "valid")
    kinds = list(valid)
    originals = [open(p, "rb").read() for p in valid.values()]
    rng = np.random.default_rng(20240520)
    fuzz_dir = tmp_path / "fuzz"
    fuzz_dir.mkdir()
    n_invalid = 0
    for i in range(360):
        data, must_fail = mutate(rng, originals[i % len(originals)])
        p = fuzz_dir / f"f{i:03d}.bin"
        p.write_bytes(data)
        r = inspect_file(p, n_threads=1)
        assert isinstance(r["valid"], bool)
        # a plain state file's and a debug state's sizes define their parameter count, so some
        # truncations of them are indistinguishable from a smaller valid file
        self_sized = kinds[i % len(kinds)] in ("state-plain", "debug-state")
        if must_fail and not (self_sized and data[:4] == originals[i % len(originals)][:4]):
            assert not r["valid"], (i, r)
        if r["valid"]:
            READERS[r["kind"]](p)  # the reader agrees
        else:
            n_invalid += 1
            prob = r["problem"]
            assert isinstance(prob, str) and prob and "\n" not in prob, (i, r)
            assert not prob.startswith("cannot read file"), (i, r)  # an unexpected exception leaked
            assert str(p) not in prob  # the CLI adds the path once
    assert n_invalid > 200  # the mutations really do break most files


def test_fuzz_through_cli_in_process(tmp_path, capsys):
    from llmctl.cli import main

    valid = make_valid_files(tmp_path / "v")
    originals = [open(p, "rb").read() for p in valid.values()]
    rng = np.random.default_rng(7)
    paths = []
    for i in range(60):
        data, _ = mutate(rng, originals[i % len(originals)])
        paths.append(str(tmp_path / f"c{i:02d}.bin"))
        with open(paths[-1], "wb") as f:
            f.write(data)
    expected_bad = [r["path"] for r in inspect_files(paths, n_threads=1) if not r["valid"]]
    assert expected_bad
    with pytest.raises(SystemExit) as ei:
        main(["inspect-bin", *paths])
    assert ei.value.code == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Hint: ")]
    assert len(lines) == len(expected_bad)
    for line, path in zip(lines, expected_bad):
        assert line.startswith(f"{path}: ")
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# CLI through a subprocess (exit codes, stdout/stderr split)


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "llmctl", "inspect-bin", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_valid_files_exit_0(valid_files):
    paths = list(valid_files.values())
    r = run_cli(*paths)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout.splitlines()
    assert len(out) == len(paths)
    assert out[0].startswith(f"{valid_files['shard']}: shard ok: uint16 v1, 10 tokens")
    r = run_cli("--json", *paths)
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert [d["kind"] for d in data] == ["shard", "shard-llama3", "eval", "checkpoint", "checkpoint", "tokenizer",
                                         "state", "state", "debug-state"]
    assert all(d["valid"] for d in data)


def test_cli_bad_files_exit_1(tmp_path, valid_files):
    trunc = tmp_path / "train.bin"
    F.write_datafile(trunc, np.zeros(305_772, np.uint16))
    with open(trunc, "r+b") as f:
        f.truncate(1024 + 611_000)
    three = tmp_path / "three.bin"
    three.write_bytes(b"abc")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(0).bytes(5000))
    badver = tmp_path / "badver.bin"
    badver.write_bytes(struct.pack("<256i", 20240520, 9, 1, *[0] * 253) + b"\0\0")
    missing = tmp_path / "missing.bin"
    args = [valid_files["shard"], trunc, three, empty, noise, badver, missing, tmp_path]
    r = run_cli(*args)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("Hint: ")]
    assert err == [
        f"{trunc}: expected 611,544 bytes of tokens, found 611,000: file truncated?",
        f"{three}: file is 3 bytes, too short to hold a magic number (llm.c files start with a 1,024-byte header)",
        f"{empty}: file is 0 bytes, too short to hold a magic number (llm.c files start with a 1,024-byte header)",
        err[3],
        f"{badver}: unsupported version 9 for a GPT-2 (uint16) token shard with magic 20240520 (expected 1)",
        f"{missing}: no such file",
        f"{tmp_path}: is a directory, not a file",
    ]
    assert err[3].startswith(f"{noise}: unknown magic ")
    assert r.stdout.startswith(f"{valid_files['shard']}: shard ok")
    r = run_cli("--json", *args)
    assert r.returncode == 1
    assert [d["valid"] for d in json.loads(r.stdout)] == [True] + [False] * 7


def test_cli_text_output_shows_each_bad_files_hint(tmp_path, valid_files):
    """Text mode prints a bad file's hint under its problem line, as --json carries it."""
    three = tmp_path / "three.bin"
    three.write_bytes(b"abc")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(0).bytes(5000))
    args = [valid_files["shard"], three, noise, tmp_path / "missing.bin", tmp_path]
    results = json.loads(run_cli("--json", *args).stdout)
    want = []
    for res in results[1:]:
        assert not res["valid"] and res["hint"], res  # each of these bad files has a hint
        want += [f"{res['path']}: {res['problem']}", f"Hint: {res['hint']}"]
    r = run_cli(*args)
    assert r.returncode == 1 and r.stderr.splitlines() == want, r.stderr


def test_cli_no_files_checks_every_bin_under_data(valid_files):
    import shutil

    r = run_cli()  # the test runs in an empty directory: no data/
    assert_cli_error(r.stderr, 1, r.returncode, names=["data/", "llmctl prepro tinyshakespeare"])
    os.makedirs("data/fineweb10B")
    assert "no .bin file under data/" in run_cli().stderr
    shutil.copy(valid_files["shard"], "data/tiny_shakespeare_val.bin")
    shutil.copy(valid_files["eval"], "data/hellaswag_val.bin")
    shutil.copy(valid_files["shard"], "data/fineweb10B/fineweb_val_000000.bin")
    with open("data/tiny_shakespeare.txt", "w") as f:
        f.write("not a .bin: not checked\n")
    r = run_cli("--json")
    assert r.returncode == 0 and "checking the 3 .bin file(s) under data/" in r.stderr
    assert [x["path"] for x in json.loads(r.stdout)] == [
        "data/fineweb10B/fineweb_val_000000.bin", "data/hellaswag_val.bin", "data/tiny_shakespeare_val.bin"]
    with open("data/broken.bin", "wb") as f:
        f.write(b"\0" * 10)
    r = run_cli()
    assert r.returncode == 1 and "data/broken.bin:" in r.stderr and "checking the 4 .bin file(s)" in r.stderr


def test_cli_usage_errors_exit_2(valid_files):
    r = run_cli("--decode", "-3", valid_files["shard"])
    assert_cli_error(r.stderr, 2, r.returncode, names=["--decode", "-3"])
    assert run_cli("--no-such-flag", valid_files["shard"]).returncode == 2


def test_cli_a_whole_train_output_directory_is_valid(tmp_path, capsys):
    # the README's `llmctl inspect-bin runs/d6/*`: besides model_/state_ the run holds the empty
    # DONE_ marker and the text logs, which are llmctl's own files, not bad llm.c binaries
    from tinyrun import tiny_train_args, write_tiny_run

    from llmctl.cli import main

    from llmctl.model import GPT2

    write_tiny_run(tmp_path, 2000)
    m = GPT2.from_checkpoint(str(tmp_path / "init.bin"), n_threads=1)
    c = m.config
    m.params[c.vocab_size * c.channels:c.padded_vocab_size * c.channels] = 0  # as llm.c pads wte
    m.save_checkpoint(str(tmp_path / "init.bin"))
    with pytest.raises(SystemExit) as e:
        main(tiny_train_args(tmp_path, "run", 2, 8, "-x", "2", "-n", "2"))
    assert e.value.code in (0, None)
    capsys.readouterr()
    run = tmp_path / "run"
    names = sorted(os.listdir(run))
    assert names == ["DONE_00000002", "main.log", "metrics.jsonl", "model_00000002.bin", "state_00000002_00000.bin"]
    r = run_cli("--json", *sorted(run.iterdir()))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["kind"] for d in data] == ["done", "text", "text", "checkpoint", "state"]
    assert all(d["valid"] for d in data) and data[0]["step"] == 2
    # a DONE marker whose checkpoint is gone (or that is not empty) is reported, with a hint
    os.unlink(run / "model_00000002.bin")
    (run / "DONE_00000001").write_bytes(b"x")
    bad = inspect_files([run / "DONE_00000001", run / "DONE_00000002"])
    assert [b["valid"] for b in bad] == [False, False] and all(b["hint"] for b in bad)
    assert "model_00000002.bin is missing" in bad[1]["problem"]
