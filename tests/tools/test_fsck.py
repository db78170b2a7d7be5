"""kvstore fsck: every finding kind planted in a real store, repair, re-check, serving.

Each case writes a real store (DiskStore.create + put), closes it, damages it the way the
finding describes (bytes in slot files, files removed or truncated, LMDB rows changed
through Index internals), then checks that fsck reports the kind, that --repair fixes it
(exit 1), that a second fsck --deep finds the store clean (exit 0) and that every intact
entry is still served byte-exact.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from click.testing import CliRunner

import kvstore.format.layout as layout_mod
from kvstore import _slotfile
from kvstore.cli import main
from kvstore.store.disk import DiskStore, slot_file_path
from kvstore.index.core import Index
from kvstore.format.layout import Layout
from kvstore.tools import fsck as F
from kvstore.tools.fsck import fsck

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLOCK = 8192
SLOT = 4096 + BLOCK
NKEYS = 24
CAP = 40


def layout(tp=1):
    return Layout(model="tiny", dtype="float16", block_size=16, block_bytes=BLOCK, num_layers=2,
                  num_kv_heads=2, head_dim=16, tp_size=tp)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8 + b"\x00"  # 33 bytes, like a sha256 block hash + group id


def payload(i: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng(i * 7 + rank)
    return rng.integers(0, 256, BLOCK, dtype=np.uint8)


def make_store(path, *, tp=1, nkeys=NKEYS, cap=CAP, slots_per_file=None, monkeypatch=None):
    if slots_per_file is not None:
        monkeypatch.setattr(layout_mod, "MAX_FILE_BYTES", slots_per_file * SLOT)
    keys = [key(i) for i in range(nkeys)]
    with DiskStore.create(str(path), layout(tp), cap * SLOT * tp, io=True, staging_bytes=1 << 20) as st:
        assert st.put(keys, payload) == keys
    return keys


def serves(path, keys, tp=1):
    """Keys served byte-exact (each looked up alone)."""
    ok = []
    with DiskStore(str(path), io=True, staging_bytes=1 << 20) as st:
        assert st.index.check_consistency() == []
        for i, k in enumerate(keys):
            got = st.get([k], touch=False)
            if k in got:
                assert [bytes(x) for x in got[k]] == [payload(i, r).tobytes() for r in range(tp)]
                ok.append(k)
    return ok


def slot_of(path, k):
    with Index(os.path.join(str(path), "index"), None, readonly=True) as ix:
        return ix.lookup(k)


def write_at(path, slot, offset, data, rank=0, spf=None):
    spf = spf or CAP
    p = slot_file_path(str(path), rank, slot // spf)
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, data, (slot % spf) * SLOT + offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def header(k, slot, gen, plen=BLOCK, csum=0):
    buf = bytearray(4096)
    _slotfile.encode_header(buf, k, slot, gen, plen, csum)
    return bytes(buf)


def index_edit(path, fn):
    ix = Index(os.path.join(str(path), "index"), None)
    try:
        ix._write(lambda txn: fn(ix, txn))
    finally:
        ix.close()


U32 = struct.Struct(">I")
LRU = struct.Struct(">QI")
VAL = struct.Struct("<IQQ")
U64 = struct.Struct("<Q")


# ------------------------------------------------------------------ plants
# Each returns the keys the damage destroys (repair must drop them; every other key
# must still be served).

def plant_header_corrupt(p, keys):
    e = slot_of(p, keys[3])
    write_at(p, e.slot, 20, b"\xff\xfe")
    return {keys[3]}


def plant_payload_corrupt(p, keys):
    e = slot_of(p, keys[5])
    write_at(p, e.slot, 4096 + 1000, b"\x00\x01\x02")
    return {keys[5]}


def plant_key_mismatch(p, keys):
    e = slot_of(p, keys[6])
    write_at(p, e.slot, 0, header(b"someone else's key", e.slot, e.generation))
    return {keys[6]}


def plant_generation_mismatch(p, keys):
    e = slot_of(p, keys[7])
    write_at(p, e.slot, 0, header(keys[7], e.slot, e.generation + 5))
    return {keys[7]}


def plant_header_mismatch(p, keys):
    e = slot_of(p, keys[8])
    write_at(p, e.slot, 0, header(keys[8], e.slot + 1, e.generation))
    return {keys[8]}


def plant_malformed_row(p, keys):
    index_edit(p, lambda ix, txn: txn.put(b"short-value-key", b"\x01\x02", db=ix._keys))
    return set()


def plant_slot_out_of_range(p, keys):
    e = slot_of(p, keys[2])

    def fn(ix, txn):
        txn.put(keys[2], VAL.pack(CAP + 5, e.generation, e.tick), db=ix._keys)
    index_edit(p, fn)
    return {keys[2]}


def plant_slot_shared(p, keys):
    a, b = slot_of(p, keys[1]), slot_of(p, keys[2])

    def fn(ix, txn):  # key 2 now claims key 1's slot too
        txn.put(keys[2], VAL.pack(a.slot, b.generation, b.tick), db=ix._keys)
    index_edit(p, fn)
    return {keys[2]}


def plant_slot_key_mismatch(p, keys):
    e = slot_of(p, keys[4])
    index_edit(p, lambda ix, txn: txn.delete(U32.pack(e.slot), db=ix._slots))
    return set()


def plant_stray_slot_row(p, keys):
    with DiskStore(str(p)) as st:
        st.drop([keys[9]])  # slot -> free list, header stays
    e_slot = None
    with Index(os.path.join(str(p), "index"), None, readonly=True) as ix:
        e_slot = next(iter(ix.iter_free()))
    index_edit(p, lambda ix, txn: txn.put(U32.pack(e_slot), b"ghost", db=ix._slots))
    return {keys[9]}


def plant_lru_missing(p, keys):
    e = slot_of(p, keys[10])
    index_edit(p, lambda ix, txn: txn.delete(LRU.pack(e.tick, e.slot), db=ix._lru))
    return set()


def plant_lru_stray(p, keys):
    e = slot_of(p, keys[10])
    index_edit(p, lambda ix, txn: txn.put(LRU.pack(e.tick + 1000, e.slot), b"", db=ix._lru))
    return set()


def plant_free_conflict(p, keys):
    e = slot_of(p, keys[11])
    index_edit(p, lambda ix, txn: txn.put(U32.pack(e.slot), b"", db=ix._free))
    return set()


def plant_counter(p, keys):
    index_edit(p, lambda ix, txn: txn.put(b"generation", U64.pack(1), db=ix._meta))
    return set()


def plant_leaked_slot(p, keys):
    # high_water moves past a never-written slot that no list holds
    index_edit(p, lambda ix, txn: txn.put(b"high_water", U64.pack(NKEYS + 1), db=ix._meta))
    return set()


def plant_orphan(p, keys):
    # a complete, valid slot image for a key the index does not hold, in a slot no list holds
    data = payload(999, 0)
    img = header(b"orphan-key", NKEYS, 10_000, BLOCK, _slotfile.payload_checksum(data)) + data.tobytes()
    write_at(p, NKEYS, 0, img)
    index_edit(p, lambda ix, txn: txn.put(b"high_water", U64.pack(NKEYS + 1), db=ix._meta))
    return set()


def plant_owned_stray(p, keys):
    # an engine's reservation row for a slot that is in use, not reserved
    e = slot_of(p, keys[5])
    owner = struct.pack(">IQ", 4242, 77)
    index_edit(p, lambda ix, txn: txn.put(owner + U32.pack(e.slot), b"", db=ix._owned))
    return set()


CASES = {
    "owned_stray": plant_owned_stray,
    "header_corrupt": plant_header_corrupt,
    "payload_corrupt": plant_payload_corrupt,
    "key_mismatch": plant_key_mismatch,
    "generation_mismatch": plant_generation_mismatch,
    "header_mismatch": plant_header_mismatch,
    "malformed_row": plant_malformed_row,
    "slot_out_of_range": plant_slot_out_of_range,
    "slot_shared": plant_slot_shared,
    "slot_key_mismatch": plant_slot_key_mismatch,
    "stray_slot_row": plant_stray_slot_row,
    "lru_missing": plant_lru_missing,
    "lru_stray": plant_lru_stray,
    "free_conflict": plant_free_conflict,
    "counter": plant_counter,
    "leaked_slot": plant_leaked_slot,
    "orphan": plant_orphan,
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_finding_planted_found_repaired(tmp_path, kind, fd_leak_check):
    p = tmp_path / "store"
    keys = make_store(p)
    lost = CASES[kind](p, keys)
    deep = kind == "payload_corrupt"
    if deep:  # a header-only check cannot see a payload flip
        assert fsck(str(p)).exit_code == F.EXIT_CLEAN
    rep = fsck(str(p), deep=deep)
    assert kind in rep.counts(), rep.to_json()
    assert rep.exit_code == F.EXIT_UNCORRECTED
    assert all(not f.fixed for f in rep.findings)
    for f in rep.findings:
        assert f.kind in F.KINDS and f.detail
    rep2 = fsck(str(p), deep=deep, repair=True)
    assert rep2.exit_code == F.EXIT_CORRECTED, F.format_text(rep2)
    assert kind in rep2.counts() and all(f.fixed for f in rep2.findings)
    again = fsck(str(p), deep=True)
    assert again.exit_code == F.EXIT_CLEAN, F.format_text(again)
    served = serves(p, keys)
    assert set(served) == set(keys) - lost


def test_clean_store_and_json(tmp_path):
    p = tmp_path / "store"
    make_store(p, tp=2)
    rep = fsck(str(p), deep=True)
    assert rep.exit_code == 0 and rep.findings == []
    assert rep.stats["slots_checked"] == NKEYS
    assert rep.stats["bytes_read"] == NKEYS * SLOT * 2
    r = CliRunner().invoke(main, ["fsck", "--json", "--deep", "-q", str(p)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["clean"] and doc["counts"] == {} and doc["findings"] == []
    r = CliRunner().invoke(main, ["fsck", "-q", str(p)])
    assert r.exit_code == 0 and "clean" in r.output


def test_json_lists_findings_with_hex_keys(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p)
    plant_key_mismatch(p, keys)
    r = CliRunner().invoke(main, ["fsck", "--json", "-q", str(p)])
    assert r.exit_code == 4
    doc = json.loads(r.output)
    assert doc["counts"] == {"key_mismatch": 1}
    (f,) = doc["findings"]
    assert f["kind"] == "key_mismatch" and f["key"] == keys[6].hex()
    assert f["slot"] == slot_of(p, keys[6]).slot and f["fixed"] is False
    r = CliRunner().invoke(main, ["fsck", "--json", "-q", "--repair", str(p)])
    assert r.exit_code == 1 and json.loads(r.output)["errors_corrected"] == 1


def test_multirank_header_damage_on_one_rank(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p, tp=2)
    e = slot_of(p, keys[0])
    write_at(p, e.slot, 4096 + 10, b"\x55", rank=1)
    rep = fsck(str(p), deep=True)
    assert rep.counts() == {"payload_corrupt": 1} and rep.findings[0].rank == 1
    assert fsck(str(p), deep=True, repair=True).exit_code == 1
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys, tp=2)) == set(keys[1:])


# ------------------------------------------------------------------ slot files

def test_slot_file_missing(tmp_path, monkeypatch):
    p = tmp_path / "store"
    keys = make_store(p, cap=32, slots_per_file=8, monkeypatch=monkeypatch)
    os.unlink(slot_file_path(str(p), 0, 1))            # slots 8..15
    rep = fsck(str(p))
    c = rep.counts()
    assert c["slot_file_missing"] == 1 and c["slot_unreadable"] == 8
    assert rep.exit_code == 4
    rep = fsck(str(p), repair=True)
    assert rep.exit_code == 1, F.format_text(rep)
    # after the file is recreated its slots read as empty: those entries are dropped
    assert rep.counts().get("header_corrupt") == 8
    assert fsck(str(p), deep=True).exit_code == 0
    # put() on a fresh store fills slots 0.. in key order: keys 8..15 lived in that file
    assert set(serves(p, keys)) == set(keys) - set(keys[8:16])


def test_slot_file_truncated_keeps_intact_front(tmp_path, monkeypatch):
    p = tmp_path / "store"
    keys = make_store(p, cap=32, slots_per_file=8, monkeypatch=monkeypatch)
    os.truncate(slot_file_path(str(p), 0, 2), 3 * SLOT)  # slots 16..18 survive, 19..23 gone
    rep = fsck(str(p))
    assert rep.counts()["slot_file_size"] == 1 and rep.exit_code == 4
    assert "truncated" in rep.findings[0].detail
    assert fsck(str(p), repair=True).exit_code == 1
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys)) == set(keys) - set(keys[19:24])
    assert os.path.getsize(slot_file_path(str(p), 0, 2)) == 8 * SLOT


def test_slot_file_symlink(tmp_path, monkeypatch):
    p = tmp_path / "store"
    keys = make_store(p, cap=32, slots_per_file=8, monkeypatch=monkeypatch)
    f = slot_file_path(str(p), 0, 3)                    # slots 24..31: unused
    target = tmp_path / "elsewhere.kvs"
    shutil.move(f, target)
    os.symlink(target, f)
    rep = fsck(str(p))
    assert rep.counts() == {"slot_file_invalid": 1}
    assert fsck(str(p), repair=True).exit_code == 1
    assert not os.path.islink(f) and target.exists()   # the link went, its target stays
    assert fsck(str(p)).exit_code == 0
    assert set(serves(p, keys)) == set(keys)


# ------------------------------------------------------------------ index

def test_index_missing_rebuild(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p, tp=2)
    with DiskStore(str(p), io=True) as st:
        st.get(keys[:3])
        st.drop([keys[20]])     # slot stays intact on disk: a rebuild adopts it again
    shutil.rmtree(p / "index")
    rep = fsck(str(p))
    assert rep.counts() == {"index_missing": 1} and rep.exit_code == 4
    with pytest.raises(Exception, match="rebuild-index"):
        DiskStore(str(p))
    rep = fsck(str(p), rebuild_index=True, deep=True)
    assert rep.exit_code == 1, F.format_text(rep)
    assert rep.stats["rebuilt_entries"] == NKEYS
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys, tp=2)) == set(keys)
    with DiskStore(str(p)) as st:  # generations never go back: new stores stay unique
        refs, _ = st.reserve([b"new-key"])
        assert refs[0].generation > max(st.lookup(k).generation for k in keys)
        st.abort(refs)


def test_index_unreadable_rebuild(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p)
    with open(p / "index" / "data.mdb", "r+b") as f:
        f.write(b"\x00" * 8192)
    rep = fsck(str(p))
    assert rep.counts() == {"index_unreadable": 1} and rep.exit_code == 4
    assert fsck(str(p), repair=True).exit_code == 4          # repair alone cannot
    rep = fsck(str(p), rebuild_index=True)
    assert rep.exit_code == 1
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys)) == set(keys)


def test_capacity_mismatch_rebuild(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p)
    shutil.rmtree(p / "index")
    Index(str(p / "index"), CAP * 2, create=True).close()
    rep = fsck(str(p))
    assert rep.counts() == {"capacity_mismatch": 1}
    assert fsck(str(p), rebuild_index=True).exit_code == 1
    assert fsck(str(p)).exit_code == 0
    assert set(serves(p, keys)) == set(keys)


def test_rebuild_skips_corrupt_and_torn_slots(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p)
    plant_payload_corrupt(p, keys)
    plant_header_corrupt(p, keys)
    shutil.rmtree(p / "index")
    rep = fsck(str(p), rebuild_index=True)   # a rebuild always verifies payloads
    assert rep.stats["rebuilt_entries"] == NKEYS - 2 and rep.exit_code == 1
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys)) == set(keys) - {keys[3], keys[5]}


def test_rebuild_index_on_healthy_store_keeps_counters(tmp_path):
    p = tmp_path / "store"
    keys = make_store(p)
    with DiskStore(str(p), io=True) as st:
        st.get(keys[:4])
        hits = st.stats()["hits"]
    rep = fsck(str(p), rebuild_index=True)
    assert rep.exit_code == 0 and rep.findings == []
    with DiskStore(str(p)) as st:
        assert st.stats()["hits"] == hits and st.stats()["used_slots"] == NKEYS


def test_fingerprint_missing_and_invalid(tmp_path):
    p = tmp_path / "store"
    make_store(p)
    fp = p / "kvstore.json"
    good = fp.read_bytes()
    fp.write_text("{not json")
    rep = fsck(str(p))
    assert rep.counts() == {"fingerprint_invalid": 1} and rep.exit_code == F.EXIT_OPERATIONAL
    fp.unlink()
    rep = fsck(str(p))
    assert rep.counts() == {"fingerprint_missing": 1} and rep.exit_code == F.EXIT_OPERATIONAL
    fp.write_bytes(good)
    assert fsck(str(p)).exit_code == 0
    r = CliRunner().invoke(main, ["fsck", str(tmp_path / "nope")])
    assert r.exit_code == 8 and "not a directory" in r.output


def test_usage_error_exit_16(tmp_path):
    r = CliRunner().invoke(main, ["fsck"])
    assert r.exit_code == 16
    r = CliRunner().invoke(main, ["fsck", "--bogus", str(tmp_path)])
    assert r.exit_code == 16


def test_many_findings_at_once_one_repair(tmp_path, monkeypatch):
    p = tmp_path / "store"
    keys = make_store(p, cap=32, slots_per_file=8, monkeypatch=monkeypatch)
    lost = set()
    spf = 8
    for plant in (plant_header_corrupt, plant_lru_stray, plant_free_conflict, plant_slot_shared):
        if plant is plant_header_corrupt:
            e = slot_of(p, keys[3])
            write_at(p, e.slot, 20, b"\xff", spf=spf)
            lost.add(keys[3])
        else:
            lost |= plant(p, keys)
    os.unlink(slot_file_path(str(p), 0, 2))  # slots 16..23
    lost |= set(keys[16:24])
    rep = fsck(str(p))
    assert rep.exit_code == 4 and len(rep.counts()) >= 5
    assert fsck(str(p), repair=True).exit_code == 1
    assert fsck(str(p), deep=True).exit_code == 0
    assert set(serves(p, keys)) == set(keys) - lost


# ------------------------------------------------------------------ with a live writer

WRITER = textwrap.dedent(r"""
    import sys, time, numpy as np
    sys.path.insert(0, sys.argv[2])
    from kvstore.store.disk import DiskStore
    st = DiskStore(sys.argv[1], io=True)
    print("ready", flush=True)
    i = 1000
    deadline = time.time() + 60
    while time.time() < deadline:
        ks = [i.to_bytes(4, "big") * 8 + bytes([j]) for j in range(4)]
        st.put(ks, lambda n, r: np.full(8192, (i + n) % 251, np.uint8))   # evicts: capacity is small
        st.get(ks[:2])
        i += 1
        if sys.stdin in __import__("select").select([sys.stdin], [], [], 0)[0]:
            break
    st.close()
    print("done", i, flush=True)
""")


def test_fsck_while_a_writer_serves(tmp_path):
    p = tmp_path / "store"
    make_store(p)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(p), REPO], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        for _ in range(5):
            rep = fsck(str(p), deep=True)
            assert rep.exit_code == 0, F.format_text(rep)
            assert rep.stats["writer_pid"] == proc.pid
        r = CliRunner().invoke(main, ["fsck", "-q", "--repair", str(p)])
        assert r.exit_code == 8
        assert f"pid {proc.pid}" in r.output
        r = CliRunner().invoke(main, ["info", "--json", str(p)])
        assert r.exit_code == 0 and json.loads(r.output)["writer_pid"] == proc.pid
    finally:
        proc.stdin.write("stop\n")
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait(30)
    assert proc.returncode == 0 and out.startswith("done")
    assert int(out.split()[1]) > 1000   # the writer really wrote while fsck ran
    rep = fsck(str(p), deep=True, repair=True)
    assert rep.exit_code == 0, F.format_text(rep)


# ------------------------------------------------------------------ next to several engines

HOLDER = textwrap.dedent(r"""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[2])
    from kvstore.store.disk import DiskStore
    st = DiskStore(sys.argv[1], io=True)
    ks = [(5000 + j).to_bytes(4, "big") * 8 + b"\x01" for j in range(4)]
    st.put(ks, lambda n, r: np.full(8192, n + 1, np.uint8))
    refs, _ = st.reserve([(6000 + j).to_bytes(4, "big") * 8 + b"\x01" for j in range(3)])
    print("ready", flush=True)
    sys.stdin.read()          # an in-flight store (3 reservations) until told to go
    st.abort(refs)
    st.close()
""")


def test_fsck_next_to_two_engines_and_repair_refused_naming_both(tmp_path):
    """Two engine processes attached (one storing and evicting all the time, one holding
    reservations of an in-flight store): the read-only check (deep, repeated) is clean
    and says which engines are attached; --repair and --rebuild-index are refused, naming
    both pids and what to do; once they are gone --repair runs and finds nothing."""
    p = tmp_path / "store"
    make_store(p)
    a = subprocess.Popen([sys.executable, "-c", WRITER, str(p), REPO], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    b = None
    try:
        assert a.stdout.readline().strip() == "ready"
        b = subprocess.Popen([sys.executable, "-c", HOLDER, str(p), REPO], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert b.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        for _ in range(3):
            rep = fsck(str(p), deep=True)
            assert rep.exit_code == 0, F.format_text(rep)
            assert sorted(rep.stats["engine_pids"]) == sorted([a.pid, b.pid])
            assert rep.stats["writer_pid"] in (a.pid, b.pid)
            assert rep.stats["reserved_in_flight"] >= 3
        text = F.format_text(rep)
        assert "note: engines attached: pids " in text and str(a.pid) in text and str(b.pid) in text
        assert "clean" in text
        for flag in ("--repair", "--rebuild-index"):
            r = CliRunner().invoke(main, ["fsck", "-q", flag, str(p)])
            assert r.exit_code == 8, r.output
            assert "2 engine(s) are attached" in r.output, r.output
            assert str(a.pid) in r.output and str(b.pid) in r.output
            assert "stop them" in r.output and "without --repair" in r.output
        r = CliRunner().invoke(main, ["fsck", "-q", "--json", "--repair", str(p)])
        doc = json.loads(r.output)
        assert r.exit_code == 8 and sorted(doc["stats"]["engine_pids"]) == sorted([a.pid, b.pid])
        assert "refusing to repair" in doc["error"]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                if proc is a:
                    proc.stdin.write("stop\n")
                proc.stdin.close()
                proc.wait(30)
    assert a.returncode == 0 and b.returncode == 0
    rep = fsck(str(p), deep=True, repair=True)
    assert rep.exit_code == 0, F.format_text(rep)
    assert rep.stats["engine_pids"] == [] and rep.stats["reserved_in_flight"] == 0
