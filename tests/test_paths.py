"""llmctl.paths: the default -e (llm.c's gpt2_124M.bin in the working directory, else pretrained
GPT-2 124M, else one error naming -e d12 and how to fetch the weights)."""
import struct

import pytest

from llmctl import paths
from llmctl.errors import DataError


def test_default_init_takes_gpt2_124M_bin_from_the_working_directory():
    with open("gpt2_124M.bin", "wb") as f:  # only its presence matters here; loading checks the rest
        f.write(struct.pack("<256i", 20240326, 3, *([0] * 254)))
    path, note = paths.default_init()
    assert path == "gpt2_124M.bin" and "working directory" in note


def test_default_init_offline_and_not_cached_is_one_error_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # nothing cached; HF_HUB_OFFLINE=1
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "empty_llmctl_cache"))
    with pytest.raises(DataError) as e:
        paths.default_init(progress=False)
    assert "no -e given: there is no gpt2_124M.bin here and pretrained gpt2 cannot be loaded" in e.value.message
    assert "-e d12" in e.value.hint and "llmctl prepro gpt2" in e.value.hint


def test_default_init_without_huggingface_hub_names_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` fails
    with pytest.raises(DataError) as e:
        paths.default_init(progress=False)
    assert "huggingface_hub is not installed" in e.value.message
    assert e.value.hint.startswith("install it: pip install") and "-e d12" in e.value.hint
