"""A store's data directories must be distinct directories, not just distinct names: a
symlink is refused as such, and a bind mount of one directory at two paths (same device
and inode) is refused naming both."""
from __future__ import annotations

import os
import subprocess

import pytest

from kvstore.store.disk import DiskStore
from kvstore.errors import ConfigError, KVStoreError
from kvstore.format.layout import Layout

LAYOUT = Layout(model="dirs", dtype="float16", block_size=16, block_bytes=4096, num_layers=1,
                num_kv_heads=1, head_dim=64, tp_size=1)


def test_a_symlinked_data_dir_is_refused(tmp_path):
    a = tmp_path / "nvme0"
    a.mkdir()
    os.symlink(a, tmp_path / "alias")
    with pytest.raises(KVStoreError, match="symlink"):
        DiskStore.create(str(tmp_path / "store"), LAYOUT, 16 * 8192,
                         data_dirs=[str(a), str(tmp_path / "alias")])


@pytest.mark.root
def test_one_directory_bind_mounted_twice_is_refused_by_name(tmp_path):
    a, b, alias = tmp_path / "nvme0", tmp_path / "nvme1", tmp_path / "alias"
    for d in (a, b, alias):
        d.mkdir()
    subprocess.run(["mount", "--bind", str(a), str(alias)], check=True)
    try:
        with pytest.raises(ConfigError, match="same directory") as ei:
            DiskStore.create(str(tmp_path / "store"), LAYOUT, 16 * 8192,
                             data_dirs=[str(a), str(b), str(alias)])
        assert str(a) in str(ei.value) and str(alias) in str(ei.value)
        assert not os.path.exists(tmp_path / "store" / "kvstore.json")   # nothing was made
        assert os.listdir(a) == [] and os.listdir(b) == []
    finally:
        subprocess.run(["umount", str(alias)], check=True)
    DiskStore.create(str(tmp_path / "store"), LAYOUT, 16 * 8192,
                     data_dirs=[str(a), str(b)]).close()            # distinct ones are fine


@pytest.mark.root
def test_an_engine_on_a_read_only_store_is_refused_with_what_to_do(tmp_path):
    """A store on a read-only mount: an engine is refused with a message (not a bare
    OSError) and the store is unchanged; read-only openers still work."""
    p = str(tmp_path / "store")
    DiskStore.create(p, LAYOUT, 16 * 8192).close()
    before = sorted(os.listdir(p))
    subprocess.run(["mount", "--bind", p, p], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", p], check=True)
        with pytest.raises(KVStoreError, match="read-only") as ei:
            DiskStore(p)
        assert "for writing" in str(ei.value) and "kvstore info" in str(ei.value)
        DiskStore(p, readonly=True).close()
    finally:
        subprocess.run(["umount", p], check=True)
    assert sorted(os.listdir(p)) == before
    DiskStore(p).close()
