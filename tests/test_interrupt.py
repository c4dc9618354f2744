"""llmctl/interrupt.py: the one Ctrl-C guard (the loops' stop request, the launcher's count)."""
import signal

import pytest

from llmctl import interrupt


def test_the_first_ctrl_c_is_a_request_with_its_note_and_the_second_stops_at_once(capsys):
    before = signal.getsignal(signal.SIGINT)
    with interrupt.StopRequest("stopping after this step") as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and stop.count == 1
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    assert capsys.readouterr().err == "stopping after this step\n"


def test_the_launchers_guard_counts_ctrl_c_and_notes_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    stop = interrupt.StopRequest(second_raises=False, catch_sigterm=True).install()
    try:
        for _ in range(3):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        assert stop.count == 3 and stop.sigterm
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_from_the_launcher_reaches_only_a_guard_never_the_default_handler():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupt.deliver_stop() is False  # would have raised KeyboardInterrupt mid-collective
    with interrupt.StopRequest() as stop:
        assert interrupt.deliver_stop() is True and stop.requested


def test_the_interrupted_line_and_exit_code(capsys):
    interrupt.say("nothing was written.", lead=True)  # stderr is not a terminal here: no lead
    assert capsys.readouterr().err == "Interrupted: nothing was written.\n"
    assert interrupt.EXIT_CODE == 128 + signal.SIGINT


def test_a_ctrl_c_inside_a_held_block_arrives_when_the_block_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt.held():
            signal.raise_signal(signal.SIGINT)
            done.append("rest of the block")
    assert done == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupt.StopRequest() as stop:  # the handler that was there gets it, not a bare raise
        with interrupt.held():
            signal.raise_signal(signal.SIGINT)
            assert not stop.requested
        assert stop.requested and stop.count == 1
    with interrupt.held():
        pass  # nothing pressed: nothing delivered
