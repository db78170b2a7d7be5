"""The kvstore exception family.

Every error a user can meet is a `KVStoreError` subclass whose message says which call
failed and what to do about it. A missing key is a miss, never an exception.
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


class CorruptIndex(KVStoreError):
    """The LMDB index is missing, unreadable or inconsistent; run `kvstore fsck`."""
