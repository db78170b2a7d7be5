"""Where a rank's files live: its directory in each device directory and its slot files
(docs/FORMAT.md)."""
from __future__ import annotations

import os


def rank_dir(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"rank{rank}")


def slot_file_path(store_dir: str, rank: int, file_index: int) -> str:
    """A slot file of one rank in one device directory (the store directory itself for a
    single-directory store, else one of its `data_dirs`)."""
    return os.path.join(rank_dir(store_dir, rank), f"slots-{file_index:04d}.kvs")
