"""The copy engine (kvstore._copy.CopyEngine through kvstore.vllm.transfer.KVTransfer) on KV
caches built by vLLM's own allocation code (allocate_kv_cache) on CPU: the segment
lists address exactly the bytes of each block (checked against torch's view of every
layer, not against the KVCacheTensor arithmetic the engine uses), gathers and scatters
are byte-exact and touch nothing else, a round trip through disk is exact, bad input is
refused before any byte moves, and layouts that cannot be copied are refused with what
to change. The CPU backend runs the same segment lists the CUDA backend issues as DMA.
"""
from __future__ import annotations

import os

import pytest
import torch

from kvstore._copy import LOAD, STORE
from kvstore.store.disk import DiskStore
from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.format.layout import HEADER_SIZE, Layout
from kvstore.io.rank import RankIO
from kvstore.io.staging import Staging
from kvstore.vllm.transfer import KVTransfer, check_copyable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

NB = 24        # blocks in the KV cache
LAYERS = 3

SPECS = {
    "bf16": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16),
    "fp8": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.float8_e4m3fn),
    "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
}
LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC"]


def build_kv(spec, layout: str, num_layers: int = LAYERS, num_blocks: int = NB):
    """A KVCacheConfig as vLLM's planner lays it out (KVCacheTensor strides of the
    layout family) and the KV tensors vLLM's allocate_kv_cache views over it."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    page = spec.page_size_bytes
    lay = KVCacheLayout[layout]
    if lay.is_block_outermost:
        t = KVCacheTensor(size=num_layers * num_blocks * page, layers=names, layer_stride=page,
                          block_stride=num_layers * page)
    else:
        t = KVCacheTensor(size=num_layers * num_blocks * page, layers=names,
                          layer_stride=num_blocks * page, block_stride=page)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[t],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    cfg.kv_cache_layout = layout
    kv = allocate_kv_cache(cfg, torch.device("cpu"), lay, [spec.block_size])
    g = torch.Generator().manual_seed(hash((layout, str(spec.dtype))) & 0xFFFF)
    for name in names:   # random bytes in every layer (layers share one allocation)
        u8 = kv[name].view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))
    return cfg, names, kv


def page_bytes(kv, name, block) -> bytes:
    """The bytes of one layer of one block in memory order, from torch's view alone."""
    v = kv[name][block].view(torch.uint8)
    order = sorted(range(v.dim()), key=lambda d: -v.stride(d))
    return v.permute(*order).contiguous().numpy().tobytes()


def block_bytes(kv, names, block) -> bytes:
    return b"".join(page_bytes(kv, n, block) for n in names)


def make_transfer(cfg, kv, nslots: int = 16):
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    payload = spec.page_size_bytes * len(cfg.kv_cache_groups[0].layer_names)
    slot = HEADER_SIZE + -(-payload // 4096) * 4096
    staging = Staging(nslots, slot, payload)
    return KVTransfer(kv, cfg, staging), staging


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(SPECS))
def test_gather_scatter_are_byte_exact_and_touch_nothing_else(layout, kind):
    cfg, names, kv = build_kv(SPECS[kind], layout)
    xfer, staging = make_transfer(cfg, kv)
    try:
        src = [5, 0, 17, 23, 9]
        slots = [3, 11, 0, 7, 15]
        want = {b: block_bytes(kv, names, b) for b in src}
        staging.numpy()[:] = 0xEE
        assert xfer.gather(src, slots) == 0          # CPU: done on return
        for b, s in zip(src, slots):
            assert staging.payload_view(s).tobytes() == want[b]
        untouched = [s for s in range(staging.num_slots) if s not in slots]
        assert all((staging.slot_view(s) == 0xEE).all() for s in untouched)
        # headers are io_uring's, never the copy's
        assert all((staging.slot_view(s)[:HEADER_SIZE] == 0xEE).all() for s in slots)

        dst = [1, 2, 12, 20, 22]
        before = {b: block_bytes(kv, names, b) for b in range(NB)}
        xfer.wait(xfer.scatter(slots, dst))
        for b, d in zip(src, dst):
            assert block_bytes(kv, names, d) == want[b]
        for b in range(NB):
            if b not in dst:
                assert block_bytes(kv, names, b) == before[b], f"block {b} changed"
    finally:
        xfer.close()
        staging.close()


@pytest.mark.parametrize("layout,per_block", [("LBNHC", LAYERS), ("BLNHC", 1)])
def test_segments_are_one_per_contiguous_run(layout, per_block):
    """Layer-major: one segment per layer of a block; block-major: one per block (its
    pages of all layers are one run). Addresses match torch's views."""
    cfg, names, kv = build_kv(SPECS["bf16"], layout)
    xfer, staging = make_transfer(cfg, kv)
    try:
        page = SPECS["bf16"].page_size_bytes
        src, dst, length = xfer.engine.segments(STORE, [4, 6], [1, 2])
        assert len(src) == 2 * per_block
        assert int(length.sum()) == 2 * LAYERS * page
        assert int(src[0]) == kv[names[0]][4].data_ptr()
        assert int(dst[0]) == staging.address + 1 * staging.slot_size + HEADER_SIZE
        lsrc, ldst, _ = xfer.engine.segments(LOAD, [4, 6], [1, 2])
        assert (lsrc == dst).all() and (ldst == src).all()   # a load is the mirror image
    finally:
        xfer.close()
        staging.close()


def test_round_trip_through_disk(tmp_path):
    """KV -> staging -> slot file (io_uring, O_DIRECT) -> staging -> other KV blocks."""
    cfg, names, kv = build_kv(SPECS["bf16"], "LBNHC")
    spec = SPECS["bf16"]
    layout = Layout(model="m", dtype="bfloat16", block_size=16, block_bytes=spec.page_size_bytes * LAYERS,
                    num_layers=LAYERS, num_kv_heads=4, head_dim=64)
    path = str(tmp_path / "store")
    store = DiskStore.create(path, layout, 32 * layout.slot_size)
    staging = Staging(8, layout.slot_size, layout.block_bytes)
    rio = RankIO(path, 0, layout=layout, staging=staging)
    xfer = KVTransfer(kv, cfg, staging)
    try:
        src, slots = [3, 8, 13, 21], [0, 1, 2, 3]
        want = [block_bytes(kv, names, b) for b in src]
        refs, _ = store.reserve([b"k%d" % b for b in src])
        xfer.wait(xfer.gather(src, slots))
        assert rio.write_staged(refs, slots) == [None] * 4
        store.commit(refs)
        staging.numpy()[:] = 0
        back = [4, 5, 6, 7]
        assert rio.read_staged(refs, back) == [None] * 4
        dst = [0, 1, 2, 23]
        xfer.wait(xfer.scatter(back, dst))
        assert [block_bytes(kv, names, d) for d in dst] == want
    finally:
        xfer.close()
        rio.close()
        staging.close()
        store.close()


def test_bad_ids_are_refused_before_any_byte_moves():
    cfg, names, kv = build_kv(SPECS["bf16"], "BLNHC")
    xfer, staging = make_transfer(cfg, kv, nslots=4)
    try:
        staging.numpy()[:] = 7
        with pytest.raises(ValueError, match=r"block id out of range 0\.\.23: 0\.\.24"):
            xfer.gather([0, 24], [0, 1])
        with pytest.raises(ValueError, match=r"staging slot out of range 0\.\.3: -1\.\.1"):
            xfer.gather([0, 1], [1, -1])
        with pytest.raises(ValueError, match="2 block ids for 1 staging slots"):
            xfer.gather([0, 1], [1])
        assert (staging.numpy() == 7).all()
        xfer.close()
        xfer.close()      # idempotent
        with pytest.raises(Exception, match="closed"):
            xfer.gather([0], [0])
    finally:
        xfer.close()
        staging.close()


def test_cpu_engine_has_no_cuda_state():
    cfg, names, kv = build_kv(SPECS["mla"], "LBNHC")
    xfer, staging = make_transfer(cfg, kv)
    try:
        assert not xfer.cuda and not xfer.engine.cuda and not xfer.engine.batch
        assert xfer.mark() == 0
        xfer.bind_thread()
        assert xfer.engine.events_created == 0
        assert not staging.pinned
    finally:
        xfer.close()
        staging.close()


def test_head_outermost_layout_is_refused_before_tensors_exist():
    spec = SPECS["bf16"]
    cfg, names, kv = build_kv(spec, "LBNHC")
    cfg.kv_cache_layout = "LHBNC"
    with pytest.raises(ConfigError, match="LHBNC.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
        check_copyable(cfg)
    cfg.kv_cache_layout = "BHLNC"
    with pytest.raises(ConfigError, match="heads are outside the blocks"):
        check_copyable(cfg)
    # one head (MLA): the page is one run whatever the layout
    mla, _, _ = build_kv(SPECS["mla"], "LBNHC")
    mla.kv_cache_layout = "LHBNC"
    check_copyable(mla)


def test_padded_pages_are_refused():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                            alignment=65536)
    assert spec.page_size_padded is not None
    names = ["l0"]
    cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(
        size=4 * spec.page_size_bytes, layers=names, layer_stride=4 * spec.page_size_bytes,
        block_stride=spec.page_size_bytes)], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    with pytest.raises(ConfigError, match=r"padded from 18432 to 65536 bytes"):
        check_copyable(cfg)


def test_non_contiguous_views_are_refused_with_the_numbers():
    """A view whose block dim does not step by the tensor's block stride (e.g. strides
    from another layout than the KVCacheTensor says) is refused, not copied wrongly."""
    cfg, names, kv = build_kv(SPECS["bf16"], "LBNHC")
    bad = dict(kv)
    v = kv[names[1]]
    bad[names[1]] = v.as_strided((v.shape[0] // 2,) + tuple(v.shape[1:]), (v.stride(0) * 2,) + v.stride()[1:])
    staging = Staging(2, HEADER_SIZE + 3 * SPECS["bf16"].page_size_bytes, 3 * SPECS["bf16"].page_size_bytes)
    try:
        with pytest.raises(ConfigError, match=r"non-contiguously .*block stride 16384"):
            KVTransfer(bad, cfg, staging)
    finally:
        staging.close()


def test_fp8_variants_get_distinct_fingerprints(tmp_path):
    """fp8 caches are uint8 tensors whatever the variant: the fingerprint records the
    configured cache dtype, so an fp8_e5m2 store is refused to an fp8_e4m3 engine."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    from kvstore.drivers.simulator import write_model_dir
    from kvstore.vllm.config import layout_from_vllm

    model = write_model_dir(str(tmp_path / "model"), num_layers=2, num_kv_heads=2, head_dim=16,
                            dtype="float16", max_position_embeddings=4096)

    def layout_for(cache_dtype):
        vc = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16",
                                                 seed=0, max_model_len=1024),
                        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
                        device_config=DeviceConfig("cpu"))
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.uint8)
        names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        return layout_from_vllm(vc, kvc)

    e5m2, e4m3, fp8 = layout_for("fp8_e5m2"), layout_for("fp8_e4m3"), layout_for("fp8")
    assert (e5m2.dtype, e4m3.dtype, fp8.dtype) == ("fp8_e5m2", "fp8_e4m3", "fp8_e4m3")
    path = str(tmp_path / "store")
    DiskStore.create(path, e5m2, 16 * e5m2.slot_size).close()
    with pytest.raises(LayoutMismatch, match=r"dtype='fp8_e5m2' but this engine has dtype='fp8_e4m3'") as exc:
        DiskStore(path, e4m3)
    assert exc.value.field == "dtype"
    DiskStore(path, e5m2).close()


def test_connector_refuses_a_head_outermost_layout_before_serving(tmp_path):
    """vLLM itself accepts LHBNC here (one page size); the kvstore worker connector
    refuses it when it is built, with the layout to use, before any step runs."""
    from connector_util import kv_config

    from kvstore.drivers.simulator import EngineHarness
    with pytest.raises(ConfigError, match=r"LHBNC KV cache layout.*VLLM_KV_CACHE_LAYOUT=LBNHC"):
        EngineHarness(workdir=str(tmp_path), layout="LHBNC",
                      kv_transfer_config=kv_config(tmp_path / "store"))
