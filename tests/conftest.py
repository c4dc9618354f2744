"""Shared test fixtures: where the repo and the shared real data are."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

# A suite started in the background of a non-interactive shell (`pytest tests &`, some CI
# runners) inherits SIGINT ignored, and exec hands that on to every llmctl it starts: the Ctrl-C
# tests would find it deaf (as it should be under nohup). Catching it here restores Python's
# handler in this process and the default disposition in its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TEST_DATA_ENV = "LLMCTL_TEST_DATA"


def shared_data_dir():
    """The real test data: $LLMCTL_TEST_DATA if set, else shared/data beside the checkout."""
    env = os.environ.get(TEST_DATA_ENV, "").strip()
    return Path(env).expanduser() if env else SHARED_DATA


def under_ci():
    """CI=true (set by GitHub Actions and most CI services): what a test needs must be there."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require(ok, what):
    """A precondition from outside the repository (the real data, a compiler) that is not met:
    under CI the test fails saying what was looked for; locally it skips with the same text."""
    if not ok:
        if under_ci():
            pytest.fail(f"{what} (CI=true: required)", pytrace=False)
        pytest.skip(what)


def shared_file(rel):
    """Path to a file of the real test data ($LLMCTL_TEST_DATA, else the shared data directory
    beside the repo)."""
    p = shared_data_dir() / rel
    require(p.is_file(), f"real data {rel} is absent: looked for {p} (set {TEST_DATA_ENV} to the "
                         "directory that holds it; README.md, Tests)")
    return p


def without_module(module, code):
    """Run `code` in a fresh Python where `import module` fails (as when an extension is not built)
    and return (the value it assigns to `result`, the texts of the RuntimeWarnings it raised)."""
    prog = (f"import pickle, sys, warnings\nsys.modules[{module!r}] = None\n"
            "with warnings.catch_warnings(record=True) as caught:\n    warnings.simplefilter('always')\n"
            + textwrap.indent(code, "    ") +
            "\nsys.stdout.buffer.write(pickle.dumps((result, [str(w.message) for w in caught "
            "if issubclass(w.category, RuntimeWarning)])))\n")
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()
    return pickle.loads(r.stdout)


@pytest.fixture
def shakespeare_path():
    return shared_file("tinyshakespeare/input.txt")


@pytest.fixture
def hellaswag_jsonl():
    return shared_file("hellaswag/hellaswag_val.jsonl")


@pytest.fixture
def tinystories_path():
    return shared_file("tinystories/tinystories_sample.txt")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny byte-level run of the tests/test_train_*.py files (tests/trainkit.py): Tiny
    Shakespeare's bytes as llm.c uint16 shards and an llm.c checkpoint, built once per module."""
    from trainkit import tiny_params, write_llmc_checkpoint, write_shard

    src = shared_file("tinyshakespeare/input.txt")
    d = tmp_path_factory.mktemp("bytes")
    b = np.frombuffer(src.read_bytes(), dtype=np.uint8).astype(np.uint16)
    # two train shards (exercises shard shuffling), one val shard
    write_shard(d / "ts_bytes_train_000001.bin", b[32768:400000])
    write_shard(d / "ts_bytes_train_000002.bin", b[400000:])
    write_shard(d / "ts_bytes_val_000000.bin", b[:32768])
    ckpt = write_llmc_checkpoint(d / "tiny.bin", tiny_params())
    return {"dir": d, "train": str(d / "ts_bytes_train_*.bin"),
            "val": str(d / "ts_bytes_val_*.bin"), "ckpt": ckpt}


@pytest.fixture(params=["refused", "reset"])
def dead_hub(request):
    """An HF_ENDPOINT that cannot serve (deadhub.DeadHub), both kinds."""
    from deadhub import DeadHub

    ep = DeadHub(request.param)
    yield ep
    ep.sock.close()


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Tests never reach the internet: tiktoken/datasets must work from local files."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _private_converted_checkpoints(tmp_path, monkeypatch):
    """Pretrained checkpoints a test converts (-e gpt2, -e DIR) go to its own tmp dir, never the
    user's cache (docs/pretrained.md: $LLMCTL_CACHE)."""
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "llmctl-cache"))


@pytest.fixture(autouse=True)
def _cwd_outside_the_checkout(tmp_path, monkeypatch):
    """Run every test (and the `python -m llmctl` processes it starts) from an empty directory.

    From the repo root, `python -m` would import the source tree instead of the installed, built
    llmctl; a user's relative paths resolve against their own directory, never the checkout.
    """
    monkeypatch.chdir(tmp_path)
