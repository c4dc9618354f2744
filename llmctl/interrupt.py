"""Ctrl-C, in one place: how a run is asked to stop, how a rank ignores it, how it is reported.

What it is:
- `StopRequest`, a context manager that turns SIGINT into a request: the first Ctrl-C sets
  `requested` (and prints `note`, if any), a second raises KeyboardInterrupt (the training loop:
  finish the step, checkpoint; again: stop at once), or, with `second_raises=False`, only counts
  (the launcher, whose watch loop decides). It can note SIGTERM too. Outside the main thread,
  where Python installs no handler, it does nothing.
- `ignore_in_child()`: a rank or pool worker leaves Ctrl-C to its parent, which stops it.
- `deliver_stop()`: a coordinated stop that arrived over a channel (the launcher's) is handed to
  the StopRequest of this process as if Ctrl-C had been pressed here.
- `held()`: a block a Ctrl-C must not split (a file renamed into place and the record that says
  so): a SIGINT inside it is delivered, to whatever handler was there, when the block ends.
- `say(text)`: the one "Interrupted: ..." line on stderr; EXIT_CODE (130, 128 + SIGINT) is the
  exit code of every interrupted command.

What it is not: the CLI's rendering of errors (llmctl/cli.py) or what a stopped run keeps
(each caller says that in `text`).
"""
import contextlib
import signal
import sys
import threading

EXIT_CODE = 130


def _on_main_thread():
    return threading.current_thread() is threading.main_thread()


class StopRequest:
    """`with StopRequest(note) as stop:` ... `if stop.requested:` (or install() ... restore());
    see the module doc."""

    def __init__(self, note=None, second_raises=True, catch_sigterm=False):
        self.note = note
        self.second_raises = second_raises
        self.catch_sigterm = catch_sigterm
        self.count = 0  # Ctrl-Cs so far
        self.sigterm = False
        self._prev = {}

    @property
    def requested(self):
        return self.count > 0

    def _on_sigint(self, signum, frame):
        if self.count and self.second_raises:
            raise KeyboardInterrupt
        self.count += 1
        if self.count == 1 and self.note:
            with contextlib.suppress(Exception):
                sys.stderr.write(self.note + "\n")
                sys.stderr.flush()

    def _on_sigterm(self, signum, frame):
        self.sigterm = True

    def install(self):
        if _on_main_thread():
            self._prev[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
            if self.catch_sigterm:
                self._prev[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def restore(self):
        """Put back the handlers install() replaced (none if it was not called)."""
        for sig, handler in self._prev.items():
            signal.signal(sig, handler)
        self._prev = {}

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.restore()
        return False


def ignore_in_child():
    """Ctrl-C reaches the whole process group: a child ignores it and its parent stops it (the
    launcher's coordinated stop, a pool's `with` block) instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def deliver_stop():
    """Raise SIGINT in this process if (and only if) a Python SIGINT handler is installed (a
    StopRequest) -- never the default one, which would throw KeyboardInterrupt out of the middle
    of a collective. -> whether it was delivered."""
    h = signal.getsignal(signal.SIGINT)
    if callable(h) and h is not signal.default_int_handler and _on_main_thread():
        signal.raise_signal(signal.SIGINT)
        return True
    return False


@contextlib.contextmanager
def held():
    """See the module doc. Off the main thread, where no handler can be set, or where SIGINT's
    handler was not installed from Python (it could not be put back), it holds nothing."""
    if not _on_main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught = []
    prev = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
        if caught:
            signal.raise_signal(signal.SIGINT)


def say(text, lead=False):
    """The "Interrupted: <text>" line on stderr. lead: start on a new line when stderr is a
    terminal (^C leaves the cursor mid-line)."""
    with contextlib.suppress(BrokenPipeError, ValueError):
        sys.stdout.flush()
    start = "\n" if lead and sys.stderr.isatty() else ""
    sys.stderr.write(f"{start}Interrupted: {text}\n")
    sys.stderr.flush()
