"""TrainConfig's checks and the `llmctl train` CLI built from it: every out-of-range
setting and flag, bad input through the CLI (one line, exit 1 or 2, nothing written).

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from errcheck import assert_cli_error
from trainkit import write_shard, cfg_for, metrics, write_hellaswag, run_cli, _base, _one_error
from llmctl.errors import ConfigError
from llmctl.train import TrainConfig, train


def _out_of_range_cases():
    """(field, value, the flag the error must name) for every TrainConfig field with a range: each
    field checked by its metadata gets values just outside its range (and nan/inf for reals),
    then the ranges validate() checks with the other settings."""
    from dataclasses import fields

    from llmctl.info import usable_cores
    from llmctl.train_config import Range

    bad = {"positive": [0, -1], "nonnegative": [-1], "zscore": [-0.5, math.nan], "bool01": [2, -1]}
    cases = []
    for f in fields(TrainConfig):
        check = f.metadata["check"]
        if check is None:
            continue
        flag = f.metadata["flags"][0] if f.metadata["flags"] else f.metadata["long"]
        if isinstance(check, Range):
            values = [math.nan, -math.inf, check.lo if check.lo_open else check.lo - 0.5]
            values += [check.hi] if check.hi_open and math.isfinite(check.hi) else []
            values += [check.hi + 0.5] if not check.hi_open else []
        else:
            values = bad[check]
        cases += [(f.name, v, flag) for v in values]
    return cases + [("max_steps", -2, "-x"), ("val_max_steps", -2, "-m"), ("val_max_steps", 0, "-m"),
                    ("hellaswag_limit", 0, "--hellaswag-limit"), ("gen_tokens", 0, "-g"),
                    ("threads", 4 * usable_cores() + 1, "--threads"), ("total_batch_size", 5, "-d"),
                    ("resume", 1, "-o"), ("sampler", "random", "--sampler"), ("lr_scheduler", "exp", "-k")]


OUT_OF_RANGE = _out_of_range_cases()


OUT_OF_RANGE_CLI = [c for c in OUT_OF_RANGE if c[0] != "eps"]  # AdamW eps has no flag (as in llm.c)


@pytest.mark.parametrize("name, value, flag", OUT_OF_RANGE, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE])
def test_each_out_of_range_setting_is_an_error_with_a_hint_naming_the_flag(name, value, flag):
    from dataclasses import replace

    with pytest.raises(ConfigError) as e:
        replace(TrainConfig(), **{name: value}).validate(P=1)
    assert flag in e.value.message and e.value.exit_code == 2, e.value.message
    assert e.value.hint and flag in e.value.hint, (e.value.message, e.value.hint)


@pytest.mark.parametrize("name, value, flag", OUT_OF_RANGE_CLI, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE_CLI])
def test_each_out_of_range_flag_is_one_error_and_a_hint_from_llmctl_train(name, value, flag, tmp_path,
                                                                          monkeypatch, capsys):
    from dataclasses import fields

    from llmctl.cli import main

    f = {f.name: f for f in fields(TrainConfig)}[name]
    monkeypatch.chdir(tmp_path)  # nothing to train on here: only the check can answer
    with pytest.raises(SystemExit) as e:
        main(["train", f.metadata["flags"][0], str(value)])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2, err
    assert err[0].startswith("Error: ") and flag in err[0] and err[1].startswith("Hint: "), err


def test_config_defaults_pass_and_every_range_check_names_its_flag():
    """TrainConfig's field metadata drive validate(): the defaults pass, and a value outside a
    field's range is a ConfigError (exit 2) naming that field's llm.c flag."""
    from dataclasses import fields, replace

    from llmctl.train_config import Range

    assert TrainConfig().validate(P=1) == (4 * 1024, 1)
    bad = {"positive": 0, "nonnegative": -1, "zscore": -0.5, "bool01": 2}
    checked = 0
    for f in fields(TrainConfig):
        check = f.metadata["check"]
        if check is None:
            continue
        v = math.nan if isinstance(check, Range) else bad[check]
        with pytest.raises(ConfigError) as e:
            replace(TrainConfig(), **{f.name: v}).validate(P=1)
        flag = f.metadata["flags"][0] if f.metadata["flags"] else f.metadata["long"]
        assert flag in e.value.message and e.value.exit_code == 2, (f.name, e.value.message)
        checked += 1
    assert checked == 20


def test_train_command_has_one_option_per_config_flag():
    """`llmctl train` is built from TrainConfig: each exposed field is an option with the
    field's flags (llm.c's short one first) and default, shown in --help."""
    from dataclasses import fields

    import typer

    from llmctl.cli import app

    cmd = typer.main.get_command(app).commands["train"]
    opts = {p.name: p for p in cmd.params}
    for f in fields(TrainConfig):
        m = f.metadata
        if not m["flags"]:
            assert f.name not in opts  # AdamW eps: hard-coded in llm.c, no flag
            continue
        o = opts[f.name]
        assert tuple(o.opts) == m["flags"] and o.help == m["help"], f.name
        assert o.default == m.get("cli_default", f.default), f.name


@pytest.mark.parametrize("case", ["no_match", "too_small", "T_gt_maxT", "d_not_multiple",
                                  "unwritable", "corrupt_ckpt", "bad_schedule", "resume_no_o",
                                  "hellaswag_missing", "hellaswag_too_long"])
def test_bad_input_one_line_error(data, tmp_path, capsys, case):
    out = tmp_path / "out"
    over = {"-o": str(out)}
    want = "no file matches"
    code = 1
    if case == "no_match":
        over["-i"] = str(tmp_path / "nothing_*.bin")
    elif case == "too_small":
        over["-i"] = write_shard(tmp_path / "small.bin", np.arange(100))
        want = "has 100 tokens but needs at least"
    elif case == "T_gt_maxT":
        over["-t"] = "64"
        want, code = "exceeds the model's maxT 32", 2
    elif case == "d_not_multiple":
        over["-d"] = "200"
        want, code = "not a positive multiple of B*T*P", 2
    elif case == "unwritable":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "sub"
        over["-o"] = str(out)
        want = f"{tmp_path / 'afile'} is a file, and -o must be a directory"
    elif case == "corrupt_ckpt":
        bad = tmp_path / "bad.bin"
        bad.write_bytes(Path(data["ckpt"]).read_bytes()[:5000])
        over["-e"] = str(bad)
        want = "bad.bin"
    elif case == "bad_schedule":
        over["-k"] = "exponential"
        want, code = "unknown learning-rate schedule", 2
    elif case == "resume_no_o":
        del over["-o"]
        over["-y"] = "1"
        want, code = "no -o was given", 2
    elif case == "hellaswag_missing":  # llm.c would skip HellaSwag silently
        over.update({"-h": "1", "--hellaswag": str(tmp_path / "hellaswag_val.bin")})
        want, code = "-h 1 needs the HellaSwag eval file", 2
    elif case == "hellaswag_too_long":
        over.update({"-h": "1", "--hellaswag": write_hellaswag(tmp_path / "hs.bin", ctx_len=30)})
        want, code = "but the model's maxT is 32", 2
    rc, stdout, err = run_cli(_base(data, **over), capsys)
    assert rc == code, err
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("Error:")]
    assert len(errors) == 1 and want in errors[0], err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()  # checked before anything is created
    if case == "hellaswag_missing":
        assert f"Hint: create it with `llmctl prepro hellaswag --out-dir {tmp_path}`" in err


def test_cli_subprocess_error_exit_code(data, tmp_path):
    r = subprocess.run([sys.executable, "-m", "llmctl", "train", "-i", str(tmp_path / "x*.bin"),
                        "-j", data["val"], "-e", data["ckpt"], "-t", "32"],
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.startswith("Error: ")
    assert_cli_error(r.stderr, 1, r.returncode, names=str(tmp_path / "x*.bin"))


@pytest.mark.parametrize("flag,value", [
    ("-l", "nan"), ("-l", "-1"), ("-l", "inf"), ("--beta1", "1.5"), ("--beta1", "-0.1"),
    ("--beta2", "1"), ("--beta2", "-1"), ("-q", "5"), ("-q", "-0.5"), ("--grad-clip", "-1"),
    ("--grad-clip", "nan"), ("-u", "-1"), ("-b", "0"), ("-t", "0"), ("-c", "nan"),
    ("-c", "-1"), ("--threads", "100000")])
def test_absurd_values_are_usage_errors(data, tmp_path, capsys, flag, value):
    out = tmp_path / "o"
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), flag: value}), capsys)
    assert rc == 2, err
    line = _one_error(err)
    assert flag in line, line
    assert not out.exists() and stdout == ""


def test_transport_and_its_alias_backend_are_one_option(capsys):
    """--backend is an alias of --transport: either spelling's value reaches the transport
    check, before any data is read."""
    for spelling in ("--transport", "--backend"):
        rc, out, err = run_cli([spelling, "carrier-pigeon"], capsys)
        assert rc == 2 and out == "", err
        assert _one_error(err) == "Error: --transport 'carrier-pigeon' is not one of auto, shm, ring, mpi"


def test_validation_accepts_the_edges(data, tmp_path):
    """The closed ends of every range run: lr 0 (and betas 0, no clip, no decay) trains a step
    that leaves the weights exactly as they were; betas just below 1 train a normal step."""
    still = tmp_path / "still"
    s = train(cfg_for(data, still, max_steps=1, val_loss_every=0, learning_rate=0.0,
                      final_lr_frac=0.0, beta1=0.0, beta2=0.0, grad_clip=0.0, weight_decay=0.0,
                      checkpoint_every=1))
    assert s["steps_run"] == 1 and metrics(still)[0]["lr"] == 0.0
    init = np.fromfile(data["ckpt"], dtype=np.float32)[256:]
    assert np.array_equal(np.fromfile(still / "model_00000001.bin", dtype=np.float32)[256:], init)
    moved = tmp_path / "moved"
    s = train(cfg_for(data, moved, max_steps=1, val_loss_every=0, final_lr_frac=1.0, beta1=0.99,
                      beta2=0.999, checkpoint_every=1))
    assert s["steps_run"] == 1 and math.isfinite(s["train_loss"])
    after = np.fromfile(moved / "model_00000001.bin", dtype=np.float32)[256:]
    assert np.isfinite(after).all() and not np.array_equal(after, init)
