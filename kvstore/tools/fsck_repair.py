"""`kvstore fsck --repair` and `--rebuild-index`: `Repairs` fixes what the checks found
in the index (drops the entries whose slots failed, gives reservations back, or rebuilds
the index from the surviving entries when its structure is damaged) and recreates a
lost index from the slots that verify on every rank. The slot files are repaired by
`fsck_files`, fenced devices re-admitted by `fsck_checks`."""
from __future__ import annotations

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.index.core import Index
from kvstore.index.maint import rebuild_index
from kvstore.tools.fsck_checks import IndexScan
from kvstore.tools.fsck_report import DATA_KINDS, FILE_KINDS, INDEX_OPEN_KINDS, RECLAIM_KINDS
from kvstore.tools.fsck_scan import FsckContext, SlotReader

# The index counters a repair or a rebuild carries over.
KEPT_COUNTERS = ("hits", "misses", "evictions", "duplicates", "stale_commits")


class Repairs:
    """The index repairs (the lock is held: no engine is attached)."""

    def __init__(self, ctx: FsckContext, reader: SlotReader):
        self.ctx = ctx
        self.reader = reader

    def repair(self, scan: IndexScan, bad_keys: set[bytes]) -> None:
        # File findings were fixed (or not) in pass 1 and index-open findings by the
        # rebuild; what is left is fixed here, by dropping entries or rebuilding the index.
        ctx = self.ctx
        pending = [f for f in ctx.rep.findings if not f.fixed and id(f) not in ctx.kept
                   and f.kind not in FILE_KINDS and f.kind not in INDEX_OPEN_KINDS]
        if not pending:
            return
        structural = [f for f in pending if f.kind not in DATA_KINDS | RECLAIM_KINDS]
        if not structural:
            with Index(ctx.index_dir, None) as ix:  # writer (we hold the lock)
                ix.reclaim_reserved()
                ix.drop(sorted(bad_keys))
            for f in pending:
                f.fixed = True
            ctx.rep.stats["repair"] = f"{len(bad_keys):,} entr{'y' if len(bad_keys) == 1 else 'ies'} dropped"
            return
        keep = [e for e in scan.entries if e.key not in bad_keys]
        # A slot claimed by several keys can only have passed the data checks for one of
        # them (headers name one key); drop the others.
        seen: set[int] = set()
        entries = []
        for e in sorted(keep, key=lambda e: e.tick):
            if e.slot in seen:
                continue
            seen.add(e.slot)
            entries.append((e.key, e.slot, e.generation))
        c = scan.counters
        counters = {k: c[k] for k in KEPT_COUNTERS if k in c}
        counters.update({k: v for k, v in c.items() if k.startswith("fenced.")})   # fences stay
        counters["generation"] = scan.max_gen
        n = rebuild_index(ctx.index_dir, ctx.cap, entries, counters=counters)
        for f in pending:
            f.fixed = True
        ctx.rep.stats["repair"] = (f"index rebuilt with {n:,} surviving entr{'y' if n == 1 else 'ies'}, "
                                   f"{len(scan.entries) - n:,} dropped")

    def rebuild_from_headers(self) -> None:
        """--rebuild-index: a new index holding every slot with a valid block. Every slot
        is read in full and only blocks whose header and payload checksum hold (on every
        rank, with the same key and generation) are adopted: a rebuild must not bring back
        a block that a load or an earlier fsck dropped as corrupt."""
        ctx = self.ctx
        counters: dict = {}
        try:
            with Index(ctx.index_dir, None, readonly=True) as old:
                s = old.stats()
                counters = {k: s[k] for k in KEPT_COUNTERS}
                counters["generation"] = s["generation"]
                counters.update(old.fence_rows())   # a fenced device stays fenced
        except KVStoreError:
            pass
        cap, plen = ctx.cap, ctx.layout.block_bytes
        keys: list[bytes | None] = [None] * cap
        gens = np.zeros(cap, dtype=np.uint64)
        valid = np.zeros(cap, dtype=bool)
        max_gen = int(counters.get("generation", 0))
        all_slots = np.arange(cap, dtype=np.int64)
        for r in range(ctx.layout.tp_size):
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
            self.reader.read_slots(r, all_slots, True, on_slot, f"rank {r}: verifying every slot")
        fenced = {int(k.split(".", 1)[1]) for k in counters if k.startswith("fenced.")}
        if fenced and ctx.geo.num_devices > 1:
            # a fenced device's slots hold blocks its fence dropped: never adopt them
            valid[np.isin(np.arange(cap) % ctx.geo.num_devices, sorted(fenced))] = False
        best: dict[bytes, int] = {}
        for s in np.flatnonzero(valid).tolist():
            k = keys[s]
            if k not in best or gens[s] > gens[best[k]]:
                best[k] = s
        entries = sorted(((k, s, int(gens[s])) for k, s in best.items()), key=lambda x: x[2])
        counters["generation"] = max_gen
        n = rebuild_index(ctx.index_dir, cap, entries, counters=counters)
        ctx.rep.stats["rebuilt_entries"] = n
        ctx.rep.stats["rebuild_slots_scanned"] = cap * ctx.layout.tp_size
