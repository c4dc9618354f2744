"""llmctl.windows: TokenWindows against plain list slicing of the token stream (the TextDataset rule
len = n - block_size - 1, x = tokens[i:i+T], y = tokens[i+1:i+T+1]), and WindowBatches' epochs,
ranks and resume. Shards are packed here with struct, not with llmctl's writer."""
import pickle
import struct

import numpy as np
import pytest
from errcheck import raises_error

from llmctl.windows import TokenWindows, WindowBatches
from llmctl.errors import ConfigError, DataError, FormatError


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
    return str(path)


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50257, 300).tolist()
    b = rng.integers(0, 50257, 111).tolist()
    write_shard(tmp_path / "s_train_000001.bin", a)
    write_shard(tmp_path / "s_train_000002.bin", b)
    return str(tmp_path / "s_train_*.bin"), [a, b]


def ref_windows(tokens, T, stride):
    """The classic TextDataset over a token list, generalised to a stride: starts 0, stride, ... < n - T - 1."""
    return [(tokens[i:i + T], tokens[i + 1:i + T + 1]) for i in range(0, len(tokens) - T - 1, stride)]


@pytest.mark.parametrize("T,stride", [(8, 1), (16, 16), (5, 3), (109, 1)])
def test_windows_match_list_slicing_per_shard(shards, T, stride):
    pattern, toks = shards
    ds = TokenWindows(pattern, T, stride=stride)
    ref = ref_windows(toks[0], T, stride) + ref_windows(toks[1], T, stride)  # never across shards
    assert len(ds) == len(ref)
    for i, (rx, ry) in enumerate(ref):
        x, y = ds[i]
        assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == y.shape == (T,)
        assert x.tolist() == rx and y.tolist() == ry
    if stride == 1:
        assert len(ds) == (300 - T - 1) + max(0, 111 - T - 1)


def test_stride_block_size_does_not_overlap(shards):
    pattern, toks = shards
    T = 16
    ds = TokenWindows(pattern, T, stride=T)
    per_shard = [len(range(0, len(t) - T - 1, T)) for t in toks]
    xs = [ds[i][0] for i in range(per_shard[0])]
    assert np.concatenate(xs).tolist() == toks[0][:per_shard[0] * T]  # consecutive, no overlap, no gap
    assert ds.locate(per_shard[0]) == (1, 0)


def test_indexing_like_a_sequence(shards):
    pattern, toks = shards
    ds = TokenWindows(pattern, 8)
    assert ds[-1][1].tolist() == toks[1][-10 + 1:-1]  # last start is n - T - 2
    assert [a.tolist() for a in ds[np.int64(3)]] == [a.tolist() for a in ds[3]]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(TypeError):
        ds[1.5]
    assert list(iter(ds[i] for i in range(2)))  # what a Sampler does: ints in range(len)


def test_pickles_without_its_memory_maps(shards):
    pattern, _ = shards
    ds = TokenWindows(pattern, 8)
    fresh = len(pickle.dumps(ds))
    ds[0]  # opens a map
    assert len(pickle.dumps(ds)) == fresh  # the open map is not in the pickle (no shard bytes)
    copy = pickle.loads(pickle.dumps(ds))  # what DataLoader workers receive
    assert all((a == b).all() for a, b in zip(copy[5], ds[5]))


def test_bad_input_is_one_clear_error(tmp_path, shards):
    with raises_error(DataError, names=str(tmp_path / "nope_*.bin")):
        TokenWindows(str(tmp_path / "nope_*.bin"), 8)
    short = write_shard(tmp_path / "short.bin", [1, 2, 3, 4])
    with raises_error(DataError, names=["block_size+2 = 6", str(short)]):
        TokenWindows(short, 4)
    assert len(TokenWindows(short, 2)) == 1
    for bad in (0, -3):
        with raises_error(ConfigError, names=["block_size", str(bad)], hint=None):  # library arguments: no flag to name
            TokenWindows(shards[0], bad)
        with raises_error(ConfigError, names=["stride", str(bad)], hint=None):
            TokenWindows(shards[0], 4, stride=bad)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\0" * 2000)
    with raises_error(FormatError, names=[str(junk), "magic", "0"]):
        TokenWindows(str(junk), 4)


def test_under_torch_dataloader_shuffle_drop_last(shards):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    pattern, toks = shards
    ds = TokenWindows(pattern, 8)
    torch.manual_seed(0)
    batches = list(DataLoader(ds, batch_size=32, shuffle=True, drop_last=True))
    assert len(batches) == len(ds) // 32
    seen = set()
    for x, y in batches:
        assert x.dtype == torch.int64 and x.shape == y.shape == (32, 8)
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen.update(tuple(r) for r in x.tolist())
    assert len(seen) == 32 * len(batches)  # drop_last: whole batches of distinct windows


def test_window_batches_epochs_ranks_and_resume(shards):
    pattern, _ = shards
    ds = TokenWindows(pattern, 8)
    B, P = 4, 2
    per_epoch = len(ds) // (B * P)
    ranks = [WindowBatches(ds, B, process_rank=r, num_processes=P, seed=7) for r in range(P)]
    rows = []
    for _ in range(per_epoch):
        for r in ranks:
            x, y = r.next_batch()
            assert x.dtype == np.int32 and x.shape == (B, 8) and (x[:, 1:] == y[:, :-1]).all()
            rows += [tuple(v) for v in x.tolist()]
    # one epoch: B*P distinct windows a batch, every window at most once, the remainder dropped
    assert len(rows) == len(set(rows)) == per_epoch * B * P
    all_windows = {tuple(ds[i][0].tolist()) for i in range(len(ds))}
    assert set(rows) <= all_windows
    # next epoch: a different order, the same seed gives the same batches
    nxt = ranks[0].next_batch()[0]
    again = WindowBatches(ds, B, process_rank=0, num_processes=P, seed=7)
    for _ in range(per_epoch):
        again.next_batch()
    assert (again.next_batch()[0] == nxt).all()
    assert not (WindowBatches(ds, B, seed=8).next_batch()[0] == WindowBatches(ds, B, seed=7).next_batch()[0]).all()
    # resume mid-epoch and across the epoch boundary
    a = WindowBatches(ds, B, seed=3)
    for _ in range(per_epoch * 2 - 2):
        a.next_batch()
    st = a.state()
    b = WindowBatches(ds, B, seed=3)
    b.load_state(st)
    for _ in range(5):
        assert (a.next_batch()[0] == b.next_batch()[0]).all()
    with raises_error(DataError, names=[str(len(ds)), str(len(ds) + 1)]):
        WindowBatches(ds, len(ds) + 1)


def test_llmctl_data_is_another_name_of_llmctl_windows():
    from llmctl import data, windows

    assert data.TokenWindows is windows.TokenWindows and data.WindowBatches is windows.WindowBatches
