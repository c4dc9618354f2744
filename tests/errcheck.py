"""Assertions on the errors a user meets, written so a rewording does not break them.

What it is: `raises_error` / `assert_error` for an llmctl exception (its type, the names and
values it must state, that it carries a hint) and `assert_cli_error` for what the CLI prints (one
`Error:` line, one `Hint:` line, no traceback, the exit code). `names` are the facts a user needs
from the text: the flag, the file, the offending value, the limit; each must appear somewhere in
the message or the hint (what the user reads). The prose around them is free to change.
What it is not: a check of the wording; a test that guards one specific sentence says so with
its own assert.
"""
import contextlib

import pytest


def _names(names):
    return [names] if isinstance(names, str) else list(names)


def _check_hint(hint, want, text):
    if want is True:
        assert hint and hint.strip(), f"no hint: {text}"
    elif want is False:
        assert not hint, f"unexpected hint {hint!r}: {text}"


def assert_error(exc, cls, names=(), hint=True):
    """`exc` (an exception or pytest's ExceptionInfo) is a `cls` whose message or hint states each
    of `names`; hint=True: it has a hint, False: it has none, None: either. Returns the exception."""
    e = getattr(exc, "value", exc)
    assert isinstance(e, cls), f"{type(e).__name__} is not a {cls.__name__}: {e}"
    text = f"{e} | hint: {getattr(e, 'hint', None)}"
    for n in _names(names):
        assert str(n) in text, f"{n!r} not named: {text}"
    _check_hint(getattr(e, "hint", None), hint, text)
    return e


@contextlib.contextmanager
def raises_error(cls, names=(), hint=True):
    """`with raises_error(ConfigError, names="-b"):` pytest.raises plus assert_error's checks.
    Plain exceptions (ValueError from a kernel) pass hint=None."""
    with pytest.raises(cls) as info:
        yield info
    assert_error(info, cls, names, hint)


def assert_cli_error(err, code=None, exit_code=None, names=(), hint=True):
    """`err` (the CLI's stderr) is one `Error:` line plus, with hint=True, one `Hint:` line, and no
    traceback; each of `names` appears in those two lines; `exit_code` (if given) equals `code`.
    Returns (error_line, hint_line or None)."""
    if code is not None:
        assert exit_code == code, f"exit code {exit_code}, expected {code}: {err}"
    assert "Traceback" not in err, err
    lines = [ln.strip() for ln in err.splitlines()]
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    hints = [ln for ln in lines if ln.startswith("Hint: ")]
    assert len(errors) == 1, f"expected one Error: line: {err}"
    if hint is True:
        assert len(hints) == 1 and hints[0][len("Hint: "):].strip(), f"expected one Hint: line: {err}"
    elif hint is False:
        assert not hints, f"unexpected Hint: line: {err}"
    text = errors[0] + "\n" + "\n".join(hints)
    for n in _names(names):
        assert str(n) in text, f"{n!r} not named: {err}"
    return errors[0], hints[0] if hints else None
