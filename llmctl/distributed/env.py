"""Who am I in the job: rank / world size / local rank / master address from flags or environment.

What it is: one function, `resolve_env`, that turns explicit values (flags) and the process
environment into a validated `DistEnv`. Precedence: explicit argument > torchrun variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) > MPI launcher
variables (Open MPI OMPI_COMM_WORLD_*, MPICH/Hydra PMI_*) > Slurm (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_NTASKS_PER_NODE) > the world of one. Also `threads_per_rank`, the core split.

What it is not: it starts and connects nothing. It mirrors what llm.c's `-pn/-pr/-pg` flags and
multi_gpu_config_init read from OMPI/Slurm, in torchrun's vocabulary.
"""
import os
from dataclasses import dataclass

from llmctl.errors import ConfigError
from llmctl.info import usable_cores


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "default"   # where rank/world came from: flags, torchrun, openmpi, mpich, slurm, default


_SOURCES = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]


def _fix_hint(name, lo):
    if name.startswith("-"):
        return f"pass {name} an integer >= {lo}"
    return f"set {name} to an integer >= {lo}, or unset it"


def parse_int(name, value, lo=0):
    """An integer >= lo from a flag or environment variable `name`; ConfigError naming it.
    Slurm's compressed counts read as their first value: SLURM_NTASKS_PER_NODE="2(x3)" is 2
    (two tasks on each of three nodes)."""
    try:
        v = int(str(value).strip().split("(")[0])
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer", hint=_fix_hint(name, lo)) from None
    if v < lo:
        raise ConfigError(f"{name}={v} must be >= {lo}", hint=_fix_hint(name, lo))
    return v


def resolve_env(rank=None, world_size=None, local_rank=None, local_world_size=None,
                master_addr=None, master_port=None, environ=None):
    """Explicit values win; otherwise the first launcher whose rank and size variables are both set."""
    env = os.environ if environ is None else environ
    source = "default"
    found = {}
    for name, vr, vw, vlr, vlw in _SOURCES:
        if vr in env and vw in env:
            source = name
            found = {"rank": (vr, env[vr]), "world_size": (vw, env[vw])}
            if vlr in env:
                found["local_rank"] = (vlr, env[vlr])
            if vlw in env:
                found["local_world_size"] = (vlw, env[vlw])
            break

    def pick(key, explicit, default, lo=0):
        if explicit is not None:
            return parse_int(f"--{key.replace('_', '-')}", explicit, lo)
        if key in found:
            return parse_int(*found[key], lo)
        return default

    if rank is not None or world_size is not None:
        source = "flags"
    w = pick("world_size", world_size, 1, lo=1)
    r = pick("rank", rank, 0)
    if r >= w:
        raise ConfigError(f"rank {r} is not below the world size {w}")
    lw = pick("local_world_size", local_world_size, w, lo=1)
    lr = pick("local_rank", local_rank, r % lw if lw else 0)
    if lr >= lw:
        raise ConfigError(f"local rank {lr} is not below the local world size {lw}")
    addr = master_addr if master_addr is not None else env.get("MASTER_ADDR", "127.0.0.1")
    port = master_port if master_port is not None else env.get("MASTER_PORT", 0)
    port = parse_int("MASTER_PORT", port)
    if port > 65535:
        raise ConfigError(f"master port {port} is not a TCP port (0..65535)")
    return DistEnv(r, w, lr, lw, str(addr), port, source)


def threads_per_rank(nproc, threads=None):
    """Kernel threads each of `nproc` local ranks uses: `threads` if given, else cores // nproc."""
    if threads is not None:
        if int(threads) < 1:
            raise ConfigError(f"--threads {threads} must be >= 1", hint="or leave --threads out for cores / --nproc")
        return int(threads)
    return max(1, usable_cores() // max(1, nproc))
