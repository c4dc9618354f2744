"""`llmctl train`: llm.c's training loop (train_gpt2.cu) on the CPU, with llm.c's files.

What it is: `Trainer`, which wires one run together (config, loaders, model, checkpoints, comm,
display), and `train(cfg, comm, display)`, which runs the loop of train_gpt2.cu in its order,
for step = start..N inclusive:
val loss -> HellaSwag (-h 1) -> sample -> checkpoint -> (stop at the last step) -> micro-steps of
forward/backward with gradient accumulation -> all-reduce of the flat gradient buffer (-z 1:
reduce-scatter, and AdamW on this rank's shard then an all-gather: llmctl/distributed/zero.py)
-> lr schedule, grad-norm clip, AdamW (skipped when -sl/-sg's outlier z-score says so, llmctl/outlier.py;
it also spends the gradients, so the next step's zero_grad has nothing to fill) -> log
`s:%d trl:%.4f lr:%.6f norm:%.2f`. Checkpoints are llm.c's `model_%08d.bin` (rank 0),
`state_%08d_%05d.bin` (every rank; with -sl/-sg also a `state_%08d_%05d.outlier.json` sidecar
holding the detectors, which llm.c does not save) and an empty `DONE_%08d` written last, every -n
steps and, whenever -o is given, at the last step (llm.c: only with -n); `-y 1`
resumes from the newest DONE and continues bit for bit (fixed thread count). Also writes
`metrics.jsonl`.
What it is not: the settings and their checks (llmctl/train_config.py), the checkpoint files
(llmctl/checkpoints.py), the model math (llmctl/model/), the data pipeline (llmctl/loader.py),
building the comm and launching ranks (llmctl/jobs/run.py), HellaSwag scoring
(llmctl/evaluate.py) or the rendering (llmctl/display.py). Differences from llm.c are listed in
docs/training.md.
Reference: llm.c train_gpt2.cu (`main`: the loop and its flags; `write_checkpoint`,
`find_max_step`), llmc/dataloader.h (the loader state a checkpoint carries), docs/formats.md.
"""
import glob
import math
import os
import re
import time

import numpy as np

from llmctl.checkpoints import Checkpoints
from llmctl.constants import GPT2_VOCAB_SIZE
from llmctl.inputs import split_inputs
from llmctl.windows import TokenWindows, WindowBatches
from llmctl.distributed.base import SingleProcessComm
from llmctl.distributed.zero import Zero1, shard_layout
from llmctl.display import Display
from llmctl.errors import ConfigError, DataError, FormatError, LlmctlError
from llmctl.interrupt import EXIT_CODE, StopRequest
from llmctl.loader import DataLoader
from llmctl.mfu import flops_per_token, measure_peak_flops, mfu_roof_precision
from llmctl.model import load as load_model, peek_config, resolve_init
from llmctl.outlier import OutlierDetector, as_float32, skip_update
from llmctl.paths import TINYSHAKESPEARE_VAL
from llmctl.roof import best_roof
from llmctl.runlog import RunLogWriter
from llmctl.schedulers import LRScheduler
from llmctl.threads import resolve_threads
from llmctl.train_config import TrainConfig

__all__ = ["TrainConfig", "Trainer", "TrainInterrupted", "TrainingDiverged", "train"]


class TrainInterrupted(LlmctlError):
    """Ctrl-C: the current step finished, a checkpoint was written if -o was set."""

    exit_code = EXIT_CODE

    def __init__(self, message, summary=None):
        super().__init__(message)
        self.summary = summary or {}


class TrainingDiverged(LlmctlError):
    """The loss (or gradient norm) became NaN/Inf; no update was applied."""


# what a failed or stopped multi-process job means for a run, said by the launcher (llmctl/jobs/)
FAILED_JOB_HINT = ("every rank was stopped; the last complete checkpoint (DONE_* in -o) is intact: "
                   "rerun with -y 1 to resume")
STOP_NOTE = "checkpointing if -o is set"
RING_FAILURE_HINT = "the other ranks stop too; rerun with -y 1 to resume from the last checkpoint"



# ---------------------------------------------------------------------------------------------
# helpers


PEAK_RECHECKS = 3  # times a run may measure the peak again when a step's FLOP/s exceeds it


def _check_hellaswag(cfg, model_config):
    """-h 1: the eval file must exist, be valid and fit the model; -> examples scored per eval."""
    from llmctl.evaluate import check_examples
    from llmctl.formats import read_evalfile

    path = cfg.hellaswag_path
    if not os.path.isfile(path):
        out_dir = os.path.dirname(path) or "."
        raise ConfigError(f"-h 1 needs the HellaSwag eval file {path}, which does not exist "
                          "(llm.c would silently skip HellaSwag; llmctl stops before training)",
                          hint=f"create it with `llmctl prepro hellaswag --out-dir {out_dir}`, "
                               "pass --hellaswag FILE, or use -h 0")
    examples = read_evalfile(path)[:cfg.hellaswag_limit]
    check_examples(examples, model_config, path)
    return len(examples)


def _files_text(files, most=4):
    """The header's list of data files: all of them, or the first few and how many more."""
    if isinstance(files, str):
        return files
    shown = ", ".join(files[:most])
    return shown + (f" and {len(files) - most} more ({len(files)} files)" if len(files) > most else "")


# ---------------------------------------------------------------------------------------------
# the trainer


class Trainer:
    """One training run. `run()` is the loop; the pieces are methods so tools can time them."""

    def __init__(self, cfg, comm=None, display=None):
        self.cfg = cfg
        self.comm = comm if comm is not None else SingleProcessComm()
        self.display = display if display is not None else Display()
        self.rank, self.P = self.comm.rank, self.comm.world_size
        self.is_master = self.rank == 0
        self.n_threads = resolve_threads(cfg.threads)
        B, T = cfg.batch_size, cfg.seq_len
        self.B, self.T = B, T

        # 1. flags that cannot work, before touching any file
        self.total_batch_size, self.grad_accum_steps = cfg.validate(self.P)

        # 2. data (llm.c: -a 1 overfits the first batch of the VAL split)
        self._open_data()

        # 3. the model's shape (header or descriptor only), then the output directory: all
        # cheap checks happen before anything is written or a large model is initialised
        self._claim_output()

        # 4. model, optimizer schedule, -sl/-sg's outlier detectors over loss and grad norm
        self.model = load_model(self.init_spec, n_threads=self.n_threads, precision=cfg.precision,
                                recompute=None if cfg.recompute == -1 else cfg.recompute)
        mc = self.model.config
        self.gen_tokens = min(cfg.gen_tokens, mc.max_seq_len)
        self.detect_outliers = cfg.skip_update_lossz != 0 or cfg.skip_update_gradz != 0
        self.loss_detector, self.grad_detector = OutlierDetector(), OutlierDetector()
        self.zero = Zero1(self.model, self.comm) if cfg.zero_stage == 1 and self.P > 1 else None
        self.scheduler = LRScheduler(cfg.lr_scheduler, cfg.learning_rate, cfg.warmup_iters,
                                     self.num_steps, cfg.final_lr_frac)

        # 5. -y 1: optimizer, loader and detector state from the newest complete checkpoint
        self._resume()

        self.flops_per_step = flops_per_token(self.model.num_parameters, mc.num_layers,
                                              mc.channels, T) * B * T * self.grad_accum_steps
        self.mfu_roof = mfu_roof_precision(cfg.precision)
        self._measure_roof()
        self.peak_rechecks = 0
        self.allreduce_ms = 0.0
        self.adamw_ms = 0.0   # the last step's AdamW (-z 1: on this rank's shard)

    def _claim_output(self):
        """Which weights the run starts from (-y 1's checkpoint, -e, or the default), their shape
        checked against the flags, then -o claimed (llmctl/checkpoints.py)."""
        cfg = self.cfg
        self.out = cfg.output_dir
        self.checkpoints = Checkpoints(self.out, self.comm)
        self.resume_step = self.checkpoints.newest() if cfg.resume == 1 else -1
        self.init_note = None
        if self.resume_step >= 0:
            init_spec = self.checkpoints.paths(self.resume_step)[0]
        else:  # no -e: llm.c's train_gpt2.c: gpt2_124M.bin here, else pretrained GPT-2 124M
            init_spec, self.init_note = resolve_init(
                cfg.init, log=self.display.message if self.is_master else None,
                progress=self.is_master)
        self.init_spec = init_spec
        try:
            init_config = peek_config(init_spec)
        except FormatError as e:
            if self.resume_step < 0:
                raise
            raise self.checkpoints.damaged(e, self.resume_step) from None
        self.hellaswag_examples = self._check_fits(init_config)
        self._check_zero(init_config)
        if cfg.overwrite:
            self._check_init_survives_overwrite()
        self.checkpoints.claim(cfg.resume, cfg.overwrite)

    def _resume(self):
        """-y 1: load the newest complete checkpoint's state into the model, loader, detectors."""
        cfg = self.cfg
        self.start_step = 0
        self.resume_notes = []
        if self.resume_step >= 0:
            self.start_step, self.resume_notes = self.checkpoints.load(
                self.resume_step, self.model, self.train_loader, self._detectors(),
                restore_loader=not cfg.overfit_single_batch,  # -a 1: reset every step
                zero=self.zero)
            if self.start_step > self.num_steps:
                raise ConfigError(f"the checkpoint in {self.out} is at step {self.start_step}, "
                                  f"beyond the {self.num_steps} steps of this run",
                                  hint="pass the -x of the original run")

    def _measure_roof(self, again=False):
        """MFU's denominator: this run's GEMM measurement merged into the best one cached for
        this CPU, threads, engine and precision (llmctl/roof.py), so it does not move with the
        load of the moment; peak_source says where it came from."""
        measured = measure_peak_flops(self.n_threads, self.cfg.precision, again=again)
        self.peak_flops, self.peak_source = best_roof(measured, self.n_threads, self.mfu_roof)

    def _open_data(self):
        """-i's train shards (its val shards validate unless -j is given; other llm.c files it
        matches are left out) and -j's; -a 1 trains on the val split, unshuffled, as
        train_gpt2.cu; --sampler windows draws shuffled windows instead of llm.c's batches."""
        cfg, B, T = self.cfg, self.B, self.T
        split = split_inputs(cfg.train_data)
        self.left_out = split.left_out
        if cfg.val_data is not None:
            val_files = cfg.val_data
        elif split.val:
            val_files = split.val
        else:
            val_files = TINYSHAKESPEARE_VAL
        self.train_files = split.train
        if cfg.overfit_single_batch:  # train_gpt2.cu: the first batch of the val split
            self.train_files = val_files if isinstance(val_files, list) else sorted(glob.glob(val_files))
            if not self.train_files:
                raise DataError(f"-a 1 trains on the val split, but no file matches {val_files!r}",
                                hint="pass -j with the val shards")
        if cfg.sampler == "windows" and not cfg.overfit_single_batch:
            self.train_loader = WindowBatches(TokenWindows(self.train_files, T), B, self.rank,
                                              self.P, seed=cfg.seed)
        else:
            self.train_loader = DataLoader(self.train_files, B, T, self.rank, self.P,
                                           shuffle=not cfg.overfit_single_batch, seed=cfg.seed)
        self.val_loader = None
        self.val_files = [] if isinstance(val_files, list) else val_files
        if cfg.val_loss_every > 0:
            self.val_loader = DataLoader(val_files, B, T, self.rank, self.P, shuffle=False)
            self.val_files = self.val_loader.files
        if cfg.max_steps == -1:
            self.num_steps = self.train_loader.num_tokens // self.total_batch_size
            if self.num_steps == 0:
                raise DataError(f"{' '.join(self.train_files)} has {self.train_loader.num_tokens} "
                                f"tokens, less than one step of -d {self.total_batch_size} tokens",
                                hint="use a smaller -d/-b/-t or set -x")
        else:
            self.num_steps = cfg.max_steps
        self.shared_files = []
        if self.val_loader is not None and not cfg.overfit_single_batch:
            val_real = {os.path.realpath(f) for f in self.val_files}
            self.shared_files = [f for f in self.train_files if os.path.realpath(f) in val_real]
        self.val_num_batches = 0
        if self.val_loader is not None:
            self.val_num_batches = (cfg.val_max_steps if cfg.val_max_steps != -1 else
                                    self.val_loader.num_tokens // (B * T * self.P))

    def _check_fits(self, mc):
        """The data, -t and the -h 1 eval file fit model config mc. -> HellaSwag examples."""
        for loader in (self.train_loader, self.val_loader):
            if loader is not None:
                loader.check_vocab(mc.vocab_size, self.n_threads)
        if self.T > mc.max_seq_len:
            raise ConfigError(f"sequence length -t {self.T} exceeds the model's maxT "
                              f"{mc.max_seq_len}", hint=f"use -t {mc.max_seq_len} or less")
        return _check_hellaswag(self.cfg, mc) if self.cfg.hellaswag else 0

    def _check_init_survives_overwrite(self):
        """--overwrite deletes the checkpoints in -o: -e must not be one of them."""
        spec = self.init_spec
        if not (self.out and os.path.isfile(spec)):
            return
        here = os.path.realpath(os.path.dirname(os.path.abspath(spec)))
        name = os.path.basename(spec)
        if here == os.path.realpath(self.out) and re.fullmatch(r"model_\d{8}\.bin", name):
            raise ConfigError(f"-e {spec} is a checkpoint in -o {self.out}, which --overwrite "
                              "would delete before reading it",
                              hint="copy it out of -o first, or resume it with -y 1 instead "
                                   "of --overwrite")

    def _check_zero(self, mc):
        """-z 1 needs a backend with the reduce-scatter and all-gather, and tensors that cut
        into P equal shards (llmctl/distributed/zero.py); with one process it is -z 0, as in
        llm.c (its one shard is the whole model)."""
        if self.cfg.zero_stage != 1 or self.P == 1:
            return
        if not self.comm.supports_zero:
            raise ConfigError(f"-z 1 is not available over this backend ({type(self.comm).__name__}"
                              "): it has no reduce-scatter / all-gather; shm (--nproc), --nnodes, "
                              "the ring and MPI have them",
                              hint="use -z 0, or one of those transports")
        shard_layout(mc, self.P)

    def _detectors(self):
        return (self.loss_detector, self.grad_detector) if self.detect_outliers else None

    # -- checkpoints (llmctl/checkpoints.py) ------------------------------------------------

    @property
    def last_checkpoint(self):
        """The newest model_%08d.bin this run wrote, or None."""
        return self.checkpoints.last

    def write_checkpoint(self, step):
        """model (rank 0), state (every rank), barrier, DONE (rank 0): llm.c write_checkpoint.
        Weights that hold NaN/Inf are never written."""
        model_path = self.checkpoints.paths(step)[0]
        if not np.isfinite(self.model.params).all():  # ~1 ms per 10M parameters
            raise TrainingDiverged(
                f"the parameters hold NaN/Inf at step {step}: checkpoint {model_path} was not "
                f"written ({self.checkpoints.last_good_text()})",
                hint="lower the learning rate (-l), add warmup (-u) or keep --grad-clip on")
        self.checkpoints.write(step, self.model, self.train_loader.state(), self._detectors(),
                               zero=self.zero)
        if self.is_master:
            self.display.checkpoint(step, model_path)

    def rotate_checkpoints(self, step):
        c = self.cfg
        self.checkpoints.rotate(step, c.checkpoint_every, c.checkpoints_keep,
                                c.major_checkpoint_every)

    # -- evaluation / sampling -------------------------------------------------------------------

    def evaluate_val(self, stop=None):
        """Mean loss over val_num_batches batches from the start of the val split, all ranks.
        stop: a callable checked between batches (Ctrl-C); when it says so the loop ends early
        and the mean is over the batches done (the caller then discards it)."""
        self.val_loader.reset()
        total = 0.0
        done = 0
        for _ in range(self.val_num_batches):
            if stop is not None and stop():
                break
            x, y = self.val_loader.next_batch()
            total += float(self.model.forward(x, y))
            done += 1
        val = total / max(done, 1)
        return self.comm.all_reduce_sum_scalar(val) / self.P

    def evaluate_hellaswag(self):
        """llm.c's HellaSwag acc_norm over the eval file; the examples are split over the ranks
        and the correct counts summed. -> llmctl.evaluate.eval_hellaswag's result dict."""
        from llmctl.evaluate import eval_hellaswag

        return eval_hellaswag(self.model, self.cfg.hellaswag_path, limit=self.cfg.hellaswag_limit, comm=self.comm)

    def generate_sample(self):
        """llm.c's training-time sample: from <|endoftext|>, gen_tokens-1 tokens, coins from
        xorshift seeded 1337 afresh each time, no temperature. Returns the text (or ids)."""
        from llmctl.sample import default_start, generate

        V = self.model.config.vocab_size
        eot = default_start(V)[0]  # EOT, or 0 for a vocabulary without it
        n = self.gen_tokens - 1
        if n <= 0:
            return ""
        ids = generate(self.model, [eot], n, seed=1337, stop_at_eot=False, eot=eot)
        if V == GPT2_VOCAB_SIZE:
            try:
                from llmctl.tokenizer import get_tokenizer

                return get_tokenizer().decode(ids)
            except LlmctlError:
                pass
        return " ".join(str(i) for i in ids)

    # -- one optimization step ------------------------------------------------------------------

    def all_reduce_grads(self):
        """Average the flat gradient buffer over ranks (one collective per step); -z 1: the
        reduce-scatter, this rank's shard only."""
        if self.P > 1:
            t0 = time.perf_counter()
            if self.zero is not None:
                self.zero.reduce_grads()
            else:
                self.comm.all_reduce_mean(self.model.grads)
            self.allreduce_ms = (time.perf_counter() - t0) * 1000.0

    def train_step(self, step):
        """Micro-steps + all-reduce + outlier z-scores + clip + AdamW. -> (mean loss over
        micro-steps and ranks, lr, grad norm, outlier dict: {} without -sl/-sg, else loss_z,
        grad_z (None while a window fills) and skipped). Raises TrainingDiverged (before any
        update) on a non-finite loss/norm."""
        model = self.model
        model.zero_grad(lazy=True)   # bf16: the backward overwrites them (GPT2.zero_grad)
        loss_sum = 0.0
        if self.cfg.overfit_single_batch:  # train_gpt2.cu: the same batches every step
            self.train_loader.reset()
        for _ in range(self.grad_accum_steps):  # consecutive batches, as dataloader_next_batch
            x, y = self.train_loader.next_batch()
            scale = 1.0 / self.grad_accum_steps
            loss_sum += float(model.forward(x, y, loss_scale=scale))
            model.backward(loss_scale=scale)
        loss = loss_sum / self.grad_accum_steps
        if self.P > 1:
            loss = self.comm.all_reduce_sum_scalar(loss) / self.P
        self.all_reduce_grads()
        # llm.c feeds its float mean_loss / grad_norm (as double) and keeps z as float; every
        # rank sees the same all-reduced values, so every rank makes the same decision
        zloss = self.loss_detector.update(as_float32(loss))
        lr = self.scheduler.lr_at(step)
        grad_norm = float(model.grad_norm() if self.zero is None else self.zero.grad_norm())
        zgrad = self.grad_detector.update(as_float32(grad_norm))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(step, loss, grad_norm)
        outlier, skipped = self._outliers(zloss, zgrad)
        if skipped is not None:
            if self.is_master:
                self.display.message(skipped)  # llm.c prints it before the step line
            return loss, lr, grad_norm, outlier
        clip = self.cfg.grad_clip
        grad_scale = clip / grad_norm if clip > 0 and grad_norm > clip else 1.0
        # AdamW also spends the gradients (no zeroing pass before the next step: fp32's AdamW
        # writes zeros as it reads, bf16's next backward overwrites them; a skipped or diverged
        # step returns above without it, and zero_grad then fills or, in bf16, marks them spent
        # for the backward to overwrite). With shm's shared
        # gradient buffer this is safe: the all-reduce's last collective comes after every
        # rank's reduce of its slice across all rows, so from here on each rank reads and
        # writes only its own row until the next step's all-reduce, whose first collective
        # waits for every rank's update and backward. Ring, MPI and hier reduce a private
        # buffer in place (ring's sends are flushed before it returns).
        t0 = time.perf_counter()
        if self.zero is not None:  # AdamW on this rank's shard, then the all-gather
            self.zero.update(lr, self.cfg.beta1, self.cfg.beta2, self.cfg.eps,
                             self.cfg.weight_decay, grad_scale, step + 1)
            self.adamw_ms = self.zero.adamw_ms
            self.allreduce_ms += self.zero.comm_ms   # the reduce-scatter and the all-gather
        else:
            model.update(lr, self.cfg.beta1, self.cfg.beta2, self.cfg.eps, self.cfg.weight_decay,
                         grad_scale, step + 1, zero_grads=True)
            self.adamw_ms = (time.perf_counter() - t0) * 1000.0
        return loss, lr, grad_norm, outlier

    def _diverged(self, step, loss, grad_norm):
        """A NaN/Inf loss or gradient norm: drop checkpoint `step` (its weights produced it), raise."""
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        value = loss if not math.isfinite(loss) else grad_norm
        self.checkpoints.discard(step)
        raise TrainingDiverged(
            f"{what} is {value} at step {step + 1}/{self.num_steps}: training stopped "
            f"before the update ({self.checkpoints.last_good_text()})",
            hint="lower the learning rate (-l), add warmup (-u) or keep --grad-clip on")

    def _outliers(self, zloss, zgrad):
        """-sl/-sg: -> (the step's outlier fields, llm.c's "skipping update" line or None)."""
        if not self.detect_outliers:
            return {}, None
        skipped = None
        if skip_update(zloss, self.cfg.skip_update_lossz):
            skipped = f"skipping update due to loss z-score of {as_float32(zloss):f}"
        elif skip_update(zgrad, self.cfg.skip_update_gradz):
            skipped = f"skipping update due to grad z-score of {as_float32(zgrad):f}"
        return ({"loss_z": None if math.isnan(zloss) else as_float32(zloss),
                 "grad_z": None if math.isnan(zgrad) else as_float32(zgrad),
                 "skipped": skipped is not None}, skipped)

    # -- the loop -------------------------------------------------------------------------------

    def _info(self):
        mc, c = self.model.config, self.cfg
        info = {
            "train_data": _files_text(self.train_files)
                          + (" (-a 1: the val split, unshuffled)" if c.overfit_single_batch else "")
                          + (" (--sampler windows)" if c.sampler == "windows"
                             and not c.overfit_single_batch else ""),
            "val_data": (_files_text(self.val_files) if self.val_loader is not None
                         else "- (-v 0)"),
            "init": (f"checkpoint step {self.resume_step}" if self.resume_step >= 0
                     else self.init_note or c.init),
            "model": f"L={mc.num_layers} NH={mc.num_heads} C={mc.channels} "
                     f"maxT={mc.max_seq_len} V={mc.vocab_size} Vp={mc.padded_vocab_size}",
            "num_parameters": self.model.num_parameters,
            "B": self.B, "T": self.T, "P": self.P,
            "total_batch_size": self.total_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "num_steps": self.num_steps, "start_step": self.start_step,
            "val_num_batches": self.val_num_batches,
            "lr_schedule": f"{c.lr_scheduler} lr={c.learning_rate:g} warmup={c.warmup_iters} "
                           f"final_frac={c.final_lr_frac:g}",
            "threads": self.n_threads,
            "precision": c.precision + (" (emulated: fp32 GEMMs)" if c.precision != self.mfu_roof else ""),
            "mfu_roof": self.mfu_roof,
            "peak_flops": f"{self.peak_flops / 1e9:.1f} GFLOP/s ({self.mfu_roof} GEMM 1024^3: "
                          f"{self.peak_source})",
            "output_dir": self.out or "-",
        }
        if self.detect_outliers:
            info["skip_update"] = (f"loss z > {c.skip_update_lossz:g}, grad norm z > "
                                   f"{c.skip_update_gradz:g} (0 = off; window 128)")
        if c.hellaswag:
            info["hellaswag"] = f"{c.hellaswag_path} ({self.hellaswag_examples} examples)"
        return info

    def _open_logs(self):
        self.logs = RunLogWriter(self.out if self.is_master else None, self.cfg.resume == 1,
                                 self.start_step)

    def _stop_requested(self, sigint, launcher=True):
        stop = sigint.requested
        if self.P > 1:  # every rank must stop at the same step
            stop = self.comm.all_reduce_sum_scalar(1.0 if stop else 0.0) > 0
        # a launcher's coordinated Ctrl-C: set on every rank at the same collective; it is
        # honoured after the step's update only (launcher=False: the check after validation)
        return stop or (launcher and bool(getattr(self.comm, "stop_requested", False)))

    def _interrupt(self, step, N, summary, resumed_here):
        """Checkpoint the weights after `step` updates (unless that checkpoint exists) and
        raise TrainInterrupted."""
        where = "; no -o, nothing saved"
        if self.out:
            path = self.checkpoints.paths(step)[0]
            if resumed_here or step in self.checkpoints.written:
                where = f"; checkpoint: {path}"
            else:
                self.write_checkpoint(step)
                if self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0:
                    self.rotate_checkpoints(step)  # on the -n grid: -nk applies as to a regular one
                where = f"; checkpoint written: {path}"
        summary["checkpoint"] = self.last_checkpoint
        raise TrainInterrupted(f"interrupted after step {step}/{N}{where}", summary)

    def run(self):
        """The loop of train_gpt2.cu's main (see the module doc); -> the run's summary dict."""
        N = self.num_steps
        self._open_logs()
        if self.is_master:
            self._announce()
        summary = {"start_step": self.start_step, "num_steps": N, "steps_run": 0,
                   "train_loss": None, "val_loss": None, "checkpoint": None,
                   "output_dir": self.out}
        if self.cfg.hellaswag:
            summary["hellaswag_acc_norm"] = None
        resuming = self.resume_step >= 0
        times = []
        try:
            with StopRequest("stopping after this step (Ctrl-C again to abort)...") as sigint:
                for step in range(self.start_step, N + 1):
                    last = step == N
                    self.comm.step = step  # the backends name it in heartbeats and errors
                    rec = {"step": step}
                    self._evaluate(step, last, rec, summary, sigint, resuming)
                    if self.out and not resuming and self._checkpoint_due(step, last):
                        self.write_checkpoint(step)
                        if self.cfg.checkpoint_every > 0:
                            self.rotate_checkpoints(step)
                    resuming = False
                    if last:
                        if len(rec) > 1:
                            self.logs.record(rec)
                        break
                    self._timed_step(step, rec, summary, times)
                    if self._stop_requested(sigint):
                        self._interrupt(step + 1, N, summary, False)
        except KeyboardInterrupt:
            # the second Ctrl-C: stop at once; DONE_ is written last, so a checkpoint being
            # written is incomplete and ignored, the previous complete one is intact
            raise TrainInterrupted(f"aborted by a second Ctrl-C ({self.checkpoints.last_good_text()})",
                                   summary) from None
        finally:
            self._finish(summary, times)
        return summary

    def _announce(self):
        """Rank 0's header and the notes about how this run was set up."""
        cfg = self.cfg
        self.display.start(self._info())
        if cfg.resume == 1:
            self.display.message(
                f"resuming from the checkpoint at step {self.start_step} in {self.out}"
                if self.resume_step >= 0 else
                f"no complete checkpoint in {self.out}: starting from {self.init_note or cfg.init}")
        for note in self.resume_notes:
            self.display.message(note)
        if cfg.zero_stage == 1 and self.P == 1:
            self.display.message("Note: -z 1 with one process: its one shard is the whole "
                                 "model, so it runs as -z 0 (as llm.c does)")
        if cfg.checkpoint_every > 0 and not self.out:  # llm.c says nothing and writes nothing
            self.display.message(f"Note: -n {cfg.checkpoint_every} writes no checkpoint without "
                                 "-o DIR (checkpoints go into the output directory)")
        if self.shared_files:
            self.display.message(
                f"Warning: -i and -j both name {_files_text(self.shared_files)}: the val loss "
                "is measured on tokens the model trains on")
        if self.left_out:
            self.display.message(
                f"-i {self.cfg.train_data!r} also matched {len(self.left_out)} file(s) that are "
                "not token shards, left out: "
                + ", ".join(f"{p} ({what})" for p, what in self.left_out))

    def _evaluate(self, step, last, rec, summary, sigint, resuming):
        """What llm.c does before a step's update: val loss every -v steps, HellaSwag (-h 1) and a
        sample every -s steps, and each at the last step. Ctrl-C during the val loss stops here."""
        cfg, N = self.cfg, self.num_steps
        if self.val_loader is not None and (step % cfg.val_loss_every == 0 or last):
            val = self.evaluate_val(stop=lambda: sigint.requested)
            if self._stop_requested(sigint, launcher=False):  # Ctrl-C in val
                self._interrupt(step, N, summary, resuming)
            rec["val_loss"] = summary["val_loss"] = val
            self.logs.log(step, val_loss=val)
            if self.is_master:
                self.display.val(step, val)
        if cfg.hellaswag and ((cfg.val_loss_every > 0 and step > 0
                               and step % cfg.val_loss_every == 0) or last):
            hs = self.evaluate_hellaswag()  # every rank: a collective
            acc = hs["acc_norm"]
            rec["hellaswag_acc_norm"] = summary["hellaswag_acc_norm"] = acc
            self.logs.log(step, hellaswag_acc_norm=acc)
            if self.is_master:
                self.display.message(f"HellaSwag: {hs['correct_norm']}/"
                                     f"{hs['num_examples']} = {acc:f}")
        if (self.is_master and cfg.sample_every > 0
                and ((step > 0 and step % cfg.sample_every == 0) or last)):
            self.display.sample(step, self.generate_sample())

    def _checkpoint_due(self, step, last):
        """-o: the last step always (llm.c: only with -n), and every -n steps."""
        every = self.cfg.checkpoint_every
        return last or (every > 0 and step > 0 and step % every == 0)

    def _timed_step(self, step, rec, summary, times):
        """One update, timed (into `times`), logged and shown."""
        t0 = time.perf_counter()
        loss, lr, norm, outlier = self.train_step(step)
        ms = (time.perf_counter() - t0) * 1000.0
        times.append(ms)
        tokens = self.P * self.B * self.T * self.grad_accum_steps
        if (self.flops_per_step / (ms / 1000.0) > self.peak_flops and self.P == 1
                and self.peak_rechecks < PEAK_RECHECKS):
            # a step beat the peak: it was measured while the cores were busier
            self.peak_rechecks += 1
            self._measure_roof(again=True)
        rec.update(train_loss=loss, lr=lr, grad_norm=norm, ms=ms,
                   tokens_per_s=tokens / (ms / 1000.0),
                   mfu=self.flops_per_step / (ms / 1000.0) / self.peak_flops,
                   **outlier)
        if self.P > 1:
            rec["allreduce_ms"] = self.allreduce_ms
            rec["adamw_ms"] = self.adamw_ms
        self.logs.log(step, train_loss=loss, lr=lr, grad_norm=norm)
        self.logs.record(rec)
        summary.update(steps_run=summary["steps_run"] + 1, train_loss=loss)
        if self.is_master:
            self.display.step({**rec, "num_steps": self.num_steps})

    def _finish(self, summary, times):
        """However the loop ended: close the logs, complete the summary, show it (rank 0)."""
        self.logs.close()
        summary["checkpoint"] = self.last_checkpoint
        if times:
            summary["avg_ms"] = (sum(times[1:]) / len(times[1:]) if len(times) > 1
                                 else times[0])
        if self.is_master:
            self.display.finish(summary)


def train(cfg, comm=None, display=None, *, check_params=False):
    """Run llm.c's training loop for `cfg` (a TrainConfig); returns a summary dict.

    comm: a llmctl.distributed Comm (default: one process); when its all-reduce is zero-copy on
    its own memory (Comm.shares_memory) the model's gradients are placed there. display: a
    llmctl.display.Display. check_params: every scalar collective first checks that all ranks
    hold bit-identical parameters, and in bf16 the same bf16 copy (Comm.watch; a debug mode).
    Raises ConfigError/DataError/FormatError for bad input (before any file is written),
    TrainingDiverged on a NaN/Inf loss, TrainInterrupted (exit code 130) after Ctrl-C.
    """
    comm = comm if comm is not None else SingleProcessComm()
    trainer = Trainer(cfg, comm, display)  # its loop sets comm.step, checks comm.stop_requested
    if comm.world_size > 1 and comm.shares_memory:
        adopt_grads(comm, trainer.model)
    if check_params:
        trainer.model.prepare(trainer.B, trainer.T)   # the bf16 copy it keeps is sized by the plan
        comm.watch(trainer.model.params, "parameters")
        if trainer.model.params_bf16 is not None:  # each rank's own copy the matmuls read
            comm.watch(trainer.model.params_bf16, "bf16 parameters")
    return trainer.run()


def adopt_grads(comm, model):
    """Place the model's gradients in comm.shared_buffer(n), so the per-step all-reduce is
    zero-copy (GPT2.bind_grads copies them in; the private buffer is dropped)."""
    model.bind_grads(comm.shared_buffer(model.grads.shape[0]))
