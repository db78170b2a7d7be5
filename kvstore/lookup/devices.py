"""Failed devices of a store over several data directories, as the serving index sees them.

`DeviceFences` owns the fences (device -> (reason, since)) of the store: at open it
probes every data directory (`probe`: fences a device that is not usable, re-admits a
fenced one that is back); while serving, `fence` takes a failed device's entries out of
the lookups and its slots out of the pool at once, and the index thread then drops its
entries from LMDB and records the fence (`apply`), after which no reservation or commit
touches its slots.
"""
from __future__ import annotations

import logging
import time

from kvstore.lookup.events import Dropped
from kvstore.lookup.ops import FenceOp

log = logging.getLogger("kvstore.lookup.table")

# A fence of these reasons is lifted at open once the device probes fine (it was away or
# read-only: its entries were dropped, its free slots hold nothing anyone reads); an I/O
# error fence is lifted only by `kvstore fsck --repair`.
READMIT_AT_OPEN = ("missing", "readonly", "foreign")


def probe_devices(store, index, fences: dict, ndev: int, direct: bool) -> list[int]:
    """At open: fence (in `index` and `fences`) every device whose data directory is not
    usable (missing, read-only, another store's), re-admit a fenced one that is back (see
    READMIT_AT_OPEN); returns the re-admitted devices. Runs before any slot is handed out."""
    from kvstore.io.datadirs import probe_data_dir
    readmitted = []
    for d, path in enumerate(store.data_dirs):
        bad = probe_data_dir(path, store.path, d, direct)
        if bad is None and d in fences and fences[d][0] in READMIT_AT_OPEN:
            index.readmit_device(d)
            reason = fences.pop(d)[0]
            readmitted.append(d)
            log.warning("kvstore: device %d (%s) is back (fenced as %s); re-admitted",
                        d, path, reason)
        elif bad is not None and d not in fences:
            dropped = index.fence_device(d, ndev, bad[0])
            fences[d] = (bad[0], int(time.time()))
            log.error("kvstore: device %d (%s) is not usable (%s); fenced, %d entries "
                      "dropped", d, path, bad[1], len(dropped))
        elif d in fences:
            # still fenced: drop what an index rebuild (or a crash) may have left on it
            index.fence_device(d, ndev, fences[d][0])
    return readmitted


class DeviceFences:
    """See the module docstring. `fences` and `readmitted` are `ServingIndex`'s."""

    def __init__(self, store, index, ndev: int, lookups, pool, requests, outbox):
        self.store = store
        self.index = index
        self.ndev = ndev
        self.lookups = lookups      # `TableLookups`
        self.pool = pool            # `SlotPool`
        self.requests = requests    # `OpQueue`
        self.outbox = outbox
        self.fences: dict[int, tuple[str, int]] = index.set_devices(ndev)
        self.readmitted: list[int] = []

    def probe(self, direct: bool) -> None:
        """`probe_devices`, at open (before the pool is filled and the table is built)."""
        self.readmitted.extend(probe_devices(self.store, self.index, self.fences, self.ndev,
                                             direct))

    def fence(self, dev: int, reason: str = "io_error") -> bool:
        """`ServingIndex.fence_device` (step thread)."""
        if self.ndev < 2 or not 0 <= dev < self.ndev or dev in self.fences:
            return False
        self.fences[dev] = (reason, int(time.time()))
        self.lookups.remove_device(self.ndev, dev)
        removed = self.pool.purge(dev, self.ndev)
        self.requests.put(FenceOp(dev, reason, removed))
        return True

    def apply(self, dev: int, reason: str, removed: list[int]) -> None:
        """Index thread: the fence in LMDB (its entries dropped, the slots the pool held
        given back)."""
        dropped = self.index.fence_device(dev, self.ndev, reason)   # retracted in its txn
        removed = removed + self.pool.purge(dev, self.ndev)     # a refill that ran before the fence
        if removed:
            self.index.abort(removed)
        self.lookups.remove_device(self.ndev, dev)
        log.warning("kvstore: device %d (%s) fenced (%s): %d entries dropped, its slots are "
                    "not used until `kvstore fsck --repair` re-admits it", dev,
                    self.store.data_dirs[dev], reason, len(dropped))
        if dropped:
            self.outbox.post(Dropped(keys=[e.key for e in dropped]))
