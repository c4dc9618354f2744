"""Small Hugging Face GPT-2 models for tests, written with the real `safetensors` library, and a
real `huggingface_hub` cache directory to put them in. Imports nothing from llmctl.

A model is described by `tiny_config(...)` (a config.json dict) and a dict of float32 tensors in
Hugging Face's layout (Conv1D weights (in, out), wte with V rows). `hf_to_llmc_flat` is an
independent NumPy statement of train_gpt2.py's write_model payload, and `hf_forward` a float64
GPT2LMHeadModel forward on the HF tensors, both written from the file facts, not from llmctl.
"""
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

import reference as ref

COMMIT = "6c0e6080953db56375760c0471a8c5f2929baf11"  # any 40-hex string names a snapshot


def tiny_config(L=2, C=16, NH=2, maxT=32, V=50257, **extra):
    cfg = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "bos_token_id": 50256,
           "eos_token_id": 50256, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": maxT,
           "n_embd": C, "n_head": NH, "n_layer": L, "n_positions": maxT, "vocab_size": V}
    cfg.update(extra)
    return cfg


def random_hf_tensors(cfg, seed=0, std=0.2):
    """{bare HF name: float32} with LN weights near 1 (so the forward is not trivial)."""
    rng = np.random.default_rng(seed)
    L, C, maxT, V = cfg["n_layer"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (maxT, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for l in range(L):
        shapes.update({f"h.{l}.ln_1.weight": (C,), f"h.{l}.ln_1.bias": (C,),
                       f"h.{l}.attn.c_attn.weight": (C, 3 * C), f"h.{l}.attn.c_attn.bias": (3 * C,),
                       f"h.{l}.attn.c_proj.weight": (C, C), f"h.{l}.attn.c_proj.bias": (C,),
                       f"h.{l}.ln_2.weight": (C,), f"h.{l}.ln_2.bias": (C,),
                       f"h.{l}.mlp.c_fc.weight": (C, 4 * C), f"h.{l}.mlp.c_fc.bias": (4 * C,),
                       f"h.{l}.mlp.c_proj.weight": (4 * C, C), f"h.{l}.mlp.c_proj.bias": (C,)})
    out = {}
    for k, s in shapes.items():
        a = rng.normal(0.0, std, size=s)
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            a = 1.0 + a
        out[k] = a.astype(np.float32)
    return out


def save_hf_model(d, cfg, tensors, prefix="", buffers=True, lm_head=False, dtype=np.float32):
    """Write config.json + model.safetensors into d as OpenAI's files (prefix "", with the
    attn.bias mask buffers) or as save_pretrained does (prefix "transformer.")."""
    from safetensors.numpy import save_file

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    out = {prefix + k: np.ascontiguousarray(v, dtype=dtype) for k, v in tensors.items()}
    if buffers:
        T = cfg["n_positions"]
        mask = np.tril(np.ones((T, T), np.float32))[None, None]
        for l in range(cfg["n_layer"]):
            out[f"{prefix}h.{l}.attn.bias"] = mask
            if prefix:
                out[f"{prefix}h.{l}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if lm_head:
        out["lm_head.weight"] = np.ascontiguousarray(tensors["wte.weight"], dtype=dtype)
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def hub_cache(hf_home, repo_id, files, commit=COMMIT):
    """Lay out huggingface_hub's cache for one repo at `commit`: blobs/<sha256>, snapshot
    symlinks into them, refs/main. files: {name: source path}. Returns the snapshot dir."""
    root = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = Path(src).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snap), link)
    (root / "refs" / "main").write_text(commit)
    return snap


def hf_to_llmc_flat(cfg, t):
    """train_gpt2.py write_model's payload for these HF tensors: wte padded to a multiple of
    128 rows with zeros, then the per-layer tensors stacked in llm.c's order, Conv1D weights
    transposed to (out, in)."""
    L, C, V = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"]
    Vp = math.ceil(V / 128) * 128
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = t["wte.weight"]
    parts = [wte, t["wpe.weight"]]
    for name, tr in [("ln_1.weight", 0), ("ln_1.bias", 0), ("attn.c_attn.weight", 1), ("attn.c_attn.bias", 0),
                     ("attn.c_proj.weight", 1), ("attn.c_proj.bias", 0), ("ln_2.weight", 0), ("ln_2.bias", 0),
                     ("mlp.c_fc.weight", 1), ("mlp.c_fc.bias", 0), ("mlp.c_proj.weight", 1), ("mlp.c_proj.bias", 0)]:
        parts += [t[f"h.{l}.{name}"].T if tr else t[f"h.{l}.{name}"] for l in range(L)]
    parts += [t["ln_f.weight"], t["ln_f.bias"]]
    return np.concatenate([np.asarray(p, np.float32).ravel() for p in parts])


def llmc_header(cfg, version=3):
    V = cfg["vocab_size"]
    h = np.zeros(256, "<i4")
    h[:8] = [20240326, version, cfg["n_positions"], V, cfg["n_layer"], cfg["n_head"], cfg["n_embd"],
             math.ceil(V / 128) * 128]
    return h.tobytes()


def hf_forward(cfg, t, ids):
    """float64 logits (B, T, V) of GPT2LMHeadModel on HF-layout tensors: y = x @ W + b for
    Conv1D, tanh GELU, causal attention scaled by 1/sqrt(hs), tied head."""
    p = {k: np.asarray(v, np.float64) for k, v in t.items()}
    ids = np.asarray(ids)
    T = ids.shape[1]
    x = p["wte.weight"][ids] + p["wpe.weight"][:T][None]
    for l in range(cfg["n_layer"]):
        def h(k, l=l):
            return p[f"h.{l}.{k}"]
        a, _, _ = ref.layernorm_forward(x, h("ln_1.weight"), h("ln_1.bias"))
        qkv = a @ h("attn.c_attn.weight") + h("attn.c_attn.bias")
        x = x + ref.attention_forward(qkv, cfg["n_head"]) @ h("attn.c_proj.weight") + h("attn.c_proj.bias")
        m, _, _ = ref.layernorm_forward(x, h("ln_2.weight"), h("ln_2.bias"))
        x = x + ref.gelu_forward(m @ h("mlp.c_fc.weight") + h("mlp.c_fc.bias")) @ h("mlp.c_proj.weight") \
            + h("mlp.c_proj.bias")
    f, _, _ = ref.layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])
    return f @ p["wte.weight"].T
