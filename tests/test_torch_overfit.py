"""`llmctl train -a 1` against PyTorch: the same tiny GPT-2, the same batch, torch.optim.AdamW.

llm.c's train_gpt2.cu with -a 1 (overfit a single batch) trains on the val split, its loader not
permuted and reset at the start of every step, the micro-steps of a step reading consecutive
batches: with P = 1, micro-step k of every step reads tokens [k*B*T, (k+1)*B*T + 1) of the val
shard. This test writes a tiny float32 v3 checkpoint and the shards with tests/loop_reference.py's
NumPy writers, runs `python -m llmctl train -a 1` on them as a subprocess and compares every
step's train loss and grad norm (its metrics.jsonl) with a nanoGPT-style GPT-2 written here in
PyTorch (tanh GELU, LayerNorm eps 1e-5, causal attention, lm head tied to wte, wte padded to Vp
rows with zeros beyond V, the loss over the first V logits only) trained on exactly those tokens
the way train_gpt2.cu's step does it: the loss of each micro-step scaled by 1/accum (a mean over
micro-steps), the global L2 norm before clipping, the gradients scaled by 1/norm when it exceeds
1.0, then torch.optim.AdamW (betas 0.9/0.95, eps 1e-8, weight decay only on the 2-D tensors via
two param groups) at the lr of llmc/schedulers.h.

Both sides compute in float32 and differ only in summation order (~1e-7 relative per step).
AdamW normalises its update, so that rounding does not grow much over the steps: we see at most
~5e-7 relative on losses and grad norms over 8 steps. RTOL = 1e-4 leaves a wide margin, while
reading another batch (a permuted loader, no reset between steps, one micro-batch read twice)
moves the losses by 1e-2 or more from step 0 or 1 on.
"""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the -a 1 comparison "
                                            "against torch.optim.AdamW needs it")
nn, F = torch.nn, torch.nn.functional

import loop_reference as LR  # noqa: E402
import reference as R  # noqa: E402

CFG = dict(max_seq_len=16, vocab_size=64, padded_vocab_size=128, num_layers=2, num_heads=2,
           channels=16)
B, T, STEPS = 4, 16, 8
VAL_TOKENS = 1000  # 15 batches of B*T: a permuted or unreset loader reads other tokens
RTOL = 1e-4


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.c_attn = nn.Linear(C, 3 * C)  # q, k, v; head h is channels h*hs:(h+1)*hs of each
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def attn(self, x):
        Bx, Tx, C = x.shape
        hs = C // self.NH
        q, k, v = (t.view(Bx, Tx, self.NH, hs).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        causal = torch.ones(Tx, Tx, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.attn_proj((att @ v).transpose(1, 2).reshape(Bx, Tx, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["channels"]
        self.V = cfg["vocab_size"]
        self.wte = nn.Embedding(cfg["padded_vocab_size"], C)
        self.wpe = nn.Embedding(cfg["max_seq_len"], C)
        self.h = nn.ModuleList(Block(C, cfg["num_heads"]) for _ in range(cfg["num_layers"]))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., :self.V]  # tied, padding dropped
        return F.cross_entropy(logits.reshape(-1, self.V), targets.reshape(-1))

    def load_llmc(self, p):
        """llm.c's tensors (checkpoint order, Linear weights already (out, in)) into the modules."""
        def put(param, value):
            with torch.no_grad():
                param.copy_(torch.from_numpy(np.asarray(value, dtype=np.float32)))

        put(self.wte.weight, p["wte"])
        put(self.wpe.weight, p["wpe"])
        for i, b in enumerate(self.h):
            for mod, w, bias in ((b.ln_1, "ln1w", "ln1b"), (b.c_attn, "qkvw", "qkvb"),
                                 (b.attn_proj, "attprojw", "attprojb"), (b.ln_2, "ln2w", "ln2b"),
                                 (b.c_fc, "fcw", "fcb"), (b.mlp_proj, "fcprojw", "fcprojb")):
                put(mod.weight, p[w][i])
                put(mod.bias, p[bias][i])
        put(self.ln_f.weight, p["lnfw"])
        put(self.ln_f.bias, p["lnfb"])


def torch_overfit(d, steps, total_batch, lr, schedule, warmup, final_frac, weight_decay,
                  grad_clip=1.0):
    """train_gpt2.cu's -a 1 loop in PyTorch on d's files -> [(train_loss, grad_norm)] per step."""
    torch.manual_seed(0)  # only the module constructors draw; every value is then overwritten
    cfg, params = LR.read_checkpoint(d / "init.bin")
    model = GPT(cfg)
    model.load_llmc(params)
    ps = list(model.parameters())
    assert sum(p.numel() for p in ps) == R.num_parameters(cfg)
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() == 2], "weight_decay": weight_decay},
                             {"params": [p for p in ps if p.dim() != 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.from_numpy(LR.read_shard(d / "val.bin").astype(np.int64))
    accum = total_batch // (B * T)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        loss_sum = 0.0
        for k in range(accum):  # the same consecutive batches every step, from the top
            buf = tokens[k * B * T:(k + 1) * B * T + 1]
            loss = model(buf[:-1].view(B, T), buf[1:].view(B, T))
            (loss / accum).backward()
            loss_sum += loss.item()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps])).item()
        if norm > grad_clip:  # llm.c's grad_scale = clip / norm (clip_grad_norm_ adds 1e-6)
            for p in ps:
                p.grad.mul_(grad_clip / norm)
        for g in opt.param_groups:
            g["lr"] = LR.learning_rate(schedule, step, lr, warmup, steps, final_frac)
        opt.step()
        out.append((loss_sum / accum, norm))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """init.bin (std 0.2: grad norms above 1 at first, so the clip acts), a train shard that
    -a 1 must not read and the val shard it must."""
    d = tmp_path_factory.mktemp("torch_overfit")
    LR.write_checkpoint(d / "init.bin", CFG, R.random_params(CFG, seed=3, std=0.2))
    rng = np.random.default_rng(5)
    LR.write_shard(d / "train.bin", rng.integers(0, CFG["vocab_size"], 500))
    LR.write_shard(d / "val.bin", rng.integers(0, CFG["vocab_size"], VAL_TOKENS))
    return d


def llmctl_overfit(d, out, flags):
    """`python -m llmctl train -a 1` on d's files -> [(train_loss, grad_norm)] per step."""
    args = ["train", "-i", str(d / "train.bin"), "-j", str(d / "val.bin"), "-e", str(d / "init.bin"),
            "-o", str(d / out), "-b", str(B), "-t", str(T), "-x", str(STEPS), "-a", "1",
            "-v", "0", "-s", "0", "--threads", "1", *flags]
    r = subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in (d / out / "metrics.jsonl").read_text().splitlines()]
    recs = sorted((rec for rec in recs if "train_loss" in rec), key=lambda rec: rec["step"])
    assert [rec["step"] for rec in recs] == list(range(STEPS))
    return [(rec["train_loss"], rec["grad_norm"]) for rec in recs]


CASES = {
    # one micro-step: -d defaults to B*T; a constant lr, weight decay on the matrices
    "plain": dict(flags=["-l", "3e-3", "-k", "constant", "-c", "0.1"], total_batch=B * T,
                  lr=3e-3, schedule="constant", warmup=0, final_frac=1.0, weight_decay=0.1),
    # two consecutive micro-batches per step, averaged; warmup then cosine decay
    "accumulate_2": dict(flags=["-d", str(2 * B * T), "-l", "3e-3", "-k", "cosine", "-u", "2",
                                "-q", "0.1", "-c", "0.1"],
                         total_batch=2 * B * T, lr=3e-3, schedule="cosine", warmup=2,
                         final_frac=0.1, weight_decay=0.1),
}


@pytest.mark.parametrize("case", CASES)
def test_overfit_losses_and_grad_norms_match_pytorch(files, case):
    c = CASES[case]
    torch.set_num_threads(1)
    want = torch_overfit(files, STEPS, c["total_batch"], c["lr"], c["schedule"], c["warmup"],
                         c["final_frac"], c["weight_decay"])
    got = llmctl_overfit(files, case, c["flags"])
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=RTOL,
                               err_msg="train_loss per step")
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=RTOL,
                               err_msg="grad_norm per step")
    assert want[0][1] > 1.0  # the clip acted at least once
    assert want[-1][0] < want[0][0] - 0.1  # it overfits: the comparison is not of a flat line
