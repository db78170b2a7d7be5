"""`kvstore info STORE`: what a store is and how full it is.

Read-only and lock-free (safe next to running engines): the fingerprint, the slot
geometry, used / free / reserved / pinned slots, hit and eviction counters, how long ago
the oldest entry was last used, file sizes and the engines attached to the store.
Everything but the engine list is O(1) in the store size (index counters and LMDB
statistics, no scan); the engines' pins and reservations are counted from their lease
files and the index's `owned` rows (O(capacity) per engine for the pins, O(reserved) for
the reservations).

Engines (`engines`): one row per lease file in STORE/engines (`kvstore.store.shared`): pid,
start time, kind (engine, warmup), whether it is alive, the reservations it holds
(index `owned` rows, in-flight stores) and the slots it pins (its lease's pin counts,
written by the serving index; an engine that pins only in memory, as a bare `DiskStore`
does, shows 0). A lease whose process died and that no engine has reclaimed yet shows
with alive false, with its reservations: the next engine to attach, or a running
serving engine within seconds, gives them back. Top-level `pinned_slots` sums the live
engines' pins. Ages are in index ticks (one tick per block committed or hit), not
seconds: the index keeps access order, not wall-clock time.
"""
from __future__ import annotations

import datetime
import os
import stat

from kvstore.store import shared
from kvstore.store.disk import DiskStore, rank_dir, slot_file_path
from kvstore.errors import KVStoreError
from kvstore.format.identity import IDENTITY_ORDER
from kvstore.format.layout import FINGERPRINT, device_dirs, format_size, read_fingerprint
from kvstore.io.iostats import read_iostats

__all__ = ["gather", "format_text"]


def _file_usage(path: str) -> tuple[int, int] | None:
    """(apparent bytes, allocated bytes) of a regular file, None if absent or not one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_size, st.st_blocks * 512


def gather(path: str) -> dict:
    """Everything `kvstore info` shows, as a JSON-able dict.

    Raises KVStoreError when `path` is not a store (no readable fingerprint). A store
    whose index cannot be opened still yields the fingerprint and files, with
    `index_error` set (and the slot counters left out).
    """
    path = os.path.abspath(path)
    layout, geo, doc = read_fingerprint(path)
    leases = shared.engines(path, pins=True)     # before the reservations: see _engines
    out: dict = {
        "store": path,
        "format_version": doc.get("format_version"),
        "layout": layout.to_dict(),
        # the weights and settings of the model whose KV it holds (None: made by a tool)
        "model_identity": doc.get("model_identity"),
        "created_by": doc.get("created_by"),
        "created_at": doc.get("created_at"),
        "capacity_bytes": int(doc["capacity_bytes"]),
        "capacity_slots": geo.num_slots,
        "slot_size": geo.slot_size,
        "block_bytes": layout.block_bytes,
        "slots_per_file": geo.slots_per_file,
        "files_per_rank": sum(geo.device_files(d) for d in range(geo.num_devices)),
        "num_devices": geo.num_devices,
        "tp_size": layout.tp_size,
        # kept for compatibility: an attached engine's pid (the first lease's), or None
        "writer_pid": next((e.pid for e in leases if e.alive), None),
    }
    dirs = device_dirs(path, doc)
    if doc.get("data_dirs"):
        out["data_dirs"] = dirs
    dev_used = None
    fences: dict = {}
    owned: dict = {}
    try:
        with DiskStore(path, readonly=True) as st:
            s = st.stats()
            owned = st.index.owned_counts()
            if len(dirs) > 1:
                dev_used = _used_per_device(st, s, geo)
                fences = st.index.fenced_devices()
    except KVStoreError as exc:
        out["index_error"] = str(exc)
        s = None
    if s is not None:
        looked_up = s["hits"] + s["misses"]
        oldest = s["oldest_tick"]
        out.update({
            "capacity_slots": s["capacity_slots"],
            "used_slots": s["used_slots"],
            "free_slots": s["free_slots"],
            "reserved_slots": s["reserved_slots"],
            "pinned_slots": sum(e.pinned_slots for e in leases if e.alive),
            "used_bytes": s["used_slots"] * geo.slot_size * layout.tp_size,
            "hits": s["hits"],
            "misses": s["misses"],
            "hit_rate": (s["hits"] / looked_up) if looked_up else None,
            "evictions": s["evictions"],
            "duplicates": s["duplicates"],
            "stale_commits": s["stale_commits"],
            "tick": s["tick"],
            "generation": s["generation"],
            "oldest_tick": oldest,
            "oldest_age_ticks": (s["tick"] - oldest) if oldest is not None else None,
            "index_map_bytes": s["map_size"],
            "index_data_bytes": s["data_bytes"],
        })
        if geo.num_slots != s["capacity_slots"]:
            out["index_error"] = (f"the index has {s['capacity_slots']} slots but the fingerprint "
                                  f"{geo.num_slots}; run `kvstore fsck`")
    out["engines"] = _engines(leases, owned)
    if s is not None:
        # reservations no lease names: made without an owner (an exclusive open, a store
        # written before leases existed) or left by an engine whose close could not give
        # them back; the next engine to attach with no other attached reclaims them
        out["unowned_reserved_slots"] = max(
            0, s["reserved_slots"] - sum(e["reserved_slots"] for e in out["engines"]))
    files: dict = {}
    fp = _file_usage(os.path.join(path, FINGERPRINT))
    files["fingerprint_bytes"] = fp[0] if fp else None
    mdb = _file_usage(os.path.join(path, "index", "data.mdb"))
    files["index_bytes"] = mdb[0] if mdb else None
    files["index_allocated_bytes"] = mdb[1] if mdb else None
    ranks = []
    for r in range(layout.tp_size):
        apparent = allocated = missing = wrong_size = nfiles = 0
        for d, ddir in enumerate(dirs):
            for i in range(geo.device_files(d)):
                nfiles += 1
                u = _file_usage(slot_file_path(ddir, r, i))
                if u is None:
                    missing += 1
                    continue
                apparent += u[0]
                allocated += u[1]
                if u[0] != geo.device_file_slots(d, i) * geo.slot_size:
                    wrong_size += 1
        row = {"rank": r, "dir": rank_dir(dirs[0], r), "files": nfiles,
               "missing_files": missing, "wrong_size_files": wrong_size,
               "bytes": apparent, "allocated_bytes": allocated}
        if len(dirs) > 1:
            row["dirs"] = [rank_dir(ddir, r) for ddir in dirs]
        ranks.append(row)
    files["ranks"] = ranks
    files["slot_bytes"] = sum(x["bytes"] for x in ranks)
    files["slot_allocated_bytes"] = sum(x["allocated_bytes"] for x in ranks)
    out["files"] = files
    out["devices"] = _devices(dirs, geo, layout.tp_size, s, dev_used, fences)
    if len(dirs) > 1:
        out["failed_devices"] = sorted(fences)
        out["fenced_slots"] = sum(geo.device_slots(d) for d in fences if d < len(dirs))
    return out


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def _engines(leases, owned: dict) -> list[dict]:
    """One object per lease file: who it is, whether it lives, what it holds. The leases
    are read before the reservations, so an engine that attached in between is not
    listed (its reservations count as unowned for this one look)."""
    out = []
    for e in sorted(leases, key=lambda e: (not e.alive, e.started, e.pid)):
        out.append({"pid": e.pid, "started": round(e.started, 3), "started_iso": _iso(e.started),
                    "kind": e.kind, "alive": e.alive,
                    "reserved_slots": int(owned.get(e.owner, 0)),
                    "pinned_slots": int(e.pinned_slots),
                    "lease": os.path.basename(e.path)})
    return out


def _used_per_device(st: DiskStore, s: dict, geo) -> list[int]:
    """Used slots of each device: its slots less its free and reserved ones. The free
    list and the reservations are read (O(free + reserved rows), not a scan of the
    entries); slots at or above high_water are free and counted arithmetically. Read from
    separate snapshots: while a server runs the per-device sums may differ from
    used_slots by the blocks committed meanwhile."""
    D = geo.num_devices
    hw, cap = s["high_water"], s["capacity_slots"]
    free = [0] * D
    for slot in st.index.iter_free():
        if slot >= hw:
            break      # the rest is high_water..capacity: counted below
        free[slot % D] += 1
    for d in range(D):  # slots hw..cap-1 with s % D == d
        first = hw + ((d - hw) % D)
        free[d] += max(0, (cap - first + D - 1) // D)
    reserved = [0] * D
    for slot, _gen, _key in st.index.iter_reserved():
        reserved[slot % D] += 1
    return [geo.device_slots(d) - free[d] - reserved[d] for d in range(D)]


def _devices(dirs, geo, tp_size: int, s: dict | None, dev_used, fences=None) -> list[dict]:
    """One object per device: its data directory, state, slots and the bytes kvstore read
    and wrote there (summed over ranks from rank<N>/iostats; null when no rank has a
    counter file, e.g. a store made before the counters existed and never opened for
    writing since)."""
    out = []
    for d, ddir in enumerate(dirs):
        st = "ok"
        try:
            if os.path.islink(ddir) or not os.path.isdir(ddir):
                st = "missing"
            elif not all(os.path.isdir(rank_dir(ddir, r)) for r in range(tp_size)):
                st = "missing"
        except OSError:
            st = "missing"
        counts = [read_iostats(ddir, r) for r in range(tp_size)]
        tracked = [c for c in counts if c is not None]
        if s is None:
            used = None
        elif dev_used is not None:
            used = dev_used[d]
        else:
            used = s["used_slots"]
        try:
            fs_free = os.statvfs(ddir).f_bavail * os.statvfs(ddir).f_frsize if st == "ok" else None
        except OSError:
            fs_free = None
        row = {"device": d, "path": ddir, "state": st,
               "capacity_slots": geo.device_slots(d), "used_slots": used,
               "bytes_read": sum(c[0] for c in tracked) if tracked else None,
               "bytes_written": sum(c[1] for c in tracked) if tracked else None,
               "io_errors": sum(c[2] for c in tracked) if tracked else None,
               "fs_free_bytes": fs_free}
        if fences and d in fences:
            # fenced by the server (or at its start): its slots are not used until
            # `kvstore fsck --repair` (or, for missing/readonly, the next start) re-admits it
            row["state"] = "failed"
            row["reason"], row["failed_since"] = fences[d]
            row["present"] = st == "ok"
        out.append(row)
    return out


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f}%" if d else "-"


def _engine_rows(info: dict) -> list[tuple[str, str]]:
    engs = info.get("engines") or []
    live = [e for e in engs if e["alive"]]
    dead = [e for e in engs if not e["alive"]]
    head = (f"{len(live)} attached (pid {', '.join(str(e['pid']) for e in live)})" if live
            else "none attached")
    if dead:
        head += f"; {len(dead)} gone, not reclaimed yet"
    rows = [("engines", head)]
    for e in engs:
        when = datetime.datetime.fromtimestamp(e["started"]).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        if e["alive"]:
            rows.append(("  engine", f"pid {e['pid']} ({e['kind']}), started {when}, "
                                     f"reserved {e['reserved_slots']:,}, pinned {e['pinned_slots']:,}"))
        else:
            rows.append(("  engine", f"pid {e['pid']} ({e['kind']}), started {when}: GONE (its lease is "
                                     f"left; its {e['reserved_slots']:,} reservation(s) go back when an "
                                     "engine attaches, or within seconds to a running serving engine)"))
    if info.get("unowned_reserved_slots"):
        rows.append(("  unowned", f"{info['unowned_reserved_slots']:,} reservation(s) held by no attached "
                                  "engine (reclaimed when an engine attaches with no other attached, "
                                  "or by `kvstore fsck --repair`)"))
    return rows


def format_text(info: dict) -> str:
    L = info["layout"]
    rows = [("store", info["store"])]
    rows.append(("fingerprint",
                 f"model={L['model']} dtype={L['dtype']} block_size={L['block_size']} tokens "
                 f"block_bytes={format_size(L['block_bytes'])}/rank layers={L['num_layers']} "
                 f"kv_heads={L['num_kv_heads']} head_dim={L['head_dim']} tp_size={L['tp_size']} "
                 f"hash={L['hash_algo']}" + (f" kv_layout={L['kv_layout']}" if L.get("kv_layout") else "")
                 + (f" groups={L['groups']}" if L.get("groups") else "")))
    ident = info.get("model_identity")
    rows.append(("identity",
                 " ".join(f"{k}={ident[k]}" for k in IDENTITY_ORDER if ident.get(k, "-") != "-")
                 if ident
                 else "none recorded (made by a tool; the first engine re-initialises it)"))
    created = info.get("created_at")
    when = (datetime.datetime.fromtimestamp(created).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
            if isinstance(created, int) else "?")
    rows.append(("format", f"version {info['format_version']}, created by {info.get('created_by')} on {when}"))
    rows.append(("capacity",
                 f"{format_size(info['capacity_bytes'])}: {info['capacity_slots']:,} slots of "
                 f"{format_size(info['slot_size'])} x {info['tp_size']} rank(s), "
                 f"{info['files_per_rank']} slot file(s) per rank"
                 + (f" over {info['num_devices']} devices" if info.get("num_devices", 1) > 1 else "")))
    if "used_slots" in info:
        cap = info["capacity_slots"]
        rows.append(("slots", f"used {info['used_slots']:,} ({_pct(info['used_slots'], cap)}), "
                              f"free {info['free_slots']:,}, reserved {info['reserved_slots']:,}, "
                              f"pinned {info['pinned_slots']:,} (by the attached engines)"))
        rate = f"{100.0 * info['hit_rate']:.1f}%" if info["hit_rate"] is not None else "-"
        rows.append(("lookups", f"{info['hits']:,} blocks hit, {info['misses']:,} lookups stopped "
                                f"short at a miss (hit rate {rate})"))
        rows.append(("evictions", f"{info['evictions']:,} (duplicate stores {info['duplicates']:,}, "
                                  f"stale commits {info['stale_commits']:,})"))
        if info["oldest_tick"] is None:
            rows.append(("oldest entry", "- (store is empty)"))
        else:
            rows.append(("oldest entry", f"last used {info['oldest_age_ticks']:,} ticks ago "
                                         f"(tick {info['oldest_tick']:,} of {info['tick']:,})"))
    if info.get("index_error"):
        rows.append(("index", f"ERROR: {info['index_error']}"))
    f = info["files"]
    idx = (f"{format_size(f['index_bytes'])} (map {format_size(info['index_map_bytes'])})"
           if f["index_bytes"] is not None and "index_map_bytes" in info
           else (format_size(f["index_bytes"]) if f["index_bytes"] is not None else "missing"))
    rows.append(("files", f"{FINGERPRINT} {f['fingerprint_bytes']} B, index/data.mdb {idx}"))
    for r in f["ranks"]:
        bad = []
        if r["missing_files"]:
            bad.append(f"{r['missing_files']} MISSING")
        if r["wrong_size_files"]:
            bad.append(f"{r['wrong_size_files']} WRONG SIZE")
        rows.append((f"rank{r['rank']}", f"{r['files']} slot file(s), {format_size(r['bytes'])} "
                                         f"({format_size(r['allocated_bytes'])} allocated)"
                                         + (f"; {', '.join(bad)}: run `kvstore fsck`" if bad else "")))
    devs = info.get("devices") or []
    if len(devs) > 1 or info.get("data_dirs"):
        for dv in devs:
            used = "-" if dv["used_slots"] is None else f"{dv['used_slots']:,}"
            io = ("bytes not tracked" if dv["bytes_read"] is None else
                  f"read {format_size(dv['bytes_read'])}, written {format_size(dv['bytes_written'])}"
                  + (f", {dv['io_errors']:,} failed I/O op(s)" if dv.get("io_errors") else ""))
            state = dv['state'].upper() if dv['state'] != 'ok' else 'ok'
            if dv["state"] == "failed":
                since = datetime.datetime.fromtimestamp(dv["failed_since"]).astimezone().strftime(
                    "%Y-%m-%d %H:%M:%S %Z")
                state += (f" ({dv['reason']} since {since}; not used until `kvstore fsck --repair` "
                          "re-admits it)")
            rows.append((f"device{dv['device']}", f"{dv['path']}: {state}, "
                         f"{dv['capacity_slots']:,} slots, used {used}, {io}"))
    rows.extend(_engine_rows(info))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
