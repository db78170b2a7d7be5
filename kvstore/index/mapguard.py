"""This process's transactions vs. re-mapping its LMDB environment: `MapGuard`, held
shared by every transaction and exclusively by a re-map, and `ReadTxn`, a read
transaction that holds it until it ends. Used by `kvstore.index.env.IndexEnv`."""

from __future__ import annotations

import threading

__all__ = ["MapGuard", "ReadTxn"]


class MapGuard:
    """This process's transactions vs. re-mapping its environment (`set_mapsize`: growing
    the map, or adopting a size another process grew it to). LMDB requires that no
    transaction of the process is open while it re-maps, and py-lmdb invalidates every
    open one; with a store shared by several engines the scheduler thread reads LMDB
    (another engine's blocks) while the index thread writes, and every engine meets the
    other engines' growth (MDB_MAP_RESIZED) at its next transaction. Transactions hold
    the guard shared; a re-map waits until none is open, and while it waits or runs no
    new one begins (else a thread that reads in a loop starves it), except in a thread
    that holds one already."""

    __slots__ = ("_cond", "_active", "_resizing", "_pending", "_local")

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._resizing = False
        self._pending = 0
        self._local = threading.local()

    def enter(self) -> None:
        depth = getattr(self._local, "depth", 0)
        with self._cond:
            while depth == 0 and (self._resizing or self._pending):
                self._cond.wait()
            self._active += 1
        self._local.depth = depth + 1

    def exit(self) -> None:
        self._local.depth -= 1
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def remap(self, fn, timeout: float | None) -> bool:
        """Run fn() while no transaction of this process is open; False when this thread
        holds one itself, or none could be had within `timeout` seconds."""
        if getattr(self._local, "depth", 0):
            return False
        with self._cond:
            self._pending += 1
            try:
                ok = self._cond.wait_for(lambda: self._active == 0 and not self._resizing,
                                         timeout)
            finally:
                self._pending -= 1
            if not ok:
                self._cond.notify_all()     # the transactions held back may begin
                return False
            self._resizing = True
        try:
            fn()
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
        return True


class ReadTxn:
    """A read transaction holding the map guard until it ends (`with`, or `abort()`)."""

    __slots__ = ("_txn", "_guard")

    def __init__(self, txn, guard: MapGuard):
        self._txn, self._guard = txn, guard

    def __enter__(self):
        return self._txn

    def __exit__(self, *exc):
        self.abort()

    def abort(self) -> None:
        g, self._guard = self._guard, None
        if g is not None:
            try:
                self._txn.abort()
            finally:
                g.exit()

    def __getattr__(self, name):
        return getattr(self._txn, name)
