"""llmctl: prepare data for, train, evaluate and sample GPT-2 on CPUs, byte-compatible with llm.c."""
import os as _os

# Two thread pools take turns on the same cores: the OpenMP kernels (libgomp) and scipy's OpenBLAS
# (sgemm). Each busy-waits after its work by default and so steals the cores from the other:
# measured on d12 B=4 T=64, 2 threads, 1.69 s/step with the defaults vs 1.17 s with both set
# (docs/performance.md). They must be set before either library loads; a user's own value wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
