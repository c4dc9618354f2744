"""Where the tests find the real data (tests/conftest.py): $LLMCTL_TEST_DATA, else shared/data
beside the checkout; a file absent from there skips (fails under CI=true) naming the variable."""
import pytest

import conftest


def test_llmctl_test_data_names_the_directory_of_the_real_data(tmp_path, monkeypatch):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("First Citizen:\n")
    monkeypatch.setenv("LLMCTL_TEST_DATA", str(tmp_path))
    assert conftest.shared_file("tinyshakespeare/input.txt") == tmp_path / "tinyshakespeare" / "input.txt"
    monkeypatch.delenv("LLMCTL_TEST_DATA")
    assert conftest.shared_data_dir() == conftest.REPO.parent / "shared" / "data"


def test_absent_real_data_skips_naming_llmctl_test_data(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_TEST_DATA", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as e:
        conftest.shared_file("hellaswag/hellaswag_val.jsonl")
    assert str(tmp_path / "hellaswag" / "hellaswag_val.jsonl") in str(e.value)
    assert "LLMCTL_TEST_DATA" in str(e.value)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        conftest.shared_file("hellaswag/hellaswag_val.jsonl")
