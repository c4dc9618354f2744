"""A training run's checkpoints in -o: llm.c's file names, the newest complete one, save, resume,
rotation (-nk/-nm) and the clean-up of a checkpoint whose weights went NaN.

What it is: the paths `model_%08d.bin` (rank 0), `state_%08d_%05d.bin` (every rank; with -sl/-sg
also `state_%08d_%05d.outlier.json`, the detectors llm.c does not save) and the empty `DONE_%08d`
written last (train_gpt2.cu `write_checkpoint`); `find_max_step` (llm.c `find_max_step`: the
newest DONE); and `Checkpoints`, one rank's view of -o: `write` (model, state, barrier, DONE),
`load` (the state file back into the optimizer, the loader and the detectors), `rotate`,
`delete`, `discard` (NaN clean-up) and `last_good_text` for error messages.

What it is not: the byte layouts (llmctl/formats.py), the loader's shuffle state
(llmctl/loader.py) or when to checkpoint (llmctl/train.py).
"""
import contextlib
import json
import os
import re

import numpy as np

from llmctl.atomic import atomic_write
from llmctl.errors import ConfigError, DataError, FormatError, LlmctlError

RUN_LOGS = ("main.log", "metrics.jsonl")  # what a run writes in -o besides checkpoints
OUTPUT_HINT = ("make sure -o is a writable directory with free space and that no directory "
               "occupies this file's name")


def os_error(path, e):
    """An OSError on an output path as a one-line DataError naming the path."""
    return DataError(f"cannot write {path}: {e.strerror or e}", hint=OUTPUT_HINT)


def checkpoint_paths(output_dir, step, rank=0):
    """(model_%08d.bin, state_%08d_%05d.bin, DONE_%08d) of `step` in output_dir."""
    return (os.path.join(output_dir, f"model_{step:08d}.bin"),
            os.path.join(output_dir, f"state_{step:08d}_{rank:05d}.bin"),
            os.path.join(output_dir, f"DONE_{step:08d}"))


def outlier_state_path(output_dir, step, rank=0):
    """The -sl/-sg detectors' sidecar next to state_%08d_%05d.bin (llmctl only)."""
    return os.path.join(output_dir, f"state_{step:08d}_{rank:05d}.outlier.json")


def find_max_step(output_dir):
    """The largest N with a DONE_%08d file in output_dir, or -1 (llm.c find_max_step)."""
    best = -1
    if not output_dir or not os.path.isdir(output_dir):
        return best
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"DONE_(\d{8})", name)
        if m:
            best = max(best, int(m.group(1)))
    return best


def _not_a_directory(path):
    """The first existing part of path (itself, else its nearest existing parent) when that is
    a file or anything else but a directory; None when path can be a directory."""
    p = os.path.normpath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent in ("", p):
            return None
        p = parent
    return None if os.path.isdir(p) else p


def prepare_output_dir(path, rank=0):
    """Create -o and prove it is writable before anything is trained; no file is left behind."""
    blocker = _not_a_directory(path)
    if blocker is not None:
        what = "a file" if os.path.isfile(blocker) else "not a directory"
        where = (f"output path {path} is {what}" if blocker == os.path.normpath(path)
                 else f"output path {path}: {blocker} is {what}")
        raise LlmctlError(f"{where}, and -o must be a directory",
                          hint="-o names the directory main.log, metrics.jsonl and checkpoints go "
                               "into: pass a new or existing directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise LlmctlError(f"cannot create output directory {path}: {e.strerror or e}",
                          hint="choose a writable -o") from None
    if not os.path.isdir(path):
        raise LlmctlError(f"output path {path} exists and is not a directory",
                          hint="choose another -o")
    probe = os.path.join(path, f".llmctl-write-test-{os.getpid()}-{rank}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise LlmctlError(f"output directory {path} is not writable: {e.strerror or e}",
                          hint="choose a writable -o") from None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or a pid the kernel refuses: leave it
        return True
    return True


class Checkpoints:
    """One rank's view of the checkpoints in `output_dir` (None: no -o, nothing is saved).

    `written` holds the steps this run wrote (not the one it resumed from), `last` the newest
    model path this run wrote or None."""

    def __init__(self, output_dir, comm):
        self.out = output_dir
        self.comm = comm
        self.rank = comm.rank
        self.is_master = comm.rank == 0
        self.written = set()
        self.last = None

    def paths(self, step):
        return checkpoint_paths(self.out, step, self.rank)

    def newest(self):
        return find_max_step(self.out)

    def claim(self, resume, overwrite=False):
        """Before anything is written: refuse -y 0 over an earlier run (its checkpoints or its
        logs) unless overwrite, then create -o, check that it is writable and, with overwrite,
        delete the earlier run's checkpoints (its logs are replaced when the run opens them)."""
        if not self.out:
            return
        k = find_max_step(self.out)
        if resume == 0 and not overwrite and k >= 0:
            raise ConfigError(f"output directory {self.out} already holds checkpoints of an "
                              f"earlier run (DONE_{k:08d}); -y 0 would mix the two runs' "
                              "checkpoints (llm.c overwrites silently)",
                              hint="pass -y 1 to resume from them, --overwrite to delete them and "
                                   "start over there, or use a new or empty -o")
        # rank 0 writes the logs (checked there only: another rank could see this run's own)
        logs = [n for n in RUN_LOGS if self.is_master and os.path.isfile(os.path.join(self.out, n))]
        if resume == 0 and not overwrite and logs:
            raise ConfigError(f"output directory {self.out} already holds {' and '.join(logs)} of "
                              "an earlier run, which -y 0 would overwrite",
                              hint="pass -y 1 to resume that run, --overwrite to replace it, or "
                                   "use a new or empty -o")
        prepare_output_dir(self.out, self.rank)
        self.sweep_dead_temps()
        if overwrite:
            self.delete_earlier_run()

    def sweep_dead_temps(self):
        """Remove the temp files (llmctl/atomic.py's .NAME.tmp-PID) of this rank's checkpoint
        files whose writer is dead: a rank killed (SIGKILL, OOM) in the middle of a write leaves
        one behind; nothing reads it, and its name is this rank's own (rank 0: the model and
        DONE_, every rank: its state files), so no other live writer can own it. A pid alive
        on this host is left alone, whoever it is."""
        own = rf"state_\d{{8}}_{self.rank:05d}(?:\.bin|\.outlier\.json)"
        if self.is_master:
            own = rf"(?:{own}|model_\d{{8}}\.bin|DONE_\d{{8}})"
        for name in os.listdir(self.out):
            m = re.fullmatch(rf"\.{own}\.tmp-(\d+)", name)
            if m and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.out, name))

    def delete_earlier_run(self):
        """--overwrite: every checkpoint file in -o (rank 0: all of them, every rank's state
        files too; other ranks: their own state files, for an -o that is not shared), each
        DONE_ first, so an interrupted deletion never leaves a complete-looking checkpoint."""
        names = sorted(os.listdir(self.out), key=lambda n: not n.startswith("DONE_"))
        own = f"_{self.rank:05d}"
        for name in names:
            m = re.fullmatch(r"(?:DONE_\d{8}|model_\d{8}\.bin|state_\d{8}(_\d{5})(?:\.bin|\.outlier\.json))",
                             name)
            if m and (self.is_master or m.group(1) == own):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.out, name))

    def last_good_text(self):
        """Names the newest complete checkpoint in -o (what -y 1 would resume from)."""
        if not self.out:
            return "no -o, nothing saved"
        k = find_max_step(self.out)
        if k < 0:
            return "no complete checkpoint exists"
        return f"last good checkpoint: {checkpoint_paths(self.out, k)[0]}"

    # -- save / resume ---------------------------------------------------------------------------

    def write(self, step, model, loader_state, detectors=None, zero=None):
        """model (rank 0), state (every rank), detectors, barrier, DONE (rank 0): llm.c
        write_checkpoint. loader_state: DataLoader.state(); detectors: (loss, grad norm)
        OutlierDetectors or None; zero: -z 1's Zero1, whose m/v shard the state file holds
        (llm.c: shard_num_parameters floats each). -> the model path."""
        from llmctl.formats import StateFile, write_state_file

        model_path, state_path, done_path = self.paths(step)
        if self.is_master:
            try:
                model.save_checkpoint(model_path)
            except OSError as e:
                raise os_error(model_path, e) from None
        n, ld = model.num_parameters, loader_state
        if zero is not None:
            m, v = zero.state()
        else:
            m = model.m if model.m is not None else np.zeros(n, np.float32)
            v = model.v if model.v is not None else np.zeros(n, np.float32)
        P = self.comm.world_size
        st = StateFile(num_processes=P, process_rank=self.rank, use_master_weights=False,
                       should_shuffle=ld["should_shuffle"], step=step,
                       rng_state=13371337 + self.rank, rng_state_last_update=13371337 + self.rank,
                       current_shard_idx=ld["current_shard_idx"],
                       current_sample_idx=ld["current_sample_idx"], m=m, v=v,
                       shard_indices=ld["shard_indices"],
                       intra_shard_indices=ld["intra_shard_indices"], mt_state=ld["rng_state"])
        try:
            write_state_file(state_path, st)
        except OSError as e:
            raise os_error(state_path, e) from None
        if detectors is not None:
            d = {"step": step, "loss": detectors[0].state_dict(),
                 "grad_norm": detectors[1].state_dict()}
            atomic_write(outlier_state_path(self.out, step, self.rank), json.dumps(d) + "\n",
                         hint=OUTPUT_HINT)
        self.comm.barrier()
        if self.is_master:
            atomic_write(done_path, b"", hint=OUTPUT_HINT)
        self.last = model_path
        self.written.add(step)
        return model_path

    def damaged(self, err, step):
        """A FormatError for a file of checkpoint `step` read by -y 1, hinting the way out."""
        return FormatError(err.message, hint=f"delete {self.paths(step)[2]} to resume from the "
                                             "checkpoint before it (or start over with -y 0)")

    def load(self, step, model, loader, detectors=None, restore_loader=True, zero=None):
        """Resume from checkpoint `step` (its model was loaded as -e): this rank's state file
        into model.m/v (and fp32 master weights), the loader's position and shuffle state
        (unless restore_loader is False: -a 1 never reads it again) and, given detectors, their
        windows. -> (step, notes: messages for the user)."""
        from llmctl.formats import read_state_file

        path = self.paths(step)[1]
        P = self.comm.world_size
        if not os.path.isfile(path):
            raise FormatError(f"{path}: missing (DONE_{step:08d} exists but this rank's state "
                              "file does not)", hint="resume with the same number of processes, "
                              "or delete the incomplete checkpoint")
        N = model.num_parameters
        want = zero.shard_size if zero is not None else N
        try:
            st = read_state_file(path, num_parameters=want)
        except FormatError as e:
            self._check_layout(path, N, want, zero is not None)
            raise self.damaged(e, step) from None
        if st.step != step:
            raise FormatError(f"{path}: says step {st.step} but belongs to checkpoint {step}",
                              hint="the checkpoint directory is inconsistent; delete DONE_"
                                   f"{step:08d} to resume from an earlier one")
        if st.num_processes != P or st.process_rank != self.rank:
            raise ConfigError(f"{path}: written by rank {st.process_rank} of {st.num_processes} "
                              f"processes, but this is rank {self.rank} of {P}",
                              hint="resume with the same number of processes")
        if zero is not None:
            zero.load_state(st.m, st.v)
        else:
            model.m = np.array(st.m, dtype=np.float32)
            model.v = np.array(st.v, dtype=np.float32)
        if st.use_master_weights and st.master is not None:
            # llm.c (bf16 builds) keeps fp32 master weights: those are the real parameters
            model.params[:] = np.asarray(st.master, dtype=np.float32)
            model.params_changed()   # a bf16 model re-casts its matmul copy
        if not restore_loader:
            pass
        elif st.should_shuffle != (loader.sampler == "llmc"):
            # a train loader is llm.c's shuffled one or the window sampler, whose state is unshuffled
            written = "llmc" if st.should_shuffle else "windows"
            raise ConfigError(f"{path}: written by a run with --sampler {written}, but this run "
                              f"uses --sampler {loader.sampler}",
                              hint=f"resume with --sampler {written}, or start over with -y 0 "
                                   "or a new -o")
        elif st.should_shuffle:
            loader.load_state(st.shard_indices, st.intra_shard_indices, st.mt_state,
                              st.current_shard_idx, st.current_sample_idx, source=path)
        else:
            loader.should_shuffle = False
            loader.resume(st.current_shard_idx, st.current_sample_idx)
        notes = []
        if detectors is not None:
            notes += self._load_detectors(step, detectors)
        return int(st.step), notes

    def _check_layout(self, path, N, want, zero1):
        """The state file did not hold `want` floats of m and v: when it is a whole state file
        of another world size or zero stage, say so (ConfigError) instead of calling it damaged."""
        from llmctl.formats import read_state_file

        try:
            st = read_state_file(path)
        except FormatError:
            return   # really damaged
        P, got = self.comm.world_size, st.m.shape[0]
        if st.num_processes != P:
            raise ConfigError(f"{path}: written by {st.num_processes} processes, but this run "
                              f"has {P}", hint="resume with the same number of processes (and "
                                               "the same -z)")
        stage = 0 if got == N else 1 if got * st.num_processes == N else None
        if stage is not None:
            raise ConfigError(f"{path}: holds the AdamW state of {got} parameters, a -z {stage} "
                              f"checkpoint, but this run has -z {1 if zero1 else 0} ({want} per "
                              "rank)", hint=f"resume with -z {stage}")

    def _load_detectors(self, step, detectors):
        path = outlier_state_path(self.out, step, self.rank)
        if not os.path.isfile(path):
            return [f"note: {os.path.basename(path)} is absent (checkpoint written without "
                    "-sl/-sg or by llm.c): the outlier windows start empty, as llm.c's do on "
                    "resume"]
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("step") != step:
                raise ValueError(f"says step {d.get('step')}")
            detectors[0].load_state_dict(d["loss"])
            detectors[1].load_state_dict(d["grad_norm"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{path}: corrupt outlier-detector state ({e})",
                              hint=f"delete it to resume with empty windows (as llm.c), or "
                                   f"delete DONE_{step:08d} to resume from an earlier checkpoint"
                              ) from None
        return []

    # -- rotation / clean-up ---------------------------------------------------------------------

    def rotate(self, step, every, keep, major):
        """-nk after the regular checkpoint at `step`: llm.c deletes step - nk*n unless it is
        major (-nm). Off-grid checkpoints (Ctrl-C) older than the oldest kept regular one go
        too, under the same -nm rule (llm.c never deletes them)."""
        n, nk, nm = every, keep, major
        if nk <= 0:
            return
        oldest_kept = step - (nk - 1) * n
        doomed = set()
        if step - nk * n > 0:
            doomed.add(step - nk * n)
        for name in os.listdir(self.out):
            m = re.fullmatch(r"(?:DONE|model|state)_(\d{8})(?:_\d{5})?(?:\.bin|\.outlier\.json)?",
                             name)
            if m:
                k = int(m.group(1))
                if 0 < k < oldest_kept and k % n != 0:
                    doomed.add(k)
        for k in sorted(doomed):
            if nm == 0 or k % nm != 0:
                self.delete(k)

    def delete(self, step):
        model_path, state_path, done_path = self.paths(step)
        # DONE first: a half-deleted checkpoint must never look complete
        for p in (((done_path, model_path) if self.is_master else ())
                  + (state_path, outlier_state_path(self.out, step, self.rank))):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)

    def discard(self, step):
        """NaN clean-up: checkpoint `step` holds the weights that just produced a NaN loss or
        gradient, so it is not good. Deletes it if this run wrote it; a collective."""
        if not self.out or step not in self.written:
            return
        self.delete(step)
        self.written.discard(step)
        self.comm.barrier()  # every rank's files are gone before rank 0 names one
        if self.last == self.paths(step)[0]:
            self.last = None
