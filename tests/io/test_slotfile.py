"""SlotFile and slot headers: format, verification, O_DIRECT refusal, symlinks, truncation."""
import os
import subprocess

import numpy as np
import pytest

from kvstore import CorruptSlot, KVStoreError
from kvstore._hostbuf import HostBuffer
from kvstore._slotfile import (
    HEADER_SIZE, SlotFile, decode_header, encode_header, payload_checksum, slot_size_for,
    verify_slot,
)


def _image(key=b"k" * 33, slot=5, gen=9, plen=8192):
    ss = slot_size_for(plen)
    img = np.zeros(ss, dtype=np.uint8)
    img[HEADER_SIZE:HEADER_SIZE + plen] = np.random.default_rng(slot).integers(0, 256, plen, dtype=np.uint8)
    encode_header(img[:HEADER_SIZE], key, slot, gen, plen, payload_checksum(img[HEADER_SIZE:HEADER_SIZE + plen]))
    return img


def test_slot_size_rounds_payload():
    assert slot_size_for(1) == 8192
    assert slot_size_for(4096) == 8192
    assert slot_size_for(4097) == 12288


def test_header_round_trip():
    img = _image()
    h = decode_header(img[:HEADER_SIZE], 5)
    assert (h.key, h.slot, h.generation, h.payload_len) == (b"k" * 33, 5, 9, 8192)
    assert verify_slot(img, b"k" * 33, 5, 9, 8192).generation == 9


@pytest.mark.parametrize("where,match", [
    (100, "header checksum"),        # inside the header fields
    (HEADER_SIZE + 17, "payload checksum"),
    (0, "bad magic"),
])
def test_bit_flip_detected(where, match):
    img = _image()
    img[where] ^= 0x10
    with pytest.raises(CorruptSlot, match=match) as ei:
        verify_slot(img, b"k" * 33, 5, 9, 8192)
    assert ei.value.key == b"k" * 33


def test_wrong_key_generation_slot_detected():
    img = _image()
    with pytest.raises(CorruptSlot, match="holds key"):
        verify_slot(img, b"other", 5, 9, 8192)
    with pytest.raises(CorruptSlot, match="generation"):
        verify_slot(img, b"k" * 33, 5, 10, 8192)
    with pytest.raises(CorruptSlot, match="header says slot"):
        verify_slot(img, b"k" * 33, 6, 9, 8192)


def test_header_only_mode_skips_payload():
    img = _image()
    img[HEADER_SIZE + 1] ^= 1
    verify_slot(img, b"k" * 33, 5, 9, 8192, check_payload=False)  # header still fine
    with pytest.raises(CorruptSlot):
        verify_slot(img, b"k" * 33, 5, 9, 8192, check_payload=True)


def test_empty_slot_reported_as_never_written():
    with pytest.raises(CorruptSlot, match="never written"):
        decode_header(np.zeros(HEADER_SIZE, np.uint8), 3)


def test_key_too_long_refused():
    with pytest.raises(ValueError):
        encode_header(np.zeros(HEADER_SIZE, np.uint8), b"x" * 200, 0, 0, 1, 0)


def test_create_preallocates_0600(tmp_path, fd_leak_check):
    p = str(tmp_path / "a.kvs")
    with SlotFile(p, 8192, 10, create=True) as f:
        assert f.size == 81920 and f.offset(3) == 3 * 8192
        with pytest.raises(IndexError):
            f.offset(10)
    st = os.stat(p)
    assert st.st_size == 81920 and (st.st_mode & 0o777) == 0o600
    assert st.st_blocks * 512 >= 81920  # really allocated, not sparse


def test_truncated_file_refused(tmp_path, fd_leak_check):
    p = str(tmp_path / "a.kvs")
    SlotFile(p, 8192, 10, create=True).close()
    os.truncate(p, 8192 * 9)
    with pytest.raises(KVStoreError, match="truncated"):
        SlotFile(p, 8192, 10)


def test_symlink_refused(tmp_path, fd_leak_check):
    p = str(tmp_path / "a.kvs")
    SlotFile(p, 8192, 2, create=True).close()
    os.symlink(p, tmp_path / "link.kvs")
    with pytest.raises(KVStoreError, match="symlink"):
        SlotFile(str(tmp_path / "link.kvs"), 8192, 2)


def test_missing_file_message(tmp_path):
    with pytest.raises(KVStoreError, match="missing"):
        SlotFile(str(tmp_path / "nope.kvs"), 8192, 2)


def test_o_direct_refusal_names_page_cache_option(ramfs, fd_leak_check):
    """ramfs has no O_DIRECT: opening there fails loudly, naming the page-cache option,
    and leaves nothing behind; page-cache mode then works on the same directory."""
    p = str(ramfs / "x.kvs")
    with pytest.raises(KVStoreError, match="page_cache") as ei:
        SlotFile(p, 8192, 2, create=True)
    assert "--page-cache" in str(ei.value) and "O_DIRECT" in str(ei.value)
    with SlotFile(p, 8192, 2, create=True, direct=False) as f:
        assert f.size == 16384


def test_hostbuffer_views_share_memory_and_survive_close():
    import torch
    hb = HostBuffer(10000)
    assert hb.nbytes == 12288 and hb.address % 4096 == 0
    a = hb.numpy()
    t = hb.torch()
    a[5] = 77
    assert int(t[5]) == 77 and t.data_ptr() == hb.address
    hb.close()          # views alive: the mapping stays until they are gone
    assert hb.closed
    assert a[5] == 77
    del a, t
    with pytest.raises(KVStoreError):
        hb.numpy()


def test_hostbuffer_check_range():
    from kvstore import AlignmentError
    hb = HostBuffer(8192)
    hb.check_range(4096, 4096)
    with pytest.raises(AlignmentError, match="outside the staging buffer"):
        hb.check_range(4096, 8192)
    with pytest.raises(AlignmentError, match="not a positive multiple"):
        hb.check_range(0, 100)
    hb.close()
