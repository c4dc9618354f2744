"""Evaluate a GPT-2 model: multiple-choice accuracy (HellaSwag, scored as llm.c does) and mean loss.

What it is:
- `score_examples` / `eval_hellaswag`: every example of an llm.c eval file (`data_common.py` `write_evalfile`) becomes 4 rows
  context + completion; a completion's loss is the per-token cross-entropy at the positions that
  predict its tokens (n_ctx-1 .. n_ctx+n_c-2), exactly the mask of llm.c's EvalLoader (`llmc/dataloader.h`).
  acc_norm = argmin of the MEAN loss per row (llm.c's figure; ties go to the lowest index, as its
  strict '<'), acc = argmin of the SUMMED loss (hellaswag.py's `acc`); `norm="chars"` divides by
  the completion's decoded character length instead (lm-evaluation-harness's acc_norm).
- `eval_loss`: mean per-token loss and perplexity over token shards, in llm.c's val-loader order
  (non-overlapping B*T windows, each with its next-token targets).
What it is not: llm.c's padding of every row to T. Examples are sorted by length and packed into
batches padded only to their longest context, their completion rows run in groups of similar
length (_length_groups), each padded to its own longest row; the context runs ONCE per example
and its cached keys/values serve all four completions (exact: attention is causal, so no context
position sees a completion), read where the context wrote them; all rows of a batch share each
layer's matmuls. Logits are computed only where a loss is needed. Results do not depend on
batching beyond float32 rounding.
Mirrors: llm.c `llmc/dataloader.h` EvalLoader (next_batch/stat_losses), `dev/data/hellaswag.py`
(evaluate: sum vs mean), `train_gpt2.cu` val loss loop.
"""
import glob as _glob
import os
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from llmctl.errors import ConfigError, DataError, FormatError

NUM_COMPLETIONS = 4


@dataclass
class ExampleScore:
    """One example's outcome. losses_sum / num_tokens per completion; pred = argmin sum,
    pred_norm = argmin of the normalised loss (mean per token, or per character)."""
    index: int
    label: int
    losses_sum: List[float]
    num_tokens: List[int]
    pred: int
    pred_norm: int
    num_chars: Optional[List[int]] = field(default=None)

    def to_dict(self):
        d = {"index": self.index, "label": self.label, "pred": self.pred, "pred_norm": self.pred_norm,
             "losses_sum": self.losses_sum, "num_tokens": self.num_tokens}
        if self.num_chars is not None:
            d["num_chars"] = self.num_chars
        return d


def _argmin_first(vals):
    # llm.c stat_losses: strict '<' scan, so ties go to the lowest index
    best = 0
    for i in range(1, len(vals)):
        if vals[i] < vals[best]:
            best = i
    return best


def check_examples(examples, config, path="<examples>"):
    """Refuse examples this model cannot score, naming the file and example index."""
    maxT, V = config.max_seq_len, config.vocab_size
    for ex in examples:
        n_ctx = len(ex.context)
        if len(ex.endings) != NUM_COMPLETIONS:
            raise FormatError(f"{path}: example {ex.index} has {len(ex.endings)} completions, expected 4")
        if not 0 <= int(ex.label) < NUM_COMPLETIONS:
            raise FormatError(f"{path}: example {ex.index} has label {ex.label}, expected 0..3")
        if n_ctx == 0 or any(len(e) == 0 for e in ex.endings):
            raise FormatError(f"{path}: example {ex.index} has an empty context or completion")
        longest = n_ctx + max(len(e) for e in ex.endings)
        if longest > maxT:
            raise ConfigError(f"{path}: example {ex.index} needs {longest} positions (context {n_ctx} + "
                              f"completion) but the model's maxT is {maxT}",
                              hint=f"this file needs a model with maxT >= {longest}")
        for toks in [ex.context] + list(ex.endings):
            if int(np.max(toks)) >= V:
                raise FormatError(f"{path}: example {ex.index} has token id {int(np.max(toks))} >= vocab size {V}")


class _Scratch:
    """float32 buffers a scoring pass keeps across its batches, each grown to the largest size
    asked for. A batch's KV caches and logits are tens of MB: as fresh arrays they were fresh
    mappings whose pages fault in (zeroed) on first write, every batch."""

    def __init__(self):
        self._bufs = {}

    def take(self, name, shape, dtype=np.float32):
        n = int(np.prod(shape))
        b = self._bufs.get(name)
        if b is None or b.size < n or b.dtype != dtype:
            grown = 0 if b is None or b.dtype != dtype else b.size * 3 // 2
            b = self._bufs[name] = np.empty(max(n, grown), dtype)
        return b[:n].reshape(shape)


def _token_losses(model, h, targets, chunk=256, scratch=None):
    """Cross-entropy of final-normed hidden rows h (M,C) against targets (M,) or (M,k) (k targets
    scored from the same row's distribution) -> float64, the same shape as targets. The logits are
    those of the training forward (bf16 in bf16, as `eval loss` and llm.c's bf16 model score); the
    fused softmax + cross-entropy kernel scores the first target of each row (log(sum) -
    (x_t - max), summed in double, as in training) without writing probabilities back; every
    target of the row is then its log-sum-exp minus its logit, so equal targets score equal
    losses."""
    targets = np.asarray(targets, dtype=np.int64)
    out = np.empty(targets.shape, dtype=np.float64)
    V = model.config.vocab_size
    dt = model.ops.logits_dtype
    for s in range(0, h.shape[0], chunk):
        m = min(chunk, h.shape[0] - s)
        lg = model.logits_from_hidden(h[s:s + m], None if scratch is None else scratch.take("logits", (m, V), dt),
                                      as_trained=True)
        tg = targets[s:s + chunk].reshape(m, -1)
        x_t = np.take_along_axis(lg, tg, axis=1)
        if dt == np.uint16:   # bf16 bits: the top half of a float32's
            x_t = (x_t.astype(np.uint32) << 16).view(np.float32)
        x_t = x_t.astype(np.float64)
        loss0 = np.empty(m, dtype=np.float32)
        model.kernels.layers.softmax_crossentropy_forward_backward_bf16(loss0, None, lg.reshape(-1),
                                                                        tg[:, 0].astype(np.int32), None,
                                                                        m, V, V, model.n_threads)
        lse = loss0.astype(np.float64) + x_t[:, 0]
        out[s:s + chunk] = (lse[:, None] - x_t).reshape(out[s:s + chunk].shape)
    return out


# an extra group of completion rows costs about this many padded positions (its attention calls
# per layer; its rows share the batch's matmuls): _length_groups cuts a batch's rows where the
# padding saved is worth more. 0, 1, 2 and 4 ran 1-4 % slower on a Zen 4, fp32 and bf16
GROUP_COST = 16


def _length_groups(lengths, cost=GROUP_COST):
    """Split rows of the given lengths into groups that are each padded to their longest row,
    for the fewest padded positions plus `cost` per group (exact, over the rows sorted by length).
    -> list of index arrays into lengths, each ascending in length."""
    order = np.argsort(lengths, kind="stable")
    ls = [int(x) for x in np.asarray(lengths)[order]]
    n = len(ls)
    best, cut = [0] + [None] * n, [0] * (n + 1)
    for j in range(1, n + 1):   # the last group is sorted rows i..j-1, padded to ls[j-1]
        for i in range(j):
            c = best[i] + (j - i) * ls[j - 1] + cost
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _completion_rows(comps):
    """The completion rows a batch runs: (example, completion) of every completion longer than one
    token, and the tokens each feeds (all but its last, which is only ever a target)."""
    rows = [(e, c) for e, cs in enumerate(comps) for c in range(NUM_COMPLETIONS) if len(cs[c]) > 1]
    return rows, np.array([len(comps[e][c]) - 1 for e, c in rows], dtype=np.int64)


def positions_run(examples, batch_tokens=2048):
    """Positions the model runs to score these examples, padding included: each batch's contexts
    padded to its longest, each group of completion rows to its longest (bench/eval.py)."""
    n = 0
    for idxs in _batches(examples, batch_tokens):
        batch = [examples[i] for i in idxs]
        n += len(batch) * max(len(ex.context) for ex in batch)
        _, fed = _completion_rows([ex.endings for ex in batch])
        n += sum(len(g) * int(fed[g].max()) for g in _length_groups(fed))
    return n


def _score_batch(model, batch, scratch=None):
    """-> (losses_sum (E,4), num_tokens (E,4)) for a list of EvalExample; scratch: a _Scratch
    kept across batches."""
    from llmctl.model.gpt2 import KVPart

    scratch = _Scratch() if scratch is None else scratch
    cfg = model.config
    C, NH = cfg.channels, cfg.num_heads
    E = len(batch)
    n_ctx = np.array([len(ex.context) for ex in batch], dtype=np.int32)
    comps = [[np.asarray(e, dtype=np.int64) for e in ex.endings] for ex in batch]
    Tx = int(n_ctx.max())

    ctx_tok = np.zeros((E, Tx), dtype=np.int64)
    for e, ex in enumerate(batch):
        ctx_tok[e, :n_ctx[e]] = ex.context
    zero_pos = np.zeros(E, dtype=np.int32)
    k = scratch.take("k", (E, NH, Tx, C // NH))
    v = scratch.take("v", k.shape)
    xs, parts = [model.embed(ctx_tok, zero_pos)], [KVPart(k, v, zero_pos, E * Tx)]
    # completion rows feed all but their last token (which is only ever a target); their lengths
    # differ a lot (HellaSwag endings run from 1 to 40+ tokens), so they run in groups of similar
    # length, each padded only to its own longest row (one padded group did twice the work). Each
    # group reads its context's K/V where the context's part wrote them (a prefix, no copy), and
    # every row of the batch goes through one matmul per weight: fp32 GEMMs of a few hundred rows
    # ran 1.1-1.5x slower than one of the whole batch
    rows, fed = _completion_rows(comps)
    groups = []
    for i, g in enumerate(_length_groups(fed)):
        ex_idx = np.array([rows[r][0] for r in g], dtype=np.int32)
        Tq = int(fed[g].max())
        tok = np.zeros((len(g), Tq), dtype=np.int64)
        for j, r in enumerate(g):
            e, c = rows[r]
            tok[j, :fed[r]] = comps[e][c][:-1]
        pos = n_ctx[ex_idx]
        kg = scratch.take(f"kg{i}", (len(g), NH, Tq, C // NH))
        vg = scratch.take(f"vg{i}", kg.shape)
        xs.append(model.embed(tok, pos))
        parts.append(KVPart(kg, vg, pos, len(g) * Tq, prefix=(k, v, ex_idx, pos, Tx)))
        groups.append((g, Tq))
    x = np.concatenate(xs)
    for l in range(cfg.num_layers):   # the residual stream is updated in place
        model.block_forward_parts(l, x, parts, out=x)
    x_ctx, x_rows = x[:E * Tx], x[E * Tx:]

    # rows of hidden states that predict a completion token, and those tokens
    h_last = model.final_norm(x_ctx.reshape(E, Tx, C)[np.arange(E), n_ctx - 1])  # predicts comp[0]
    first_t = np.array([[comps[e][c][0] for c in range(NUM_COMPLETIONS)] for e in range(E)])
    losses = np.zeros((E, NUM_COMPLETIONS), dtype=np.float64)
    counts = np.array([[len(c) for c in cs] for cs in comps], dtype=np.int64)
    # the first completion token of each row: one distribution per example serves all four
    losses += _token_losses(model, h_last, first_t, scratch=scratch)
    if rows:
        hs, r_idx, tgt, r0 = [], [], [], 0
        for g, Tq in groups:
            sel_r = np.repeat(np.arange(len(g)), fed[g])
            sel_t = np.concatenate([np.arange(fed[r]) for r in g])
            hs.append(x_rows[r0:r0 + len(g) * Tq].reshape(len(g), Tq, C)[sel_r, sel_t])
            r0 += len(g) * Tq
            for r in g:
                e, c = rows[r]
                r_idx.extend([e * NUM_COMPLETIONS + c] * int(fed[r]))
                tgt.extend(comps[e][c][1:].tolist())
        h = model.final_norm(np.concatenate(hs))
        tl = _token_losses(model, h, np.array(tgt, dtype=np.int64), scratch=scratch)
        np.add.at(losses.reshape(-1), np.array(r_idx), tl)
    return losses, counts


def _batches(examples, batch_tokens):
    """Group examples (sorted by length) into batches whose padded positions stay <= batch_tokens."""
    order = sorted(range(len(examples)),
                   key=lambda i: (len(examples[i].context), max(len(e) for e in examples[i].endings)))
    batch, tx, tc = [], 0, 0
    for i in order:
        ex = examples[i]
        ntx = max(tx, len(ex.context))
        ntc = max(tc, max(len(e) for e in ex.endings) - 1)
        if batch and (len(batch) + 1) * (ntx + NUM_COMPLETIONS * ntc) > batch_tokens:
            yield batch
            batch, ntx, ntc = [], len(ex.context), max(len(e) for e in ex.endings) - 1
        batch.append(i)
        tx, tc = ntx, ntc
    if batch:
        yield batch


def score_examples(model, examples, norm="tokens", tokenizer=None, batch_tokens=2048, on_progress=None,
                   path="<examples>"):
    """Score multiple-choice examples (EvalExample-like: index, label, context, endings).
    -> list of ExampleScore in the input order. on_progress(n_done) after each batch."""
    if norm not in ("tokens", "chars"):
        raise ConfigError(f"--norm must be 'tokens' or 'chars', got {norm!r}")
    examples = list(examples)
    check_examples(examples, model.config, path)
    if norm == "chars":
        if tokenizer is None:
            from llmctl.tokenizer import get_tokenizer
            tokenizer = get_tokenizer()
    try:
        return _score_all(model, examples, norm, tokenizer, batch_tokens, on_progress)
    finally:
        model.free_cached_buffers()   # a batch's buffers are not kept past the pass (training)


def _score_all(model, examples, norm, tokenizer, batch_tokens, on_progress):
    scores = [None] * len(examples)
    done = 0
    scratch = _Scratch()
    for idxs in _batches(examples, batch_tokens):
        losses, counts = _score_batch(model, [examples[i] for i in idxs], scratch)
        for j, i in enumerate(idxs):
            ex = examples[i]
            s = losses[j].tolist()
            n = counts[j].tolist()
            mean = [s[c] / n[c] for c in range(NUM_COMPLETIONS)]
            nchars = None
            if norm == "chars":
                nchars = [len(tokenizer.decode([int(t) for t in e])) for e in ex.endings]
                normed = [s[c] / max(nchars[c], 1) for c in range(NUM_COMPLETIONS)]
            else:
                normed = mean
            scores[i] = ExampleScore(index=int(ex.index), label=int(ex.label), losses_sum=s,
                                     num_tokens=n, pred=_argmin_first(s),
                                     pred_norm=_argmin_first(normed), num_chars=nchars)
        done += len(idxs)
        if on_progress is not None:
            on_progress(done)
    return scores


def summarize(scores, norm="tokens", per_example=False):
    """The result object `llmctl eval hellaswag --json` prints."""
    n = len(scores)
    correct = sum(s.pred == s.label for s in scores)
    correct_norm = sum(s.pred_norm == s.label for s in scores)
    out = {"num_examples": n, "correct": correct, "correct_norm": correct_norm,
           "acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0, "norm": norm}
    if per_example:
        out["examples"] = [s.to_dict() for s in scores]
    return out


def check_eval_file(path):
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not an eval file",
                        hint="pass the .bin inside it, e.g. -i DIR/hellaswag_val.bin")
    if not os.path.isfile(path):
        raise DataError(f"{path}: eval file not found", hint="create it with `llmctl prepro hellaswag`")


def hellaswag_file(path=None, log=None):
    """The eval file `llmctl eval hellaswag` scores: `path` if given, else data/hellaswag_val.bin,
    written first by `llmctl prepro hellaswag` (from data/hellaswag_val.jsonl, `datasets` or the
    download) when it is missing. log(msg) hears about that."""
    from llmctl.paths import HELLASWAG_VAL

    if path is not None:
        return path
    if not os.path.isfile(HELLASWAG_VAL):
        from llmctl.prepro import prepro_hellaswag

        if log:
            log(f"{HELLASWAG_VAL} is missing: writing it first (llmctl prepro hellaswag)")
        jsonl = os.path.join(os.path.dirname(HELLASWAG_VAL), "hellaswag_val.jsonl")
        try:
            prepro_hellaswag(out_dir=os.path.dirname(HELLASWAG_VAL), log=log)
        except DataError as e:  # its hint names prepro's --source, which eval does not have
            raise DataError(e.message, hint=f"download hellaswag_val.jsonl and run `llmctl prepro hellaswag "
                                            f"--source PATH` (or put it at {jsonl}), or pass -i EVAL_FILE") from None
    return HELLASWAG_VAL


def eval_hellaswag(model, path, limit=None, norm="tokens", per_example=False, batch_tokens=2048,
                   on_progress=None, on_start=None, comm=None):
    """Score an llm.c eval file (e.g. hellaswag_val.bin). model: a GPT2. limit: only the first N
    examples. on_start(num_local_examples) before scoring.

    With a `comm` (llmctl.distributed Comm) of P ranks, rank r scores examples [r*ceil(N/P), ...) as llm.c's
    EvalLoader splits them and the counts are summed over ranks; per-example results are the
    local ones. Called from training, log `s:%d eval:%.4f` with the returned acc_norm."""
    from llmctl.formats import read_evalfile

    check_eval_file(path)
    examples = read_evalfile(path)
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        examples = examples[:limit]
    n_total = len(examples)
    if comm is not None and comm.world_size > 1:
        per = -(-n_total // comm.world_size)
        examples = examples[comm.rank * per:(comm.rank + 1) * per]
    if on_start is not None:
        on_start(len(examples))
    scores = score_examples(model, examples, norm=norm, batch_tokens=batch_tokens, on_progress=on_progress, path=str(path))
    res = summarize(scores, norm=norm, per_example=per_example)
    if comm is not None and comm.world_size > 1:
        res["correct"] = int(round(comm.all_reduce_sum_scalar(float(res["correct"]))))
        res["correct_norm"] = int(round(comm.all_reduce_sum_scalar(float(res["correct_norm"]))))
        res["num_examples"] = n_total
        res["acc"] = res["correct"] / n_total
        res["acc_norm"] = res["correct_norm"] / n_total
    res["file"] = str(path)
    res["precision"] = model.precision
    return res


# ----------------------------------------------------------------------------------------------
# eval loss

def eval_loss(model, pattern, B=4, T=None, max_batches=-1, on_progress=None, on_start=None):
    """Mean next-token loss over token shards matching `pattern` (sorted), read by llm.c's
    unshuffled loader (llmctl.loader.DataLoader, shuffle=False): each shard gives (N-1) // (B*T)
    windows of B*T inputs + shifted targets; shards with fewer than B*T+1 tokens are skipped.
    max_batches >= 1 stops early (llm.c's -m; -1 = all). The forward keeps no activations (one layer of buffers,
    not L). -> dict(loss, perplexity, num_batches, num_tokens, files)."""
    from llmctl.formats import open_shard
    from llmctl.loader import DataLoader

    cfg = model.config
    T = int(min(1024, cfg.max_seq_len) if T is None else T)  # -t 0 is an error, not "the default"
    if not 1 <= T <= cfg.max_seq_len:
        raise ConfigError(f"-t {T} must be in 1..maxT = {cfg.max_seq_len}",
                          hint=f"pass -t between 1 and {cfg.max_seq_len}, or leave it out for {min(1024, cfg.max_seq_len)}")
    if B < 1:
        raise ConfigError(f"-b {B} must be >= 1", hint="pass -b 1 or more (llm.c's default is 4)")
    if max_batches is None or max_batches == 0 or max_batches < -1:  # as train's -m (train_config.py)
        raise ConfigError(f"-m {max_batches} must be -1 (every full batch) or >= 1",
                          hint="pass -m N with N >= 1, or -m -1 (the default) for every full batch")
    files = sorted(_glob.glob(pattern))
    if not files:
        raise DataError(f"no files match {pattern!r}", hint="check the -j pattern (quote it in the shell)")
    files_used = [f for f in files if open_shard(f).shape[0] >= B * T + 1]  # others give no batch
    if not files_used:
        raise DataError(f"{pattern}: no shard holds B*T+1 = {B * T + 1} tokens",
                        hint="lower -b or -t")
    loader = DataLoader(files_used, B, T, shuffle=False)  # llm.c's val loader: shards in order
    num_batches = loader.batches_per_epoch()
    if max_batches > 0:
        num_batches = min(num_batches, max_batches)
    if on_start is not None:
        on_start(num_batches)
    total = 0.0
    for i in range(num_batches):
        x, y = loader.next_batch()
        top = max(int(x.max()), int(y.max()))
        if top >= cfg.vocab_size:
            raise FormatError(f"{loader.current_file}: token id {top} >= vocab size {cfg.vocab_size}",
                              hint="is this a llama-3 shard? llmctl models are GPT-2")
        total += float(model.forward(x, y, keep_activations=False))
        if on_progress is not None:
            on_progress(i + 1)
    loss = total / num_batches
    return {"loss": loss, "perplexity": float(np.exp(loss)), "num_batches": num_batches,
            "num_tokens": num_batches * B * T, "B": B, "T": T, "files": files, "precision": model.precision}
