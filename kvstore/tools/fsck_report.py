"""What a `kvstore fsck` run found, and how it is told: every finding kind (`KINDS`,
and the groups the repair treats alike), `Finding`, `Report` (its JSON and its exit
status, a sum as e2fsck's: the `EXIT_*` codes) and `format_text`, the report a person
reads."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.format.layout import format_size

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
DATA_KINDS = frozenset({"slot_unreadable", "header_corrupt", "key_mismatch", "generation_mismatch",
                        "header_mismatch", "payload_corrupt"})
# Fixed by giving every reservation back, which also empties the owned db (the offline
# repair runs with no engine attached: no reservation has a live owner).
RECLAIM_KINDS = frozenset({"owned_stray"})
# Fixed (or not) by the store-files pass itself.
FILE_KINDS = frozenset({"slot_file_missing", "slot_file_size", "slot_file_invalid"})
# Fixed only by --rebuild-index.
INDEX_OPEN_KINDS = frozenset({"index_missing", "index_unreadable", "capacity_mismatch"})


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


def apply_fix(finding: Finding, fn, *args) -> None:
    """Run the repair `fn(*args)` for `finding`: fixed when it returns, else its detail
    says why not."""
    try:
        fn(*args)
        finding.fixed = True
    except (OSError, KVStoreError) as exc:
        finding.detail += f"; repair failed: {exc}"


def short_key(key: bytes | None) -> str:
    """A key as the findings name it: its hex, shortened to `first16..last2`."""
    if key is None:
        return "-"
    h = key.hex()
    return h if len(h) <= 20 else f"{h[:16]}..{h[-2:]}"


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
            where.append(f"key {short_key(f.key)}")
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
        if any(not f.fixed and f.kind in INDEX_OPEN_KINDS for f in rep.findings):
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
