"""`llmctl export CHECKPOINT OUT_DIR` (llmctl/hf/export.py): llm.c checkpoint -> Hugging Face GPT-2 directory.

Checked without torch: the tensors against an independent inverse of llm.c's layout, the exported
model's float64 HF-layout forward against the float64 llm.c-layout reference on the checkpoint,
the tokenizer files against tiktoken's own GPT-2 loader (with OpenAI's pinned hashes), and the
round trip checkpoint -> export -> `-e OUT_DIR` byte for byte. With transformers installed (not in
CI), GPT2LMHeadModel / AutoTokenizer load the directory as the issue requires.
"""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

import reference as ref
from hfmodels import hf_forward
from llmctl.errors import LlmctlError
from llmctl.formats import write_checkpoint
from llmctl.hf import export_checkpoint, pretrained_checkpoint

CFG = {"max_seq_len": 32, "vocab_size": 50257, "padded_vocab_size": 50304, "num_layers": 2, "num_heads": 2,
       "channels": 16}
TEXT = "Hello world!  It's 2026;\n\tnaïve café — 東京 <|endoftext|> ok  \n\n 123456 don't"


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "llmctl-cache"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random llm.c v3 checkpoint (padded wte rows zero, as llm.c writes them)."""
    params = ref.random_params(CFG, seed=7)
    path = tmp_path_factory.mktemp("ckpt") / "model.bin"
    write_checkpoint(path, CFG, ref.params_to_flat(params, CFG))
    return path, params


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    return out, export_checkpoint(ckpt[0], out)


def load_tensors(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "model.safetensors"))


def test_export_writes_the_hf_gpt2_files(exported):
    out, summary = exported
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    assert summary["files"] == sorted(os.listdir(out))
    umask = os.umask(0)
    os.umask(umask)
    modes = {f: oct(stat.S_IMODE(os.stat(out / f).st_mode)) for f in os.listdir(out)}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # safetensors alone wrote 0600
    cfg = json.loads((out / "config.json").read_text())
    # llmctl trains without dropout; GPT2Config's default 0.1 would drop in model.train()
    assert cfg["attn_pdrop"] == cfg["embd_pdrop"] == cfg["resid_pdrop"] == 0.0
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]) == (2, 2, 16, 32, 50257)
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 50256, "eos_token_id": 50256}
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == tc["eos_token"] == tc["unk_token"] == "<|endoftext|>"
    assert tc["added_tokens_decoder"]["50256"]["content"] == "<|endoftext|>" and tc["model_max_length"] == 32
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]


def test_exported_tensors_are_the_checkpoint_in_hf_layout(exported, ckpt):
    out, _ = exported
    p = ckpt[1]
    t = load_tensors(out)
    names = {"ln_1.weight": "ln1w", "ln_1.bias": "ln1b", "attn.c_attn.bias": "qkvb", "attn.c_proj.bias": "attprojb",
             "ln_2.weight": "ln2w", "ln_2.bias": "ln2b", "mlp.c_fc.bias": "fcb", "mlp.c_proj.bias": "fcprojb"}
    conv = {"attn.c_attn.weight": "qkvw", "attn.c_proj.weight": "attprojw", "mlp.c_fc.weight": "fcw",
            "mlp.c_proj.weight": "fcprojw"}
    want = {"transformer.wte.weight": p["wte"][:50257], "transformer.wpe.weight": p["wpe"],
            "transformer.ln_f.weight": p["lnfw"], "transformer.ln_f.bias": p["lnfb"]}
    for l in range(2):
        want.update({f"transformer.h.{l}.{k}": p[v][l] for k, v in names.items()})
        want.update({f"transformer.h.{l}.{k}": p[v][l].T for k, v in conv.items()})  # Conv1D: (in, out)
    assert sorted(t) == sorted(want)  # no lm_head.weight (tied), no mask buffers
    for k, v in want.items():
        assert t[k].dtype == np.float32
        np.testing.assert_array_equal(t[k], v.astype(np.float32), err_msg=k)


def test_exported_model_forward_matches_the_checkpoint(exported, ckpt):
    out, _ = exported
    t = {k[len("transformer."):]: v for k, v in load_tensors(out).items()}
    hf_cfg = json.loads((out / "config.json").read_text())
    ids = np.random.default_rng(1).integers(0, 50257, size=(2, 10))
    p32 = {k: v.astype(np.float32).astype(np.float64) for k, v in ckpt[1].items()}
    _, want, _ = ref.gpt2_forward(p32, ids, None, CFG)
    np.testing.assert_allclose(hf_forward(hf_cfg, t, ids), want[:, :, :50257], rtol=1e-10, atol=1e-10)


def test_round_trip_gives_identical_checkpoint_bytes(exported, ckpt, tmp_path):
    out, _ = exported
    back = pretrained_checkpoint(str(out), convert_dir=tmp_path / "c")
    assert back.read_bytes() == Path(ckpt[0]).read_bytes()


def test_bf16_checkpoint_exports_its_exact_values(ckpt, tmp_path):
    from llmctl.formats import read_checkpoint_params

    flat = ref.params_to_flat(ckpt[1], CFG)
    write_checkpoint(tmp_path / "m_bf16.bin", CFG, flat, "bfloat16")
    export_checkpoint(tmp_path / "m_bf16.bin", tmp_path / "hf")
    _, widened = read_checkpoint_params(tmp_path / "m_bf16.bin")
    write_checkpoint(tmp_path / "m_fp32.bin", CFG, widened)
    back = pretrained_checkpoint(str(tmp_path / "hf"), convert_dir=tmp_path / "c")
    assert back.read_bytes() == (tmp_path / "m_fp32.bin").read_bytes()


def test_tokenizer_files_are_openais_and_encode_like_tiktoken_gpt2(exported, monkeypatch):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    from llmctl.tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256, get_tokenizer

    out, _ = exported
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the files themselves, cache nothing
    ranks = data_gym_to_mergeable_bpe_ranks(str(out / "merges.txt"), str(out / "vocab.json"),
                                            vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    enc = tiktoken.Encoding("exported", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    assert enc.encode_ordinary(TEXT) == get_tokenizer().encode_ordinary(TEXT)
    assert json.loads((out / "vocab.json").read_text(encoding="utf-8"))["<|endoftext|>"] == 50256


def test_tokenizer_json_holds_the_same_vocabulary_and_merges(exported):
    """tokenizer.json (the `tokenizers` format) is vocab.json's ids and merges.txt's merges in
    order, byte-level pre-tokenizer and decoder, <|endoftext|> an added special token."""
    out, _ = exported
    tj = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["model"]["type"] == "BPE" and tj["pre_tokenizer"]["type"] == tj["decoder"]["type"] == "ByteLevel"
    assert tj["pre_tokenizer"]["add_prefix_space"] is False
    assert tj["model"]["vocab"] == json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    lines = (out / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and tj["model"]["merges"] == lines[1:]
    assert len(tj["model"]["merges"]) == 50000
    assert [(t["id"], t["content"], t["special"]) for t in tj["added_tokens"]] == [(50256, "<|endoftext|>", True)]


def test_tokenizer_json_encodes_like_tiktoken_gpt2_in_the_tokenizers_library(exported):
    """What transformers' GPT2TokenizerFast runs: `tokenizers` on tokenizer.json, offline."""
    from conftest import require

    try:
        import tokenizers
    except ImportError:
        tokenizers = None
    require(tokenizers is not None, "the `tokenizers` package is not installed (the test extra has it)")
    from llmctl.tokenizer import get_tokenizer

    out, _ = exported
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = get_tokenizer().encoding
    for text in (TEXT, " leading space", "", "a\r\n\r\nb   \u00a0x 🙂🙂"):
        want = ours.encode(text, allowed_special={"<|endoftext|>"})
        assert tok.encode(text).ids == want, text
        assert tok.decode(want, skip_special_tokens=False) == text
    assert tok.token_to_id("<|endoftext|>") == 50256 and tok.get_vocab_size() == 50257


# ---------------------------------------------------------------------------------------------
# bad input


def test_missing_or_corrupt_checkpoint_is_one_error(tmp_path):
    with raises_error(LlmctlError, names=str(tmp_path / "nope.bin")):
        export_checkpoint(tmp_path / "nope.bin", tmp_path / "hf")
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 2048)
    with raises_error(LlmctlError, names=[str(tmp_path / "bad.bin"), "magic", "llm.c"]):
        export_checkpoint(tmp_path / "bad.bin", tmp_path / "hf")
    assert sorted(os.listdir(tmp_path)) == ["bad.bin"]


def test_non_empty_out_dir_is_refused_and_kept(ckpt, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in (False, True):
        with raises_error(LlmctlError, names=[str(out), "not empty"] + (["--force"] if force else [])):
            export_checkpoint(ckpt[0], out, force=force)
    assert os.listdir(out) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["hf"]


def test_force_replaces_an_earlier_export(ckpt, tmp_path):
    out = tmp_path / "hf"
    export_checkpoint(ckpt[0], out)
    (out / "config.json").write_text("{}")
    export_checkpoint(ckpt[0], out, force=True)
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_ctrl_c_between_the_renames_of_force_loses_neither_export(ckpt, tmp_path, monkeypatch):
    import signal

    out = tmp_path / "hf"
    export_checkpoint(ckpt[0], out)
    (out / "config.json").write_text("{}")
    real_replace = os.replace

    def replace_then_ctrl_c(a, b):
        real_replace(a, b)
        if Path(a) == out.resolve():   # the earlier export moved aside, the new one not yet in
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as e:
        export_checkpoint(ckpt[0], out, force=True)
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert e.value.kept == f"the export was complete: {out}"


def test_failed_write_leaves_no_out_dir(ckpt, tmp_path, monkeypatch):
    import llmctl.tokenizer as tokenizer_mod

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    # the last step of an export, after model.safetensors: the tokenizer files
    monkeypatch.setattr(tokenizer_mod, "bpe_data_files", boom)
    with raises_error(LlmctlError, names=[str(tmp_path / "hf"), "No space left on device"]):
        export_checkpoint(ckpt[0], tmp_path / "hf")
    assert os.listdir(tmp_path) == []


def _file_size_limit(nbytes):
    """preexec_fn: writes past nbytes fail with EFBIG (SIGXFSZ ignored), like a full disk."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def test_cli_export_onto_a_full_disk_is_one_error_and_leaves_no_out_dir(ckpt, tmp_path):
    # safetensors' own writer fails (a SafetensorError, not an OSError) on the 3 MB model.safetensors
    r = subprocess.run([sys.executable, "-m", "llmctl", "export", str(ckpt[0]), "hf"], cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
                       preexec_fn=_file_size_limit(100_000))
    assert_cli_error(r.stderr, 1, r.returncode, names=["hf", "model.safetensors"])
    assert os.listdir(tmp_path) == []


def test_cli_export_json_and_error(ckpt, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "llmctl", "export", str(ckpt[0]), "hf", "--json"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] == sorted(os.listdir(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "llmctl", "export", str(ckpt[0]), "hf"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert_cli_error(r.stderr, 1, r.returncode, names="hf")


# ---------------------------------------------------------------------------------------------
# transformers, when it is installed (it needs torch; not in CI)


def test_transformers_loads_the_export_with_llmctls_loss_and_tiktokens_tokens(exported, ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from llmctl.evaluate import eval_loss
    from llmctl.formats import write_datafile
    from llmctl.model import GPT2
    from llmctl.tokenizer import get_tokenizer

    out, _ = exported
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    toks = np.random.default_rng(3).integers(0, 50257, size=4 * 16 + 1)
    write_datafile(tmp_path / "val.bin", toks)
    ours = eval_loss(GPT2.from_checkpoint(ckpt[0], n_threads=1), str(tmp_path / "val.bin"), B=4, T=16)["loss"]
    x = torch.tensor(toks[:-1].reshape(4, 16))
    y = torch.tensor(toks[1:].reshape(4, 16))
    with torch.no_grad():
        logits = model(input_ids=x).logits
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.is_fast  # GPT2TokenizerFast from tokenizer.json
    plain = TEXT.replace("<|endoftext|>", "")
    assert tok(plain)["input_ids"] == get_tokenizer().encode_ordinary(plain)
    assert tok.eos_token_id == tok.bos_token_id == 50256
