"""The step thread's lookups: the in-memory key table, its pins, and drops not applied yet.

`TableLookups` owns the `KeyTable` (key -> (slot, generation), with a pin count per slot)
and the one lock (`lock`) that covers the table and the pins together, so a lookup that
pins a slot and an eviction claim that checks the pins (`claim`, on the index thread)
cannot interleave. Every lookup of `ServingIndex` runs here: from the table once it is
built (`ready`), from LMDB read transactions before (the walks below, also the synchronous
baseline's). In a store other engines are attached to, a miss in the table asks LMDB for
what they stored (`peer_prefix`, `peer_present`), checked against the shared slot
generations. Drops asked for and not applied to LMDB yet (`dropping`, `dropping_all`)
keep their keys out of every LMDB read here.
"""
from __future__ import annotations

import array
import logging
import threading
import time
from collections.abc import Iterable, Sequence

from kvstore._keytable import KeyTable
from kvstore.errors import KVStoreError
from kvstore.format.layout import block_key
from kvstore.store.shared import W_ATTACHED

log = logging.getLogger("kvstore.lookup.table")

# Inside its LMDB transactions the index thread sleeps this long every few dozen rows
# (`Index.pause`): the GIL is then free for the step thread, which would otherwise wait for
# it up to the interpreter's switch interval (5 ms) while the index thread runs Python.
YIELD_S = 0.0001
# The index thread counts a dry pool's dropped blocks in slices this long (`count_new`).
COUNT_SLICE = 128


def yield_gil() -> None:
    """Let the GIL go for the step thread (`YIELD_S`)."""
    time.sleep(YIELD_S)


def packed_hit(hit: tuple, packed: bool) -> tuple:
    """A (keys, slots, generations) hit made of lists, as `lookup_hashes(packed=...)`
    returns it."""
    if not packed:
        return hit
    return None, array.array("I", hit[1]), array.array("Q", hit[2])


def packed_plan(hashes: list, keys: list, bids: list, idx: list, packed: bool) -> tuple:
    """A store plan made of lists, as `plan_new(packed=...)` returns it: with `packed`,
    vLLM's hash objects instead of keys and the block indices as an array('I')."""
    if not packed:
        return keys, bids, idx
    return [hashes[i] for i in idx], bids, array.array("I", idx)


# The step thread's walks over LMDB (while the table is built; the synchronous baseline).
# `dropped(key)`: a drop of key is pending (LMDB's entry must not be served).

def present_lmdb(index, dropped, hashes, start, stop, group) -> bytes:
    return bytes(not dropped(k) and index.lookup(k) is not None
                 for k in (block_key(h, group) for h in hashes[max(0, start):stop]))


def lookup_hashes_lmdb(lookup_pin, hashes, start, stop, group) -> tuple:
    keys = [block_key(h, group) for h in hashes[max(0, start):stop]]
    slots, gens = lookup_pin(keys)
    return keys[:len(slots)], slots, gens


def plan_new_lmdb(index, dropped, hashes, start, stop, block_ids, skip, limit, group) -> tuple:
    keys, bids, idx = [], [], []
    for i in range(max(0, start), min(stop, len(hashes), len(block_ids))):
        if len(keys) >= limit:
            break
        k = block_key(hashes[i], group)
        if k in skip or (not dropped(k) and index.lookup(k) is not None):
            continue
        skip.add(k)
        keys.append(k)
        b = block_ids[i]        # an int, or vLLM's KVCacheBlock (as KeyTable.plan_new reads it)
        bids.append(b if isinstance(b, int) else b.block_id)
        idx.append(i)
    return keys, bids, idx


def count_new_lmdb(index, dropped, hashes, start, stop, skip, group) -> int:
    return sum(1 for h in hashes[max(0, start):stop]
               if (k := block_key(h, group)) not in skip
               and (dropped(k) or index.lookup(k) is None))


class TableLookups:
    """The key table and its lock, pins and pending drops; see the module docstring.
    The step thread calls the lookups; the index thread builds the table (`build`),
    claims eviction victims (`claim`) and counts dropped blocks (`count_new`)."""

    def __init__(self, index, capacity: int, lease=None):
        self.index = index
        # The store's `kvstore.store.shared.Lease` (None: not shared).
        self.lease = lease
        self.lock = threading.Lock()
        # (with a lease the pins move to its file at once: no point faulting ours in)
        self.table = KeyTable(capacity, prefault=lease is None)
        self.ready = False          # the table holds every committed key
        # Drops asked for and not yet applied to LMDB: keys (`forget`), and how many
        # `forget_all`s are queued. Changed under `lock`.
        self.dropping: set[bytes] = set()
        self.dropping_all = 0
        self.cross_hits = 0         # blocks found in LMDB that another engine stored

    # ------------------------------------------------------------------ step thread

    def lookup_pin(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """`ServingIndex.lookup_pin`."""
        if not self.ready:
            entries = self.undropped(self.index.longest_prefix(keys))    # LMDB read txn,
            #                                                  until the table is built
            slots, gens = [e.slot for e in entries], [e.generation for e in entries]
            with self.lock:
                self.table.pin(slots)
                # another engine may have evicted one since the read: checked as a table
                # hit is (the table is being built: nothing leaves it here)
                n = self.table.validate_pinned(keys[:len(slots)], slots, gens, False)
            del slots[n:], gens[n:]
            return slots, gens
        with self.lock:
            slots, gens = self.table.prefix(keys)
            if slots:
                self.table.pin(slots)
                n = self.table.validate_pinned(keys[:len(slots)], slots, gens)
                del slots[n:], gens[n:]
            if len(slots) < len(keys) and self.shared_now():
                rest = keys[len(slots):]
                more = self.peer_prefix(lambda a, b: rest[a:b], len(rest))
                slots += more[1]
                gens += more[2]
        return slots, gens

    def contains(self, key: bytes) -> bool:
        if not self.ready:
            return not self.dropped(key) and self.index.lookup(key) is not None
        with self.lock:
            return key in self.table

    # The step thread's per-step walks take vLLM's block hashes as they are (a list of
    # bytes) and run in C over the table (`KeyTable.prefix_of`, `plan_new`): no Python
    # object per block that is skipped, about 0.1-0.3 us per block.

    def lookup_hashes(self, hashes: list, start: int, stop: int, group: int = 0,
                      packed: bool = False) -> tuple[list[bytes] | None, Sequence[int], Sequence[int]]:
        """`ServingIndex.lookup_hashes`."""
        if not self.ready:
            return packed_hit(lookup_hashes_lmdb(self.lookup_pin, hashes, start, stop, group),
                              packed)
        with self.lock:     # found and pinned in one C walk
            keys, slots, gens = self.table.prefix_of(hashes, start, stop, group, True, packed)
            stop = min(stop, len(hashes))
            base = max(0, start) + len(slots)
            if base < stop and self.shared_now():
                # other engines attached: what they stored may be in LMDB only (keys are
                # made per chunk: a plain miss makes one)
                more = self.peer_prefix(
                    lambda a, b: [block_key(h, group) for h in hashes[base + a:base + b]],
                    stop - base)
                if more[0]:
                    if not packed:
                        keys += more[0]
                    slots += type(slots)("I", more[1]) if packed else more[1]
                    gens += type(gens)("Q", more[2]) if packed else more[2]
            return keys, slots, gens

    def peer_prefix(self, keys_at, n: int) -> tuple[list, list, list]:
        """The longest prefix of the n keys (`keys_at(a, b)` makes keys a..b) that LMDB
        has (other engines' stores), pinned and checked against the shared slot
        generations; it joins the table. Called under `lock`, on a miss in the table while
        other engines are attached: a read transaction per chunk of 1, 8, 64, then 512
        keys, so a plain miss costs one lookup."""
        out_k, out_s, out_g = [], [], []
        pos, chunk = 0, 1
        ss = []                 # pinned and not yet in out_s (validate_pinned unpins the rest)
        try:
            while pos < n:
                part = keys_at(pos, min(n, pos + chunk))
                try:
                    entries = self.undropped(self.index.longest_prefix(part))
                except KVStoreError as exc:     # e.g. a map another engine grew, not adopted yet
                    log.debug("kvstore: LMDB lookup for other engines' blocks failed: %s", exc)
                    break                       # a miss: vLLM computes the rest
                if not entries:
                    break
                ks = [e.key for e in entries]
                new_s = [e.slot for e in entries]
                gs = [e.generation for e in entries]
                self.table.pin(new_s)           # undoes its own pins when it raises
                ss = new_s
                kept = self.table.validate_pinned(ks, ss, gs)
                out_k += ks[:kept]
                out_s += ss[:kept]
                out_g += gs[:kept]
                ss = []
                if kept < len(entries) or len(entries) < len(part):
                    break
                pos += chunk
                chunk = min(chunk * 8, 512)
            if out_k:
                self.table.put_many(out_k, out_s, out_g)
        except Exception as exc:
            # Anything else (no memory, a malformed record): a miss, and nothing it
            # pinned stays pinned (the caller's own hit is the caller's).
            self.table.unpin(out_s + ss)
            log.warning("kvstore: lookup of other engines' blocks failed (%s: %s); treated "
                        "as a miss", type(exc).__name__, exc)
            return [], [], []
        if out_k:
            self.cross_hits += len(out_k)
        return out_k, out_s, out_g

    def adopt(self, keys: list[bytes], slots: list[int], gens: list[int]) -> int:
        """`ServingIndex.adopt`: entries another writer of the store committed and reported
        (the fleet agent's fills) join the table, the prefix whose slots still hold their
        generations; no LMDB read. Returns how many joined."""
        n = min(len(keys), len(slots), len(gens))
        if not n or not self.ready:
            return 0
        keys, slots, gens = list(keys[:n]), list(slots[:n]), list(gens[:n])
        with self.lock:
            self.table.pin(slots)
            kept = self.table.validate_pinned(keys, slots, gens, False)   # unpins the rest
            try:
                if kept:
                    self.table.put_many(keys[:kept], slots[:kept], gens[:kept])
            finally:
                self.table.unpin(slots[:kept])
        return kept

    def present(self, hashes: list, start: int, stop: int, group: int = 0) -> bytes:
        """`ServingIndex.present`."""
        if not self.ready:
            return present_lmdb(self.index, self.dropped, hashes, start, stop, group)
        with self.lock:
            flags = self.table.present(hashes, start, stop, group)
            if b"\0" in flags and self.shared_now():
                flags = self.peer_present(hashes, max(0, start), group, flags)
            return flags

    def peer_present(self, hashes: list, start: int, group: int, flags: bytes) -> bytes:
        """present() for the blocks the table lacks, from LMDB (other engines' stores),
        while other engines are attached; what is found (and whose slot still holds its
        generation) joins the table. Under `lock`; one read transaction."""
        miss = [i for i, f in enumerate(flags) if not f]
        keys = [block_key(hashes[start + i], group) for i in miss]
        try:
            found = self.index.get_many(keys)
        except KVStoreError as exc:
            log.debug("kvstore: LMDB lookup for other engines' blocks failed: %s", exc)
            return flags
        if not found:
            return flags
        slots = self.lease.slots
        ok = [(k, s_, g) for k, s_, g in found
              if slots.generation(s_) == g and not self.dropped(k)]
        if not ok:
            return flags
        self.table.put_many([x[0] for x in ok], [x[1] for x in ok], [x[2] for x in ok])
        self.cross_hits += len(ok)
        have = {x[0] for x in ok}
        out = bytearray(flags)
        for i, key in zip(miss, keys):
            if key in have:
                out[i] = 1
        return bytes(out)

    def plan_new(self, hashes: list, start: int, stop: int, block_ids: list, skip: set,
                 limit: int, group: int = 0, packed: bool = False
                 ) -> tuple[list[bytes], list[int], Sequence[int]]:
        """`ServingIndex.plan_new`."""
        if not self.ready:
            keys, bids, idx = plan_new_lmdb(self.index, self.dropped, hashes, start, stop,
                                            block_ids, skip, limit, group)
            return packed_plan(hashes, keys, bids, idx, packed)
        with self.lock:
            return self.table.plan_new(hashes, start, stop, block_ids, skip, limit, group,
                                       packed)

    def pin(self, slots: Iterable[int]) -> None:
        slots = slots if isinstance(slots, list) else list(slots)
        with self.lock:
            self.table.pin(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        # a lookup's array('I') goes to the table as it is (no int object per slot)
        if not isinstance(slots, (list, array.array)):
            slots = list(slots)
        if slots:
            with self.lock:
                self.table.unpin(slots)

    def pin_counts(self) -> dict[int, int]:
        with self.lock:
            return self.table.pins_dict()

    def shared_now(self) -> bool:
        """Other engines are attached (one shared word; the step thread asks it on a miss)."""
        return self.lease is not None and self.lease.slots.load(W_ATTACHED) > 1

    # -- drops ------------------------------------------------------------------------
    def forget(self, keys: list[bytes]) -> None:
        """A drop is asked for: keys leave the table now, and LMDB's entries for them are
        not served until the index thread applied it (`drop_applied`)."""
        with self.lock:
            self.table.remove_many(keys)
            self.dropping.update(keys)

    def forget_all(self) -> None:
        """`forget` of every key (`drop_all`), until `drop_all_applied`."""
        with self.lock:
            self.table.clear()
            self.dropping_all += 1

    def drop_applied(self, keys: list[bytes]) -> None:
        with self.lock:     # applied: LMDB lookups may see them again
            self.dropping.difference_update(keys)

    def drop_all_applied(self) -> None:
        with self.lock:
            self.dropping_all -= 1

    def dropped(self, key: bytes) -> bool:
        """A drop of key is asked for and not applied to LMDB yet: LMDB's entry for it
        must not be served or taken into the table."""
        return bool(self.dropping_all) or key in self.dropping

    def undropped(self, entries: list) -> list:
        """The prefix of LMDB `entries` up to the first one with a drop pending."""
        if not self.dropping and not self.dropping_all:
            return entries
        for i, e in enumerate(entries):
            if self.dropped(e.key):
                return entries[:i]
        return entries

    # ------------------------------------------------------------------ index thread

    def build(self) -> None:
        """Fill the table from LMDB, less the drops asked for meanwhile (applied later
        by the index thread). The caller sets `ready` once it returns."""
        # (the store's shared slot generations were made complete at open, by
        # `DiskStore`: hits are checked against them from the first lookup)
        self.index.load_keys(self.table)
        with self.lock:
            if self.dropping_all:
                self.table.clear()
            elif self.dropping:
                self.table.remove_many(list(self.dropping))

    def count_new(self, hashes, start, stop, skip, group) -> int:
        """`ServingIndex.count_dropped`'s count, in slices of `COUNT_SLICE` blocks (each
        a few dozen microseconds holding the GIL) with the GIL let go between them."""
        n = 0
        for b in range(max(0, start), stop, COUNT_SLICE):
            e = min(stop, b + COUNT_SLICE)
            if self.ready:
                with self.lock:
                    n += self.table.count_new(hashes, b, e, skip, group)
            else:       # the table could not be built: LMDB lookups
                n += count_new_lmdb(self.index, self.dropped, hashes, b, e, skip, group)
            if e < stop:
                yield_gil()
        return n

    def claim(self, removed: list):
        """`Index.reserve_pool`'s claim: refuse pinned slots; evicted keys leave the table
        first (and are added to `removed`: key, slot, generation each)."""
        table = self.table
        lease = self.lease

        def claim(cands):
            with self.lock:         # one C call: the step thread waits microseconds at most
                for _ in range(3):
                    if lease is None or not table.peers_stale:
                        break
                    # an engine came or went since the peers were listed: list them
                    # again now (the claim takes nothing from stale peers), without the
                    # ATTACH lock: this runs inside an LMDB write transaction
                    epoch = lease.epoch
                    table.set_peers(lease.peers(probe=False), epoch)
                taken, gone = table.claim(cands, self.ready)
            removed.extend(gone)
            return taken
        return claim

    def restore(self, removed: list) -> None:
        """Put back what a claim removed (the reservation failed: LMDB still has them)."""
        with self.lock:
            for i in range(0, len(removed), 3):
                self.table.put(removed[i], removed[i + 1], removed[i + 2])

    def remove_device(self, ndev: int, dev: int) -> None:
        """Every entry of device `dev` leaves the table (one C call)."""
        with self.lock:
            self.table.remove_device(ndev, dev)
