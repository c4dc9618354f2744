"""`llmctl eval hellaswag --nproc N`: HellaSwag scored by N local ranks.

What it is: `eval_hellaswag_multiproc` checks the eval file, starts the ranks with llmctl's
launcher and returns rank 0's summed result; `hellaswag_entry` is each rank's target: it loads
the model with the rank's thread count and scores its slice (llmctl/evaluate.py's
eval_hellaswag with the comm).
What it is not: the scoring (llmctl/evaluate.py) or the launcher (launcher.py).
"""
from llmctl.info import DEFAULT_PRECISION


def hellaswag_entry(args, comm):
    """One rank of `llmctl eval hellaswag --nproc N` (run by llmctl.jobs.launcher): loads the
    model with the rank's thread count, scores its slice, returns the summed result (rank 0's
    return value is what the launcher hands back)."""
    from llmctl.evaluate import eval_hellaswag
    from llmctl.model import load

    model = load(args["checkpoint"], n_threads=comm.n_threads, precision=args.get("precision", DEFAULT_PRECISION))
    return eval_hellaswag(model, args["path"], limit=args.get("limit"), norm=args.get("norm", "tokens"),
                          per_example=False, batch_tokens=args.get("batch_tokens", 2048), comm=comm)


def eval_hellaswag_multiproc(checkpoint, path, nproc, threads=None, limit=None, norm="tokens",
                             batch_tokens=2048, timeout=30.0, precision=DEFAULT_PRECISION):
    """eval_hellaswag split over `nproc` local processes (llmctl.jobs.launcher); -> the result dict."""
    from llmctl.evaluate import check_eval_file
    from llmctl.jobs.launcher import launch

    check_eval_file(path)  # fail before spawning anything
    out = launch("llmctl.jobs.eval:hellaswag_entry",
                 {"checkpoint": str(checkpoint), "path": str(path), "limit": limit, "norm": norm,
                  "batch_tokens": batch_tokens, "precision": precision}, nproc, threads=threads, timeout=timeout)
    res = out["result"]
    res["nproc"], res["threads_per_process"] = out["nproc"], out["threads"]
    return res
