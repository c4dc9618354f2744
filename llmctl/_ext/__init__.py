"""llmctl's compiled kernels (built from _ext/*.pyx by setup.py).

On x86-64 Linux, matmul links oneDNN's libdnnl.so.3 from the onednn-cpu-gomp wheel and finds it
through an rpath relative to where pip installs llmctl. An editable install (pip install -e .)
builds in pip's temporary environment and puts the extensions in the source tree, so that rpath
points nowhere; loading the wheel's library first, by its installed path, lets the dynamic
loader resolve matmul's dependency whatever the layout.
"""
import ctypes
import sys
from importlib import metadata


def _preload_onednn():
    """Load the installed onednn-cpu-gomp wheel's libdnnl.so.3 (RTLD_GLOBAL); -> its path or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        for f in metadata.distribution("onednn-cpu-gomp").files or []:
            if str(f).replace("\\", "/").rsplit("/", 1)[-1] == "libdnnl.so.3":
                path = str(f.locate())
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
    except (OSError, metadata.PackageNotFoundError):
        return None   # not installed or not loadable: matmul's own rpath (or its error) decides
    return None


ONEDNN_PRELOADED = _preload_onednn()
