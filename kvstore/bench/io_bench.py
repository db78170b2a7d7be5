"""`kvstore bench io`: the I/O core against fio and a blocking one-thread baseline.

In one run, on one directory, with one block size, queue depth, total size and O_DIRECT
setting, it measures (a) kvstore's Ring writing then reading slot images of SlotFiles,
(b) fio with the io_uring engine (the device's practical limit) and (c) one thread of
blocking os.pwritev/os.preadv (how vLLM's SimpleCPUOffload disk mode moves blocks).
Rounds alternate between the systems (A B C A B C ...) and medians are reported. Every
block kvstore reads back is verified (header + xxh3 payload checksum against what was
written): a fast benchmark that returns wrong data is a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

from kvstore._hostbuf import HostBuffer
from kvstore._ring import Ring
from kvstore._slotfile import HEADER_SIZE, SlotFile, encode_header, payload_checksum, verify_slot
from kvstore.errors import KVStoreError
from kvstore.layout import format_size, parse_size

STAGING_BYTES = 512 << 20


def drop_page_cache() -> bool:
    """Best effort: drop clean page-cache pages so reads come from the device."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class KVStoreCore:
    """Slot images through one Ring at the requested depth; verified on read."""

    name = "kvstore"

    def __init__(self, directory, size, block, qd, direct):
        self.block = block
        self.nblocks = size // block
        self.path = os.path.join(directory, "kvstore-bench.kvs")
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.file = SlotFile(self.path, block, self.nblocks, direct=direct, create=True)
        self.stage_n = max(1, min(self.nblocks, STAGING_BYTES // block))
        self.staging = HostBuffer(self.stage_n * block)
        self.ring = Ring(qd)
        self.ring.register_buffers([self.staging])
        self.ring.register_files([self.file.fd], [self.path])
        self.buf = self.staging.numpy()
        rng = np.random.default_rng(1)
        self.buf[:] = rng.integers(0, 256, self.buf.size, dtype=np.uint8)
        self.payload = block - HEADER_SIZE
        self.verified = 0

    def _stamp(self, first, n):
        # Make every block unique (its index in the first payload bytes) and give it a
        # valid header, so a misplaced or torn block fails verification on read.
        for j in range(n):
            base = j * self.block
            pay = self.buf[base + HEADER_SIZE: base + self.block]
            pay[:8] = np.frombuffer(np.int64(first + j).tobytes(), np.uint8)
            encode_header(self.buf[base:base + HEADER_SIZE], b"bench", first + j, 1, self.payload,
                          payload_checksum(pay))

    def _chunks(self):
        for first in range(0, self.nblocks, self.stage_n):
            yield first, min(self.stage_n, self.nblocks - first)

    def _submit(self, opcode, first, n):
        offs = np.arange(first, first + n, dtype=np.uint64) * np.uint64(self.block)
        addrs = self.staging.address + np.arange(n, dtype=np.uint64) * np.uint64(self.block)
        res = self.ring.submit(opcode, np.full(n, self.file.fd, np.int32), offs, addrs,
                               np.full(n, self.block, np.uint32))
        self.ring.raise_for_results(opcode, res, np.full(n, self.file.fd), offs)

    def write(self):
        busy = 0.0
        for first, n in self._chunks():
            self._stamp(first, n)
            t = time.perf_counter()
            self._submit(1, first, n)
            busy += time.perf_counter() - t
        t = time.perf_counter()
        self.ring.fdatasync([self.file.fd])
        return busy + time.perf_counter() - t

    def read(self):
        busy = 0.0
        for first, n in self._chunks():
            self.buf[:] = 0
            t = time.perf_counter()
            self._submit(0, first, n)
            busy += time.perf_counter() - t
            for j in range(n):
                base = j * self.block
                verify_slot(self.buf[base:base + self.block], b"bench", first + j, 1, self.payload)
                if int(np.frombuffer(self.buf[base + HEADER_SIZE: base + HEADER_SIZE + 8], np.int64)[0]) != first + j:
                    raise KVStoreError(f"benchmark read back the wrong block at {first + j}")
            self.verified += n
        return busy

    def close(self):
        self.ring.close()
        self.file.close()
        self.buf = None
        self.staging.close()
        os.unlink(self.path)


class OneThread:
    """Blocking pwritev/preadv from one thread, one block at a time."""

    name = "threads"

    def __init__(self, directory, size, block, qd, direct):
        self.block = block
        self.nblocks = size // block
        self.path = os.path.join(directory, "threads-bench.dat")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(self.path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, self.nblocks * block)
        self.hb = HostBuffer(block)
        self.mv = memoryview(self.hb)
        self.hb.numpy()[:] = 7

    def write(self):
        t = time.perf_counter()
        for i in range(self.nblocks):
            if os.pwritev(self.fd, [self.mv], i * self.block) != self.block:
                raise OSError("short write in baseline")
        os.fdatasync(self.fd)
        return time.perf_counter() - t

    def read(self):
        t = time.perf_counter()
        for i in range(self.nblocks):
            if os.preadv(self.fd, [self.mv], i * self.block) != self.block:
                raise OSError("short read in baseline")
        return time.perf_counter() - t

    def close(self):
        self.mv.release()
        self.hb.close()
        os.close(self.fd)
        os.unlink(self.path)


class Fio:
    """fio, io_uring engine, one job, same block size / depth / size / O_DIRECT."""

    name = "fio"

    def __init__(self, directory, size, block, qd, direct):
        if shutil.which("fio") is None:
            raise KVStoreError("fio is not installed (Debian: apt-get install fio); `make` installs it")
        self.path = os.path.join(directory, "fio-bench.dat")
        self.args = [f"--filename={self.path}", f"--size={size}", f"--bs={block}",
                     f"--iodepth={qd}", "--ioengine=io_uring", f"--direct={1 if direct else 0}",
                     "--numjobs=1", "--output-format=json", "--fallocate=native"]

    def _run(self, rw):
        out = subprocess.run(["fio", f"--name={rw}", f"--rw={rw}", *self.args,
                              *(["--end_fsync=1"] if rw == "write" else [])],
                             capture_output=True, text=True, check=True)
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
        part = job["write" if rw == "write" else "read"]
        return part["io_bytes"] / (part["runtime"] / 1000.0) if part["runtime"] else float("nan")

    def write(self):
        return self._run("write")

    def read(self):
        return self._run("read")

    def close(self):
        if os.path.exists(self.path):
            os.unlink(self.path)


def run(directory: str | None = None, size="4G", block_size="2M", queue_depth: int = 32,
        page_cache: bool = False, rounds: int = 3, systems=("kvstore", "fio", "threads")) -> dict:
    """Run the comparison; returns the JSON-able result dict."""
    size_b = parse_size(size)
    block = parse_size(block_size)
    if block % 4096 or block <= HEADER_SIZE:
        raise KVStoreError(f"block size {block} must be a multiple of 4096 and > 4096")
    size_b = size_b // block * block
    if size_b < block:
        raise KVStoreError(f"size {size} holds no block of {block_size}")
    direct = not page_cache
    own_dir = directory is None
    directory = tempfile.mkdtemp(prefix="kvstore-bench-") if own_dir else directory
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if size_b * 1.2 > free:
        raise KVStoreError(f"--size {format_size(size_b)} needs more than the {format_size(free)} "
                           f"free in {directory}; lower --size")
    classes = {"kvstore": KVStoreCore, "fio": Fio, "threads": OneThread}
    samples = {s: {"write": [], "read": []} for s in systems}
    verified = 0
    try:
        for rnd in range(rounds):
            for name in systems:
                sysobj = classes[name](directory, size_b, block, queue_depth, direct)
                try:
                    if name == "fio":
                        w = sysobj.write()
                        if page_cache:
                            drop_page_cache()
                        r = sysobj.read()
                    else:
                        w = size_b / sysobj.write()
                        if page_cache:
                            drop_page_cache()
                        r = size_b / sysobj.read()
                    samples[name]["write"].append(w / 1e9)
                    samples[name]["read"].append(r / 1e9)
                    if name == "kvstore":
                        verified += sysobj.verified
                finally:
                    sysobj.close()
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    results = {name: {"write_gbps": statistics.median(v["write"]), "read_gbps": statistics.median(v["read"]),
                      "write_samples": v["write"], "read_samples": v["read"]}
               for name, v in samples.items()}
    out = {
        "config": {"dir": directory, "size": size_b, "block_size": block, "queue_depth": queue_depth,
                   "o_direct": direct, "rounds": rounds},
        "results": results,
        "blocks_verified": verified,
    }
    if "fio" in results and "kvstore" in results:
        out["ratio_vs_fio"] = {k: results["kvstore"][f"{k}_gbps"] / results["fio"][f"{k}_gbps"]
                               for k in ("write", "read")}
    if "threads" in results and "kvstore" in results:
        out["ratio_vs_threads"] = {k: results["kvstore"][f"{k}_gbps"] / results["threads"][f"{k}_gbps"]
                                   for k in ("write", "read")}
    return out


def format_table(out: dict) -> str:
    c = out["config"]
    lines = [f"kvstore bench io: {format_size(c['size'])} in {format_size(c['block_size'])} blocks, "
             f"queue depth {c['queue_depth']}, {'O_DIRECT' if c['o_direct'] else 'page cache'}, "
             f"median of {c['rounds']} alternating rounds",
             f"{'system':<10} {'write GB/s':>11} {'read GB/s':>10}"]
    labels = {"kvstore": "kvstore", "fio": "fio", "threads": "1 thread"}
    for name, r in out["results"].items():
        lines.append(f"{labels.get(name, name):<10} {r['write_gbps']:>11.2f} {r['read_gbps']:>10.2f}")
    if "ratio_vs_fio" in out:
        lines.append(f"kvstore / fio:      write {out['ratio_vs_fio']['write']:.2f}x  read {out['ratio_vs_fio']['read']:.2f}x")
    if "ratio_vs_threads" in out:
        lines.append(f"kvstore / 1 thread: write {out['ratio_vs_threads']['write']:.2f}x  read {out['ratio_vs_threads']['read']:.2f}x")
    lines.append(f"blocks read back and verified: {out['blocks_verified']}")
    return "\n".join(lines)
