"""Write a file so that a reader never sees half of it: a temp file next to it, then os.replace.

What it is: `atomic_open(path)` (a context manager yielding a binary file) and
`atomic_write(path, data)` (bytes or str). On success the temp file `.NAME.tmp-PID` is renamed
onto `path` in one step; on any failure it is removed and `path` is untouched, so an interrupted
or failed write never leaves a valid-looking partial file (a checkpoint, shard or DONE_ marker).
An OSError (missing directory, disk full, a directory in the file's place) becomes one DataError
naming the path.

A `path` that already exists as something other than a regular file (a device such as
/dev/null, a FIFO, /dev/stdout) is written in place: renaming a temp file onto it would replace
the device node itself. A symlink to a regular file keeps the link: its target is replaced.

What it is not: durable against power loss (no fsync), and it creates no directories.
"""
import contextlib
import errno
import os
import stat

from llmctl.errors import DataError

WRITE_HINT = "check that the directory exists and is writable"


FULL_HINT = "free some disk space (or write somewhere else) and run again; nothing half-written was left"


def _error(path, e, hint):
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # not a permissions problem
        hint = FULL_HINT
    return DataError(f"{path}: cannot write file: {e.strerror or e}", hint)


@contextlib.contextmanager
def atomic_open(path, hint=WRITE_HINT):
    """Open a temp file next to `path` for binary writing; os.replace it into place on success."""
    path = os.fspath(path)
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode) and not os.path.isdir(path)
    except OSError:  # missing (or a dangling link): a new file
        special = False
    if special:
        yield from _write_in_place(path, hint)
        return
    target = os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)
    d, base = os.path.split(target)
    tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}")
    try:
        f = open(tmp, "wb")
    except OSError as e:
        raise _error(path, e, hint) from None
    try:
        with f:
            yield f
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # disk full, I/O error: one line, not a traceback
            raise _error(path, e, hint) from None
        raise


def _write_in_place(path, hint):
    try:
        with open(path, "wb") as f:
            yield f
    except OSError as e:
        raise _error(path, e, hint) from None


def atomic_write(path, data, hint=WRITE_HINT):
    """Write `data` (bytes, or str as UTF-8) to `path` atomically."""
    if isinstance(data, str):
        data = data.encode()
    with atomic_open(path, hint) as f:
        f.write(data)


def missing_dirs(path):
    """The directories os.makedirs(path) would create, deepest first (for remove_empty)."""
    out, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out


def remove_empty(dirs):
    """Undo os.makedirs after a failure that wrote nothing: rmdir each of `dirs`
    (missing_dirs' list, deepest first) while it is empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (a file was kept) or already gone: leave it and its parents
