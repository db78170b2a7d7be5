"""`kvstore fsck`'s consistency checks of the index against the slots: the index's
structure in one LMDB snapshot (pass 2, `IndexScan`), the header (and with --deep the
payload) of every referenced slot on every rank (pass 3), the slots no list holds
(pass 4) and the devices a server fenced (pass 5). `IndexChecks` turns each
inconsistency into a finding; the repairs are `fsck_repair`'s."""
from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvstore.errors import CorruptIndex, CorruptSlot, KVStoreError
from kvstore.index.core import Index
from kvstore.index.maint import snapshot
from kvstore.index.rows import Entry
from kvstore.tools.fsck_report import apply_fix, short_key
from kvstore.tools.fsck_scan import FsckContext, SlotReader


@dataclass(slots=True)
class IndexScan:
    """What pass 2 read from the index snapshot, for the later passes and the repair."""
    entries: list[Entry]               # the entries whose slot is in range
    by_slot: dict[int, list[Entry]]    # slot -> the entries pointing at it
    counters: dict                     # the meta counters (and fence rows)
    unlisted: np.ndarray               # slots below high_water neither used, free nor reserved
    reserved: list                     # the reserved rows (slot, generation, key)
    max_gen: int                       # the highest generation seen (index or slot headers)


@dataclass(slots=True)
class SlotFault:
    """One rank's failed check of a referenced slot (pass 3), before the re-check."""
    kind: str
    detail: str
    rank: int
    entry: Entry


class IndexChecks:
    """Passes 2 to 5: the index against itself and against the slots."""

    def __init__(self, ctx: FsckContext, reader: SlotReader):
        self.ctx = ctx
        self.reader = reader

    # ---------------------------------------------------------------- pass 2: index
    def open_index(self) -> Index | None:
        """Open the index read-only; None (with a finding) when it is unusable."""
        ctx = self.ctx
        if not os.path.isdir(ctx.index_dir) or not os.path.isfile(os.path.join(ctx.index_dir, "data.mdb")):
            ctx.rep.add("index_missing", f"{ctx.index_dir} (data.mdb) is missing; "
                        "`kvstore fsck --rebuild-index` recreates it from the slot headers")
            return None
        try:
            ix = Index(ctx.index_dir, None, readonly=True)
        except CorruptIndex as exc:
            ctx.rep.add("index_unreadable", f"{exc}")
            return None
        if ix.capacity_slots != ctx.cap:
            ctx.rep.add("capacity_mismatch", f"the index has {ix.capacity_slots} slots, the fingerprint "
                        f"{ctx.cap}; `kvstore fsck --rebuild-index` recreates the index")
            ix.close()
            return None
        return ix

    def scan_index(self, ix: Index) -> IndexScan:
        """Pass 2 in one snapshot. Returns what the later passes need."""
        rep, cap = self.ctx.rep, self.ctx.cap
        with snapshot(ix) as snap:
            counters = snap.counters()
            entries = list(snap.entries())
            slot_rows = dict(snap.slot_rows())
            lru_rows = list(snap.lru_rows())
            free_rows = list(snap.free_rows())
            reserved_rows = list(snap.reserved_rows())
            owned_rows = list(snap.owned_rows())
            malformed = list(snap.malformed)
        for db, k in malformed:
            rep.add("malformed_row", f"{db} db row {short_key(k)} does not decode", key=k)
        for name in ("capacity", "high_water", "tick", "generation", "format"):
            if name not in counters:
                rep.add("counter", f"meta counter {name!r} is missing")
        hw = counters.get("high_water", 0)
        tick = counters.get("tick", 0)
        gen = counters.get("generation", 0)
        if hw > cap:
            rep.add("counter", f"high_water {hw} > capacity {cap}")
            hw = cap

        by_slot: dict[int, list] = defaultdict(list)
        good_range = []
        max_tick = max_gen = 0
        for e in entries:
            max_tick = max(max_tick, e.tick)
            max_gen = max(max_gen, e.generation)
            if not 0 <= e.slot < cap:
                rep.add("slot_out_of_range", f"key points at slot {e.slot}, outside [0, {cap})",
                        slot=e.slot, key=e.key)
                continue
            by_slot[e.slot].append(e)
            good_range.append(e)
        if max_tick > tick:
            rep.add("counter", f"meta tick {tick} is behind an entry's tick {max_tick}")
        if max_gen > gen:
            rep.add("counter", f"meta generation {gen} is behind an entry's generation {max_gen}")
        for s, es in by_slot.items():
            if len(es) > 1:
                rep.add("slot_shared", f"slot {s} is referenced by {len(es)} keys: "
                        + ", ".join(short_key(e.key) for e in es), slot=s)
            elif slot_rows.get(s) != es[0].key:
                back = slot_rows.get(s)
                rep.add("slot_key_mismatch", f"slot {s} -> key row is "
                        + ("missing" if back is None else f"key {short_key(back)}"), slot=s, key=es[0].key)
        keyslot = {(e.key, e.slot) for e in good_range}
        for s, k in slot_rows.items():
            if (k, s) not in keyslot:
                rep.add("stray_slot_row", f"slot {s} -> key row has no matching entry", slot=s, key=k)
        expected = {(e.tick, e.slot): e for e in good_range}
        lru_set = set(lru_rows)
        for (t, s), e in expected.items():
            if (t, s) not in lru_set:
                rep.add("lru_missing", f"entry (slot {s}, tick {t}) has no LRU row", slot=s, key=e.key)
        for t, s in lru_rows:
            if (t, s) not in expected:
                rep.add("lru_stray", f"LRU row (tick {t}, slot {s}) has no entry", slot=s)

        # slot accounting: each slot below high_water in exactly one of used/free/reserved
        state = np.zeros(cap, dtype=np.uint8)  # bit 1 used, 2 free, 4 reserved
        for s in by_slot:
            state[s] |= 1
            if s >= hw:
                rep.add("free_conflict", f"slot {s} is in use but lies above high_water {hw}, so it "
                        "would be handed out again", slot=s, key=by_slot[s][0].key)
        for s in free_rows:
            if not 0 <= s < cap or s >= hw:
                rep.add("free_conflict", f"free row for slot {s} lies outside [0, high_water {hw})", slot=s)
                continue
            if state[s] & 1:
                rep.add("free_conflict", f"slot {s} is listed free but used by key "
                        f"{short_key(by_slot[s][0].key)}", slot=s, key=by_slot[s][0].key)
            state[s] |= 2
        for s, rgen, rkey in reserved_rows:
            if not 0 <= s < cap or s >= hw:
                rep.add("free_conflict", f"reserved row for slot {s} lies outside [0, high_water {hw})",
                        slot=s, key=rkey)
                continue
            if state[s] & 3:
                rep.add("free_conflict", f"slot {s} is reserved and also "
                        + ("used" if state[s] & 1 else "free"), slot=s, key=rkey)
            if rgen > gen:
                rep.add("counter", f"reservation of slot {s} has generation {rgen} > meta generation {gen}",
                        slot=s, key=rkey)
            state[s] |= 4
        reserved_slots = {s for s, _, _ in reserved_rows}
        for who, s in owned_rows:
            if s not in reserved_slots:
                pid = int.from_bytes(who[:4], "big")
                rep.add("owned_stray", f"owned row of engine pid {pid} names slot {s}, which is not "
                        "reserved (reclaiming that engine would free whatever reservation the slot "
                        "gets next)", slot=s)
        unlisted = np.flatnonzero(state[:hw] == 0)
        rep.stats.update(entries=len(entries), reserved_in_flight=len(reserved_rows),
                         capacity_slots=cap, high_water=hw)
        return IndexScan(entries=good_range, by_slot=by_slot, counters=counters, unlisted=unlisted,
                         reserved=reserved_rows, max_gen=max(max_gen, gen))

    # ---------------------------------------------------------------- pass 3/4: slot data
    def check_data(self, ix: Index, scan: IndexScan) -> set[bytes]:
        """Pass 3. Returns the keys whose slot failed a check (on any rank)."""
        ctx, reader = self.ctx, self.reader
        by_slot = scan.by_slot
        slots = np.array(sorted(by_slot), dtype=np.int64)
        plen = ctx.layout.block_bytes
        bad: dict[tuple[bytes, int], list[SlotFault]] = defaultdict(list)  # (key, slot) -> faults
        max_hdr_gen = 0
        for r in range(ctx.layout.tp_size):
            def on_slot(s, h, payload_ok, r=r):
                nonlocal max_hdr_gen
                for e in by_slot[s]:
                    kind = detail = None
                    if isinstance(h, OSError):
                        reason = reader.bad_files.get(ctx.geo.file_number(s))
                        kind, detail = "slot_unreadable", reason or f"read failed: {h}"
                    elif isinstance(h, CorruptSlot):
                        kind, detail = "header_corrupt", str(h).removeprefix(f"slot {s}: ")
                    else:
                        max_hdr_gen = max(max_hdr_gen, h.generation)
                        if h.key != e.key:
                            kind, detail = "key_mismatch", f"header claims key {short_key(h.key)}"
                        elif h.slot != s:
                            kind, detail = "header_mismatch", f"header says slot {h.slot}"
                        elif h.generation != e.generation:
                            kind, detail = ("generation_mismatch", f"header generation {h.generation}, "
                                            f"index {e.generation}")
                        elif h.payload_len != plen:
                            kind, detail = ("header_mismatch", f"header payload length {h.payload_len}, "
                                            f"layout {plen}")
                        elif payload_ok is False:
                            kind, detail = "payload_corrupt", "payload checksum mismatch"
                    if kind is not None:
                        bad[(e.key, s)].append(SlotFault(kind, detail, r, e))
            label = f"rank {r}: " + ("verifying slots" if ctx.deep else "reading slot headers")
            reader.read_slots(r, slots, ctx.deep, on_slot, label)
        scan.max_gen = max(scan.max_gen, max_hdr_gen)
        changed = 0
        bad_keys: set[bytes] = set()
        for (key, s), faults in bad.items():
            e = faults[0].entry
            if not ctx.repair:
                # An engine (attached before or during the check: it is lock-free) may have
                # evicted and rewritten the slot after our snapshot: the finding stands only
                # if the entry is still the one we checked.
                now = ix.lookup(key)
                if now is None or now.slot != e.slot or now.generation != e.generation:
                    changed += 1
                    continue
            dev = ctx.geo.device_of(s)
            away = dev in ctx.missing_devices
            if not away:
                bad_keys.add(key)
            for fault in faults:
                f = ctx.rep.add(fault.kind, f"slot {s}" + (f" rank {fault.rank}" if ctx.layout.tp_size > 1 else "")
                                + f": {fault.detail}" + (f" (device {dev} is missing: the entry is kept; "
                                                         "mount the device and run fsck again)" if away else ""),
                                slot=s, key=key, rank=fault.rank)
                if away:
                    ctx.kept.add(id(f))
        ctx.rep.stats["slots_checked"] = len(slots)
        ctx.rep.stats["changed_during_check"] = changed
        return bad_keys

    def check_unlisted(self, scan: IndexScan) -> None:
        """Pass 4: classify slots that belong to no list as orphans or leaked slots."""
        rep = self.ctx.rep
        slots = scan.unlisted
        if not len(slots):
            return
        held = {e.key: e.slot for e in scan.entries}

        def on_slot(s, h, _ok):
            if isinstance(h, Exception):
                rep.add("leaked_slot", f"slot {s} is neither used, free nor reserved "
                        f"(no valid block: {h})", slot=s)
                return
            scan.max_gen = max(scan.max_gen, h.generation)
            where = held.get(h.key)
            claim = ("which the index does not hold" if where is None
                     else f"which the index holds at slot {where}")
            rep.add("orphan", f"slot {s} is neither used, free nor reserved; its header claims "
                    f"key {short_key(h.key)} (generation {h.generation}), {claim}", slot=s, key=h.key)
        self.reader.read_slots(0, np.asarray(slots, dtype=np.int64), False, on_slot, "reading unlisted slots")

    # ---------------------------------------------------------------- pass 5: fenced devices
    def check_fences(self) -> None:
        """Devices fenced by a server (index meta `fenced.<d>`): each is a finding; with
        --repair one whose data directory probes usable (present, its marker naming this
        store, a file created and written with O_DIRECT) is re-admitted: the fence is
        cleared, its slots are free again. Runs after the data pass, so any entry still
        pointing at the device was verified (and dropped if bad) first."""
        ctx = self.ctx
        if len(ctx.dirs) < 2:
            return
        from kvstore.io.datadirs import probe_data_dir
        try:
            with Index(ctx.index_dir, None, readonly=True) as ix:
                fences = ix.fenced_devices()
        except KVStoreError:
            return
        ctx.rep.stats["fenced_devices"] = sorted(fences)
        for d, (reason, since) in sorted(fences.items()):
            ddir = ctx.dirs[d] if d < len(ctx.dirs) else f"device {d}"
            if not ctx.repair:
                there = d < len(ctx.dirs) and os.path.isdir(ddir)
                ctx.rep.add("device_fenced", f"device {d} ({ddir}) was fenced as failed ({reason}) at "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}; its "
                            f"directory is {'present' if there else 'missing'}: run with --repair "
                            "to re-admit it once the device is healthy")
                continue
            bad = probe_data_dir(ddir, ctx.path, d, direct=True) if d < len(ctx.dirs) else ("missing", ddir)
            f = ctx.rep.add("device_fenced", f"device {d} ({ddir}) was fenced as failed ({reason})"
                            + (f"; still not usable: {bad[1]}" if bad else "; it probes healthy"))
            if bad is None:
                def readmit(d=d):
                    with Index(ctx.index_dir, None) as ix:    # writer (we hold the lock)
                        ix.readmit_device(d)
                apply_fix(f, readmit)
                if f.fixed:
                    ctx.rep.stats.setdefault("readmitted_devices", []).append(d)
