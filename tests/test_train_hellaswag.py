"""HellaSwag during training (-h 1): llm.c's log lines, and two ranks splitting the examples.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
from trainkit import cfg_for, metrics, train_nproc2, write_hellaswag
from llmctl.display import PlainDisplay
from llmctl.train import train


def test_hellaswag_during_training_logs_llmc_lines(data, tmp_path):
    """-h 1 -v 2 -x 4: HellaSwag at steps 2 and 4 (not 0), after val loss and before the step;
    each accuracy equals a direct eval_hellaswag call on that step's checkpoint."""
    import io

    from llmctl.evaluate import eval_hellaswag
    from llmctl.model import GPT2

    hs = write_hellaswag(tmp_path / "hs.bin")
    out = tmp_path / "run"
    buf = io.StringIO()
    s = train(cfg_for(data, out, max_steps=4, val_loss_every=2, checkpoint_every=2, hellaswag=1,
                      hellaswag_path=hs), display=PlainDisplay(buf))
    log = (out / "main.log").read_text().splitlines()
    evals = [(i, l) for i, l in enumerate(log) if " eval:" in l]
    assert [l.split()[0] for _, l in evals] == ["s:2", "s:4"]
    for i, line in evals:  # llm.c's order: tel, eval, then the step's trl (none after the last)
        assert log[i - 1].startswith(line.split()[0] + " tel:")
        assert i == len(log) - 1 or log[i + 1].startswith(line.split()[0] + " trl:")
    recs = metrics(out)
    assert [r["step"] for r in recs if "hellaswag_acc_norm" in r] == [2, 4]
    shown = [l for l in buf.getvalue().splitlines() if l.startswith("HellaSwag:")]
    assert len(shown) == 2
    for step, (_, line), msg in zip((2, 4), evals, shown):
        m = GPT2.from_checkpoint(str(out / f"model_{step:08d}.bin"), n_threads=1)
        want = eval_hellaswag(m, hs)
        assert recs[step]["hellaswag_acc_norm"] == want["acc_norm"]
        assert line == f"s:{step} eval:{want['acc_norm']:.4f}"
        # llm.c's printf0("HellaSwag: %d/%d = %f\n", ...)
        assert msg == f"HellaSwag: {want['correct_norm']}/7 = {want['acc_norm']:f}"
    assert s["hellaswag_acc_norm"] == recs[4]["hellaswag_acc_norm"]


def test_hellaswag_two_ranks_split_examples_and_limit(data, tmp_path):
    """Two processes (3 + 2 of the first 5 examples with --hellaswag-limit 5, counts summed) give
    the one-process accuracy of the same weights; with -v 0 HellaSwag runs only at the last step."""
    from llmctl.evaluate import eval_hellaswag
    from llmctl.model import GPT2

    hs = write_hellaswag(tmp_path / "hs.bin", n=9, seed=1)
    out = tmp_path / "r2"
    train_nproc2(data, out, "-x", "2", "-v", "0", "-n", "2", "-h", "1", "--hellaswag", hs,
                 "--hellaswag-limit", "5")
    recs = metrics(out)
    assert [r["step"] for r in recs if "hellaswag_acc_norm" in r] == [2]
    # no update follows the last step's eval: the final checkpoint holds the weights it scored
    model = GPT2.from_checkpoint(str(out / "model_00000002.bin"), n_threads=1)
    want = eval_hellaswag(model, hs, limit=5)
    assert want["num_examples"] == 5 and want["correct_norm"] > 0  # else a double count hides
    assert recs[2]["hellaswag_acc_norm"] == want["acc_norm"]
    assert (out / "main.log").read_text().splitlines()[-1] == f"s:2 eval:{want['acc_norm']:.4f}"
