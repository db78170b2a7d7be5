"""The store a `kvstore fsck` run checks, and reading its slots: `FsckContext` (the
store's layout, geometry and devices, the run's options and its report) and
`SlotReader`, which reads one rank's slots on every device at once (headers, or whole
slots with their payload checksums for --deep) and counts the bytes read per device."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvstore import _slotfile
from kvstore._slotfile import HEADER_SIZE
from kvstore.errors import CorruptSlot, KVStoreError
from kvstore.format.layout import Layout, StoreGeometry, device_dirs, read_fingerprint
from kvstore.store.disk import RankIO
from kvstore.tools.fsck_report import Report

DEFAULT_STAGING = 256 << 20
READERS = 2  # rings per rank for deep reads (see SlotReader.read_slots)


@dataclass(slots=True)
class FsckContext:
    """One fsck run over one store: what every pass shares."""
    path: str
    rep: Report
    deep: bool
    repair: bool
    staging_bytes: int
    queue_depth: int
    progress: object        # progress(desc, total, unit) -> reporter, or None
    engine_pids: list[int]
    layout: Layout
    geo: StoreGeometry
    dirs: list[str]         # one per device (the store itself if no data_dirs)
    cap: int
    index_dir: str
    missing_devices: set[int] = field(default_factory=set)   # data directories that are gone
    kept: set[int] = field(default_factory=set)   # ids of findings on a missing device: never "fixed"

    @classmethod
    def open(cls, path: str, rep: Report, *, deep: bool, repair: bool, staging_bytes: int,
             queue_depth: int, progress, engine_pids=()) -> FsckContext:
        layout, geo, doc = read_fingerprint(path)
        return cls(path=path, rep=rep, deep=deep, repair=repair, staging_bytes=staging_bytes,
                   queue_depth=queue_depth, progress=progress, engine_pids=list(engine_pids),
                   layout=layout, geo=geo, dirs=device_dirs(path, doc), cap=geo.num_slots,
                   index_dir=os.path.join(path, "index"))


def device_absent(ddir: str, store: str, d: int) -> str:
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


class SlotReader:
    """Reads slots for the passes; every pass reads through `read_slots`."""

    def __init__(self, ctx: FsckContext):
        self.ctx = ctx
        self.bad_files: dict[int, str] = {}   # file number -> reason, of the rank being read

    def open_rank(self, r: int, nslots: int, deep: bool, *, staging_bytes: int | None = None,
                  queue_depth: int | None = None) -> RankIO:
        # Staging sized to the job (registering 256 MiB costs more than checking a small store).
        ctx = self.ctx
        ss = ctx.geo.slot_size
        need = 2 * nslots * ss if deep else -(-nslots * HEADER_SIZE // ss) * ss
        staging = max(ss, min(staging_bytes or ctx.staging_bytes, need))
        return RankIO(ctx.path, r, readonly=True, missing_ok=True,
                      queue_depth=queue_depth or ctx.queue_depth, staging_bytes=staging)

    def read_slots(self, r: int, slots: np.ndarray, deep: bool, on_slot, label: str) -> None:
        """Read rank r's `slots` and call on_slot(slot, header_or_exc, payload_ok) for each
        (payload_ok: None unless deep). Sets self.bad_files for the rank's unopenable files.

        Deep reads are split over READERS rings (each with half the queue depth and half the
        staging memory, each double-buffered on its own thread), so that while one ring
        drains the tail of a batch the other keeps the device busy: the total in flight
        stays near --queue-depth, as fio's does. Checksums run on the reader threads
        (xxh3 releases the GIL); on_slot calls are serialized.
        """
        ctx = self.ctx
        ss = ctx.geo.slot_size
        total_bytes = len(slots) * (ss if deep else HEADER_SIZE)
        prog = ctx.progress(label, total_bytes, "B") if ctx.progress else None
        t0 = time.perf_counter()
        readers = READERS if deep and len(slots) >= READERS * 8 and ctx.queue_depth >= READERS else 1
        rios = []
        try:
            for _ in range(readers):
                # --staging and --queue-depth are per device: each RankIO reads all
                # devices at once (one ring each), so a batch is split over them.
                rios.append(self.open_rank(r, -(-len(slots) // readers), deep,
                                           staging_bytes=ctx.staging_bytes * len(ctx.dirs) // readers,
                                           queue_depth=ctx.queue_depth // readers))
            self.bad_files = dict(rios[0].bad_files)
            if deep:
                self._read_deep(rios, slots, on_slot, prog)
            else:
                step = 1 << 16
                for start in range(0, len(slots), step):
                    chunk = slots[start:start + step]
                    for s, h in zip(chunk.tolist(), rios[0].read_headers(chunk)):
                        on_slot(s, h, None)
                    if prog:
                        prog.update(len(chunk) * HEADER_SIZE)
        finally:
            per_dev = ctx.rep.stats.setdefault("device_bytes_read", [0] * len(ctx.dirs))
            for rio in rios:
                for d in range(len(per_dev)):
                    per_dev[d] += int(rio.io_bytes[d, 0])
                rio.close()
            if prog:
                prog.close()
        st = ctx.rep.stats
        st["bytes_read"] = st.get("bytes_read", 0) + total_bytes
        st["read_seconds"] = st.get("read_seconds", 0.0) + (time.perf_counter() - t0)

    def _read_deep(self, rios: list[RankIO], slots: np.ndarray, on_slot, prog) -> None:
        """Whole slots over len(rios) rings, one part of `slots` each, payload checksums
        computed on the reader threads."""
        plen = self.ctx.layout.block_bytes
        ss = self.ctx.geo.slot_size
        readers = len(rios)
        lock = threading.Lock()
        cancel = threading.Event()   # set when the main thread unwinds (Ctrl-C, an error)

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
