"""llmctl.inputs: split_inputs sorts what a -i glob matched by magic and name (train shards, val
shards, other llm.c files left out). Files are packed here with struct, not with llmctl's writer."""
import struct

from errcheck import raises_error

from llmctl.errors import DataError
from llmctl.inputs import split_inputs
from test_windows import write_shard


def _header_only(path, magic, version):
    """Just an llm.c header: split_inputs tells kinds apart by their magic alone."""
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", magic, version, *([0] * 254)))


def test_split_inputs_of_a_data_glob(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_shard(d / "tiny_shakespeare_train.bin", [1, 2, 3])
    write_shard(d / "tiny_shakespeare_val.bin", [4, 5, 6])
    write_shard(d / "fineweb_val_000000.bin", [7, 8])
    write_shard(d / "fineweb_train_000001.bin", [9, 10])
    _header_only(d / "hellaswag_val.bin", 20240522, 1)   # eval file: its name looks like val data
    _header_only(d / "gpt2_124M.bin", 20240326, 3)       # checkpoint
    _header_only(d / "gpt2_tokenizer.bin", 20240328, 2)  # tokenizer
    (d / "notes.bin").write_bytes(b"hello")               # not an llm.c file: the loader will say so
    s = split_inputs(str(d / "*.bin"))
    assert [p.split("/")[-1] for p in s.train] == ["fineweb_train_000001.bin", "notes.bin", "tiny_shakespeare_train.bin"]
    assert [p.split("/")[-1] for p in s.val] == ["fineweb_val_000000.bin", "tiny_shakespeare_val.bin"]
    assert [(p.split("/")[-1], w) for p, w in s.left_out] == [
        ("gpt2_124M.bin", "a model checkpoint"), ("gpt2_tokenizer.bin", "a tokenizer file"),
        ("hellaswag_val.bin", "an eval file, for -h 1 and eval hellaswag")]
    # only val shards matched: they are what to train on (as -a 1 does with llm.c's -j)
    s = split_inputs(str(d / "*_val*.bin"))
    assert [p.split("/")[-1] for p in s.train] == ["fineweb_val_000000.bin", "tiny_shakespeare_val.bin"]
    assert s.val == [] and [p.split("/")[-1] for p, _ in s.left_out] == ["hellaswag_val.bin"]
    with raises_error(DataError, names=["hellaswag_val.bin", "an eval file"]):
        split_inputs(str(d / "hellaswag*"))
    with raises_error(DataError, names=str(d / "nothing*")):
        split_inputs(str(d / "nothing*"))
