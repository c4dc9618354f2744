"""DataLoader (llmctl/loader.py) against llm.c's documented vectors and an independent re-implementation.

The reference below is written from llm.c's `llmc/dataloader.h` alone: its own pure-Python
mt19937 (init_genrand + twist + tempering), its own permutation and its own batch arithmetic. It
does not import llmctl.rand or llmctl._ext, so a shared mistake cannot hide.
"""

import numpy as np
import pytest
from errcheck import raises_error

from llmctl.errors import DataError, FormatError
from llmctl.loader import DataLoader



# ---------------------------------------------------------------------------------------------
# independent reference


class RefMT19937:
    """The classic MT19937 (PyTorch CPU generator / llm.c rand.h), straight from the algorithm's definition."""

    def __init__(self, seed):
        mt = [seed & 0xFFFFFFFF]
        for j in range(1, 624):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + j) & 0xFFFFFFFF)
        self.mt, self.idx = mt, 624

    def _twist(self):
        mt = self.mt
        for i in range(624):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
            mt[i] = mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self.idx = 0

    def randint32(self):
        if self.idx >= 624:
            self._twist()
        y = self.mt[self.idx]
        self.idx += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF

    def permute(self, a):
        for i in range(len(a) - 1, 0, -1):
            j = self.randint32() % (i + 1)
            a[i], a[j] = a[j], a[i]


class RefLoader:
    """`llmc/dataloader.h`'s DataLoader over in-memory token arrays (one per file, in sorted-glob order)."""

    def __init__(self, shards, B, T, r=0, P=1, shuffle=True):
        self.shards, self.B, self.T, self.r, self.P, self.shuffle = shards, B, T, r, P, shuffle
        self.total = P * B * T
        if shuffle:
            self.rng = RefMT19937(42 + r)
            self.shard_indices = list(range(len(shards)))
        self.reset()

    def _load(self, i):
        f = self.shard_indices[i] if self.shuffle else i
        self.cur = self.shards[f]
        self.n_samples = (2 * len(self.cur) - 2) // (2 * self.total)

    def _intra(self):
        self.intra = list(range(self.n_samples))
        self.rng.permute(self.intra)

    def reset(self):
        self.shard_idx = self.sample_idx = 0
        if self.shuffle:
            self.rng.permute(self.shard_indices)
        self._load(0)
        if self.shuffle:
            self._intra()

    def advance(self):
        if self.shard_idx == len(self.shards) - 1:
            self.reset()
            return
        self.shard_idx += 1
        self.sample_idx = 0
        self._load(self.shard_idx)
        if self.shuffle:
            self._intra()

    def next_batch(self):
        if self.sample_idx >= self.n_samples:
            self.advance()
        s = self.intra[self.sample_idx] if self.shuffle else self.sample_idx
        off = s * self.total + self.r * self.B * self.T
        buf = [int(x) for x in self.cur[off:off + self.B * self.T + 1]]
        self.sample_idx += 1
        return buf[:-1], buf[1:]


def write_shard(path, tokens, magic=20240520, version=1, n=None):
    """llm.c write_datafile, written here independently of llmctl.formats."""
    tokens = np.asarray(tokens, dtype=np.uint16)
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if n is None else n
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    return str(path)


def test_reference_rng_matches_spec_vectors():
    rng = RefMT19937(137)
    assert [rng.randint32() for _ in range(5)] == [4053805790, 2173880614, 380293709,
                                                   1237255315, 2986595568]


# ---------------------------------------------------------------------------------------------
# llm.c's vectors on the real Tiny Shakespeare shards (`llmc/dataloader.h`, `dev/data/tinyshakespeare.py`)


@pytest.fixture(scope="module")
def shakespeare_shards(tmp_path_factory):
    from conftest import shared_file

    src = shared_file("tinyshakespeare/input.txt")
    from llmctl.tokenizer import get_tokenizer

    enc = get_tokenizer()
    sections = src.read_text(encoding="utf-8").split("\n\n")
    toks = []
    for i, s in enumerate(sections):
        toks.append(50256)
        toks.extend(enc.encode_ordinary(s + "\n\n" if i < len(sections) - 1 else s))
    d = tmp_path_factory.mktemp("tinyshakespeare")
    val = write_shard(d / "tiny_shakespeare_val.bin", toks[:32768])
    train = write_shard(d / "tiny_shakespeare_train.bin", toks[32768:])
    return train, val, np.asarray(toks[32768:], dtype=np.uint16)


def test_llmc_vectors_tinyshakespeare(shakespeare_shards):
    train, val, train_tokens = shakespeare_shards
    assert len(train_tokens) == 305260
    dl = DataLoader(train, 4, 64)
    assert dl.num_tokens == 305260 and dl.shard_num_samples == 1192
    assert dl.intra_shard_indices[:6].tolist() == [408, 791, 914, 1057, 81, 450]
    x, y = dl.next_batch()
    assert x.shape == (4, 64) and x.dtype == np.int32 and y.dtype == np.int32
    assert x.reshape(-1)[:6].tolist() == [673, 438, 13482, 1334, 477, 4302]
    assert np.array_equal(y.reshape(-1)[:-1], x.reshape(-1)[1:])
    for _ in range(1191):
        dl.next_batch()
    dl.next_batch()  # first batch of epoch 2 triggers the reshuffle
    assert dl.intra_shard_indices[:4].tolist() == [820, 64, 871, 704]

    r1 = DataLoader(train, 4, 64, process_rank=1, num_processes=2)
    assert r1.shard_num_samples == 596
    assert r1.intra_shard_indices[:3].tolist() == [251, 260, 93]
    # rank 1 reads the second B*T+1 slice of sample 251
    x1, _ = r1.next_batch()
    start = 251 * 2 * 256 + 256
    assert np.array_equal(x1.reshape(-1), train_tokens[start:start + 256])

    v = DataLoader(val, 4, 64, shuffle=False)
    assert v.shard_num_samples == 127
    xv, yv = v.next_batch()
    assert xv.reshape(-1)[:2].tolist() == [50256, 5962]


# ---------------------------------------------------------------------------------------------
# against the reference: several shards, epochs, ranks


@pytest.fixture
def three_shards(tmp_path):
    rs = np.random.default_rng(0)
    sizes = [1000, 1537, 700]  # unequal, so sample counts differ per shard
    arrs = [rs.integers(0, 65535, n).astype(np.uint16) for n in sizes]
    # write in reverse name order to check the glob is sorted
    for i in reversed(range(3)):
        write_shard(tmp_path / f"data_train_{i:06d}.bin", arrs[i])
    return str(tmp_path / "data_train_*.bin"), arrs


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("shuffle", [True, False])
def test_matches_reference_multishard_multiepoch(three_shards, P, shuffle):
    pattern, arrs = three_shards
    B, T = 2, 8
    for r in range(P):
        dl = DataLoader(pattern, B, T, process_rank=r, num_processes=P, shuffle=shuffle)
        ref = RefLoader(arrs, B, T, r, P, shuffle)
        per_epoch = sum((len(a) - 1) // (P * B * T) for a in arrs)
        assert dl.num_tokens == sum(len(a) for a in arrs)
        for k in range(3 * per_epoch + 5):  # three full epochs and a bit: composition of shard orders
            x, y = dl.next_batch()
            rx, ry = ref.next_batch()
            assert x.reshape(-1).tolist() == rx, (r, k)
            assert y.reshape(-1).tolist() == ry, (r, k)
        if shuffle:
            assert dl.shard_indices.tolist() == ref.shard_indices


def test_ranks_partition_each_sample(three_shards):
    pattern, arrs = three_shards
    r0 = DataLoader(pattern, 2, 8, 0, 2, shuffle=False)
    r1 = DataLoader(pattern, 2, 8, 1, 2, shuffle=False)
    x0, _ = r0.next_batch()
    x1, y1 = r1.next_batch()
    a = arrs[0]
    assert np.array_equal(x0.reshape(-1), a[:16]) and np.array_equal(x1.reshape(-1), a[16:32])
    assert y1.reshape(-1)[-1] == a[32]


@pytest.mark.parametrize("k", [0, 5, 61, 62, 63, 130, 200, 201, 202])  # 201 = one epoch
def test_resume_mid_epoch_gives_same_batches(three_shards, k):
    pattern, _ = three_shards
    a = DataLoader(pattern, 2, 8)
    for _ in range(k):
        a.next_batch()
    st = a.state()
    # a fresh loader has consumed different random numbers: the restore must overwrite them all
    b = DataLoader(pattern, 2, 8)
    b.next_batch()
    b.load_state(st["shard_indices"], st["intra_shard_indices"], st["rng_state"],
                 st["current_shard_idx"], st["current_sample_idx"])
    for _ in range(250):  # crosses shard boundaries and an epoch (201 samples per epoch)
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_state_rng_blob_is_llmc_struct(three_shards):
    pattern, _ = three_shards
    st = DataLoader(pattern, 2, 8).state()
    assert len(st["rng_state"]) == 2520
    assert st["shard_indices"].dtype == np.int32 and st["intra_shard_indices"].dtype == np.int32


def test_restore_rejects_other_glob(three_shards, tmp_path):
    pattern, _ = three_shards
    st = DataLoader(pattern, 2, 8).state()
    b = DataLoader(str(tmp_path / "data_train_00000[01].bin"), 2, 8)
    with raises_error(DataError, names=["3", "2"]):
        b.load_state(st["shard_indices"], st["intra_shard_indices"], st["rng_state"], 0, 0)


# ---------------------------------------------------------------------------------------------
# bad input


def test_no_match(tmp_path):
    with raises_error(DataError, names=str(tmp_path / "nothing_*.bin")):
        DataLoader(str(tmp_path / "nothing_*.bin"), 4, 64)


def test_shard_too_small_names_shard_and_counts(tmp_path):
    write_shard(tmp_path / "a_000.bin", np.arange(600))
    p = write_shard(tmp_path / "a_001.bin", np.arange(256))
    with pytest.raises(DataError) as e:
        DataLoader(str(tmp_path / "a_*.bin"), 4, 64, num_processes=2, process_rank=1)
    msg = e.value.message
    assert p in msg and "256 tokens" in msg and "513" in msg


@pytest.mark.parametrize("kind", ["magic", "version", "truncated", "empty"])
def test_corrupt_shard(tmp_path, kind):
    p = tmp_path / "x.bin"
    if kind == "magic":
        write_shard(p, np.arange(1000), magic=20240326)
    elif kind == "version":
        write_shard(p, np.arange(1000), version=7)
    elif kind == "truncated":
        write_shard(p, np.arange(1000), n=1200)
    else:
        p.write_bytes(b"")
    with pytest.raises((FormatError, DataError)) as e:
        DataLoader(str(p), 4, 64)
    assert str(p) in e.value.message


def test_out_of_vocab_id_is_named_up_front(tmp_path):
    """vocab_size=V: a shard holding an id >= V is a DataError naming the shard, the id and V,
    raised at construction; ids < V pass; vocab_size=None does not look at the tokens."""
    good = np.arange(1000) % 256
    bad = good.copy()
    bad[777] = 60000
    write_shard(tmp_path / "a_000.bin", good)
    write_shard(tmp_path / "a_001.bin", bad)
    pattern = str(tmp_path / "a_*.bin")
    with pytest.raises(DataError) as e:
        DataLoader(pattern, 2, 8, vocab_size=256)
    msg = e.value.message
    assert "a_001.bin" in msg and "60000" in msg and "256" in msg and "a_000.bin" not in msg
    DataLoader(pattern, 2, 8)  # no V: no check (llm.c's behaviour)
    DataLoader(str(tmp_path / "a_000.bin"), 2, 8, vocab_size=256)  # max id 255 < 256
    with pytest.raises(DataError):  # boundary: id == V is out of range
        DataLoader(str(tmp_path / "a_000.bin"), 2, 8, vocab_size=255)
