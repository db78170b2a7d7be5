"""`kvstore fsck STORE`: check (and optionally repair) a store, modelled on e2fsck.

Passes:

1. store files: the fingerprint (`kvstore.json`) parses; every rank's slot files exist,
   are regular files (not symlinks) and have exactly the size the geometry says.
2. index structure, in one consistent LMDB snapshot: the index opens and holds its named
   databases; every key's slot is in range and referenced by exactly one key; slot -> key
   and key -> slot agree; LRU rows and entries agree; free and reserved rows do not
   overlap used slots or each other and lie below high_water; counters are not behind
   the entries; used + free + reserved covers every slot.
3. slot data: every referenced slot's header (on every rank) parses, passes its header
   checksum and names the key, slot number, generation and payload length the index
   expects; with --deep the payload checksum too (whole slots are streamed through
   io_uring rings at the device's speed: two rings per rank, each double-buffered, with
   the checksums computed while the next batches are read).
4. unlisted slots: a slot that is neither used, free nor reserved is an *orphan* when its
   header claims a key the index does not hold there, a *leaked* slot otherwise.

Read-only by default, without any lock: safe while engines use the store, however many
are attached (the structure is read from one snapshot; a data finding is re-checked
against the live index and dropped if the entry changed meanwhile). `--repair` takes the
store's exclusive lock (an offline repair: refused, naming the attached engines' pids,
while any engine is attached; no engine attaches while it runs), fixes slot files (recreates missing ones,
restores sizes, replaces symlinks), drops dangling and corrupt entries, frees orphans
and leaked slots and rebuilds the free and LRU lists (the index is rebuilt from the
surviving entries, keeping their LRU order and the counters, whenever its structure is
damaged), then checks the result again. `--rebuild-index` recreates `index/` from the
slot headers (implies --repair): every slot is read in full and adopted when its header
and payload checksum hold on every rank. A rebuilt index adopts every slot holding a
valid block, including blocks that had been evicted but not yet overwritten, with the LRU
order approximated by generation (oldest write = coldest).

Exit status, as e2fsck (a sum): 0 clean, 1 errors corrected, 4 errors left uncorrected,
8 operational error, 16 usage error, 32 cancelled by the user.
"""
from __future__ import annotations

import os
import stat
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from kvstore import _slotfile
from kvstore.store import shared
from kvstore._slotfile import HEADER_SIZE, SlotFile
from kvstore.store.disk import RankIO, WriterLock, rank_dir, slot_file_path
from kvstore.errors import (
    CorruptIndex, CorruptSlot, DataDirError, KVStoreError, StoreLocked, StoreNotFound,
)
from kvstore.index.core import Index
from kvstore.index.maint import rebuild_index, snapshot
from kvstore.format.identity import describe_differences, model_identity
from kvstore.format.layout import (
    FINGERPRINT, device_dirs, format_size, read_fingerprint, stored_identity,
)

__all__ = ["fsck", "Finding", "Report", "KINDS", "format_text",
           "EXIT_CLEAN", "EXIT_CORRECTED", "EXIT_UNCORRECTED", "EXIT_OPERATIONAL",
           "EXIT_USAGE", "EXIT_CANCELLED"]

EXIT_CLEAN = 0
EXIT_CORRECTED = 1
EXIT_UNCORRECTED = 4
EXIT_OPERATIONAL = 8
EXIT_USAGE = 16
EXIT_CANCELLED = 32

# Every finding kind, with what it means. Docs (docs/fsck.md) list the same table.
KINDS = {
    # pass 1: store files
    "fingerprint_missing": "kvstore.json is missing: the directory is not a store (not repairable)",
    "fingerprint_invalid": "kvstore.json does not parse or is inconsistent (not repairable: restore it)",
    "slot_file_missing": "a rank's slot file (or rank directory) is missing",
    "slot_file_size": "a slot file is truncated or longer than the geometry says",
    "slot_file_invalid": "a slot file is a symlink or not a regular file",
    "model_changed": "the store's model identity differs from --model's weights or config (the "
                     "next engine start re-initialises the store, or refuses it with "
                     "on_model_change \"refuse\"; not repaired by fsck)",
    "device_fenced": "a device the server fenced as failed (--repair re-admits it once its "
                     "directory is back, writable and O_DIRECT-capable)",
    # pass 2: index structure
    "index_missing": "index/ or its data.mdb is missing (--rebuild-index recreates it)",
    "index_unreadable": "the LMDB index cannot be opened or lacks its databases (--rebuild-index)",
    "capacity_mismatch": "the index's capacity differs from the fingerprint's (--rebuild-index)",
    "malformed_row": "an index row whose key or value has the wrong length",
    "slot_out_of_range": "a key points at a slot outside [0, capacity)",
    "slot_shared": "one slot is referenced by more than one key",
    "slot_key_mismatch": "key -> slot has no matching slot -> key row",
    "stray_slot_row": "a slot -> key row without the matching key -> slot entry",
    "lru_missing": "an entry without its LRU row",
    "lru_stray": "an LRU row without an entry",
    "free_conflict": "a slot listed free or reserved that is also in use (or above high_water)",
    "counter": "an index counter is behind the entries (tick, generation, high_water)",
    "leaked_slot": "a slot that is neither used, free nor reserved, holding no valid block",
    "orphan": "a slot that is neither used, free nor reserved whose header claims a key",
    "owned_stray": "an engine's reservation row (owned db) names a slot that is not reserved",
    # pass 3: slot data
    "slot_unreadable": "a referenced slot cannot be read (I/O error, or its file is bad)",
    "header_corrupt": "a referenced slot's header does not parse or fails its checksum",
    "key_mismatch": "a referenced slot's header names another key",
    "generation_mismatch": "a referenced slot's header has another generation (stale or torn write)",
    "header_mismatch": "a referenced slot's header names another slot number or payload length",
    "payload_corrupt": "a referenced slot's payload checksum does not hold (--deep)",
}
# Kinds fixed by dropping the entry (the index stays structurally sound).
_DATA_KINDS = {"slot_unreadable", "header_corrupt", "key_mismatch", "generation_mismatch",
               "header_mismatch", "payload_corrupt"}
# Fixed by giving every reservation back, which also empties the owned db (the offline
# repair runs with no engine attached: no reservation has a live owner).
_RECLAIM_KINDS = {"owned_stray"}
_FILE_KINDS = {"slot_file_missing", "slot_file_size", "slot_file_invalid"}
_INDEX_OPEN_KINDS = {"index_missing", "index_unreadable", "capacity_mismatch"}

DEFAULT_STAGING = 256 << 20
READERS = 2  # rings per rank for deep reads (see _Check.read_slots)


@dataclass
class Finding:
    kind: str
    detail: str
    slot: int | None = None
    key: bytes | None = None
    rank: int | None = None
    fixed: bool = False

    def to_json(self) -> dict:
        return {"kind": self.kind, "slot": self.slot, "key": self.key.hex() if self.key is not None else None,
                "rank": self.rank, "detail": self.detail, "fixed": self.fixed}


@dataclass
class Report:
    store: str
    mode: str = "check"           # check | repair | rebuild-index
    deep: bool = False
    findings: list[Finding] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    error: str | None = None
    cancelled: bool = False

    def add(self, kind: str, detail: str, **kw) -> Finding:
        assert kind in KINDS, kind
        f = Finding(kind, detail, **kw)
        self.findings.append(f)
        return f

    def counts(self) -> dict:
        return dict(sorted(Counter(f.kind for f in self.findings).items()))

    @property
    def exit_code(self) -> int:
        if self.cancelled:
            return EXIT_CANCELLED
        if self.error is not None:
            return EXIT_OPERATIONAL
        code = 0
        if any(f.fixed for f in self.findings):
            code |= EXIT_CORRECTED
        if any(not f.fixed for f in self.findings):
            code |= EXIT_UNCORRECTED
        return code

    def to_json(self) -> dict:
        return {
            "store": self.store,
            "mode": self.mode,
            "deep": self.deep,
            "exit_code": self.exit_code,
            "clean": not self.findings and self.error is None and not self.cancelled,
            "error": self.error,
            "errors_found": len(self.findings),
            "errors_corrected": sum(f.fixed for f in self.findings),
            "counts": self.counts(),
            "findings": [f.to_json() for f in self.findings],
            "stats": self.stats,
        }


def _short(key: bytes | None) -> str:
    if key is None:
        return "-"
    h = key.hex()
    return h if len(h) <= 20 else f"{h[:16]}..{h[-2:]}"


def _device_absent(ddir: str, store: str, d: int) -> str:
    """Why device d's data directory is not this store's device d ("" when it is): gone,
    or without a `kvstore-data.json` naming this store and device (an empty mount point
    of an unmounted device). The store directory itself carries no marker."""
    import json
    if not os.path.isdir(ddir):
        return "no such directory"
    if os.path.normpath(ddir) == os.path.normpath(store):
        return ""
    try:
        with open(os.path.join(ddir, "kvstore-data.json"), "rb") as f:
            doc = json.loads(f.read(1 << 16))
    except FileNotFoundError:
        return "no kvstore-data.json: an empty mount point?"
    except (OSError, ValueError) as exc:
        return f"kvstore-data.json unreadable: {exc}"
    if not isinstance(doc, dict) or doc.get("store") != store or doc.get("device") != d:
        return f"kvstore-data.json names {doc!r}"
    return ""


class _Check:
    """One fsck run over one store (the passes above); fills a Report."""

    def __init__(self, path: str, report: Report, *, deep: bool, repair: bool,
                 staging_bytes: int, queue_depth: int, progress, engine_pids: list[int] = ()):
        self.path = path
        self.rep = report
        self.deep = deep
        self.repair = repair
        self.staging_bytes = staging_bytes
        self.queue_depth = queue_depth
        self.progress = progress
        self.engine_pids = list(engine_pids)
        self.layout, self.geo, doc = read_fingerprint(path)
        self.dirs = device_dirs(path, doc)   # one per device (the store itself if no data_dirs)
        self.cap = self.geo.num_slots
        self.index_dir = os.path.join(path, "index")
        self.bad_files: dict[int, str] = {}   # file number -> reason, of the rank being read
        self.missing_devices: set[int] = set()   # data directories that are gone (check_files)
        self._kept: set[int] = set()   # ids of findings on a missing device: never "fixed"

    # ---------------------------------------------------------------- pass 1: files
    def check_files(self) -> None:
        self.missing_devices: set[int] = set()
        for d in range(len(self.dirs)):
            self._check_device_files(d)
        self.rep.stats["devices"] = len(self.dirs)

    def _check_device_files(self, d: int) -> None:
        g = self.geo
        ddir = self.dirs[d]
        absent = _device_absent(ddir, self.path, d)   # "" for the store directory itself
        if absent:
            # Most often a device that is not mounted: never recreate its files elsewhere
            # (on the root file system under the mount point), and keep its entries
            # (check_data): they are valid again once it is back. An empty mount point
            # (the directory is there, its kvstore-data.json is not) is one too.
            self.missing_devices.add(d)
            for r in range(self.layout.tp_size):
                self.rep.add("slot_file_missing", f"data directory {ddir} (device {d}) is missing "
                             f"({absent}): mount the device (or restore the directory); fsck does "
                             f"not recreate it", rank=r)
            return
        for r in range(self.layout.tp_size):
            rd = rank_dir(ddir, r)
            try:
                st = os.lstat(rd)
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                    f = self.rep.add("slot_file_invalid", f"{rd} is not a directory (a symlink or a file)", rank=r)
                    if self.repair:
                        self._fix(f, self._replace_rank_dir, rd, d)
                    continue
            except FileNotFoundError:
                f = self.rep.add("slot_file_missing", f"rank directory {rd} is missing "
                                 f"({g.device_files(d)} slot file(s) with it)", rank=r)
                if self.repair:
                    self._fix(f, self._recreate_rank, r, d)
                continue
            for i in range(g.device_files(d)):
                p = slot_file_path(ddir, r, i)
                want = g.device_file_slots(d, i) * g.slot_size
                first = i * g.slots_per_file * g.num_devices + d
                where = g.slot_range_text(d, i)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    f = self.rep.add("slot_file_missing", f"{p} ({where}) is missing", rank=r, slot=first)
                    if self.repair:
                        self._fix(f, self._create_file, p, g.device_file_slots(d, i))
                    continue
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
                    what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                    f = self.rep.add("slot_file_invalid", f"{p} ({where}) is {what}", rank=r, slot=first)
                    if self.repair and stat.S_ISLNK(st.st_mode):
                        self._fix(f, self._replace_symlink, p, g.device_file_slots(d, i))
                    continue
                if st.st_size != want:
                    how = "truncated" if st.st_size < want else "too long"
                    f = self.rep.add("slot_file_size", f"{p} ({where}) is {st.st_size} bytes, expected "
                                     f"{want} ({how})", rank=r, slot=first)
                    if self.repair:
                        self._fix(f, self._resize, p, want)

    def _fix(self, finding: Finding, fn, *args) -> None:
        try:
            fn(*args)
            finding.fixed = True
        except (OSError, KVStoreError) as exc:
            finding.detail += f"; repair failed: {exc}"

    def _create_file(self, p: str, nslots: int) -> None:
        SlotFile(p, self.geo.slot_size, nslots, direct=True, create=True).close()

    def _recreate_rank(self, r: int, d: int = 0) -> None:
        os.mkdir(rank_dir(self.dirs[d], r), 0o700)
        for i in range(self.geo.device_files(d)):
            self._create_file(slot_file_path(self.dirs[d], r, i), self.geo.device_file_slots(d, i))

    def _replace_rank_dir(self, rd: str, d: int = 0) -> None:
        if not os.path.islink(rd):
            raise DataDirError(f"{rd} is not a directory; move it away by hand")
        os.unlink(rd)
        self._recreate_rank(int(os.path.basename(rd)[4:]), d)

    def _replace_symlink(self, p: str, nslots: int) -> None:
        os.unlink(p)  # removes the link only, never its target
        self._create_file(p, nslots)

    def _resize(self, p: str, size: int) -> None:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            else:
                os.posix_fallocate(fd, 0, size)  # the missing tail reads as zeros: empty slots
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- pass 2: index
    def open_index(self) -> Index | None:
        """Open the index read-only; None (with a finding) when it is unusable."""
        if not os.path.isdir(self.index_dir) or not os.path.isfile(os.path.join(self.index_dir, "data.mdb")):
            self.rep.add("index_missing", f"{self.index_dir} (data.mdb) is missing; "
                         "`kvstore fsck --rebuild-index` recreates it from the slot headers")
            return None
        try:
            ix = Index(self.index_dir, None, readonly=True)
        except CorruptIndex as exc:
            self.rep.add("index_unreadable", f"{exc}")
            return None
        if ix.capacity_slots != self.cap:
            self.rep.add("capacity_mismatch", f"the index has {ix.capacity_slots} slots, the fingerprint "
                         f"{self.cap}; `kvstore fsck --rebuild-index` recreates the index")
            ix.close()
            return None
        return ix

    def scan_index(self, ix: Index) -> dict:
        """Pass 2 in one snapshot. Returns what the later passes need."""
        rep, cap = self.rep, self.cap
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
            rep.add("malformed_row", f"{db} db row {_short(k)} does not decode", key=k)
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
                        + ", ".join(_short(e.key) for e in es), slot=s)
            elif slot_rows.get(s) != es[0].key:
                back = slot_rows.get(s)
                rep.add("slot_key_mismatch", f"slot {s} -> key row is "
                        + ("missing" if back is None else f"key {_short(back)}"), slot=s, key=es[0].key)
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
                        f"{_short(by_slot[s][0].key)}", slot=s, key=by_slot[s][0].key)
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
        self.rep.stats.update(entries=len(entries), reserved_in_flight=len(reserved_rows),
                              capacity_slots=cap, high_water=hw)
        return {"entries": good_range, "by_slot": by_slot, "counters": counters, "unlisted": unlisted,
                "reserved": reserved_rows, "max_gen": max(max_gen, gen)}

    # ---------------------------------------------------------------- pass 3/4: slot data
    def _open_rank(self, r: int, nslots: int, deep: bool, *, staging_bytes: int | None = None,
                   queue_depth: int | None = None) -> RankIO:
        # Staging sized to the job (registering 256 MiB costs more than checking a small store).
        ss = self.geo.slot_size
        need = 2 * nslots * ss if deep else -(-nslots * HEADER_SIZE // ss) * ss
        staging = max(ss, min(staging_bytes or self.staging_bytes, need))
        return RankIO(self.path, r, readonly=True, missing_ok=True,
                      queue_depth=queue_depth or self.queue_depth, staging_bytes=staging)

    def read_slots(self, r: int, slots: np.ndarray, deep: bool, on_slot, label: str) -> None:
        """Read rank r's `slots` and call on_slot(slot, header_or_exc, payload_ok) for each
        (payload_ok: None unless deep). Sets self.bad_files for the rank's unopenable files.

        Deep reads are split over READERS rings (each with half the queue depth and half the
        staging memory, each double-buffered on its own thread), so that while one ring
        drains the tail of a batch the other keeps the device busy: the total in flight
        stays near --queue-depth, as fio's does. Checksums run on the reader threads
        (xxh3 releases the GIL); on_slot calls are serialized.
        """
        import threading
        from concurrent.futures import ThreadPoolExecutor
        plen = self.layout.block_bytes
        ss = self.geo.slot_size
        total_bytes = len(slots) * (ss if deep else HEADER_SIZE)
        prog = self.progress(label, total_bytes, "B") if self.progress else None
        lock = threading.Lock()
        cancel = threading.Event()   # set when the main thread unwinds (Ctrl-C, an error)
        t0 = time.perf_counter()
        readers = READERS if deep and len(slots) >= READERS * 8 and self.queue_depth >= READERS else 1
        rios = []
        try:
            for _ in range(readers):
                # --staging and --queue-depth are per device: each RankIO reads all
                # devices at once (one ring each), so a batch is split over them.
                rios.append(self._open_rank(r, -(-len(slots) // readers), deep,
                                            staging_bytes=self.staging_bytes * len(self.dirs) // readers,
                                            queue_depth=self.queue_depth // readers))
            self.bad_files = dict(rios[0].bad_files)
            if deep:
                def consume_for(part):
                    def consume(start, stop, images, res):
                        if cancel.is_set():
                            raise KVStoreError("fsck cancelled")
                        out = []
                        for j in range(stop - start):
                            s = int(part[start + j])
                            if res[j] < 0:
                                out.append((s, OSError(-int(res[j]), os.strerror(-int(res[j]))), None))
                                continue
                            img = images[j]
                            try:
                                h = _slotfile.decode_header(img[:HEADER_SIZE], s)
                            except CorruptSlot as exc:
                                out.append((s, exc, None))
                                continue
                            ok = None
                            if h.payload_len == plen:
                                ok = (_slotfile.payload_checksum(img[HEADER_SIZE:HEADER_SIZE + plen])
                                      == h.payload_checksum)
                            out.append((s, h, ok))
                        with lock:
                            for item in out:
                                on_slot(*item)
                            if prog:
                                prog.update((stop - start) * ss)
                    return consume
                parts = np.array_split(slots, readers)
                if readers == 1:
                    rios[0].scan_slots(parts[0], consume_for(parts[0]))
                else:
                    with ThreadPoolExecutor(readers, thread_name_prefix="kvstore-fsck") as pool:
                        futs = [pool.submit(rio.scan_slots, part, consume_for(part))
                                for rio, part in zip(rios, parts)]
                        try:
                            for f in futs:
                                f.result()
                        except BaseException:
                            cancel.set()  # readers stop after their current batch
                            raise
            else:
                step = 1 << 16
                for start in range(0, len(slots), step):
                    chunk = slots[start:start + step]
                    for s, h in zip(chunk.tolist(), rios[0].read_headers(chunk)):
                        on_slot(s, h, None)
                    if prog:
                        prog.update(len(chunk) * HEADER_SIZE)
        finally:
            per_dev = self.rep.stats.setdefault("device_bytes_read", [0] * len(self.dirs))
            for rio in rios:
                for d in range(len(per_dev)):
                    per_dev[d] += int(rio.io_bytes[d, 0])
                rio.close()
            if prog:
                prog.close()
        st = self.rep.stats
        st["bytes_read"] = st.get("bytes_read", 0) + total_bytes
        st["read_seconds"] = st.get("read_seconds", 0.0) + (time.perf_counter() - t0)

    def check_data(self, ix: Index, scan: dict) -> set[bytes]:
        """Pass 3. Returns the keys whose slot failed a check (on any rank)."""
        by_slot = scan["by_slot"]
        slots = np.array(sorted(by_slot), dtype=np.int64)
        plen = self.layout.block_bytes
        bad: dict[tuple[bytes, int], list] = defaultdict(list)  # (key, slot) -> findings args
        max_hdr_gen = 0
        for r in range(self.layout.tp_size):
            def on_slot(s, h, payload_ok, r=r):
                nonlocal max_hdr_gen
                for e in by_slot[s]:
                    kind = detail = None
                    if isinstance(h, OSError):
                        reason = self.bad_files.get(self.geo.file_number(s))
                        kind, detail = "slot_unreadable", reason or f"read failed: {h}"
                    elif isinstance(h, CorruptSlot):
                        kind, detail = "header_corrupt", str(h).removeprefix(f"slot {s}: ")
                    else:
                        max_hdr_gen = max(max_hdr_gen, h.generation)
                        if h.key != e.key:
                            kind, detail = "key_mismatch", f"header claims key {_short(h.key)}"
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
                        bad[(e.key, s)].append((kind, detail, r, e))
            label = f"rank {r}: " + ("verifying slots" if self.deep else "reading slot headers")
            self.read_slots(r, slots, self.deep, on_slot, label)
        scan["max_gen"] = max(scan["max_gen"], max_hdr_gen)
        changed = 0
        bad_keys: set[bytes] = set()
        for (key, s), items in bad.items():
            e = items[0][3]
            if not self.repair:
                # An engine (attached before or during the check: it is lock-free) may have
                # evicted and rewritten the slot after our snapshot: the finding stands only
                # if the entry is still the one we checked.
                now = ix.lookup(key)
                if now is None or now.slot != e.slot or now.generation != e.generation:
                    changed += 1
                    continue
            dev = self.geo.device_of(s)
            away = dev in self.missing_devices
            if not away:
                bad_keys.add(key)
            for kind, detail, r, _ in items:
                f = self.rep.add(kind, f"slot {s}" + (f" rank {r}" if self.layout.tp_size > 1 else "")
                                 + f": {detail}" + (f" (device {dev} is missing: the entry is kept; "
                                                    "mount the device and run fsck again)" if away else ""),
                                 slot=s, key=key, rank=r)
                if away:
                    self._kept.add(id(f))
        self.rep.stats["slots_checked"] = len(slots)
        self.rep.stats["changed_during_check"] = changed
        return bad_keys

    def check_unlisted(self, scan: dict) -> None:
        """Pass 4: classify slots that belong to no list as orphans or leaked slots."""
        slots = scan["unlisted"]
        if not len(slots):
            return
        held = {e.key: e.slot for e in scan["entries"]}

        def on_slot(s, h, _ok):
            if isinstance(h, Exception):
                self.rep.add("leaked_slot", f"slot {s} is neither used, free nor reserved "
                             f"(no valid block: {h})", slot=s)
                return
            scan["max_gen"] = max(scan["max_gen"], h.generation)
            where = held.get(h.key)
            claim = ("which the index does not hold" if where is None
                     else f"which the index holds at slot {where}")
            self.rep.add("orphan", f"slot {s} is neither used, free nor reserved; its header claims "
                         f"key {_short(h.key)} (generation {h.generation}), {claim}", slot=s, key=h.key)
        self.read_slots(0, np.asarray(slots, dtype=np.int64), False, on_slot, "reading unlisted slots")

    # ---------------------------------------------------------------- repair
    def do_repair(self, scan: dict, bad_keys: set[bytes]) -> None:
        # File findings were fixed (or not) in pass 1 and index-open findings by the
        # rebuild; what is left is fixed here, by dropping entries or rebuilding the index.
        pending = [f for f in self.rep.findings if not f.fixed and id(f) not in self._kept
                   and f.kind not in _FILE_KINDS and f.kind not in _INDEX_OPEN_KINDS]
        if not pending:
            return
        structural = [f for f in pending if f.kind not in _DATA_KINDS | _RECLAIM_KINDS]
        if not structural:
            with Index(self.index_dir, None) as ix:  # writer (we hold the lock)
                ix.reclaim_reserved()
                ix.drop(sorted(bad_keys))
            for f in pending:
                f.fixed = True
            self.rep.stats["repair"] = f"{len(bad_keys):,} entr{'y' if len(bad_keys) == 1 else 'ies'} dropped"
            return
        keep = [e for e in scan["entries"] if e.key not in bad_keys]
        # A slot claimed by several keys can only have passed the data checks for one of
        # them (headers name one key); drop the others.
        seen: set[int] = set()
        entries = []
        for e in sorted(keep, key=lambda e: e.tick):
            if e.slot in seen:
                continue
            seen.add(e.slot)
            entries.append((e.key, e.slot, e.generation))
        c = scan["counters"]
        counters = {k: c[k] for k in ("hits", "misses", "evictions", "duplicates", "stale_commits") if k in c}
        counters.update({k: v for k, v in c.items() if k.startswith("fenced.")})   # fences stay
        counters["generation"] = scan["max_gen"]
        n = rebuild_index(self.index_dir, self.cap, entries, counters=counters)
        for f in pending:
            f.fixed = True
        self.rep.stats["repair"] = (f"index rebuilt with {n:,} surviving entr{'y' if n == 1 else 'ies'}, "
                                    f"{len(scan['entries']) - n:,} dropped")

    def rebuild_from_headers(self) -> None:
        """--rebuild-index: a new index holding every slot with a valid block. Every slot
        is read in full and only blocks whose header and payload checksum hold (on every
        rank, with the same key and generation) are adopted: a rebuild must not bring back
        a block that a load or an earlier fsck dropped as corrupt."""
        counters: dict = {}
        try:
            with Index(self.index_dir, None, readonly=True) as old:
                s = old.stats()
                counters = {k: s[k] for k in ("hits", "misses", "evictions", "duplicates", "stale_commits")}
                counters["generation"] = s["generation"]
                counters.update(old.fence_rows())   # a fenced device stays fenced
        except KVStoreError:
            pass
        cap, plen = self.cap, self.layout.block_bytes
        keys: list[bytes | None] = [None] * cap
        gens = np.zeros(cap, dtype=np.uint64)
        valid = np.zeros(cap, dtype=bool)
        max_gen = int(counters.get("generation", 0))
        all_slots = np.arange(cap, dtype=np.int64)
        for r in range(self.layout.tp_size):
            def on_slot(s, h, payload_ok, r=r):
                nonlocal max_gen
                if isinstance(h, Exception):
                    valid[s] = False
                    return
                max_gen = max(max_gen, h.generation)
                ok = (h.slot == s and h.payload_len == plen and len(h.key) > 0
                      and payload_ok is True)
                if r == 0:
                    valid[s] = ok
                    keys[s] = h.key
                    gens[s] = h.generation
                elif valid[s] and (not ok or keys[s] != h.key or int(gens[s]) != h.generation):
                    valid[s] = False
            self.read_slots(r, all_slots, True, on_slot, f"rank {r}: verifying every slot")
        fenced = {int(k.split(".", 1)[1]) for k in counters if k.startswith("fenced.")}
        if fenced and self.geo.num_devices > 1:
            # a fenced device's slots hold blocks its fence dropped: never adopt them
            valid[np.isin(np.arange(cap) % self.geo.num_devices, sorted(fenced))] = False
        best: dict[bytes, int] = {}
        for s in np.flatnonzero(valid).tolist():
            k = keys[s]
            if k not in best or gens[s] > gens[best[k]]:
                best[k] = s
        entries = sorted(((k, s, int(gens[s])) for k, s in best.items()), key=lambda x: x[2])
        counters["generation"] = max_gen
        n = rebuild_index(self.index_dir, cap, entries, counters=counters)
        self.rep.stats["rebuilt_entries"] = n
        self.rep.stats["rebuild_slots_scanned"] = cap * self.layout.tp_size

    # ---------------------------------------------------------------- driver
    def run(self, rebuild: bool) -> None:
        self.check_files()
        if rebuild:
            before = len(self.rep.findings)
            ix = self.open_index()
            if ix is not None:
                ix.close()
            self.rebuild_from_headers()
            for f in self.rep.findings[before:]:
                if f.kind in _INDEX_OPEN_KINDS:
                    f.fixed = True
        ix = self.open_index()
        if ix is None:
            return
        try:
            scan = self.scan_index(ix)
            bad_keys = self.check_data(ix, scan)
            self.check_unlisted(scan)
        finally:
            ix.close()
        if self.repair:
            self.do_repair(scan, bad_keys)
        self.check_fences()

    # ---------------------------------------------------------------- fenced devices
    def check_fences(self) -> None:
        """Devices fenced by a server (index meta `fenced.<d>`): each is a finding; with
        --repair one whose data directory probes usable (present, its marker naming this
        store, a file created and written with O_DIRECT) is re-admitted: the fence is
        cleared, its slots are free again. Runs after the data pass, so any entry still
        pointing at the device was verified (and dropped if bad) first."""
        if len(self.dirs) < 2:
            return
        from kvstore.io.datadirs import probe_data_dir
        try:
            with Index(self.index_dir, None, readonly=True) as ix:
                fences = ix.fenced_devices()
        except KVStoreError:
            return
        self.rep.stats["fenced_devices"] = sorted(fences)
        for d, (reason, since) in sorted(fences.items()):
            ddir = self.dirs[d] if d < len(self.dirs) else f"device {d}"
            if not self.repair:
                there = d < len(self.dirs) and os.path.isdir(ddir)
                self.rep.add("device_fenced", f"device {d} ({ddir}) was fenced as failed ({reason}) at "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}; its "
                             f"directory is {'present' if there else 'missing'}: run with --repair "
                             "to re-admit it once the device is healthy")
                continue
            bad = probe_data_dir(ddir, self.path, d, direct=True) if d < len(self.dirs) else ("missing", ddir)
            f = self.rep.add("device_fenced", f"device {d} ({ddir}) was fenced as failed ({reason})"
                             + (f"; still not usable: {bad[1]}" if bad else "; it probes healthy"))
            if bad is None:
                def readmit(d=d):
                    with Index(self.index_dir, None) as ix:    # writer (we hold the lock)
                        ix.readmit_device(d)
                self._fix(f, readmit)
                if f.fixed:
                    self.rep.stats.setdefault("readmitted_devices", []).append(d)


def fsck(path: str, *, deep: bool = False, repair: bool = False, rebuild_index: bool = False,
         progress=None, staging_bytes: int = DEFAULT_STAGING, queue_depth: int = 32,
         model: str | None = None) -> Report:
    """Check (and with repair/rebuild_index, fix) the store at `path`; returns the Report.

    With `model` (a model directory or a hub name in the local cache), also checks that
    the store's model identity still matches that model's weights and config files
    (`check_model`).

    `progress(desc, total, unit)` makes a progress reporter (kvstore.tools.Progress) or is
    None for silence. Never raises for a damaged store (damage is findings); an
    operational failure (not a store, lock held, I/O on the index) sets `report.error`.
    KeyboardInterrupt propagates (the CLI exits 32).
    """
    path = os.path.abspath(path)
    repair = repair or rebuild_index
    rep = Report(store=path, mode="rebuild-index" if rebuild_index else "repair" if repair else "check",
                 deep=deep)
    t0 = time.perf_counter()
    try:
        if not os.path.isdir(path):
            raise StoreNotFound(f"{path} is not a directory")
        try:
            _, _, doc = read_fingerprint(path)
        except StoreNotFound as exc:
            rep.add("fingerprint_missing", str(exc))
            rep.error = f"{path} is not a kvstore store ({FINGERPRINT} is missing)"
            return rep
        except KVStoreError as exc:
            rep.add("fingerprint_invalid", str(exc))
            rep.error = f"cannot check {path} without a valid {FINGERPRINT}"
            return rep
        if model is not None:
            check_model(rep, doc, model)
        lock = None
        pids: list[int] = []
        if repair:
            try:
                lock = WriterLock(path)
            except StoreLocked as exc:
                pids = shared.live_pids(path)
                rep.stats["engine_pids"] = pids
                rep.stats["writer_pid"] = pids[0] if pids else exc.pid
                rep.error = _refusal(path, pids)
                return rep
        else:
            pids = shared.live_pids(path)
        rep.stats["engine_pids"] = pids
        rep.stats["writer_pid"] = pids[0] if pids else None   # compatibility: one of them
        try:
            _Check(path, rep, deep=deep, repair=repair, staging_bytes=staging_bytes,
                   queue_depth=queue_depth, progress=progress, engine_pids=pids).run(rebuild_index)
            if repair and any(f.fixed for f in rep.findings):
                # Check the repaired store again (lock still held, index read-only).
                again = Report(store=path, deep=deep)
                _Check(path, again, deep=deep, repair=False, staging_bytes=staging_bytes,
                       queue_depth=queue_depth, progress=progress).run(False)
                for f in again.findings:
                    f.detail = "still present after repair: " + f.detail
                    rep.findings.append(f)
                rep.stats["recheck_findings"] = len(again.findings)
        finally:
            if lock is not None:
                lock.release()
    except KeyboardInterrupt:
        rep.cancelled = True
        raise
    except (KVStoreError, OSError) as exc:
        rep.error = str(exc)
    finally:
        rep.stats["seconds"] = round(time.perf_counter() - t0, 3)
        if rep.stats.get("read_seconds"):
            rep.stats["read_gbps"] = round(rep.stats["bytes_read"] / rep.stats["read_seconds"] / 1e9, 3)
    return rep


def check_model(rep: Report, doc: dict, model: str) -> None:
    """Report `model_changed` when the identity the store records differs from `model`'s
    weights or config files (the fields fsck can compute without vLLM; the vLLM settings
    are compared by the engine at start)."""
    stored = stored_identity(doc)
    now, how = model_identity(model)
    rep.stats["model_identity"] = now.to_dict()
    if stored is None:
        rep.add("model_changed", f"the store records no model identity (made by a tool or an "
                f"older kvstore); {model} has weights {now.weights} (identified by {how})")
        return
    diffs = [(n, a, b) for n, a, b in stored.differences(now) if n in ("weights", "config")]
    if diffs:
        rep.add("model_changed", f"the store holds KV of {describe_differences(diffs)} ({model}, "
                f"identified by {how}): its blocks are not this model's")


def _refusal(path: str, pids: list[int]) -> str:
    """Why --repair / --rebuild-index will not run now, and what to do."""
    if pids:
        who = (f"{len(pids)} engine(s) are attached (pid{'s' if len(pids) > 1 else ''} "
               f"{', '.join(map(str, pids))})")
        return (f"refusing to repair {path}: {who}; an offline repair needs the store to itself: "
                "stop them (every vLLM server and `kvstore warmup` on this store) and run it again, "
                "or run fsck without --repair for a read-only check next to them")
    return (f"refusing to repair {path}: another process holds the store's lock (an engine "
            "attaching or leaving, or another repair); run it again, or run fsck without --repair "
            "for a read-only check")


def format_text(rep: Report) -> str:
    lines = []
    mode = {"check": "read-only check", "repair": "repair",
            "rebuild-index": "index rebuilt from verified slots, then repair"}[rep.mode]
    lines.append(f"kvstore fsck {rep.store} ({mode}, {'deep: payload checksums' if rep.deep else 'headers'})")
    st = rep.stats
    if st.get("engine_pids") and rep.mode == "check":
        lines.append(f"note: engines attached: pid{'s' if len(st['engine_pids']) > 1 else ''} "
                     f"{', '.join(map(str, st['engine_pids']))}; the check is read-only and findings "
                     "were re-checked against the live index")
    for f in rep.findings:
        where = []
        if f.slot is not None:
            where.append(f"slot {f.slot}")
        if f.key is not None:
            where.append(f"key {_short(f.key)}")
        tag = " [FIXED]" if f.fixed else ""
        extra = [w for w in where if w not in f.detail]
        lines.append(f"  {f.kind}{tag}: {f.detail}" + (f" ({', '.join(extra)})" if extra else ""))
    if rep.error:
        lines.append(f"kvstore fsck: error: {rep.error}")
    n = len(rep.findings)
    fixed = sum(f.fixed for f in rep.findings)
    if rep.cancelled:
        verdict = "CANCELLED"
    elif rep.error:
        verdict = "NOT CHECKED"
    elif not n:
        verdict = "clean"
    elif fixed == n:
        verdict = f"{n} error(s) found, all corrected"
    else:
        hint = ""
        if any(not f.fixed and f.kind in _INDEX_OPEN_KINDS for f in rep.findings):
            hint = " (run with --rebuild-index)"
        elif rep.mode == "check":
            hint = " (run with --repair)"
        verdict = f"{n} error(s) found, {fixed} corrected, {n - fixed} LEFT UNCORRECTED{hint}"
    notes = []
    if st.get("rebuilt_entries") is not None:
        notes.append(f"index rebuilt from the slot headers with {st['rebuilt_entries']:,} entries")
    if st.get("repair"):
        notes.append(st["repair"])
    lines.append(f"{rep.store}: {verdict}" + (f" ({'; '.join(notes)})" if notes else ""))
    summary = []
    if "entries" in st:
        summary.append(f"{st['entries']:,} entries, {st.get('slots_checked', 0):,}/{st['capacity_slots']:,} "
                       "slots used")
    if st.get("bytes_read"):
        summary.append(f"{format_size(st['bytes_read'])} read in {st['read_seconds']:.2f} s "
                       f"({st.get('read_gbps', 0):.2f} GB/s)")
    if st.get("changed_during_check"):
        summary.append(f"{st['changed_during_check']} entr(ies) changed by the engines during the check "
                       "(skipped)")
    if st.get("reserved_in_flight"):
        summary.append(f"{st['reserved_in_flight']} slot(s) reserved by in-flight or interrupted stores")
    if summary:
        lines.append(f"{rep.store}: {', '.join(summary)}")
    return "\n".join(lines)
