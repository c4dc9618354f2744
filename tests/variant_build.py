"""Test builds of the kernels, for the tests that need one (test_serial_build.py,
test_avx512_emulated.py, test_portable_build.py): setup.py + _ext/ are copied into a temp dir and
built there with a build switch, so the tree's own generated .c and .so files are never touched,
and a child process loads that build through LLMCTL_EXT_DIR (which the processes it starts
inherit)."""
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the extensions with a copy of their kernels per instruction set (or a portable C one); the
# others (decode, randinit, reduce, sampler, shards, tokens) have no code that the portable or
# SIMDe switches select, and a child of a build without them imports the installed ones
ISA_EXTS = "adamw,attention,buildinfo,convert,kvcache,layers,matmul"
# the kernel tests that are parametrised over instruction sets or read the build's copies
KERNEL_TESTS = ["test_attention.py", "test_attention_bf16.py", "test_kernels.py", "test_bf16.py", "test_sample.py"]


def build(root, switches, exts=None, timeout=900, source=REPO):
    """Build the extensions (all, or the comma-separated `exts`) of the tree `source` (this
    checkout, or an unpacked sdist) under root with the environment variables `switches` set ->
    the directory of the built llmctl._ext modules.

    At -O1 (LLMCTL_QUICK): these builds serve tests, and compile in half the time. The tree's
    Cython-generated .c files come along with their times, so cythonize regenerates only those
    older than their .pyx or its dependencies: the switches here act on the C compiler only."""
    src = root / "src"
    src.mkdir()
    shutil.copy2(source / "setup.py", src / "setup.py")
    shutil.copytree(source / "_ext", src / "_ext", ignore=shutil.ignore_patterns("*.so", "build"))
    out, tmp = root / "build", root / "tmp"
    env = {k: v for k, v in os.environ.items() if k != "LLMCTL_EXTS"}
    env["LLMCTL_QUICK"] = "1"
    env.update(switches)
    if exts:
        env["LLMCTL_EXTS"] = exts
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-j", "2", "-b", str(out), "-t", str(tmp)],
                       cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    ext_dir = out / "llmctl" / "_ext"
    # and Cython's shared utility module, which every module imports (setup.py's SHARED_UTILITY)
    want = 1 + (len(exts.split(",")) if exts else len(list((source / "_ext").glob("*.pyx"))))
    assert len(list(ext_dir.glob("*.so"))) == want, list(ext_dir.iterdir())
    assert len(list(ext_dir.glob("_cyutility.*"))) == 1, list(ext_dir.iterdir())
    return ext_dir


def env_for(ext_dir):
    """The environment of a child that loads the build in ext_dir."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLMCTL_EXTS", "LLMCTL_ATT_ISA", "LLMCTL_ATT_BF16")}
    env["LLMCTL_EXT_DIR"] = str(ext_dir)
    return env


def run_kernel_tests(ext_dir, xml, tests=KERNEL_TESTS, timeout=1200):
    """pytest on `tests` in a child that loads the build in ext_dir -> (the child's CompletedProcess,
    the ids that passed, the ids that were skipped), ids as "module::test[params]"."""
    # run from xml's directory, not the checkout: `python -m` puts its directory first on sys.path,
    # and the checkout's llmctl has no modules beside a non-editable install's (the ones the
    # build left out come from the installed llmctl)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                        "--rootdir", str(REPO)] + [str(REPO / "tests" / t) for t in tests],
                       capture_output=True, text=True, timeout=timeout, cwd=xml.parent, env=env_for(ext_dir))
    passed, skipped = set(), set()
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            (skipped if case.find("skipped") is not None else passed).add(name)
    return r, passed, skipped


def child_python(ext_dir, code, cwd):
    """python -c code in a child that loads the build in ext_dir -> its stdout."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_for(ext_dir), cwd=cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
