"""`llmctl prepro gpt2`: what llm.c's train_gpt2.py writes for llm.c's C/CUDA trainers, without PyTorch.

What it is: from pretrained GPT-2 (a hub name or a Hugging Face model directory, via llmctl.hf),
  gpt2_<size>.bin        v3 fp32 checkpoint  (train_gpt2.py write_model(..., "float32"))
  gpt2_<size>_bf16.bin   v5 bf16 checkpoint  (write_model(..., "bfloat16"): round to nearest even)
  gpt2_tokenizer.bin     v2 tokenizer file   (write_tokenizer)
and, with debug_state, gpt2_<size>_debug_state.bin (write_state: x, y of the first batch of the
input shard, logits, loss and all gradients, computed by llmctl's model) for llm.c's test_gpt2.c.
<size> is train_gpt2.py's name for the model: 124M, 355M, 774M, 1558M.
What it is not: a trainer; the checkpoints are byte for byte what write_model writes for the same
weights, nothing is fine-tuned.
"""
import os
import shutil

import numpy as np

from llmctl.errors import ConfigError, DataError
from llmctl.formats import read_checkpoint, read_checkpoint_header, write_checkpoint, write_debug_state
from llmctl.hf.convert import size_name

DEBUG_INPUT = "data/tiny_shakespeare_val.bin"  # train_gpt2.py --input_bin (where prepro writes it)
DEBUG_B, DEBUG_T = 4, 64                       # train_gpt2.py --batch_size, --sequence_length


def _copy_atomic(src, dst):
    from llmctl.atomic import atomic_open

    with open(src, "rb") as fi, atomic_open(dst) as fo:
        shutil.copyfileobj(fi, fo, 1 << 24)


def debug_state_batch(input_bin, B, T, maxT):
    """(x, y) int32 (B, T): the first B*T+1 tokens of a shard, as train_gpt2.py's
    DistributedDataLoader.next_batch on rank 0."""
    from llmctl.formats import open_shard

    if not 0 < T <= maxT or B <= 0:
        raise ConfigError(f"-b {B} -t {T}: need B > 0 and 0 < T <= the model's maxT {maxT}",
                          f"pass -t {min(64, maxT)} (train_gpt2.py writes B = 4, T = 64)")
    if not os.path.isfile(input_bin):
        raise DataError(f"{input_bin}: no such file (the debug state's input batch comes from it)",
                        "write it with `llmctl prepro tinyshakespeare`, or pass --input-bin")
    tokens = open_shard(input_bin)
    if tokens.size < B * T + 1:
        raise DataError(f"{input_bin}: {tokens.size:,} tokens, fewer than B*T+1 = {B * T + 1:,}")
    buf = np.asarray(tokens[:B * T + 1], dtype=np.int32)
    return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)


def write_gpt2_debug_state(checkpoint, path, x, y, threads=None):
    """write_state for the checkpoint's model on (x, y): logits (B,T,V), mean loss, gradients."""
    from llmctl.model import GPT2

    model = GPT2.from_checkpoint(checkpoint, n_threads=threads)
    V = model.config.vocab_size
    model.forward(x, keep_activations=False)
    logits = np.array(model.logits()[:, :, :V])
    loss = model.forward(x, y)
    model.zero_grad()
    model.backward()
    write_debug_state(path, x, y, logits, loss, model.grads)
    return loss


def prepro_gpt2(model="gpt2", out_dir=".", debug_state=False, input_bin=DEBUG_INPUT, batch_size=DEBUG_B,
                seq_len=DEBUG_T, local_files_only=None, progress=True, threads=None, convert_dir=None, log=None):
    """Write train_gpt2.py's files for a pretrained model into out_dir; returns a summary dict.
    model, local_files_only, progress, convert_dir: as llmctl.hf.pretrained_checkpoint."""
    from llmctl.hf import pretrained_checkpoint
    from llmctl.hf.hub import NotCached
    from llmctl.tokenizer import write_gpt2_tokenizer_bin

    try:
        ckpt = pretrained_checkpoint(model, local_files_only=local_files_only, progress=progress,
                                     convert_dir=convert_dir, log=log)
    except NotCached as e:  # its hint speaks of -e, which prepro gpt2 does not have
        e.hint = ("fetch it once with network, pass a local model directory (config.json + "
                  "model.safetensors) as --model DIR, or point HF_HOME at a Hugging Face cache that "
                  "holds it (--offline, or HF_HUB_OFFLINE=1, then tries nothing online)")
        raise
    hdr = read_checkpoint_header(ckpt)
    name = f"gpt2_{size_name(hdr)}"
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"{out_dir}: cannot create the output directory: {e.strerror or e}") from None
    x = y = None
    if debug_state:  # check the input before writing anything
        x, y = debug_state_batch(input_bin, batch_size, seq_len, hdr.max_seq_len)
    files = []
    fp32 = os.path.join(out_dir, f"{name}.bin")
    _copy_atomic(ckpt, fp32)
    files.append({"path": fp32, "kind": "checkpoint v3 (fp32)"})
    bf16 = os.path.join(out_dir, f"{name}_bf16.bin")
    write_checkpoint(bf16, hdr, read_checkpoint(ckpt)[1], "bfloat16")
    files.append({"path": bf16, "kind": "checkpoint v5 (bf16)"})
    tok = os.path.join(out_dir, "gpt2_tokenizer.bin")
    write_gpt2_tokenizer_bin(tok)
    files.append({"path": tok, "kind": "tokenizer v2"})
    summary = {"model": str(model), "source": str(ckpt), "origin": f"{model}, converted and cached",
               "size": size_name(hdr), "files": files}
    if debug_state:
        state = os.path.join(out_dir, f"{name}_debug_state.bin")
        summary["loss"] = write_gpt2_debug_state(fp32, state, x, y, threads=threads)
        files.append({"path": state, "kind": f"debug state (B={batch_size}, T={seq_len}, from {input_bin})"})
    return summary
