"""llmctl.model.GPT2 vs the float64 NumPy reference (tests/reference.py), llm.c's init, checkpoints.

Tiny config: L=2, C=32, NH=4 (hs=8), V=100 (Vp=128, so padded rows exist), maxT=16.
Tolerances: the model runs in float32 (eps 6e-8) and the reference in float64. Each value passes
through ~20 kernels whose reductions have at most a few hundred terms, so a relative error of
~1e-6 of the tensor's scale is expected (measured: <= 7e-7); we allow 2e-5 of the scale, which is
still ~1000x smaller than any real bug (a wrong sign, index or missing term moves a gradient by
O(scale)).
"""
import shutil
import struct
import subprocess

import numpy as np
import pytest
from errcheck import raises_error

import reference as R
from llmctl.errors import ConfigError, FormatError
from llmctl.model import DECAY_PARAMS, PARAM_NAMES, GPT2, GPT2Config, init_llmc_, load, param_shapes
from llmctl.model.gpt2 import KVCache

CFG = GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=4, channels=32)
REL = 2e-5


def _model(n_threads=1, seed=0, std=0.1):
    m = GPT2(CFG, n_threads=n_threads)
    m.params[:] = R.params_to_flat(R.random_params(CFG, seed, std), CFG)
    return m, R.params_from_flat(m.params, CFG)  # reference starts from the same float32 values


def _batch(B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab_size, (B, T)), rng.integers(0, CFG.vocab_size, (B, T))


def _close(got, want, what):
    scale = float(np.abs(want).max())
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert err <= REL * scale + 1e-12, f"{what}: max abs err {err:.3g} vs scale {scale:.3g}"


def test_param_layout():
    m = GPT2(CFG)
    assert [n for n, _ in param_shapes(CFG)] == list(PARAM_NAMES)
    assert m.num_parameters == R.num_parameters(CFG) == 128 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32
    # views are windows on the one flat buffer, in checkpoint order
    off = 0
    for name, shape in param_shapes(CFG):
        assert m.p[name].shape == shape and m.g[name].shape == shape
        assert np.shares_memory(m.p[name], m.params) and np.shares_memory(m.g[name], m.grads)
        m.p[name].reshape(-1)[0] = off + 1
        assert m.params[off] == off + 1
        off += int(np.prod(shape))
    assert off == m.num_parameters


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("B,T", [(2, 7), (2, 16), (3, 5)])
def test_forward_backward_vs_reference(n_threads, B, T):
    m, pr = _model(n_threads)
    ids, tg = _batch(B, T, seed=T)
    m.zero_grad()
    loss = m.forward(ids, tg)
    m.backward()
    rloss, rlogits, cache = R.gpt2_forward(pr, ids, tg, CFG)
    rg = R.gpt2_backward(pr, cache, CFG)
    assert abs(loss - rloss) <= REL * rloss
    _close(m.losses, cache["losses"], "per-token losses")
    for name in PARAM_NAMES:
        _close(m.g[name], rg[name], f"grad {name}")
    # padded vocab rows: zero weights in, zero gradient out
    assert not m.g["wte"][CFG.vocab_size:].any()
    m.forward(ids)
    _close(m.logits(), rlogits, "logits")
    assert not m.logits()[..., CFG.vocab_size:].any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [True, False, 0, 1, 2, 3])
def test_recompute_modes_agree(recompute, precision, monkeypatch):
    # keeping fch_gelu, ln1, ln2 per layer (-r 0) and recomputing them in backward (llm.c's
    # -r 1: fch_gelu; -r 2 and True: also ln1, ln2; llmctl's -r 3: also res2, and in bf16 the
    # layers' weights cast as each layer runs) give the same loss, gradients and updated
    # parameters, bit for bit
    from llmctl._ext import matmul

    if precision == "bf16" and not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    ids, tg = _batch(2, 9, seed=3)
    src, _ = _model(1)
    base = GPT2(CFG, n_threads=1, recompute=0, precision=precision)
    m = GPT2(CFG, n_threads=1, recompute=recompute, precision=precision)
    for x in (base, m):
        x.params[:] = src.params
        x.params_changed()
        x.zero_grad()
        loss = x.forward(ids, tg)
        x.backward()
        x.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1)
        x.zero_grad()
        x.forward(ids, tg)   # a second step on the updated weights
        x.backward()
        x.loss0 = loss
    assert m.loss0 == base.loss0
    level = 2 if recompute is True else int(recompute)
    assert m.plan.recompute == level and base.plan.recompute == 0
    # -r 1 holds fch_gelu for one layer, not L; -r 2 also ln1, ln2 (bf16 in bf16); -r 3 also
    # res2 (fp32): exactly those bytes less
    C, BT, bf16 = CFG.channels, 2 * 9, precision == "bf16"
    held = (4 * C if level >= 1 else 0) + (2 * C if level >= 2 else 0)
    layer_bytes = BT * held * (2 if bf16 else 4) + (BT * C * 4 if level >= 3 else 0)
    assert base.activation_bytes() - m.activation_bytes() == (CFG.num_layers - 1) * layer_bytes
    assert m.grads.tobytes() == base.grads.tobytes()
    assert m.params.tobytes() == base.params.tobytes()
    assert m.m.tobytes() == base.m.tobytes() and m.v.tobytes() == base.v.tobytes()
    if bf16:   # -r 3 keeps the lm head's weights in bf16 only: wte and wpe, the first two tensors
        kept = CFG.padded_vocab_size * C + CFG.max_seq_len * C if level >= 3 else base.num_parameters
        assert m.params_bf16.size == kept
        assert m.params_bf16.tobytes() == base.params_bf16[:kept].tobytes()
        # ... and the model samples the same logits from the cached forward, which casts them too
        h = [x.forward_cached(KVCache(CFG, 2, 8), ids[:, :4]) for x in (m, base)]
        assert h[0].tobytes() == h[1].tobytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_auto_level_follows_the_precision_and_size(precision, monkeypatch):
    # -r -1: while every layer's fch_gelu fits in 256 MiB, fp32 recomputes the GELU (its
    # backward's GELU pass makes it again for free) and bf16 keeps it; beyond that, level 2
    from llmctl._ext import matmul
    from llmctl.model import gpt2 as G

    if precision == "bf16" and not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    small = GPT2(CFG, n_threads=1, precision=precision)
    small._ensure_acts(18, CFG.num_layers)
    assert small.plan.recompute == (1 if precision == "fp32" else 0)
    monkeypatch.setattr(G, "KEEP_GELU_BYTES", CFG.num_layers * 18 * 4 * CFG.channels * 4 - 1)
    big = GPT2(CFG, n_threads=1, precision=precision)
    big._ensure_acts(18, CFG.num_layers)
    assert big.plan.recompute == 2


def test_recompute_auto_level_3_in_bf16_and_weights_lent_between_steps(monkeypatch):
    # -r -1 in bf16, at level 2's sizes: level 3 once the fc activations (L*BT*4C bf16) can hold
    # the layers' bf16 weights (12*L*C^2), i.e. B*T >= 3C. Bit for bit a -r 2 model's training,
    # and its cached forward between steps reads every layer's weights cast once into the fc
    # buffer: never while a backward may still read it, and never after a forward overwrote it
    from llmctl._ext import matmul
    from llmctl.model import gpt2 as G

    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    monkeypatch.setattr(G, "KEEP_GELU_BYTES", 0)
    C = CFG.channels
    below = GPT2(CFG, n_threads=1, precision="bf16")
    below._ensure_acts(3 * C - 1, CFG.num_layers)
    assert below.plan.recompute == 2 and below.ops.lw is None
    src, _ = _model(1)
    m = GPT2(CFG, n_threads=1, precision="bf16")
    base = GPT2(CFG, n_threads=1, precision="bf16", recompute=2)
    ids, tg = _batch(6, 16, seed=7)   # 96 rows = 3C
    ctx = _batch(2, 5, seed=8)[0]
    for x in (m, base):
        x.params[:] = src.params
        x.params_changed()
    seen = []
    for step in (1, 2, 3):
        for x in (m, base):
            x.zero_grad()
            x.loss = x.forward(ids, tg)
            if step == 2:   # between forward and backward the activations are not lent
                x.between = x.forward_cached(KVCache(CFG, 2, 8), ctx)
            x.backward()
            x.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, step)
            x.hidden = x.forward_cached(KVCache(CFG, 2, 8), ctx)
            x.hidden2 = x.forward_cached(KVCache(CFG, 2, 8), ctx)   # reads the loan again
        seen.append(m.ops.held is not None)
        assert m.loss == base.loss
        assert m.grads.tobytes() == base.grads.tobytes()
        assert m.params.tobytes() == base.params.tobytes()
        assert m.hidden.tobytes() == base.hidden.tobytes() == m.hidden2.tobytes()
        if step == 2:
            assert m.between.tobytes() == base.between.tobytes()
    assert m.plan.recompute == 3 and seen == [True, True, True]
    kept = CFG.padded_vocab_size * C + CFG.max_seq_len * C   # wte and wpe
    assert m.params_bf16.size == kept
    assert m.params_bf16.tobytes() == base.params_bf16[:kept].tobytes()
    m.forward(ids, tg)
    assert m.ops.held is None


class _CountingConvert:
    """The model's convert module, counting the casts whose source is one of `params`."""

    def __init__(self, real, params):
        self.real, self.params, self.casts = real, params, 0

    def cast_to_bf16(self, dst, src, nt):
        self.casts += np.shares_memory(src, self.params)
        return self.real.cast_to_bf16(dst, src, nt)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("micro", [1, 2])
def test_level_3_backward_reads_the_weights_its_forward_parked_in_spent_gradients(micro, monkeypatch):
    # bf16 -r 3 as the trainer runs it (zero_grad(lazy=True), forward(loss_scale=), backward,
    # update(zero_grads=True)): the forward casts layer l >= 1's weights into layer l-1's spent
    # weight-gradient rows, the backward reads them there and casts none; bit for bit -r 2. A
    # second micro-step (live gradients), or a plain zero_grad() between forward and backward
    # (zeroed gradients), casts each layer's weights again in the backward, as before.
    from llmctl._ext import matmul

    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    cfg = GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=3, num_heads=4,
                     channels=32)
    m = GPT2(cfg, n_threads=1, precision="bf16", recompute=3)
    base = GPT2(cfg, n_threads=1, precision="bf16", recompute=2)
    base.params[:] = R.params_to_flat(R.random_params(cfg, 5, 0.1), cfg)
    m.params[:] = base.params
    for x in (m, base):
        x.params_changed()
    count = m.kernels.convert = _CountingConvert(m.kernels.convert, m.params)
    batches = [_batch(2, 9, seed=20 + k) for k in range(micro)]
    ctx = _batch(1, 5, seed=30)[0]
    for step in (1, 2, 3):
        casts = []
        for x in (m, base):
            x.zero_grad(lazy=True)
            x.losses_seen = []
            for k, (ids, tg) in enumerate(batches):
                x.losses_seen.append(x.forward(ids, tg, loss_scale=1.0 / micro))
                if step == 2:   # a cached forward in between reads the parked weights too
                    x.between = x.forward_cached(KVCache(cfg, 1, 8), ctx)
                if step == 3 and k == 0:
                    x.zero_grad()
                before = count.casts
                x.backward(loss_scale=1.0 / micro)
                casts.append(count.casts - before)
            x.grads_seen = x.grads.copy()
            x.after = x.forward_cached(KVCache(cfg, 1, 8), ctx)   # the rows hold gradients again
            x.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, step, zero_grads=True)
        assert m.losses_seen == base.losses_seen
        assert m.grads_seen.tobytes() == base.grads_seen.tobytes()
        assert m.params.tobytes() == base.params.tobytes()
        assert m.after.tobytes() == base.after.tobytes()
        if step == 2:
            assert m.between.tobytes() == base.between.tobytes()
        L = cfg.num_layers
        # the layer buffer holds layer L-1 after an unparked forward, layer 0 after a parked one
        want = [4 * L if step == 3 else 0] + [4 * (L - 1)] * (micro - 1)
        assert casts[:micro] == want, (step, casts)


def test_recompute_level_checked():
    with pytest.raises(ConfigError, match="recompute must be"):
        GPT2(CFG, n_threads=1, recompute=4)


def test_reference_gradients_by_finite_differences():
    # the reference itself, in float64: central differences agree to ~1e-9 relative
    cfg = dict(max_seq_len=6, vocab_size=10, padded_vocab_size=16, num_layers=2, num_heads=2, channels=8)
    p = R.random_params(cfg, 3, 0.3)
    rng = np.random.default_rng(4)
    ids, tg = rng.integers(0, 10, (2, 5)), rng.integers(0, 10, (2, 5))
    _, _, cache = R.gpt2_forward(p, ids, tg, cfg)
    g = R.gpt2_backward(p, cache, cfg)
    for name, _ in R.param_shapes(cfg):
        flat = p[name].reshape(-1)
        for idx in rng.choice(flat.size, 3, replace=False):
            old, h = flat[idx], 1e-5
            flat[idx] = old + h
            lp = R.gpt2_loss(p, ids, tg, cfg)
            flat[idx] = old - h
            lm = R.gpt2_loss(p, ids, tg, cfg)
            flat[idx] = old
            fd = (lp - lm) / (2 * h)
            # O(h^2) truncation + 1e-16/h rounding: ~1e-10 absolute
            assert abs(fd - g[name].reshape(-1)[idx]) <= 1e-8 + 1e-6 * abs(fd), (name, idx)


def test_model_gradients_by_finite_differences():
    # float32 model: loss resolution ~5e-7, so with h=1e-2 the difference quotient carries
    # ~5e-5 rounding noise plus O(h^2) curvature; check the largest-gradient entry per tensor.
    m, _ = _model(1, seed=5)
    ids, tg = _batch(2, 6, seed=6)
    m.zero_grad()
    m.forward(ids, tg)
    m.backward()
    for name in PARAM_NAMES:
        gflat = m.g[name].reshape(-1)
        idx = int(np.argmax(np.abs(gflat)))
        pflat = m.p[name].reshape(-1)
        old, h = pflat[idx], np.float32(1e-2)
        pflat[idx] = old + h
        lp = m.forward(ids, tg)
        pflat[idx] = old - h
        lm = m.forward(ids, tg)
        pflat[idx] = old
        fd = (lp - lm) / (2 * float(h))
        assert abs(fd - gflat[idx]) <= 1e-3 + 2e-2 * abs(gflat[idx]), (name, fd, gflat[idx])


def test_backward_accumulates_and_loss_scale():
    m, _ = _model(1)
    ids, tg = _batch(2, 8)
    m.zero_grad()
    m.forward(ids, tg)
    m.backward()
    g1 = m.grads.copy()
    m.forward(ids, tg)
    m.backward(loss_scale=0.5)
    np.testing.assert_allclose(m.grads, 1.5 * g1, rtol=1e-5, atol=1e-9)
    assert abs(m.grad_norm() - 1.5 * float(np.sqrt((g1.astype(np.float64) ** 2).sum()))) < 1e-5 * m.grad_norm()


def test_batch_shape_changes_reuse_buffers():
    # eval packs rows of different lengths: shrinking B*T reuses the buffers, growing reallocates
    m, pr = _model(1)
    for B, T in [(1, 16), (2, 3), (4, 8), (1, 1)]:
        ids, tg = _batch(B, T, seed=B * 100 + T)
        loss = m.forward(ids, tg)
        rloss, _, cache = R.gpt2_forward(pr, ids, tg, CFG)
        assert abs(loss - rloss) <= REL * rloss
        _close(m.losses, cache["losses"], f"losses B={B} T={T}")
    assert m.plan.rows == 32


def test_activation_memory_plan():
    # docs/model.md: per token 12C+NH+4 floats per layer, fch_gelu 4C for one layer (fp32's
    # default recomputes it: -r 1), C+C+2+Vp+2 final, and 5C of backward scratch (dres, C, lives
    # in the logits buffer); never anything of size T*T
    m, _ = _model(1)
    B, T = 2, 16
    ids, tg = _batch(B, T)
    m.forward(ids, tg)
    m.backward()
    L, C, NH, Vp, BT = 2, 32, 4, 128, B * T
    assert m.plan.recompute == 1
    floats = BT * (L * (12 * C + NH + 4) + 1 * 4 * C + (C + C + 2 + Vp + 2) + 5 * C)
    assert m.activation_bytes() == 4 * floats


def test_forward_without_keeping_activations():
    # eval/sampling path: one layer of buffers reused by every layer; same bits as a training forward
    ids, tg = _batch(3, 10, seed=21)
    train, _ = _model(1)
    want_loss = train.forward(ids, tg)
    want_losses = train.losses.copy()
    train.forward(ids)
    want_logits = train.logits().copy()
    m, pr = _model(1)
    assert m.forward(ids, tg, keep_activations=False) == want_loss
    np.testing.assert_array_equal(m.losses, want_losses)
    with pytest.raises(RuntimeError):
        m.backward()
    m.forward(ids, keep_activations=False)
    np.testing.assert_array_equal(m.logits(), want_logits)
    small = m.activation_bytes()
    keep_all = GPT2(CFG, n_threads=1, recompute=0)   # every layer's buffers (fp32's default recomputes GELU)
    keep_all.forward(ids, tg)
    assert small < keep_all.activation_bytes() * 0.6
    # a training forward afterwards grows the buffers to all layers and still matches the reference
    m.forward(ids, tg)
    m.backward()
    _, _, cache = R.gpt2_forward(pr, ids, tg, CFG)
    _close(m.g["qkvw"], R.gpt2_backward(pr, cache, CFG)["qkvw"], "qkvw after inference-only forward")
    assert m.activation_bytes() > small
    # and keep_activations=False on the big buffers still gives the same bits
    assert m.forward(ids, tg, keep_activations=False) == want_loss


# Frozen expected values, as llm.c's test_gpt2.c does: 10 AdamW steps on one batch from
# R.random_params(CFG, seed=1, std=0.1) (rounded to float32), batch _batch(2, 16, seed=2),
# lr 3e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on DECAY_PARAMS, clipping at global
# norm 1 (grad_scale = 1/norm, active every step here). Computed with reference.py in float64.
EXPECTED_LOSSES = [4.806956532288467, 4.249573744472032, 3.865364949623892, 3.5141425922957144,
                   3.1854289485696765, 2.9233397926260327, 2.699780254936522, 2.5069989588094947,
                   2.3333866791236053, 2.169763094441806]
OPT = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _train_losses(m, steps=10):
    ids, tg = _batch(2, 16, seed=2)
    out = []
    for step in range(steps):
        m.zero_grad()
        out.append(m.forward(ids, tg))
        m.backward()
        norm = m.grad_norm()
        m.update(grad_scale=1.0 / norm if norm > 1.0 else 1.0, step=step + 1, **OPT)
    return out


def test_reference_training_matches_frozen_losses():
    pr = R.params_from_flat(R.params_to_flat(R.random_params(CFG, 1, 0.1), CFG), CFG)
    ids, tg = _batch(2, 16, seed=2)
    state, losses = {}, []
    for step in range(10):
        loss, _, cache = R.gpt2_forward(pr, ids, tg, CFG)
        g = R.gpt2_backward(pr, cache, CFG)
        norm = np.sqrt(sum((g[n] ** 2).sum() for n in PARAM_NAMES))
        pr = R.gpt2_adamw(pr, g, state, OPT["lr"], OPT["beta1"], OPT["beta2"], OPT["eps"],
                          OPT["weight_decay"], step + 1, 1.0 / norm if norm > 1 else 1.0)
        losses.append(loss)
    np.testing.assert_allclose(losses, EXPECTED_LOSSES, rtol=1e-9)  # float64 vs float64


@pytest.mark.parametrize("n_threads", [1, 2])
def test_training_matches_frozen_losses(n_threads):
    m = GPT2(CFG, n_threads=n_threads)
    m.params[:] = R.params_to_flat(R.random_params(CFG, 1, 0.1), CFG)
    # float32 vs float64 after 10 Adam steps: measured <= 7e-7; Adam's m/sqrt(v) can flip the
    # sign of updates for near-zero gradients, so allow 2e-5 (llm.c's test_gpt2.c allows 1e-2)
    np.testing.assert_allclose(_train_losses(m), EXPECTED_LOSSES, atol=2e-5, rtol=0)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_bit_identical_reruns(n_threads):
    runs = []
    for _ in range(2):
        m = GPT2(CFG, n_threads=n_threads)
        m.params[:] = R.params_to_flat(R.random_params(CFG, 1, 0.1), CFG)
        losses = _train_losses(m, steps=3)
        runs.append((losses, m.params.tobytes(), m.m.tobytes(), m.v.tobytes()))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("n_threads", [1, 2])
def test_fused_zero_grads_same_bits_as_the_fill(n_threads):
    """update(zero_grads=True) leaves grads zero and zero_grad() skips its fill: 3 steps of 2
    accumulated micro-batches give the same losses/params/m/v bits as update() + a fill."""
    runs = []
    for zero in (False, True):
        m = GPT2(CFG, n_threads=n_threads)
        m.params[:] = R.params_to_flat(R.random_params(CFG, 1, 0.1), CFG)
        out = []
        for step in range(3):
            m.zero_grad()
            for k in range(2):
                out.append(m.forward(*_batch(2, 16, seed=10 * step + k)))
                m.backward(loss_scale=0.5)
            norm = m.grad_norm()
            out.append(norm)
            m.update(grad_scale=1.0 / norm if norm > 1.0 else 1.0, step=step + 1, zero_grads=zero, **OPT)
            assert m.grads.any() != zero
        runs.append((out, m.params.tobytes(), m.m.tobytes(), m.v.tobytes()))
    assert runs[0] == runs[1]


def test_zero_grad_fills_whenever_grads_were_written_after_the_fused_update():
    m, _ = _model(1, seed=3)
    x, y = _batch(2, 8, seed=5)

    def fused_step():
        m.zero_grad()
        m.forward(x, y)
        m.backward()
        m.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1, zero_grads=True)
        assert not m.grads.any()

    fused_step()
    m.forward(x, y)
    m.backward()                     # accumulates with no zero_grad first: zero_grad must fill
    m.zero_grad()
    assert not m.grads.any()
    fused_step()
    m.zero_grad()                    # free
    m.grads[::7] = 1.0               # written after zero_grad: the next zero_grad must fill
    m.zero_grad()
    assert not m.grads.any()
    m.forward(x, y)
    m.backward()
    with pytest.raises(ValueError):  # a refused update leaves the gradients for zero_grad
        m.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 0, zero_grads=True)
    assert m.grads.any()
    m.zero_grad()
    assert not m.grads.any()
    fused_step()
    buf = np.full(m.num_parameters, np.nan, np.float32)
    m.bind_grads(buf)                # the (zero) gradients are copied in: still known zero
    m.zero_grad()
    assert m.grads is buf and not buf.any()


def test_update_weight_decay_only_on_2d_tensors():
    m, _ = _model(1)
    before = m.params.copy()
    m.zero_grad()  # zero gradient: only decay moves parameters, p *= (1 - lr*wd)
    m.update(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5, grad_scale=1.0, step=1)
    after = R.params_from_flat(m.params, CFG)
    ref = R.params_from_flat(before, CFG)
    for name in PARAM_NAMES:
        want = ref[name] * (1 - 0.1 * 0.5) if name in DECAY_PARAMS else ref[name]
        np.testing.assert_allclose(after[name], want, rtol=1e-6, err_msg=name)
    with pytest.raises(ValueError):
        m.update(0.1, 0.9, 0.95, 1e-8, 0.0, 1.0, step=0)


def test_update_matches_reference_adamw():
    m, pr = _model(1)
    rng = np.random.default_rng(9)
    m.grads[:] = rng.normal(0, 1e-2, m.num_parameters).astype(np.float32)
    g = R.params_from_flat(m.grads, CFG)
    state = {}
    for t in (1, 2):
        m.update(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5, step=t)
        pr = R.gpt2_adamw(pr, g, state, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, 0.5)
    got = R.params_from_flat(m.params, CFG)
    for name in PARAM_NAMES:
        np.testing.assert_allclose(got[name], pr[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_input_validation():
    m, _ = _model(1)  # library input checks: the value and where it is, no hint (no flag to fix)
    ids, tg = _batch(2, 8)
    bad = ids.copy()
    bad[1, 3] = 100  # == V
    with raises_error(ConfigError, names=["inputs[1, 3] = 100", "[0, 100)"], hint=None):
        m.forward(bad)
    bad[1, 3] = -1
    with raises_error(ConfigError, names="inputs[1, 3] = -1", hint=None):
        m.forward(bad)
    badt = tg.copy()
    badt[0, 0] = 127  # a padded id: still not a valid token
    with raises_error(ConfigError, names="targets[0, 0] = 127", hint=None):
        m.forward(ids, badt)
    with raises_error(ConfigError, names=["17", "16"], hint=None):
        m.forward(np.zeros((1, 17), dtype=np.int64))
    with raises_error(ConfigError, names=["(2, 8)", "(2, 4)"], hint=None):
        m.forward(ids, tg[:, :4])
    with pytest.raises(ConfigError):
        m.forward(np.zeros((2, 0), dtype=np.int64))
    with raises_error(ConfigError, names="float32", hint=None):
        m.forward(ids.astype(np.float32))
    m.forward(ids)
    with pytest.raises(RuntimeError):
        m.backward()  # no targets
    m.forward(ids, tg)
    with pytest.raises(RuntimeError):
        m.logits()  # buffer holds probs
    m.backward()
    with pytest.raises(RuntimeError):
        m.backward()  # buffer holds dlogits now


def test_descriptors():
    assert GPT2Config.from_descriptor("d12") == GPT2Config()
    assert GPT2Config.from_descriptor("gpt2:d6") == GPT2Config(1024, 50257, 50304, 6, 6, 384)
    assert GPT2Config.from_descriptor("gpt3:c768") == GPT2Config(2048, 50257, 50304, 12, 12, 768)
    c = GPT2Config.from_descriptor("gpt3:c1536")
    assert (c.num_layers, c.num_heads, c.head_size) == (24, 16, 96)
    for bad in ("d7", "x12", "gpt3:c100", "gpt3:c5140", "", "d"):
        with pytest.raises(ConfigError):
            GPT2Config.from_descriptor(bad)


def test_a_mistyped_pretrained_name_is_told_the_pretrained_names_too():
    with raises_error(ConfigError, names="'gpt2-huge'") as e:
        GPT2Config.from_descriptor("gpt2-huge")
    assert all(n in e.value.hint for n in ("gpt2-medium", "gpt2-large", "gpt2-xl", "Hugging Face model directory"))


def test_checkpoint_round_trip(tmp_path):
    m, _ = _model(1, seed=11)
    p3, p5 = tmp_path / "m3.bin", tmp_path / "m5.bin"
    m.save_checkpoint(p3)
    m.save_checkpoint(p5, dtype="bfloat16")
    hdr = struct.unpack("<8i", p3.read_bytes()[:32])
    assert hdr == (20240326, 3, 16, 100, 2, 4, 32, 128)
    assert p3.stat().st_size == 1024 + 4 * m.num_parameters
    assert struct.unpack("<2i", p5.read_bytes()[:8]) == (20240326, 5)
    assert p5.stat().st_size == 1024 + 2 * m.num_parameters
    m3 = GPT2.from_checkpoint(p3)
    assert m3.config == CFG and m3.params.tobytes() == m.params.tobytes()
    m5 = load(str(p5))
    # bf16 = top 16 bits of fp32 with round-to-nearest-even (independent computation here)
    u = m.params.view(np.uint32).astype(np.uint64)
    want = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(m5.params, want)
    # loading into a model of another shape is refused
    other = GPT2(GPT2Config(16, 100, 128, 1, 4, 32))
    with raises_error(ConfigError, names=[str(p3), "L 2 vs 1"], hint=None):
        other.load_checkpoint(p3)
    trunc = tmp_path / "t.bin"
    trunc.write_bytes(p3.read_bytes()[:-4])
    with pytest.raises(FormatError):
        GPT2.from_checkpoint(trunc)
    with pytest.raises(FormatError):
        load(str(tmp_path / "missing.bin"))
    with pytest.raises(ConfigError):
        load("d5")


# --- llm.c init, checked against a gcc-compiled C statement of gpt2_build_from_descriptor's loop

C_INIT_MAIN = r"""
#include <stdlib.h>
int main(int argc, char **argv) {
  long V = atol(argv[1]), Vp = atol(argv[2]), maxT = atol(argv[3]), L = atol(argv[4]), C = atol(argv[5]);
  long sizes[16] = {Vp*C, maxT*C, L*C, L*C, L*3*C*C, L*3*C, L*C*C, L*C, L*C, L*C, L*4*C*C, L*4*C, L*C*4*C, L*C, C, C};
  long total = 0, off[16];
  for (int i = 0; i < 16; i++) { off[i] = total; total += sizes[i]; }
  float *p = calloc(total, sizeof(float));
  for (int i = 0; i < 16; i++) if (i == 2 || i == 8 || i == 14) for (long j = 0; j < sizes[i]; j++) p[off[i] + j] = 1.0f;
  float rs = 1.0f / sqrtf(2.0f * L);
  seed(42);
  for (long l = 0; l < L; l++) {
    for (int i = 0; i < 16; i++) {
      if (!((l == 0 && (i == 0 || i == 1)) || i == 4 || i == 6 || i == 10 || i == 12)) continue;
      long n = sizes[i], lo = 0;
      if (i == 0) n = V * C;
      if (i >= 4) { n = n / L; lo = l * n; }
      float std = (i == 6 || i == 12) ? 0.02f * rs : 0.02f;
      normal(p + off[i] + lo, (unsigned)n, 0.0f, std);
    }
  }
  fwrite(p, sizeof(float), total, stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def c_init(tmp_path_factory):
    """run(cfg, build="O2"): the C init's parameter buffer. Builds: "O2" is gcc -O2 (x86-64
    baseline: no FMA, like nvcc's host g++ -O3 for train_gpt2.cu); "native" is -O3
    -march=native, where gcc contracts `r * cosf(t) * std + mean` into an FMA on FMA CPUs."""
    from conftest import require
    from test_rand import C_CORE

    require(shutil.which("gcc") is not None, "gcc is not installed (looked for it on PATH)")

    d = tmp_path_factory.mktemp("initc")
    (d / "init.c").write_text(C_CORE + C_INIT_MAIN)
    exes = {}
    for build, flags in (("O2", ["-O2"]), ("native", ["-O3", "-march=native"])):
        r = subprocess.run(["gcc", *flags, "-o", str(d / build), str(d / "init.c"), "-lm"], capture_output=True)
        if r.returncode == 0:
            exes[build] = str(d / build)
    assert "O2" in exes

    def run(cfg, build="O2"):
        if build not in exes:
            pytest.skip(f"gcc cannot build with {build}")
        out = subprocess.run([exes[build], *map(str, (cfg.vocab_size, cfg.padded_vocab_size, cfg.max_seq_len,
                                                      cfg.num_layers, cfg.channels))],
                             check=True, capture_output=True).stdout
        return np.frombuffer(out, dtype=np.float32)
    return run


SMALL_CFGS = (GPT2Config(16, 100, 128, 3, 4, 24),   # odd sizes: wte V*C = 2400 (n % 16 == 0), fcw 2304, ...
              GPT2Config(13, 101, 128, 2, 2, 10),   # n % 16 != 0 everywhere: exercises the tail redo
              GPT2Config(3, 5, 8, 1, 1, 2))         # wpe 6, attprojw 4: the n < 16 float64 path



@pytest.mark.parametrize("build", ["O2", "native"])
def test_init_bit_identical_to_c_default(c_init, build):
    # the default init (llmctl._ext.randinit) uses the same logf/cosf/sinf as the C program:
    # every bit must agree. Also against -O3 -march=native: init draws have mean 0, so even an
    # FMA-contracted C build gives the same bits (fma(x, std, 0) rounds like x * std).
    for c in SMALL_CFGS:
        m = GPT2(c)
        init_llmc_(m.p, c)
        assert m.params.tobytes() == c_init(c, build).tobytes()


def test_init_ctypes_libm_exact(c_init):
    # the slow ctypes libm path (exact_libm=True without the extension), still bit-identical
    for c in SMALL_CFGS:
        m = GPT2(c)
        init_llmc_(m.p, c, libm="ctypes")
        assert m.params.tobytes() == c_init(c).tobytes()


def test_init_fallback_without_extension(c_init):
    # default init with the extension missing: NumPy math with a RuntimeWarning, a few ulps from
    # C on ~1% of draws (see test_rand.py), drawing the same words (so the layout is right).
    # The warning is given once per process: one for the two inits.
    from conftest import without_module

    cfgs = SMALL_CFGS[:2]
    got, warned = without_module("llmctl._ext.randinit", (
        "from llmctl.model import GPT2, GPT2Config, init_llmc_\nresult = []\n"
        f"for c in {cfgs!r}:\n    m = GPT2(c)\n    init_llmc_(m.p, c)\n    result.append(m.params.copy())"))
    assert len(warned) == 1 and "randinit is not built" in warned[0], warned
    for params, c in zip(got, cfgs):
        want = c_init(c)
        np.testing.assert_allclose(params, want, rtol=4 * 2.0 ** -23, atol=0)
        assert (params.view(np.uint32) == want.view(np.uint32)).mean() > 0.95


def test_from_descriptor_d6(c_init):
    m = GPT2.from_descriptor("d6", n_threads=2)
    assert m.num_parameters == 30_357_504
    assert not m.p["wte"][50257:].any() and (m.p["ln1w"] == 1).all() and not m.p["qkvb"].any()
    # the default path is exact: all 30M parameters bit-identical to the C init
    assert m.params.tobytes() == c_init(m.config).tobytes()
    assert abs(float(m.p["fcprojw"].std()) - 0.02 / np.sqrt(12)) < 1e-4
    assert abs(float(m.p["wte"][:50257].std()) - 0.02) < 1e-4


def test_against_pytorch_if_installed():
    # optional, independent of reference.py: the same tiny GPT-2 in PyTorch (float64) autograd
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    m, pr = _model(1, seed=13)
    ids, tg = _batch(2, 11, seed=14)
    m.zero_grad()
    loss = m.forward(ids, tg)
    m.backward()
    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in pr.items()}
    C, NH, V, L = CFG.channels, CFG.num_heads, CFG.vocab_size, CFG.num_layers
    x = P["wte"][torch.tensor(ids)] + P["wpe"][:ids.shape[1]]
    for l in range(L):
        h = F.layer_norm(x, (C,), P["ln1w"][l], P["ln1b"][l], eps=1e-5)
        q, k, v = F.linear(h, P["qkvw"][l], P["qkvb"][l]).split(C, dim=-1)
        q, k, v = (t.view(2, -1, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, -1, C)
        x = x + F.linear(y, P["attprojw"][l], P["attprojb"][l])
        h = F.gelu(F.linear(F.layer_norm(x, (C,), P["ln2w"][l], P["ln2b"][l], eps=1e-5), P["fcw"][l], P["fcb"][l]),
                   approximate="tanh")
        x = x + F.linear(h, P["fcprojw"][l], P["fcprojb"][l])
    logits = F.layer_norm(x, (C,), P["lnfw"], P["lnfb"], eps=1e-5) @ P["wte"].T
    tloss = F.cross_entropy(logits[..., :V].reshape(-1, V), torch.tensor(tg).reshape(-1))
    tloss.backward()
    assert abs(loss - tloss.item()) <= REL * tloss.item()
    for name in PARAM_NAMES:
        _close(m.g[name], P[name].grad.numpy(), f"grad {name} vs torch")


def test_bind_grads_moves_gradients_into_the_given_buffer():
    m, _ = _model(1, seed=12)
    twin, _ = _model(1, seed=12)
    x, y = _batch(2, 8, seed=4)
    for model in (m, twin):
        model.forward(x, y)
        model.backward()
    buf = np.full(m.num_parameters, np.nan, dtype=np.float32)
    assert m.bind_grads(buf) is buf
    assert m.grads is buf
    np.testing.assert_array_equal(buf, twin.grads)  # the current grads were copied in
    for name in PARAM_NAMES:
        assert np.shares_memory(m.g[name], buf) and m.g[name].shape == twin.g[name].shape
    # the next backward accumulates into buf, exactly as into the model's own buffer
    for model in (m, twin):
        model.forward(x, y)
        model.backward()
    np.testing.assert_array_equal(buf, twin.grads)
    assert m.grad_norm() == twin.grad_norm()
    m.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1)
    twin.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1)
    np.testing.assert_array_equal(m.params, twin.params)
    m.zero_grad()
    assert not buf.any()
    for bad in (np.zeros(m.num_parameters - 1, np.float32), np.zeros(m.num_parameters, np.float64),
                np.zeros((2, m.num_parameters), np.float32)[:, 0], [0.0] * m.num_parameters):
        with pytest.raises(ValueError, match="num_parameters"):
            m.bind_grads(bad)
    assert m.grads is buf


def test_load_and_peek_config_resolve_checkpoints_and_descriptors(tmp_path):
    from llmctl.model import peek_config

    m, _ = _model(1, seed=13)
    p3, p5 = tmp_path / "m3.bin", tmp_path / "m5.bin"
    m.save_checkpoint(p3)
    m.save_checkpoint(p5, dtype="bfloat16")
    assert peek_config(str(p3)) == peek_config(p5) == CFG
    m3 = load(str(p3), n_threads=1)
    assert m3.config == CFG and m3.params.tobytes() == m.params.tobytes()
    assert load(p5, n_threads=1).params.tobytes() == GPT2.from_checkpoint(p5).params.tobytes()
    assert peek_config("d6") == GPT2Config.from_descriptor("d6") == GPT2Config(1024, 50257, 50304, 6, 6, 384)
    assert peek_config("gpt3:c768") == GPT2Config(2048, 50257, 50304, 12, 12, 768)
    for missing in (str(tmp_path / "missing.bin"), str(tmp_path / "sub" / "d12")):
        with raises_error(FormatError, names=missing):
            peek_config(missing)
        with raises_error(FormatError, names=missing):
            load(missing)
    with raises_error(ConfigError, names="d5"):
        peek_config("d5")
    with raises_error(ConfigError, names="gpt9"):
        load("gpt9")


def test_engine_picks_the_gemm_and_matmul_is_its_former_name():
    for kw in ({"engine": "blas"}, {"matmul": "blas"}, {"engine": "blas", "matmul": "blas"}):
        m = GPT2(CFG, n_threads=1, **kw)
        assert m.engine == "blas" and m.ops.engine == "blas", kw
    assert GPT2(CFG, n_threads=1).engine is None  # the default engine, chosen per call
    with raises_error(ConfigError, names=["engine=", "matmul="]):
        GPT2(CFG, n_threads=1, engine="blas", matmul="tiled")
    m = GPT2(CFG, n_threads=1, engine="cuda")
    with pytest.raises(ValueError, match="unknown matmul engine 'cuda'"):
        m.forward(np.zeros((1, 4), np.int32))
