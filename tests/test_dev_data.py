"""dev/data/*.py, llm.c's script names: each runs as a script and writes llm.c's files next to itself.

Every script is copied into a temporary dev/data/ (it writes beside its own path, as llm.c's do)
and run with `python script.py` from local sources; the bytes it writes are compared with the
independent references of tests/test_prepro.py (tiktoken's own gpt2 loader, struct-packed headers,
llm.c's loops restated).
"""
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import test_prepro
from conftest import shared_file
from test_prepro import read_shard, ref_eval_example, ref_fineweb_shards, ref_tinyshakespeare_tokens

ref_enc, stories = test_prepro.ref_enc, test_prepro.stories  # module-scoped fixtures, shared

REPO = Path(__file__).resolve().parent.parent


def run_script(tmp_path, name, *args, ok=True):
    d = tmp_path / "dev" / "data"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "dev" / "data" / name, d / name)
    r = subprocess.run([sys.executable, str(d / name), *args], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert (r.returncode == 0) == ok, r.stderr
    return d, r


def test_tinyshakespeare_script_writes_llmcs_two_files(tmp_path, ref_enc):
    src = shared_file("tinyshakespeare/input.txt")
    d, r = run_script(tmp_path, "tinyshakespeare.py", "--source", str(src))
    toks = ref_tinyshakespeare_tokens(ref_enc, src.read_text(encoding="utf-8"))
    out = d / "tinyshakespeare"
    assert sorted(p.name for p in out.iterdir()) == ["tiny_shakespeare_train.bin",
                                                      "tiny_shakespeare_val.bin"]
    assert read_shard(out / "tiny_shakespeare_val.bin") == toks[:32768]
    assert read_shard(out / "tiny_shakespeare_train.bin") == toks[32768:]
    assert len(toks) - 32768 == 305_260
    assert r.stdout.splitlines() == [f"writing 32,768 tokens to {out / 'tiny_shakespeare_val.bin'}",
                                     f"writing 305,260 tokens to {out / 'tiny_shakespeare_train.bin'}"]


def test_hellaswag_script_writes_the_eval_file(tmp_path, ref_enc):
    lines = shared_file("hellaswag/hellaswag_val.jsonl").read_text(encoding="utf-8").splitlines()[:7]
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    d, r = run_script(tmp_path, "hellaswag.py", "--source", str(src))
    raw = (d / "hellaswag" / "hellaswag_val.bin").read_bytes()
    body = [ref_eval_example(ref_enc, i, json.loads(x)) for i, x in enumerate(lines)]
    header = struct.pack("<256i", 20240522, 1, len(body), max(map(len, body)), *([0] * 252))
    assert raw == header + b"".join(body)
    assert r.stdout.strip() == f"wrote 7 examples to {d / 'hellaswag' / 'hellaswag_val.bin'}"


def test_tinystories_script_splits_val_and_train(tmp_path, stories):
    text, docs, toks = stories
    src = tmp_path / "stories.txt"
    src.write_text(text, encoding="utf-8")
    d, _ = run_script(tmp_path, "tinystories.py", "--source", str(src), "--val_tokens", "300")
    flat = [t for doc in toks for t in doc]
    assert read_shard(d / "tinystories" / "TinyStories_val.bin") == flat[:300]
    assert read_shard(d / "tinystories" / "TinyStories_train.bin") == flat[300:]


def test_fineweb_script_shards_like_llmc(tmp_path, stories):
    _, docs, toks = stories
    src = tmp_path / "fw.jsonl"
    src.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs * 3))
    d, r = run_script(tmp_path, "fineweb.py", "-t", "edu", "-s", "300", "--source", str(src))
    ref = ref_fineweb_shards(toks * 3, 300)
    out = d / "edu_fineweb10B"
    names = [f"edu_fineweb_{'val' if i == 0 else 'train'}_{i:06d}.bin" for i in range(len(ref))]
    assert sorted(p.name for p in out.iterdir()) == sorted(names) and len(ref) > 2
    assert [read_shard(out / n) for n in names] == ref
    assert len(r.stdout.splitlines()) == len(ref)


def test_script_bad_source_is_one_error_line_and_a_hint(tmp_path):
    _, r = run_script(tmp_path, "tinyshakespeare.py", "--source", str(tmp_path / "missing.txt"),
                      ok=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith("Error: ") and "missing.txt" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("Hint: ")
    assert not (tmp_path / "dev" / "data" / "tinyshakespeare").exists() or not any(
        (tmp_path / "dev" / "data" / "tinyshakespeare").iterdir())
