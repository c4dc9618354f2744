"""Tests for llmctl.sample / _ext/kvcache.pyx / _ext/sampler.pyx / `llmctl sample`: the KV-cached
forward against a full forward and the float64 NumPy reference, greedy decoding against the reference's greedy,
llm.c's sampler arithmetic (vectors from compiling llm.c's sampler.h / random_u32 with gcc),
top-k/top-p, streaming decode, length limits and the CLI's --json output."""
import json

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

import reference as ref
from llmctl import formats
from llmctl.errors import ConfigError
from llmctl.model import GPT2
from llmctl.model.gpt2 import KVCache
from llmctl.sample import StreamDecoder, Xorshift, check_sample_length, generate, sample_token
from llmctl.tokenizer import get_tokenizer

V, Vp = 50257, 50304


def tiny_cfg(maxT=32, L=2, NH=4, C=32):
    return dict(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp, num_layers=L, num_heads=NH, channels=C)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer GPT-2 (C=32, maxT=32) as an llm.c checkpoint, the model and its float64 params."""
    cfg = tiny_cfg()
    P = ref.random_params(cfg, seed=1, std=0.1)
    path = tmp_path_factory.mktemp("tiny") / "tiny.bin"
    formats.write_checkpoint(str(path), cfg, ref.params_to_flat(P, cfg))
    # one thread: these shapes are far too small to gain from two, and on a loaded machine
    # OpenMP/BLAS threads that spin-wait for a busy core make tiny kernels 100x slower
    return GPT2.from_checkpoint(str(path), n_threads=1), P, cfg, str(path)


# ----------------------------------------------------------------------------------------------
# the kernel

def _attention_ref(qkv, kc, vc, pos, NH):
    """float64: query (b,t,h) of qkv (B,Tq,3C) against cache rows 0..pos[b]+t of kc/vc (B,NH,Tcap,hs)."""
    B, Tq, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    out = np.zeros((B, Tq, C))
    for b in range(B):
        for t in range(Tq):
            n = pos[b] + t + 1
            for h in range(NH):
                q = qkv[b, t, h * hs:(h + 1) * hs].astype(np.float64)
                s = kc[b, h, :n].astype(np.float64) @ q / np.sqrt(hs)
                a = np.exp(s - s.max())
                out[b, t, h * hs:(h + 1) * hs] = (a / a.sum()) @ vc[b, h, :n]
    return out


def _kv_isas():
    from llmctl._ext import kvcache

    prev, runs = kvcache.isa(), []
    try:
        for name in kvcache.ISAS:
            try:
                runs.append(kvcache.set_isa(name))
            except ValueError:
                pass
    finally:
        kvcache.set_isa(prev)
    return runs


@pytest.fixture(params=_kv_isas())
def kv_isa(request):
    """Run the test on one copy of the cached-attention kernel (each this CPU has)."""
    from llmctl._ext import kvcache

    prev = kvcache.set_isa(request.param)
    try:
        yield request.param
    finally:
        kvcache.set_isa(prev)


@pytest.mark.parametrize("B,Tq,NH,hs,threads,Tcap", [(1, 1, 4, 8, 1, 16), (3, 5, 2, 16, 2, 16), (2, 7, 3, 5, 2, 16),
                                                     (2, 9, 2, 64, 2, 103), (1, 3, 1, 40, 1, 37), (2, 4, 2, 20, 2, 29)])
def test_attention_cached_kernel_matches_numpy(B, Tq, NH, hs, threads, Tcap, kv_isa):
    from llmctl._ext.kvcache import attention_cached, kvcache_append_forward

    rng = np.random.default_rng(B * 100 + Tq)
    C = NH * hs
    pos = np.array([Tcap - Tq - b for b in range(B)], dtype=np.int32)   # different past per row
    kc = rng.normal(size=(B, NH, Tcap, hs)).astype(np.float32)
    vc = rng.normal(size=(B, NH, Tcap, hs)).astype(np.float32)
    qkv = rng.normal(size=(B, Tq, 3 * C)).astype(np.float32)
    kvcache_append_forward(kc.reshape(-1), vc.reshape(-1), qkv.reshape(-1), pos, B, Tq, C, NH, Tcap)
    for b in range(B):  # the new K/V landed at pos[b] + t
        for t in range(Tq):
            np.testing.assert_array_equal(kc[b, :, pos[b] + t].reshape(-1), qkv[b, t, C:2 * C])
            np.testing.assert_array_equal(vc[b, :, pos[b] + t].reshape(-1), qkv[b, t, 2 * C:])
    out = np.empty((B, Tq, C), dtype=np.float32)
    attention_cached(out.reshape(-1), qkv.reshape(-1), kc.reshape(-1), vc.reshape(-1), pos,
                     B, Tq, C, NH, Tcap, threads)
    # float32 dot products of <= 64 terms and a <= 103-term softmax: 1e-5 is ~100 ulp of O(1) values
    np.testing.assert_allclose(out, _attention_ref(qkv, kc, vc, pos, NH), atol=1e-5, rtol=1e-5)
    out1 = np.empty_like(out)
    attention_cached(out1.reshape(-1), qkv.reshape(-1), kc.reshape(-1), vc.reshape(-1), pos,
                     B, Tq, C, NH, Tcap, 1)
    np.testing.assert_array_equal(out, out1)  # one thread computes each query whole


@pytest.mark.parametrize("hs,threads", [(64, 2), (20, 1), (5, 2)])
def test_attention_cached_prefix_gives_the_bits_of_one_cache(hs, threads, kv_isa):
    # HellaSwag's endings read their context's K/V where the context's rows wrote them: the same
    # bits as a cache per row holding a copy of the context (the kernel's sums run over key
    # positions, wherever the keys lie), for rows of different prefix lengths, one of them 0
    from llmctl._ext.kvcache import attention_cached, kvcache_append_forward

    rng = np.random.default_rng(hs)
    NH, P, Tp, B, Tq = 3, 3, 11, 5, 4
    C = NH * hs
    rows_of = np.array([0, 2, 1, 1, 2], np.int32)
    lengths = np.array([11, 0, 6, 9, 3], np.int32)
    kpre = rng.normal(size=(P, NH, Tp, hs)).astype(np.float32)
    vpre = rng.normal(size=kpre.shape).astype(np.float32)
    qkv = rng.normal(size=(B, Tq, 3 * C)).astype(np.float32)
    Tcap = Tp + Tq
    kf, vf = np.full((B, NH, Tcap, hs), np.nan, np.float32), np.full((B, NH, Tcap, hs), np.nan, np.float32)
    for b in range(B):
        kf[b, :, :lengths[b]] = kpre[rows_of[b], :, :lengths[b]]
        vf[b, :, :lengths[b]] = vpre[rows_of[b], :, :lengths[b]]
    kvcache_append_forward(kf.reshape(-1), vf.reshape(-1), qkv.reshape(-1), lengths, B, Tq, C, NH, Tcap)
    want = np.empty((B, Tq, C), np.float32)
    attention_cached(want.reshape(-1), qkv.reshape(-1), kf.reshape(-1), vf.reshape(-1), lengths,
                     B, Tq, C, NH, Tcap, threads)
    np.testing.assert_allclose(want, _attention_ref(qkv, kf, vf, lengths, NH), atol=1e-5, rtol=1e-5)
    ko, vo = np.full((B, NH, Tq, hs), np.nan, np.float32), np.full((B, NH, Tq, hs), np.nan, np.float32)
    kvcache_append_forward(ko.reshape(-1), vo.reshape(-1), qkv.reshape(-1), np.zeros(B, np.int32),
                           B, Tq, C, NH, Tq)
    got = np.full((B, Tq, C), np.nan, np.float32)
    attention_cached(got.reshape(-1), qkv.reshape(-1), ko.reshape(-1), vo.reshape(-1), lengths,
                     B, Tq, C, NH, Tq, threads, prefix=(kpre.reshape(-1), vpre.reshape(-1), rows_of, lengths, Tp))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("hs,Tq,threads", [(64, 21, 2), (64, 17, 1), (20, 11, 2), (40, 9, 1)])
def test_attention_cached_query_gives_the_bits_of_itself_alone(hs, Tq, threads, kv_isa):
    # a prompt's queries run in blocks that share each key's reads (the AVX-512 copy): every query
    # must still get the bits it gets alone, as a decode step computes it, wherever it falls in
    # its block, with or without a prefix, for rows of different pasts
    from llmctl._ext.kvcache import attention_cached, kvcache_append_forward

    rng = np.random.default_rng(hs * 100 + Tq)
    NH, B, P, Tp = 2, 3, 2, 19
    C = NH * hs
    qkv = rng.normal(size=(B, Tq, 3 * C)).astype(np.float32) * 2
    kpre = rng.normal(size=(P, NH, Tp, hs)).astype(np.float32)
    vpre = rng.normal(size=kpre.shape).astype(np.float32)
    for prefix in (None, (np.array([1, 0, 1], np.int32), np.array([19, 0, 7], np.int32))):
        Tcap = Tq + 13
        pos = np.array([13, 0, 5], np.int32) if prefix is None else prefix[1]
        kc = rng.normal(size=(B, NH, Tcap, hs)).astype(np.float32)
        vc = rng.normal(size=kc.shape).astype(np.float32)
        app = pos if prefix is None else np.zeros(B, np.int32)
        kvcache_append_forward(kc.reshape(-1), vc.reshape(-1), qkv.reshape(-1), app, B, Tq, C, NH, Tcap, threads)
        pre = None if prefix is None else (kpre.reshape(-1), vpre.reshape(-1), prefix[0], prefix[1], Tp)
        whole = np.full((B, Tq, C), np.nan, np.float32)
        attention_cached(whole.reshape(-1), qkv.reshape(-1), kc.reshape(-1), vc.reshape(-1), pos, B, Tq, C, NH,
                         Tcap, threads, prefix=pre)
        np.testing.assert_allclose(whole, _attention_ref(qkv, *_one_cache(kc, vc, kpre, vpre, prefix, Tcap + Tp),
                                                         pos, NH), atol=1e-5, rtol=1e-5)
        for b in range(B):
            for t in range(Tq):
                one = np.full(C, np.nan, np.float32)
                # row b alone, query t alone: the cache holds its keys up to its own position
                sub = None if pre is None else (pre[0], pre[1], prefix[0][b:b + 1], prefix[1][b:b + 1], Tp)
                attention_cached(one, np.ascontiguousarray(qkv[b, t]), np.ascontiguousarray(kc[b]).reshape(-1),
                                 np.ascontiguousarray(vc[b]).reshape(-1), pos[b:b + 1] + t, 1, 1, C, NH, Tcap, 1,
                                 prefix=sub)
                np.testing.assert_array_equal(one, whole[b, t], err_msg=f"row {b}, query {t}")


def _one_cache(kc, vc, kpre, vpre, prefix, cap):
    """The caches of test_attention_cached_query_gives_the_bits_of_itself_alone as one cache per row
    (the prefix's keys first), for _attention_ref."""
    if prefix is None:
        return kc, vc
    rows, lens = prefix
    B, NH, Tcap, hs = kc.shape
    k1, v1 = np.zeros((B, NH, cap, hs), np.float32), np.zeros((B, NH, cap, hs), np.float32)
    for b in range(B):
        n = lens[b]
        k1[b, :, :n], v1[b, :, :n] = kpre[rows[b], :, :n], vpre[rows[b], :, :n]
        k1[b, :, n:n + Tcap], v1[b, :, n:n + Tcap] = kc[b], vc[b]
    return k1, v1


def test_kvcache_append_threads_write_the_same_caches():
    from llmctl._ext.kvcache import kvcache_append_forward

    rng = np.random.default_rng(3)
    B, Tq, NH, hs, Tcap = 3, 37, 4, 16, 50
    C = NH * hs
    qkv = rng.normal(size=(B, Tq, 3 * C)).astype(np.float32)
    pos = np.array([0, 13, 5], np.int32)
    caches = []
    for threads in (1, 2):
        kc, vc = np.full((B, NH, Tcap, hs), np.nan, np.float32), np.full((B, NH, Tcap, hs), np.nan, np.float32)
        kvcache_append_forward(kc.reshape(-1), vc.reshape(-1), qkv.reshape(-1), pos, B, Tq, C, NH, Tcap, threads)
        caches.append((kc, vc))
        for b in range(B):
            want_k = qkv[b, :, C:2 * C].reshape(Tq, NH, hs).transpose(1, 0, 2)
            np.testing.assert_array_equal(kc[b, :, pos[b]:pos[b] + Tq], want_k)
            assert np.isnan(kc[b, :, :pos[b]]).all() and np.isnan(vc[b, :, pos[b] + Tq:]).all()
    np.testing.assert_array_equal(caches[0][0], caches[1][0])
    np.testing.assert_array_equal(caches[0][1], caches[1][1])
    with pytest.raises(ValueError, match="n_threads"):
        kvcache_append_forward(kc.reshape(-1), vc.reshape(-1), qkv.reshape(-1), pos, B, Tq, C, NH, Tcap, 0)


def test_attention_cached_rejects_a_bad_prefix():
    from llmctl._ext.kvcache import attention_cached

    B, Tq, C, NH, Tcap, Tp = 2, 2, 8, 2, 2, 3
    kc = np.zeros(B * Tcap * C, np.float32)
    qkv = np.zeros(B * Tq * 3 * C, np.float32)
    out = np.zeros(B * Tq * C, np.float32)
    kp = np.zeros(2 * Tp * C, np.float32)
    rows_of, lengths = np.array([0, 1], np.int32), np.array([3, 2], np.int32)

    def call(pos=lengths, prefix=(kp, kp, rows_of, lengths, Tp)):
        attention_cached(out, qkv, kc, kc, np.asarray(pos, np.int32), B, Tq, C, NH, Tcap, 1, prefix=prefix)

    call()
    with pytest.raises(ValueError, match="prefix row 2 of 2"):
        call(prefix=(kp, kp, np.array([0, 2], np.int32), lengths, Tp))
    with pytest.raises(ValueError, match="prefix length 3 of Tp = 3, pos 2"):   # past its new positions
        call(pos=[2, 2])
    with pytest.raises(ValueError, match="Tcap = 2 after the prefix"):          # own cache too short
        call(pos=[4, 2])
    with pytest.raises(ValueError, match="whole rows"):
        call(prefix=(kp[:-1], kp[:-1], rows_of, lengths, Tp))
    with pytest.raises(ValueError, match="prefix values"):
        call(prefix=(kp, kp[:-1], rows_of, lengths, Tp))
    with pytest.raises(ValueError, match="prefix lengths"):
        call(prefix=(kp, kp, rows_of, lengths[:1], Tp))


def test_attention_cached_isa_selection():
    from llmctl._ext import kvcache

    assert kvcache.isa() == kvcache.set_isa(None) == _kv_isas()[-1]   # the best, by default
    with pytest.raises(ValueError, match="unknown kernel copy"):
        kvcache.set_isa("sse4")
    if "avx512" not in _kv_isas():
        with pytest.raises(ValueError, match="needs a CPU with AVX-512"):
            kvcache.set_isa("avx512")
    if "avx2" not in _kv_isas():
        with pytest.raises(ValueError, match="needs a CPU with AVX2"):
            kvcache.set_isa("avx2")


def test_kernel_rejects_bad_sizes():
    from llmctl._ext.kvcache import attention_cached, kvcache_append_forward

    B, Tq, C, NH, Tcap = 1, 2, 8, 2, 4
    kc = np.zeros(B * Tcap * C, np.float32)
    qkv = np.zeros(B * Tq * 3 * C, np.float32)
    out = np.zeros(B * Tq * C, np.float32)
    with pytest.raises(ValueError, match="pos\\[0\\]"):
        attention_cached(out, qkv, kc, kc, np.array([3], np.int32), B, Tq, C, NH, Tcap, 1)
    with pytest.raises(ValueError, match="qkv"):
        attention_cached(out, qkv[:-1], kc, kc, np.array([0], np.int32), B, Tq, C, NH, Tcap, 1)
    with pytest.raises(ValueError, match="multiple"):
        kvcache_append_forward(kc, kc, qkv, np.array([0], np.int32), B, Tq, C, 3, Tcap)


# ----------------------------------------------------------------------------------------------
# the cached forward

def test_cached_logits_equal_full_forward_at_every_position(tiny):
    model, P, cfg, _ = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, size=(3, 20)).astype(np.int32)
    model.forward(ids)
    full = model.logits()[..., :V].copy()
    _, ref_logits, _ = ref.gpt2_forward(P, ids, None, cfg)
    cache = KVCache(model.config, 3, 20)
    hs = [model.forward_cached(cache, ids[:, :7])]          # prefill 7, then 2 at once, then 1 by 1
    hs.append(model.forward_cached(cache, ids[:, 7:9]))
    for t in range(9, 20):
        hs.append(model.forward_cached(cache, ids[:, t:t + 1]))
    cached = model.logits_from_hidden(np.concatenate(hs, axis=1))
    assert cached.shape == (3, 20, V)
    # float32 paths that differ only in summation order (BLAS vs per-query attention) over
    # C=32-wide dot products and 2 layers; logits are O(3), so 1e-5 absolute is ~100 ulp.
    np.testing.assert_allclose(cached, full, atol=1e-5, rtol=0)
    np.testing.assert_allclose(cached, ref_logits[..., :V], atol=1e-5, rtol=0)
    assert list(cache.lengths) == [20, 20, 20]
    with pytest.raises(ValueError):
        model.forward_cached(cache, ids[:, :1])  # the cache is full


@pytest.mark.parametrize("precision,engine", [("fp32", None), ("bf16", None), ("bf16", "blas")])
def test_cached_attention_threads_only_beside_openmp_matmuls(precision, engine, monkeypatch):
    # a cache of 64K floats or more is read on both threads, but only where decode's one-row
    # matmuls run on OpenMP too: an OpenMP region between BLAS calls (fp32's GEMV, emulated
    # bf16's without a copy of the bf16 GEMV) leaves its threads spinning against BLAS's, and
    # fp32 decoding went 7x slower
    from llmctl._ext import matmul

    if precision == "bf16" and not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
        if engine is None:
            engine = "blas"   # without native bf16 the default engine is the emulation
    from llmctl.model import GPT2Config

    m = GPT2(GPT2Config(**tiny_cfg(maxT=320, L=1, NH=4, C=256)), n_threads=2, precision=precision, engine=engine)
    used = []
    kv = m.kernels.kvcache

    class Recording:
        def __getattr__(self, name):
            return getattr(kv, name)

        def attention_cached(self, *a, **kw):
            used.append(a[10])    # n_threads
            return kv.attention_cached(*a, **kw)

    class RecordingDecode:      # a bf16 decode step's layers in one call: its attention's threads
        def decode_layers_bf16(self, *a):
            used.append(a[13])
            return dec.decode_layers_bf16(*a)

    dec = m.kernels.decode
    m.kernels.kvcache, m.kernels.decode = Recording(), RecordingDecode()
    cache = KVCache(m.config, 1, 300)     # B * Tcap * C = 76,800 floats
    m.forward_cached(cache, np.array([[1, 2, 3]], dtype=np.int32))
    m.forward_cached(cache, np.array([[4]], dtype=np.int32))
    # bf16's few-row products run on the GEMV (OpenMP) wherever a copy of it runs, whatever the engine
    want = 2 if precision == "bf16" and (engine != "blas" or matmul.gemv_bf16_available()) else 1
    assert used == [want, want]
    # and so does the sampler's exp pass
    from llmctl._ext import sampler

    sampled = []
    softmax = sampler.sample_softmax
    monkeypatch.setattr(sampler, "sample_softmax", lambda lg, c, nt=1: sampled.append(nt) or softmax(lg, c, nt))
    generate(m, [1, 2, 3], 3, stop_at_eot=False)
    assert sampled == [want] * 3


def test_block_forward_and_logits_write_into_a_given_buffer(tiny):
    # HellaSwag scoring keeps its residual streams and logits across batches: out=x (in place)
    # and a kept logits buffer give the same bits as fresh arrays; a wrong buffer is refused
    model, _, cfg, _ = tiny
    ids = np.random.default_rng(1).integers(0, V, size=(2, 6)).astype(np.int32)
    L, NH, C = model.config.num_layers, model.config.num_heads, model.config.channels
    pos = np.zeros(2, np.int32)
    outs = []
    for inplace in (False, True):
        x = model.embed(ids, pos)
        k = np.full((2, NH, 6, C // NH), np.nan, np.float32)
        v = np.full_like(k, np.nan)
        for l in range(L):
            y = model.block_forward(l, x, k, v, pos, out=x if inplace else None)
            assert np.shares_memory(y, x) == inplace
            x = y
        h = model.final_norm(x)
        buf = np.full(h.shape[0] * V, np.nan, np.float32) if inplace else None
        lg = model.logits_from_hidden(h, buf)
        assert np.shares_memory(lg, buf) if inplace else True
        outs.append(lg.copy())
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="out must be"):
        model.logits_from_hidden(h, np.empty(h.shape[0] * V + 1, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        model.block_forward(0, model.embed(ids, pos), k, v, pos, out=np.empty(12 * C, np.float64))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_forward_parts_equals_a_call_per_part(precision, monkeypatch):
    # HellaSwag's scoring: the context rows and their endings' rows through one call per layer
    # (one matmul per weight over all rows, the endings reading the context's K/V as a prefix)
    # give the bits of a call per part with the context copied into each ending's cache
    from llmctl._ext import matmul
    from llmctl.model import GPT2Config
    from llmctl.model.gpt2 import KVPart

    if precision == "bf16" and not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    m = GPT2(GPT2Config(**tiny_cfg(maxT=64, L=2, NH=4, C=64)), n_threads=2, precision=precision)
    rng = np.random.default_rng(3)
    NH, hs = 4, 16
    E, Tx, n_ctx = 2, 7, np.array([7, 4], np.int32)
    ctx = rng.integers(0, V, size=(E, Tx))
    rows_of, Tq = np.array([1, 0, 1], np.int32), 3
    ends = rng.integers(0, V, size=(3, Tq))
    pos = n_ctx[rows_of]
    x0 = np.concatenate([m.embed(ctx, np.zeros(E, np.int32)), m.embed(ends, pos)])
    # one call per layer
    k, v = np.empty((E, NH, Tx, hs), np.float32), np.empty((E, NH, Tx, hs), np.float32)
    kg, vg = np.empty((3, NH, Tq, hs), np.float32), np.empty((3, NH, Tq, hs), np.float32)
    parts = [KVPart(k, v, np.zeros(E, np.int32), E * Tx),
             KVPart(kg, vg, pos, 3 * Tq, prefix=(k, v, rows_of, pos, Tx))]
    got = x0.copy()
    for l in range(2):
        m.block_forward_parts(l, got, parts, out=got)
    # a call per part, the context copied
    xc, xe = x0[:E * Tx].copy(), x0[E * Tx:].copy()
    kc, vc = np.empty((3, NH, Tx + Tq, hs), np.float32), np.empty((3, NH, Tx + Tq, hs), np.float32)
    for l in range(2):
        xc = m.block_forward(l, xc, k, v, np.zeros(E, np.int32))
        kc[:, :, :Tx], vc[:, :, :Tx] = k[rows_of], v[rows_of]
        xe = m.block_forward(l, xe, kc, vc, pos)
    np.testing.assert_array_equal(got, np.concatenate([xc, xe]))
    with pytest.raises(ValueError, match="the parts hold 20 rows, x 23"):
        m.block_forward_parts(0, x0, parts[:1] + [KVPart(kg, vg, pos, 6, prefix=parts[1].prefix)])
    with pytest.raises(ValueError, match="k must be a C-contiguous float32 cache"):   # appends would be lost
        m.block_forward_parts(0, x0, [KVPart(k[:, :, ::2], v, np.zeros(E, np.int32), E * Tx), parts[1]])
    with pytest.raises(ValueError, match="prefix v must be"):
        m.block_forward_parts(0, x0, [parts[0], KVPart(kg, vg, pos, 3 * Tq, prefix=(k, v[..., :8], rows_of, pos, Tx))])


def _bf16_model_or_skip(monkeypatch, **kw):
    """A bf16 model over tiny_cfg(**kw), emulated where this CPU has no native bf16, on 2 threads."""
    from llmctl._ext import matmul
    from llmctl.model import GPT2Config

    if not matmul.gemv_bf16_isas():
        pytest.skip("no copy of the bf16 GEMV runs on this CPU (it needs AVX2, or AVX512_BF16)")
    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    m = GPT2(GPT2Config(**tiny_cfg(**kw)), n_threads=2, precision="bf16")
    m.params[:] = np.random.default_rng(2).normal(0, 0.1, m.params.size)   # no zero biases, no unit norms
    m.params_changed()
    return m


def _decode_calls(m):
    """Record the model's calls of decode.decode_layers_bf16 (-> the list they are appended to)."""
    calls, dec = [], m.kernels.decode

    class Recording:
        def decode_layers_bf16(self, *a, **kw):
            calls.append(a[8])   # B
            return dec.decode_layers_bf16(*a, **kw)

    m.kernels.decode = Recording()
    return calls


def _decode_run(m, B, steps, one_call):
    """A prompt (rows of different lengths) then `steps` decode steps -> their hidden states."""
    rng = np.random.default_rng(B)
    cache = KVCache(m.config, B, 24)
    m.forward_cached(cache, rng.integers(0, V, size=(B, 6)).astype(np.int32))
    cache.lengths[:] = 6 - np.arange(B) % 3       # rows at different positions
    if not one_call:
        m._decode_layers = lambda x, c: False     # block_forward's layer loop
    try:
        return np.stack([m.forward_cached(cache, rng.integers(0, V, size=(B, 1)).astype(np.int32))
                         for _ in range(steps)])
    finally:
        m.__dict__.pop("_decode_layers", None)


@pytest.mark.parametrize("B", [1, 3, 4])
@pytest.mark.parametrize("gemv_isa", ["avx2", "avx512_bf16"])
def test_decode_step_in_one_call_gives_the_bits_of_the_layer_loop(B, gemv_isa, monkeypatch):
    # a bf16 decode step runs every layer in one call into decode.pyx, on the kernels the
    # Python layer loop calls: the same bits, on each copy of the GEMV, rows at different positions
    from llmctl._ext import matmul

    m = _bf16_model_or_skip(monkeypatch, maxT=32, L=3, NH=4, C=64)
    if gemv_isa not in matmul.gemv_bf16_isas():
        pytest.skip(f"this CPU runs no {gemv_isa} copy of the bf16 GEMV")
    old = matmul.set_gemv_isa(gemv_isa)
    try:
        calls = _decode_calls(m)
        got = _decode_run(m, B, 5, True)
        assert calls == [B] * 5
        want = _decode_run(m, B, 5, False)
        assert calls == [B] * 5
    finally:
        matmul.set_gemv_isa(old)
    np.testing.assert_array_equal(got, want)


def test_decode_step_falls_back_to_the_layer_loop_where_it_does_not_apply(monkeypatch):
    # more rows than the GEMV takes, a prompt, fp32, and level 3's layers casting their own
    # weights run the layer loop; level 3 with the weights lent between steps runs in one call
    from llmctl._ext import matmul
    from llmctl.model import GPT2Config

    m = _bf16_model_or_skip(monkeypatch, maxT=32, L=2, NH=4, C=64)
    calls = _decode_calls(m)
    rows = matmul.set_gemv_rows(4)
    try:
        _decode_run(m, 5, 2, True)
        assert calls == []
        f = GPT2(GPT2Config(**tiny_cfg(maxT=32, L=2, NH=4, C=64)), n_threads=2)
        f_calls = _decode_calls(f)
        _decode_run(f, 1, 2, True)
        assert f_calls == []
        m3 = GPT2(m.config, n_threads=2, precision="bf16", recompute=3)
        m3.params[:] = m.params
        m3.params_changed()
        c3 = _decode_calls(m3)
        got = _decode_run(m3, 2, 3, True)
        assert c3 == []                           # nothing to lend yet: each layer casts its own
        np.testing.assert_array_equal(got, _decode_run(m, 2, 3, False))
        m3.forward(np.ones((8, 32), np.int32))    # a forward that keeps every layer: its fc buffer (B*T >= 3C) is lent
        got = _decode_run(m3, 2, 3, True)
        assert c3 == [2, 2, 2] and m3.ops.held is not None
        np.testing.assert_array_equal(got, _decode_run(m, 2, 3, False))
    finally:
        matmul.set_gemv_rows(rows)


def test_decode_layers_rejects_bad_arguments(monkeypatch):
    from llmctl._ext import decode, matmul

    m = _bf16_model_or_skip(monkeypatch, maxT=32, L=2, NH=4, C=64)
    cache = KVCache(m.config, 2, 8)
    m._sync_bf16()
    wbuf, woff = m.ops.layer_weights_in(m.params_bf16)
    m._decode_layers(np.zeros((2, 64), np.float32), cache)
    poff = m._param_offs.reshape(-1)
    x = np.zeros(2 * 64, np.float32)
    good = dict(x=x, wbuf=wbuf, woff=woff.reshape(-1), params=m.params, poff=poff, kcache=cache.k.reshape(-1),
                vcache=cache.v.reshape(-1), pos=np.zeros(2, np.int32))

    def call(B=2, C=64, NH=4, Tcap=8, **kw):
        a = {**good, **kw}
        decode.decode_layers_bf16(a["x"], a["wbuf"], a["woff"], a["params"], a["poff"], a["kcache"],
                                  a["vcache"], a["pos"], B, C, NH, Tcap)

    call()
    with pytest.raises(ValueError, match="x has 64 elements, expected 128"):
        call(x=x[:64])
    with pytest.raises(ValueError, match="not 4 per layer"):
        call(woff=good["woff"][:7])
    with pytest.raises(ValueError, match="poff has 8 elements, expected 16"):
        call(poff=poff[:8])
    bad = good["woff"].copy()
    bad[5] = wbuf.size - 10
    with pytest.raises(ValueError, match=r"woff offset .* \(layer 1, tensor 1\)"):
        call(woff=bad)
    bad = poff.copy()
    bad[3] = -1
    with pytest.raises(ValueError, match=r"poff offset -1 \(layer 0, tensor 3\)"):
        call(poff=bad)
    with pytest.raises(ValueError, match="pos\\[1\\] = 8 is outside a cache of Tcap = 8"):
        call(pos=np.array([0, 8], np.int32))
    with pytest.raises(ValueError, match="kcache has"):
        call(kcache=good["kcache"][:-64])
    with pytest.raises(ValueError, match="not a multiple of NH"):
        call(NH=5)
    rows = matmul.set_gemv_rows(1)
    try:
        with pytest.raises(ValueError, match="no bf16 GEMV for 2 rows"):
            call()
    finally:
        matmul.set_gemv_rows(rows)


def test_cached_forward_refuses_beyond_maxT(tiny):
    model = tiny[0]
    cache = KVCache(model.config, 1, 40)
    with raises_error(ConfigError, names=["33", "32"], hint=None):  # the positions asked for, maxT
        model.forward_cached(cache, np.zeros((1, 33), np.int32))


def test_greedy_equals_reference_greedy(tiny):
    model, P, cfg, _ = tiny
    prompt = [50256, 464, 3290]
    want = ref.gpt2_greedy(P, prompt, 12, cfg)[len(prompt):]
    assert generate(model, prompt, 12, temperature=0, stop_at_eot=False) == want
    assert generate(model, prompt, 12, temperature=0, stop_at_eot=False, use_cache=False) == want


# ----------------------------------------------------------------------------------------------
# sampling

def test_xorshift_matches_llmc():
    # printed by llm.c's random_u32 / random_f32 compiled with gcc, state 1337
    r = Xorshift(1337)
    assert [r.random_u32() for _ in range(5)] == [989205090, 818269915, 1335155955, 3876892996, 2941700015]
    r = Xorshift(1337)
    assert [np.float32(r.random_f32()) for _ in range(3)] == [np.float32(x) for x in (0.230317235, 0.19051826, 0.310865164)]


def test_plain_sampling_is_llmc_sample_softmax():
    # llm.c's sample_softmax(l, 1000, random_f32(&s)) with s = 42, l[i] = ((i*37)%101)/17 - 3,
    # compiled with gcc -O2: the first 20 draws
    logits = (np.array([(i * 37) % 101 for i in range(1000)], np.float32) / np.float32(17.0)) - np.float32(3.0)
    r = Xorshift(42)
    coins = [r.random_f32() for _ in range(20)]
    want = [340, 785, 794, 946, 767, 838, 207, 441, 305, 674, 428, 341, 876, 190, 75, 614, 330, 313, 999, 333]
    assert [sample_token(logits, c) for c in coins] == want
    # the exps on two threads (a chunk each past 4096 ids): the same ids
    assert [sample_token(logits, c, n_threads=2) for c in coins] == want
    big = np.random.default_rng(5).normal(0, 3, size=V).astype(np.float32)
    coins = np.random.default_rng(6).random(200)
    got = [sample_token(big, c, n_threads=2) for c in coins]
    assert got == [sample_token(big, c) for c in coins] and len(set(got)) > 100


def test_top_k_top_p_temperature_distributions():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, size=200).astype(np.float32)
    order = np.argsort(-logits.astype(np.float64))
    coins = (np.arange(4000) + 0.5) / 4000  # a uniform grid: frequencies equal the CDF steps
    # top-k 1 and a tiny top-p are greedy whatever the coin
    assert {sample_token(logits, c, top_k=1) for c in coins[::97]} == {int(order[0])}
    assert {sample_token(logits, c, top_p=1e-6) for c in coins[::97]} == {int(order[0])}
    # top-k 5 at temperature 0.7: only the 5 best ids, with frequencies softmax(z/0.7) over them
    picks = np.array([sample_token(logits, c, temperature=0.7, top_k=5) for c in coins])
    top5 = order[:5]
    assert set(picks.tolist()) <= set(top5.tolist())
    z = logits[top5].astype(np.float64) / 0.7
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    freq = np.array([(picks == i).mean() for i in top5])
    np.testing.assert_allclose(freq, p, atol=1.0 / 4000 + 1e-9)   # grid resolution
    # top-p 0.5: the smallest most-likely prefix whose mass reaches 0.5
    pr = np.exp(logits.astype(np.float64) - logits.max())
    pr /= pr.sum()
    n_keep = int(np.searchsorted(np.cumsum(pr[order]), 0.5)) + 1
    picks = {sample_token(logits, c, top_p=0.5) for c in coins[::7]}
    assert picks == set(order[:n_keep].tolist())
    assert sample_token(logits, 0.3, temperature=0) == int(order[0])
    # temperature alone: frequencies softmax(z/T) over every id
    picks = np.array([sample_token(logits, c, temperature=2.0) for c in coins])
    z = logits.astype(np.float64) / 2.0
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(np.bincount(picks, minlength=200) / 4000, p, atol=1.0 / 4000 + 1e-9)


def test_same_seed_same_text_and_seeds_differ(tiny):
    model = tiny[0]
    a = generate(model, [50256], 15, seed=7, stop_at_eot=False)
    b = generate(model, [50256], 15, seed=7, stop_at_eot=False)
    c = generate(model, [50256], 15, seed=8, stop_at_eot=False)
    assert a == b and a != c
    # top-k/top-p/temperature samples are reproducible too
    kw = dict(temperature=0.8, top_k=50, top_p=0.9, seed=3, stop_at_eot=False)
    assert generate(model, [50256], 10, **kw) == generate(model, [50256], 10, **kw)
    # cache and full recompute draw the same tokens from the same coins
    assert generate(model, [50256, 11], 10, seed=5, stop_at_eot=False, use_cache=False) == \
        generate(model, [50256, 11], 10, seed=5, stop_at_eot=False)


def test_seed_0_and_seeds_outside_64_bits_are_errors_not_a_constant_or_aliased_stream():
    # xorshift64* from state 0 stays 0: every coin 0, every sampled token the lowest id
    for bad in (0, -1, 1 << 64, (1 << 64) + 1):
        with raises_error(ConfigError, names=f"--seed {bad}"):
            Xorshift(bad)
    assert Xorshift((1 << 64) - 1).random_u32() != Xorshift(1).random_u32()


def test_cli_sample_seed_0_is_a_usage_error_before_the_model_is_read(capsys):
    code, out, err = _run(["sample", "-e", "no-such-model.bin", "--seed", "0", "--json"], capsys)
    assert out == ""
    assert_cli_error(err, 2, code, names="--seed 0")


def test_length_limits(tiny):
    model = tiny[0]
    n, msg = check_sample_length(model.config, 10, 100)
    assert n == 22 and "maxT 32" in msg
    assert check_sample_length(model.config, 10, 22) == (22, None)
    with raises_error(ConfigError, names=["32"]):  # maxT
        generate(model, [1] * 10, 23)
    with raises_error(ConfigError, names=["32 tokens"]):  # the prompt's length
        check_sample_length(model.config, 32, 1)


# ----------------------------------------------------------------------------------------------
# text

def test_stream_decoder_splits_and_escapes():
    tok = get_tokenizer()
    text = "naïve 😀 ok\n\tbye \x1b[31mred\x07"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the prompt round-trips through the tokenizer
    # somewhere a token boundary falls inside a multi-byte character (the emoji is several tokens)
    assert any(not _is_utf8(tok.decode_bytes([i])) for i in ids)
    raw = StreamDecoder(tok, escape=False)
    pieces = [raw.feed(i) for i in ids] + [raw.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    esc = StreamDecoder(tok, escape=True)
    shown = "".join([esc.feed(i) for i in ids] + [esc.flush()])
    assert shown == "naïve 😀 ok\n\tbye \\x1b[31mred\\x07"


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ----------------------------------------------------------------------------------------------
# CLI

def _run(args, capsys):
    from llmctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_sample_json(tiny, capsys):
    model, P, cfg, path = tiny
    tok = get_tokenizer()
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt", "Hello, world", "-n", "8",
                           "--temperature", "0", "--num-samples", "2", "--json"], capsys)
    assert code in (0, None)
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines) == 2
    prompt = tok.encode("Hello, world")
    want = ref.gpt2_greedy(P, prompt, 8, cfg)[len(prompt):]
    for r in lines:
        assert r["prompt_tokens"] == prompt and tok.decode(r["prompt_tokens"]) == "Hello, world"
        assert r["tokens"] == want and r["text"] == tok.decode(want)


def test_cli_sample_truncates_n_beyond_maxT(tiny, capsys):
    path = tiny[3]
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "100", "--temperature", "0", "--json"], capsys)
    assert code in (0, None)
    r = json.loads(out)
    assert r["prompt_tokens"] == [50256]
    want = ref.gpt2_greedy(tiny[1], [50256], 31, tiny[2])[1:]  # maxT 32 leaves room for 31
    if 50256 in want:
        want = want[:want.index(50256) + 1]
    assert r["tokens"] == want
    assert "generating 31 tokens" in err




def test_cli_prompt_file_and_eot_text(tiny, tmp_path, capsys):
    path = tiny[3]
    pf = tmp_path / "p.txt"
    pf.write_text("<|endoftext|>A cat\n", encoding="utf-8")
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt-file", str(pf), "-n", "3",
                           "--temperature", "0", "--json"], capsys)
    assert code in (0, None)
    r = json.loads(out)
    tok = get_tokenizer()
    assert r["prompt_tokens"][0] == tok.eot and tok.decode(r["prompt_tokens"]) == "<|endoftext|>A cat\n"
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt", "x", "--prompt-file", str(pf)], capsys)
    assert_cli_error(err, 2, code, names=["--prompt", "--prompt-file"])
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt-file", str(tmp_path / "nope.txt")], capsys)
    assert_cli_error(err, 2, code, names=str(tmp_path / "nope.txt"))
    for bad, why in [(tmp_path / "nope.txt", "No such file"), (tmp_path, "Is a directory")]:
        code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt-file", str(bad)], capsys)
        assert_cli_error(err, 2, code, names=[f"--prompt-file {bad}", why])  # the OS's reason, in words
        assert "Errno" not in err
    (tmp_path / "bin.txt").write_bytes(b"ab\xff")
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt-file", str(tmp_path / "bin.txt")],
                          capsys)
    assert_cli_error(err, 2, code, names=[str(tmp_path / "bin.txt"), "UTF-8", "byte 2"])


# ----------------------------------------------------------------------------------------------
# extreme temperatures, non-finite settings, small vocabularies (reviewer's findings)

def test_tiny_temperature_is_greedy_and_non_finite_settings_are_rejected(tiny):
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, size=V).astype(np.float32)
    best = int(np.argmax(logits))
    assert best != V - 1  # the old NaN path fell through to the last id (EOT)
    for t in (1e-320, 5e-324, 1e-12, 1e-7):  # 1e-320 / 1e-12: z / T overflowed to inf - inf = NaN
        for kw in ({}, {"top_k": 5}, {"top_p": 0.9}):
            assert {sample_token(logits, c, temperature=t, **kw) for c in (0.01, 0.5, 0.99)} == {best}
    # just above the greedy cut-off, max-subtracted float64 logits stay finite: a gap of 1e-3 over
    # T = 1e-5 puts exp(-100) ~ 4e-44 on the runner-up, so every coin picks the best id
    two = np.full(8, -5.0, np.float32)
    two[3], two[6] = 1.0, 0.999
    assert {sample_token(two, c, temperature=1e-5) for c in (0.0, 0.5, 0.999999)} == {3}
    model = tiny[0]
    for bad in ({"temperature": float("inf")}, {"temperature": float("nan")}, {"temperature": -1.0},
                {"top_p": float("nan")}, {"top_p": float("inf")}):
        with pytest.raises(ConfigError):
            generate(model, [1, 2], 2, **bad)
    # generation at T = 1e-320 equals greedy (T = 0)
    assert generate(model, [1, 2], 4, temperature=1e-320) == generate(model, [1, 2], 4, temperature=0)


def test_cli_rejects_non_finite_temperature(tiny, capsys):
    path = tiny[3]
    for flag in (["--temperature", "inf"], ["--temperature", "nan"], ["--top-p", "nan"]):
        code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "2"] + flag, capsys)
        assert code == 2 and "Traceback" not in err, (flag, err)


def test_sample_without_prompt_on_a_small_vocabulary_starts_from_token_0(tmp_path, capsys):
    cfg = dict(max_seq_len=16, vocab_size=1000, padded_vocab_size=1024, num_layers=1, num_heads=2, channels=16)
    P = ref.random_params(cfg, seed=4, std=0.1)
    path = tmp_path / "small.bin"
    formats.write_checkpoint(str(path), cfg, ref.params_to_flat(P, cfg))
    model = GPT2.from_checkpoint(str(path), n_threads=1)
    want = ref.gpt2_greedy(P, [0], 3, cfg)[1:]
    assert generate(model, [], 3, temperature=0) == want
    code, out, err = _run(["sample", "--threads", "1", "-e", str(path), "-n", "3", "--temperature", "0",
                           "--json", "--num-samples", "2"], capsys)
    assert code in (0, None), err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [[0], [0]] and rows[0]["tokens"] == want
    assert err.count("starting from token 0") == 1


# ----------------------------------------------------------------------------------------------
# the CLI against a float64 reference sampler (llm.c's xorshift64* coins, tests/loop_reference.py)

HOT = {" cat": 3.0, " sat": 2.6, " on": 2.2, " the": 1.8, " mat": 1.4}
EOT_LOGIT = 1.6  # p(EOT) ~ 0.09 per token: a sample stops where the coins say


@pytest.fixture(scope="module")
def fixed_next_token(tmp_path_factory):
    """A GPT-2 whose next-token logits are the same vector z at every position: lnfw = 0 makes
    the final LayerNorm's output exactly lnfb = u (unit), and wte[:V] @ u = z. z puts nearly
    all the mass on five words and EOT (the rest at -20: 2e-6 of it), so every coin falls well
    inside one token's interval and float32 logits pick the ids float64 ones do.
    -> (checkpoint path, z as float64 from the float32 weights, {word: id})."""
    cfg = tiny_cfg()
    tok = get_tokenizer()
    assert all(len(tok.encode(w)) == 1 for w in HOT)
    ids = {w: tok.encode(w)[0] for w in HOT}
    z = np.full(V, -20.0)
    for w, v in HOT.items():
        z[ids[w]] = v
    z[50256] = EOT_LOGIT
    P = ref.random_params(cfg, seed=4, std=0.1)
    rng = np.random.default_rng(4)
    u = rng.normal(size=cfg["channels"])
    u /= np.linalg.norm(u)
    noise = rng.normal(0, 0.1, size=(V, cfg["channels"]))
    P["wte"][:V] = np.outer(z, u) + noise - np.outer(noise @ u, u)
    P["lnfw"][:] = 0.0
    P["lnfb"][:] = u
    path = tmp_path_factory.mktemp("fixed") / "fixed.bin"
    formats.write_checkpoint(str(path), cfg, ref.params_to_flat(P, cfg))
    P32 = ref.params_from_flat(ref.params_to_flat(P, cfg), cfg)
    _, logits, _ = ref.gpt2_forward(P32, np.array([[50256, 11, 12]]), None, cfg)
    assert np.allclose(logits[0, :, :V], logits[0, 0, :V]) and np.allclose(logits[0, 0, :V], z, atol=1e-5)
    return str(path), logits[0, 0, :V], ids


def _ref_sample(z, n, seed, temperature=1.0, top_k=0):
    """llm.c's sample_softmax (temperature 1, no top-k) or softmax(z / T) over the top_k ids, the
    coin walking the CDF in id order; stops after EOT. The ids it draws."""
    import loop_reference as LR

    rng, out = LR.XorShift(seed), []
    p = np.exp((z - z.max()) / temperature)
    if top_k:
        p[np.argsort(-z)[top_k:]] = 0.0
    for _ in range(n):
        coin = rng.random_f32()
        i = LR.sample_softmax(z, coin) if temperature == 1.0 and not top_k else \
            int(np.searchsorted(np.cumsum(p), coin * p.sum(), side="right"))
        out.append(i)
        if i == 50256:
            break
    return out


def test_cli_sample_stops_at_eot(fixed_next_token, capsys):
    path, z, _ = fixed_next_token
    want = _ref_sample(z, 30, seed=11)
    assert 3 <= len(want) < 30 and want[-1] == 50256 and 50256 not in want[:-1]  # the case tested
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "30", "--seed", "11", "--json"], capsys)
    assert code in (0, None)
    assert json.loads(out)["tokens"] == want


def test_cli_sample_streams_text(fixed_next_token, capsys):
    """The prompt, then each sampled word as it comes (the float64 reference's draws; the words
    are known by construction), no EOT text, a newline; the speed on stderr."""
    path, z, ids = fixed_next_token
    want = _ref_sample(z, 30, seed=11)
    word = {i: w for w, i in ids.items()}
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "--prompt", "Once", "-n", "30",
                           "--seed", "11"], capsys)
    assert code in (0, None)
    assert out == "Once" + "".join(word[i] for i in want[:-1]) + "\n"
    assert "tokens/s" in err
    # the count ends short of -n because the sample reached EOT: the speed line says so
    assert f"; stopped at <|endoftext|>, token {len(want)} of -n 30" in err.splitlines()[-1]


def test_cli_sample_says_which_samples_stopped_at_eot(fixed_next_token, capsys):
    path, z, _ = fixed_next_token
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "30", "--seed", "11",
                           "--num-samples", "3", "--json"], capsys)
    assert code in (0, None)
    got = [json.loads(ln) for ln in out.splitlines()]
    want = _ref_sample(z, 30, seed=11)
    assert got[0]["tokens"] == want and got[0]["stopped_at_eot"]
    assert [r["stopped_at_eot"] for r in got] == [r["tokens"][-1] == 50256 for r in got]
    k = sum(r["stopped_at_eot"] for r in got)
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "30", "--seed", "11",
                           "--num-samples", "3"], capsys)
    assert err.splitlines()[-1].endswith(f"; {k} of 3 samples stopped at <|endoftext|> (-n 30)")


def test_cli_sample_top_k_keeps_the_k_most_likely(fixed_next_token, capsys):
    path, z, ids = fixed_next_token
    want = _ref_sample(z, 24, seed=5, temperature=0.8, top_k=3)
    assert len(want) == 24 and set(want) == {ids[" cat"], ids[" sat"], ids[" on"]}  # never EOT
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "24", "--seed", "5",
                           "--temperature", "0.8", "--top-k", "3", "--json"], capsys)
    assert code in (0, None)
    assert json.loads(out)["tokens"] == want and not json.loads(out)["stopped_at_eot"]
    code, out, err = _run(["sample", "--threads", "1", "-e", path, "-n", "24", "--seed", "5",
                           "--temperature", "0.8", "--top-k", "3"], capsys)
    assert "tokens/s" in err and "endoftext" not in err  # ran to -n: no note

