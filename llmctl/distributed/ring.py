"""The TCP ring backend: a bandwidth-optimal ring all-reduce between hosts.

issue 6.

What it is: `RingComm`, a `Comm` whose members form a ring of TCP connections (each member
sends only to the next and receives only from the previous one). all_reduce_mean(buf) of n
floats over P members splits buf into P segments and runs
  reduce-scatter  P-1 steps: send segment (r-s), receive segment (r-s-1) and add it to ours;
                  after the last step member r owns the full sum of segment r+1 and divides it
                  by P (once, by its owner);
  all-gather      P-1 steps: forward the owned/received segment, receive the next one straight
                  into buf.
Each member sends 2(P-1)/P of the buffer -- the bandwidth lower bound. Segments move in chunks
(CHUNK_BYTES) and a sender thread runs beside the receiving/adding main thread, so a chunk is
forwarded as soon as it has been added: the steps are pipelined, not store-and-forward. Every
element is summed by one owner in a fixed ring order and then copied, so every member ends
with the same bits (asserted in tests/test_ring.py).

Connections are authenticated with the job secret (the HMAC handshake of rendezvous.py) and
each collective starts with a header (magic, sequence number, op, size) that the receiver
checks, so desynchronised ranks or foreign bytes are an error, not silent corruption. Faults:
any socket error, EOF, bad header or `collective_timeout` s without data raises DistError
naming the peer (rank, host, address:port) and shuts both ring sockets down, which makes the
neighbours fail at once too, so the whole ring ends within a few hops. TCP keepalive (and
TCP_USER_TIMEOUT) bound the detection of a host that vanished without closing its sockets to
about `timeout` s.

What it is not: no process spawning (launcher.py), no shared memory (hier.py combines this
with shm.py), no rendezvous protocol of its own (rendezvous.py). It stands in for NCCL's ring
allReduce across nodes in llm.c's multi-node runs.
"""
import hashlib
import queue
import socket
import struct
import threading
import time

import numpy as np

from llmctl.distributed.base import Comm
from llmctl.distributed.control import ProtocolError
from llmctl.distributed.rendezvous import (host_port, auth_client, auth_server, bind_listener, local_addr_for,
                                    rendezvous, resolve_addr)
from llmctl.errors import DistError

CHUNK_BYTES = 1 << 20
_HDR = struct.Struct(">8sQBIQ")   # magic, seq, op, root, nbytes
_HDR_MAGIC = b"LLMRING1"
_OPS = {1: "all_reduce_mean", 2: "all_reduce_sum", 3: "broadcast", 4: "all_gather",
        5: "reduce_scatter_mean", 6: "all_gather_shards"}


def _set_keepalive(s, timeout):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    t = max(1, int(timeout))
    for name, val in (("TCP_KEEPIDLE", max(1, t // 3)), ("TCP_KEEPINTVL", max(1, t // 6)),
                      ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", t * 1000)):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                s.setsockopt(socket.IPPROTO_TCP, opt, val)
            except OSError:
                pass


def ring_connect(members, pos, listener, secret, timeout, connect_timeout):
    """Connect to members[pos+1] and accept members[pos-1]; returns (out_sock, in_sock).

    members: records (rank, addr, port, host) in ring order. Foreign or unauthenticated
    connections to our listener are dropped (and named in the error if the right one never
    comes); only the expected previous member is accepted. Both directions run at once (the
    accept in a thread) so P = 2 cannot deadlock.
    """
    P = len(members)
    me, nxt, prv = members[pos], members[(pos + 1) % P], members[(pos - 1) % P]
    deadline = time.monotonic() + connect_timeout
    got = {}
    rejected = []
    t = threading.Thread(target=_accept_previous, name="llmctl-ring-accept", daemon=True,
                         args=(listener, secret, me, prv, deadline, got, rejected))
    t.start()
    out = None
    who = f"rank {nxt['rank']} ({nxt['host']} {host_port(nxt['addr'], nxt['port'])})"
    try:
        while out is None:
            try:
                out = socket.create_connection((nxt["addr"], nxt["port"]), timeout=5.0)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise DistError(f"rank {me['rank']}: cannot connect to the next ring member "
                                    f"{who}: {e.strerror or e}") from None
                time.sleep(0.1)
        auth_client(out, secret, b"ring", me["rank"], nxt["rank"], P, f"ring member {who}")
        t.join(max(0.0, deadline - time.monotonic()) + 0.5)
        if "in" not in got:
            why = f" (rejected: {'; '.join(rejected[:3])})" if rejected else ""
            raise DistError(f"rank {me['rank']}: the previous ring member rank {prv['rank']} "
                            f"({prv['host']} {host_port(prv['addr'], prv['port'])}) did not connect "
                            f"within {connect_timeout:.0f} s{why}")
    except BaseException:
        if out is not None:
            out.close()
        if "in" in got:
            got["in"].close()
        raise
    for s in (out, got["in"]):
        _set_keepalive(s, timeout)
    return out, got["in"]


def _accept_previous(listener, secret, me, prv, deadline, got, rejected):
    """ring_connect's accepting side: got["in"] = the previous member's authenticated socket
    (got["err"] if the listener fails); strangers are closed and named in `rejected`."""
    listener.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            s, peer = listener.accept()
        except socket.timeout:
            continue
        except OSError as e:
            got["err"] = e
            return
        try:
            r, to, _ = auth_server(s, secret, b"ring")
            if r != prv["rank"] or to != me["rank"]:
                raise ProtocolError(f"authenticated as rank {r} -> {to}, but this ring expects "
                                    f"rank {prv['rank']} -> {me['rank']}")
            got["in"] = s
            return
        except ProtocolError as e:
            rejected.append(f"{host_port(*peer[:2])}: {e}")
            s.close()


RING_FAILURE_HINT = "the other ranks stop too"


class RingComm(Comm):
    """Members of one TCP ring. See the module docstring for the algorithm and fault model."""

    def __init__(self, members, pos, out_sock, in_sock, *, rank=None, world_size=None,
                 local_rank=0, local_world_size=1, timeout=30.0, collective_timeout=300.0,
                 chunk_bytes=CHUNK_BYTES, n_threads=1, label=None, failure_hint=None):
        self.members = members
        # what a failed collective means for the caller's work (training: the checkpoint to resume from)
        self.failure_hint = failure_hint or RING_FAILURE_HINT
        self.pos = pos
        self.size = len(members)
        self.rank = members[pos]["rank"] if rank is None else rank
        self.world_size = self.size if world_size is None else world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.n_threads = n_threads
        self.label = label or f"rank {self.rank}"
        self.timeout = float(timeout)
        self.collective_timeout = float(collective_timeout)
        self.chunk_bytes = max(64, int(chunk_bytes))
        self.step = -1
        self.stop_requested = False
        self._seq = 0
        self._out = out_sock
        self._in = in_sock
        self._q = queue.SimpleQueue()
        self._send_err = None
        self._failed = None
        self._scratch = {}
        self._watch = []
        nxt, prv = members[(pos + 1) % self.size], members[(pos - 1) % self.size]
        self._next_name = f"rank {nxt['rank']} ({nxt['host']} {host_port(nxt['addr'], nxt['port'])})"
        self._prev_name = f"rank {prv['rank']} ({prv['host']} {host_port(prv['addr'], prv['port'])})"
        self._op = ""
        self.allreduce_calls = 0
        self.allreduce_seconds = 0.0
        self._sender = None
        if self.size > 1:
            self._in.settimeout(self.collective_timeout)
            self._out.settimeout(self.collective_timeout)
            self._sender = threading.Thread(target=self._send_loop, name="llmctl-ring-send",
                                            daemon=True)
            self._sender.start()

    # -- plumbing --------------------------------------------------------------------------------
    def _send_loop(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._send_err is not None:
                continue  # drain: the main thread reports the error
            try:
                self._out.sendall(item)
            except OSError as e:
                self._send_err = e
                self._shutdown()  # wakes the main thread's recv, breaks the ring for the others

    def _shutdown(self):
        for s in (self._out, self._in):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass

    def _where(self):
        at = f" at step {self.step}" if self.step >= 0 else ""
        return f"{self._op} #{self._seq}{at}"

    def _fail(self, msg, hint=None):
        """Record the first failure, break the ring (the neighbours fail at once), raise."""
        if self._failed is None:
            self._failed = msg
        self._shutdown()
        raise DistError(f"{self.label}: {self._failed}", hint=hint or self.failure_hint)

    def _send_failure(self):
        e = self._send_err
        return (f"lost the connection to the next ring member {self._next_name} during "
                f"{self._where()}: {e.strerror or e}")

    def _check(self):
        if self._failed is not None:
            raise DistError(f"{self.label}: the ring is broken since an earlier failure: "
                            f"{self._failed}")

    def _send(self, arr):
        self._q.put(memoryview(arr).cast("B"))

    def _recv_into(self, arr):
        mv = memoryview(arr).cast("B")
        n = len(mv)
        got = 0
        while got < n:
            k = -1
            try:
                k = self._in.recv_into(mv[got:], n - got)
            except socket.timeout:
                msg = (f"no data from the previous ring member {self._prev_name} for "
                       f"{self.collective_timeout:.0f} s during {self._where()}: it is hung, or "
                       "stopped before this collective")
            except OSError as e:
                msg = (f"lost the connection from the previous ring member {self._prev_name} "
                       f"during {self._where()}: {e.strerror or e}")
            if k == 0:
                msg = (f"the previous ring member {self._prev_name} closed the connection during "
                       f"{self._where()} (its process died or its job failed)")
            if k <= 0:
                if self._send_err is not None and self._failed is None:
                    msg = self._send_failure()
                self._fail(msg)
            got += k

    def _flush(self):
        ev = threading.Event()
        self._q.put(ev)
        deadline = time.monotonic() + self.collective_timeout + 5.0
        while not ev.wait(0.5):
            if time.monotonic() > deadline:
                self._fail(f"sending to the next ring member {self._next_name} stalled for "
                           f"{self.collective_timeout:.0f} s during {self._where()}")
        if self._send_err is not None:
            self._fail(self._send_failure())

    def _begin(self, op, nbytes, root=0):
        """Send our header for this collective to the next member; check the previous one's."""
        self._check()
        self._op = _OPS[op]
        self._send(np.frombuffer(_HDR.pack(_HDR_MAGIC, self._seq, op, root, nbytes), np.uint8))
        hdr = np.empty(_HDR.size, np.uint8)
        self._recv_into(hdr)
        magic, seq, pop, proot, pn = _HDR.unpack(hdr.tobytes())
        if magic != _HDR_MAGIC:
            self._fail(f"the previous ring member {self._prev_name} sent bytes that are not an "
                       f"llmctl ring header (garbage, or a different program) at {self._where()}")
        if (seq, pop, proot, pn) != (self._seq, op, root, nbytes):
            self._fail(f"the previous ring member {self._prev_name} is at collective #{seq} "
                       f"{_OPS.get(pop, pop)}(root={proot}, {pn} bytes) but this rank is at "
                       f"{self._where()}(root={root}, {nbytes} bytes): the ranks called different "
                       "collectives")

    def _end(self):
        self._flush()
        self._seq += 1

    def _tmp(self, n, dtype):
        t = self._scratch.get(dtype)
        if t is None or t.shape[0] < n:
            t = self._scratch[dtype] = np.empty(n, dtype)
        return t[:n]

    # -- algorithms ------------------------------------------------------------------------------
    def _ring_allreduce(self, buf, average):
        P, r = self.size, self.pos
        n = buf.shape[0]
        self._begin(1 if average else 2, buf.nbytes)
        bounds = [k * n // P for k in range(P + 1)]

        def seg(k):
            k %= P
            return bounds[k], bounds[k + 1]

        ce = max(1, self.chunk_bytes // buf.itemsize)
        tmp = self._tmp(min(ce, max(1, n)), buf.dtype)
        div = buf.dtype.type(P)
        lo, hi = seg(r)
        for c in range(lo, hi, ce):
            self._send(buf[c:min(hi, c + ce)])
        for s in range(P - 1):          # reduce-scatter
            lo, hi = seg(r - s - 1)
            last = s == P - 2
            for c in range(lo, hi, ce):
                e = min(hi, c + ce)
                t = tmp[:e - c]
                self._recv_into(t)
                dst = buf[c:e]
                np.add(dst, t, out=dst)
                if last and average:
                    np.divide(dst, div, out=dst)
                self._send(dst)          # next step's send, or all-gather step 0 when last
        for s in range(P - 1):          # all-gather
            lo, hi = seg(r - s)
            fwd = s < P - 2
            for c in range(lo, hi, ce):
                dst = buf[c:min(hi, c + ce)]
                self._recv_into(dst)
                if fwd:
                    self._send(dst)
        self._end()

    def _pieces(self, buf, ranges):
        """buf's views over `ranges`, cut at chunk_bytes (the same cuts on every member)."""
        ce = max(1, self.chunk_bytes // buf.itemsize)
        for lo, hi in ranges:
            for c in range(lo, hi, ce):
                yield buf[c:min(hi, c + ce)]

    def _shard_segs(self, shards):
        """Ring position k's segment is the shard of the rank at position k - 1, so that the
        reduce-scatter leaves each member with its own rank's shard (position r ends with k = r+1)."""
        ranks = [m["rank"] for m in self.members]
        return lambda k: shards[ranks[(k - 1) % self.size]]

    # -- Comm interface --------------------------------------------------------------------------
    supports_zero = True

    def reduce_scatter_mean(self, buf, shards):
        """The first half of the ring all-reduce over the ranks' shards as segments: P-1 steps,
        each sending a partial sum of one shard to the next member; this rank's shard ends with
        the sum over all members, divided by P."""
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1 \
                or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("reduce_scatter_mean needs a writeable 1-D contiguous float32 array")
        if self.size == 1:
            return
        t0 = time.perf_counter()
        P, r = self.size, self.pos
        seg = self._shard_segs(shards)
        self._begin(5, buf.nbytes)
        ce = max(1, self.chunk_bytes // buf.itemsize)
        tmp = self._tmp(min(ce, max(1, buf.shape[0])), buf.dtype)
        div = buf.dtype.type(P)
        for piece in self._pieces(buf, seg(r)):
            self._send(piece)
        for s in range(P - 1):
            last = s == P - 2
            for dst in self._pieces(buf, seg(r - s - 1)):
                t = tmp[:dst.shape[0]]
                self._recv_into(t)
                np.add(dst, t, out=dst)
                if last:
                    np.divide(dst, div, out=dst)
                else:
                    self._send(dst)
        self._end()   # every send flushed: the caller may overwrite buf
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    def all_gather(self, buf, shards, scratch=None):
        """The second half of the ring all-reduce: this rank's shard goes round the ring
        (scratch is not needed: the pieces travel straight into buf)."""
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1 \
                or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("all_gather needs a writeable 1-D contiguous float32 array")
        if self.size == 1:
            return
        P, r = self.size, self.pos
        seg = self._shard_segs(shards)
        self._begin(6, buf.nbytes)
        for piece in self._pieces(buf, seg(r + 1)):
            self._send(piece)
        for s in range(P - 1):
            fwd = s < P - 2
            for dst in self._pieces(buf, seg(r - s)):
                self._recv_into(dst)
                if fwd:
                    self._send(dst)
        self._end()

    def all_reduce_mean(self, buf):
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1 \
                or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("all_reduce_mean needs a writeable 1-D contiguous float32 array, got "
                             f"{getattr(buf, 'dtype', type(buf))} {getattr(buf, 'shape', '')}")
        if self.size == 1:
            return
        t0 = time.perf_counter()
        self._ring_allreduce(buf, True)
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    def all_reduce_sum_vec(self, vals):
        """Sum of a few float64 values over members; identical bits on every member."""
        v = np.array(vals, dtype=np.float64).reshape(-1)
        if self.size > 1:
            self._ring_allreduce(v, False)
        return v

    def all_reduce_sum_scalar(self, x):
        for watched in self._watch:
            self.assert_identical(*watched)
        return float(self.all_reduce_sum_vec([float(x)])[0])

    def barrier(self):
        # an all-reduce completes on a member only after every member has contributed
        if self.size > 1:
            self.all_reduce_sum_vec([0.0])

    def broadcast(self, buf, root=0):
        """Copy the buffer of global rank `root` (a member of this ring) into buf everywhere."""
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise ValueError("broadcast needs a contiguous NumPy array")
        ranks = [m["rank"] for m in self.members]
        if root not in ranks:
            raise ValueError(f"broadcast root {root} is not a rank of this ring {ranks}")
        if self.size == 1:
            return
        rp = ranks.index(root)
        raw = buf.reshape(-1).view(np.uint8)
        self._begin(3, raw.shape[0], root)
        step = self.chunk_bytes
        if self.pos == rp:
            for c in range(0, raw.shape[0], step):
                self._send(raw[c:c + step])
        else:
            fwd = (self.pos + 1) % self.size != rp
            for c in range(0, raw.shape[0], step):
                dst = raw[c:c + step]
                self._recv_into(dst)
                if fwd:
                    self._send(dst)
        self._end()

    def all_gather_bytes(self, mine):
        """Every member's `mine` (same length everywhere), in ring order."""
        L = len(mine)
        out = [None] * self.size
        out[self.pos] = bytes(mine)
        if self.size == 1:
            return out
        self._begin(4, L)
        cur = np.frombuffer(bytes(mine), np.uint8).copy()
        for s in range(self.size - 1):
            self._send(cur)
            nxt = np.empty(L, np.uint8)
            self._recv_into(nxt)
            out[(self.pos - s - 1) % self.size] = nxt.tobytes()
            cur = nxt
        self._end()
        return out

    def watch(self, buf, what="buffer"):
        """Debug mode: assert_identical(buf) before every all_reduce_sum_scalar from now on."""
        self._watch.append((buf, what))

    def assert_identical(self, buf, what="buffer"):
        if self.size == 1:
            return
        arr = np.ascontiguousarray(buf)
        d = hashlib.blake2b(memoryview(arr).cast("B"), digest_size=16).digest()
        ds = self.all_gather_bytes(d)
        if len(set(ds)) != 1:
            detail = ", ".join(f"rank {m['rank']}: {x.hex()[:16]}" for m, x in zip(self.members, ds))
            raise DistError(f"{self.label}: ranks disagree on {what} at step {self.step}: {detail}")

    def close(self):
        if self._sender is not None:
            self._q.put(None)
            self._sender.join(5.0)
            self._sender = None
        for s in (self._out, self._in):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self._out = self._in = None


def init_ring(rank, world_size, *, master_addr, master_port, bind_addr, secret, timeout=30.0,
              collective_timeout=None, rdzv_timeout=300.0, ring_key=0, node=0, host=None,
              local_rank=0, local_world_size=1, chunk_bytes=CHUNK_BYTES, log=None, label=None,
              failure_hint=None):
    """Rendezvous, then connect the ring of all ranks with the same `ring_key` (in rank order).

    failure_hint: the hint of a failed collective (default: the other ranks stop too). Returns a RingComm whose rank is the global rank; its world_size is the ring's size (for the
    flat backend, every rank; inside hier.py, one member per node).
    """
    collective_timeout = float(collective_timeout) if collective_timeout else max(300.0, 10 * timeout)
    host = host or socket.gethostname()
    lis = bind_listener(bind_addr, 0, "ring")
    advertise = bind_addr
    if advertise in ("0.0.0.0", "::"):  # listening everywhere (the user asked): tell peers one route
        advertise = resolve_addr(master_addr) if rank == 0 else local_addr_for(master_addr)
    try:
        rec = {"node": node, "ring": ring_key, "addr": advertise, "port": lis.getsockname()[1],
               "host": host[:255]}
        table = rendezvous(rank, world_size, master_addr, master_port, secret, rec, rdzv_timeout, log)
        members = [p for p in table if p["ring"] == ring_key]
        pos = [m["rank"] for m in members].index(rank)
        if len(members) == 1:
            out = inn = None
        else:
            out, inn = ring_connect(members, pos, lis, secret, timeout,
                                    connect_timeout=max(30.0, 2 * timeout))
    finally:
        lis.close()  # nothing stays listening once the ring is connected
    comm = RingComm(members, pos, out, inn, timeout=timeout, collective_timeout=collective_timeout,
                    chunk_bytes=chunk_bytes, local_rank=local_rank,
                    local_world_size=local_world_size, label=label, failure_hint=failure_hint)
    comm.table = table
    return comm
