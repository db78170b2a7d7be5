"""What the several-engines tests (tests/lookup/test_shared_index.py, tests/store/test_shared_races.py)
share: a one-rank layout, keys, a small store."""
from __future__ import annotations

from kvstore.store.disk import DiskStore
from kvstore.format.layout import Layout

BB = 4096
LAYOUT = Layout(model="shared", dtype="float16", block_size=16, block_bytes=BB, num_layers=1,
                num_kv_heads=1, head_dim=64, tp_size=1)


def k(i: int, tag: bytes = b"a") -> bytes:
    return tag + b"-%06d" % i + b"\x00" * 24


def make(tmp_path, slots: int) -> str:
    """A store of `slots` slots at tmp_path/store; returns its path."""
    DiskStore.create(str(tmp_path / "store"), LAYOUT, slots * (BB + 4096)).close()
    return str(tmp_path / "store")
