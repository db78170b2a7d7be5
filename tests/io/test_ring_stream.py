"""Streamed ring calls: slot_io parts started on one ring while another is in
flight, so the queue refills from the next part as the current one drains; the device
thread that drives them (DeviceStream) and the batch loops that use it (RankIO)."""
import threading
import time

import numpy as np
import pytest

from kvstore import KVStoreError
from kvstore._hostbuf import HostBuffer
from kvstore._ring import Ring
from kvstore._slotfile import SlotFile
from kvstore.io.device_stream import DeviceStream

SLOT = 20 << 10            # 4 KiB header + 16 KiB payload
IO_LEN = SLOT - 4096
PAYLOAD = IO_LEN


def _setup(tmp_path, nslots=256, depth=8, staging=256):
    f = SlotFile(str(tmp_path / "f.kvs"), SLOT, nslots, direct=True, create=True)
    hb = HostBuffer(staging * SLOT)
    ring = Ring(depth)
    ring.register_buffers([hb])
    ring.register_files([f.fd], [f.path])
    return f, hb, ring


def _start(ring, f, hb, opcode, slots, stage, gen=1):
    n = len(slots)
    offs = np.array(slots, dtype=np.uint64) * SLOT
    hdrs = hb.address + np.array(stage, dtype=np.uint64) * SLOT
    keys = [b"key%06d" % s for s in slots]
    return ring.slot_io_start(opcode, [f.fd] * n, offs, hdrs, None, IO_LEN, keys, list(slots),
                              [gen] * n, PAYLOAD)


def _fill(hb, stage, slots):
    a = hb.numpy()
    for j, s in zip(stage, slots):
        a[j * SLOT + 4096:(j + 1) * SLOT] = s % 251


def _payload_ok(hb, stage, slots):
    a = hb.numpy()
    return all((a[j * SLOT + 4096:(j + 1) * SLOT] == s % 251).all() for j, s in zip(stage, slots))


def test_two_parts_in_flight_move_and_check_every_slot(tmp_path):
    f, hb, ring = _setup(tmp_path)
    try:
        a_slots, b_slots = list(range(0, 96)), list(range(96, 200))
        _fill(hb, range(96), a_slots)
        _fill(hb, range(96, 200), b_slots)
        # B's ops fill the room A's tail leaves: with A shorter than the depth (8), the
        # first fill already takes 3 of B, before A can be done, whatever the device.
        # (With A of 96 ops it would depend on how completions are batched: on a device
        # completing all 8 in flight at once, A's last refill could take all the room and
        # A end before B got any.)
        p5 = _start(ring, f, hb, 1, a_slots[:5], range(5))
        p20 = _start(ring, f, hb, 1, b_slots[:20], range(96, 116))
        ring.slot_io_finish(p5)
        assert p20.completed + p20.in_flight > 0
        assert (ring.slot_io_finish(p20)[0] == SLOT).all()
        pa = _start(ring, f, hb, 1, a_slots, range(96))
        pb = _start(ring, f, hb, 1, b_slots, range(96, 200))
        assert ring.active_batches == 2
        res_a, _ = ring.slot_io_finish(pa)
        res_b, _ = ring.slot_io_finish(pb)
        assert (res_a == SLOT).all() and (res_b == SLOT).all()
        assert ring.active_batches == 0
        hb.numpy()[:] = 0
        # Read back in two parts, finished out of order: every slot checked (header,
        # key, slot, generation and payload checksum) and its bytes where they belong.
        ra = _start(ring, f, hb, 0, a_slots, range(96))
        rb = _start(ring, f, hb, 0, b_slots, range(96, 200))
        out_b, st_b = ring.slot_io_finish(rb)
        out_a, st_a = ring.slot_io_finish(ra)
        assert (out_a == SLOT).all() and (out_b == SLOT).all()
        assert (st_a == 0).all() and (st_b == 0).all()
        assert _payload_ok(hb, range(96), a_slots) and _payload_ok(hb, range(96, 200), b_slots)
        # A part read with the wrong generation is caught by the checks of its own part only.
        rg = _start(ring, f, hb, 0, a_slots[:10], range(10), gen=2)
        rok = _start(ring, f, hb, 0, b_slots[:10], range(100, 110))
        _, st_g = ring.slot_io_finish(rg)
        _, st_ok = ring.slot_io_finish(rok)
        assert (st_g != 0).all() and (st_ok == 0).all()
    finally:
        ring.close(); f.close(); hb.close()


def test_a_part_ends_once_and_only_on_its_ring(tmp_path):
    f, hb, ring = _setup(tmp_path)
    other = Ring(4)
    try:
        p = _start(ring, f, hb, 1, [1, 2, 3], range(3))
        with pytest.raises(ValueError, match="another ring"):
            other.slot_io_finish(p)
        ring.slot_io_finish(p)
        assert p.done
        with pytest.raises(ValueError, match="already ended"):
            ring.slot_io_finish(p)
        empty = ring.slot_io_start(1, [], [], [], None, IO_LEN, [], [], [], PAYLOAD)
        out, status = ring.slot_io_finish(empty)
        assert len(out) == 0 and len(status) == 0
    finally:
        other.close(); ring.close(); f.close(); hb.close()


def test_wake_makes_the_pump_return_before_the_part_is_done(tmp_path):
    f, hb, ring = _setup(tmp_path)
    try:
        p = _start(ring, f, hb, 1, list(range(128)), range(128))
        ring.wake()
        # Woken once its tail began (every op of it queued in the ring), not before:
        # the ring had its own ops to refill from until then.
        assert ring.slot_io_pump(p) is False
        assert p.in_flight > 0 and p.completed >= 128 - 8
        while not ring.slot_io_pump(p):            # no wake pending: pumped to its end
            pass
        assert p.done
        res, _ = ring.slot_io_finish(p)
        assert (res == SLOT).all()
    finally:
        ring.close(); f.close(); hb.close()


def test_a_dropped_part_waits_for_its_ops_and_the_ring_goes_on(tmp_path):
    f, hb, ring = _setup(tmp_path)
    try:
        p = _start(ring, f, hb, 1, list(range(128)), range(128))
        del p   # never finished: its memory goes only after the kernel is done with it
        assert ring.active_batches == 0
        q = _start(ring, f, hb, 1, [5, 6], range(2))
        res, _ = ring.slot_io_finish(q)
        assert (res == SLOT).all()
    finally:
        ring.close(); f.close(); hb.close()


def test_closing_the_ring_with_a_part_in_flight_fails_the_part_clearly(tmp_path):
    f, hb, ring = _setup(tmp_path)
    try:
        p = _start(ring, f, hb, 1, list(range(64)), range(64))
        ring.close()   # drains what is in flight first: no request outlives the ring
        with pytest.raises(KVStoreError, match="closed while this SlotIOPart was in flight"):
            ring.slot_io_finish(p)
    finally:
        ring.close(); f.close(); hb.close()


def test_at_most_max_active_parts(tmp_path):
    f, hb, ring = _setup(tmp_path)
    try:
        parts = [_start(ring, f, hb, 1, [i], [i]) for i in range(8)]
        with pytest.raises(KVStoreError, match="at most 8 batches"):
            _start(ring, f, hb, 1, [9], [9])
        for p in parts:
            ring.slot_io_finish(p)
    finally:
        ring.close(); f.close(); hb.close()


def test_device_stream_runs_calls_and_parts_on_its_own_thread(tmp_path):
    f, hb, ring = _setup(tmp_path)
    stream = DeviceStream(ring, "kvstore-dev-test")
    try:
        names = []
        gate = threading.Event()
        blocked = stream.call(lambda: (gate.wait(10), names.append(threading.current_thread().name)))
        _fill(hb, range(200), range(200))
        seen = []

        def make(slots, stage):
            def go():
                p = _start(ring, f, hb, 1, slots, stage)
                seen.append(ring.active_batches)
                return p
            return go
        fa = stream.start(make(list(range(100)), range(100)), lambda out: out[0])
        fb = stream.start(make(list(range(100, 200)), range(100, 200)), lambda out: out[0])
        time.sleep(0.2)
        gate.set()   # both parts were queued behind the call: started together
        assert (fa.result(10) == SLOT).all() and (fb.result(10) == SLOT).all()
        blocked.result(10)
        assert names == ["kvstore-dev-test"] and seen == [1, 2]
        bad = stream.start(lambda: 1 / 0, lambda out: out)
        with pytest.raises(ZeroDivisionError):
            bad.result(10)
        assert stream.call(lambda: 7).result(10) == 7
    finally:
        stream.close()
        with pytest.raises(KVStoreError, match="stopped"):
            stream.call(lambda: None)
        ring.close(); f.close(); hb.close()


@pytest.mark.parametrize("ndirs", [1, 3])
def test_batch_loops_start_the_next_chunk_before_the_last_one_drains(tmp_path, ndirs):
    """write_blocks and read_blocks hand chunk k+1 to the device streams before waiting
    for chunk k: with the device thread held up, both chunks are started together (two
    batches active on the ring), and every block still round-trips."""
    from kvstore.store.disk import DiskStore, SlotRef
    from kvstore.format.layout import Layout
    layout = Layout(model="m", dtype="float16", block_size=16, block_bytes=PAYLOAD, num_layers=1,
                    num_kv_heads=1, head_dim=8, tp_size=1)
    dirs = [str(tmp_path / f"d{i}") for i in range(ndirs)]
    for d in dirs:
        (tmp_path / d).mkdir()
    with DiskStore.create(str(tmp_path / "store"), layout, 300 * SLOT, io=True,
                          data_dirs=dirs if ndirs > 1 else None, staging_bytes=64 * SLOT) as st:
        rio = st.ranks[0]
        seen = []
        for ring in rio.rings:
            ring.fault_injector = (lambda r: lambda op, fds, offs, lens: seen.append(r.active_batches) or [])(ring)
        refs = [SlotRef(b"k%05d" % i, i, 1) for i in range(200)]

        def held(fn):
            """Run fn with every device thread held up for a moment at its start."""
            gates = [threading.Event() for _ in rio.rings]
            for stream, g in zip(rio._device_streams(), gates):
                stream.call(lambda g=g: g.wait(10))

            def release():
                # once chunks 0 and 1 both wait on every held thread (not after a fixed
                # pause: a fast disk or a slow caller made that a race)
                streams = rio._device_streams()
                deadline = time.monotonic() + 10
                while (min(len(st._items) for st in streams) < 2
                       and time.monotonic() < deadline):
                    time.sleep(0.005)
                for g in gates:
                    g.set()
            threading.Thread(target=release, daemon=True).start()
            return fn()

        def fill(start, stop, views):
            for j, v in enumerate(views):
                v[:] = (start + j) % 251
        assert held(lambda: rio.write_blocks(refs, fill)) == [None] * 200
        assert max(seen) >= 2, seen
        seen.clear()
        wrong = []

        def drain(start, stop, views, errors):
            wrong.extend(start + j for j, (v, e) in enumerate(zip(views, errors))
                         if e is not None or not (np.asarray(v) == (start + j) % 251).all())
        assert held(lambda: rio.read_blocks(refs, drain)) == [None] * 200
        assert wrong == [] and max(seen) >= 2, seen
        for ring in rio.rings:
            ring.fault_injector = None


def test_a_started_part_in_a_garbage_cycle_waits_for_its_ops(tmp_path):
    """A part collected as part of a reference cycle waits for its ops: parts are
    no_gc_clear, since a collector that cleared its ring and keys first would free its
    batch under the kernel's in-flight ops while the ring still lists it (the next pump
    would crash)."""
    import gc
    f, hb, ring = _setup(tmp_path)
    try:
        p = _start(ring, f, hb, 1, list(range(64)), range(64))
        cycle = [p]
        cycle.append(cycle)
        del p, cycle
        gc.collect()
        assert ring.active_batches == 0
        q = _start(ring, f, hb, 1, [1, 2], range(2))
        res, _ = ring.slot_io_finish(q)
        assert (res == SLOT).all()
    finally:
        ring.close(); f.close(); hb.close()


def test_more_parts_than_a_ring_keeps_wait_their_turn(tmp_path):
    """Callers may post more parts than a ring keeps started (8 batches): the stream
    starts the rest as earlier ones end, and every part moves."""
    f, hb, ring = _setup(tmp_path)
    stream = DeviceStream(ring, "kvstore-dev-test")
    try:
        gate = threading.Event()
        stream.call(lambda: gate.wait(10))
        futs = [stream.start(lambda i=i: _start(ring, f, hb, 1, list(range(i * 16, i * 16 + 16)),
                                                range(i * 16, i * 16 + 16)),
                             lambda out: out[0]) for i in range(12)]
        time.sleep(0.1)
        gate.set()
        assert all((fut.result(10) == SLOT).all() for fut in futs)
    finally:
        stream.close()
        ring.close(); f.close(); hb.close()


def test_device_streams_are_built_once_whoever_asks_first(tmp_path):
    """Two threads asking for the streams at once (a scan's two ring-op threads on a fresh
    store) built two sets: two threads drove each ring."""
    from kvstore.store.disk import DiskStore
    from kvstore.format.layout import Layout
    layout = Layout(model="m", dtype="float16", block_size=16, block_bytes=PAYLOAD, num_layers=1,
                    num_kv_heads=1, head_dim=8, tp_size=1)
    dirs = [str(tmp_path / f"d{i}") for i in range(3)]
    for d in dirs:
        (tmp_path / d).mkdir()
    with DiskStore.create(str(tmp_path / "store"), layout, 30 * SLOT, io=True, data_dirs=dirs,
                          staging_bytes=8 * SLOT) as st:
        rio = st.ranks[0]
        barrier = threading.Barrier(8)
        got = []

        def ask():
            barrier.wait()
            got.append(rio._device_streams())
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(g is got[0] for g in got) and len(got[0]) == 3
        names = [t.name for t in threading.enumerate() if t.name.startswith("kvstore-dev")]
        assert sorted(names) == ["kvstore-dev0-r0", "kvstore-dev1-r0", "kvstore-dev2-r0"]


def test_write_blocks_refuses_a_slot_named_twice(tmp_path):
    from kvstore.store.disk import DiskStore, SlotRef
    from kvstore.format.layout import Layout
    layout = Layout(model="m", dtype="float16", block_size=16, block_bytes=PAYLOAD, num_layers=1,
                    num_kv_heads=1, head_dim=8, tp_size=1)
    with DiskStore.create(str(tmp_path / "store"), layout, 30 * SLOT, io=True,
                          staging_bytes=8 * SLOT) as st:
        refs = [SlotRef(b"a", 3, 1), SlotRef(b"b", 4, 1), SlotRef(b"c", 3, 2)]
        with pytest.raises(ValueError, match="a slot appears twice"):
            st.ranks[0].write_blocks(refs, lambda start, stop, views: None)
