"""Pure-NumPy float64 GPT-2: the "naive" reference every llmctl kernel and the model are tested against.

What it is: llm.c's `train_gpt2.c` forward/backward written as plain shaped NumPy in float64, one
function pair per layer (`<layer>_forward` / `<layer>_backward`), the whole model
(`gpt2_forward` / `gpt2_backward`), AdamW as llm.c's GPU trainer applies it, and greedy decoding.
What it is not: fast, memory-frugal or shared with llmctl. It imports nothing from llmctl, so a bug
in the kernels or in llmctl/model.py cannot hide in here too. Attention materialises the full
(B, NH, T, T) matrices on purpose (the kernels never do).

Conventions (llm.c): B batch, T time, C channels, V vocab, Vp padded vocab, L layers, NH heads,
hs = C/NH. Linear weights are (out, in): y = x @ W.T + b. Backward functions RETURN fresh
gradients (they do not accumulate); the model backward sums them itself.
`cfg` may be any object with attributes (or a dict with keys) max_seq_len, vocab_size,
padded_vocab_size, num_layers, num_heads, channels.
"""
import math

import numpy as np

PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
DECAY_PARAMS = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
LN_EPS = 1e-5
GELU_SCALE = math.sqrt(2.0 / math.pi)


# ----------------------------------------------------------------------------------------------
# config helpers

def _get(cfg, name):
    return cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)


def cfg_dims(cfg):
    """(maxT, V, Vp, L, NH, C) of a config object or dict."""
    return tuple(_get(cfg, k) for k in ("max_seq_len", "vocab_size", "padded_vocab_size",
                                        "num_layers", "num_heads", "channels"))


def param_shapes(cfg):
    """[(name, shape)] in llm.c's checkpoint order (`train_gpt2.py` `write_model`)."""
    maxT, V, Vp, L, NH, C = cfg_dims(cfg)
    return [("wte", (Vp, C)), ("wpe", (maxT, C)), ("ln1w", (L, C)), ("ln1b", (L, C)),
            ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)),
            ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)), ("fcw", (L, 4 * C, C)),
            ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
            ("lnfw", (C,)), ("lnfb", (C,))]


def num_parameters(cfg):
    return sum(int(np.prod(s)) for _, s in param_shapes(cfg))


def params_from_flat(flat, cfg):
    """Split a flat parameter vector (checkpoint order) into a dict of float64 shaped copies."""
    flat = np.asarray(flat)
    out, off = {}, 0
    for name, shape in param_shapes(cfg):
        n = int(np.prod(shape))
        out[name] = flat[off:off + n].astype(np.float64).reshape(shape)
        off += n
    if off != flat.size:
        raise ValueError(f"flat vector has {flat.size} values, config needs {off}")
    return out


def params_to_flat(params, cfg, dtype=np.float32):
    return np.concatenate([np.asarray(params[n], dtype=dtype).ravel() for n, _ in param_shapes(cfg)])


def random_params(cfg, seed=0, std=0.1):
    """Random float64 parameters for tests: LN weights near 1, padded wte rows exactly 0."""
    rng = np.random.default_rng(seed)
    maxT, V, Vp, L, NH, C = cfg_dims(cfg)
    p = {}
    for name, shape in param_shapes(cfg):
        a = rng.normal(0.0, std, size=shape)
        if name in ("ln1w", "ln2w", "lnfw"):
            a = 1.0 + a
        p[name] = a
    p["wte"][V:] = 0.0
    return p


# ----------------------------------------------------------------------------------------------
# layers

def encoder_forward(ids, wte, wpe):
    """ids (B,T) int -> (B,T,C) = wte[ids] + wpe[t]."""
    ids = np.asarray(ids)
    T = ids.shape[1]
    return wte[ids] + wpe[None, :T]


def encoder_backward(dout, ids, Vp, maxT):
    """-> (dwte (Vp,C), dwpe (maxT,C))."""
    ids = np.asarray(ids)
    B, T, C = dout.shape
    dwte = np.zeros((Vp, C))
    np.add.at(dwte, ids.reshape(-1), dout.reshape(-1, C))
    dwpe = np.zeros((maxT, C))
    dwpe[:T] = dout.sum(axis=0)
    return dwte, dwpe


def layernorm_forward(x, w, b):
    """x (..., C) -> (out, mean (...), rstd (...)); biased variance, eps 1e-5 inside the sqrt."""
    mean = x.mean(axis=-1)
    xc = x - mean[..., None]
    var = (xc * xc).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    out = xc * rstd[..., None] * w + b
    return out, mean, rstd


def layernorm_backward(dout, x, w, mean, rstd):
    """-> (dx, dw, db); dw/db summed over all leading dims."""
    C = x.shape[-1]
    norm = (x - mean[..., None]) * rstd[..., None]
    dnorm = dout * w
    dx = rstd[..., None] * (dnorm - dnorm.mean(axis=-1, keepdims=True)
                            - norm * (dnorm * norm).mean(axis=-1, keepdims=True))
    dw = (dout * norm).reshape(-1, C).sum(axis=0)
    db = dout.reshape(-1, C).sum(axis=0)
    return dx, dw, db


def matmul_forward(x, W, b=None):
    """x (..., C), W (OC, C), b (OC) -> (..., OC)."""
    y = x @ W.T
    if b is not None:
        y = y + b
    return y


def matmul_backward(dout, x, W):
    """-> (dx (..., C), dW (OC, C), db (OC))."""
    OC, C = W.shape
    d2 = dout.reshape(-1, OC)
    x2 = x.reshape(-1, C)
    dx = (d2 @ W).reshape(x.shape)
    return dx, d2.T @ x2, d2.sum(axis=0)


def gelu_forward(x):
    """tanh-approximation GELU."""
    return 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + 0.044715 * x ** 3)))


def gelu_backward(dout, x):
    u = GELU_SCALE * (x + 0.044715 * x ** 3)
    th = np.tanh(u)
    sech2 = 1.0 - th * th
    grad = 0.5 * (1.0 + th) + x * 0.5 * sech2 * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
    return grad * dout


def _split_heads(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    f = lambda a: a.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)  # (B,NH,T,hs)
    return f(q), f(k), f(v), hs


def _attention_probs(q, k, hs):
    T = q.shape[2]
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hs)  # (B,NH,T,T)
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    scores = np.where(mask, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def attention_forward(qkv, NH):
    """qkv (B,T,3C) -> out (B,T,C); causal, scale 1/sqrt(hs)."""
    B, T, C3 = qkv.shape
    q, k, v, hs = _split_heads(qkv, NH)
    att = _attention_probs(q, k, hs)
    y = att @ v  # (B,NH,T,hs)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)


def attention_lse(qkv, NH):
    """(B,NH,T) log-sum-exp of the scaled causal scores (what the kernel saves for backward)."""
    q, k, v, hs = _split_heads(qkv, NH)
    T = q.shape[2]
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hs)
    scores = np.where(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf, scores)
    mx = scores.max(axis=-1, keepdims=True)
    return (mx + np.log(np.exp(scores - mx).sum(axis=-1, keepdims=True)))[..., 0]


def attention_backward(dout, qkv, NH):
    """-> dqkv (B,T,3C)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v, hs = _split_heads(qkv, NH)
    att = _attention_probs(q, k, hs)
    dy = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    datt = dy @ v.transpose(0, 1, 3, 2)
    dv = att.transpose(0, 1, 3, 2) @ dy
    dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) / math.sqrt(hs)
    dq = dscores @ k
    dk = dscores.transpose(0, 1, 3, 2) @ q
    m = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, C)
    return np.concatenate([m(dq), m(dk), m(dv)], axis=-1)


def softmax_crossentropy_forward(logits, targets, V):
    """logits (B,T,Vp) -> (losses (B,T), probs (B,T,Vp) with the padded columns 0)."""
    z = logits[..., :V]
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    probs = np.zeros(logits.shape)
    probs[..., :V] = e / e.sum(axis=-1, keepdims=True)
    targets = np.asarray(targets)
    losses = -np.log(np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0])
    return losses, probs


def softmax_crossentropy_backward(probs, targets, dlosses, V):
    """-> dlogits (B,T,Vp); padded columns 0."""
    d = probs.copy()
    d[..., V:] = 0.0
    targets = np.asarray(targets)
    np.put_along_axis(d, targets[..., None],
                      np.take_along_axis(d, targets[..., None], axis=-1) - 1.0, axis=-1)
    return d * np.asarray(dlosses)[..., None]


def adamw_step(p, g, m, v, lr, b1, b2, eps, wd, t, grad_scale=1.0):
    """llm.c CU AdamW (`llmc/adamw.cuh`) on arrays; t is 1-based. -> (p, m, v) new arrays."""
    g = grad_scale * g
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    mhat = m / (1.0 - b1 ** t)
    vhat = v / (1.0 - b2 ** t)
    p = p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p)
    return p, m, v


def gpt2_adamw(params, grads, state, lr, b1, b2, eps, wd, t, grad_scale=1.0):
    """AdamW over the whole model with weight decay only on DECAY_PARAMS. `state` is a dict
    name -> (m, v) (empty at the first step). Returns new params dict; updates state."""
    new = {}
    for name in PARAM_NAMES:
        m, v = state.get(name, (np.zeros_like(params[name]), np.zeros_like(params[name])))
        new[name], m, v = adamw_step(params[name], grads[name], m, v, lr, b1, b2, eps,
                                     wd if name in DECAY_PARAMS else 0.0, t, grad_scale)
        state[name] = (m, v)
    return new


# ----------------------------------------------------------------------------------------------
# model

def gpt2_forward(params, ids, targets, cfg):
    """-> (mean loss or None, logits (B,T,Vp), cache for gpt2_backward)."""
    maxT, V, Vp, L, NH, C = cfg_dims(cfg)
    ids = np.asarray(ids)
    B, T = ids.shape
    assert T <= maxT and ids.min() >= 0 and ids.max() < V
    p = params
    cache = {"ids": ids, "targets": targets, "layers": []}
    x = encoder_forward(ids, p["wte"], p["wpe"])
    for l in range(L):
        lc = {"x": x}
        ln1, lc["ln1_mean"], lc["ln1_rstd"] = layernorm_forward(x, p["ln1w"][l], p["ln1b"][l])
        qkv = matmul_forward(ln1, p["qkvw"][l], p["qkvb"][l])
        atty = attention_forward(qkv, NH)
        x2 = x + matmul_forward(atty, p["attprojw"][l], p["attprojb"][l])
        ln2, lc["ln2_mean"], lc["ln2_rstd"] = layernorm_forward(x2, p["ln2w"][l], p["ln2b"][l])
        fch = matmul_forward(ln2, p["fcw"][l], p["fcb"][l])
        fch_gelu = gelu_forward(fch)
        x = x2 + matmul_forward(fch_gelu, p["fcprojw"][l], p["fcprojb"][l])
        lc.update(ln1=ln1, qkv=qkv, atty=atty, x2=x2, ln2=ln2, fch=fch, fch_gelu=fch_gelu)
        cache["layers"].append(lc)
    cache["xf"] = x
    lnf, cache["lnf_mean"], cache["lnf_rstd"] = layernorm_forward(x, p["lnfw"], p["lnfb"])
    cache["lnf"] = lnf
    logits = matmul_forward(lnf, p["wte"])
    cache["logits"] = logits
    loss = None
    if targets is not None:
        targets = np.asarray(targets)
        assert targets.shape == ids.shape and targets.min() >= 0 and targets.max() < V
        losses, probs = softmax_crossentropy_forward(logits, targets, V)
        cache["losses"], cache["probs"] = losses, probs
        loss = float(losses.mean())
    return loss, logits, cache


def gpt2_backward(params, cache, cfg, loss_scale=1.0):
    """Gradient of loss_scale * mean loss w.r.t. all 16 tensors -> dict name -> array (llm.c shapes)."""
    maxT, V, Vp, L, NH, C = cfg_dims(cfg)
    p = params
    ids, targets = cache["ids"], cache["targets"]
    assert targets is not None, "gpt2_backward needs a forward with targets"
    B, T = ids.shape
    g = {name: np.zeros(shape) for name, shape in param_shapes(cfg)}
    dlosses = np.full((B, T), loss_scale / (B * T))
    dlogits = softmax_crossentropy_backward(cache["probs"], targets, dlosses, V)
    dlnf, dW, _ = matmul_backward(dlogits, cache["lnf"], p["wte"])
    g["wte"] += dW
    dx, g["lnfw"], g["lnfb"] = layernorm_backward(dlnf, cache["xf"], p["lnfw"],
                                                  cache["lnf_mean"], cache["lnf_rstd"])
    for l in reversed(range(L)):
        lc = cache["layers"][l]
        # x = x2 + fcproj(gelu(fc(ln2(x2))))
        dfg, g["fcprojw"][l], g["fcprojb"][l] = matmul_backward(dx, lc["fch_gelu"], p["fcprojw"][l])
        dfch = gelu_backward(dfg, lc["fch"])
        dln2, g["fcw"][l], g["fcb"][l] = matmul_backward(dfch, lc["ln2"], p["fcw"][l])
        dx2, g["ln2w"][l], g["ln2b"][l] = layernorm_backward(dln2, lc["x2"], p["ln2w"][l],
                                                             lc["ln2_mean"], lc["ln2_rstd"])
        dx2 = dx2 + dx
        # x2 = x + attproj(attn(qkv(ln1(x))))
        datty, g["attprojw"][l], g["attprojb"][l] = matmul_backward(dx2, lc["atty"], p["attprojw"][l])
        dqkv = attention_backward(datty, lc["qkv"], NH)
        dln1, g["qkvw"][l], g["qkvb"][l] = matmul_backward(dqkv, lc["ln1"], p["qkvw"][l])
        dxl, g["ln1w"][l], g["ln1b"][l] = layernorm_backward(dln1, lc["x"], p["ln1w"][l],
                                                             lc["ln1_mean"], lc["ln1_rstd"])
        dx = dxl + dx2
    dwte, dwpe = encoder_backward(dx, ids, Vp, maxT)
    g["wte"] += dwte
    g["wpe"] += dwpe
    return g


def gpt2_loss(params, ids, targets, cfg):
    """Mean loss only (for finite differences)."""
    return gpt2_forward(params, ids, targets, cfg)[0]


def gpt2_greedy(params, ids, n, cfg):
    """Greedy decoding: append n argmax tokens (over the first V logits) to the 1-D prompt `ids`,
    re-running the full forward each step on the last maxT tokens. -> list of all ids."""
    maxT, V = cfg_dims(cfg)[:2]
    seq = [int(i) for i in ids]
    for _ in range(n):
        ctx = np.array(seq[-maxT:])[None, :]
        _, logits, _ = gpt2_forward(params, ctx, None, cfg)
        seq.append(int(np.argmax(logits[0, -1, :V])))
    return seq
