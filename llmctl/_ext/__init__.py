"""llmctl's compiled kernels (built from _ext/*.pyx by setup.py).

On x86-64 Linux, matmul links oneDNN's libdnnl.so.3 from the onednn-cpu-gomp wheel and finds it
through an rpath relative to where pip installs llmctl. An editable install (pip install -e .)
builds in pip's temporary environment and puts the extensions in the source tree, so that rpath
points nowhere; loading the wheel's library first, by its installed path, lets the dynamic
loader resolve matmul's dependency whatever the layout (it matches the library's soname).

The file loaded is the wheel's fully versioned one (libdnnl.so.3.2 for onednn-cpu-gomp 2023.2):
another package of the environment can overwrite <prefix>/lib/libdnnl.so.3 with its own build
(Intel's `onednn` wheel does, with a TBB-threaded 3.x that needs libtbb), and matmul must still
get the build it was compiled and tested against.

LLMCTL_EXT_DIR names a directory of these modules built another way, loaded instead of the
installed ones, in this process and the processes it starts: the test builds of
tests/variant_build.py (no OpenMP; portable C only; AVX-512, AVX512_BF16 and AMX on SIMDe).
"""
import ctypes
import os
import re
import sys
from importlib import metadata

EXT_DIR = os.environ.get("LLMCTL_EXT_DIR") or None
if EXT_DIR:
    __path__.insert(0, EXT_DIR)

ONEDNN_DIST = "onednn-cpu-gomp"
_LIB = re.compile(r"libdnnl\.so\.3(\.\d+)*$")


def _onednn_candidates(files):
    """The dist's libdnnl.so.3* files, the most specific version first (libdnnl.so.3 last)."""
    libs = [f for f in files if _LIB.match(str(f).replace("\\", "/").rsplit("/", 1)[-1])]
    return sorted(libs, key=lambda f: -len(str(f).rsplit("/", 1)[-1]))


def _preload_onednn():
    """Load the installed onednn-cpu-gomp wheel's libdnnl (RTLD_GLOBAL). -> (path or None, why
    not or None)."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        files = metadata.distribution(ONEDNN_DIST).files or []
    except metadata.PackageNotFoundError:
        return None, None   # not installed: matmul's own rpath (or its error) decides
    errors = []
    for f in _onednn_candidates(files):
        path = str(f.locate())
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path, None
        except OSError as e:
            errors.append(f"{path}: {e}")
    return None, "; ".join(errors) or f"{ONEDNN_DIST} lists no libdnnl.so.3"


ONEDNN_PRELOADED, ONEDNN_PRELOAD_ERROR = _preload_onednn()


def load_error(e):
    """(message, hint) for an ImportError raised while importing one of these modules."""
    text = str(e)
    if "libdnnl" in text or (ONEDNN_PRELOAD_ERROR and e.name == __name__ + ".matmul"):
        try:
            pin = f"=={metadata.version(ONEDNN_DIST)}"
        except metadata.PackageNotFoundError:
            pin = ""
        tried = f"; the {ONEDNN_DIST} wheel's library did not load: {ONEDNN_PRELOAD_ERROR}" if ONEDNN_PRELOAD_ERROR else ""
        return (f"llmctl's matmul kernel cannot load oneDNN ({text}){tried}",
                f"reinstall the wheel llmctl was built with: pip install --force-reinstall --no-deps "
                f"{ONEDNN_DIST}{pin}")
    return (f"llmctl's compiled kernels did not load ({text})",
            "reinstall llmctl (pip install .), or in a checkout rebuild them: python setup.py build_ext --inplace")


def is_ours(e):
    """Did this ImportError come from importing one of these modules?"""
    return isinstance(e, ImportError) and (e.name or "").startswith(__name__ + ".")
