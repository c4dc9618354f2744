"""Getting a dataset's raw file onto disk: --source, then the local cache, then `datasets`, then HTTP.

What it is: the one fallback chain every `prepro` command uses to turn "I need Tiny Shakespeare"
into a local path. Each level that fails adds one short reason; if all fail, a single DataError
lists them and says how to pass `--source`.
What it is not: a tokenizer or writer; it never parses the file it fetches.
Mirrors: llm.c `dev/data/data_common.py` `download_file` (stream the canonical URL into the
dataset's cache dir, `DATA_CACHE_DIR/<file>`), made atomic (temp name + rename) and offline-safe.
"""
import contextlib
import http.client
import math
import os
import tempfile
import urllib.error
import urllib.request

from llmctl.atomic import atomic_write, missing_dirs, remove_empty
from llmctl.errors import ConfigError, DataError

DEFAULT_TIMEOUT = 30.0
_CHUNK = 1 << 20


def _usable_file(path):
    return os.path.isfile(path) and os.path.getsize(path) > 0


def check_timeout(timeout):
    """ConfigError (exit 2) unless the download timeout is a finite number of seconds > 0."""
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout {timeout}: must be a finite number of seconds > 0",
                          hint=f"the default is {DEFAULT_TIMEOUT:g}")


def _umask_mode():
    """The mode open() gives a new file (0o666 minus the umask); mkstemp's is 0o600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def download(url, path, timeout=DEFAULT_TIMEOUT):
    """Stream `url` to `path` via a temp file in the same directory; never leaves a partial file.
    Raises OSError/urllib errors (incl. a short read against Content-Length); a failed download
    also removes the directories it made for `path` (an empty data/ is not left behind)."""
    d = os.path.dirname(os.path.abspath(path))
    created = missing_dirs(d)
    os.makedirs(d, exist_ok=True)
    try:
        _download_into(url, path, d, timeout)
    except BaseException:
        remove_empty(created)
        raise


def _download_into(url, path, d, timeout):
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".part", dir=d)
    try:
        os.fchmod(fd, _umask_mode())  # the cached copy is as readable as the .bin files beside it
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as r:
            expected = r.headers.get("Content-Length")
            n = 0
            while True:
                chunk = r.read(_CHUNK)
                if not chunk:
                    break
                f.write(chunk)
                n += len(chunk)
        if expected is not None and n != int(expected):
            raise OSError(f"short read: got {n} of {expected} bytes")
        if n == 0:
            raise OSError("the server sent an empty file")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def obtain(what, *, source=None, cache_path, url=None, from_datasets=None, hub_dataset=None,
           timeout=DEFAULT_TIMEOUT, log=None):
    """Return {"path", "origin", "notes"} for a local copy of dataset `what`.

    Order: `source` (must exist if given: an explicit path never silently falls back), the
    cache file `cache_path`, `from_datasets(datasets_module) -> bytes` (written to the cache),
    then an HTTP download of `url` into the cache. `log(msg)` is told before a download starts;
    the returned "notes" say why each earlier level was skipped. `hub_dataset` (the repo id that
    from_datasets loads): when the Hub cannot be reached, datasets runs offline (its own cache
    only) instead of retrying for ~25 s (datasets_reachable).
    """
    check_timeout(timeout)
    notes = []
    note = notes.append

    if source is not None:
        return {"path": _check_source(what, source), "origin": "source", "notes": notes}

    cache_path = os.fspath(cache_path)
    if _usable_file(cache_path):
        return {"path": cache_path, "origin": "cache", "notes": notes}
    note(f"cache: {cache_path} not found")

    if from_datasets is not None and _via_datasets(from_datasets, hub_dataset, cache_path, note):
        return {"path": cache_path, "origin": "datasets", "notes": notes}

    if url:
        if log:
            log(f"downloading {url} -> {cache_path}")
        try:
            download(url, cache_path, timeout=timeout)
            return {"path": cache_path, "origin": "download", "notes": notes}
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            note(f"download {url}: failed ({type(e).__name__}: {first_line(e)})")

    raise DataError(f"could not get {what}: " + "; ".join(notes),
                    hint=f"download it yourself and pass it with --source PATH (or put it at {cache_path})")


def _check_source(what, source):
    """--source PATH must be a regular non-empty file (an explicit path never falls back); -> it."""
    source = os.fspath(source)
    if not os.path.exists(source):
        raise DataError(f"--source {source}: no such file", hint=f"pass the path of a local copy of {what}")
    if os.path.isdir(source):
        raise DataError(f"--source {source}: is a directory, not a file",
                        hint=f"pass the path of a local copy of {what}")
    if not _usable_file(source):
        raise DataError(f"--source {source}: not a regular non-empty file",
                        hint=f"pass the path of a local copy of {what}")
    return source


def _via_datasets(from_datasets, hub_dataset, cache_path, note):
    """Write from_datasets(datasets)'s bytes to the cache; -> True, or False with a note why not."""
    try:
        import datasets as ds  # optional dependency: pip install 'llmctl[datasets]'
    except ImportError:
        note("datasets: not installed (pip install datasets)")
        return False
    unreachable = None
    try:
        with datasets_reachable(ds, hub_dataset) as unreachable:
            data = from_datasets(ds)
        if not data:
            raise ValueError("it returned no data")
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        atomic_write(cache_path, data)
        return True
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        if unreachable is not None and isinstance(e, ConnectionError):  # offline, not cached
            note(f"datasets: the Hub cannot be reached ({type(unreachable).__name__}: "
                 f"{first_line(unreachable)}) and datasets' cache has no copy")
        else:
            note(f"datasets: failed ({type(e).__name__}: {first_line(e)})")
        return False


@contextlib.contextmanager
def datasets_reachable(ds, repo_id):
    """Yield None, or the network error when the `datasets` library `ds` is online (no
    HF_HUB_OFFLINE) but the Hub cannot be reached for dataset repo_id (one request, see
    llmctl.hf.hub.hub_unreachable); in that case datasets runs offline inside the block, so a
    copy in its cache is still used and a missing one fails at once (ConnectionError) instead
    of after datasets' retries. datasets reads HF_HUB_OFFLINE into `datasets.config` when it is
    imported and consults it on each load, so that is what is set, and restored after."""
    if repo_id is None or ds.config.HF_HUB_OFFLINE:
        yield None
        return
    from llmctl.hf.hub import hub_unreachable

    err = hub_unreachable(repo_id, "README.md", repo_type="dataset")
    if err is None:
        yield None
        return
    ds.config.HF_HUB_OFFLINE = True
    try:
        yield err
    finally:
        ds.config.HF_HUB_OFFLINE = False


def first_line(e):
    """The first line of an exception's message, at most 200 characters, for a one-line note."""
    s = str(e).strip().splitlines()
    return s[0][:200] if s else "no message"
