"""Staging (the one owner of staging memory and its slot free list) and the CUDA driver
loader's behaviour on a machine without a GPU: clear errors, nothing half-made."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from kvstore import _cuda
from kvstore._copy import CopyEngine
from kvstore.errors import ConfigError, KVStoreError
from kvstore.format.layout import ALIGN, HEADER_SIZE
from kvstore.io.staging import Staging


def test_views_follow_the_slot_format():
    st = Staging(3, HEADER_SIZE + 2 * ALIGN, 5000)
    try:
        assert st.address % ALIGN == 0 and st.nbytes == 3 * st.slot_size
        st.numpy()[:] = 0
        st.payload_view(1)[:] = 7
        img = st.slot_view(1)
        assert (img[:HEADER_SIZE] == 0).all() and (img[HEADER_SIZE:HEADER_SIZE + 5000] == 7).all()
        assert (img[HEADER_SIZE + 5000:] == 0).all()
        assert (st.slot_view(0) == 0).all() and (st.slot_view(2) == 0).all()
    finally:
        st.close()
    st.close()   # idempotent
    assert st.closed
    with pytest.raises(KVStoreError, match="closed"):
        st.numpy()


@pytest.mark.parametrize("args,match", [
    ((0, HEADER_SIZE + ALIGN, 10), "at least one slot"),
    ((1, HEADER_SIZE + 100, 10), "multiple of 4096"),
    ((1, HEADER_SIZE + ALIGN, ALIGN + 1), "does not fit"),
])
def test_bad_geometry_is_refused_with_the_numbers(args, match):
    with pytest.raises(ConfigError, match=match):
        Staging(*args)


def test_free_list_is_shared_between_threads():
    st = Staging(4, HEADER_SIZE + ALIGN, ALIGN)
    try:
        a = st.take(3)
        assert len(a) == 3 and st.free == 1
        assert st.take(2) is None and st.free == 1          # never a partial take
        assert st.take_up_to(5) == [s for s in range(4) if s not in a]
        assert st.take_up_to(1) == []                        # nothing free, no wait
        got = []
        t = threading.Thread(target=lambda: got.append(st.take(2, timeout=30)))
        t.start()
        st.give(a[:2])                                       # wakes the waiting taker
        t.join(30)
        assert sorted(got[0]) == sorted(a[:2])
        st.give(got[0] + [a[2]])
        assert st.free == 3
    finally:
        st.close()


def test_without_a_driver_pinning_fails_softly_and_cuda_copies_refuse(caplog):
    if _cuda.available():
        pytest.skip("this machine has a CUDA driver (tools/gpu_check.py covers it)")
    with pytest.raises(_cuda.CudaError, match="libcuda.so.1"):
        _cuda.driver_info()
    st = Staging(2, HEADER_SIZE + ALIGN, ALIGN)
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.io.staging"):
            assert st.pin(0) is False
        assert not st.pinned and "pinning" in caplog.text
        kv = np.zeros(4 * ALIGN, dtype=np.uint8)
        with pytest.raises(_cuda.CudaError, match="libcuda.so.1"):
            CopyEngine([(0, ALIGN, HEADER_SIZE, ALIGN, 4)], kv.ctypes.data, kv.nbytes, st.address,
                       st.nbytes, st.slot_size, device=0)
    finally:
        st.close()
