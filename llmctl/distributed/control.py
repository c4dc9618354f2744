"""The authenticated control channel between the ranks of one job and its hub (the launcher).

What it is: everything that is *not* gradient bytes travels here -- rendezvous, collective
arrival/release ("gradient ready" is the arrival at an all-reduce), heartbeats, stop requests,
errors and aborts. Transport is TCP on a loopback address. Every connection first proves it
belongs to the job with a mutual HMAC-SHA256 challenge over a per-job 32-byte random secret
(handed to the workers in their environment, never on a command line); only then is anything it
sends parsed. After the handshake, messages are length-prefixed (4-byte big-endian) UTF-8 JSON
objects, at most MAX_MSG bytes, checked against a strict schema (known type, exactly the known
fields, right JSON types). Nothing received is ever unpickled, evaluated or used as a path.

What it is not: no data plane (gradients go through shared memory, llmctl/distributed/shm.py) and no
process management (llmctl/jobs/launcher.py). It plays the part of llm.c's NCCL-id exchange over
a socket (`-pi tcp`) plus NCCL's own error propagation.

Handshake (fixed-size binary, so unauthenticated bytes are never parsed as JSON):
  hub    -> client : MAGIC(8) | nonce_h(32)
  client -> hub    : MAGIC(8) | rank(u32 BE) | nonce_c(32) | HMAC(secret, "client"|nonce_h|nonce_c|rank)
  hub    -> client : HMAC(secret, "hub"|nonce_c|nonce_h|rank)   (the client checks the hub, too)
"""
import errno
import hashlib
import hmac
import json
import os
import select
import selectors
import socket
import struct
import threading
import time

from llmctl.errors import DistError

MAGIC = b"LLMCTL\x00\x01"
NONCE = 32
MAC = 32
HELLO_HUB = len(MAGIC) + NONCE                  # 40 bytes
HELLO_CLIENT = len(MAGIC) + 4 + NONCE + MAC     # 76 bytes
MAX_MSG = 64 * 1024
HANDSHAKE_TIMEOUT = 5.0

# message type -> {field: allowed python types}; every listed field is required, no others allowed
_INT = (int,)
_STR = (str,)
SCHEMA = {
    # worker -> hub
    "coll": {"t": _STR, "seq": _INT, "op": _STR, "n": _INT, "digest": _STR, "step": _INT},
    "hb": {"t": _STR, "step": _INT},
    "error": {"t": _STR, "msg": _STR, "hint": _STR, "step": _INT},
    "bye": {"t": _STR, "step": _INT},
    # hub -> worker
    "go": {"t": _STR, "seq": _INT, "stop": (bool,)},
    "abort": {"t": _STR, "msg": _STR},
}
TO_HUB = frozenset({"coll", "hb", "error", "bye"})
TO_WORKER = frozenset({"go", "abort"})


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid message of this protocol."""


# ---------------------------------------------------------------------------------------------
# framing and schema

def encode(msg):
    check_message(msg, TO_HUB | TO_WORKER)
    body = json.dumps(msg, separators=(",", ":"), ensure_ascii=True).encode()
    if len(body) > MAX_MSG:
        raise ValueError(f"control message of {len(body)} bytes exceeds {MAX_MSG}")
    return struct.pack(">I", len(body)) + body


def _reject_constant(name):
    raise ProtocolError(f"non-finite number {name} in message")


def decode(body, allowed):
    """bytes -> validated dict, or ProtocolError. `allowed` is the set of types this side accepts."""
    try:
        msg = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"not UTF-8 JSON ({e.__class__.__name__})") from None
    check_message(msg, allowed)
    return msg


def check_message(msg, allowed):
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a JSON object")
    t = msg.get("t")
    if not isinstance(t, str) or t not in allowed:
        raise ProtocolError(f"unexpected message type {str(t)[:32]!r}")
    spec = SCHEMA[t]
    if set(msg) != set(spec):
        raise ProtocolError(f"{t!r} message has fields {sorted(msg)[:8]}, expected {sorted(spec)}")
    for k, types in spec.items():
        _check_value(t, k, msg[k], types)


def _check_value(t, k, v, types):
    # bool is an int subclass: never accept it where an int is meant
    if not isinstance(v, types) or (types == _INT and isinstance(v, bool)):
        raise ProtocolError(f"field {k!r} of {t!r} has the wrong type")
    if types == _INT and not (-2**62 < v < 2**62):
        raise ProtocolError(f"field {k!r} of {t!r} is out of range")
    if types == _STR and len(v) > 4096:
        raise ProtocolError(f"field {k!r} of {t!r} is too long")


class FrameReader:
    """Accumulates bytes from a socket and yields complete frames (bodies)."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data):
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = struct.unpack(">I", self.buf[:4])
            if n > MAX_MSG:
                raise ProtocolError(f"frame length {n} exceeds {MAX_MSG}")
            if len(self.buf) < 4 + n:
                break
            out.append(bytes(self.buf[4:4 + n]))
            del self.buf[:4 + n]
        return out


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def auth_mac(secret, *parts):
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------
# client (one per worker rank)

class ControlClient:
    """A worker's blocking connection to the hub, with a heartbeat thread.

    The main thread sends requests and waits for replies (`recv`); the heartbeat thread only
    sends. Sends are serialised by a lock; receives happen only in the main thread. The socket
    stays in blocking mode; waits are bounded with select().
    """

    def __init__(self, addr, port, secret, rank, timeout, connect_timeout=30.0):
        self.rank = rank
        self.timeout = float(timeout)
        self.step = -1
        self._send_lock = threading.Lock()
        self._reader = FrameReader()
        self._pending = []
        self._closed = False
        self.sock = self._connect(addr, port, connect_timeout)
        try:
            self._handshake(secret)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._hb_stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, name="llmctl-heartbeat", daemon=True)
        self._hb.start()

    def _connect(self, addr, port, connect_timeout):
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                s = socket.create_connection((addr, port), timeout=HANDSHAKE_TIMEOUT)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            except OSError as e:
                if time.monotonic() > deadline:
                    raise DistError(f"rank {self.rank}: cannot connect to the control hub at "
                                    f"{addr}:{port}: {e.strerror or e}") from None
                time.sleep(0.2)

    def _handshake(self, secret):
        handshake_connect(self.sock, secret, self.rank)

    def send(self, msg):
        data = encode(msg)
        with self._send_lock:
            if self._closed:
                raise DistError(f"rank {self.rank}: control connection is closed")
            self.sock.sendall(data)

    def recv(self, timeout):
        """Next message from the hub (validated), or DistError on timeout/EOF/garbage."""
        if self._pending:
            return self._pending.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistError(f"rank {self.rank}: no reply from the control hub within {timeout:.0f} s")
            try:
                # select, not settimeout: the socket's timeout would also apply to the heartbeat
                # thread's concurrent sendall (and a timed-out sendall can leave half a frame)
                ready, _, _ = select.select([self.sock], [], [], left)
                if not ready:
                    continue
                data = self.sock.recv(65536)
            except OSError as e:
                raise DistError(f"rank {self.rank}: control connection failed: {e}") from None
            if not data:
                raise DistError(f"rank {self.rank}: the launcher closed the control connection")
            try:
                frames = self._reader.feed(data)
                self._pending.extend(decode(f, TO_WORKER) for f in frames)
            except ProtocolError as e:
                raise DistError(f"rank {self.rank}: malformed message from the control hub: {e}") from None
            if self._pending:
                return self._pending.pop(0)

    def _heartbeat(self):
        interval = max(0.05, min(2.0, self.timeout / 6))
        while not self._hb_stop.wait(interval):
            try:
                self.send({"t": "hb", "step": int(self.step)})
            except Exception:
                return

    def close(self, bye=True):
        if self._closed:
            return
        self._hb_stop.set()
        if bye:
            try:
                self.send({"t": "bye", "step": int(self.step)})
            except Exception:
                pass
        with self._send_lock:
            self._closed = True
            try:
                self.sock.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# hub (runs inside the launcher's single-threaded event loop)

class _Conn:
    __slots__ = ("sock", "reader", "rank", "nonce", "deadline", "peer")

    def __init__(self, sock, nonce, deadline, peer):
        self.sock = sock
        self.reader = FrameReader()
        self.rank = None
        self.nonce = nonce
        self.deadline = deadline
        self.peer = peer


class Hub:
    """The rendezvous and barrier server for `world_size` ranks.

    Not a thread: the owner calls `poll(timeout)` in its loop (it blocks in select, never spins)
    and reads `failure` (a message) when something went wrong. Collectives: each rank sends
    ("coll", seq, op, n, digest); when all ranks have sent the same seq with the same op and n
    (and the same digest, when one is given) the hub releases them all with ("go", seq, stop).
    """

    def __init__(self, sock, secret, world_size, timeout, collective_timeout, startup_timeout,
                 log, names=None):
        self.listen = sock
        self.secret = secret
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.startup_timeout = startup_timeout
        self.log = log
        self.names = names or {}  # rank -> "rank 1 (pid 123)"
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.conns = {}          # rank -> _Conn
        self.last_seen = {}      # rank -> monotonic time of its last message
        self.step = {}           # rank -> last step it reported
        self.finished = set()    # ranks that said bye
        self.errors = {}         # rank -> error message it reported
        self.lost = {}           # rank -> monotonic time its connection dropped without bye
        self.arrivals = {}       # seq -> {rank: (op, n, digest)}
        self.first_arrival = {}  # seq -> monotonic time
        self.next_seq = 0
        self.stop = False
        self.failure = None
        self.failed_rank = None  # set when the failure is a rank's own error report
        self.failed_hint = None  # ... and that report's hint
        self.started = time.monotonic()
        self.rejected = 0

    def name(self, rank):
        return self.names.get(rank, f"rank {rank}")

    def _fail(self, msg):
        if self.failure is None:
            self.failure = msg

    # -- I/O ------------------------------------------------------------------------------------
    def poll(self, timeout):
        """Wait up to `timeout` s for socket events (and any extra fds registered with data=cb)."""
        for key, _ in self.sel.select(timeout):
            if key.fileobj is self.listen:
                self._accept()
            elif callable(key.data):
                key.data()
            else:
                self._readable(key.data)
        self._check_timeouts()

    def _accept(self):
        try:
            s, peer = self.listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        s.settimeout(HANDSHAKE_TIMEOUT)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(NONCE)
        c = _Conn(s, nonce, time.monotonic() + HANDSHAKE_TIMEOUT, peer)
        try:
            s.sendall(MAGIC + nonce)
        except OSError:
            s.close()
            return
        self.sel.register(s, selectors.EVENT_READ, c)

    def _drop(self, c, why=None):
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        if why:
            self.rejected += 1
            self.log(f"rejected a control connection from {c.peer[0]}:{c.peer[1]}: {why}")

    def _readable(self, c):
        try:
            data = c.sock.recv(65536)
        except (socket.timeout, BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if c.rank is None:
            self._handshake_data(c, data)
            return
        if not data:
            self._drop(c)
            if c.rank not in self.finished:
                self.lost.setdefault(c.rank, time.monotonic())
            self.conns.pop(c.rank, None)
            return
        try:
            frames = c.reader.feed(data)
            msgs = [decode(f, TO_HUB) for f in frames]
        except ProtocolError as e:
            self.log(f"rejected a malformed control message from {self.name(c.rank)}: {e}")
            self._fail(f"{self.name(c.rank)} sent a malformed control message ({e})")
            return
        self.last_seen[c.rank] = time.monotonic()
        for m in msgs:
            self._handle(c.rank, m)

    def _handshake_data(self, c, data):
        if not data:
            self._drop(c, "closed before authenticating")
            return
        c.reader.buf += data
        if len(c.reader.buf) < HELLO_CLIENT:
            if not bytes(c.reader.buf[:len(MAGIC)]) == MAGIC[:min(len(MAGIC), len(c.reader.buf))]:
                self._drop(c, "not an llmctl client (bad greeting)")
            return
        hello = bytes(c.reader.buf[:HELLO_CLIENT])
        extra = bytes(c.reader.buf[HELLO_CLIENT:])
        c.reader.buf.clear()
        if hello[:len(MAGIC)] != MAGIC:
            self._drop(c, "not an llmctl client (bad greeting)")
            return
        rank_b = hello[8:12]
        nonce_c = hello[12:12 + NONCE]
        mac = hello[12 + NONCE:]
        if not hmac.compare_digest(mac, auth_mac(self.secret, b"client", c.nonce, nonce_c, rank_b)):
            self._drop(c, "wrong job secret (HMAC mismatch)")
            return
        (rank,) = struct.unpack(">I", rank_b)
        if rank >= self.world_size:
            self._drop(c, f"authenticated but claims rank {rank} of a world of {self.world_size}")
            return
        if rank in self.conns or rank in self.finished or rank in self.lost:
            self._drop(c, f"a second connection for rank {rank}")
            return
        try:
            c.sock.sendall(auth_mac(self.secret, b"hub", nonce_c, c.nonce, rank_b))
        except OSError:
            self._drop(c)
            return
        c.rank = rank
        c.sock.settimeout(10.0)  # bounds a send to a wedged peer; reads only follow select()
        self.conns[rank] = c
        self.last_seen[rank] = time.monotonic()
        if extra:
            self._readable_extra(c, extra)

    def _readable_extra(self, c, data):
        try:
            msgs = [decode(f, TO_HUB) for f in c.reader.feed(data)]
        except ProtocolError as e:
            self._fail(f"{self.name(c.rank)} sent a malformed control message ({e})")
            return
        for m in msgs:
            self._handle(c.rank, m)

    def _send(self, rank, msg):
        c = self.conns.get(rank)
        if c is None:
            return
        try:
            c.sock.sendall(encode(msg))
        except OSError:
            pass  # its death is reported through the process exit or the heartbeat check

    # -- protocol -------------------------------------------------------------------------------
    def _handle(self, rank, m):
        t = m["t"]
        if "step" in m and m["step"] >= 0:
            self.step[rank] = m["step"]
        if t == "hb":
            return
        if t == "bye":
            self.finished.add(rank)
            return
        if t == "error":
            self.errors[rank] = m["msg"]
            if self.failure is None:
                self.failed_rank = rank
                self.failed_hint = m["hint"] or None
            self._fail(f"{self.name(rank)} failed{self.at_step(rank)}: {m['msg']}")
            return
        # t == "coll"
        seq = m["seq"]
        if seq != self.next_seq:
            self._fail(f"{self.name(rank)} is at collective #{seq} but the job is at #{self.next_seq} "
                       "(ranks called different collectives)")
            return
        arr = self.arrivals.setdefault(seq, {})
        if rank in arr:
            self._fail(f"{self.name(rank)} arrived twice at collective #{seq}")
            return
        arr[rank] = (m["op"], m["n"], m["digest"])
        self.first_arrival.setdefault(seq, time.monotonic())
        if len(arr) < self.world_size:
            return
        kinds = {(op, n) for op, n, _ in arr.values()}
        if len(kinds) != 1:
            detail = ", ".join(f"rank {r}: {op}(n={n})" for r, (op, n, _) in sorted(arr.items()))
            self._fail(f"ranks called different collectives at #{seq}: {detail}")
            return
        digests = {d for _, _, d in arr.values()}
        if len(digests) != 1:
            op = next(iter(kinds))[0]
            detail = ", ".join(f"rank {r}: {d[:16]}" for r, (_, _, d) in sorted(arr.items()))
            self._fail(f"ranks disagree on {op}{self.at_step(0)} (collective #{seq}): {detail}")
            return
        del self.arrivals[seq]
        del self.first_arrival[seq]
        self.next_seq += 1
        for r in range(self.world_size):
            self._send(r, {"t": "go", "seq": seq, "stop": bool(self.stop)})

    def at_step(self, rank, last_seen=False):
        """Where rank was, for messages: ' at step S', ' (last seen at step S)', or '' if unknown."""
        s = self.step.get(rank)
        if s is None:
            return ""
        return f" (last seen at step {s})" if last_seen else f" at step {s}"

    def _check_timeouts(self):
        now = time.monotonic()
        for key in list(self.sel.get_map().values()):
            c = key.data
            if isinstance(c, _Conn) and c.rank is None and now > c.deadline:
                self._drop(c, f"did not authenticate within {HANDSHAKE_TIMEOUT:.0f} s")
        if self.failure is not None:
            return
        for rank in range(self.world_size):
            if rank in self.finished or rank in self.lost:
                continue
            if rank not in self.conns:
                if now - self.started > self.startup_timeout:
                    self._fail(f"{self.name(rank)} did not connect to the control hub within "
                               f"{self.startup_timeout:.0f} s")
                    return
                continue
            quiet = now - self.last_seen[rank]
            if quiet > self.timeout:
                self._fail(f"{self.name(rank)} sent no heartbeat for {quiet:.1f} s: hung or "
                           f"stopped{self.at_step(rank, True)}")
                return
        for seq, t0 in self.first_arrival.items():
            arr = self.arrivals[seq]
            waiting = [r for r in range(self.world_size) if r not in arr]
            gone = [r for r in waiting if r in self.finished]
            if gone:
                self._fail(f"{self.name(gone[0])} exited (code 0) while ranks {sorted(arr)} were "
                           f"waiting for it at collective #{seq} ({next(iter(arr.values()))[0]})")
                return
            if now - t0 > self.collective_timeout:
                self._fail(f"{self.name(waiting[0])} did not reach collective #{seq} "
                           f"({next(iter(arr.values()))[0]}){self.at_step(waiting[0], True)} within "
                           f"{self.collective_timeout:.0f} s while ranks {sorted(arr)} waited")
                return

    def abort(self, msg):
        for r in list(self.conns):
            self._send(r, {"t": "abort", "msg": msg})

    def close(self):
        for c in list(self.conns.values()):
            self._drop(c)
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, _Conn):
                self._drop(key.data)
        self.sel.close()
        self.listen.close()


def handshake_connect(sock, secret, rank, peer="the control hub"):
    """Client side of the mutual HMAC handshake on a connected blocking socket."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        hello = recv_exact(sock, HELLO_HUB)
        if hello[:len(MAGIC)] != MAGIC:
            raise DistError(f"rank {rank}: {peer} is not an llmctl endpoint (wrong greeting)")
        nonce_h = hello[len(MAGIC):]
        nonce_c = os.urandom(NONCE)
        rank_b = struct.pack(">I", rank)
        sock.sendall(MAGIC + rank_b + nonce_c + auth_mac(secret, b"client", nonce_h, nonce_c, rank_b))
        proof = recv_exact(sock, MAC)
    except (OSError, ConnectionError) as e:
        raise DistError(f"rank {rank}: handshake with {peer} failed: {e}",
                        hint="the peer rejected this process's credentials or went away") from None
    if not hmac.compare_digest(proof, auth_mac(secret, b"hub", nonce_c, nonce_h, rank_b)):
        raise DistError(f"rank {rank}: {peer} failed to prove it knows the job secret")


def is_loopback(addr):
    return addr in ("localhost", "::1") or addr.startswith("127.")


def bind_listener(addr, port, allow_remote=False, what="control", blocking=False):
    """A listening TCP socket on exactly `addr:port` (port 0: the OS picks a free one).

    Loopback only unless allow_remote (multi-host: the user named the address explicitly); never
    a wildcard address unless `addr` is one. `what` names the listener in error messages."""
    if not allow_remote and not is_loopback(addr):
        raise DistError(f"refusing to bind the {what} listener to {addr}: only loopback addresses are "
                        "allowed on one host", hint="use 127.0.0.1 (the default)")
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    # REUSEADDR only skips TIME_WAIT leftovers of an earlier run; a live listener still conflicts
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise DistError(f"{what} port {port} on {addr} is already in use",
                            hint="pass another --master-port, or 0 to let the OS pick a free one") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise DistError(f"cannot bind the {what} listener to {addr}: no local interface has that address",
                            hint="pass this host's own address as --bind-addr "
                                 "(and --master-addr must be node 0's)") from None
        raise DistError(f"cannot bind the {what} listener to {addr}:{port}: {e.strerror}") from None
    s.listen(128)
    s.setblocking(blocking)
    return s
