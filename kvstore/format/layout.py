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
from kvstore.errors import (
    ConfigError, CorruptStore, DataDirError, LayoutMismatch, StoreNotFound,
)
from kvstore.format.identity import ModelIdentity

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
    # KV cache groups of a hybrid model, one entry per group in vLLM's order, e.g.
    # "full;swa:4096" or "full;swa:4096;mamba:mamba2:3x64,2x16x16:float16,float16" (a
    # Mamba group: backend, per-rank state shapes and dtypes); "" for one group (the
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
    """How a store's capacity is cut into slots, devices and files (fixed at creation).

    With `num_devices` D > 1 (a store over several data directories, one per device),
    slots are striped: slot s lives on device s % D as that device's local slot s // D,
    so consecutive slots (one request's prefix) read from every device at once. Each
    device holds its local slots in files of `slots_per_file` slots. D = 1 is the
    single-directory store, byte for byte as before (local slot = slot).
    """

    num_slots: int
    slot_size: int
    slots_per_file: int
    num_devices: int = 1

    def device_slots(self, device: int) -> int:
        """Slots that live on `device` (the first num_slots % D devices hold one more)."""
        d = self.num_devices
        return max(0, (self.num_slots - device + d - 1) // d)

    def device_files(self, device: int) -> int:
        return (self.device_slots(device) + self.slots_per_file - 1) // self.slots_per_file

    def device_file_slots(self, device: int, file_index: int) -> int:
        return min(self.slots_per_file, self.device_slots(device) - file_index * self.slots_per_file)

    @property
    def num_files(self) -> int:
        """Slot files per rank on device 0 (the device with the most; all of them for D = 1)."""
        return self.device_files(0)

    def file_slots(self, file_index: int) -> int:
        """Slots of file `file_index` on device 0."""
        return self.device_file_slots(0, file_index)

    def device_of(self, slot: int) -> int:
        return slot % self.num_devices

    def locate(self, slot: int) -> tuple[int, int]:
        """(file index on its device, byte offset) of a slot."""
        local = slot // self.num_devices
        return local // self.slots_per_file, (local % self.slots_per_file) * self.slot_size

    def file_number(self, slot: int) -> int:
        """One number per slot file of a rank: device * files of device 0 + file index
        (the file index itself for D = 1)."""
        return self.device_of(slot) * self.num_files + self.locate(slot)[0]

    def slot_range_text(self, device: int, file_index: int) -> str:
        """The global slots a file holds, for messages."""
        first = file_index * self.slots_per_file
        n = self.device_file_slots(device, file_index)
        if self.num_devices == 1:
            return f"slots {first}..{first + n - 1}"
        d = self.num_devices
        return (f"slots {first * d + device}..{(first + n - 1) * d + device} "
                f"(every {d}th, device {device})")

    @classmethod
    def for_capacity(cls, capacity_bytes: int, layout: Layout, num_devices: int = 1) -> "StoreGeometry":
        per_slot = layout.slot_size * layout.tp_size
        num_slots = capacity_bytes // per_slot
        if num_slots < 1:
            raise ConfigError(
                f"capacity {format_size(capacity_bytes)} holds no block: one block takes "
                f"{format_size(per_slot)} ({layout.tp_size} rank(s) x {format_size(layout.slot_size)}); "
                "raise the capacity")
        if num_slots < num_devices:
            raise ConfigError(
                f"capacity {format_size(capacity_bytes)} holds {num_slots} block(s), fewer than the "
                f"{num_devices} data directories: raise the capacity or give fewer data_dirs")
        per_device = -(-num_slots // num_devices)
        spf = max(1, min(per_device, MAX_FILE_BYTES // layout.slot_size))
        return cls(num_slots=num_slots, slot_size=layout.slot_size, slots_per_file=spf,
                   num_devices=num_devices)


def normalize_data_dirs(data_dirs) -> list[str] | None:
    """A `data_dirs` setting as absolute paths (None or [] -> None: the store directory
    holds the slot files). Refuses anything but a list of distinct directory strings."""
    if data_dirs is None:
        return None
    if isinstance(data_dirs, (str, bytes)) or not isinstance(data_dirs, (list, tuple)):
        raise ConfigError(f"data_dirs must be a list of directories (one per device), e.g. "
                          f'["/mnt/nvme0/kv", "/mnt/nvme1/kv"]; got {data_dirs!r}')
    if not data_dirs:
        return None
    out = []
    for d in data_dirs:
        if not isinstance(d, str) or not d:
            raise ConfigError(f"data_dirs entries must be directory paths, got {d!r}")
        out.append(os.path.normpath(os.path.abspath(os.path.expanduser(d))))
    if len(set(out)) != len(out):
        dup = next(d for d in out if out.count(d) > 1)
        raise ConfigError(f"data_dirs names {dup} twice: give each device one directory")
    if len(out) > 256:
        raise ConfigError(f"data_dirs has {len(out)} entries; at most 256 devices per store")
    return out


def device_dirs(store_dir: str, doc: dict) -> list[str]:
    """The directory of every device of a store: its `data_dirs`, else the store itself."""
    return list(doc.get("data_dirs") or [store_dir])


def write_fingerprint(store_dir: str, layout: Layout, geometry: StoreGeometry, capacity_bytes: int,
                      data_dirs: list[str] | None = None, identity=None) -> None:
    """Write kvstore.json (atomically: a temporary file, fsync, rename). `identity` (a
    `kvstore.format.identity.ModelIdentity`) is recorded as "model_identity"; a store
    made by a tool without a model has none."""
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
    if data_dirs:   # absent for single-directory stores (their fingerprint is unchanged)
        doc["data_dirs"] = list(data_dirs)
    if identity is not None:
        doc["model_identity"] = identity.to_dict()
    path = os.path.join(store_dir, FINGERPRINT)
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == 40:
            raise DataDirError(f"refusing {tmp}: it is a symlink (kvstore never follows symlinks "
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
            raise DataDirError(f"refusing {path}: it is a symlink (kvstore never follows symlinks "
                               "inside a store)") from None
        raise DataDirError(f"cannot open {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 20)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStore(f"{path} is not valid JSON ({exc}); restore it or run "
                           "`kvstore fsck --repair`") from None
    if not isinstance(doc, dict):
        raise CorruptStore(f"{path} must hold a JSON object")
    if doc.get("format_version") != FORMAT_VERSION:
        raise LayoutMismatch(f"{path}: store format version {doc.get('format_version')!r}, this "
                             f"kvstore reads version {FORMAT_VERSION}", field="format_version")
    try:
        layout = Layout.from_dict(doc.get("layout"))
        dirs = doc.get("data_dirs")
        if dirs is not None:
            if normalize_data_dirs(dirs) != dirs:
                raise ConfigError(f"data_dirs must be a non-empty list of distinct absolute paths, "
                                  f"got {dirs!r}")
        geo = StoreGeometry(int(doc["num_slots"]), int(doc["slot_size"]), int(doc["slots_per_file"]),
                            len(dirs) if dirs else 1)
        int(doc["capacity_bytes"])
        if "model_identity" in doc:
            ModelIdentity.from_dict(doc["model_identity"])
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise CorruptStore(f"{path} is damaged ({exc}); restore it from the store's creator") from None
    if (geo.num_slots < 1 or geo.slots_per_file < 1 or geo.slot_size != layout.slot_size
            or geo.num_slots < geo.num_devices):
        raise CorruptStore(f"{path} is inconsistent (slot geometry does not match the layout)")
    return layout, geo, doc


def stored_identity(doc: dict) -> ModelIdentity | None:
    """The model identity a store's kvstore.json records (None: made without one, by a
    tool or an older kvstore; `read_fingerprint` has validated it)."""
    d = doc.get("model_identity")
    return None if d is None else ModelIdentity.from_dict(d)


def check_layout(store_dir: str, stored: Layout, wanted: Layout) -> None:
    diffs = stored.differences(wanted)
    if diffs:
        name, have, want = diffs[0]
        more = "".join(f"; also {n}={h!r} vs {w!r}" for n, h, w in diffs[1:])
        raise LayoutMismatch(
            f"store {store_dir} was written with {name}={have!r} but this engine has "
            f"{name}={want!r}{more}; refusing to serve KV of another layout. Use another store "
            "path (or delete this store) for this model/configuration.", field=name)


def check_data_dirs(store_dir: str, doc: dict, wanted) -> None:
    """Refuse a store whose data directories are not the configured ones (LayoutMismatch
    naming `data_dirs`); `wanted` None means "whatever the store has"."""
    if wanted is None:
        return
    want = normalize_data_dirs(wanted) or [os.path.normpath(os.path.abspath(store_dir))]
    have = device_dirs(os.path.normpath(os.path.abspath(store_dir)), doc)
    if have != want:
        raise LayoutMismatch(
            f"store {store_dir} was created with data_dirs={have!r} but this engine has "
            f"data_dirs={want!r}; refusing to serve with another set of devices (the slots are "
            "striped over the store's own directories, in that order). Configure the store's "
            "data_dirs, or use another store path.", field="data_dirs")


def block_key(block_hash: bytes, group_id: int = 0) -> bytes:
    """Store key of a block: vLLM's BlockHashWithGroupId (hash + 4-byte big-endian group).
    `kvstore._keytable.KeyTable.prefix_of` / `plan_new` build the same bytes in C."""
    return bytes(block_hash) + group_id.to_bytes(4, "big")
