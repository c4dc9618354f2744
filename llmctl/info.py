"""What this llmctl build and process will use: version, OpenMP, threads, GEMM engine, precisions,
the instruction sets of the runtime-dispatched kernels, and the MFU roofs cached for this CPU."""
import os

from llmctl import __version__

# The matmul precisions (`check_precision`). fp32 is the default: it is llm.c's CPU trainer's
# arithmetic, runs on every CPU, and bf16 pays only where the CPU multiplies bf16 natively
# (docs/performance.md).
PRECISIONS = ("fp32", "bf16")
DEFAULT_PRECISION = "fp32"
BF16_EMULATE_ENV = "LLMCTL_BF16_EMULATE"


def bf16_unavailable():
    """Why this build on this CPU cannot multiply bf16 natively (oneDNN's bf16 GEMM), or None."""
    from llmctl._ext import matmul

    if matmul.bf16_native():
        return None
    return ("llmctl was built without oneDNN" if not matmul.dnnl_built() else
            "LLMCTL_NO_DNNL is set" if "dnnl" not in matmul.get_engines() else
            "this CPU has no native bf16 (AVX512_BF16 or AMX)" if not matmul.cpu_bf16_features() else
            "oneDNN's bf16 GEMM does not run on this CPU")


GEMV_COPY_NAMES = {"avx2": "AVX2", "avx512_bf16": "AVX512_BF16"}


def bf16_sampling():
    """How `llmctl sample --precision bf16` multiplies here: "native" (oneDNN and the AVX512_BF16
    GEMV), the bf16 GEMV copy decoding's products run on without oneDNN's bf16 GEMM ("avx2", or
    "avx512_bf16" where oneDNN is off or not built: decoding is bound by the weights' bytes, half
    of fp32's; the prompt's few GEMMs run emulated), or None (neither)."""
    from llmctl._ext import matmul

    if matmul.bf16_native():
        return "native"
    copies = matmul.gemv_bf16_isas()
    return copies[-1] if copies else None


def _sampling_copy(how):
    return f"the bf16 GEMV's {GEMV_COPY_NAMES[how]} copy"


def check_precision(precision, sampling=False, emulate=None):
    """precision if this machine can run it, else ConfigError: the one precision check. bf16
    needs a CPU that multiplies bf16 natively (AVX512_BF16 or AMX, through oneDNN), or, with
    sampling=True, one where bf16_sampling() is not None. emulate=True (None: the environment's
    LLMCTL_BF16_EMULATE=1) runs bf16 anyway, the same numerics with the GEMMs on fp32 (slower
    than fp32: for tests and checks on any CPU)."""
    from llmctl.errors import ConfigError

    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}", hint=f"choose one of {', '.join(PRECISIONS)}")
    if emulate is None:
        emulate = os.environ.get(BF16_EMULATE_ENV, "") not in ("", "0")
    if precision == "bf16" and not emulate and not (sampling and bf16_sampling()):
        why = bf16_unavailable()
        if why:
            how = None if sampling else bf16_sampling()
            also = f"; `llmctl sample --precision bf16` runs on {_sampling_copy(how)}" if how else ""
            raise ConfigError(f"--precision bf16 is not available: {why}{also}",
                              hint=f"use --precision fp32 (`llmctl info` lists the precisions); "
                                   f"{BF16_EMULATE_ENV}=1 emulates bf16 on fp32 GEMMs (slower)")
    return precision


def usable_cores():
    """Cores this process may run on (its CPU affinity mask; else all the machine's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads():
    """Threads a kernel uses unless told otherwise: OMP_NUM_THREADS, else the usable cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return usable_cores()


def gemm_info():
    """The matmul engines and precisions of this build on this CPU.

    engine: the default fp32 GEMM engine ("dnnl" or "blas"); engines: every fp32 engine accepted;
    onednn: oneDNN's version string or None; cpu_bf16: the native bf16 instruction sets found;
    precisions: ["fp32"] plus "bf16" where the CPU multiplies bf16 natively through oneDNN;
    bf16_unavailable: why not, or None; bf16_sampling: how bf16 sampling runs here (bf16_sampling()),
    or None."""
    from llmctl._ext import matmul

    v = matmul.dnnl_version()
    return {
        "engine": matmul.default_engine(),
        "engines": list(matmul.get_engines()),
        "onednn": ".".join(map(str, v)) if v else None,
        "onednn_disabled": bool(v) and "dnnl" not in matmul.get_engines(),
        "cpu_bf16": list(matmul.cpu_bf16_features()),
        "precisions": ["fp32", "bf16"] if matmul.bf16_native() else ["fp32"],
        "bf16_unavailable": bf16_unavailable(),
        "bf16_sampling": bf16_sampling(),
    }


def simd_info():
    """The instruction set each runtime-dispatched kernel runs here (the build itself is baseline
    x86-64; wider copies are picked by cpuid): attention ("default", "avx2", "avx512"), the row
    loops of GELU, layernorm, softmax + cross-entropy and the bf16 cast ("baseline", "avx2",
    "avx512"), AdamW ("baseline", "avx"), the few-row bf16 matmul of decoding
    ("avx512_bf16", "avx2", or "off": the bf16 GEMM engine does those rows too), the attention over a KV
    cache of decoding and HellaSwag ("baseline", "avx512"), and the products of the bf16
    attention ("amx", "avx512_bf16", or "emulated": the same bf16 rounding done on fp32)."""
    from llmctl._ext import adamw, attention, kvcache, layers, matmul

    return {"attention": attention.isa(), "layers": layers.simd(), "adamw": adamw.simd(),
            "bf16_gemv": matmul.gemv_bf16_isa(),
            "kv_attention": kvcache.isa(), "attention_bf16": attention.bf16_path()}


def roof_info():
    """The MFU roofs cached for this CPU and GEMM engine (llmctl/roof.py), measuring nothing:
    {"cache": path, "roofs": [{precision, threads, gflops, measurements, measured}]}."""
    from llmctl.roof import cached_roofs, roof_path

    path = roof_path()
    return {"cache": path,
            "roofs": [{"precision": e.get("precision"), "threads": e.get("threads"),
                       "gflops": round(e["flops"] / 1e9, 1),
                       "measurements": int(e.get("measurements", 1)), "measured": e.get("measured")}
                      for e in cached_roofs(path=path)]}


def openmp_wait():
    """How idle OpenMP threads wait (llmctl/__init__.py sets a default when the user did not):
    {"policy": "spin" | "passive" | "user", "env": the variables in effect}."""
    import llmctl

    env = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return {"policy": llmctl.OPENMP_WAIT or "user", "env": env}


def _wait_text(w):
    said = " ".join(f"{k}={v}" for k, v in w["env"].items()) or "libgomp's default"
    whose = "your setting" if w["policy"] == "user" else "llmctl's default"
    return f"{said}, {whose}"


_CHECKED_MODULES = ("adamw", "attention", "buildinfo", "kvcache", "layers", "matmul")


def _not_from_ext_dir(ext_dir):
    """The kernel modules that did not load from LLMCTL_EXT_DIR although it is set (absent there:
    the installed ones loaded instead)."""
    if not ext_dir:
        return []
    import importlib

    d = os.path.realpath(ext_dir)
    return [name for name in _CHECKED_MODULES
            if os.path.dirname(os.path.realpath(importlib.import_module(f"llmctl._ext.{name}").__file__)) != d]


def runtime_info():
    import llmctl._ext
    from llmctl._ext import buildinfo

    info = {
        "version": __version__,
        "openmp": buildinfo.openmp_enabled(),
        # older builds in LLMCTL_EXT_DIR lack these two
        "simde_avx512": getattr(buildinfo, "simde_avx512", bool)(),
        "portable": getattr(buildinfo, "portable", bool)(),
        "ext_dir": llmctl._ext.EXT_DIR,
        "ext_dir_missing": _not_from_ext_dir(llmctl._ext.EXT_DIR),
        "threads": default_threads(),
        "openmp_wait": openmp_wait(),
        "blas": None,
        **gemm_info(),
        "kernels": simd_info(),
        "mfu_roof": roof_info(),
    }
    from llmctl._ext import attention

    info["attention_bf16_paths"] = attention.bf16_available_paths()
    try:
        from threadpoolctl import threadpool_info
        import scipy.linalg  # noqa: F401  (loads the BLAS the kernels call)

        for lib in threadpool_info():
            if lib.get("user_api") == "blas" and "scipy" in lib.get("filepath", "") and "openblas64" not in lib.get("filepath", ""):
                info["blas"] = f"{lib['internal_api']} {lib['version']} ({lib.get('architecture')})"
                break
    except Exception:  # BLAS introspection is informational only
        pass
    return info


def _engine_line(info):
    if info["engine"] == "dnnl":
        return f"GEMM engine: oneDNN {info['onednn']} (dnnl_sgemm); fallback: scipy BLAS"
    why = "LLMCTL_NO_DNNL is set" if info["onednn_disabled"] else "built without oneDNN"
    return f"GEMM engine: scipy BLAS ({why})"


def _precision_line(info):
    if "bf16" in info["precisions"]:
        return f"precisions: fp32, bf16 (native: {', '.join(info['cpu_bf16'])}; oneDNN matmul primitive)"
    if info.get("bf16_sampling") in GEMV_COPY_NAMES:
        return (f"precisions: fp32; bf16 for `llmctl sample` only, on {_sampling_copy(info['bf16_sampling'])} "
                f"(training and eval: no, {info['bf16_unavailable']})")
    return f"precisions: fp32 (bf16: no, {info['bf16_unavailable']})"


def _roof_line(info):
    r = info["mfu_roof"]
    if not r["roofs"]:
        return (f"MFU roof: none measured on this CPU yet (`llmctl train` measures one; "
                f"cache: {r['cache']})")
    from llmctl.roof import threads_text

    each = [f"{e['precision']} {e['gflops']:.1f} GFLOP/s at {threads_text(e['threads'])} "
            f"(best of {e['measurements']})" for e in r["roofs"]]
    return f"MFU roof: {', '.join(each)}; cached in {r['cache']}"


def _build_note(info):
    note = []
    if info.get("simde_avx512"):
        note.append("a test build: AVX-512 emulated by SIMDe, slow")
    if info.get("portable"):
        note.append("a test build: portable C only")
    if info.get("ext_dir"):
        missing, d = info.get("ext_dir_missing") or [], info["ext_dir"]
        note.append(f"LLMCTL_EXT_DIR={d} has none of them: the installed ones loaded"
                    if len(missing) == len(_CHECKED_MODULES) else
                    f"loaded from LLMCTL_EXT_DIR={d}, except {', '.join(missing)}: the installed ones" if missing else
                    f"loaded from LLMCTL_EXT_DIR={d}")
    return f" ({'; '.join(note)})" if note else ""


def format_info(info):
    k = info["kernels"]
    return (f"llmctl {info['version']}\n"
            f"OpenMP: {'yes' if info['openmp'] else 'NO (serial build)'}, threads: {info['threads']}, "
            f"idle threads: {_wait_text(info['openmp_wait'])}\n"
            f"{_engine_line(info)}\n"
            f"{_precision_line(info)}\n"
            f"kernels: attention {k['attention']}, layers {k['layers']}, AdamW {k['adamw']}, "
            f"bf16 GEMV {k['bf16_gemv']}, KV-cache attention {k['kv_attention']}{_build_note(info)}\n"
            f"attention-bf16: {k['attention_bf16']} (available: {', '.join(info['attention_bf16_paths'])})\n"
            f"BLAS: {info['blas'] or 'unknown'}\n"
            f"{_roof_line(info)}")
