"""What the systems of `kvstore bench peers` share: the systems and their labels, the
context of one block size (`PeersContext`: the directories, the block geometry, the
source and destination rows), the bench's keys and memory, and the prefix-load test
(`prefix_samples`: time one prefix's load while a background thread stores, giving a
`PrefixResult`)."""
from __future__ import annotations

import mmap
import resource
import threading
import time
from dataclasses import dataclass

import numpy as np

SYSTEMS = ("kvstore", "vllm_fs", "one_thread", "fio", "fio_slots")
LABELS = {"kvstore": "kvstore", "vllm_fs": "vLLM fs tier", "one_thread": "1 thread", "fio": "fio io_uring",
          "fio_slots": "fio, slots"}
FIO_SYSTEMS = ("fio", "fio_slots")
BW_FIELDS = ("store_gbps", "load_gbps")
ALL_FIELDS = ("store_gbps", "load_gbps", "cpu_s_per_gb", "prefix_load_p50_ms", "prefix_load_p99_ms")


@dataclass(slots=True)
class PeersContext:
    """One block size's run: where, how big, and the rows every system stores from and
    loads into (``src``/``dst``: ``[nblocks, block]`` views of ``src_mem``/``dst_mem``)."""
    directory: str          # the first (or only) directory
    dirs: list[str]
    block: int              # bytes per block
    nblocks: int
    qd: int                 # queue depth
    page_cache: bool        # buffered I/O instead of O_DIRECT
    staging_bytes: int
    prefix: int             # blocks per prefix
    vllm_job_blocks: int
    src: np.ndarray
    dst: np.ndarray
    src_mem: mmap.mmap
    dst_mem: mmap.mmap


@dataclass(slots=True)
class PrefixResult:
    """The prefix-load test of one system in one round."""
    latencies_ms: list[float]
    background_gbps: float


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def bench_keys(tag: str, first: int, n: int) -> list[bytes]:
    """n distinct 32-byte keys (hash-like: tag + index, then filler)."""
    head = tag.encode()[:8].ljust(8, b"_")
    return [head + i.to_bytes(8, "big") + bytes(16) for i in range(first, first + n)]


def anon_memory(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (what O_DIRECT needs; vLLM's primary tier is an mmap)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class Background:
    """Runs `step()` in a thread until stopped; counts the bytes it reports."""

    def __init__(self, step):
        self.step = step
        self.stop = threading.Event()
        self.bytes = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="peers-bg-store", daemon=True)

    def _run(self):
        try:
            while not self.stop.is_set():
                self.bytes += self.step()
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.t0
        if self.error is not None and exc[0] is None:
            raise self.error

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else float("nan")



PREFIX_TEST_MAX_S = 10.0  # per system per round: a slow system gets fewer (at least 5) samples


def prefix_samples(load_once, bg_step, samples: int, warmup_s: float = 0.3) -> PrefixResult:
    """Time `load_once()` `samples` times while `bg_step` stores in a background thread."""
    lat = []
    with Background(bg_step) as bg:
        time.sleep(warmup_s)  # let the background stores reach steady state
        t_end = time.perf_counter() + PREFIX_TEST_MAX_S
        for i in range(samples):
            if i >= 5 and time.perf_counter() > t_end:
                break
            t = time.perf_counter()
            load_once()
            lat.append((time.perf_counter() - t) * 1e3)
    return PrefixResult(lat, bg.gbps)
