"""kvstore as a secondary tier of vLLM's OffloadingConnector inside a real `vllm serve`.

vLLM's CPU build runs `OffloadingConnector` with `kvstore.vllm.cpu_offload.
CPUTieringOffloadingSpec` (vLLM's TieringOffloadingSpec whose engine <-> primary copies are
memcpy) and `KVStoreTier` behind vLLM's CPU primary tier. The first test checks that copy
worker against the addressing of vLLM's own CUDA handler (`compute_sub_block_ptrs`); the
second serves the shared workload, restarts on the same tier store and needs identical
tokens with chunks promoted from disk.
"""
from __future__ import annotations

import ctypes
import uuid

import numpy as np
import torch

from e2e_util import MAX_TOKENS, assert_same, fsck, info, tier_counter, wait_cascaded
from kvstore.drivers.client import Client


def test_copy_worker_moves_the_bytes_vllms_handler_addresses():
    """Stores and loads of several groups, tensors, partial first chunks and unpadded page
    sizes move exactly the bytes whose addresses vLLM's CUDA handler computes."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvstore.vllm.cpu_offload import CPUCopyOffloadingWorker

    bpc, num_blocks, num_chunks, pages = 4, 48, 16, (1024, 2048)
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=gen) for p in pages]
    refs = [[CanonicalKVCacheRef(0, 1024), CanonicalKVCacheRef(1, 2048)],
            [CanonicalKVCacheRef(1, 1536)]]          # a group with an unpadded, smaller page
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, p) for t, p in zip(kv, pages)], refs)
    row = bpc * sum(pages)
    region = SharedOffloadRegion(engine_id=f"kvstore-test-{uuid.uuid4().hex}", num_chunks=num_chunks,
                                 rank=0, kv_bytes_per_chunk=row, cpu_page_size=row)
    worker = CPUCopyOffloadingWorker(caches, bpc, region)
    try:
        chunk_views = [s.as_strided((num_chunks, bpc * p), (row, 1)) for s, p in
                       zip(worker.chunk_slots, pages)]
        base = region._base

        def expected_ops(gpu, cpu, to_chunks):
            """(src address, dst address, bytes) of vLLM's direct-layout descriptors."""
            ops, g_off, c_off = [], 0, 0
            for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
                skip = first % bpc
                n_chunks = -(-(size + skip) // bpc)
                for ref in refs[g]:
                    gp, cp = np.empty(size, np.uint64), np.empty(size, np.uint64)
                    compute_sub_block_ptrs(gpu.block_ids[g_off:g_off + size], 1, gp, kv[ref.tensor_idx])
                    compute_sub_block_ptrs(cpu.block_ids[c_off:c_off + n_chunks], bpc, cp,
                                           chunk_views[ref.tensor_idx], skip_count=skip)
                    for a, b in zip(gp, cp):
                        ops.append((int(a), int(b), ref.page_size_bytes) if to_chunks
                                   else (int(b), int(a), ref.page_size_bytes))
                g_off, c_off = g_off + size, c_off + n_chunks
            return ops

        # group 0: blocks 6..12 of a request (starts 2 blocks into its first chunk);
        # group 1: blocks 0..4 (chunk-aligned, the last chunk partial)
        gpu = GPULoadStoreSpec([3, 17, 40, 8, 9, 22, 30, 1, 2, 45, 44, 11], group_sizes=[7, 5],
                               block_indices=[6, 0])
        cpu = CPULoadStoreSpec([5, 0, 12, 9, 3])      # 3 chunks for group 0, 2 for group 1
        ops = expected_ops(gpu, cpu, True)
        assert worker.submit_store(1, gpu, cpu)
        got = base.clone()
        base.zero_()
        for src, dst, n in ops:
            ctypes.memmove(dst, src, n)
        assert torch.equal(got, base), "the store wrote other bytes than vLLM's handler"
        assert got.count_nonzero() > 0

        # load them back into other blocks: the engine tensors equal vLLM's copy of them
        dst = GPULoadStoreSpec([0, 4, 5, 6, 7, 10, 12, 13, 14, 15, 16, 18], group_sizes=[7, 5],
                               block_indices=[6, 0])
        ops = expected_ops(dst, cpu, False)
        for t in kv:
            t.zero_()
        assert worker.submit_load(2, cpu, dst)
        got_kv = [t.clone() for t in kv]
        assert all(t.count_nonzero() > 0 for t in got_kv)
        for t in kv:
            t.zero_()
        for src, d, n in ops:
            ctypes.memmove(d, src, n)
        assert all(torch.equal(a, b) for a, b in zip(got_kv, kv)), "the load differs from vLLM's"

        results = {r.job_id: r for r in worker.get_finished()}
        assert set(results) == {1, 2} and all(r.success for r in results.values())
        assert results[1].transfer_size == 7 * (1024 + 2048) + 5 * 1536

        # a spec that names more chunks than its groups use is reported failed, not done
        assert worker.submit_store(3, gpu, CPULoadStoreSpec([5, 0, 12, 9, 3, 7]))
        (r,) = worker.get_finished()
        assert r.job_id == 3 and not r.success
    finally:
        chunk_views = base = None       # the region's views, before it unmaps
        worker.shutdown()


def test_tier_serves_identical_tokens_and_hits_disk_after_restart(serve, workload, reference, tmp_path):
    store = str(tmp_path / "tier")
    s = serve.tier_server(store).start()
    try:
        assert_same(reference, workload.replay(Client(s.url), max_tokens=MAX_TOKENS), workload)
        written = wait_cascaded(s)
    finally:
        serve.stop_tier(s)
    log = s.log_text()
    assert "Created secondary tier #0 (KVStoreTier)" in log
    assert "Created TieringOffloadingManager with primary tier" in log
    used = info(store)["used_slots"]
    assert used > 0 and written > 0

    # A new engine: vLLM's prefix cache and CPU primary tier are empty, the tier store is not.
    s = serve.tier_server(store).start()
    try:
        m0 = s.metrics()
        assert_same(reference, workload.replay(Client(s.url), max_tokens=MAX_TOKENS), workload)
        m1 = s.metrics()
    finally:
        serve.stop_tier(s)
    hits = tier_counter(m1, "hits") - tier_counter(m0, "hits")
    loaded = tier_counter(m1, "loaded_chunks") - tier_counter(m0, "loaded_chunks")
    ext = (m1.get("vllm:external_prefix_cache_hits_total", 0)
           - m0.get("vllm:external_prefix_cache_hits_total", 0))
    print(f"tier store: {used} slots, {written:.0f} bytes written; after the restart: {hits:.0f} "
          f"tier hits, {loaded:.0f} chunks loaded ({tier_counter(m1, 'read_bytes'):.0f} bytes), "
          f"{ext:.0f} external prefix hit tokens")
    assert hits > 0 and loaded > 0, f"no chunk came from the tier store (hits {hits}, loaded {loaded})"
    assert ext > 0, "vLLM counted no external prefix cache hit"
    assert tier_counter(m1, "verify_failures") == 0
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc
