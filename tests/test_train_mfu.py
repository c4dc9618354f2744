"""MFU: over the GEMM roof of the precision the run's matmuls multiply in, measured at start-up,
again when a step beats it, and the best roof cached for this CPU.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import pytest

from trainkit import TINY, n_params, cfg_for, metrics
from llmctl._ext import matmul as _matmul
from llmctl.display import PlainDisplay
from llmctl.train import train


_NATIVE_BF16 = _matmul.bf16_native()


def _spy_bf16_matmul(monkeypatch):
    """Record the calls of the real matmul_forward_bf16 (it still runs)."""
    from llmctl._ext import matmul

    calls, real = [], matmul.matmul_forward_bf16

    def spy(*a, **k):
        calls.append(a[4:] + tuple(k.values()))
        return real(*a, **k)
    monkeypatch.setattr(matmul, "matmul_forward_bf16", spy)
    return calls


@pytest.mark.skipif(_NATIVE_BF16, reason="this CPU multiplies bf16 natively: bf16 is not emulated")
def test_peak_flops_of_emulated_bf16_is_the_fp32_roof(monkeypatch):
    # emulated bf16 multiplies widened operands in fp32 sgemm: the fp32 roof is its denominator
    import llmctl.mfu as tr

    monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    monkeypatch.setattr(tr, "_PEAK_CACHE", {})
    calls = _spy_bf16_matmul(monkeypatch)
    assert tr.mfu_roof_precision("bf16") == "fp32" == tr.mfu_roof_precision("fp32")
    bf16 = tr.measure_peak_flops(1, "bf16")
    assert bf16 > 0 and calls == []                   # no bf16 GEMM was timed
    assert tr.measure_peak_flops(1, "fp32") == bf16   # one fp32 measurement serves both
    assert list(tr._PEAK_CACHE) == [(1, "fp32")]


@pytest.mark.skipif(not _NATIVE_BF16, reason="no native bf16 on this CPU (AVX512_BF16/AMX): "
                                             "oneDNN's bf16 GEMM cannot run, so there is no bf16 roof")
def test_peak_flops_of_native_bf16_times_llmctls_bf16_matmul(monkeypatch):
    import llmctl.mfu as tr

    monkeypatch.setattr(tr, "_PEAK_CACHE", {})
    calls = _spy_bf16_matmul(monkeypatch)
    assert tr.mfu_roof_precision("bf16") == "bf16"
    peak = tr.measure_peak_flops(2, "bf16")
    # a warm-up and best of 3, each one 1024^3 bf16 GEMM on the native engine
    assert calls == [(1024, 1024, 1024, 2, "dnnl")] * 4 and peak > 0
    assert tr.measure_peak_flops(2, "fp32") > 0 and set(tr._PEAK_CACHE) == {(2, "bf16"), (2, "fp32")}
    assert len(calls) == 4   # the fp32 roof is NumPy's sgemm, not the bf16 kernel


def test_a_step_faster_than_the_peak_measures_the_peak_again_and_keeps_the_best(data, tmp_path, monkeypatch):
    """The peak is timed once at start-up in ~0.1 s; taken while other processes held the cores
    it reads low and MFU shows over 100 %. A step that beats it measures again (keeping the best
    of all measurements), at most PEAK_RECHECKS times a run."""
    import llmctl.train as tr

    asked = []

    def peak(n_threads, precision="fp32", again=False):
        asked.append(again)
        return 1.0 if not again else 1.0 + sum(asked)   # far below any real step's FLOP/s
    monkeypatch.setattr(tr, "measure_peak_flops", peak)
    train(cfg_for(data, tmp_path / "o", max_steps=6, val_loss_every=0))
    assert asked == [False] + [True] * tr.PEAK_RECHECKS
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    # tokens_per_s / mfu = peak * tokens / flops: the peak each step was divided by, up to a constant
    used = [r["tokens_per_s"] / r["mfu"] for r in recs]
    # step 0 beat 1.0 and measured 2.0, steps 1 and 2 measured 3.0 and 4.0, then no more re-checks
    assert [2.0 * u / used[0] for u in used] == pytest.approx([2.0, 3.0, 4.0, 4.0, 4.0, 4.0])

    # a real peak is not re-measured by ordinary steps (the tiny model runs far below it)
    asked.clear()
    monkeypatch.setattr(tr, "measure_peak_flops", lambda n, p="fp32", again=False: asked.append(again) or 1e15)
    train(cfg_for(data, tmp_path / "p", max_steps=3, val_loss_every=0))
    assert asked == [False]


def test_measure_peak_flops_again_keeps_the_best_measurement(monkeypatch):
    import llmctl.mfu as tr

    monkeypatch.setattr(tr, "_PEAK_CACHE", {(1, "fp32"): 1e18})   # an earlier, better reading
    assert tr.measure_peak_flops(1, "fp32") == 1e18                # cached
    assert tr.measure_peak_flops(1, "fp32", again=True) == 1e18    # measured anew, lower: kept
    tr._PEAK_CACHE[(1, "fp32")] = 1.0
    assert tr.measure_peak_flops(1, "fp32", again=True) > 1e6      # measured anew, higher: taken


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_in_metrics_is_flops_over_time_over_the_peak_of_the_precision(data, tmp_path, monkeypatch,
                                                                          precision):
    import llmctl.train as tr

    if precision == "bf16" and not _NATIVE_BF16:
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    peaks, asked = {"fp32": 3.0e15, "bf16": 7.0e15}, []   # above any step's FLOP/s: never re-measured

    def peak(n_threads, precision="fp32", again=False):
        asked.append((n_threads, precision))
        return peaks[precision]
    monkeypatch.setattr(tr, "measure_peak_flops", peak)
    import io

    shown = io.StringIO()
    train(cfg_for(data, tmp_path / "o", max_steps=3, val_loss_every=0, total_batch_size=2 * 4 * 32,
                  precision=precision), display=PlainDisplay(shown))
    assert asked == [(1, precision)]
    # the step lines name the roof: bf16's only where bf16 multiplies natively
    roof = "bf16" if precision == "bf16" and _NATIVE_BF16 else "fp32"
    assert shown.getvalue().count(f"% {roof} MFU |") == 3, shown.getvalue()
    c = TINY
    N = n_params(**c)
    flops_per_step = (6 * N + 6 * c["L"] * c["C"] * 32) * 4 * 32 * 2   # llm.c's count, B=4 T=32, 2 micro-steps
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    assert len(recs) == 3
    for r in recs:
        assert r["mfu"] == pytest.approx(flops_per_step / (r["ms"] / 1000.0) / peaks[precision], rel=1e-12)


def test_mfu_is_over_the_best_roof_cached_for_this_cpu_and_the_header_says_so(data, tmp_path, monkeypatch):
    """A start-up measurement below the best one cached for this CPU (other processes held the
    cores) does not lower the roof: MFU stays comparable between runs, and the header names it."""
    import io

    import llmctl.train as tr
    from llmctl import roof

    roof.best_roof(5.0e15, 1, "fp32")  # an earlier run's better measurement, this CPU and engine
    monkeypatch.setattr(tr, "measure_peak_flops", lambda n, p="fp32", again=False: 3.0e15)
    shown = io.StringIO()
    train(cfg_for(data, tmp_path / "o", max_steps=2, val_loss_every=0), display=PlainDisplay(shown))
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    flops_per_step = (6 * n_params(**TINY) + 6 * TINY["L"] * TINY["C"] * 32) * 4 * 32
    for r in recs:
        assert r["mfu"] == pytest.approx(flops_per_step / (r["ms"] / 1000.0) / 5.0e15, rel=1e-12)
    path = roof.roof_path()
    header = [ln for ln in shown.getvalue().splitlines() if ln.startswith("| peak_flops")]
    assert len(header) == 1 and "5000000.0 GFLOP/s (fp32 GEMM 1024^3: best of 2 measurements on " \
        f"this CPU at 1 thread, cached in {path})" in header[0], header
    assert [e["measurements"] for e in roof.cached_roofs()] == [2]
