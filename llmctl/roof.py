"""The MFU roof: the best GEMM FLOP/s ever measured on this CPU, kept in the llmctl cache.

What it is: a run times a 1024^3 GEMM at start-up (llmctl.mfu.measure_peak_flops); one timing
reads whatever the other processes left of the cores (151 to 379 GFLOP/s on one machine), so
MFU against it jumped between runs of the same speed. `best_roof` merges each measurement into
`$LLMCTL_CACHE/mfu_roofs.json` and returns the best one seen for the same key: CPU model, a hash
of its feature flags, thread count, llmctl's GEMM engine and the roof's precision. The file is
rewritten atomically (temp file, then rename); a cache that cannot be read or written costs only
the stability (the run uses its own measurement and says so). `cached_roofs` lists this CPU's
entries for `llmctl info` without measuring anything.
What it is not: the measurement (llmctl.mfu.measure_peak_flops) or the MFU arithmetic (the
train loop: llm.c's FLOP count over step time over the roof).
"""
import hashlib
import json
import os
import platform
import time

ROOF_FILE = "mfu_roofs.json"
ROOF_VERSION = 1  # bump when the measurement changes, so older roofs are not compared with it


def cpu_identity(cpuinfo="/proc/cpuinfo"):
    """(model name, sha256 prefix of its sorted feature flags) of this machine's first CPU."""
    model, flags = "", ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Processor", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]
    return model, digest


def gemm_engine():
    """llmctl's default fp32 GEMM engine ("dnnl" or "blas")."""
    from llmctl._ext import matmul

    return matmul.default_engine()


def roof_key(n_threads, precision, cpu=None, engine=None):
    """The cache key of a roof: which CPU (model, features), how many threads, which engine."""
    model, flags = cpu if cpu is not None else cpu_identity()
    engine = engine if engine is not None else gemm_engine()
    return f"v{ROOF_VERSION}|{model}|{flags}|{engine}|{precision}|{n_threads}"


def roof_path(cache_dir=None):
    """$LLMCTL_CACHE/mfu_roofs.json (the cache converted checkpoints live in)."""
    if cache_dir is None:
        from llmctl.hf.hub import converted_cache_dir

        cache_dir = converted_cache_dir()
    return os.path.join(os.fspath(cache_dir), ROOF_FILE)


def _read(path):
    """The cached roofs by key; {} when the file is missing or not ours (it is only a cache)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    roofs = d.get("roofs") if isinstance(d, dict) else None
    if not isinstance(roofs, dict):
        return {}
    return {k: v for k, v in roofs.items()
            if isinstance(v, dict) and isinstance(v.get("flops"), (int, float)) and v["flops"] > 0}


def _write(path, roofs):
    from llmctl.atomic import atomic_write

    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, json.dumps({"roofs": roofs}, indent=1, sort_keys=True) + "\n")


def best_roof(measured, n_threads, precision, cpu=None, engine=None, path=None):
    """Merge one measurement (FLOP/s) into the cache; -> (roof FLOP/s, where it came from).

    The roof is the best of the cached value and this measurement; the cache keeps the best and
    counts the measurements. A cache that cannot be written leaves the measurement as the roof."""
    from llmctl.errors import LlmctlError

    path = path or roof_path()
    key = roof_key(n_threads, precision, cpu, engine)
    roofs = _read(path)
    old = roofs.get(key)
    if old is not None and old["flops"] >= measured:
        entry = dict(old, measurements=int(old.get("measurements", 1)) + 1)
    else:
        model, _ = cpu if cpu is not None else cpu_identity()
        entry = {"flops": float(measured), "cpu": model, "threads": n_threads, "precision": precision,
                 "engine": engine if engine is not None else gemm_engine(),
                 "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "measurements": int(old.get("measurements", 0)) + 1 if old else 1}
    roofs[key] = entry
    try:
        _write(path, roofs)
    except (OSError, LlmctlError) as e:
        why = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
        best = max(measured, old["flops"]) if old else measured
        return best, f"measured now; not cached ({why})"
    return entry["flops"], describe(entry, path)


def threads_text(n):
    return f"{n} thread{'' if n == 1 else 's'}"


def describe(entry, path):
    """'best of N measurements on this CPU at T threads, cached in PATH' for one cache entry."""
    n, at = int(entry.get("measurements", 1)), threads_text(entry["threads"])
    return (f"best of {n} measurements on this CPU at {at}, cached in {path}" if n > 1
            else f"measured now, the first on this CPU at {at}; cached in {path}")


def cached_roofs(cpu=None, engine=None, path=None):
    """This CPU's and engine's cached roofs, by precision then threads, measuring nothing."""
    path = path or roof_path()
    model, flags = cpu if cpu is not None else cpu_identity()
    engine = engine if engine is not None else gemm_engine()
    prefix = f"v{ROOF_VERSION}|{model}|{flags}|{engine}|"
    found = [e for k, e in _read(path).items() if k.startswith(prefix)]
    return sorted(found, key=lambda e: (e.get("precision", ""), e.get("threads", 0)))
