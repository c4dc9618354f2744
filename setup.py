"""Build llmctl's Cython kernels (`_ext/*.pyx` -> `llmctl._ext.*`), with OpenMP when it works.

Environment switches (all off by default):
  LLMCTL_NO_OPENMP=1       build serial kernels on purpose (llm.c's NO_OMP=1)
  LLMCTL_FAIL_NO_OPENMP=1  make a missing/broken OpenMP a build error (CI sets it)
  LLMCTL_DEBUG_CYTHON=1    turn boundscheck/wraparound/initializedcheck back on
  LLMCTL_NATIVE=1          add -march=native (never in wheels: SIGILL on older CPUs)
  LLMCTL_EXTS=a,b          build only these extensions (development convenience)
  LLMCTL_BUILD_JOBS=N      compile N extensions at once (default: one per CPU; pip passes no -j)
  LLMCTL_QUICK=1           compile at -O1 (the test builds: about half the compile time of -O3;
                           slower kernels, the same results: no flag here changes float semantics)
  LLMCTL_NO_DNNL=1         build matmul without oneDNN (scipy's BLAS is then its GEMM engine)
  LLMCTL_FAIL_NO_DNNL=1    make a missing oneDNN a build error on x86-64 Linux

oneDNN (the GEMM engine of _ext/matmul.pyx on x86-64 Linux) comes from the `onednn-cpu-gomp`
wheel (libdnnl.so.3, built on GNU OpenMP like our kernels) and `onednn-devel-cpu-gomp` (headers),
both build requirements and the first a run-time dependency there (pyproject.toml). The wheels put
lib/ and include/ under the environment's prefix; matmul gets an rpath to that lib/ relative to
its own install location, so an installed llmctl finds libdnnl.so.3 without LD_LIBRARY_PATH.

The OpenMP probe follows scikit-learn's openmp_helpers: compile, link and *run* a tiny program.
"""
import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


def _dist_file(dists, suffix):
    """Absolute path of the first installed file of one of `dists` whose path ends with suffix."""
    from importlib import metadata

    for dist in dists:
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            path = os.path.abspath(str(f.locate()))
            if path.replace(os.sep, "/").endswith(suffix) and os.path.exists(path):
                return path
    return None


def find_onednn():
    """(include_dir, lib_dir) of the installed oneDNN wheels, or (None, why not)."""
    if _env_flag("LLMCTL_NO_DNNL"):
        return None, "LLMCTL_NO_DNNL is set"
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return None, f"oneDNN's wheels are used on x86-64 Linux only, not {sys.platform}/{platform.machine()}"
    header = _dist_file(("onednn-devel-cpu-gomp",), "include/oneapi/dnnl/dnnl.h")
    lib = _dist_file(("onednn-cpu-gomp",), "lib/libdnnl.so.3")
    if header is None or lib is None:
        return None, "the onednn-cpu-gomp / onednn-devel-cpu-gomp wheels are not installed"
    return (os.path.dirname(os.path.dirname(os.path.dirname(header))), os.path.dirname(lib)), "ok"


def probe_onednn(inc, lib, cflags, ldflags):
    """None if a tiny program calling dnnl_sgemm compiles, links and runs, else why not."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    src = textwrap.dedent(
        """
        #include <oneapi/dnnl/dnnl.h>
        int main(void) {
            float a[4] = {1, 2, 3, 4}, c[4] = {0};
            if (dnnl_sgemm('N', 'N', 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) != dnnl_success) return 2;
            return c[0] == 7 && c[1] == 10 && c[2] == 15 && c[3] == 22 ? 0 : 1;
        }
        """
    )
    tmp = tempfile.mkdtemp(prefix="llmctl-dnnl-")
    try:
        c_path, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
        with open(c_path, "w") as f:
            f.write(src)
        cmd = cc.split() + cflags + [f"-I{inc}", c_path, "-o", exe, f"-L{lib}", "-l:libdnnl.so.3",
                                     f"-Wl,-rpath,{lib}"] + ldflags
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"compiling a oneDNN program failed: {r.stderr.strip()[:300]}"
        r = subprocess.run([exe], capture_output=True, text=True)
        if r.returncode != 0:
            return f"the oneDNN probe program failed (exit {r.returncode}): {r.stderr.strip()[:300]}"
        return None
    except OSError as e:
        return f"could not run the compiler {cc!r}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def onednn_build_args(openmp):
    """(define_macros, include_dirs, link_args) for matmul: oneDNN's when usable, else none."""
    found, why = find_onednn()
    if found is not None:
        inc, lib = found
        why = probe_onednn(inc, lib, *(openmp or ([], [])))
        if why is None:
            # installed layout: <prefix>/lib/pythonX.Y/site-packages/llmctl/_ext -> <prefix>/lib
            paths = sysconfig.get_paths()
            rel = os.path.relpath(os.path.join(paths["data"], "lib"),
                                  os.path.join(paths["platlib"], "llmctl", "_ext"))
            rpaths = ["$ORIGIN/" + rel.replace(os.sep, "/")]
            if os.path.realpath(lib) == os.path.realpath(os.path.join(sys.prefix, "lib")):
                rpaths.append(lib)  # an in-place build in this environment (not pip's temporary one)
            link = [f"-L{lib}", "-l:libdnnl.so.3"] + [f"-Wl,-rpath,{p}" for p in rpaths]
            return [("LLMCTL_DNNL_BUILD", "1")], [inc], link
    if _env_flag("LLMCTL_FAIL_NO_DNNL") and not _env_flag("LLMCTL_NO_DNNL"):
        sys.exit(f"error: oneDNN is required (LLMCTL_FAIL_NO_DNNL=1) but {why}")
    if not _env_flag("LLMCTL_NO_DNNL"):
        _warn(f"oneDNN is not usable ({why}): matmul will use scipy's BLAS (fp32 only, slower; "
              "bf16 is then emulated).")
    return [("LLMCTL_DNNL_BUILD", "0")], [], []


SHARED_UTILITY = "llmctl._ext._cyutility"


def _build_jobs():
    value = os.environ.get("LLMCTL_BUILD_JOBS", "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit():
        sys.exit(f"error: LLMCTL_BUILD_JOBS must be a whole number of jobs, not {value!r}")
    return max(int(value), 1)


class BuildExt(build_ext):
    """build_ext compiling the extensions in parallel unless -j says otherwise: `pip install`
    has no way to pass -j, and a serial build of the kernels takes minutes."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = _build_jobs()


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
    if _env_flag("LLMCTL_QUICK") and sys.platform != "win32":
        compile_args.append("-O1")
    simde = []
    if _env_flag("LLMCTL_PORTABLE"):
        # tests only: the kernels as a compiler without x86 dispatch or vector types builds them
        # (the portable C of every header: the scalar attention set, no AVX copies)
        compile_args += ["-DLLMCTL_NO_AVX_DISPATCH", "-DATT_NO_DISPATCH", "-DATT_NO_VEC"]
    if _env_flag("LLMCTL_SIMDE_AVX512"):
        # tests only: the AVX-512 copies on SIMDe's portable intrinsics (_ext/simde_avx512.h)
        import simde_py
        simde = [simde_py.get_include()]
        # -O1: SIMDe's inline layers compile twice as fast, and the tests it serves run as fast
        compile_args += ["-include", "simde_avx512.h", "-mavx2", "-mfma", "-Wno-psabi", "-O1"]
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
    dnnl = onednn_build_args(openmp) if not only or "matmul" in only else ([], [], [])
    extensions = []
    for pyx in sorted(glob.glob(os.path.join("_ext", "*.pyx"))):
        name = os.path.splitext(os.path.basename(pyx))[0]
        if only and name not in only:
            continue
        macros, incs, links = dnnl if name == "matmul" else ([], [], [])
        extensions.append(
            Extension(
                f"llmctl._ext.{name}",
                [pyx],
                # shared .pxd/.h: a change rebuilds every extension, and sdists carry them
                depends=sorted(glob.glob(os.path.join("_ext", "*.pxd")) + glob.glob(os.path.join("_ext", "*.h"))),
                include_dirs=[np.get_include(), "_ext"] + incs + simde,
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                               ("LLMCTL_OPENMP_BUILD", "1" if openmp else "0")] + macros,
                extra_compile_args=compile_args,
                extra_link_args=link_args + links,
            )
        )

    # Cython's utility code (typed memoryviews above all) in one module the others import: each
    # module's C is then a third of its size, and the build compiles it once instead of 13 times
    extensions.append(Extension(SHARED_UTILITY, [os.path.join("_ext", "_cyutility.c")],
                                include_dirs=["_ext"] + simde,
                                extra_compile_args=compile_args, extra_link_args=link_args))
    jobs = _build_jobs()
    setup(
        ext_modules=cythonize(
            extensions,
            compiler_directives=directives,
            include_path=["_ext"],
            nthreads=jobs if jobs > 1 else 0,
            shared_utility_qualified_name=SHARED_UTILITY,
        ),
        cmdclass={"build_ext": BuildExt},
    )


if __name__ == "__main__":
    main()
