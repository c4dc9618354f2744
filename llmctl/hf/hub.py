"""`-e gpt2` and `-e DIR`: pretrained GPT-2 from the Hugging Face Hub or a local directory, as a
cached llm.c checkpoint.

What it is: the resolver from a pretrained spec to an llm.c v3 checkpoint file. Hub names
(`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`: OpenAI's weights under `openai-community/`) are
fetched with `huggingface_hub.hf_hub_download`, so the hub cache, `HF_HOME`, `HF_HUB_OFFLINE=1`
and `local_files_only` behave as in every Hugging Face tool and a download shows its progress bar.
The safetensors file is converted once (convert.py) and the checkpoint kept under
`$LLMCTL_CACHE` (default `$HF_HOME/llmctl`, i.e. `~/.cache/huggingface/llmctl`):
  hub/v1/<org>--<name>/<commit>/gpt2_124M.bin  keyed by the repo and the commit it came from
  local/<fingerprint>/gpt2_<size>.bin          a directory, keyed by its files' path, size, mtime
so the next run only reads config.json (to learn the commit) and the checkpoint. Concurrent
resolvers (the ranks of one job) serialize on a lock file and convert once.
What it is not: the conversion (convert.py), the model loader (llmctl/model/), or a network layer.
"""
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmctl.errors import ConfigError, DataError, FormatError, missing_dependency
from llmctl.hf.convert import SafetensorsGPT2, header_from_config, index_shards, read_config, size_name

HUB_ORG = "openai-community"
OPENAI_GPT2 = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
CACHE_ENV = "LLMCTL_CACHE"
LAYOUT = "v1"  # bump when the conversion changes, so old cached checkpoints are not reused
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded save_pretrained: model-0000i-of-0000n.safetensors
_NAME_RE = re.compile(r"(?:hf:)?(?:openai-community/)?(gpt2(?:-medium|-large|-xl)?)(?:@([\w.\-/]+))?")
_HF_RE = re.compile(r"hf:([\w.\-]+/[\w.\-]+)(?:@([\w.\-/]+))?")


@dataclass
class PretrainedSpec:
    repo_id: Optional[str] = None      # "openai-community/gpt2"
    revision: Optional[str] = None     # branch, tag or commit; None = main
    directory: Optional[str] = None    # a local Hugging Face model directory


def _is_model_dir(s):
    return os.path.isdir(s) and any(os.path.isfile(os.path.join(s, n)) for n in ("config.json", WEIGHTS))


def parse_spec(spec):
    """PretrainedSpec of `gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl` (optionally
    `openai-community/...`, `@revision`), `hf:ORG/NAME[@revision]`, or a directory holding
    config.json / model.safetensors (a directory wins over a name, as in transformers); else None."""
    s = str(spec).strip()
    if _is_model_dir(s):
        return PretrainedSpec(directory=s)
    m = _NAME_RE.fullmatch(s)
    if m:
        return PretrainedSpec(repo_id=f"{HUB_ORG}/{m.group(1)}", revision=m.group(2))
    m = _HF_RE.fullmatch(s)
    if m:
        return PretrainedSpec(repo_id=m.group(1), revision=m.group(2))
    return None


def is_pretrained_spec(spec):
    """True for what pretrained_checkpoint resolves: a hub name or a model directory."""
    return parse_spec(spec) is not None


def hf_home():
    """huggingface_hub's HF_HOME rule, read now (not at import): $HF_HOME, else
    $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    home = os.environ.get("HF_HOME")
    if not home:
        home = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home)))


def converted_cache_dir():
    """Where converted checkpoints live: $LLMCTL_CACHE, else $HF_HOME/llmctl."""
    env = os.environ.get(CACHE_ENV)
    return Path(os.path.expanduser(env)) if env else hf_home() / "llmctl"


def env_offline():
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to 1/ON/YES/TRUE, read now."""
    return any(os.environ.get(k, "").strip().upper() in {"1", "ON", "YES", "TRUE"}
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


# ---------------------------------------------------------------------------------------------
# hub download


class NotCached(DataError):
    """A hub file is not in the cache and cannot be downloaded."""


class NotInRepo(DataError):
    """The hub repo has no such file."""


def _fetch_hint(repo_id):
    return (f"fetch it once with network (`llmctl prepro gpt2 --model {repo_id}` or "
            f"`hf download {repo_id} config.json model.safetensors`), or set HF_HOME to a cache that "
            f"holds it; -e d12 starts from random weights instead")


def _unreachable_hint(repo_id):
    return ("no network here? pass a local model directory (config.json + model.safetensors) as -e DIR, "
            "or point HF_HOME at a Hugging Face cache that holds it and set HF_HUB_OFFLINE=1 so nothing "
            f"is tried online; with network, `llmctl prepro gpt2 --model {repo_id}` fetches it once; "
            "-e d12 starts from random weights instead")


def _transport_errors():
    """The network-level exceptions of huggingface_hub's HTTP client (name resolution, connection
    refused or reset, timeouts), whichever client this huggingface_hub uses (httpx2, httpx or
    requests). Their HTTP-status errors are huggingface_hub's own HfHubHTTPError."""
    import sys

    errs = []
    for mod, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                      ("requests", "RequestException")):
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type):
            errs.append(cls)
    return tuple(errs)


def _unreachable(repo_id, filename, where, err):
    from huggingface_hub import constants

    return NotCached(f"{repo_id}: {filename} is not in the Hugging Face cache ({where}) and the Hub "
                     f"({constants.ENDPOINT}) cannot be reached: {err}", _unreachable_hint(repo_id))


def hub_unreachable(repo_id, filename, *, repo_type=None, revision=None):
    """None when the Hub answers a HEAD request for one file of a repo (whatever the status: a
    404 or 401 is left to the caller's download, which reports it); the network error when it
    cannot be reached at all (no network, DNS fails, the endpoint refuses or resets).

    Why: hf_hub_download and datasets.load_dataset, finding no cached copy to fall back on, retry
    an unreachable Hub with backoff (5 retries, 1+2+4+8+8 s of sleep, each attempt with a 60 s
    timeout): ~25 s and five log lines before they give up on a machine without network. This
    is one request, with huggingface_hub's etag timeout (HF_HUB_ETAG_TIMEOUT, 10 s), no retry."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, repo_type=repo_type, revision=revision),
                             timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except _transport_errors() as e:
        return e
    except Exception:  # the Hub answered; the download says what (not found, gated, ...)
        pass
    return None


def _check_reachable(repo_id, filename, revision, where):
    """NotCached at once, before hf_hub_download, when a file that is not cached cannot be
    fetched because the Hub cannot be reached (hub_unreachable)."""
    err = hub_unreachable(repo_id, filename, revision=revision)
    if err is not None:
        raise _unreachable(repo_id, filename, where, err)


def _download(repo_id, filename, revision, cache_dir, offline, where):
    """hf_hub_download, falling back on the cached copy after a connection reset or protocol
    error, which huggingface_hub does not fall back on (it does on a refused connection or a
    timeout); -> the file's path."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir,
                                    local_files_only=offline))
    except _transport_errors() as e:
        if offline:
            raise
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir,
                                        local_files_only=True))
        except LocalEntryNotFoundError:
            raise _unreachable(repo_id, filename, where, e) from None


def hub_file(repo_id, filename, *, revision=None, local_files_only=None, cache_dir=None, progress=True):
    """Path of one file of a hub repo via hf_hub_download (cache first; downloads unless offline).
    A Hub that cannot be reached costs one request: the cached copy is used if there is one
    (as huggingface_hub does), else one NotCached error at once (_check_reachable)."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
        from huggingface_hub.utils import (EntryNotFoundError, HfHubHTTPError, HFValidationError,
                                           LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
                                           are_progress_bars_disabled, disable_progress_bars,
                                           enable_progress_bars)
    except ImportError:
        raise missing_dependency("huggingface_hub") from None
    offline = env_offline() if local_files_only is None else bool(local_files_only)
    where = cache_dir or constants.HF_HUB_CACHE
    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        if not offline:
            try:
                cached = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
            except HFValidationError:
                cached = None  # hf_hub_download reports it below
            if not isinstance(cached, str):
                _check_reachable(repo_id, filename, revision, where)
        return _download(repo_id, filename, revision, cache_dir, offline, where)
    except HFValidationError as e:
        raise ConfigError(f"{repo_id}: not a valid Hugging Face repo id or revision ({e})",
                          "a repo id is ORG/NAME of letters, digits, '-', '_' and '.'") from None
    except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: first
        why = ("downloads are off (HF_HUB_OFFLINE=1 or local_files_only)" if offline
               else "the Hub cannot be reached")
        raise NotCached(f"{repo_id}: {filename} is not in the Hugging Face cache ({where}) and {why}",
                        _fetch_hint(repo_id) if offline else _unreachable_hint(repo_id)) from None
    except RevisionNotFoundError:
        raise DataError(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub",
                        "use a branch, tag or commit of the repo, or leave @revision out") from None
    except RepositoryNotFoundError:
        raise DataError(f"{repo_id}: no such model on the Hugging Face Hub (or it is private or gated)",
                        "pretrained names are gpt2, gpt2-medium, gpt2-large, gpt2-xl; log in with "
                        "`hf auth login` for a private repo") from None
    except EntryNotFoundError:
        raise NotInRepo(f"{repo_id}: the repo has no {filename}",
                        "llmctl reads config.json + model.safetensors (no PyTorch, so no pytorch_model.bin)") from None
    except (HfHubHTTPError, OSError) as e:
        raise DataError(f"{repo_id}: cannot fetch {filename}: {e}", _fetch_hint(repo_id)) from None
    finally:
        if quiet:
            enable_progress_bars()


# ---------------------------------------------------------------------------------------------
# conversion cache


def _cached_ok(target, hdr):
    """A complete v3 checkpoint with exactly hdr's shape is already at target."""
    from llmctl.formats import read_checkpoint_header

    if not target.is_file():
        return False
    try:
        got = read_checkpoint_header(target)
    except FormatError:
        return False
    return got.version == 3 and got.to_bytes() == hdr.to_bytes()


def _convert_cached(target, hdr, weights, source, log):
    """Convert the safetensors file(s) to an llm.c checkpoint at target once (atomic, under a lock)."""
    from llmctl.formats import write_checkpoint_tensors

    if _cached_ok(target, hdr):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock

        lock = FileLock(str(target) + ".lock")
        lock.acquire()
    except ImportError:
        lock = None
    except OSError as e:
        raise DataError(f"{target.parent}: cannot create the converted-checkpoint cache: {e.strerror or e}",
                        f"set {CACHE_ENV} to a writable directory") from None
    try:
        if _cached_ok(target, hdr):  # another process converted it while we waited
            return target
        reader = SafetensorsGPT2(weights, hdr)
        reader.check_tied()
        if log:
            log(f"converting {source} to an llm.c checkpoint (once): {target}")
        write_checkpoint_tensors(target, hdr, reader.llmc_tensors(), "float32")
        return target
    finally:
        if lock is not None:
            lock.release()


def _fingerprint(*paths):
    h = hashlib.sha256(LAYOUT.encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.realpath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:20]


def _parse_or_fail(spec):
    p = parse_spec(spec)
    if p is None:
        raise ConfigError(f"{spec!r} is not a pretrained model name or a Hugging Face model directory",
                          "use gpt2, gpt2-medium, gpt2-large, gpt2-xl, hf:ORG/NAME, or a directory "
                          "with config.json and model.safetensors")
    return p


def pretrained_header(spec, *, revision=None, local_files_only=None, cache_dir=None):
    """The llm.c checkpoint header (v3) pretrained_checkpoint(spec) will have, from config.json
    alone (no weights are fetched or converted): for checks before anything big happens."""
    p = _parse_or_fail(spec)
    if p.directory:
        cfg_path = Path(p.directory) / "config.json"
        return header_from_config(read_config(cfg_path), where=str(cfg_path))
    cfg_path = hub_file(p.repo_id, "config.json", revision=revision or p.revision,
                        local_files_only=local_files_only, cache_dir=cache_dir, progress=False)
    return header_from_config(read_config(cfg_path), where=f"{p.repo_id}: config.json")


def pretrained_checkpoint(spec, *, revision=None, local_files_only=None, progress=True, cache_dir=None,
                          convert_dir=None, log=None):
    """Path of an llm.c v3 checkpoint for a pretrained spec (see parse_spec), converting and
    caching it on first use. Hub names go through huggingface_hub (local_files_only=None follows
    HF_HUB_OFFLINE; cache_dir=None is the hub cache of HF_HOME); convert_dir overrides the
    converted-checkpoint cache ($LLMCTL_CACHE, else $HF_HOME/llmctl). log(msg) hears about a
    conversion. Errors are LlmctlError with a hint (not in cache while offline, not GPT-2, ...)."""
    p = _parse_or_fail(spec)
    root = Path(convert_dir) if convert_dir else converted_cache_dir()
    if p.directory:
        d = Path(p.directory)
        cfg_path = d / "config.json"
        hdr = header_from_config(read_config(cfg_path), where=str(cfg_path))
        weights = _dir_weights(d)
        target = root / "local" / _fingerprint(cfg_path, *weights) / f"gpt2_{size_name(hdr)}.bin"
        return _convert_cached(target, hdr, weights, str(d), log)
    kw = dict(local_files_only=local_files_only, cache_dir=cache_dir, progress=progress)
    cfg_path = hub_file(p.repo_id, "config.json", revision=revision or p.revision, **kw)
    commit = cfg_path.parent.name  # <cache>/models--org--name/snapshots/<commit>/config.json
    hdr = header_from_config(read_config(cfg_path), where=f"{p.repo_id}: config.json")
    target = root / "hub" / LAYOUT / p.repo_id.replace("/", "--") / commit / f"gpt2_{size_name(hdr)}.bin"
    if _cached_ok(target, hdr):
        return target
    return _convert_cached(target, hdr, _hub_weights(p.repo_id, commit, kw), f"{p.repo_id}@{commit[:10]}", log)


def _dir_weights(d):
    """model.safetensors of a model directory, or the shards its index names."""
    if (d / WEIGHTS).is_file():
        return [d / WEIGHTS]
    if (d / WEIGHTS_INDEX).is_file():
        return [d / n for n in index_shards(d / WEIGHTS_INDEX)]
    raise FormatError(f"{d / WEIGHTS}: no such file",
                      "llmctl reads model.safetensors (no PyTorch, so no pytorch_model.bin); "
                      "transformers' save_pretrained writes it by default")


def _hub_weights(repo_id, commit, kw):
    """model.safetensors of a hub repo at commit, or the shards its index names."""
    try:
        return [hub_file(repo_id, WEIGHTS, revision=commit, **kw)]
    except (NotCached, NotInRepo) as first:
        try:
            index = hub_file(repo_id, WEIGHTS_INDEX, revision=commit, **kw)
        except (NotCached, NotInRepo):
            raise first from None
    return [hub_file(repo_id, n, revision=commit, **kw) for n in index_shards(index)]
