"""The default -e, llmctl.model.default_init over llmctl.paths' names: llm.c's gpt2_124M.bin in
the working directory, else pretrained GPT-2 124M, else one error naming -e d12 and how to fetch
the weights."""
import struct

from errcheck import assert_cli_error, raises_error

from llmctl.model import default_init, resolve_init
from llmctl.errors import DataError


def test_default_init_takes_gpt2_124M_bin_from_the_working_directory():
    with open("gpt2_124M.bin", "wb") as f:  # only its presence matters here; loading checks the rest
        f.write(struct.pack("<256i", 20240326, 3, *([0] * 254)))
    path, note = default_init()
    assert path == "gpt2_124M.bin" and "working directory" in note


def test_default_init_offline_and_not_cached_is_one_error_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # nothing cached; HF_HUB_OFFLINE=1
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "empty_llmctl_cache"))
    # the default it looked for, and the two ways out: random init, or fetch the weights first
    with raises_error(DataError, names=["-e", "gpt2_124M.bin", "-e d12", "llmctl prepro gpt2"]):
        default_init(progress=False)


def test_default_init_without_huggingface_hub_names_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` fails
    with raises_error(DataError, names=["huggingface_hub", "pip install", "-e d12"]):
        default_init(progress=False)


def _llmctl(*args, env_extra=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_eval_loss_and_sample_without_e_use_gpt2_124M_bin_here(tmp_path):
    import json
    import shutil

    from tinyrun import write_tiny_run

    (tmp_path / "run").mkdir()
    d = write_tiny_run(tmp_path / "run", train_tokens=300)
    shutil.copy(d / "init.bin", "gpt2_124M.bin")  # the cwd is the test's empty directory
    r = _llmctl("eval", "loss", "-j", str(d / "val.bin"), "-t", "16", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    with_e = _llmctl("eval", "loss", "-e", "gpt2_124M.bin", "-j", str(d / "val.bin"), "-t", "16",
                     "--threads", "1", "--json")
    assert json.loads(r.stdout)["loss"] == json.loads(with_e.stdout)["loss"]
    r = _llmctl("sample", "-n", "4", "--temperature", "0", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["tokens"]) == 4


def test_eval_loss_and_sample_without_e_offline_is_one_error_naming_e_d12(tmp_path):
    env = {"HF_HOME": str(tmp_path / "empty_hf_home"), "LLMCTL_CACHE": str(tmp_path / "empty_cache"),
           "HF_HUB_OFFLINE": "1"}
    for args in (("eval", "loss"), ("sample", "-n", "4")):
        r = _llmctl(*args, env_extra=env)
        assert_cli_error(r.stderr, 1, r.returncode, names=["-e", "-e d12"])


def test_resolve_init_keeps_a_given_spec_and_names_the_default_it_picks():
    assert resolve_init("d6") == ("d6", None)
    with open("gpt2_124M.bin", "wb") as f:
        f.write(struct.pack("<256i", 20240326, 3, *([0] * 254)))
    assert resolve_init(None) == ("gpt2_124M.bin",
                                  "gpt2_124M.bin (no -e: gpt2_124M.bin in the working directory)")
