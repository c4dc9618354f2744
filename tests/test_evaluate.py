"""Tests for llmctl.evaluate / `llmctl eval`: HellaSwag choices on real examples against the float64
NumPy reference scoring full llm.c rows, a hand-made 2-example file with a forced answer, rejected
malformed files, batching invariance, and `eval loss` against the reference's mean loss."""
import json

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

import reference as ref
from llmctl import formats
from llmctl.errors import ConfigError, DataError, FormatError
from llmctl.evaluate import eval_hellaswag, eval_loss, score_examples
from llmctl.model import GPT2

V, Vp = 50257, 50304


def _write_model(path, P, maxT, L, NH, C):
    cfg = dict(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp, num_layers=L, num_heads=NH, channels=C)
    formats.write_checkpoint(str(path), cfg, ref.params_to_flat(P, cfg))
    # one thread: tiny shapes, and spinning OpenMP/BLAS threads crawl on a loaded CI machine
    return GPT2.from_checkpoint(str(path), n_threads=1), cfg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = dict(max_seq_len=256, vocab_size=V, padded_vocab_size=Vp, num_layers=2, num_heads=4, channels=32)
    P = ref.random_params(cfg, seed=2, std=0.1)
    path = tmp_path_factory.mktemp("tiny") / "tiny.bin"
    model, cfg = _write_model(path, P, 256, 2, 4, 32)
    return model, P, cfg, str(path)


@pytest.fixture(scope="module")
def real_bin(tmp_path_factory):
    """hellaswag_val.bin of the first 12 real validation examples, written by `prepro hellaswag`
    (12, not more: the float64 reference's 50257-way softmax over 4 rows dominates test time)."""
    from conftest import shared_file
    from llmctl.prepro.hellaswag import prepro_hellaswag

    src = shared_file("hellaswag/hellaswag_val.jsonl")
    d = tmp_path_factory.mktemp("hs")
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(12)]
    (d / "part.jsonl").write_text("".join(lines), encoding="utf-8")
    return prepro_hellaswag(out_dir=str(d), source=str(d / "part.jsonl"))["path"]


def _reference_scores(P, cfg, ex):
    """llm.c EvalLoader rows for one example scored by the float64 reference:
    -> (summed losses, mean losses) per completion."""
    rows = [np.concatenate([ex.context, e]).astype(np.int64) for e in ex.endings]
    T = max(len(r) for r in rows)
    ids = np.zeros((4, T), np.int64)
    tgt = np.zeros((4, T), np.int64)
    mask = np.zeros((4, T))
    n_ctx = len(ex.context)
    for c, r in enumerate(rows):
        ids[c, :len(r)] = r
        tgt[c, :len(r) - 1] = r[1:]
        mask[c, n_ctx - 1:len(r) - 1] = 1  # positions n_ctx-1 .. n_ctx+n_c-2 predict the completion
    _, _, cache = ref.gpt2_forward(P, ids, tgt, cfg)
    sums = (cache["losses"] * mask).sum(axis=1)
    return sums, sums / mask.sum(axis=1)


def _first_argmin(a):
    return min(range(len(a)), key=lambda i: (a[i], i))


def test_real_hellaswag_choices_equal_reference(tiny, real_bin):
    model, P, cfg, _ = tiny
    res = eval_hellaswag(model, real_bin, per_example=True)
    examples = formats.read_evalfile(real_bin)
    assert res["num_examples"] == 12 and len(res["examples"]) == 12
    for ex, got in zip(examples, res["examples"]):
        sums, means = _reference_scores(P, cfg, ex)
        assert got["index"] == ex.index and got["label"] == ex.label
        assert got["num_tokens"] == [len(e) for e in ex.endings]
        # float32 vs float64 over 2 layers of C=32 and a 50257-way softmax: per-token losses agree
        # to ~1e-6 absolute; 1e-4 relative on sums of <= ~40 tokens of O(10) losses is generous
        np.testing.assert_allclose(got["losses_sum"], sums, rtol=1e-4)
        assert got["pred"] == _first_argmin(sums)
        assert got["pred_norm"] == _first_argmin(means)
    assert res["correct"] == sum(e["pred"] == e["label"] for e in res["examples"])
    assert res["correct_norm"] == sum(e["pred_norm"] == e["label"] for e in res["examples"])
    assert res["acc_norm"] == res["correct_norm"] / 12


def test_batching_does_not_change_results(tiny, real_bin):
    model = tiny[0]
    examples = formats.read_evalfile(real_bin)
    one = score_examples(model, examples, batch_tokens=64)      # one example per batch
    many = score_examples(model, examples, batch_tokens=100000)  # all in one padded batch
    for a, b in zip(one, many):
        assert (a.pred, a.pred_norm) == (b.pred, b.pred_norm)
        # same math, different padding/BLAS blocking: float32 rounding only
        np.testing.assert_allclose(a.losses_sum, b.losses_sum, rtol=1e-5)


def test_completion_groups_do_not_change_results(tiny, real_bin, monkeypatch):
    """Completion rows run in groups of similar length: one group per batch (the old padding),
    or a group per distinct length, scores the same (float32 rounding only), and fewer
    positions are run."""
    import llmctl.evaluate as E

    model = tiny[0]
    examples = formats.read_evalfile(real_bin)
    monkeypatch.setattr(E._length_groups, "__defaults__", (10**9,))   # one padded group
    one, ran_one = score_examples(model, examples, batch_tokens=100000), E.positions_run(examples, 100000)
    monkeypatch.setattr(E._length_groups, "__defaults__", (0,))       # no padding at all
    many, ran_many = score_examples(model, examples, batch_tokens=100000), E.positions_run(examples, 100000)
    for a, b in zip(one, many):
        assert (a.pred, a.pred_norm) == (b.pred, b.pred_norm)
        np.testing.assert_allclose(a.losses_sum, b.losses_sum, rtol=1e-5)
    needed = sum(len(ex.context) + sum(len(e) - 1 for e in ex.endings) for ex in examples)
    # one batch of 12: the contexts padded to the longest, completions padded or not
    assert ran_many == 12 * max(len(ex.context) for ex in examples) + needed - sum(len(ex.context) for ex in examples)
    assert ran_one > ran_many


def test_length_groups_are_the_cheapest_split():
    """_length_groups against every split of the sorted rows into consecutive groups."""
    from itertools import combinations

    from llmctl.evaluate import _length_groups

    rng = np.random.default_rng(0)
    for n in range(1, 8):
        for _ in range(20):
            lengths = rng.integers(1, 30, n)
            cost = int(rng.integers(0, 20))
            srt = np.sort(lengths)

            def price(bounds, srt=srt, cost=cost):
                return sum((j - i) * srt[j - 1] + cost for i, j in zip(bounds[:-1], bounds[1:]))
            best = min(price((0,) + c + (n,)) for k in range(n) for c in combinations(range(1, n), k))
            groups = _length_groups(lengths, cost)
            assert sorted(np.concatenate(groups).tolist()) == list(range(n))   # each row once
            assert sum(len(g) * lengths[g].max() + cost for g in groups) == best


def test_norm_chars(tiny, real_bin):
    from llmctl.tokenizer import get_tokenizer

    model, P, cfg, _ = tiny
    tok = get_tokenizer()
    res = eval_hellaswag(model, real_bin, limit=4, norm="chars", per_example=True)
    assert res["norm"] == "chars" and res["num_examples"] == 4
    for ex, got in zip(formats.read_evalfile(real_bin)[:4], res["examples"]):
        nchars = [len(tok.decode([int(t) for t in e])) for e in ex.endings]
        assert got["num_chars"] == nchars
        sums, _ = _reference_scores(P, cfg, ex)
        assert got["pred_norm"] == _first_argmin(sums / np.array(nchars))


# ----------------------------------------------------------------------------------------------
# a hand-made file with a known answer

@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    """A model that predicts 'the current token again': blocks output zero (projections 0), no
    position embedding, so logits_j = LN(wte[i]) . wte[j], largest for j = i by a wide margin
    (C=64: ~64 for j = i vs. max ~35 over 50k random others)."""
    cfg = dict(max_seq_len=32, vocab_size=V, padded_vocab_size=Vp, num_layers=1, num_heads=2, channels=64)
    P = ref.random_params(cfg, seed=5, std=0.1)
    P["wte"] = np.random.default_rng(5).normal(size=(Vp, 64))
    P["wte"][V:] = 0
    P["wpe"][:] = 0
    for name in ("attprojw", "attprojb", "fcprojw", "fcprojb", "lnfb"):
        P[name][:] = 0
    P["lnfw"][:] = 1
    d = tmp_path_factory.mktemp("echo")
    model, cfg = _write_model(d / "echo.bin", P, 32, 1, 2, 64)
    return model, P, cfg, str(d / "echo.bin")


def test_handmade_two_examples_known_answer(echo_model, tmp_path):
    model, P, cfg, _ = echo_model
    assert ref.gpt2_greedy(P, [42], 3, cfg) == [42, 42, 42, 42]  # it really echoes
    path = str(tmp_path / "two.bin")
    formats.write_evalfile(path, [
        # ending 0 repeats the last context token: the only cheap completion
        dict(label=0, ctx_tokens=[5, 6, 7], ending_tokens=[[7, 7, 7], [100, 200, 300], [400], [500, 600]]),
        # ending 0 = one surprising token (sum X); ending 1 = the same surprise then 3 cheap echoes
        # (sum >= X, mean ~X/4): the summed loss picks 0, the mean loss picks the label 1
        dict(label=1, ctx_tokens=[9, 9], ending_tokens=[[123], [123, 123, 123, 123], [456, 789], [777, 888, 999]]),
        # endings 0 and 1 are identical: an exact tie goes to the lowest index (llm.c's strict '<')
        dict(label=1, ctx_tokens=[3, 4], ending_tokens=[[4], [4], [50], [60]]),
    ])
    res = eval_hellaswag(model, path, per_example=True)
    assert [e["pred"] for e in res["examples"]] == [0, 0, 0]
    assert [e["pred_norm"] for e in res["examples"]] == [0, 1, 0]
    assert res["examples"][2]["losses_sum"][0] == res["examples"][2]["losses_sum"][1]
    assert (res["correct"], res["correct_norm"], res["num_examples"]) == (1, 2, 3)
    assert (res["acc"], res["acc_norm"]) == (1 / 3, 2 / 3)


def _run(args, capsys):
    from llmctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_eval_hellaswag_json(echo_model, tmp_path, capsys):
    path = str(tmp_path / "two.bin")
    formats.write_evalfile(path, [
        dict(label=0, ctx_tokens=[5, 6, 7], ending_tokens=[[7, 7], [100], [400], [500, 600]]),
        dict(label=2, ctx_tokens=[9], ending_tokens=[[1], [2, 3], [9, 9], [4]]),
    ])
    code, out, err = _run(["eval", "hellaswag", "--threads", "1", "-e", echo_model[3], "-i", path,
                           "--json", "--per-example"], capsys)
    assert code in (0, None)
    res = json.loads(out)
    assert {"acc", "acc_norm", "correct", "correct_norm", "num_examples"} <= set(res)
    assert res["precision"] == "fp32"
    assert (res["correct"], res["correct_norm"], res["num_examples"]) == (2, 2, 2)
    assert [e["pred_norm"] for e in res["examples"]] == [0, 2]
    code, out, err = _run(["eval", "hellaswag", "--threads", "1", "-e", echo_model[3], "-i", path], capsys)
    assert code in (0, None) and "acc_norm: 2/2 = 1.0000" in out


def test_cli_norm_chars_divides_by_characters_not_tokens(echo_model, tmp_path, capsys):
    """--norm chars through the CLI: ending 0 is one surprising 17-character token, ending 1 the
    same kind of surprise in 'x' followed by three cheap echoes. Per token, ending 1 is cheapest
    (~X/4); per character ending 0 is (~X/17 vs ~X/4): the flag flips the prediction, and each
    matches the float64 reference's argmin."""
    from llmctl.tokenizer import get_tokenizer

    model, P, cfg, ckpt = echo_model
    tok = get_tokenizer()
    long_id, x = tok.encode(" responsibilities")[0], tok.encode("x")[0]
    path = str(tmp_path / "chars.bin")
    formats.write_evalfile(path, [dict(label=0, ctx_tokens=[9], ending_tokens=[
        [long_id], [x, x, x, x], [tok.encode(" a")[0]], [tok.encode("!")[0]]])])
    ex = formats.read_evalfile(path)[0]
    sums, means = _reference_scores(P, cfg, ex)
    nchars = np.array([len(tok.decode([int(t) for t in e])) for e in ex.endings])
    assert nchars.tolist() == [17, 4, 2, 1]
    want_tokens, want_chars = _first_argmin(means), _first_argmin(sums / nchars)
    assert (want_tokens, want_chars) == (1, 0)  # the case tested: the two norms disagree
    preds = {}
    for norm in ("tokens", "chars"):
        code, out, err = _run(["eval", "hellaswag", "--threads", "1", "-e", ckpt, "-i", path,
                               "--norm", norm, "--json", "--per-example"], capsys)
        assert code in (0, None), err
        res = json.loads(out)
        assert res["norm"] == norm
        preds[norm] = res["examples"][0]["pred_norm"]
    assert preds == {"tokens": want_tokens, "chars": want_chars}


# ----------------------------------------------------------------------------------------------
# bad input

def test_malformed_eval_file_names_file_and_example(echo_model, tmp_path, capsys):
    model, _, _, ckpt = echo_model
    path = tmp_path / "bad.bin"
    formats.write_evalfile(str(path), [
        dict(label=0, ctx_tokens=[5, 6], ending_tokens=[[7], [8], [9], [10]]),
        dict(label=1, ctx_tokens=[5, 6], ending_tokens=[[7], [8], [9], [10]]),
    ])
    data = bytearray(path.read_bytes())
    ex1 = 1024 + 2 * 15                      # example 0 is 15 uint16 long
    data[ex1 + 6:ex1 + 8] = (7).to_bytes(2, "little")   # example 1's LABEL := 7
    path.write_bytes(bytes(data))
    with raises_error(FormatError, names=[str(path), "example 1", "7"]):
        eval_hellaswag(model, str(path))
    code, out, err = _run(["eval", "hellaswag", "--threads", "1", "-e", ckpt, "-i", str(path)], capsys)
    assert_cli_error(err, 1, code, names=[str(path), "example 1"])
    assert out == ""
    # a truncated file
    path.write_bytes(bytes(data[:-4]))
    with raises_error(FormatError, names=str(path)):
        eval_hellaswag(model, str(path))
    with raises_error(DataError, names=str(tmp_path / "missing.bin")):
        eval_hellaswag(model, str(tmp_path / "missing.bin"))


def test_example_longer_than_maxT_is_refused(echo_model, tmp_path):
    path = str(tmp_path / "long.bin")
    formats.write_evalfile(path, [
        dict(label=0, ctx_tokens=[5], ending_tokens=[[7], [8], [9], [10]]),
        dict(label=0, ctx_tokens=list(range(30)), ending_tokens=[[7], [8, 9, 10], [9], [10]]),
    ])
    with raises_error(ConfigError, names=["example 1", "33", "32"]):
        eval_hellaswag(echo_model[0], path)
    assert eval_hellaswag(echo_model[0], path, limit=1)["num_examples"] == 1


# ----------------------------------------------------------------------------------------------
# eval loss

def test_eval_loss_matches_reference(tiny, tmp_path, capsys):
    model, P, cfg, ckpt = tiny
    toks = np.random.default_rng(1).integers(0, V, size=50)
    formats.write_datafile(str(tmp_path / "x_val_000000.bin"), toks)
    formats.write_datafile(str(tmp_path / "x_val_000001.bin"), toks[:20])
    B, T = 2, 8
    want = []
    for s in [toks[i * 16:i * 16 + 17] for i in range(3)] + [toks[:17]]:  # 49 // 16 = 3, then 19 // 16 = 1
        loss, _, _ = ref.gpt2_forward(P, s[:-1].reshape(B, T), s[1:].reshape(B, T), cfg)
        want.append(loss)
    res = eval_loss(model, str(tmp_path / "x_val_*.bin"), B=B, T=T)
    assert res["num_batches"] == 4 and res["num_tokens"] == 4 * B * T
    # mean of 4 float32 mean losses of O(11) vs float64: 1e-5 relative
    assert res["loss"] == pytest.approx(np.mean(want), rel=1e-5)
    assert res["perplexity"] == pytest.approx(np.exp(np.mean(want)), rel=1e-4)
    assert eval_loss(model, str(tmp_path / "x_val_*.bin"), B=B, T=T, max_batches=2)["loss"] == \
        pytest.approx(np.mean(want[:2]), rel=1e-5)
    with raises_error(DataError, names=str(tmp_path / "nothing*.bin")):
        eval_loss(model, str(tmp_path / "nothing*.bin"))
    with raises_error(DataError, names=[str(tmp_path / "x_val_000001.bin"), "33"]):  # B*T+1 tokens
        eval_loss(model, str(tmp_path / "x_val_000001.bin"), B=4, T=8)
    code, out, err = _run(["eval", "loss", "--threads", "1", "-e", ckpt, "-j", str(tmp_path / "x_val_*.bin"),
                           "-b", "2", "-t", "8", "--json"], capsys)
    assert code in (0, None)
    assert json.loads(out)["loss"] == pytest.approx(np.mean(want), rel=1e-5)


def test_eval_loss_rejects_t_0_instead_of_running_the_default(tiny, tmp_path):
    model, _, _, _ = tiny
    formats.write_datafile(str(tmp_path / "z_val_000000.bin"), np.arange(40) % V)
    for bad in (0, -1, 257):
        with raises_error(ConfigError, names=[f"-t {bad}", "256"]):
            eval_loss(model, str(tmp_path / "z_val_000000.bin"), B=1, T=bad)
    with raises_error(ConfigError, names="-b 0"):
        eval_loss(model, str(tmp_path / "z_val_000000.bin"), B=0, T=8)


def test_eval_loss_rejects_m_0_and_below_minus_1_instead_of_scoring_everything(tiny, tmp_path):
    model, _, _, _ = tiny
    formats.write_datafile(str(tmp_path / "z_val_000000.bin"), np.arange(40) % V)
    for bad in (0, -2, -7):
        with raises_error(ConfigError, names=f"-m {bad}"):
            eval_loss(model, str(tmp_path / "z_val_000000.bin"), B=1, T=8, max_batches=bad)
    assert eval_loss(model, str(tmp_path / "z_val_000000.bin"), B=1, T=8, max_batches=-1)["num_batches"] == 4
    assert eval_loss(model, str(tmp_path / "z_val_000000.bin"), B=1, T=8, max_batches=1)["num_batches"] == 1


def test_hellaswag_scoring_keeps_no_buffers_past_the_pass(tiny, real_bin):
    """The cached forward's buffers serve every layer and batch of a pass, then are dropped:
    a HellaSwag eval inside training must not leave a big batch's buffers beside its activations."""
    _, _, _, ckpt = tiny
    m = GPT2.from_checkpoint(ckpt, n_threads=1)
    before = m.activation_bytes()
    x = m.embed(np.array([[1, 2, 3]]), np.zeros(1, np.int32))
    k = np.zeros((1, m.config.num_heads, 4, m.config.channels // m.config.num_heads), np.float32)
    m.block_forward(0, x, k, k.copy(), np.zeros(1, np.int32))
    assert m.activation_bytes() > before       # kept for the next layer's call
    score_examples(m, formats.read_evalfile(real_bin), batch_tokens=100000)
    assert m.activation_bytes() == before


def test_eval_loss_allocates_one_layer_of_activations(tiny, tmp_path):
    _, _, _, ckpt = tiny
    toks = np.random.default_rng(3).integers(0, V, size=40)
    formats.write_datafile(str(tmp_path / "y_val_000000.bin"), toks)
    B, T = 2, 8
    m = GPT2.from_checkpoint(ckpt, n_threads=1)
    eval_loss(m, str(tmp_path / "y_val_*.bin"), B=B, T=T)
    x, y = toks[:B * T].reshape(B, T), toks[1:B * T + 1].reshape(B, T)
    one_layer = GPT2.from_checkpoint(ckpt, n_threads=1)
    one_layer.forward(x, y, keep_activations=False)
    training = GPT2.from_checkpoint(ckpt, n_threads=1)
    training.forward(x, y)
    # the tiny model has L = 2 layers: the training forward keeps both, eval loss only one
    assert m.activation_bytes() == one_layer.activation_bytes() < training.activation_bytes()
    with pytest.raises(RuntimeError, match="keep_activations=True"):
        m.backward()


def test_nproc_2_sums_ranks(tiny, real_bin, capsys):
    # two local processes, each scoring a contiguous half (llm.c's split), counts summed
    model, _, _, ckpt = tiny
    want = eval_hellaswag(model, real_bin)
    code, out, err = _run(["eval", "hellaswag", "--nproc", "2", "--threads", "1", "-e", ckpt,
                           "-i", real_bin, "--json"], capsys)
    assert code in (0, None), err
    res = json.loads(out)
    assert res["nproc"] == 2
    for k in ("num_examples", "correct", "correct_norm", "acc", "acc_norm"):
        assert res[k] == want[k]


# ----------------------------------------------------------------------------------------------
# reviewer's findings: directories, non-finite loss, absurd parallelism

def test_eval_file_that_is_a_directory_says_so(tiny, tmp_path, capsys):
    model, _, _, ckpt = tiny
    d = tmp_path / "d"
    d.mkdir()
    with raises_error(DataError, names=[str(d), "is a directory"]):
        eval_hellaswag(model, str(d))
    code, out, err = _run(["eval", "hellaswag", "--threads", "1", "-e", ckpt, "-i", str(d)], capsys)
    assert_cli_error(err, 1, code, names=[str(d), "is a directory"])
    assert "not found" not in err


def test_eval_loss_of_a_nan_model_is_an_error_naming_the_checkpoint(tmp_path, capsys):
    cfg = dict(max_seq_len=16, vocab_size=V, padded_vocab_size=Vp, num_layers=1, num_heads=2, channels=16)
    P = ref.random_params(cfg, seed=3, std=0.1)
    P["lnfw"] = P["lnfw"] * np.nan  # every logit NaN
    ckpt = tmp_path / "nan_model.bin"
    formats.write_checkpoint(str(ckpt), cfg, ref.params_to_flat(P, cfg))
    formats.write_datafile(str(tmp_path / "v.bin"), np.arange(40) % 50)
    for extra in ([], ["--json"]):
        code, out, err = _run(["eval", "loss", "--threads", "1", "-e", str(ckpt), "-j", str(tmp_path / "v.bin"),
                               "-b", "2", "-t", "8"] + extra, capsys)
        assert_cli_error(err, 1, code, names=[str(ckpt), "not finite"])
        assert "loss:" not in out


def test_absurd_nproc_or_threads_are_refused_before_any_work(tiny, capsys):
    from llmctl.info import usable_cores

    ckpt = tiny[3]
    many = str(4 * usable_cores() + 1)
    for args in (["eval", "hellaswag", "-e", ckpt, "--nproc", many], ["eval", "hellaswag", "-e", ckpt, "--threads", many],
                 ["eval", "hellaswag", "-e", ckpt, "--nproc", "2", "--threads", many],
                 ["eval", "loss", "-e", ckpt, "--threads", "100000"],
                 ["sample", "-e", ckpt, "--threads", "100000"]):
        code, out, err = _run(args, capsys)
        assert_cli_error(err, 2, code, names=[args[-2], args[-1]])  # the flag and its value
