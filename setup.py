"""Build llmctl's Cython kernels (`_ext/*.pyx` -> `llmctl._ext.*`), with OpenMP when it works.

Environment switches (all off by default):
  LLMCTL_NO_OPENMP=1       build serial kernels on purpose (llm.c's NO_OMP=1)
  LLMCTL_FAIL_NO_OPENMP=1  make a missing/broken OpenMP a build error (CI sets it)
  LLMCTL_DEBUG_CYTHON=1    turn boundscheck/wraparound/initializedcheck back on
  LLMCTL_NATIVE=1          add -march=native (never in wheels: SIGILL on older CPUs)
  LLMCTL_EXTS=a,b          build only these extensions (development convenience)

The OpenMP probe follows scikit-learn's openmp_helpers: compile, link and *run* a tiny program.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _warn(msg):
    bar = "*" * 78
    sys.stderr.write(f"\n{bar}\n{textwrap.fill('WARNING: ' + msg, 78)}\n{bar}\n\n")


def _openmp_flags():
    if sys.platform == "win32":
        return ["/openmp"], []
    if sys.platform == "darwin":
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return ["-fopenmp"], ["-fopenmp"]


def probe_openmp():
    """Return (compile_args, link_args) if a tiny OpenMP program builds and runs, else None."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cflags, ldflags = _openmp_flags()
    src = textwrap.dedent(
        """
        #include <omp.h>
        #include <stdio.h>
        int main(void) {
            int n = 0;
            #pragma omp parallel reduction(+:n)
            n += 1;
            printf("%d %d\\n", n, omp_get_max_threads());
            return n == omp_get_max_threads() ? 0 : 1;
        }
        """
    )
    tmp = tempfile.mkdtemp(prefix="llmctl-omp-")
    try:
        c_path = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(c_path, "w") as f:
            f.write(src)
        cmd = cc.split() + cflags + [c_path, "-o", exe] + ldflags
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"compiling with {' '.join(cflags)} failed: {r.stderr.strip()[:300]}"
        r = subprocess.run([exe], capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"the OpenMP probe program failed to run: {r.stderr.strip()[:300]}"
        return (cflags, ldflags), "ok"
    except OSError as e:
        return None, f"could not run the compiler {cc!r}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    openmp = None
    if _env_flag("LLMCTL_NO_OPENMP"):
        _warn("LLMCTL_NO_OPENMP is set: building serial kernels (no OpenMP).")
    else:
        openmp, why = probe_openmp()
        if openmp is None:
            if _env_flag("LLMCTL_FAIL_NO_OPENMP"):
                sys.exit(f"error: OpenMP is required (LLMCTL_FAIL_NO_OPENMP=1) but {why}")
            _warn(f"OpenMP is not usable ({why}). llmctl's kernels will be built SERIAL and "
                  "will run on one core. Install an OpenMP runtime (libgomp/libomp) and rebuild.")

    compile_args = ["-O3", "-std=c11"] if sys.platform != "win32" else ["/O2"]
    link_args = []
    if _env_flag("LLMCTL_NATIVE"):
        compile_args.append("-march=native")
    if openmp is not None:
        compile_args += openmp[0]
        link_args += openmp[1]

    debug = _env_flag("LLMCTL_DEBUG_CYTHON")
    directives = {
        "language_level": 3,
        "boundscheck": debug,
        "wraparound": debug,
        "initializedcheck": debug,
        "cdivision": True,
        "embedsignature": True,
    }

    only = {s.strip() for s in os.environ.get("LLMCTL_EXTS", "").split(",") if s.strip()}
    extensions = []
    for pyx in sorted(glob.glob(os.path.join("_ext", "*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        if only and name not in only:
            continue
        extensions.append(
            Extension(
                f"llmctl._ext.{name}",
                [pyx],
                # shared .pxd/.h: a change rebuilds every extension, and sdists carry them
                depends=sorted(glob.glob(os.path.join("_ext", "*.pxd")) + glob.glob(os.path.join("_ext", "*.h"))),
                include_dirs=[np.get_include(), "_ext"],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                               ("LLMCTL_OPENMP_BUILD", "1" if openmp else "0")],
                extra_compile_args=compile_args,
                extra_link_args=link_args,
            )
        )

    setup(
        ext_modules=cythonize(
            extensions,
            compiler_directives=directives,
            include_path=["_ext"],
            nthreads=int(os.environ.get("LLMCTL_BUILD_JOBS", "0")),
        ),
    )


if __name__ == "__main__":
    main()
