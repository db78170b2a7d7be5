"""Blocks as they travel through the pool: one record per block and rank, a header that
names what it is (the store's fingerprint digest, the block's key, the rank) and the
payload's checksum, then the payload. A record is verified like a local slot before
anything is written: a corrupt record, a record of another model or geometry, or one
stored under another key is never served.

Record header (little-endian, `HEADER_SIZE` bytes):
    0   8s   magic b"KVSPOOL1"
    8   u16  rank
    10  u16  key length (<= 64)
    12  u32  reserved (0)
    16  32s  fingerprint digest (`fingerprint_digest`)
    48  u64  payload length
    56  u64  payload checksum: xxh3_64 (as a slot's)
    64  64s  key (zero padded)
    128 u32  header checksum: crc32 of bytes [0, 128)
    132..255 zero
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib

from kvstore._slotfile import payload_checksum
from kvstore.format.layout import Layout

MAGIC = b"KVSPOOL1"
HEADER_SIZE = 256
MAX_KEY = 64
_HEAD = struct.Struct("<8sHHI32sQQ64s")
_CRC = struct.Struct("<I")


def fingerprint_digest(layout: Layout, identity: dict | None) -> bytes:
    """32 bytes that differ whenever two stores' blocks must not be shared: the layout
    (model, dtype, geometry of a block, TP size, hashing, KV cache groups) and the model
    identity (weights, config, revision, quantization, overrides)."""
    doc = {"layout": layout.to_dict(), "model_identity": identity}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()


def pool_key(digest: bytes, key: bytes, rank: int) -> str:
    """The pool's key of a block's record for one rank: the store's fingerprint digest is
    in it, so stores of two models or two geometries never see each other's blocks."""
    return f"kvs1/{digest[:16].hex()}/{rank}/{key.hex()}"


def encode_into(buf, digest: bytes, key: bytes, rank: int, payload) -> int:
    """Write the record of `payload` into `buf` (a writable buffer of at least
    HEADER_SIZE + len(payload) bytes); returns its size."""
    if len(key) > MAX_KEY:
        raise ValueError(f"a pool record's key is at most {MAX_KEY} bytes, got {len(key)}")
    mv = memoryview(buf).cast("B")
    n = len(payload)
    head = _HEAD.pack(MAGIC, rank, len(key), 0, digest, n, payload_checksum(payload), key)
    mv[:_HEAD.size] = head
    mv[_HEAD.size:_HEAD.size + _CRC.size] = _CRC.pack(zlib.crc32(head))
    mv[_HEAD.size + _CRC.size:HEADER_SIZE] = bytes(HEADER_SIZE - _HEAD.size - _CRC.size)
    mv[HEADER_SIZE:HEADER_SIZE + n] = memoryview(payload).cast("B")
    return HEADER_SIZE + n


def check(record, digest: bytes, key: bytes, rank: int, payload_len: int) -> str | None:
    """Why `record` (a buffer of HEADER_SIZE + payload_len bytes) must not be served, or
    None when it is this store's block `key` for `rank`, intact."""
    mv = memoryview(record).cast("B")
    if len(mv) < HEADER_SIZE + payload_len:
        return "short record"
    head = bytes(mv[:_HEAD.size])
    magic, r, klen, _, dig, n, csum, k = _HEAD.unpack(head)
    if magic != MAGIC:
        return "not a kvstore pool record"
    if _CRC.unpack(mv[_HEAD.size:_HEAD.size + _CRC.size])[0] != zlib.crc32(head):
        return "header checksum mismatch"
    if dig != digest:
        return "another store fingerprint (model or layout)"
    if r != rank or k[:klen] != key or n != payload_len:
        return "another block"
    if payload_checksum(mv[HEADER_SIZE:HEADER_SIZE + n]) != csum:
        return "payload checksum mismatch"
    return None
