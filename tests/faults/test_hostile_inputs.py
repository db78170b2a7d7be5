"""Hostile or damaged files: every parser returns a clean KVStoreError or a miss.

Property-based (hypothesis): random and mutated slot headers, kvstore.json files and index
records are fed to the code that reads them. Never a crash, a hang, or a huge allocation,
and nothing from disk is ever unpickled or evaluated.
"""
import json
import os
import struct

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVStoreError
from kvstore._slotfile import HEADER_SIZE, decode_header, encode_header, payload_checksum, verify_slot
from kvstore.store.disk import DiskStore
from kvstore.index.core import Index
from kvstore.format.layout import Layout, read_fingerprint

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LAYOUT = Layout(model="m", dtype="float16", block_size=16, block_bytes=4096, num_layers=1,
                num_kv_heads=1, head_dim=64)


def good_image(key=b"key-1", slot=3, gen=7):
    img = np.zeros(HEADER_SIZE + 4096, np.uint8)
    img[HEADER_SIZE:] = np.arange(4096) % 251
    encode_header(img[:HEADER_SIZE], key, slot, gen, 4096, payload_checksum(img[HEADER_SIZE:]))
    return img


@FAST
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 64))
def test_random_header_bytes(data):
    img = np.zeros(HEADER_SIZE + 4096, np.uint8)
    img[:min(len(data), img.size)] = np.frombuffer(data[:img.size], np.uint8)
    try:
        verify_slot(img, b"key-1", 3, 7, 4096)
    except KVStoreError:
        pass
    try:
        decode_header(data, 0)
    except KVStoreError:
        pass


@FAST
@given(st.dictionaries(st.integers(0, 179), st.integers(1, 255), min_size=1, max_size=8))
def test_mutated_header_never_verifies(flips):
    img = good_image()
    for pos, x in flips.items():
        img[pos] ^= x
    with pytest.raises(KVStoreError):
        verify_slot(img, b"key-1", 3, 7, 4096)


@FAST
@given(st.integers(HEADER_SIZE, HEADER_SIZE + 4095), st.integers(1, 255))
def test_mutated_payload_never_verifies(pos, x):
    img = good_image()
    img[pos] ^= x
    with pytest.raises(KVStoreError):
        verify_slot(img, b"key-1", 3, 7, 4096)


def test_huge_claimed_lengths_do_not_allocate():
    """A header claiming a 2**63-byte payload or a 65535-byte key is refused, not trusted."""
    img = good_image()
    body = bytearray(img[:176].tobytes())
    struct.pack_into("<Q", body, 32, 1 << 63)       # payload length
    struct.pack_into("<H", body, 10, 65535)          # key length
    import zlib
    img[:176] = np.frombuffer(bytes(body), np.uint8)
    img[176:180] = np.frombuffer(struct.pack("<I", zlib.crc32(bytes(body))), np.uint8)
    with pytest.raises(KVStoreError):
        verify_slot(img, b"key-1", 3, 7, 4096)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)


@FAST
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
def test_random_fingerprints(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("fp")
    (d / "kvstore.json").write_bytes(raw)
    with pytest.raises(KVStoreError):
        read_fingerprint(str(d))


@FAST
@given(st.sampled_from(["format_version", "layout", "num_slots", "slot_size", "slots_per_file",
                        "capacity_bytes"]),
       st.one_of(st.none(), st.integers(-5, 1 << 70), st.text(max_size=5), st.lists(st.integers(), max_size=3)))
def test_mutated_fingerprint_fields(tmp_path_factory, field, value):
    d = tmp_path_factory.mktemp("fpm")
    DiskStore.create(str(d / "s"), LAYOUT, "1M").close()
    p = d / "s" / "kvstore.json"
    doc = json.loads(p.read_text())
    doc[field] = value
    p.write_text(json.dumps(doc))
    try:
        layout, geo, _ = read_fingerprint(str(d / "s"))
    except KVStoreError:
        return
    # Accepted only if still coherent.
    assert geo.num_slots >= 1 and geo.slot_size == layout.slot_size


@FAST
@given(st.sampled_from(["keys", "slots", "lru", "free", "reserved"]), st.binary(min_size=0, max_size=40),
       st.binary(min_size=0, max_size=40))
def test_garbage_index_records(tmp_path_factory, db, k, v):
    """A garbage row in any named database: reads give a miss or CorruptIndex, never a crash."""
    d = tmp_path_factory.mktemp("ix")
    path = str(d / "index")
    ix = Index(path, 64, create=True)
    ix.reserve([b"a", b"b"])
    ix.commit([(b"a", 0, 1), (b"b", 1, 2)])
    ix.close()
    env = lmdb.open(path, max_dbs=8, subdir=True)
    handle = env.open_db(db.encode())
    with env.begin(write=True) as txn:
        try:
            txn.put(k or b"\0", v, db=handle)
        except lmdb.Error:
            pass
    env.close()
    try:
        ix = Index(path, 64)
    except KVStoreError:
        return
    try:
        for call in (lambda: ix.lookup(k or b"a"), lambda: ix.longest_prefix([b"a", b"b", k]),
                     lambda: list(ix.iter_entries()), lambda: list(ix.iter_lru()),
                     lambda: list(ix.iter_free()), lambda: list(ix.iter_reserved()), ix.stats,
                     lambda: ix.reserve([b"new1", b"new2"]), ix.reclaim_reserved):
            try:
                call()
            except KVStoreError:
                pass
    finally:
        ix.close()


def test_nothing_from_disk_is_unpickled_or_evaluated():
    """The readers of disk data use struct/json only: no pickle, eval or exec anywhere."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sources = [os.path.join(root, "kvstore", f) for f in ("index/core.py", "store/disk.py", "format/layout.py")]
    sources += [os.path.join(root, "cython_src", "kvstore", f) for f in ("_slotfile.pyx", "_ring.pyx", "_hostbuf.pyx")]
    for path in sources:
        text = open(path).read()
        for bad in ("import pickle", "pickle.load", "eval(", "exec(", "marshal.load"):
            assert bad not in text, f"{path} uses {bad}"
