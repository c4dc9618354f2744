"""How a run is shown: --json events, the plain display's lines, the rich display.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import json

from trainkit import run_cli, _base
from llmctl.display import PlainDisplay


def test_json_output_is_machine_readable(data, capsys):
    rc, out, err = run_cli(_base(data, **{"-x": "3", "-v": "2", "-m": "1", "-s": "3", "-g": "4"})
                           + ["--json"], capsys)
    assert rc == 0, err
    events = [json.loads(l) for l in out.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    assert kinds.count("step") == 3 and kinds.count("val") == 3 and kinds.count("sample") == 1
    assert events[-1]["steps_run"] == 3  # val at 0, 2 and the last step (3)


def test_plain_display_lines():
    import io

    buf = io.StringIO()
    d = PlainDisplay(buf)
    d.step({"step": 0, "num_steps": 10, "train_loss": 5.5, "lr": 3e-4, "grad_norm": 1.25,
            "ms": 12.5, "tokens_per_s": 10240.0, "mfu": 0.05})
    d.val(0, 5.25)
    assert buf.getvalue().splitlines() == [
        "step    1/10 | loss 5.500000 | norm 1.2500 | lr 3.00e-04 | 12.50 ms | 5.0% fp32 MFU | 10240 tok/s",
        "val loss 5.250000"]


def test_rich_display_renders():
    import io

    from rich.console import Console

    from llmctl.display import RichDisplay

    buf = io.StringIO()
    d = RichDisplay(Console(file=buf, force_terminal=True, width=100))
    d.start({"num_steps": 4, "start_step": 0})
    d.val(0, 5.0)
    d.step({"step": 0, "num_steps": 4, "train_loss": 5.5, "lr": 3e-4, "grad_norm": 1.0,
            "ms": 10.0, "tokens_per_s": 1000.0, "mfu": 0.01})
    d.sample(0, "hello")
    d.finish({"avg_ms": 10.0})
    text = buf.getvalue()
    assert "5.5000" in text and "hello" in text and "1/4" in text
