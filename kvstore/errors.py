"""The kvstore exception family.

Every error a user can meet is a `KVStoreError` subclass whose message says which call
failed and what to do about it. A missing key is a miss, never an exception. The class says
who acts:

- the configuration or the command line: `ConfigError`, `AlignmentError`;
- the store's files: `StoreNotFound`, `LayoutMismatch` (written for another model or
  geometry), `CorruptStore` / `CorruptIndex` (run `kvstore fsck`), `CorruptSlot` (one slot:
  the caller drops it and recomputes);
- a directory or device: `DataDirError` (a store or data directory that cannot hold the
  store as it is: a symlink, not writable, no O_DIRECT, another store's, too small);
- other processes: `StoreLocked`, `StoreFull` (every slot pinned or reserved);
- the environment: `MissingDependency` (fio, a vLLM engine);
- the program using kvstore: `StoreClosed` (an object used after `close()`);
- a benchmark that saw wrong bytes or a failed I/O: `BenchmarkFailed`.
"""


class KVStoreError(Exception):
    """Base class of every kvstore error."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid (names the key and the accepted values)."""


class AlignmentError(KVStoreError, ValueError):
    """A buffer, length or offset is not aligned for O_DIRECT I/O (shows the numbers)."""


class LayoutMismatch(KVStoreError):
    """The store was written for another model / dtype / block size / TP layout."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class StoreFull(KVStoreError):
    """No slot can be reserved: every slot is pinned or reserved."""


class StoreLocked(KVStoreError):
    """Another process holds the store's writer lock (the message names its pid)."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


class StoreNotFound(KVStoreError):
    """The path holds no kvstore store (or a required part of it is missing)."""


class CorruptSlot(KVStoreError):
    """A slot's header or payload failed verification for the key it was read for."""

    def __init__(self, message: str, key: bytes | None = None, slot: int | None = None):
        super().__init__(message)
        self.key = key
        self.slot = slot


class CorruptStore(KVStoreError):
    """The store's own metadata (its fingerprint `kvstore.json`, the shared slot state, the
    index) is damaged or inconsistent; run `kvstore fsck`."""


class CorruptIndex(CorruptStore):
    """The LMDB index is missing, unreadable or inconsistent; run `kvstore fsck`."""


class DataDirError(KVStoreError):
    """A store directory or data directory cannot hold the store as it is: a symlink, not a
    directory, not writable, no O_DIRECT where asked, another store's, too little space."""


class StoreClosed(KVStoreError):
    """A store, index, rank I/O, staging memory or device thread was used after `close()`."""


class MissingDependency(KVStoreError):
    """Something the command needs is not installed (fio, a vLLM engine); says how to get it."""


class BenchmarkFailed(KVStoreError):
    """A benchmark read back wrong bytes or saw an I/O fail: its numbers would be meaningless."""
