"""`llmctl info` / `llmctl --version`, and that an OpenMP build (LLMCTL_FAIL_NO_OPENMP=1) has OpenMP."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmctl._ext import buildinfo

REPO = Path(__file__).resolve().parent.parent


def _cli(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, **(env or {})))
    assert r.returncode == 0, r.stderr
    return r.stdout


def _project_version():
    # the [project] table's version (Python 3.10 has no tomllib)
    return re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_info_json_reports_version_openmp_threads_and_blas():
    from threadpoolctl import threadpool_info

    info = json.loads(_cli("info", "--json", env={"OMP_NUM_THREADS": "3"}))
    assert info["version"] == _project_version()
    assert info["openmp"] is buildinfo.openmp_enabled()
    assert info["threads"] == 3  # OMP_NUM_THREADS wins over the core count
    import scipy.linalg  # noqa: F401  (the BLAS the kernels call is scipy's)

    apis = {f"{lib['internal_api']} {lib['version']}" for lib in threadpool_info()
            if lib.get("user_api") == "blas"}
    assert info["blas"] is not None and info["blas"].rsplit(" (", 1)[0] in apis


def test_info_and_version_print_the_same_eight_lines():
    from llmctl._ext import adamw, attention, kvcache, layers, matmul

    text = _cli("info", env={"OMP_NUM_THREADS": "2"})
    lines = text.splitlines()
    assert len(lines) == 8, text
    assert lines[0] == f"llmctl {_project_version()}"
    want = "yes" if buildinfo.openmp_enabled() else "NO (serial build)"
    assert lines[1].startswith(f"OpenMP: {want}, threads: 2, idle threads: "), lines[1]
    v = matmul.dnnl_version()
    if matmul.default_engine() == "dnnl":
        assert lines[2] == f"GEMM engine: oneDNN {'.'.join(map(str, v))} (dnnl_sgemm); fallback: scipy BLAS"
    else:
        assert lines[2].startswith("GEMM engine: scipy BLAS ("), lines[2]
    if matmul.bf16_native():
        assert lines[3].startswith("precisions: fp32, bf16 (native: "), lines[3]
    elif matmul.gemv_bf16_isas():   # the best copy of the GEMV this CPU runs
        name = {"avx2": "AVX2", "avx512_bf16": "AVX512_BF16"}[matmul.gemv_bf16_isas()[-1]]
        assert lines[3].startswith("precisions: fp32; bf16 for `llmctl sample` only, on the bf16 GEMV's "
                                   f"{name} copy (training and eval: no, "), lines[3]
    else:
        assert lines[3].startswith("precisions: fp32 (bf16: no, "), lines[3]
    # the kernels' instruction sets, as the modules report them in this process
    gemv = matmul.gemv_bf16_isa()
    assert gemv == (matmul.gemv_bf16_isas() or ("off",))[-1]   # the best this CPU runs
    assert lines[4] == (f"kernels: attention {attention.isa()}, layers {layers.simd()}, AdamW {adamw.simd()}, "
                        f"bf16 GEMV {gemv}, KV-cache attention {kvcache.isa()}"), lines[4]
    assert lines[5] == (f"attention-bf16: {attention.bf16_path()} "
                        f"(available: {', '.join(attention.bf16_available_paths())})"), lines[5]
    assert re.fullmatch(r"BLAS: \S+ \S+ \(.*\)|BLAS: unknown", lines[6]), lines[6]
    assert lines[7].startswith("MFU roof: none measured on this CPU yet"), lines[7]  # a fresh cache
    assert _cli("--version", env={"OMP_NUM_THREADS": "2"}) == text
    # the same facts as --json gives
    info = json.loads(_cli("info", "--json"))
    assert info["engine"] == matmul.default_engine() and ("bf16" in info["precisions"]) == matmul.bf16_native()
    assert info["bf16_sampling"] == ("native" if matmul.bf16_native() else
                                     (matmul.gemv_bf16_isas() or (None,))[-1])
    assert info["kernels"] == {"attention": attention.isa(), "layers": layers.simd(), "adamw": adamw.simd(),
                               "bf16_gemv": gemv, "kv_attention": kvcache.isa(),
                               "attention_bf16": attention.bf16_path()}


def test_ci_build_has_openmp():
    """CI installs with LLMCTL_FAIL_NO_OPENMP=1 (README's test command): its build must have it."""
    if os.environ.get("CI", "").lower() != "true":
        pytest.skip("not under CI=true: a local build may be serial on purpose")
    assert buildinfo.openmp_enabled(), "CI's build has no OpenMP"


CHECK = textwrap.dedent("""
    import sys
    import llmctl._ext
    llmctl._ext.__path__.insert(0, sys.argv[1])
    from llmctl._ext import buildinfo
    assert buildinfo.__file__.startswith(sys.argv[1]), buildinfo.__file__
    print(buildinfo.openmp_enabled(), buildinfo.openmp_max_threads())
""")


@pytest.mark.slow
def test_build_under_fail_no_openmp_has_a_working_openmp(tmp_path):
    """setup.py with LLMCTL_FAIL_NO_OPENMP=1 either fails or links a real OpenMP runtime: the
    build says so and omp_get_max_threads() follows OMP_NUM_THREADS (a serial stub returns 1)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(REPO / "setup.py", src / "setup.py")
    shutil.copytree(REPO / "_ext", src / "_ext", ignore=shutil.ignore_patterns("*.so", "build"))
    build = tmp_path / "build"
    env = dict(os.environ, LLMCTL_FAIL_NO_OPENMP="1", LLMCTL_EXTS="buildinfo", LLMCTL_QUICK="1")
    env.pop("LLMCTL_NO_OPENMP", None)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(build),
                        "-t", str(tmp_path / "tmp")], cwd=src, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ext_dir = build / "llmctl" / "_ext"
    r = subprocess.run([sys.executable, "-c", CHECK, str(ext_dir)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="3"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "3"]


def test_info_names_the_mfu_roofs_cached_for_this_cpu_without_measuring(monkeypatch):
    """The roofs train measured (llmctl/roof.py), read back; `info` itself times nothing."""
    from llmctl import roof, train

    roof.best_roof(151e9, 2, "fp32")
    roof.best_roof(379e9, 2, "fp32")
    roof.best_roof(90e9, 1, "fp32")
    roof.best_roof(1e9, 1, "fp32", cpu=("Another CPU", "0"))  # not this machine: not listed
    monkeypatch.setattr(train, "measure_peak_flops", None)  # in this process: never called
    from llmctl.info import format_info, runtime_info

    info = runtime_info()
    path = roof.roof_path()
    assert info["mfu_roof"]["cache"] == path
    assert [(r["threads"], r["gflops"], r["measurements"]) for r in info["mfu_roof"]["roofs"]] == \
        [(1, 90.0, 1), (2, 379.0, 2)]
    assert format_info(info).splitlines()[-1] == ("MFU roof: fp32 90.0 GFLOP/s at 1 thread (best of 1), "
                                                  f"fp32 379.0 GFLOP/s at 2 threads (best of 2); cached in {path}")
    line = _cli("info").splitlines()[-1]  # the subprocess reads the same $LLMCTL_CACHE
    assert line == format_info(info).splitlines()[-1]
    assert json.loads(_cli("info", "--json"))["mfu_roof"] == json.loads(json.dumps(info["mfu_roof"]))


def test_onednn_wheel_library_is_loaded_by_its_installed_path():
    # an editable install builds matmul in pip's temporary environment, so its rpath to
    # libdnnl.so.3 points nowhere: llmctl._ext loads the wheel's library first, by the path the
    # onednn-cpu-gomp distribution records, and the loader then resolves matmul's dependency
    import platform
    from importlib import metadata

    try:
        metadata.distribution("onednn-cpu-gomp")
    except metadata.PackageNotFoundError:
        pytest.skip("the onednn-cpu-gomp wheel is not installed here (llmctl uses scipy's BLAS)")
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip("the oneDNN wheel is used on x86-64 Linux only")
    import llmctl._ext as ext

    assert ext.ONEDNN_PRELOADED is not None and os.path.exists(ext.ONEDNN_PRELOADED)
    assert ext.ONEDNN_PRELOAD_ERROR is None
    import llmctl._ext.matmul  # noqa: F401  (its libdnnl.so.3 dependency resolved now)

    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "libdnnl.so" in line}
    # one oneDNN in the process: the wheel's file the loader matched matmul's soname against
    assert {os.path.realpath(p) for p in mapped} == {os.path.realpath(ext.ONEDNN_PRELOADED)}


def test_onednn_is_the_wheels_versioned_file_and_reports_its_version():
    # another package (Intel's `onednn` wheel) can overwrite <prefix>/lib/libdnnl.so.3 with a
    # different build: llmctl loads the wheel's libdnnl.so.3.N, the build matmul was compiled for
    import ctypes
    import platform
    import re
    from importlib import metadata

    try:
        files = metadata.distribution("onednn-cpu-gomp").files or []
    except metadata.PackageNotFoundError:
        pytest.skip("the onednn-cpu-gomp wheel is not installed here (llmctl uses scipy's BLAS)")
    if not (sys.platform.startswith("linux") and platform.machine() == "x86_64"):
        pytest.skip("the oneDNN wheel is used on x86-64 Linux only")
    import llmctl._ext as ext

    names = [str(f).rsplit("/", 1)[-1] for f in ext._onednn_candidates(files)]
    assert names[-1] == "libdnnl.so.3" and "libdnnl.so" not in names
    m = re.fullmatch(r"libdnnl\.so\.3\.(\d+)", os.path.basename(ext.ONEDNN_PRELOADED))
    assert m, ext.ONEDNN_PRELOADED

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int)]

    lib = ctypes.CDLL(ext.ONEDNN_PRELOADED)
    lib.dnnl_version.restype = ctypes.POINTER(Version)
    v = lib.dnnl_version().contents
    assert (v.major, v.minor) == (3, int(m.group(1)))


def _libgomp_settings(env):
    """libgomp's own report (OMP_DISPLAY_ENV) of the wait settings it read when it loaded, in a
    fresh process that imports a kernel with `env` as its whole OpenMP environment."""
    clean = {k: v for k, v in os.environ.items()   # (LLMCTL_NO_DNNL too: a run of the suite with it set)
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LLMCTL_OPENMP_WAIT", "LLMCTL_NO_DNNL")}
    r = subprocess.run([sys.executable, "-c", "import llmctl._ext.layers, llmctl; print(llmctl.OPENMP_WAIT)"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(clean, OMP_DISPLAY_ENV="verbose", **env))
    assert r.returncode == 0, r.stderr
    got = dict(re.findall(r"^\s*(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '([^']*)'", r.stderr, re.M))
    return r.stdout.strip(), got


def _onednn_installed():
    from importlib import metadata

    try:
        metadata.distribution("onednn-cpu-gomp")
        return True
    except metadata.PackageNotFoundError:
        return False


def test_idle_openmp_threads_spin_before_sleeping_on_onednn_and_a_users_setting_wins():
    import llmctl

    if not buildinfo.openmp_enabled():
        pytest.skip("a serial build loads no libgomp")
    kind, got = _libgomp_settings({})
    if _onednn_installed():
        assert (kind, got["GOMP_SPINCOUNT"]) == ("spin", llmctl.GOMP_SPINCOUNT_DEFAULT)
    else:
        assert (kind, got["OMP_WAIT_POLICY"]) == ("passive", "PASSIVE")
    # the scipy BLAS engine (oneDNN switched off) takes turns with OpenBLAS's pool: no spinning
    kind, got = _libgomp_settings({"LLMCTL_NO_DNNL": "1"})
    assert (kind, got["OMP_WAIT_POLICY"]) == ("passive", "PASSIVE")
    assert got.get("GOMP_SPINCOUNT") != llmctl.GOMP_SPINCOUNT_DEFAULT
    kind, got = _libgomp_settings({"OMP_WAIT_POLICY": "active"})
    assert (kind, got["OMP_WAIT_POLICY"]) == ("None", "ACTIVE")
    kind, got = _libgomp_settings({"GOMP_SPINCOUNT": "12345"})
    assert (kind, got["GOMP_SPINCOUNT"]) == ("None", "12345")
    # a rank started by llmctl keeps its parent's choice and says it is llmctl's
    kind, got = _libgomp_settings({"GOMP_SPINCOUNT": "1000000", "LLMCTL_OPENMP_WAIT": "spin"})
    assert (kind, got["GOMP_SPINCOUNT"]) == ("spin", "1000000")


def test_ranks_that_share_cores_wait_passively_unless_the_user_said(monkeypatch):
    import llmctl
    from llmctl.info import usable_cores
    from llmctl.jobs.launcher import _no_spin_when_oversubscribed

    monkeypatch.setattr(llmctl, "OPENMP_WAIT", "spin")
    cores = usable_cores()
    fits = {"GOMP_SPINCOUNT": "1000000", "LLMCTL_OPENMP_WAIT": "spin"}
    _no_spin_when_oversubscribed(fits, cores, 1)
    assert fits == {"GOMP_SPINCOUNT": "1000000", "LLMCTL_OPENMP_WAIT": "spin"}
    over = {"GOMP_SPINCOUNT": "1000000", "LLMCTL_OPENMP_WAIT": "spin"}
    _no_spin_when_oversubscribed(over, cores, 2)
    assert over == {"OMP_WAIT_POLICY": "PASSIVE", "LLMCTL_OPENMP_WAIT": "passive"}
    monkeypatch.setattr(llmctl, "OPENMP_WAIT", None)   # the user's GOMP_SPINCOUNT stays
    mine = {"GOMP_SPINCOUNT": "5"}
    _no_spin_when_oversubscribed(mine, cores, 2)
    assert mine == {"GOMP_SPINCOUNT": "5"}


@pytest.mark.parametrize("args", [["info"], ["sample", "-e", "d6", "-n", "1"]])
def test_a_kernel_that_does_not_load_is_one_error_line(tmp_path, args):
    # an extension built for another Python, or a shared library gone from under it: the
    # ImportError becomes llmctl's Error/Hint lines naming the module, not a traceback
    from errcheck import assert_cli_error

    prog = ("import sys; sys.modules['llmctl._ext.matmul'] = None; sys.argv = ['llmctl'] + sys.argv[1:]\n"
            "from llmctl.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", prog] + args, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert_cli_error(r.stderr, 1, r.returncode, names=["llmctl._ext.matmul", "build_ext"])


def test_onednn_that_does_not_load_names_the_wheel_to_reinstall():
    import llmctl._ext as ext

    e = ImportError("libdnnl.so.3: cannot open shared object file: No such file or directory",
                    name="llmctl._ext.matmul")
    assert ext.is_ours(e) and not ext.is_ours(ImportError("x", name="numpy.linalg"))
    message, hint = ext.load_error(e)
    assert "libdnnl.so.3" in message and "pip install --force-reinstall --no-deps onednn-cpu-gomp" in hint


def test_info_names_a_test_build_and_the_directory_it_was_loaded_from(tmp_path):
    import llmctl._ext

    info = json.loads(_cli("info", "--json"))
    assert info["simde_avx512"] is False and info["portable"] is False and info["ext_dir"] is None   # a release build
    here = str(Path(llmctl._ext.__file__).parent)
    text = _cli("info", env={"LLMCTL_EXT_DIR": here})
    assert text.splitlines()[4].endswith(f" (loaded from LLMCTL_EXT_DIR={here})"), text
    # a directory without the kernels: the installed ones load, and info says so
    empty = tmp_path / "no-kernels"
    empty.mkdir()
    line = _cli("info", env={"LLMCTL_EXT_DIR": str(empty)}).splitlines()[4]
    assert line.endswith(f" (LLMCTL_EXT_DIR={empty} has none of them: the installed ones loaded)"), line
    from llmctl.info import format_info, runtime_info

    info = dict(runtime_info(), simde_avx512=True, ext_dir=None)
    assert format_info(info).splitlines()[4].endswith(" (a test build: AVX-512 emulated by SIMDe, slow)")
    info = dict(runtime_info(), portable=True, ext_dir=None)
    assert format_info(info).splitlines()[4].endswith(" (a test build: portable C only)")
