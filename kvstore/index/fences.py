"""Fenced (failed) devices of a store over several data directories (`Fences`): the
``meta`` rows ``fenced.<d>`` (docs/FORMAT.md, "Index"), written in the transaction that
drops every entry on the device. The fenced set they load is what `SlotAllocator.fence`
holds: reservations and commits skip those devices' slots.
"""

from __future__ import annotations

import time

from kvstore.errors import KVStoreError
from kvstore.index.env import IndexEnv, guard
from kvstore.index.rows import (
    COUNTER, ENTRY_VALUE, FENCE, FENCE_CODE, FENCE_PREFIX, FENCE_REASONS, LRU_KEY, PAUSE_EVERY,
    SLOT_KEY, Entry, make_entry,
)
from kvstore.index.slots import SlotAllocator

__all__ = ["Fences"]

_U32, _U64, _LRU, _VAL = SLOT_KEY, COUNTER, LRU_KEY, ENTRY_VALUE


class Fences:
    """Reads and writes the fence rows and keeps `slots.fence` in step with them."""

    def __init__(self, env: IndexEnv, slots: SlotAllocator):
        self._lmdb = env
        self._alloc = slots
        d = env.dbs
        self._keys, self._slots, self._lru, self._free, self._meta = (
            d.keys, d.slots, d.lru, d.free, d.meta)

    @guard
    def fenced_devices(self) -> dict[int, tuple[str, int]]:
        """{device: (reason, unix time)} of every fenced device (meta rows `fenced.<d>`)."""
        out = {}
        with self._lmdb.read() as txn:
            cur = txn.cursor(db=self._meta)
            ok = cur.set_range(FENCE_PREFIX)
            while ok and cur.key().startswith(FENCE_PREFIX):
                code, t = FENCE.unpack(cur.value())
                out[int(cur.key()[len(FENCE_PREFIX):])] = (FENCE_REASONS.get(code, f"code {code}"), t)
                ok = cur.next()
        return out

    @guard
    def fence_rows(self) -> dict[str, int]:
        """The raw `fenced.<d>` meta rows (name -> u64), for an index rebuild to keep."""
        out = {}
        with self._lmdb.read() as txn:
            cur = txn.cursor(db=self._meta)
            ok = cur.set_range(FENCE_PREFIX)
            while ok and cur.key().startswith(FENCE_PREFIX):
                out[cur.key().decode()] = _U64.unpack(cur.value())[0]
                ok = cur.next()
        return out

    def set_devices(self, ndev: int) -> dict[int, tuple[str, int]]:
        """Tell the index how many devices the store has and load its fences: from now on
        reservations and commits skip the fenced devices' slots. Returns the fences."""
        fences = self.fenced_devices() if ndev > 1 else {}
        self._alloc.fence = (max(1, ndev), frozenset(fences))
        return fences

    @guard
    def fence_device(self, dev: int, ndev: int, reason: str) -> list[Entry]:
        """Fence device `dev` of `ndev`: one transaction records it (meta row `fenced.<d>`,
        the first reason kept) and drops every entry whose slot is on it (its slots go to
        free, where reservations skip them). Returns the dropped entries."""
        if not 0 <= dev < ndev or ndev < 2:
            raise KVStoreError(f"fence_device: device {dev} of {ndev}")
        code = FENCE_CODE.get(reason, 1)
        self._alloc.note_freed()
        out = self._lmdb.write(self._fence_txn, dev, ndev, code, int(time.time()))
        self._alloc.fence = (ndev, self._alloc.fence[1] | {dev})
        self._lmdb.sync()     # the fence outlives a crash: a restart never hands its slots out
        return out

    def _fence_txn(self, txn, dev, ndev, code, now):
        name = FENCE_PREFIX + str(dev).encode()
        if txn.get(name, db=self._meta) is None:
            txn.put(name, FENCE.pack(code, now), db=self._meta)
        out = []
        sdb, kdb, ldb, fdb = self._slots, self._keys, self._lru, self._free
        victims = []
        pause = self._lmdb.pause
        for n, (sk, key) in enumerate(txn.cursor(db=sdb).iternext(keys=True, values=True)):
            if pause is not None and n and n % (16 * PAUSE_EVERY) == 0:
                pause()
            s = _U32.unpack(sk)[0]
            if s % ndev == dev:
                victims.append((sk, s, bytes(key)))
        for n, (sk, s, key) in enumerate(victims):
            if pause is not None and n and n % PAUSE_EVERY == 0:
                pause()
            v = txn.pop(key, db=kdb)
            txn.delete(sk, db=sdb)
            txn.put(sk, b"", db=fdb)
            if v is None:
                continue
            s_, g, t = _VAL.unpack(v)
            txn.delete(_LRU.pack(t, s_), db=ldb)
            out.append(make_entry(key, s_, g, t))
        self._lmdb.shared_set([e.slot for e in out], [0] * len(out),
                              [e.generation for e in out])
        return out

    @guard
    def readmit_device(self, dev: int) -> bool:
        """Clear device `dev`'s fence (its slots are free again). True if it was fenced."""
        name = FENCE_PREFIX + str(dev).encode()

        def txn_fn(txn):
            return txn.delete(name, db=self._meta)
        self._alloc.note_freed()
        done = self._lmdb.write(txn_fn)
        ndev, fenced = self._alloc.fence
        self._alloc.fence = (ndev, fenced - {dev})
        if done:
            self._lmdb.sync()
        return bool(done)
