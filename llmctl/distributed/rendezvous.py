"""Across-host rendezvous: who the nodes are, the shared secret, and the address-table exchange.

issue 6.

What it is:
- `resolve_node(...)`: the launcher form `llmctl train --nnodes K --node-rank R --nproc N
  --master-addr A --master-port P [--bind-addr H]`. Explicit flags win over the environment;
  then NNODES/NODE_RANK (or torchrun's GROUP_RANK), then Slurm (SLURM_NNODES/SLURM_NODEID,
  only inside an `srun` step with one task per node). Per-rank identity (RANK, WORLD_SIZE, ...
  OMPI_*, PMI_*, SLURM_PROCID) stays in llmctl/distributed/env.py's `resolve_env`.
- `choose_backend(...)`: `--transport auto` = mpi under mpiexec (when mpi4py is installed), shm on
  one host, ring across hosts.
- `resolve_secret()`: the job secret every host must share (LLMCTL_SECRET or LLMCTL_SECRET_FILE;
  never a command-line flag, so it does not show in `ps`).
- `rendezvous(...)`: a one-shot, torchrun-style TCP store. Global rank 0 listens on
  MASTER_ADDR:MASTER_PORT; every other rank connects (retrying until the deadline), proves it
  holds the secret (mutual HMAC-SHA256, the same construction as llmctl/distributed/control.py's, with
  a different magic and tag so the two protocols cannot be confused), sends one JOIN record
  (its ring listener's address and port, node, host name), and gets back the table of all ranks.
  Then every socket is closed: nothing stays listening on the master port.
- `auth_client` / `auth_server`: that handshake, also used by the ring's data connections.

What it is not: no data plane (ring.py) and no process spawning (launcher.py). It mirrors
llm.c's `-pi tcp` NCCL-id exchange (multi_gpu_config_init) and torchrun's c10d rendezvous.
"""
import hashlib
import hmac
import ipaddress
import json
import math
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

from llmctl.distributed.control import MAC, NONCE, ProtocolError, auth_mac, recv_exact
from llmctl.distributed.env import parse_int
from llmctl.errors import ConfigError, DistError

DEFAULT_PORT = 29500  # torchrun's default MASTER_PORT
HANDSHAKE_TIMEOUT = 5.0
MIN_SECRET_CHARS = 16


def check_seconds(flag, value):
    """`value` as a float number of seconds, or ConfigError unless it is finite and > 0.

    NaN slips through a plain `<= 0` test (every comparison with NaN is false) and then makes
    deadlines that never pass or select() calls that raise, so test finiteness explicitly."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{flag} {value} must be a finite number of seconds > 0", hint=f"e.g. {flag} 30")
    return v


# ---------------------------------------------------------------------------------------------
# node-level settings

@dataclass(frozen=True)
class NodeEnv:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    bind_addr: str = "127.0.0.1"
    source: str = "default"


def _is_ip(addr):
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return False


def local_addr_for(remote):
    """The address of this host's interface that routes to `remote` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(remote, 9, type=socket.SOCK_DGRAM)
        fam, _, _, _, sa = infos[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(sa)  # UDP connect only picks a route
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"cannot find a local address that reaches the master {remote}: "
                          f"{e.strerror or e}", hint="pass --bind-addr explicitly") from None


def resolve_addr(host):
    """A host name or IP -> an IP string (IPv4 preferred)."""
    if _is_ip(host):
        return host
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot resolve host {host!r}: {e.strerror or e}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0]


def resolve_node(nnodes=None, node_rank=None, master_addr=None, master_port=None, bind_addr=None,
                 environ=None):
    """Flags > NNODES/NODE_RANK/GROUP_RANK > Slurm (one task per node) > a single node."""
    env = os.environ if environ is None else environ
    source = "default"
    e_nn = e_nr = None
    if "NNODES" in env:
        e_nn, source = ("NNODES", env["NNODES"]), "env"
    for var in ("NODE_RANK", "GROUP_RANK"):
        if var in env:
            e_nr, source = (var, env[var]), "env"
            break
    # SLURM_NNODES is also set in a plain salloc shell; only trust it inside an srun step that
    # runs one task (one launcher) per node
    if (e_nn is None and "SLURM_PROCID" in env and "SLURM_NNODES" in env
            and env.get("SLURM_NTASKS") == env.get("SLURM_NNODES")):
        e_nn, source = ("SLURM_NNODES", env["SLURM_NNODES"]), "slurm"
        if e_nr is None and "SLURM_NODEID" in env:
            e_nr = ("SLURM_NODEID", env["SLURM_NODEID"])
    nn = parse_int("--nnodes", nnodes, 1) if nnodes is not None else (parse_int(*e_nn, 1) if e_nn else 1)
    nr = parse_int("--node-rank", node_rank) if node_rank is not None else (parse_int(*e_nr) if e_nr else 0)
    if nnodes is not None or node_rank is not None:
        source = "flags"
    if nr >= nn:
        raise ConfigError(f"node rank {nr} is not below the number of nodes {nn}",
                          hint="--node-rank counts from 0 to --nnodes - 1")
    addr = master_addr if master_addr else env.get("MASTER_ADDR", "127.0.0.1")
    port = master_port if master_port else env.get("MASTER_PORT", DEFAULT_PORT)
    port = parse_int("MASTER_PORT", port, 1)
    if port > 65535:
        raise ConfigError(f"master port {port} is not a TCP port (1..65535)")
    bind = bind_addr or env.get("LLMCTL_BIND_ADDR")
    if not bind:
        bind = resolve_addr(addr) if nr == 0 else local_addr_for(addr)
    if not _is_ip(bind):
        bind = resolve_addr(bind)
    return NodeEnv(nn, nr, str(addr), port, bind, source)


def under_mpiexec(environ=None):
    env = os.environ if environ is None else environ
    return any(v in env for v in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE"))


def choose_backend(backend, nnodes=1, environ=None):
    """auto -> mpi under mpiexec, shm on one host, ring across hosts; others are validated."""
    if backend not in ("auto", "shm", "ring", "mpi"):
        raise ConfigError(f"--transport {backend!r} is not one of auto, shm, ring, mpi")
    if backend != "auto":
        if backend == "shm" and nnodes > 1:
            raise ConfigError("--transport shm works on one host only, but --nnodes is "
                              f"{nnodes}", hint="use --transport ring (or auto) across hosts")
        return backend
    if under_mpiexec(environ) and _have_mpi4py():
        return "mpi"  # (srun also sets PMI/PMIX variables: without mpi4py, auto keeps the ring)
    return "ring" if nnodes > 1 else "shm"


# what a rank whose peers did not all join can check (rank 0 and the ranks it tells alike)
JOIN_HINT = "start every node with the same --nnodes/--nproc, --master-addr/--master-port and LLMCTL_SECRET"


def _have_mpi4py():
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def resolve_secret(environ=None, required=True):
    """The shared job secret as 32 key bytes: sha256 of LLMCTL_SECRET or of LLMCTL_SECRET_FILE's text."""
    env = os.environ if environ is None else environ
    text = env.get("LLMCTL_SECRET")
    where = "LLMCTL_SECRET"
    if not text and env.get("LLMCTL_SECRET_FILE"):
        path = env["LLMCTL_SECRET_FILE"]
        where = path
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the secret file {path}: {e.strerror}") from None
    hint = ("run `export LLMCTL_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')` "
            "and pass the same value to every node (or LLMCTL_SECRET_FILE=path on a shared disk)")
    if not text:
        if not required:
            return None
        raise ConfigError("training across hosts needs a shared secret, but neither LLMCTL_SECRET "
                          "nor LLMCTL_SECRET_FILE is set", hint=hint)
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(f"the secret in {where} has {len(text)} characters; at least "
                          f"{MIN_SECRET_CHARS} are required", hint=hint)
    return hashlib.sha256(b"llmctl-job-secret\0" + text.encode()).digest()


# ---------------------------------------------------------------------------------------------
# mutual HMAC handshake (control.py's construction; different magic + a per-use tag)
#   server -> client : magic(8) | nonce_s(32)
#   client -> server : magic(8) | ident(16) | nonce_c(32) | HMAC(secret, tag|"c"|nonce_s|nonce_c|ident)
#   server -> client : HMAC(secret, tag|"s"|nonce_c|nonce_s|ident)
# ident = (rank u32, peer-rank u32, world u32, spare u32); the server checks it is expected.

MAGIC = b"LLMRDV\x00\x01"
_IDENT = struct.Struct(">IIII")
_HELLO_C = len(MAGIC) + _IDENT.size + NONCE + MAC


def auth_client(sock, secret, tag, rank, peer, world, who):
    """Prove to the server that we hold the secret and check it does too. who: for messages."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    ident = _IDENT.pack(rank, peer, world, 0)
    try:
        hello = recv_exact(sock, len(MAGIC) + NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise DistError(f"rank {rank}: {who} is not an llmctl rendezvous/ring endpoint "
                            "(wrong greeting)")
        nonce_s = hello[len(MAGIC):]
        nonce_c = os.urandom(NONCE)
        sock.sendall(MAGIC + ident + nonce_c + auth_mac(secret, tag, b"c", nonce_s, nonce_c, ident))
        proof = recv_exact(sock, MAC)
    except (OSError, ConnectionError) as e:
        raise DistError(f"rank {rank}: {who} rejected this rank's credentials or went away "
                        f"during the handshake ({e})",
                        hint="every node must use the same LLMCTL_SECRET") from None
    if not hmac_eq(proof, auth_mac(secret, tag, b"s", nonce_c, nonce_s, ident)):
        raise DistError(f"rank {rank}: {who} failed to prove it knows the job secret",
                        hint="every node must use the same LLMCTL_SECRET")


def auth_server(sock, secret, tag):
    """Run the server side; returns (rank, peer, world) the client proved, or raises ProtocolError."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    nonce_s = os.urandom(NONCE)
    try:
        sock.sendall(MAGIC + nonce_s)
        hello = recv_exact(sock, _HELLO_C)
    except socket.timeout:
        raise ProtocolError("sent nothing valid within the handshake timeout") from None
    except (OSError, ConnectionError):
        raise ProtocolError("closed before authenticating") from None
    if hello[:len(MAGIC)] != MAGIC:
        raise ProtocolError("not an llmctl peer (bad greeting)")
    ident = hello[8:8 + _IDENT.size]
    nonce_c = hello[8 + _IDENT.size:8 + _IDENT.size + NONCE]
    mac = hello[8 + _IDENT.size + NONCE:]
    if not hmac_eq(mac, auth_mac(secret, tag, b"c", nonce_s, nonce_c, ident)):
        raise ProtocolError("wrong job secret (HMAC mismatch)")
    try:
        sock.sendall(auth_mac(secret, tag, b"s", nonce_c, nonce_s, ident))
    except OSError:
        raise ProtocolError("closed during the handshake") from None
    rank, peer, world, _ = _IDENT.unpack(ident)
    return rank, peer, world


def hmac_eq(a, b):
    return hmac.compare_digest(a, b)


# ---------------------------------------------------------------------------------------------
# framed JSON messages with a strict schema (after authentication only)

_MAX_MSG = 1 << 20


def send_msg(sock, msg):
    body = json.dumps(msg, separators=(",", ":"), ensure_ascii=True).encode()
    if len(body) > _MAX_MSG:
        raise DistError(f"rendezvous message of {len(body)} bytes is too large")
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_msg(sock, deadline):
    hdr = _recv_until(sock, 4, deadline)
    (n,) = struct.unpack(">I", hdr)
    if n > _MAX_MSG:
        raise ProtocolError(f"frame length {n} exceeds {_MAX_MSG}")
    body = _recv_until(sock, n, deadline)
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"not UTF-8 JSON ({e.__class__.__name__})") from None


def _reject(name):
    raise ProtocolError(f"non-finite number {name}")


def _recv_until(sock, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


_REC_FIELDS = {"rank": int, "node": int, "ring": int, "addr": str, "port": int, "host": str}


def check_record(rec, world):
    """A JOIN record / table row: exactly these fields and types, sane values."""
    if not isinstance(rec, dict) or set(rec) != set(_REC_FIELDS):
        raise ProtocolError(f"record has fields {sorted(rec)[:8] if isinstance(rec, dict) else rec!r}"
                            f", expected {sorted(_REC_FIELDS)}")
    for k, t in _REC_FIELDS.items():
        v = rec[k]
        if not isinstance(v, t) or isinstance(v, bool):
            raise ProtocolError(f"field {k!r} has the wrong type")
        if t is str and len(v) > 255:
            raise ProtocolError(f"field {k!r} is too long")
    if not (0 <= rec["rank"] < world and 0 <= rec["node"] < 1 << 20 and 0 <= rec["ring"] < 1 << 20):
        raise ProtocolError("rank/node/ring out of range")
    if not 1 <= rec["port"] <= 65535 or not _is_ip(rec["addr"]):
        raise ProtocolError(f"bad address {rec['addr'][:64]!r}:{rec['port']}")
    return rec


# ---------------------------------------------------------------------------------------------
# the exchange

def host_port(addr, port):
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def bind_listener(addr, port=0, what="ring"):
    """A blocking listening socket on exactly `addr` (a name is resolved first), any interface."""
    from llmctl.distributed import control

    if not _is_ip(addr):
        addr = resolve_addr(addr)
    return control.bind_listener(addr, port, allow_remote=True, what=what, blocking=True)


def rendezvous(rank, world, master_addr, master_port, secret, record, timeout, log=None):
    """All-gather one record per rank through rank 0; returns the list of records by rank.

    rank 0 serves on master_addr:master_port (bound to exactly that address) until every rank
    joined or `timeout` s passed; the others retry connecting until then. Rank 0 calls
    `log(msg)` for each peer it refuses (wrong secret, wrong world size, garbage), as it happens,
    naming its address and the reason. On failure every rank that joined is told why, and all
    raise DistError naming the missing ranks and the refused peers.
    """
    timeout = check_seconds("--rdzv-timeout", timeout)
    record = dict(record, rank=rank)
    check_record(record, world)
    if world == 1:
        return [record]
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _serve(world, master_addr, master_port, secret, record, deadline, timeout, log)
    return _join(rank, world, master_addr, master_port, secret, record, deadline, timeout)


def _join(rank, world, addr, port, secret, record, deadline, timeout):
    where = f"the rendezvous at {host_port(addr, port)}"
    last = None
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=HANDSHAKE_TIMEOUT)
            break
        except OSError as e:
            last = e
            if time.monotonic() > deadline:
                raise DistError(f"rank {rank}: cannot reach {where} within {timeout:.0f} s: "
                                f"{last.strerror or last}",
                                hint="start node 0 (which serves --master-addr/--master-port) and "
                                     "check that the address is reachable from this host") from None
            time.sleep(0.2)
    try:
        auth_client(s, secret, b"rdzv", rank, 0, world, where)
        send_msg(s, {"t": "join", "world": world, "rec": record})
        try:
            msg = recv_msg(s, deadline + 5.0)
        except socket.timeout:
            raise DistError(f"rank {rank}: no address table from {where} within {timeout:.0f} s") from None
        except (OSError, ConnectionError) as e:
            raise DistError(f"rank {rank}: {where} closed the connection ({e})") from None
        except ProtocolError as e:
            raise DistError(f"rank {rank}: malformed reply from {where}: {e}") from None
        if isinstance(msg, dict) and msg.get("t") == "fail" and isinstance(msg.get("msg"), str):
            raise DistError(f"rank {rank}: rendezvous failed: {msg['msg'][:2000]}", hint=JOIN_HINT)
        try:
            if not (isinstance(msg, dict) and set(msg) == {"t", "peers"} and msg["t"] == "table"
                    and isinstance(msg["peers"], list) and len(msg["peers"]) == world):
                raise ProtocolError("not an address table for this world size")
            peers = [check_record(p, world) for p in msg["peers"]]
            if [p["rank"] for p in peers] != list(range(world)) or peers[rank] != record:
                raise ProtocolError("table rows are out of order or do not contain this rank")
        except ProtocolError as e:
            raise DistError(f"rank {rank}: malformed address table from {where}: {e}") from None
        return peers
    finally:
        s.close()


def _serve(world, addr, port, secret, record, deadline, timeout, log):
    """Rank 0: accept every other rank's JOIN (each handshake on its own thread, so a stalled
    stranger cannot hold the others up), then send all of them the table; -> the table."""
    lis = bind_listener(addr, port, "rendezvous")
    lis.settimeout(0.2)
    joined = {}            # rank -> (sock, record)
    refused = []           # "host:port (why)", in arrival order
    events = queue.Queue()
    where = f"the rendezvous at {host_port(addr, port)}"
    try:
        while len(joined) < world - 1:
            if time.monotonic() > deadline:
                _fail_late(world, joined, refused, where, timeout)
            try:
                s, peer = lis.accept()
                threading.Thread(target=_handshake_joiner, args=(s, peer, secret, world, events),
                                 daemon=True).start()
            except socket.timeout:
                pass
            _take_joins(events, joined, refused, where, log)
        peers = [record] + [joined[r][1] for r in range(1, world)]
        for s, _ in joined.values():
            try:
                send_msg(s, {"t": "table", "peers": peers})
            except OSError as e:
                raise DistError(f"rank 0: lost a rank during {where}: {e}") from None
        return peers
    finally:
        lis.close()
        for s, _ in joined.values():
            s.close()
        # handshake threads end within HANDSHAKE_TIMEOUT on their own; close what they left
        while True:
            try:
                _, s, _, _ = events.get_nowait()
            except queue.Empty:
                break
            if all(s is not js for js, _ in joined.values()):
                s.close()


def _handshake_joiner(s, peer, secret, world, events):
    """One peer's authentication and JOIN, on its own thread; -> ("ok", s, peer, record) or
    ("bad", s, peer, why) on `events`."""
    try:
        r, _, w = auth_server(s, secret, b"rdzv")
        if w != world:
            raise ProtocolError(f"rank {r} was started with world size {w}, not {world}")
        msg = recv_msg(s, time.monotonic() + HANDSHAKE_TIMEOUT)
        if not (isinstance(msg, dict) and set(msg) == {"t", "world", "rec"} and msg["t"] == "join"
                and msg["world"] == world):
            raise ProtocolError("not a JOIN message for this world")
        rec = check_record(msg["rec"], world)
        if rec["rank"] != r:
            raise ProtocolError(f"authenticated as rank {r} but joins as {rec['rank']}")
        events.put(("ok", s, peer, rec))
    except Exception as e:  # anything a stranger can provoke (bad JSON nesting too) -> rejected
        events.put(("bad", s, peer, str(e)[:200] or e.__class__.__name__))


def _take_joins(events, joined, refused, where, log):
    """Move the finished handshakes into `joined`, or close and note them in `refused`."""
    while True:
        try:
            kind, s, peer, x = events.get_nowait()
        except queue.Empty:
            return
        who = host_port(peer[0], peer[1])
        why = x if kind == "bad" else None
        if kind == "ok" and (x["rank"] in joined or x["rank"] == 0):
            why = f"a second JOIN for rank {x['rank']}"
        if why is None:
            joined[x["rank"]] = (s, x)
            continue
        refused.append(f"{who} ({why})")
        if log:
            log(f"rank 0: refused a peer at {where} from {who}: {why}")
        s.close()


def _fail_late(world, joined, refused, where, timeout):
    """The deadline passed: tell the ranks that joined, raise naming the missing and the refused."""
    missing = [r for r in range(1, world) if r not in joined]
    msg = f"ranks {missing} did not join {where} within {timeout:.0f} s"
    if refused:
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        msg += f"; refused {len(refused)} peer(s): {'; '.join(refused[:8])}{more}"
    for s, _ in joined.values():
        try:
            send_msg(s, {"t": "fail", "msg": msg})
        except OSError:
            pass
    raise DistError(f"rank 0: {msg}", hint=JOIN_HINT)
