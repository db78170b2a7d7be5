"""Crash consistency: a storing child is SIGKILLed at random moments, 20+ times in a row.

After every kill the store reopens (reclaiming reservations that never committed), every
indexed key reads back exactly its deterministic payload on every rank, no slot belongs to
two keys, and used + free + reserved == capacity.
"""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest

from kvstore.store.disk import DiskStore
from kvstore.format.layout import Layout

BB = 32 << 10
LAYOUT = Layout(model="crash", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                num_kv_heads=2, head_dim=64, tp_size=2)

CHILD = textwrap.dedent("""
    import sys, zlib, numpy as np
    from kvstore.store.disk import DiskStore
    BB = %d
    def payload(key, rank):
        h = zlib.crc32(key) + rank
        return ((np.arange(BB, dtype=np.uint32) * (h %% 251 + 1) + h) %% 256).astype(np.uint8)
    st = DiskStore(sys.argv[1], io=True)
    print("READY", flush=True)
    run = sys.argv[2]
    i = 0
    while True:
        ks = [b"%%s-%%d" %% (run.encode(), i + j) for j in range(8)]
        st.put(ks, lambda n, r: payload(ks[n], r))
        i += 8
""" % BB)


def payload(key, rank):
    h = zlib.crc32(key) + rank
    return ((np.arange(BB, dtype=np.uint32) * (h % 251 + 1) + h) % 256).astype(np.uint8)


@pytest.mark.slow
def test_sigkill_while_storing_twenty_times(tmp_path, fd_leak_check):
    path = str(tmp_path / "store")
    DiskStore.create(path, LAYOUT, 48 * (BB + 4096) * 2).close()  # small: evictions happen
    rng = random.Random(1234)
    total_checked = 0
    for run in range(22):
        child = subprocess.Popen([sys.executable, "-c", CHILD, path, f"r{run}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "READY", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close(); child.stderr.close()
        st = DiskStore(path, io=True)  # reclaims reservations of the killed writer
        try:
            s = st.stats()
            assert s["reserved_slots"] == 0
            assert s["used_slots"] + s["free_slots"] == s["capacity_slots"]
            assert st.index.check_consistency() == []
            entries = list(st.index.iter_entries())
            slots = [e.slot for e in entries]
            assert len(slots) == len(set(slots)), "a slot is referenced by two keys"
            for e in entries:
                got = st.get([e.key], touch=False)
                assert e.key in got, f"run {run}: committed key {e.key!r} did not verify"
                for rank in (0, 1):
                    assert got[e.key][rank] == payload(e.key, rank).tobytes()
            total_checked += len(entries)
        finally:
            st.close()
    assert total_checked > 0
