"""The layout fingerprint of a store (`kvstore.json`) and human-size parsing.

Owns what makes two stores' bytes interchangeable: model, dtype, block size, bytes per
block per rank, layer/head geometry, TP size, hash algorithm and slot geometry. Serving KV
written for another layout is the worst failure this product can have, so opening a store
compares every field and names the first that differs. Never reads slot files or the index.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields

# HEADER_SIZE and ALIGN are defined once, for C and Python, in the I/O core
# (cython_src/kvstore/includes/format.pxd).
from kvstore._slotfile import ALIGN, HEADER_SIZE
from kvstore.errors import ConfigError, KVStoreError, LayoutMismatch, StoreNotFound

FORMAT_VERSION = 1
FINGERPRINT = "kvstore.json"
MAX_FILE_BYTES = 4 << 30  # slot files stay <= 4 GiB: fewer fds than one file per block

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(value) -> int:
    """Parse '500G', '128K', '2MiB', '1.5T' or an int into bytes (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '500G', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"size must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(?:i?B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot parse size {value!r}: use bytes or a number with K, M, G or T "
                          "(binary units), e.g. '500G' or '128K'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ConfigError(f"size must be positive, got {value!r}")
    return n


def format_size(n: int) -> str:
    """Bytes as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass(frozen=True)
class Layout:
    """What a slot's payload means. Two stores can share blocks only if these are equal."""

    model: str
    dtype: str
    block_size: int          # tokens per vLLM block
    block_bytes: int         # payload bytes of one block, one rank, all layers
    num_layers: int          # layers (of one KV cache group, for a hybrid model)
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    hash_algo: str = "sha256"
    kv_layout: str = ""      # how the payload is arranged (e.g. "LBNHC:layer-major")
    # KV cache groups of a hybrid model, e.g. "full;swa:4096" ("" for one group: the
    # fingerprint of single-group stores does not carry the field)
    groups: str = ""

    def __post_init__(self):
        for name in ("block_size", "block_bytes", "num_layers", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"layout field {name} must be a positive integer, got {v!r}")
        for name in ("num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"layout field {name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.model, str) or not isinstance(self.dtype, str):
            raise ConfigError("layout fields model and dtype must be strings")
        if not isinstance(self.groups, str):
            raise ConfigError(f"layout field groups must be a string like \"full;swa:4096\", "
                              f"got {self.groups!r}")

    @property
    def slot_size(self) -> int:
        return HEADER_SIZE + (self.block_bytes + ALIGN - 1) // ALIGN * ALIGN

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["groups"]:
            del d["groups"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        if not isinstance(d, dict):
            raise ConfigError(f"layout must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown layout fields {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"incomplete layout: {exc}") from exc

    # block_bytes is derived from the geometry fields: name the cause, not the symptom.
    # (tp_size before num_kv_heads: the heads recorded are per rank.)
    _CHECK_ORDER = ("model", "dtype", "block_size", "tp_size", "num_layers", "num_kv_heads",
                    "head_dim", "hash_algo", "kv_layout", "groups", "block_bytes")

    def differences(self, other: "Layout") -> list[tuple[str, object, object]]:
        """Every differing field as (name, ours, theirs), causes before derived fields."""
        return [(n, getattr(self, n), getattr(other, n)) for n in self._CHECK_ORDER
                if getattr(self, n) != getattr(other, n)]

    def first_difference(self, other: "Layout") -> tuple[str, object, object] | None:
        diffs = self.differences(other)
        return diffs[0] if diffs else None


@dataclass(frozen=True)
class StoreGeometry:
    """How a store's capacity is cut into slots and files (fixed at creation)."""

    num_slots: int
    slot_size: int
    slots_per_file: int

    @property
    def num_files(self) -> int:
        return (self.num_slots + self.slots_per_file - 1) // self.slots_per_file

    def file_slots(self, file_index: int) -> int:
        return min(self.slots_per_file, self.num_slots - file_index * self.slots_per_file)

    def locate(self, slot: int) -> tuple[int, int]:
        """(file index, byte offset) of a slot."""
        return slot // self.slots_per_file, (slot % self.slots_per_file) * self.slot_size

    @classmethod
    def for_capacity(cls, capacity_bytes: int, layout: Layout) -> "StoreGeometry":
        per_slot = layout.slot_size * layout.tp_size
        num_slots = capacity_bytes // per_slot
        if num_slots < 1:
            raise ConfigError(
                f"capacity {format_size(capacity_bytes)} holds no block: one block takes "
                f"{format_size(per_slot)} ({layout.tp_size} rank(s) x {format_size(layout.slot_size)}); "
                "raise the capacity")
        spf = max(1, min(num_slots, MAX_FILE_BYTES // layout.slot_size))
        return cls(num_slots=num_slots, slot_size=layout.slot_size, slots_per_file=spf)


def write_fingerprint(store_dir: str, layout: Layout, geometry: StoreGeometry, capacity_bytes: int) -> None:
    from kvstore import __version__
    doc = {
        "format_version": FORMAT_VERSION,
        "layout": layout.to_dict(),
        "capacity_bytes": capacity_bytes,
        "num_slots": geometry.num_slots,
        "slot_size": geometry.slot_size,
        "slots_per_file": geometry.slots_per_file,
        "created_by": f"kvstore {__version__}",
        "created_at": int(time.time()),
    }
    path = os.path.join(store_dir, FINGERPRINT)
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == 40:
            raise KVStoreError(f"refusing {tmp}: it is a symlink (kvstore never follows symlinks "
                               "inside a store)") from None
        raise
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_fingerprint(store_dir: str) -> tuple[Layout, StoreGeometry, dict]:
    """Parse and validate kvstore.json; every defect is a clear KVStoreError."""
    path = os.path.join(store_dir, FINGERPRINT)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise StoreNotFound(f"{store_dir} is not a kvstore store: {FINGERPRINT} is missing "
                            "(create one with a capacity, or point `path` at an existing store)") from None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: O_NOFOLLOW met a symlink
            raise KVStoreError(f"refusing {path}: it is a symlink (kvstore never follows symlinks "
                               "inside a store)") from None
        raise KVStoreError(f"cannot open {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 20)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KVStoreError(f"{path} is not valid JSON ({exc}); restore it or run "
                           "`kvstore fsck --repair`") from None
    if not isinstance(doc, dict):
        raise KVStoreError(f"{path} must hold a JSON object")
    if doc.get("format_version") != FORMAT_VERSION:
        raise LayoutMismatch(f"{path}: store format version {doc.get('format_version')!r}, this "
                             f"kvstore reads version {FORMAT_VERSION}", field="format_version")
    try:
        layout = Layout.from_dict(doc.get("layout"))
        geo = StoreGeometry(int(doc["num_slots"]), int(doc["slot_size"]), int(doc["slots_per_file"]))
        int(doc["capacity_bytes"])
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise KVStoreError(f"{path} is damaged ({exc}); restore it from the store's creator") from None
    if geo.num_slots < 1 or geo.slots_per_file < 1 or geo.slot_size != layout.slot_size:
        raise KVStoreError(f"{path} is inconsistent (slot geometry does not match the layout)")
    return layout, geo, doc


def check_layout(store_dir: str, stored: Layout, wanted: Layout) -> None:
    diffs = stored.differences(wanted)
    if diffs:
        name, have, want = diffs[0]
        more = "".join(f"; also {n}={h!r} vs {w!r}" for n, h, w in diffs[1:])
        raise LayoutMismatch(
            f"store {store_dir} was written with {name}={have!r} but this engine has "
            f"{name}={want!r}{more}; refusing to serve KV of another layout. Use another store "
            "path (or delete this store) for this model/configuration.", field=name)


def block_key(block_hash: bytes, group_id: int = 0) -> bytes:
    """Store key of a block: vLLM's BlockHashWithGroupId (hash + 4-byte big-endian group).
    `kvstore._keytable.KeyTable.prefix_of` / `plan_new` build the same bytes in C."""
    return bytes(block_hash) + group_id.to_bytes(4, "big")
