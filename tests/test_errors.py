"""The error family: each class is raised where its cause is, so a caller can tell a bad data
directory from a damaged store from a closed object (real stores, files and LMDB)."""
from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

import kvstore
from kvstore import errors
from kvstore.errors import (
    ConfigError, CorruptIndex, CorruptStore, DataDirError, KVStoreError, StoreClosed,
)
from kvstore.format.layout import Layout
from kvstore.store.disk import DiskStore

LAYOUT = Layout(model="errors", dtype="float16", block_size=16, block_bytes=4096, num_layers=1,
                num_kv_heads=1, head_dim=64, tp_size=1)


def test_every_error_is_a_kvstore_error_and_exported():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert len(classes) >= 14
    for c in classes:
        assert issubclass(c, KVStoreError), c
        assert getattr(kvstore, c.__name__) is c, f"kvstore.{c.__name__} is not exported"
    assert issubclass(CorruptIndex, CorruptStore)
    assert issubclass(ConfigError, ValueError)


def test_a_symlinked_data_directory_is_a_data_dir_error(tmp_path):
    real = tmp_path / "nvme0"
    real.mkdir()
    os.symlink(real, tmp_path / "alias")
    with pytest.raises(DataDirError, match="symlink"):
        DiskStore.create(str(tmp_path / "store"), LAYOUT, 16 * 8192,
                         data_dirs=[str(tmp_path / "alias")])


def test_a_read_only_data_directory_is_a_data_dir_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:
            # root writes anyway: make it a file where a directory is expected instead
            os.chmod(ro, 0o755)
            os.rmdir(ro)
            ro.write_bytes(b"")
        with pytest.raises(DataDirError):
            DiskStore.create(str(tmp_path / "store"), LAYOUT, 16 * 8192, data_dirs=[str(ro)])
    finally:
        if ro.is_dir():
            os.chmod(ro, 0o755)


def test_a_damaged_fingerprint_is_corrupt_store_and_a_closed_store_says_so(tmp_path):
    path = str(tmp_path / "store")
    st = DiskStore.create(path, LAYOUT, 16 * 8192, io=True)
    keys = [b"k%03d" % i for i in range(4)]
    st.put(keys, lambda n, r: np.full(LAYOUT.block_bytes, n, np.uint8))
    st.close()
    with pytest.raises(StoreClosed, match="closed"):
        st.lookup(keys[0])
    with open(os.path.join(path, "kvstore.json"), "r+b") as f:
        f.write(b"{ not json")
    with pytest.raises(CorruptStore, match="kvstore fsck"):
        DiskStore(path)
