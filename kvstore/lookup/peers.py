"""Following the other engines attached to a shared store (`kvstore.store.shared`).

`PeerFollower` owns this engine's view of its peers: it maps the pin arrays of the engines
attached now into the lookup table (so an eviction claim refuses what they pin), gives a
dead engine's reservations back (its lease lock is free), and sweeps the table of entries
other engines evicted, a slice per round. The index thread calls `upkeep` between its
rounds; cheap when alone (one shared word read). Does nothing for a store that is not
shared (no lease).
"""
from __future__ import annotations

import time

# How often the index thread looks for engines that came, went or died (reclaiming a dead
# one's reservations), and sweeps the table of entries other engines evicted (a slice of
# the table per round).
PEERS_EVERY_S = 0.5
SWEEP_BUCKETS = 1 << 16


class PeerFollower:
    """See the module docstring. `reclaimed`: reservations of dead engines given back."""

    def __init__(self, index, lease, lookups):
        self.index = index
        self.lease = lease          # the store's `Lease` (None: not shared)
        self.lookups = lookups      # `TableLookups`: its table follows the peers
        self.epoch = -1
        self.next_at = 0.0
        self.sweep_at = 0
        self.reclaimed = 0

    def attach(self) -> None:
        """At open: the table's pins move to the lease's file, and follow the peers."""
        self.lookups.table.attach(self.lease.slots, self.lease.pins)
        self.follow()

    def follow(self) -> None:
        """Map the pin arrays of the engines attached now (after one came or went)."""
        epoch = self.lease.epoch
        if epoch == self.epoch:
            return
        peers = self.lease.peers()      # listed after the epoch was read: see set_peers
        with self.lookups.lock:
            self.lookups.table.set_peers(peers, epoch)
        self.epoch = epoch

    def upkeep(self) -> None:
        """Index thread, between rounds: follow engines that came or went, reclaim a dead
        engine's reservations, sweep a slice of the table of entries other engines
        evicted. Cheap when alone (one shared word read)."""
        if self.lease is None:
            return
        self.follow()
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + PEERS_EVERY_S
        lookups = self.lookups
        table = lookups.table
        if table.peer_count or lookups.shared_now():
            # an engine whose lease lock is free died: its reservations go back now
            gone = self.lease.reap(self.reclaim_owner)
            if gone:
                self.follow()
        if lookups.ready and (table.peer_count or self.sweep_at):
            with lookups.lock:
                _, nxt = table.sweep(self.sweep_at, SWEEP_BUCKETS)
            self.sweep_at = nxt

    def reclaim_owner(self, owner) -> None:
        if owner is not None:
            self.reclaimed += self.index.reclaim_owner(owner)
