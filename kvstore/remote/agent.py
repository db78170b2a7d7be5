"""The fleet agent: one process per engine between its local store and the KV pool.

`FleetAgent` does the work, on the store through a `DiskStore` handle of its own (an
attached writer of the store, as `kvstore warmup` is while engines serve: what it writes
the engines find in LMDB on their next lookup):

- `fetch(keys)`: the blocks of `keys` (a request's chain after its local hit) that the
  pool has on every rank, read into the registered buffer, verified (`records.check`:
  checksum, fingerprint digest, key, rank) and written into the local store. A bad
  record is never written, counted, and removed from the pool; the chain stops there.
- `publish(keys)`: blocks this engine stored, read back verified from the local store
  and put into the pool unless it has them.

`main()` runs it as a process (`python -m kvstore.remote.agent`, started by
`client.RemoteClient`): messages come over a pipe; fetches go first, publishes wait in a
bounded queue (more are dropped and counted); it exits when the engine's end of the pipe
closes, or when the engine dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

from kvstore.errors import KVStoreError
from kvstore.format.layout import stored_identity
from kvstore.remote.mooncake import MooncakePool
from kvstore.remote.records import HEADER_SIZE, check, encode_into, fingerprint_digest, pool_key
from kvstore.store.config import RemoteConfig
from kvstore.store.disk import DiskStore

log = logging.getLogger("kvstore.remote")


@dataclass(slots=True)
class AgentStats:
    """What the agent did since it started (the engine reports them: `kvstore info`,
    the connector's metrics)."""
    fetches: int = 0
    pool_hit_blocks: int = 0        # blocks the pool had on every rank, read
    filled_blocks: int = 0          # of them, written into the local store
    fill_bytes: int = 0
    verify_failed: int = 0          # records refused (corrupt, another fingerprint or block)
    published_blocks: int = 0
    publish_bytes: int = 0
    publish_dropped: int = 0        # blocks the bounded publish queue had no room for
    pool_errors: int = 0
    pool_down: bool = False
    # where the agent's time went (seconds): the pool's calls, the local store's reads
    # (publishes) and writes (fills), and kvstore's own work on records (encode, verify)
    pool_s: float = 0.0
    local_s: float = 0.0
    records_s: float = 0.0


class FleetAgent:
    """See the module docstring. Not thread-safe: one caller (the agent's main loop).

    Both directions are a two-stage pipeline over the two halves of the registered
    buffer: the pool's transfers run on one thread of their own (Mooncake's calls release
    the GIL), the local store's I/O and the records' work on the caller's, so part i+1
    crosses the network while part i is written to (or read from) the local disk."""

    CONNECT_WAIT_S = 3.0

    def __init__(self, store_path: str, cfg: RemoteConfig, *, io_mode: str = "direct",
                 pool: MooncakePool | None = None):
        self.cfg = cfg
        self.store = DiskStore(store_path, io=True, io_mode=io_mode, kind="fleet",
                               staging_bytes=32 << 20)
        try:
            lay = self.store.layout
            ident = stored_identity(self.store.fingerprint)
            self.digest = fingerprint_digest(lay, None if ident is None else ident.to_dict())
            self.tp = lay.tp_size
            self.payload = lay.block_bytes
            self.size = HEADER_SIZE + self.payload        # one record
            self.record = -(-self.size // 64) * 64        # its place in the buffer
            self.half = cfg.buffer_bytes // 2
            if self.record * self.tp > self.half:
                raise KVStoreError(f"the remote buffer ({cfg.buffer_bytes} bytes) cannot hold two "
                                   f"blocks of every rank ({2 * self.record * self.tp} bytes); "
                                   "raise remote.buffer")
            self.chunk = self.half // (self.record * self.tp)   # blocks per part
            self.pool = pool or MooncakePool(cfg)
        except BaseException:
            self.store.close()
            raise
        self.stats = AgentStats()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-pool-io")
        # connect now (the first fetch should not pay for it), waiting a little: against
        # a master that does not answer, Mooncake's setup goes on in the background
        self.pool.available(wait=self.CONNECT_WAIT_S)

    def _names(self, keys: list[bytes]) -> list[str]:
        return [pool_key(self.digest, k, r) for k in keys for r in range(self.tp)]

    def _off(self, half: int, j: int) -> int:
        """Record j of a part in buffer half `half`."""
        return half * self.half + j * self.record

    def _timed_pool(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.pool_s += time.perf_counter() - t0

    # -- fetch -----------------------------------------------------------------------------
    def fetch(self, keys: list[bytes]) -> int:
        """Blocks of the prefix of `keys` local after the fetch (found there, or filled)."""
        self.stats.fetches += 1
        local = len(self.store.longest_prefix(keys))
        todo = keys[local:]
        parts = [todo[i:i + self.chunk] for i in range(0, len(todo), self.chunk)]
        done, nxt = local, None
        if parts:
            nxt = self._io.submit(self._timed_pool, self._pool_read, parts[0], 0)
        try:
            for i, part in enumerate(parts):
                n, read = nxt.result()
                nxt = None
                if n == len(part) and i + 1 < len(parts):     # the next part crosses now
                    nxt = self._io.submit(self._timed_pool, self._pool_read, parts[i + 1],
                                          (i + 1) % 2)
                got = self._fill(part, n, read, i % 2)
                done += got
                if got < len(part):
                    break
        finally:
            if nxt is not None:     # a part read ahead of a hole: its half is not reused yet
                nxt.result()
            self._sync_pool_stats()
        return done

    def _pool_read(self, part: list[bytes], half: int) -> tuple[int, list[int] | None]:
        """Pool thread: (blocks of the prefix of `part` the pool has on every rank, the
        bytes read per record into buffer half `half`)."""
        tp = self.tp
        names = self._names(part)
        have = self.pool.exists(names)
        if have is None:
            return 0, None
        n = 0
        while n < len(part) and all(have[n * tp:(n + 1) * tp]):
            n += 1
        if not n:
            return 0, None
        names = names[:n * tp]
        read = self.pool.get_into(names, [self._off(half, j) for j in range(len(names))],
                                  [self.size] * len(names))
        return (n, read) if read is not None else (0, None)

    def _fill(self, part: list[bytes], n: int, read, half: int) -> int:
        """Verify the n records read of `part` and write the good prefix into the local
        store; the blocks of `part` local afterwards."""
        st, tp, buf = self.stats, self.tp, self.pool.buffer
        t0 = time.perf_counter()
        good = 0
        for i in range(n):
            for r in range(tp):
                j = i * tp + r
                o = self._off(half, j)
                why = (f"read returned {read[j]}" if read[j] != self.size
                       else check(buf[o:o + self.size], self.digest, part[i], r, self.payload))
                if why is not None:
                    break
            else:
                good += 1
                continue
            if read[j] == self.size:    # a bad record (not a plain miss): never served again
                st.verify_failed += 1
                name = pool_key(self.digest, part[i], r)
                self._io.submit(self.pool.remove, name).result()
                log.warning("kvstore: pool record %s refused (%s); the block is recomputed",
                            name, why)
            break
        st.pool_hit_blocks += good
        t1 = time.perf_counter()
        st.records_s += t1 - t0
        if not good:
            return 0

        def payload(i: int, r: int):
            o = self._off(half, i * tp + r) + HEADER_SIZE
            return buf[o:o + self.payload]
        try:
            stored = self.store.put(part[:good], payload)
        except KVStoreError as exc:     # the local store is full of pinned blocks, or failing
            log.warning("kvstore: writing pool blocks into the local store failed: %s", exc)
            return 0
        finally:
            st.local_s += time.perf_counter() - t1
        st.filled_blocks += len(stored)
        st.fill_bytes += len(stored) * tp * self.payload
        # blocks another writer stored meanwhile count as local too
        return len(self.store.longest_prefix(part[:good]))

    def fetch_entries(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """`fetch`, answered with the (slots, generations) of the prefix of `keys` local
        afterwards: the engine adds them to its table without reading LMDB."""
        n = self.fetch(keys)
        entries = self.store.longest_prefix(keys[:n]) if n else []
        return [e.slot for e in entries], [e.generation for e in entries]

    # -- publish ---------------------------------------------------------------------------
    def publish(self, keys: list[bytes]) -> int:
        """Put the blocks of `keys` this store holds into the pool (those it lacks, or the
        pool has, skipped). Returns the blocks the pool took."""
        tp = self.tp
        have = self._io.submit(self._timed_pool, self.pool.exists, self._names(keys)).result()
        if have is None:
            self._sync_pool_stats()
            return 0
        todo = [k for i, k in enumerate(keys) if not all(have[i * tp:(i + 1) * tp])]
        done, pending = 0, None
        try:
            for i in range(0, len(todo), self.chunk):
                half = (i // self.chunk) % 2
                ready = self._encode(todo[i:i + self.chunk], half)  # while the last part crosses
                if pending is not None:
                    done += pending.result()
                    pending = None
                if ready:
                    pending = self._io.submit(self._timed_pool, self._pool_write, ready, half)
        finally:
            if pending is not None:
                done += pending.result()
            self._sync_pool_stats()
        return done

    def _encode(self, part: list[bytes], half: int) -> list[bytes]:
        """Read the blocks of `part` the local store holds (verified) and write their
        records into buffer half `half`; returns their keys."""
        st, tp, buf = self.stats, self.tp, self.pool.buffer
        t0 = time.perf_counter()
        data: dict[bytes, list] = {}
        rest = part
        while rest:     # the local store's prefix reads stop at a hole: go on after it
            got = self.store.get(rest, verify="checksum", touch=False, count=False)
            data.update(got)
            rest = rest[len(got) + 1:]
        keys = [k for k in part if k in data]
        t1 = time.perf_counter()
        st.local_s += t1 - t0
        for i, k in enumerate(keys):
            for r in range(tp):
                o = self._off(half, i * tp + r)
                encode_into(buf[o:o + self.size], self.digest, k, r, data[k][r])
        st.records_s += time.perf_counter() - t1
        return keys

    def _pool_write(self, keys: list[bytes], half: int) -> int:
        """Pool thread: put the records of `keys` from buffer half `half`; blocks taken."""
        st, tp = self.stats, self.tp
        names = self._names(keys)
        codes = self.pool.put_from(names, [self._off(half, j) for j in range(len(names))],
                                   [self.size] * len(names))
        if codes is None:
            return 0
        ok = sum(1 for i in range(len(keys)) if all(c == 0 for c in codes[i * tp:(i + 1) * tp]))
        st.published_blocks += ok
        st.publish_bytes += ok * tp * self.payload
        return ok

    def _sync_pool_stats(self) -> None:
        self.stats.pool_errors = self.pool.errors
        self.stats.pool_down = not self.pool.connected

    def close(self, pool: bool = True) -> None:
        """Close the store (its lease ends) and, with `pool`, the pool's connection (the
        agent process leaves that to its exit: Mooncake's close waits on a master that
        died)."""
        self._io.shutdown(wait=True)
        try:
            if pool:
                self.pool.close()
        finally:
            self.store.close()


# -- the process ---------------------------------------------------------------------------

class _Inbox:
    """Messages from the engine: fetches (in order, first) and publishes (a bounded queue
    of blocks; what does not fit is dropped and counted)."""

    def __init__(self, conn: Connection, publish_limit: int, stats: AgentStats):
        self.conn, self.limit, self.stats = conn, publish_limit, stats
        self.fetches: deque = deque()
        self.publishes: deque = deque()
        self.queued_blocks = 0
        self.other: deque = deque()
        self.closed = False
        self.cv = threading.Condition()
        threading.Thread(target=self._read, name="kvstore-fleet-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            with self.cv:
                kind = msg[0]
                if kind == "fetch":
                    self.fetches.append(msg)
                elif kind == "publish":
                    keys = msg[1]
                    if self.queued_blocks + len(keys) > self.limit:
                        self.stats.publish_dropped += len(keys)
                    else:
                        self.publishes.append(keys)
                        self.queued_blocks += len(keys)
                else:
                    self.other.append(msg)
                self.cv.notify()
            if kind == "stop":
                return

    def next(self):
        """The next message: "stats" first, then fetches, then publishes; "stop" once
        nothing else is queued (the engine's end closed: the publishes it left are
        finished first, within `DRAIN_S`)."""
        with self.cv:
            while not (self.fetches or self.other or self.publishes):
                self.cv.wait()
            if self.other and (self.other[0][0] != "stop" or not self.publishes
                               or time.monotonic() > self._drain_until()):
                return self.other.popleft()
            if self.fetches:
                return self.fetches.popleft()
            keys = self.publishes.popleft()
            self.queued_blocks -= len(keys)
            return ("publish", keys)

    DRAIN_S = 5.0
    _stop_at = None

    def _drain_until(self) -> float:
        if self._stop_at is None:
            self._stop_at = time.monotonic() + self.DRAIN_S
        return self._stop_at


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:   # noqa: BLE001 (not Linux)
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kvstore's fleet agent (started by the engine)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--remote", required=True, help="the store's remote settings (JSON)")
    ap.add_argument("--io-mode", default="direct")
    ap.add_argument("--fd-in", type=int, required=True)
    ap.add_argument("--fd-out", type=int, required=True)
    a = ap.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    out = Connection(a.fd_out, readable=False)
    conn = Connection(a.fd_in, writable=False)
    try:
        agent = FleetAgent(a.store, RemoteConfig.parse(json.loads(a.remote)), io_mode=a.io_mode)
    except Exception as exc:    # noqa: BLE001
        out.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    inbox = _Inbox(conn, agent.cfg.publish_queue, agent.stats)
    out.send(("ready", os.getpid()))
    try:
        while True:
            msg = inbox.next()
            kind = msg[0]
            if kind == "stop":
                return 0
            if kind == "fetch":
                _, token, keys = msg
                t0 = time.monotonic()
                try:
                    slots, gens = agent.fetch_entries(keys)
                except Exception as exc:    # noqa: BLE001 (a request never fails for the pool)
                    log.warning("kvstore: fetch from the pool failed: %s", exc)
                    slots, gens = [], []
                # plain lists over the pipe (this module runs as __main__ here)
                out.send(("fetched", token, slots, gens, time.monotonic() - t0))
            elif kind == "publish":
                try:
                    agent.publish(msg[1])
                except Exception as exc:    # noqa: BLE001
                    log.warning("kvstore: publishing to the pool failed: %s", exc)
            elif kind == "stats":
                out.send(("stats", msg[1], asdict(agent.stats)))
    except (BrokenPipeError, EOFError, OSError):
        return 0
    finally:
        agent.close(pool=False)


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)      # not through Mooncake's teardown, which waits on a dead master
