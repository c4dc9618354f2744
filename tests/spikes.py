"""A Trainer with injected loss or gradient spikes, for the -sl/-sg tests, in one process or as
the target of a real `--nproc N` job (llmctl's launcher imports `train_entry` in every rank)."""
from llmctl.display import Display
from llmctl.model import GPT2
from llmctl.train import Trainer, TrainConfig


def unfused_update(update):
    """GPT2.update that never clears the gradients (zero_grads=False whatever the caller asks),
    so every zero_grad() fills: the separate zeroing pass the fused one is checked against."""
    def update_then_fill(self, *args, zero_grads=False, **kw):
        return update(self, *args, zero_grads=False, **kw)
    return update_then_fill


def poisoned_trainer(cfg, poison, display=None, comm=None):
    """A Trainer whose loss (kind "loss": +5 on the reported loss) or gradients (kind "grad":
    x1000 after backward) are spiked at the steps in `poison`; comm.step is the loop's step."""
    t = Trainer(cfg, comm, display=display or Display())
    fwd, bwd = t.model.forward, t.model.backward

    def forward(x, y, **kw):
        loss = fwd(x, y, **kw)
        return loss + 5.0 if poison.get(t.comm.step) == "loss" else loss

    def backward(**kw):
        bwd(**kw)
        if poison.get(t.comm.step) == "grad":
            t.model.grads *= 1000.0

    t.model.forward, t.model.backward = forward, backward
    return t


def train_entry(args, comm):
    """Launcher target: args["config"] (TrainConfig fields), args["poison"] {rank: {step: kind}};
    optional args["shared_grads"]: the gradients live in the comm's shared memory, as train()
    places them; args["unfused"]: zero_grad fills every step (unfused_update).
    The job checks after every step that all ranks hold bit-identical parameters. Returns the
    run's summary plus "grads_shared" and "fills_skipped" (zero_grad calls that found the
    gradients already cleared by AdamW)."""
    from llmctl.train import adopt_grads

    if args.get("unfused"):
        GPT2.update = unfused_update(GPT2.update)
    cfg = TrainConfig(**args["config"])
    poison = {int(k): v for k, v in args["poison"].get(str(comm.rank), {}).items()}
    t = poisoned_trainer(cfg, poison, comm=comm)
    if args.get("shared_grads") and comm.shares_memory:
        adopt_grads(comm, t.model)
    comm.watch(t.model.params, "parameters")
    skipped, zero_grad = [0], t.model.zero_grad

    def counted_zero_grad(lazy=False):
        skipped[0] += t.model.grads_known_zero
        zero_grad(lazy=lazy)
    t.model.zero_grad = counted_zero_grad
    summary = t.run()
    return {**summary, "grads_shared": comm.is_shared(t.model.grads), "fills_skipped": skipped[0]}
