"""`llmctl inspect-bin`: identify llm.c binaries by their magic and validate them fully.

What it is: `inspect_file(path) -> dict` (kind, valid, problem, plus per-kind fields) built on the
readers in llmctl.formats, and the one-line summaries the CLI prints. It never raises for a bad
file: every problem (missing, a directory, empty, truncated, wrong magic/version, corrupt
fields) becomes `valid=False` and a one-line `problem`. What it is not: a repair tool.
Mirrors the checks llm.c makes when it loads each file (dataloader.h, EvalLoader,
gpt2_build_from_checkpoint, tokenizer_init, load_state), plus content checks llm.c only asserts
at run time (token ids < vocab size, finite parameters).
"""
import os
import re

import numpy as np

from llmctl import formats as F
from llmctl.constants import GPT2_EOT, GPT2_VOCAB_SIZE, LLAMA3_EOT, LLAMA3_VOCAB_SIZE
from llmctl.errors import DataError, LlmctlError
from llmctl.paths import DATA_DIR

VOCAB_SIZES = {"shard": GPT2_VOCAB_SIZE, "shard-llama3": LLAMA3_VOCAB_SIZE}
EOT_IDS = {"shard": GPT2_EOT, "shard-llama3": LLAMA3_EOT}


def _n(x):
    return f"{x:,}"


class _Invalid(Exception):
    """A content problem found by inspect itself (the format is readable but unusable)."""

    def __init__(self, problem, hint=None):
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


def _problem_of(err, path):
    """The bare problem of an LlmctlError (its message without the leading '<path>: ')."""
    prob = getattr(err, "problem", None)
    if prob:
        return prob
    msg = err.message
    prefix = f"{path}: "
    return msg[len(prefix):] if msg.startswith(prefix) else msg


def _default_threads(n_threads):
    if n_threads:
        return max(1, int(n_threads))
    from llmctl.info import default_threads

    return default_threads()


def _get_decoder(tokenizer):
    """A callable ids -> text: a tokenizer object, a tokenizer .bin path, or llmctl's GPT-2 one."""
    if tokenizer is None:
        from llmctl.tokenizer import get_tokenizer  # lazy: building it costs ~0.3 s

        tokenizer = get_tokenizer()
    if isinstance(tokenizer, (str, os.PathLike)):
        tf = F.read_tokenizer_file(tokenizer)

        def decode(ids):
            return b"".join(tf.tokens[i] if 0 <= i < tf.vocab_size else b"<?>" for i in ids).decode(
                "utf-8", errors="replace")

        return decode
    return tokenizer.decode


def _decode(res, id_lists, tokenizer):
    """Texts of several id lists, or None with res['decode_error'] set (decoding never fails a file)."""
    try:
        dec = _get_decoder(tokenizer)
        return [dec([int(i) for i in ids]) for ids in id_lists]
    except LlmctlError as e:
        res["decode_error"] = e.message
    except Exception as e:  # decoding is a convenience; a failure must not hide the report
        res["decode_error"] = f"{type(e).__name__}: {e}"
    return None


def _inspect_shard(path, res, decode, tokenizer, n_threads, vocab_size):
    from llmctl._ext.tokens import token_stats

    hdr = F.read_shard_header(path)
    toks = F.open_shard(path)
    V = vocab_size or VOCAB_SIZES[res["kind"]]
    eot = EOT_IDS[res["kind"]]
    st = token_stats(toks, eot, V, n_threads)
    res.update(version=hdr.version, dtype=np.dtype(hdr.dtype).name, num_tokens=hdr.num_tokens,
               min_id=st["min"], max_id=st["max"], eot_id=eot, eot_count=st["eot_count"],
               vocab_size=V, out_of_vocab=st["out_of_vocab"], checksum=st["checksum"],
               starts_with_eot=bool(toks[0] == eot))
    if decode:
        if res["kind"] == "shard-llama3" and tokenizer is None:
            res["decode_error"] = "llama-3 tokens cannot be decoded with the GPT-2 tokenizer"
        else:
            texts = _decode(res, [toks[:decode]], tokenizer)
            if texts:
                res["decoded"] = texts[0]
    if st["out_of_vocab"]:
        raise _Invalid(f"{_n(st['out_of_vocab'])} of {_n(hdr.num_tokens)} token ids are >= the vocab size "
                       f"{_n(V)} (max id {_n(st['max'])})",
                       "llm.c asserts every input/target id is < V; re-create the shard with the right tokenizer")


def _inspect_eval(path, res, decode, tokenizer, vocab_size):
    hdr = F.read_eval_header(path)
    res.update(version=F.EVAL_VERSION, num_examples=hdr.num_examples,
               longest_example_bytes=hdr.longest_example_bytes)
    examples = F.read_evalfile(path)
    labels = [0] * F.EVAL_NUM_COMPLETIONS
    max_ctx = max_comp = max_row = max_id = 0
    for ex in examples:
        labels[ex.label] += 1
        n_ctx = len(ex.context)
        max_ctx = max(max_ctx, n_ctx)
        max_id = max(max_id, int(ex.context.max()))
        for e in ex.endings:
            max_comp = max(max_comp, len(e))
            max_row = max(max_row, n_ctx + len(e))
            max_id = max(max_id, int(e.max()))
    # llm.c's EvalLoader asserts n_ctx + n_completion < T and longest_bytes < 10*T
    min_T = max(max_row + 1, hdr.longest_example_bytes // 10 + 1)
    res.update(label_counts=labels, max_context_tokens=max_ctx, max_completion_tokens=max_comp,
               max_row_tokens=max_row, min_seq_len=min_T, max_id=max_id)
    if decode and examples:
        ex = examples[0]
        texts = _decode(res, [ex.context[:decode]] + [e[:decode] for e in ex.endings], tokenizer)
        if texts:
            res["decoded"], res["decoded_endings"] = texts[0], texts[1:]
    V = vocab_size or GPT2_VOCAB_SIZE
    if max_id >= V:
        raise _Invalid(f"token id {_n(max_id)} is >= the vocab size {_n(V)}")


def _nonfinite_count(data, bf16):
    bad = 0
    step = 1 << 22
    for i in range(0, data.size, step):
        chunk = np.asarray(data[i:i + step])
        if bf16:
            bad += int(np.count_nonzero((chunk & 0x7F80) == 0x7F80))
        else:
            bad += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
    return bad


def _inspect_checkpoint(path, res):
    hdr, data = F.read_checkpoint(path)
    C, V, Vp = hdr.channels, hdr.vocab_size, hdr.padded_vocab_size
    res.update(version=hdr.version, dtype=hdr.dtype, maxT=hdr.max_seq_len, V=V, L=hdr.num_layers,
               NH=hdr.num_heads, C=C, Vp=Vp, hs=C // hdr.num_heads, num_params=hdr.num_params)
    pad = np.asarray(data[V * C:Vp * C])
    res["padded_rows_zero"] = bool(not pad.size or not np.any(pad.view(np.uint32 if hdr.version == 3 else np.uint16)
                                                            & (0x7FFFFFFF if hdr.version == 3 else 0x7FFF)))
    bad = _nonfinite_count(data, hdr.version == 5)
    res["nonfinite"] = bad
    if bad:
        raise _Invalid(f"{_n(bad)} of {_n(hdr.num_params)} parameters are NaN or Inf")
    if not res["padded_rows_zero"]:
        raise _Invalid(f"wte padding rows {_n(V)}..{_n(Vp - 1)} are not zero (llm.c requires zero padded rows)")


def _inspect_tokenizer(path, res, decode):
    tf = F.read_tokenizer_file(path)
    res.update(version=tf.version, vocab_size=tf.vocab_size, eot=tf.eot,
               eot_token=tf.tokens[tf.eot].decode("utf-8", errors="replace"),
               max_token_bytes=max(len(t) for t in tf.tokens))
    if decode:
        res["decoded"] = b"".join(tf.tokens[:decode]).decode("utf-8", errors="replace")


def _sibling_model(path):
    """(num_params, model path) of the model_<step>.bin next to a state_<step>_<rank>.bin, if valid."""
    m = re.match(r"state_(\d{8})_\d{5}\.bin$", os.path.basename(path))
    if not m:
        return None, None
    model = os.path.join(os.path.dirname(path), f"model_{m.group(1)}.bin")
    try:
        return F.read_checkpoint_header(model).num_params, model
    except LlmctlError:
        return None, None


def _inspect_state(path, res, num_parameters):
    P, model = _sibling_model(path) if num_parameters is None else (None, None)
    try:
        s = F.read_state_file(path, num_parameters)
    except LlmctlError:
        if P is None or F.read_state_header(path)[0] != 1:
            raise
        # a shuffled state the search from the end could not place: the layout of the model's P
        # parameters holds, or says where it breaks (a ZeRO-1 rank's shard: P unknown here)
        s = F.read_state_file(path, P)
    if num_parameters is None:
        # the file size alone defines the count; cross-check it against the checkpoint of the same step
        if P is not None:
            res["model_file"] = model
            ok = {P} | ({P // s.num_processes} if P % s.num_processes == 0 else set())  # ZeRO-1 shards
            if s.num_parameters not in ok:
                raise _Invalid(f"holds optimizer state for {_n(s.num_parameters)} parameters but "
                               f"{os.path.basename(model)} has {_n(P)}: truncated or from another model?")
    res.update(version=F.STATE_VERSION, num_processes=s.num_processes, process_rank=s.process_rank,
               use_master_weights=s.use_master_weights, should_shuffle=s.should_shuffle, step=s.step,
               rng_state=s.rng_state, rng_state_last_update=s.rng_state_last_update,
               current_shard_idx=s.current_shard_idx, current_sample_idx=s.current_sample_idx,
               num_parameters=s.num_parameters,
               num_shards=None if s.shard_indices is None else int(s.shard_indices.size),
               shard_num_samples=None if s.intra_shard_indices is None else int(s.intra_shard_indices.size))
    if s.should_shuffle and s.current_shard_idx >= s.shard_indices.size:
        raise _Invalid(f"current_shard_idx {_n(s.current_shard_idx)} is past the {_n(s.shard_indices.size)} shards")


def _inspect_debug_state(path, res):
    h = F.read_debug_state_header(path)
    res.update(version=h.version, B=h.B, T=h.T, num_params=h.num_params)


def inspect_file(path, decode=0, tokenizer=None, n_threads=None, vocab_size=None, num_parameters=None):
    """Identify and fully validate one file. Never raises for a bad file.

    Returns a dict with path, kind (None if unidentified), valid, problem (None when valid),
    hint, size_bytes and the fields of that kind (see docs/formats.md). decode > 0 adds
    `decoded`: the first `decode` tokens as text (shards; the first example of an eval file).
    tokenizer: an object with .decode(ids), a tokenizer .bin path, or None for GPT-2.
    """
    path = os.fspath(path)
    res = {"path": path, "kind": None, "valid": False, "problem": None, "hint": None, "size_bytes": None}
    try:
        res["size_bytes"] = os.path.getsize(path) if os.path.isfile(path) else None
        if res["size_bytes"] is not None and _run_file(path, res):
            return res
        kind = F.identify(path)
        res["kind"] = kind
        if kind in ("shard", "shard-llama3"):
            _inspect_shard(path, res, decode, tokenizer, _default_threads(n_threads), vocab_size)
        elif kind == "eval":
            _inspect_eval(path, res, decode, tokenizer, vocab_size)
        elif kind == "checkpoint":
            _inspect_checkpoint(path, res)
        elif kind == "tokenizer":
            _inspect_tokenizer(path, res, decode)
        elif kind == "state":
            _inspect_state(path, res, num_parameters)
        else:
            _inspect_debug_state(path, res)
        res["valid"] = True
    except LlmctlError as e:
        res["problem"], res["hint"] = _problem_of(e, path), e.hint
    except _Invalid as e:
        res["problem"], res["hint"] = e.problem, e.hint
    except (OSError, ValueError, MemoryError) as e:  # e.g. the file vanished or changed mid-read
        res["problem"] = f"cannot read file: {type(e).__name__}: {e}"
    return res


_RUN_TEXT = {"main.log": "the training log (llm.c's main.log lines)", "metrics.jsonl": "the training metrics (JSON lines)"}


def _run_file(path, res):
    """The files besides llm.c binaries that `llmctl train -o` (and llm.c) write into a run
    directory, so `inspect-bin runs/d6/*` checks a whole run: the empty DONE_%08d marker (valid
    when empty and its model_%08d.bin is beside it) and the text logs (named, not parsed).
    -> True when `path` is one of them (res filled in), else False."""
    d, name = os.path.split(path)
    m = re.fullmatch(r"DONE_(\d{8})", name)
    if m:
        step = int(m.group(1))
        res.update(kind="done", step=step)
        model = os.path.join(d, f"model_{step:08d}.bin")
        if res["size_bytes"]:
            res["problem"] = f"a DONE marker is empty, this one is {_n(res['size_bytes'])} bytes"
            res["hint"] = "DONE_%08d is the empty file llm.c writes after a complete checkpoint; is it something else?"
        elif not os.path.isfile(model):
            res["problem"] = f"marks step {step}'s checkpoint complete, but {model} is missing"
            res["hint"] = (f"delete {path} so a resume (-y 1) starts from an earlier checkpoint")
        else:
            res["valid"] = True
        return True
    what = _RUN_TEXT.get(name) or ("the -sl/-sg outlier detectors' state"
                                   if re.fullmatch(r"state_\d{8}_\d{5}\.outlier\.json", name) else None)
    if what is None:
        return False
    res.update(kind="text", valid=True, describes=what)
    return True


def inspect_files(paths, decode=0, tokenizer=None, n_threads=None, vocab_size=None, num_parameters=None):
    """inspect_file over several paths, in order."""
    return [inspect_file(p, decode=decode, tokenizer=tokenizer, n_threads=n_threads, vocab_size=vocab_size,
                         num_parameters=num_parameters) for p in paths]


def data_dir_files(data_dir=DATA_DIR):
    """Every .bin file under `data_dir` (recursively, sorted): what `llmctl inspect-bin` checks
    when given no files. DataError if there is none."""
    data_dir = os.fspath(data_dir)
    hint = "write some with `llmctl prepro tinyshakespeare`, or name the files: llmctl inspect-bin FILES"
    if not os.path.isdir(data_dir):
        raise DataError(f"no files given and there is no {data_dir}/ directory here", hint=hint)
    found = sorted(os.path.join(root, n) for root, _, names in os.walk(data_dir)
                   for n in names if n.endswith(".bin"))
    if not found:
        raise DataError(f"no files given and no .bin file under {data_dir}/", hint=hint)
    return found


def summary_line(res):
    """One human line of details for a valid file (the CLI's table cell)."""
    k = res["kind"]
    if k in ("shard", "shard-llama3"):
        return (f"{res['dtype']} v{res['version']}, {_n(res['num_tokens'])} tokens, ids {_n(res['min_id'])}.."
                f"{_n(res['max_id'])}, {_n(res['eot_count'])} EOT ({res['eot_id']}), "
                f"{_n(res['out_of_vocab'])} ids >= {_n(res['vocab_size'])}, checksum {res['checksum']:016x}")
    if k == "eval":
        return (f"v{res['version']}, {_n(res['num_examples'])} examples, longest {_n(res['longest_example_bytes'])} "
                f"bytes, labels {res['label_counts']}, longest row {_n(res['max_row_tokens'])} tokens "
                f"(needs T >= {_n(res['min_seq_len'])})")
    if k == "checkpoint":
        return (f"v{res['version']} {res['dtype']}, L={res['L']} C={res['C']} NH={res['NH']} V={_n(res['V'])} "
                f"Vp={_n(res['Vp'])} maxT={_n(res['maxT'])}, {_n(res['num_params'])} params")
    if k == "tokenizer":
        return (f"v{res['version']}, {_n(res['vocab_size'])} tokens, EOT {res['eot']} = {res['eot_token']!r}, "
                f"longest token {res['max_token_bytes']} bytes")
    if k == "state":
        s = (f"step {_n(res['step'])}, rank {res['process_rank']}/{res['num_processes']}, "
             f"{_n(res['num_parameters'])} params, master weights {'yes' if res['use_master_weights'] else 'no'}, "
             f"shard {res['current_shard_idx']} sample {_n(res['current_sample_idx'])}")
        if res["should_shuffle"]:
            s += f", shuffled ({res['num_shards']} shards, {_n(res['shard_num_samples'])} samples)"
        return s
    if k == "done":
        return f"step {_n(res['step'])}'s checkpoint is complete"
    if k == "text":
        return f"{res['describes']} (text, not an llm.c binary: not checked)"
    if k == "debug-state":
        p = "?" if res["num_params"] is None else _n(res["num_params"])
        return f"v{res['version']}, B={res['B']} T={res['T']}, {p} params (assuming V=50,257)"
    return ""
