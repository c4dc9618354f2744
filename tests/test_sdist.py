"""The source distribution (`python setup.py sdist`, what `python -m build` uploads): it carries
every kernel source (_ext/*.pyx, *.pxd, *.h, through MANIFEST.in) and none of the C cythonize
generates, and it builds. Without MANIFEST.in it held the generated .c but no .pyx, and since
setup.py builds from _ext/*.pyx, an install from it had no kernels at all."""
import fnmatch
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from variant_build import REPO, build, child_python

# what a checkout holds beside its sources: at its root environments, builds and outputs; anywhere
# compiled modules and caches
ROOT_SKIP = (".git", ".venv*", "build", "dist", "*.egg-info", "data", "out", "log*", ".pytest_cache", ".hypothesis")
ANY_SKIP = ("*.so", "__pycache__")


def _skip(d, names):
    pats = ANY_SKIP + (ROOT_SKIP if os.path.samefile(d, REPO) else ())
    return {n for n in names if any(fnmatch.fnmatch(n, p) for p in pats)}


@pytest.mark.slow
def test_sdist_has_the_kernel_sources_and_builds(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_skip)   # with the tree's generated _ext/*.c, if any
    env = {k: v for k, v in os.environ.items() if k != "LLMCTL_EXTS"}
    # cythonize runs in every setup.py command: one module is enough to make the sdist
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src,
                       env=dict(env, LLMCTL_EXTS="buildinfo"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (archive,) = (tmp_path / "dist").glob("llmctl-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        # the "data" filter where this Python has it (3.10.12+): no links or paths out of the dir
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "unpacked", **kw)
    want = {p.relative_to(REPO).as_posix() for pat in ("*.pyx", "*.pxd", "*.h") for p in (REPO / "_ext").glob(pat)}
    assert len([n for n in want if n.endswith(".pyx")]) >= 13, want
    assert want <= names, sorted(want - names)
    assert not [n for n in names if n.startswith("_ext/") and n.endswith(".c")], sorted(names)
    for need in ("setup.py", "pyproject.toml", "README.md", "tests/conftest.py", "tests/variant_build.py",
                 "dev/data/tinyshakespeare.py", "bench/step.py", "docs/architecture.md"):
        assert need in names, need
    assert not [n for n in names if n.endswith((".so", ".pyc"))], sorted(names)
    # and it builds: two modules (and the shared one) from the unpacked sources, loaded by a child
    (root,) = (tmp_path / "unpacked").iterdir()
    (tmp_path / "b").mkdir()
    ext_dir = build(tmp_path / "b", {}, exts="buildinfo,reduce", source=root)
    out = child_python(ext_dir, "from llmctl._ext import reduce; print(reduce.__file__)", tmp_path)
    assert out.startswith(str(ext_dir)), out
