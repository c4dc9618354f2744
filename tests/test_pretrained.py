"""Pretrained GPT-2 in (llmctl/hf/hub.py, convert.py; `llmctl prepro gpt2`), offline and torch-free.

Models are tiny GPT-2s written with the real safetensors library (tests/hfmodels.py); hub names
resolve through the real huggingface_hub against a cache directory laid out as huggingface_hub
lays it out, with HF_HUB_OFFLINE=1. The conversion is checked against an independent NumPy
statement of train_gpt2.py's write_model, and the converted model's logits against a float64
GPT2LMHeadModel forward on the Hugging Face tensors.
"""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

import reference as ref
from hfmodels import (COMMIT, hf_forward, hf_to_llmc_flat, hub_cache, llmc_header, random_hf_tensors,
                      save_hf_model, tiny_config)
from llmctl.errors import LlmctlError
from llmctl.hf import is_pretrained_spec, parse_spec, pretrained_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, HF tensors, model dir in OpenAI's spelling with mask buffers)."""
    cfg = tiny_config()
    t = random_hf_tensors(cfg, seed=1)
    d = save_hf_model(tmp_path_factory.mktemp("hf") / "tiny", cfg, t)
    return cfg, t, d


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    """No test reads or writes the user's Hugging Face or llmctl cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "llmctl-cache"))


def expected_bytes(cfg, t):
    return llmc_header(cfg) + hf_to_llmc_flat(cfg, t).astype("<f4").tobytes()


def run_cli(args, env_extra, cwd):
    """`python -m llmctl ARGS` offline; env_extra values of None unset a variable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env_extra)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "llmctl"] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def bin_files(d):
    return sorted(p.name for p in Path(d).rglob("*") if p.is_file() and not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------
# specs


@pytest.mark.parametrize("spec, repo, rev", [
    ("gpt2", "openai-community/gpt2", None), ("gpt2-medium", "openai-community/gpt2-medium", None),
    ("gpt2-large", "openai-community/gpt2-large", None), ("gpt2-xl", "openai-community/gpt2-xl", None),
    ("openai-community/gpt2", "openai-community/gpt2", None), ("gpt2@main", "openai-community/gpt2", "main"),
    ("hf:someone/tiny-gpt2", "someone/tiny-gpt2", None)])
def test_hub_names_parse_to_repos(spec, repo, rev):
    p = parse_spec(spec)
    assert (p.repo_id, p.revision, p.directory) == (repo, rev, None)


@pytest.mark.parametrize("spec", ["d12", "gpt2:d12", "gpt3:c768", "model.bin", "gpt3", "gpt2-small"])
def test_descriptors_and_files_are_not_pretrained(spec):
    assert not is_pretrained_spec(spec)


def test_directory_with_config_is_pretrained_and_wins_over_the_name(tiny, tmp_path):
    assert is_pretrained_spec(str(tiny[2]))
    save_hf_model(tmp_path / "gpt2", tiny[0], tiny[1])
    assert parse_spec("gpt2").directory == "gpt2"  # the cwd (tmp_path) holds a dir named gpt2
    assert not is_pretrained_spec(str(tmp_path))   # a directory without config.json


# ---------------------------------------------------------------------------------------------
# conversion


def test_openai_layout_converts_to_write_models_bytes(tiny, tmp_path):
    cfg, t, d = tiny
    path = pretrained_checkpoint(str(d), convert_dir=tmp_path)
    assert path.name == "gpt2_811K.bin"
    assert path.read_bytes() == expected_bytes(cfg, t)


def test_save_pretrained_spelling_with_tied_head_gives_the_same_bytes(tiny, tmp_path):
    cfg, t, _ = tiny
    d = save_hf_model(tmp_path / "sp", cfg, t, prefix="transformer.", lm_head=True)
    assert pretrained_checkpoint(str(d), convert_dir=tmp_path / "c").read_bytes() == expected_bytes(cfg, t)


def test_float16_weights_widen_exactly(tmp_path):
    cfg = tiny_config(L=1, C=8, NH=2, maxT=8)
    t = random_hf_tensors(cfg, seed=2)
    d = save_hf_model(tmp_path / "f16", cfg, t, dtype=np.float16)
    t16 = {k: v.astype(np.float16).astype(np.float32) for k, v in t.items()}
    assert pretrained_checkpoint(str(d), convert_dir=tmp_path / "c").read_bytes() == expected_bytes(cfg, t16)


def write_bf16_safetensors(path, tensors):
    """A BF16 safetensors file by hand (u64 header size, JSON header, data): NumPy has no bf16,
    so safetensors.numpy cannot write one. Values are truncated to bf16 bits."""
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = (np.ascontiguousarray(v, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bfloat16_weights_widen_exactly(tmp_path):
    cfg = tiny_config(L=1, C=8, NH=2, maxT=8)
    t = random_hf_tensors(cfg, seed=3)
    d = tmp_path / "bf16"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    write_bf16_safetensors(d / "model.safetensors", t)
    tb = {k: ((v.view(np.uint32) >> 16) << 16).view(np.float32) for k, v in t.items()}
    assert pretrained_checkpoint(str(d), convert_dir=tmp_path / "c").read_bytes() == expected_bytes(cfg, tb)


def test_converted_model_logits_match_a_float64_hf_forward(tiny, tmp_path):
    from llmctl.model import GPT2

    cfg, t, d = tiny
    model = GPT2.from_checkpoint(pretrained_checkpoint(str(d), convert_dir=tmp_path), n_threads=1)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(2, 12))
    model.forward(ids, keep_activations=False)
    got = model.logits()[:, :, :cfg["vocab_size"]]
    want = hf_forward(cfg, t, ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# the hub cache


@pytest.fixture
def hub(tiny, tmp_path):
    """openai-community/gpt2 in a real hub cache under tmp HF_HOME (the tiny model's files)."""
    hf_home = tmp_path / "hf"
    snap = hub_cache(hf_home, "openai-community/gpt2", {"config.json": tiny[2] / "config.json",
                                                        "model.safetensors": tiny[2] / "model.safetensors"})
    return hf_home, snap


def test_hub_name_resolves_offline_from_the_cache(tiny, hub, tmp_path):
    hf_home, _ = hub
    path = pretrained_checkpoint("gpt2", cache_dir=hf_home / "hub", convert_dir=tmp_path / "c",
                                 local_files_only=True, progress=False)
    assert COMMIT in path.parts and "openai-community--gpt2" in path.parts
    assert path.read_bytes() == expected_bytes(tiny[0], tiny[1])
    again = pretrained_checkpoint("openai-community/gpt2@main", cache_dir=hf_home / "hub",
                                  convert_dir=tmp_path / "c", local_files_only=True)
    assert again == path


def test_second_run_does_not_read_the_safetensors_file(tiny, hub, tmp_path):
    hf_home, snap = hub
    kw = dict(cache_dir=hf_home / "hub", convert_dir=tmp_path / "c", local_files_only=True)
    first = pretrained_checkpoint("gpt2", **kw)
    os.unlink(os.path.realpath(snap / "model.safetensors"))  # the blob is gone
    assert pretrained_checkpoint("gpt2", **kw) == first
    assert first.read_bytes() == expected_bytes(tiny[0], tiny[1])


def test_a_damaged_cached_checkpoint_is_converted_again(tiny, hub, tmp_path):
    hf_home, _ = hub
    kw = dict(cache_dir=hf_home / "hub", convert_dir=tmp_path / "c", local_files_only=True)
    path = pretrained_checkpoint("gpt2", **kw)
    with open(path, "r+b") as f:
        f.truncate(4096)
    assert pretrained_checkpoint("gpt2", **kw).read_bytes() == expected_bytes(tiny[0], tiny[1])


def test_repo_not_in_the_cache_while_offline_is_one_error_with_a_hint(hub, tmp_path):
    hf_home, _ = hub
    # the repo, where it was looked for, and the random-init model that needs no download
    with raises_error(LlmctlError, names=["openai-community/gpt2-xl", "cache", "-e d12"]):
        pretrained_checkpoint("gpt2-xl", cache_dir=hf_home / "hub", convert_dir=tmp_path / "c",
                              local_files_only=True)
    assert not (tmp_path / "c").exists()


def test_cli_prepro_gpt2_uses_hf_home_offline(tiny, hub, tmp_path):
    hf_home, _ = hub
    r = run_cli(["prepro", "gpt2", "--out-dir", "out"], {"HF_HOME": str(hf_home), "LLMCTL_CACHE": None}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "gpt2_811K.bin").read_bytes() == expected_bytes(tiny[0], tiny[1])
    assert bin_files(hf_home / "llmctl") == ["gpt2_811K.bin"]  # converted once, under HF_HOME


def test_cli_offline_not_cached_error_and_hint_exit_1(tmp_path):
    r = run_cli(["prepro", "gpt2", "--model", "gpt2-medium", "--out-dir", "out"],
                {"HF_HOME": str(tmp_path / "empty")}, tmp_path)
    _, hint = assert_cli_error(r.stderr, 1, r.returncode, names=["gpt2-medium", "--model DIR"])
    assert " -e " not in hint and not (tmp_path / "out").exists()  # prepro gpt2 has no -e


@pytest.mark.parametrize("bad, flag", [(["-b", "0"], "--batch-size 0"), (["-t", "-1"], "--seq-len -1")])
def test_cli_prepro_gpt2_debug_state_rejects_bad_b_t_before_the_model_is_fetched(tmp_path, bad, flag):
    # the model is not cached: the usage error comes before it is looked for
    r = run_cli(["prepro", "gpt2", "--model", "gpt2-medium", "--out-dir", "out", "--debug-state", *bad],
                {"HF_HOME": str(tmp_path / "empty")}, tmp_path)
    assert_cli_error(r.stderr, 2, r.returncode, names=[flag])
    assert not (tmp_path / "out").exists()


def test_cli_prepro_gpt2_unreachable_hub_hint_speaks_of_its_own_flags(dead_hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "empty"), HF_ENDPOINT=dead_hub.url, LLMCTL_CACHE=str(tmp_path / "c"))
    r = subprocess.run([sys.executable, "-m", "llmctl", "prepro", "gpt2", "--out-dir", "out"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Retrying" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and "cannot be reached" in lines[0], r.stderr
    assert lines[1].startswith("Hint:") and "--model DIR" in lines[1] and " -e " not in lines[1]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# bad input: one error, nothing half-written


def _bad_config(**kw):
    return lambda d, cfg, t: (d / "config.json").write_text(json.dumps(dict(cfg, **kw)))


def _drop(key):
    def f(d, cfg, t):
        save_hf_model(d, cfg, {k: v for k, v in t.items() if k != key})
    return f


def _reshape(d, cfg, t):
    t = dict(t)
    t["h.1.attn.c_attn.weight"] = t["h.1.attn.c_attn.weight"].T.copy()  # (3C, C): llm.c's layout
    save_hf_model(d, cfg, t)


def _extra(d, cfg, t):
    save_hf_model(d, cfg, dict(t, **{"h.0.crossattention.c_attn.weight": t["h.0.attn.c_attn.weight"]}))


def _untied(d, cfg, t):
    from safetensors.numpy import load_file, save_file

    f = load_file(str(d / "model.safetensors"))
    f["lm_head.weight"] = f["wte.weight"] + 1
    save_file(f, str(d / "model.safetensors"))


def _truncate(d, cfg, t):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])


def _garbage(d, cfg, t):
    (d / "model.safetensors").write_bytes(b"\x00" * 64)


BAD = {
    "relu": (_bad_config(activation_function="relu"), "activation_function"),
    "untied": (_bad_config(tie_word_embeddings=False), "tie_word_embeddings"),
    "n_inner": (_bad_config(n_inner=48), "n_inner"),
    "layer_idx_scale": (_bad_config(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    "reorder": (_bad_config(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    "eps": (_bad_config(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
    "llama": (_bad_config(model_type="llama"), "model_type"),
    "head_split": (_bad_config(n_head=3), "not divisible"),
    "json": (lambda d, cfg, t: (d / "config.json").write_text("{not json"), "JSON"),
    "missing_tensor": (_drop("h.1.mlp.c_fc.bias"), "missing"),
    "wrong_shape": (_reshape, "shape"),
    "extra_tensor": (_extra, "unexpected tensor"),
    "untied_weights": (_untied, "lm_head.weight differs"),
    "truncated": (_truncate, "safetensors"),
    "garbage": (_garbage, "safetensors"),
    "no_safetensors": (lambda d, cfg, t: (d / "model.safetensors").unlink(), "no such file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_model_directory_is_one_error_with_a_hint_and_nothing_written(tiny, tmp_path, case):
    cfg, t, _ = tiny
    d = save_hf_model(tmp_path / "m", cfg, t)
    spoil, words = BAD[case]
    spoil(d, cfg, t)
    with raises_error(LlmctlError, names=[str(d), words]) as e:
        pretrained_checkpoint(str(d), convert_dir=tmp_path / "c")
    assert "\n" not in e.value.message
    assert not (tmp_path / "c").exists() or bin_files(tmp_path / "c") == []


def test_cli_bad_model_directory_exit_1_no_traceback(tiny, tmp_path):
    cfg, t, _ = tiny
    d = save_hf_model(tmp_path / "m", cfg, t)
    _untied(d, cfg, t)
    r = run_cli(["prepro", "gpt2", "--model", str(d), "--out-dir", "out"], {"LLMCTL_CACHE": str(tmp_path / "c")},
                tmp_path)
    assert_cli_error(r.stderr, 1, r.returncode, names=[str(d), "untied"])
    assert not (tmp_path / "out").exists() and bin_files(tmp_path / "c") == []


# ---------------------------------------------------------------------------------------------
# prepro gpt2: train_gpt2.py's files


def bf16_nearest_even(a):
    """bf16 bits of float32 values by comparing the two neighbouring bf16 values in float64
    (ties to the even one): torch's .to(torch.bfloat16) for finite values."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    lo = u & np.uint32(0xFFFF0000)
    hi = lo + np.uint32(0x10000)
    v = a.astype(np.float64)
    d_lo = np.abs(v - lo.view(np.float32).astype(np.float64))
    d_hi = np.abs(hi.view(np.float32).astype(np.float64) - v)
    odd = ((lo >> 16) & 1) == 1
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & odd & (d_lo > 0))
    return (np.where(pick_hi, hi, lo) >> 16).astype("<u2")


@pytest.fixture(scope="module")
def prepro_out(tiny, tmp_path_factory):
    from llmctl.formats import write_datafile
    from llmctl.prepro.gpt2 import prepro_gpt2

    root = tmp_path_factory.mktemp("prepro")
    shard = root / "val.bin"
    rng = np.random.default_rng(5)
    write_datafile(shard, rng.integers(0, 50257, size=100))
    summary = prepro_gpt2(str(tiny[2]), out_dir=root / "out", debug_state=True, input_bin=str(shard),
                          batch_size=2, seq_len=8, threads=1, convert_dir=root / "cache")
    return root / "out", shard, summary


def test_prepro_gpt2_writes_train_gpt2_py_files(prepro_out, tiny):
    out, _, summary = prepro_out
    assert sorted(os.listdir(out)) == ["gpt2_811K.bin", "gpt2_811K_bf16.bin", "gpt2_811K_debug_state.bin",
                                       "gpt2_tokenizer.bin"]
    cfg, t = tiny[0], tiny[1]
    assert (out / "gpt2_811K.bin").read_bytes() == expected_bytes(cfg, t)
    flat = hf_to_llmc_flat(cfg, t)
    assert (out / "gpt2_811K_bf16.bin").read_bytes() == llmc_header(cfg, 5) + bf16_nearest_even(flat).tobytes()


def test_bf16_rounding_ties_and_carries():
    from llmctl.formats import fp32_to_bf16_bits

    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0xBF808001, 0x3F7FFFFF, 0x00008000], np.uint32)
    a = bits.view(np.float32)
    assert fp32_to_bf16_bits(a).tolist() == bf16_nearest_even(a).tolist() == [0x3F80, 0x3F82, 0x3F81, 0xBF81,
                                                                               0x3F80, 0x0000]
    # half way between the largest bf16 and 2^128 rounds to inf (IEEE overflow), as torch does
    assert fp32_to_bf16_bits(np.array([0x7F7F8000], np.uint32).view(np.float32)).tolist() == [0x7F80]


def test_prepro_gpt2_tokenizer_is_llmc_write_tokenizer(prepro_out):
    from llmctl.tokenizer import get_tokenizer

    b = (prepro_out[0] / "gpt2_tokenizer.bin").read_bytes()
    assert len(b) == 372_108 and struct.unpack("<4i", b[:16]) == (20240328, 2, 50257, 50256)
    enc = get_tokenizer().encoding
    want = b"".join(bytes([len(x)]) + x for x in (enc.decode_bytes([i]) for i in range(50257)))
    assert b[1024:] == want


def test_debug_state_is_test_gpt2_c_format_with_reference_values(prepro_out, tiny):
    from llmctl.formats import read_checkpoint_params, read_debug_state_header

    out, shard, summary = prepro_out
    path = out / "gpt2_811K_debug_state.bin"
    h = read_debug_state_header(path)
    assert (h.B, h.T) == (2, 8)
    hdr, flat = read_checkpoint_params(out / "gpt2_811K.bin")
    assert h.num_params == flat.size
    raw = np.fromfile(path, dtype="<i4", offset=1024, count=32)
    toks = np.fromfile(shard, dtype="<u2", offset=1024)[:17].astype(np.int32)
    np.testing.assert_array_equal(raw[:16], toks[:16])
    np.testing.assert_array_equal(raw[16:], toks[1:17])
    V, n = 50257, 2 * 8 * 50257
    body = np.fromfile(path, dtype="<f4", offset=1024 + 4 * 32)
    logits, loss, grads = body[:n].reshape(2, 8, V), body[n], body[n + 1:]
    cfg = {"max_seq_len": hdr.max_seq_len, "vocab_size": V, "padded_vocab_size": hdr.padded_vocab_size,
           "num_layers": hdr.num_layers, "num_heads": hdr.num_heads, "channels": hdr.channels}
    params = ref.params_from_flat(flat, cfg)
    x, y = toks[:16].reshape(2, 8), toks[1:17].reshape(2, 8)
    rloss, rlogits, cache = ref.gpt2_forward(params, x, y, cfg)
    np.testing.assert_allclose(logits, rlogits[:, :, :V], rtol=1e-4, atol=1e-4)
    assert abs(loss - rloss) < 1e-5 * abs(rloss) and abs(summary["loss"] - rloss) < 1e-5 * abs(rloss)
    rgrads = ref.params_to_flat(ref.gpt2_backward(params, cache, cfg), cfg, np.float64)
    assert grads.size == rgrads.size
    np.testing.assert_allclose(grads, rgrads, rtol=1e-3, atol=1e-5 * np.abs(rgrads).max())
    assert not grads[V * hdr.channels:hdr.padded_vocab_size * hdr.channels].any()  # padded wte rows


def test_debug_state_without_its_input_is_an_error_before_anything_is_written(tiny, tmp_path):
    from llmctl.prepro.gpt2 import prepro_gpt2

    # the missing file, and the command that writes it
    with raises_error(LlmctlError, names=[str(tmp_path / "nope.bin"), "llmctl prepro tinyshakespeare"]):
        prepro_gpt2(str(tiny[2]), out_dir=tmp_path / "out", debug_state=True, input_bin=str(tmp_path / "nope.bin"),
                    batch_size=2, seq_len=8)
    assert os.listdir(tmp_path / "out") == []


def test_without_huggingface_hub_the_error_prints_the_install_command(tmp_path):
    # None in sys.modules makes `import huggingface_hub` raise ImportError, as if it were not installed
    code = ("import sys; sys.modules['huggingface_hub'] = None; from llmctl.cli import main; "
            "main(['prepro', 'gpt2', '--out-dir', 'out'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HF_HOME=str(tmp_path / "hf")))
    assert_cli_error(r.stderr, 1, r.returncode,
                     names=["huggingface_hub", "pip install 'huggingface_hub>=0.34' 'safetensors>=0.4'"])


def test_transformers_save_pretrained_output_gives_transformers_logits(tmp_path):
    """Optional (transformers needs torch; not in CI): a GPT2LMHeadModel saved by transformers
    itself, loaded as -e DIR, gives transformers' logits."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from llmctl.model import GPT2

    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=50257)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))  # away from the init, so every tensor matters
    hf.save_pretrained(tmp_path / "m")
    ids = np.random.default_rng(0).integers(0, 50257, size=(2, 12))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    model = GPT2.from_checkpoint(pretrained_checkpoint(str(tmp_path / "m"), convert_dir=tmp_path / "c"), n_threads=1)
    model.forward(ids, keep_activations=False)
    np.testing.assert_allclose(model.logits()[:, :, :50257], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_sharded_save_pretrained_directory_and_hub_repo_convert_like_one_file(tiny, tmp_path):
    """model.safetensors.index.json + model-0000i-of-00002.safetensors (a large save_pretrained)."""
    from safetensors.numpy import save_file

    cfg, t, _ = tiny
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fn, keys in halves.items():
        save_file({f"transformer.{k}": t[k] for k in keys}, str(d / fn), metadata={"format": "pt"})
        weight_map.update({f"transformer.{k}": fn for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert pretrained_checkpoint(str(d), convert_dir=tmp_path / "c").read_bytes() == expected_bytes(cfg, t)
    hf_home = tmp_path / "hf"
    hub_cache(hf_home, "someone/sharded", {p.name: p for p in d.iterdir()})
    path = pretrained_checkpoint("hf:someone/sharded", cache_dir=hf_home / "hub", convert_dir=tmp_path / "c",
                                 local_files_only=True)
    assert path.read_bytes() == expected_bytes(cfg, t)


# ---------------------------------------------------------------------------------------------
# -e gpt2 on train, eval loss, eval hellaswag and sample (offline, the tmp hub cache)


def hf_token_losses(cfg, t, tokens):
    """float64 next-token losses of a 1-D token list under the HF-layout forward."""
    tokens = np.asarray(tokens)
    logits = hf_forward(cfg, t, tokens[None, :-1])[0]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(tokens) - 1), tokens[1:]]


def run_pretrained(args, hub, tmp_path):
    r = run_cli(args + ["--threads", "1"], {"HF_HOME": str(hub[0]), "LLMCTL_CACHE": None}, tmp_path)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_sample_e_gpt2_is_the_hf_models_greedy_text(tiny, hub, tmp_path):
    cfg, t, _ = tiny
    out = run_pretrained(["sample", "-e", "gpt2", "--prompt", "Hello world", "-n", "4", "--temperature", "0",
                          "--json"], hub, tmp_path)
    seq = list(out[0]["prompt_tokens"])
    for _ in range(4):
        seq.append(int(np.argmax(hf_forward(cfg, t, np.array([seq]))[0, -1])))
    assert out[0]["tokens"] == seq[len(out[0]["prompt_tokens"]):]


def test_eval_loss_e_gpt2_is_the_hf_models_loss(tiny, hub, tmp_path):
    from llmctl.formats import write_datafile

    cfg, t, _ = tiny
    toks = np.random.default_rng(11).integers(0, 50257, size=2 * 16 + 1)
    write_datafile(tmp_path / "val.bin", toks)
    res = run_pretrained(["eval", "loss", "-e", "gpt2", "-j", "val.bin", "-b", "2", "-t", "16", "--json"],
                         hub, tmp_path)[0]
    want = np.mean([hf_token_losses(cfg, t, toks[i * 16:i * 16 + 17]) for i in range(2)])
    assert abs(res["loss"] - want) <= 1e-5 * want


def test_eval_hellaswag_e_gpt2_picks_the_hf_models_lowest_mean_loss_endings(tiny, hub, tmp_path):
    from llmctl.formats import write_evalfile

    cfg, t, _ = tiny
    rng = np.random.default_rng(12)
    examples = [{"label": int(rng.integers(0, 4)), "ctx_tokens": rng.integers(0, 50257, size=5).tolist(),
                 "ending_tokens": [rng.integers(0, 50257, size=int(rng.integers(1, 4))).tolist() for _ in range(4)]}
                for _ in range(6)]
    write_evalfile(tmp_path / "hs.bin", examples)
    res = run_pretrained(["eval", "hellaswag", "-e", "gpt2", "-i", "hs.bin", "--json"], hub, tmp_path)[0]
    correct = 0
    for ex in examples:
        n = len(ex["ctx_tokens"])
        means = [hf_token_losses(cfg, t, ex["ctx_tokens"] + e)[n - 1:].mean() for e in ex["ending_tokens"]]
        correct += int(np.argmin(means)) == ex["label"]
    assert (res["num_examples"], res["correct_norm"]) == (6, correct)


def test_train_e_gpt2_starts_from_the_hf_models_loss(tiny, hub, tmp_path):
    from llmctl.formats import write_datafile

    cfg, t, _ = tiny
    toks = np.random.default_rng(13).integers(0, 50257, size=2 * 16 + 1)  # one batch: no shuffle to undo
    write_datafile(tmp_path / "tiny_train.bin", toks)
    write_datafile(tmp_path / "tiny_val.bin", toks)
    events = run_pretrained(["train", "-e", "gpt2", "-i", "tiny_train.bin", "-j", "tiny_val.bin", "-b", "2",
                             "-t", "16", "-x", "1", "-v", "0", "-s", "0", "--json"], hub, tmp_path)
    step = [e for e in events if e["event"] == "step"][0]
    want = np.mean([hf_token_losses(cfg, t, toks[i * 16:i * 16 + 17]) for i in range(2)])
    assert abs(step["train_loss"] - want) <= 1e-5 * want


def test_peek_config_of_gpt2_reads_config_json_only(tiny, hub, tmp_path):
    code = ("from llmctl.model import peek_config; c = peek_config('gpt2'); "
            "print(c.num_layers, c.channels, c.max_seq_len, c.padded_vocab_size)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HF_HOME=str(hub[0]), HF_HUB_OFFLINE="1", LLMCTL_CACHE=str(tmp_path / "c")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "16", "32", "50304"]
    assert not (tmp_path / "c").exists()  # nothing converted


def test_a_directory_that_is_no_model_is_one_error(tmp_path):
    from llmctl.errors import FormatError
    from llmctl.model import load

    (tmp_path / "runs").mkdir()
    with raises_error(FormatError, names=[str(tmp_path / "runs"), "config.json", "gpt2"]):
        load(str(tmp_path / "runs"))


def test_inspect_bin_validates_every_prepro_gpt2_file(prepro_out):
    from llmctl.inspect_bin import inspect_files

    res = inspect_files(sorted(str(p) for p in prepro_out[0].iterdir()))
    assert [(r["kind"], r["valid"]) for r in res] == [("checkpoint", True), ("checkpoint", True),
                                                      ("debug-state", True), ("tokenizer", True)], res


def test_an_invalid_hub_repo_id_is_one_error(tmp_path):
    with raises_error(LlmctlError, names="bad..name/x"):
        pretrained_checkpoint("hf:bad..name/x", cache_dir=tmp_path / "hub", convert_dir=tmp_path / "c",
                              local_files_only=True)


# ---------------------------------------------------------------------------------------------
# online (HF_HUB_OFFLINE unset) with a Hub that cannot be reached: HF_ENDPOINT on 127.0.0.1 only
# (conftest's dead_hub)


def _sample_online(hf_home, endpoint, tmp_path):
    """`llmctl sample -e gpt2` with downloads allowed (no HF_HUB_OFFLINE), the Hub at endpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(hf_home), HF_ENDPOINT=endpoint.url,
               LLMCTL_CACHE=str(tmp_path / "c"))
    return subprocess.run([sys.executable, "-m", "llmctl", "sample", "-e", "gpt2", "-n", "2", "--threads", "1",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_unreachable_hub_and_no_cache_is_one_error_at_once_naming_the_repo(dead_hub, tmp_path):
    r = _sample_online(tmp_path / "empty", dead_hub, tmp_path)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("Error: openai-community/gpt2: config.json is not in the Hugging Face cache")
    assert f"the Hub ({dead_hub.url}) cannot be reached" in lines[0]
    assert lines[1].startswith("Hint:") and "HF_HUB_OFFLINE=1" in lines[1] and "-e DIR" in lines[1]
    # huggingface_hub's backoff (5 retries, ~25 s of sleep) did not run: one request for the file
    assert "Retrying" not in r.stderr
    if dead_hub.kind == "reset":  # its requests were seen
        assert dead_hub.heads() == ["HEAD /openai-community/gpt2/resolve/main/config.json HTTP/1.1"]
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("code, spec, want", [
    ("RepoNotFound", "hf:someone/no-such-gpt2", "someone/no-such-gpt2: no such model on the Hugging Face Hub"),
    ("RevisionNotFound", "gpt2@v9", "openai-community/gpt2: no revision 'v9' on the Hugging Face Hub"),
    ("EntryNotFound", "hf:someone/not-a-model", "someone/not-a-model: the repo has no config.json")])
def test_a_hub_that_answers_not_found_is_one_error_naming_what(code, spec, want, tmp_path):
    # the real huggingface_hub, online, against a Hub that answers as the Hub does for a mistyped
    # repo, revision or a repo without a config: one error line and its hint, no traceback, no
    # retries, nothing converted
    from deadhub import NotFoundHub

    hub = NotFoundHub(code)
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "empty"), HF_ENDPOINT=hub.url,
                   LLMCTL_CACHE=str(tmp_path / "c"))
        r = subprocess.run([sys.executable, "-m", "llmctl", "sample", "-e", spec, "-n", "2", "--threads", "1"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert_cli_error(r.stderr, 1, r.returncode, names=[want])
    assert r.stdout == "" and "Retrying" not in r.stderr
    # the file llmctl reads first, asked for once to see the Hub answers and once to download it
    heads = [q for q in hub.requests if q.startswith("HEAD ")]
    assert 1 <= len(heads) <= 2 and all("/resolve/" in q and "/config.json " in q for q in heads), hub.requests
    assert not (tmp_path / "c").exists()


def test_unreachable_hub_with_a_complete_cache_uses_the_cache(tiny, hub, dead_hub, tmp_path):
    from huggingface_hub import scan_cache_dir

    hf_home, _ = hub
    repos = {r.repo_id: r for r in scan_cache_dir(hf_home / "hub").repos}  # a cache huggingface_hub reads
    assert {f.file_name for f in next(iter(repos["openai-community/gpt2"].revisions)).files} == {
        "config.json", "model.safetensors"}
    r = _sample_online(hf_home, dead_hub, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Error" not in r.stderr and "Retrying" not in r.stderr and "Traceback" not in r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2
    ckpt = tmp_path / "c" / "hub" / "v1" / "openai-community--gpt2" / COMMIT / "gpt2_811K.bin"
    assert ckpt.read_bytes() == expected_bytes(tiny[0], tiny[1])
    assert len(dead_hub.heads()) <= 1  # at most one look at the Hub per run ("refused": none seen)
