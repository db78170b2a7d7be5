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

This module is the entry point (`fsck`, `check_model`) and the run's driver; the parts
are `fsck_report` (findings, the report, exit codes), `fsck_scan` (the store under check
and its slot reads), `fsck_files` (pass 1), `fsck_checks` (passes 2 to 4 and the
fenced devices) and `fsck_repair` (the index repairs and --rebuild-index).
"""
from __future__ import annotations

import os
import time

from kvstore.errors import KVStoreError, StoreLocked, StoreNotFound
from kvstore.format.identity import describe_differences, model_identity
from kvstore.format.layout import FINGERPRINT, read_fingerprint, stored_identity
from kvstore.store import shared
from kvstore.store.disk import WriterLock
from kvstore.tools.fsck_checks import IndexChecks
from kvstore.tools.fsck_files import FileChecks
from kvstore.tools.fsck_repair import Repairs
from kvstore.tools.fsck_report import (  # noqa: F401  (the public names, re-exported)
    EXIT_CANCELLED, EXIT_CLEAN, EXIT_CORRECTED, EXIT_OPERATIONAL, EXIT_UNCORRECTED, EXIT_USAGE,
    INDEX_OPEN_KINDS, KINDS, Finding, Report, format_text,
)
from kvstore.tools.fsck_scan import DEFAULT_STAGING, READERS, FsckContext, SlotReader  # noqa: F401

__all__ = ["fsck", "Finding", "Report", "KINDS", "format_text",
           "EXIT_CLEAN", "EXIT_CORRECTED", "EXIT_UNCORRECTED", "EXIT_OPERATIONAL",
           "EXIT_USAGE", "EXIT_CANCELLED"]


class _Check(SlotReader):
    """One fsck run over one store (the passes above); fills a Report. The run is its
    passes' slot reader: every pass reads through its `read_slots`."""

    def __init__(self, path: str, report: Report, *, deep: bool, repair: bool,
                 staging_bytes: int, queue_depth: int, progress, engine_pids: list[int] = ()):
        super().__init__(FsckContext.open(path, report, deep=deep, repair=repair,
                                          staging_bytes=staging_bytes, queue_depth=queue_depth,
                                          progress=progress, engine_pids=engine_pids))
        self.files = FileChecks(self.ctx)            # pass 1
        self.checks = IndexChecks(self.ctx, self)    # passes 2 to 5
        self.repairs = Repairs(self.ctx, self)

    def run(self, rebuild: bool) -> None:
        rep, checks = self.ctx.rep, self.checks
        self.files.check_files()
        if rebuild:
            before = len(rep.findings)
            ix = checks.open_index()
            if ix is not None:
                ix.close()
            self.repairs.rebuild_from_headers()
            for f in rep.findings[before:]:
                if f.kind in INDEX_OPEN_KINDS:
                    f.fixed = True
        ix = checks.open_index()
        if ix is None:
            return
        try:
            scan = checks.scan_index(ix)
            bad_keys = checks.check_data(ix, scan)
            checks.check_unlisted(scan)
        finally:
            ix.close()
        if self.ctx.repair:
            self.repairs.repair(scan, bad_keys)
        checks.check_fences()


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
