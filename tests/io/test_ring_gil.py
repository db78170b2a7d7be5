"""The ring's submit/reap loop never takes the GIL.

vLLM's step loop can spin holding the GIL (empty steps while requests wait for their
loads). Calling io_uring_enter through the liburing binding's entry points would make the
pump take the GIL after every call (Cython checks for a Python error after each call of a
function declared without an exception value), so against such a thread each kernel call
of a batch would cost up to a switch interval: the pump calls csrc/kvstore_enter.h
instead. Here a thread spins in pure Python with the switch interval raised
to one second, so each GIL take by the ring thread costs about a second: a batch of N
kernel calls that took the GIL would need N seconds; without it the batch costs its I/O
plus the one or two GIL takes that entering and leaving it need. The check counts GIL takes
(the batch's time in switch intervals) against a limit far from both: a GIL-free batch
would have to stall for BATCH_TAKES_LIMIT seconds to fail it, which only a hang does.

The errored path is covered too: SIGALRM (a Python handler installed) sent to the ring's
thread every half millisecond interrupts its waits in the kernel with EINTR, which the
GIL-free loop retries itself.
"""
import errno
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore import _ring
from kvstore._hostbuf import HostBuffer
from kvstore._ring import Ring
from kvstore._slotfile import SlotFile

SWITCH_S = 1.0      # a GIL take against the spinner costs about this much
NOPS = 64           # kernel calls per batch (queue depth 1: one enter per op at least)
# A batch takes the GIL once or twice (entering and leaving it) and spends well under a
# second on its I/O; a pump that took the GIL per kernel call takes it NOPS times.
BATCH_TAKES_LIMIT = NOPS // 4
IO_LEN = 64 << 10
OP_READ, OP_WRITE = 0, 1


class _Spinner:
    """A thread that holds the GIL except when the interpreter forces a switch."""

    def __init__(self):
        self.stop = False
        self.loops = 0
        self.thread = threading.Thread(target=self._spin, name="gil-spinner", daemon=True)

    def _spin(self):
        n = 0
        while not self.stop:
            n += 1
        self.loops = n

    def __enter__(self):
        self.thread.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join(120)
        assert not self.thread.is_alive(), "the spinner did not stop in 120 s"
        assert self.loops > 0


@pytest.fixture
def slow_switch():
    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _in_thread(fn, setup=None):
    """Run fn() in a fresh thread (the ring's thread) and return (result, seconds fn took);
    setup() runs first in that thread, untimed."""
    out = {}

    def body():
        try:
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            out["result"] = fn()
            out["elapsed"] = time.perf_counter() - t0
        except BaseException as exc:   # reraised in the test's thread
            out["error"] = exc

    t = threading.Thread(target=body, name="ring-thread")
    t.start()
    t.join(120)
    assert not t.is_alive(), "the ring's batch did not finish in 120 s"
    if "error" in out:
        raise out["error"]
    return out["result"], out["elapsed"]


def test_slot_batches_do_not_wait_for_a_thread_holding_the_gil(tmp_path, slow_switch, fd_leak_check):
    slot_size = 4096 + IO_LEN
    f = SlotFile(str(tmp_path / "gil.kvs"), slot_size, NOPS, direct=True, create=True)
    hb = HostBuffer(NOPS * slot_size)
    ring = Ring(1)   # one op in flight: every op is at least one io_uring_enter
    try:
        ring.register_buffers([hb])
        ring.register_files([f.fd], [f.path])
        a = hb.numpy()
        rng = np.random.default_rng(14)
        payloads = rng.integers(0, 256, (NOPS, IO_LEN), dtype=np.uint8)
        view = a.reshape(NOPS, slot_size)
        view[:, 4096:] = payloads
        slots = np.arange(NOPS, dtype=np.uint64)
        keys = [b"key-%d" % i for i in range(NOPS)]
        gens = np.full(NOPS, 7, dtype=np.uint64)
        hdrs = np.uint64(hb.address) + slots * np.uint64(slot_size)
        args = ([f.fd] * NOPS, slots * np.uint64(slot_size), hdrs, None, IO_LEN, keys, slots, gens,
                IO_LEN)
        with _Spinner():
            (res, _), t_write = _in_thread(lambda: ring.slot_io(OP_WRITE, *args))
            assert (res == slot_size).all()
            a[:] = 0
            (res, status), t_read = _in_thread(lambda: ring.slot_io(OP_READ, *args, verify=2))
        assert (res == slot_size).all()
        assert (status == 0).all(), status
        assert np.array_equal(view[:, 4096:], payloads)
        for t, what in ((t_write, "write"), (t_read, "read")):
            assert t / SWITCH_S < BATCH_TAKES_LIMIT, (
                f"a {NOPS}-slot {what} batch at queue depth 1 took {t:.2f} s while another "
                f"thread held the GIL: the pump waited for the GIL (~{t / SWITCH_S:.0f} takes "
                f"of {SWITCH_S:.0f} s)")
        del a, view
    finally:
        ring.close(); f.close(); hb.close()


# A child process (not ours: it needs no GIL of ours) paces the data into a pipe: one
# 4096-byte chunk (PIPE_BUF: written atomically) about 1 ms after the previous one was
# read, starting when the ring's thread says go (its thread id, on the child's stdin), and
# meanwhile it sends that thread SIGALRM (tgkill): every read of the batch waits in the
# kernel, and the signals interrupt those waits. (A wait is what lets the spinner take the
# GIL: a call that completes at once gets it back before the spinner wakes up. And
# setitimer's SIGALRM is process-directed: the kernel hands it to any thread that does not
# block it, and the interpreter's helper threads do not.)
_PACER = r"""
import array, ctypes, fcntl, os, signal, sys, termios, time
n, pid = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)

def unread():
    b = array.array("i", [0])
    fcntl.ioctl(1, termios.FIONREAD, b, True)
    return b[0]

os.write(1, b"R")
tid = int(os.read(0, 64))
time.sleep(0.02)
for k in range(n):
    while unread():
        time.sleep(0.0002)
    for _ in range(2):
        if libc.tgkill(pid, tid, signal.SIGALRM) != 0:
            sys.exit(f"tgkill: errno {ctypes.get_errno()}")
        time.sleep(0.0005)
    os.write(1, bytes([k % 251 + 1]) * 4096)
"""


def test_eintr_is_retried_without_error_or_gil(slow_switch, fd_leak_check):
    rfd, wfd = os.pipe()
    go_r, go_w = os.pipe()
    hb = HostBuffer(NOPS * 4096)
    ring = Ring(1)   # one read in flight: reads take the chunks in order
    hits = [0]

    def on_alarm(signum, frame):   # runs in this (the main) thread, later
        hits[0] += 1

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    child = None
    try:
        ring.register_buffers([hb])
        child = subprocess.Popen([sys.executable, "-c", _PACER, str(NOPS), str(os.getpid())],
                                 stdin=go_r, stdout=wfd)
        os.close(wfd)
        os.close(go_r)
        wfd = go_r = -1
        assert os.read(rfd, 1) == b"R"
        before = _ring.enter_stats()
        addrs = hb.address + np.arange(NOPS, dtype=np.uint64) * np.uint64(4096)

        def go():
            os.write(go_w, b"%d" % threading.get_native_id())

        with _Spinner():
            res, elapsed = _in_thread(
                lambda: ring.submit(OP_READ, [rfd] * NOPS, [0] * NOPS, addrs, [4096] * NOPS),
                setup=go)
        after = _ring.enter_stats()
        assert child.wait(120) == 0
        assert (res == 4096).all(), res
        got = np.sort(hb.numpy()[: NOPS * 4096])
        want = np.sort(np.repeat(np.arange(NOPS, dtype=np.uint8) % 251 + 1, 4096))
        assert np.array_equal(got, want)
        assert elapsed / SWITCH_S < BATCH_TAKES_LIMIT, (
            f"{NOPS} paced pipe reads took {elapsed:.2f} s with another thread holding the GIL "
            f"and {after['eintr'] - before['eintr']} EINTRs: the pump waited for the GIL "
            f"(~{elapsed / SWITCH_S:.0f} takes of {SWITCH_S:.0f} s)")
        assert after["eintr"] > before["eintr"], ("no wait was interrupted", before, after)
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for fd in (wfd, go_r, go_w, rfd):
            if fd >= 0:
                os.close(fd)
        ring.close(); hb.close()
    assert hits[0] > 0


def test_an_enter_error_that_is_not_retried_raises_oserror_with_its_errno(tmp_path, fd_leak_check):
    # The ring's fd replaced by a plain file: io_uring_enter fails with EOPNOTSUPP, which
    # the pump does not resume from. The kernel never saw the batch's SQEs, so the ring
    # closes once its bounded wait for them gives up.
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * 4096)
    hb = HostBuffer(4096)
    ring = Ring(4)
    try:
        ring.register_buffers([hb])
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.dup2(fd, ring.ring_fd)   # closes the io_uring file; the ring's mmaps stay
            with pytest.raises(OSError) as info:
                ring.submit(OP_READ, [fd], [0], [hb.address], [4096])
        finally:
            os.close(fd)
        assert info.value.errno == errno.EOPNOTSUPP
        assert "io_uring_enter" in str(info.value)
        assert ring.closed   # closed by the failed batch (and with it the fd it named)
    finally:
        ring.close(); hb.close()


# ------------------------------------------------------------------------------------------
# The worker's load timeout while its I/O thread is copying a load into the KV cache. That
# thread holds the load's lock during the copy (and, when the GIL is scarce, for as long as
# the copy's GIL takes last), so a step thread that skipped a locked load at every look
# would never time it out. The blocks of a copy in progress cannot go back to vLLM (it would
# compute into them, or reuse them, under the copy), so the load is marked at the deadline,
# the I/O thread copies nothing more for it, and it is reported failed (vLLM recomputes
# it) at the first look after the copy in progress.


def test_load_timing_out_during_its_kv_copy_is_recomputed_after_that_copy(tmp_path):
    import dataclasses

    from connector_util import drop_gpu_cache, kv_harness, prompts, settle, workers

    store = tmp_path / "store"
    ps = prompts(1414, 1, 20 * 16 + 5)   # 20 full blocks: chunks of 8, 8 and 4 blocks
    # A deadline no load reaches on its own: the test passes it by hand once the first copy
    # is held, so how fast the machine reads does not decide where the load times out.
    with kv_harness(store, extra={"load_timeout_s": 600, "staging": "256K"}) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        w = workers(h)[0]
        real = w.transfer.scatter
        gate = threading.Event()
        calls = []

        def scatter(stage_ids, block_ids, after=0):   # on the I/O thread, under the load's lock
            calls.append(len(block_ids))
            if len(calls) == 1:
                gate.wait(300)                    # bounds a hang only
            return real(stage_ids, block_ids, after)

        w.transfer.scatter = scatter
        try:
            before = dict(h.stats)
            rid = h.add_request(ps[0], max_tokens=2)
            deadline = time.monotonic() + 300      # bounds a hang only
            while not calls and time.monotonic() < deadline:
                h.step()
                time.sleep(0.001)
            assert calls, "the load never reached its first copy into the KV cache"
            st = w._loads[rid]
            # The copy is held: the load's deadline passes now.
            w.cfg = dataclasses.replace(w.cfg, load_timeout_s=0.001)
            deadline = time.monotonic() + 300      # bounds a hang only
            while not getattr(st, "timed_out", False) and time.monotonic() < deadline:
                h.step()
                time.sleep(0.001)
            for _ in range(20):                    # and the step thread keeps looking
                h.step()
            marked = getattr(st, "timed_out", False)
            # Not handed back to vLLM while the copy may still write into its blocks.
            assert not st.done and rid not in h.finished and rid in w._loads and h.busy()
            gate.set()
            h.drain(timeout_s=300)
        finally:
            gate.set()
            del w.transfer.scatter
        assert calls == [8], calls                # nothing copied after the deadline
        st_now = h.stats
        assert st_now["requests_finished"] - before["requests_finished"] == 1
        assert st_now["invalid_block_ids"] - before["invalid_block_ids"] == 20
        assert st_now["blocks_mismatched"] == 0, h.mismatches
        assert marked, "the deadline passed during the copy but the load was not marked"
