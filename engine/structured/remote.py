"""Structured output's matchers in a process of their own (``CUTEINFER_GRAMMAR_PROCESS=1``).

In one process, a constrained step costs the engine thread the matchers' advance (llguidance's
``consume_token`` holds the GIL: ~10 us a row on the GPU host, 16 rows ~0.15 ms) and the hand-off
to the mask thread, and the mask thread takes the GIL back between its Rust calls. Below a
~1.5 ms GPU step that work is the step (docs/perf.md v31-v32). Here a worker process owns every
matcher: the engine thread sends a step's sampled tokens and the next step's rows in one message
and goes on committing outputs; the worker advances the matchers, answers their outcomes, writes
the next step's bitmasks into shared memory and says so.

Protocol (one ``multiprocessing.connection.Connection`` over a socket pair; messages are bytes,
the first byte says what):

- ``A`` key, grammar text: a matcher for ``key`` (compiled per text, sharded as
  ``GrammarCache`` does), answered ``K``, or ``X`` and llguidance's message when it does not
  compile (the engine's admission check: the main process needs no llguidance tokenizer).
- ``D`` keys: drop those matchers (requests that finished).
- ``S`` slot, keys to advance with their tokens, keys to mask: the worker advances, answers
  ``O`` with one outcome byte a key (``Advance`` order: continue, done, error) and the errors'
  messages, then writes the masks of the mask keys (rows 0.. of ``slot``; a key whose advance in
  this job did not continue gets no mask: its row is unused) and answers ``M``.
- ``Q``: exit.

Jobs are answered in order, one outstanding at a time (``GrammarWorker.submit`` drains the one
before). A worker that dies fails the jobs of its requests (``GrammarError``); the next request
starts a fresh worker.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from engine.structured.grammar import GrammarError

SLOTS = 2  # mask slots: a job's rows are read (uploaded) before the job two later writes them
OUTCOMES = ("continue", "done", "error")
_HDR = struct.Struct("<iiiI")  # slot, keys advanced, keys masked, gate sequence (0: none)
ALL = np.uint32(0xFFFFFFFF)
RECV_TIMEOUT_S = 60.0  # an answer later than this: the worker is taken for hung


class _TokenizerJson:
    """What ``GrammarCache.ll_tokenizer`` reads of a tokenizer: ``backend_tokenizer.to_str()``."""

    def __init__(self, text: str) -> None:
        self.backend_tokenizer = self
        self._text = text

    def to_str(self) -> str:
        return self._text


class Job:
    """One ``S`` message in flight: ``outcomes()``, then ``result()`` (the masks written); each
    waits for its answer."""

    __slots__ = ("worker", "n_adv", "mask", "gate", "_outcomes", "_errors", "_masked",
                 "_failed")

    def __init__(self, worker: GrammarWorker, n_adv: int, mask: np.ndarray,
                 gate: int = 0) -> None:
        self.worker = worker
        self.n_adv = n_adv
        self.mask = mask  # the slot's rows the worker fills (a view of the shared memory)
        self.gate = gate  # the gate sequence the worker sets once the rows are written (0: none)
        self._outcomes: np.ndarray | None = None
        self._errors: dict[int, str] = {}
        self._masked = False
        self._failed: str | None = None

    def _fail(self, why: str) -> None:
        """The worker will not finish this job: a gated one opens its gate here (every row
        allowing every token), so that the step waiting on the device runs."""
        self._failed = why
        if self.gate:
            self.worker.open_gate(self.gate, self.mask.shape[0])

    def outcomes(self) -> tuple[np.ndarray, dict[int, str]]:
        """(int8 [n_adv] indices into ``OUTCOMES``, {row: llguidance's message} of the errors)."""
        if self._outcomes is None:
            msg = self.worker._recv(self, b"O")
            n = self.n_adv
            self._outcomes = np.frombuffer(msg, np.int8, n, 1).copy()
            if len(msg) > 1 + n:
                self._errors = {int(k): v for k, v in json.loads(msg[1 + n:]).items()}
        return self._outcomes, self._errors

    def result(self) -> None:
        """Wait until the masks are written (a future's ``result``). A job the worker failed
        (or a worker that died) leaves its rows allowing every token, so that the other rows of
        the step run: the matchers' advance then rejects what does not fit the grammar, or the
        dead worker's error finishes the constrained requests (``LogitsProcessorState``)."""
        if self.exception() is not None:
            self.mask[:] = ALL

    def exception(self) -> BaseException | None:
        """Wait until the masks are written; the error that kept them from being written."""
        try:
            self.outcomes()
            if not self._masked:
                self.worker._recv(self, b"M")
                self._masked = True
        except GrammarError as e:
            return e
        return GrammarError(self._failed) if self._failed is not None else None


class GrammarWorker:
    """The client side: starts the worker process, sends it requests' grammars and steps."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: tuple[int, ...],
                 max_rows: int, threads: int | None = None) -> None:
        self.words = (vocab_size + 31) // 32
        self.max_rows = max_rows
        flag = _flag_offset(max_rows, self.words)
        self._shm = shared_memory.SharedMemory(create=True, size=flag + 4096)
        # slots 0..SLOTS-1: the ring of mask rows; slot SLOTS: the gate's rows (a gated job's,
        # read by the device once the gate flag reaches the job's sequence number)
        self.slots = np.ndarray((SLOTS + 1, max_rows, self.words), np.uint32, self._shm.buf)
        self.gate_flag = np.ndarray((1,), np.uint32, self._shm.buf, flag)
        self.gate_flag[0] = 0
        self._slot = 0
        self.gate_seq = 0  # the last gate sequence number handed out (``next_gate``)
        # the tokenizer (~11 MB for Qwen3's) goes through a file the worker reads and removes:
        # through the socket, this thread would wait until the worker has started to read it
        fd, path = tempfile.mkstemp(prefix="cuteinfer-tok-", suffix=".json",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "engine.structured.remote", str(theirs.fileno())]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env,
                                         stdin=subprocess.DEVNULL)
        except OSError:
            for x in (ours, theirs):
                x.close()
            del self.slots
            self._shm.close()
            self._shm.unlink()
            os.unlink(path)
            raise
        finally:
            theirs.close()
        self._sock = ours
        self.conn = Connection(os.dup(ours.fileno()))
        self._job: Job | None = None
        self.dead: str | None = None
        self._closed = weakref.finalize(self, _cleanup, self.proc, self.conn, ours, self._shm,
                                        path)
        self.conn.send_bytes(json.dumps({"shm": self._shm.name, "vocab": vocab_size,
                                         "eos": list(eos), "rows": max_rows,
                                         "threads": threads, "tokenizer": path}).encode())

    # -- messages ----------------------------------------------------------------------------
    def _send(self, msg: bytes) -> None:
        if self.dead is not None:
            raise GrammarError(self.dead)
        try:
            self.conn.send_bytes(msg)
        except OSError as e:
            self._died(f"the grammar worker is gone ({type(e).__name__}: {e})")

    def _died(self, why: str) -> None:
        self.dead = why
        raise GrammarError(why)

    def _recv(self, job: Job, kind: bytes) -> bytes:
        if job._failed is not None:
            raise GrammarError(job._failed)
        try:
            if self.dead is not None:
                raise GrammarError(self.dead)
            if not self.conn.poll(RECV_TIMEOUT_S):  # a hung worker: stopped, as a dead one
                self.proc.kill()
                raise EOFError(f"no answer in {RECV_TIMEOUT_S} s; stopped")
            msg = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            self.dead = f"the grammar worker is gone ({type(e).__name__}: {e})"
            job._fail(self.dead)
            raise GrammarError(self.dead) from None
        except GrammarError as e:
            job._fail(str(e))
            raise
        if msg[:1] == b"E":  # the worker could not run the job (a bug): fails its rows
            job._fail(f"the grammar worker failed: {msg[1:].decode(errors='replace')}")
            job._masked = True  # (it sends nothing more for this job)
            if self._job is job:
                self._job = None
            raise GrammarError(job._failed)
        if msg[:1] != kind:
            self._died(f"the grammar worker answered {msg[:1]!r}, not {kind!r}")
        if kind == b"M" and self._job is job:
            self._job = None
        return msg

    def _drain(self) -> None:
        """Read the answers of the job in flight (one nobody waited for)."""
        job, self._job = self._job, None
        if job is not None:
            job.exception()

    # -- requests ----------------------------------------------------------------------------
    def add(self, key: int, grammar: str) -> None:
        """A matcher of ``grammar`` for ``key``; GrammarError with llguidance's message when
        ``grammar`` does not compile against the tokenizer (nothing is kept then). Waits for the
        job in flight first, and, on a fresh worker, for its tokenizer (~2 s for Qwen3's)."""
        self._drain()
        self._send(b"A" + struct.pack("<q", key) + grammar.encode())
        try:
            if not self.conn.poll(RECV_TIMEOUT_S):  # a hung worker: stopped, as a dead one
                self.proc.kill()
                raise EOFError(f"no answer in {RECV_TIMEOUT_S} s; stopped")
            msg = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            self._died(f"the grammar worker is gone ({type(e).__name__}: {e})")
        if msg[:1] == b"X":
            raise GrammarError(msg[1:].decode(errors="replace"))
        if msg != b"K":
            self._died(f"the grammar worker answered {msg[:1]!r}, not b'K'")

    def drop(self, keys: list[int]) -> None:
        if keys and self.dead is None:
            try:
                self._send(b"D" + np.asarray(keys, np.int64).tobytes())
            except GrammarError:
                pass

    def submit(self, adv_keys: list[int], tokens: list[int] | np.ndarray,
               mask_keys: list[int], gate: int = 0) -> Job:
        """Advance ``adv_keys`` by ``tokens``, then mask ``mask_keys`` (rows in that order).
        ``gate``: a sequence number from ``next_gate``: the rows go to the gate's slot (a row
        whose advance did not continue allows every token) and the gate flag is set to it once
        they are written."""
        if len(mask_keys) > self.max_rows:
            raise GrammarError(f"{len(mask_keys)} constrained rows exceed the worker's "
                               f"{self.max_rows}")
        self._drain()
        slot = self._slot
        if gate:
            slot = SLOTS
        elif mask_keys:  # (an advance alone writes no rows)
            self._slot = (slot + 1) % SLOTS
        job = Job(self, len(adv_keys), self.slots[slot, :len(mask_keys)], gate)
        self._send(b"S" + _HDR.pack(slot, len(adv_keys), len(mask_keys), gate)
                   + np.asarray(adv_keys, np.int64).tobytes()
                   + np.asarray(tokens, np.int32).tobytes()
                   + np.asarray(mask_keys, np.int64).tobytes())
        self._job = job
        return job

    # -- the gate (a device step waiting for its masks) ---------------------------------------
    def next_gate(self) -> int:
        """A new gate sequence number (the device waits until the flag reaches it)."""
        self.gate_seq += 1
        return self.gate_seq

    def open_gate(self, seq: int, rows: int) -> None:
        """Release the device step waiting on gate ``seq`` without masks: its ``rows`` rows allow
        every token (the worker will not write them: it died, failed or got no job)."""
        self.slots[SLOTS, :rows] = ALL
        if int(self.gate_flag[0]) < seq:
            self.gate_flag[0] = seq

    @property
    def gate_region(self) -> tuple[int, int, int, int]:
        """(host address, bytes, the gate rows' address, the flag's address) of the shared
        memory, for the executor to register and copy from."""
        base = self.slots.ctypes.data
        return (base, self._shm.size, self.slots[SLOTS].ctypes.data,
                self.gate_flag.ctypes.data)

    def close(self) -> None:
        """Stop the worker (also when this object is collected, or at exit)."""
        if self._closed.alive and self.dead is None:
            try:
                self._drain()
            except GrammarError:
                pass
        self.dead = self.dead or "the grammar worker was closed"
        self._closed()


def _cleanup(proc: subprocess.Popen, conn: Connection, sock: socket.socket,
             shm: shared_memory.SharedMemory, tokenizer_path: str) -> None:
    try:
        conn.send_bytes(b"Q")
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()
    sock.close()
    try:
        shm.close()
    except BufferError:  # (a view of it is still alive: the mapping goes with the process)
        pass
    shm.unlink()
    try:  # (a worker that died before it read its tokenizer)
        os.unlink(tokenizer_path)
    except FileNotFoundError:
        pass


def _flag_offset(rows: int, words: int) -> int:
    """The gate flag's offset in the shared memory: the first page after the mask slots."""
    return ((SLOTS + 1) * rows * words * 4 + 4095) // 4096 * 4096


# -- the worker process ---------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    from engine.structured.matcher import Advance, GrammarCache

    cfg = json.loads(conn.recv_bytes())
    with open(cfg["tokenizer"], encoding="utf-8") as f:
        tok = _TokenizerJson(f.read())
    os.unlink(cfg["tokenizer"])
    shm = shared_memory.SharedMemory(name=cfg["shm"])
    try:  # (the main process owns the segment: this process must not unlink it at exit)
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    cache = GrammarCache(tok, cfg["vocab"], tuple(cfg["eos"]), threads=cfg["threads"])
    try:  # built now (~2 s for Qwen3's), not at the first grammar (the engine's warm-up waits
        cache.ll_tokenizer()  # for it; a failure shows at the first grammar)
    except Exception:  # noqa: BLE001
        pass
    words = cache.words
    slots = np.ndarray((SLOTS + 1, cfg["rows"], words), np.uint32, shm.buf)
    flag = np.ndarray((1,), np.uint32, shm.buf, _flag_offset(cfg["rows"], words))
    matchers: dict[int, Any] = {}
    order = {Advance.CONTINUE: 0, Advance.DONE: 1, Advance.ERROR: 2}
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        op = msg[:1]
        if op == b"Q":
            break
        if op == b"A":
            (key,) = struct.unpack_from("<q", msg, 1)
            try:
                matchers[key] = cache.matcher(msg[9:].decode())
            except GrammarError as e:
                conn.send_bytes(b"X" + str(e).encode())
            except Exception as e:  # noqa: BLE001
                conn.send_bytes(b"X" + f"{type(e).__name__}: {e}".encode())
            else:
                conn.send_bytes(b"K")
            continue
        if op == b"D":
            for key in np.frombuffer(msg, np.int64, offset=1).tolist():
                matchers.pop(key, None)
            continue
        if op != b"S":
            conn.send_bytes(b"E" + f"unknown message {op!r}".encode())
            continue
        try:
            slot, n_adv, n_mask, gate = _HDR.unpack_from(msg, 1)
            o = 1 + _HDR.size
            adv = np.frombuffer(msg, np.int64, n_adv, o).tolist()
            toks = np.frombuffer(msg, np.int32, n_adv, o + 8 * n_adv).tolist()
            keys = np.frombuffer(msg, np.int64, n_mask, o + 12 * n_adv).tolist()
        except Exception as e:  # noqa: BLE001
            conn.send_bytes(b"E" + f"{type(e).__name__}: {e}".encode())
            continue
        out = bytearray(n_adv)
        errors: dict[int, str] = {}
        stopped: set[int] = set()
        for i, (key, t) in enumerate(zip(adv, toks, strict=True)):
            st = matchers.get(key)
            if st is None:
                res, why = Advance.ERROR, "no matcher for this request"
            else:
                try:
                    res = st.accept(t)
                except Exception:  # noqa: BLE001 -- as a grammar that cannot continue
                    res = Advance.ERROR
                why = st.error if res is Advance.ERROR else ""
            out[i] = order[res]
            if res is not Advance.CONTINUE:
                stopped.add(key)
                if why:
                    errors[i] = why
        conn.send_bytes(b"O" + bytes(out) + (json.dumps(errors).encode() if errors else b""))
        reqs, rows = [], []
        dest = slots[slot]
        try:
            for k, key in enumerate(keys):
                if key in stopped:
                    if gate:  # (the device reads every row of a gated step)
                        dest[k] = ALL
                    continue
                st = matchers.get(key)
                if st is None:
                    raise GrammarError(f"no matcher for request key {key}")
                reqs.append(st)
                rows.append(k)
            if rows == list(range(len(rows))):
                cache.fill_bitmasks(reqs, dest[:max(len(rows), 1)])
            elif reqs:
                tmp = np.empty((len(reqs), words), np.uint32)
                cache.fill_bitmasks(reqs, tmp)
                dest[rows] = tmp
        except Exception as e:  # noqa: BLE001
            if gate:  # the step waiting on the device runs, its rows unmasked
                dest[:n_mask] = ALL
                flag[0] = max(int(flag[0]), gate)
            conn.send_bytes(b"E" + f"{type(e).__name__}: {e}".encode())
            continue
        if gate:  # (x86 stores are ordered: the rows are visible before the flag)
            flag[0] = max(int(flag[0]), gate)
        conn.send_bytes(b"M")
    conn.close()
    shm.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))


class RemoteStructured:
    """A constrained request's matcher in the worker (``key``); ``error``: llguidance's message
    once its grammar could not continue. ``LogitsProcessorState`` advances it in batches."""

    __slots__ = ("key", "worker", "error", "__weakref__")

    def __init__(self, key: int, worker: GrammarWorker) -> None:
        self.key = key
        self.worker = worker
        self.error = ""

    def close(self) -> None:
        self.worker.drop([self.key])
