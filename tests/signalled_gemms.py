"""Child process of test_kernels.py's signal test: oneDNN GEMMs in a loop while SIGUSR1 arrives.

Usage: python signalled_gemms.py SECONDS N_THREADS [N_THREADS ...]

Runs llm.c's matmul forward and backward on the dnnl engine (fp32, and bf16 on both oneDNN
paths, the matmul primitive and the gemm call, where the CPU has it) with K > 84, where oneDNN's
nocopy sgemm kernels run on a heap workspace instead of the stack, and checks every result against NumPy. Prints "ready" once the handler is installed, then
"<gemm calls> <signals handled> <wrong results>" and exits 1 if any result was wrong. A signal
frame pushed onto that workspace corrupts the heap: the process then aborts or computes garbage.
"""
import signal
import sys
import time

import numpy as np

from llmctl._ext import convert, matmul

handled = 0


def on_signal(signum, frame):
    global handled
    handled += 1


def main():
    seconds = float(sys.argv[1])
    thread_counts = [int(a) for a in sys.argv[2:]]
    signal.signal(signal.SIGUSR1, on_signal)
    rng = np.random.default_rng(0)
    BT, C, OC = 128, 256, 192  # every GEMM has K = 128, 192 or 256 > 84
    inp = rng.standard_normal(BT * C).astype(np.float32)
    w = rng.standard_normal(OC * C).astype(np.float32)
    dout = rng.standard_normal(BT * OC).astype(np.float32)
    want_out = inp.reshape(BT, C) @ w.reshape(OC, C).T
    want_dinp = dout.reshape(BT, OC) @ w.reshape(OC, C)
    want_dw = dout.reshape(BT, OC).T @ inp.reshape(BT, C)
    bf16 = matmul.bf16_native()
    if bf16:
        inp16, w16 = np.empty(BT * C, np.uint16), np.empty(OC * C, np.uint16)
        convert.cast_to_bf16(inp16, inp, 1)
        convert.cast_to_bf16(w16, w, 1)
        dout16 = np.empty(BT * OC, np.uint16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    calls = wrong = 0
    t_end = time.time() + seconds
    while time.time() < t_end:
        for n in thread_counts:
            # small arrays between the GEMMs' workspaces and the rest of the heap
            neighbours = [np.full(k, 7.0, np.float32) for k in (16, 300, 2000)]
            out = np.empty(BT * OC, np.float32)
            matmul.matmul_forward(out, inp, w, None, BT, C, OC, n, engine="dnnl")
            dinp, dw = np.zeros(BT * C, np.float32), np.zeros(OC * C, np.float32)
            matmul.matmul_backward(dinp, dw, None, dout, inp, w, BT, C, OC, n, engine="dnnl")
            calls += 3
            ok = (np.allclose(out.reshape(BT, OC), want_out, rtol=1e-3, atol=1e-2)
                  and np.allclose(dinp.reshape(BT, C), want_dinp, rtol=1e-3, atol=1e-2)
                  and np.allclose(dw.reshape(OC, C), want_dw, rtol=1e-3, atol=1e-2)
                  and all((a == 7.0).all() for a in neighbours))
            for engine in ("dnnl", "dnnl_gemm") if bf16 else ():   # matmul primitive, gemm call
                out16 = np.empty(BT * OC, np.float32)
                matmul.matmul_forward_bf16(out16, inp16, w16, None, BT, C, OC, n, engine=engine)
                dinp16, dw16 = np.zeros(BT * C, np.float32), np.zeros(OC * C, np.float32)
                matmul.matmul_backward_bf16(dinp16, dw16, None, dout, dout16, inp16, w16, BT, C, OC, n,
                                            engine=engine)
                calls += 3
                ok = (ok and np.allclose(out16.reshape(BT, OC), want_out, rtol=0.05, atol=1.0)
                      and np.allclose(dinp16.reshape(BT, C), want_dinp, rtol=0.05, atol=1.0)
                      and np.allclose(dw16.reshape(OC, C), want_dw, rtol=0.05, atol=1.0))
            wrong += not ok
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the parent may still be sending
    print(calls, handled, wrong, flush=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
