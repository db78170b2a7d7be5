"""Start-up checks of the kvstore connector that refuse (or warn about) vLLM setups it
cannot serve correctly: context parallelism (DCP/PCP), pipeline parallelism, several KV
cache groups (hybrid KV cache manager, Mamba), and kv_load_failure_policy "fail".

Every config here is a real vLLM 0.33 object (VllmConfig, ParallelConfig, KVCacheConfig
built from vLLM's spec classes, and where possible grouped by vLLM's own planner).
"""
import logging
import os

import pytest
import torch

from connector_util import kv_config, open_fds
from kvstore.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYER = "model.layers.{}.self_attn.attn"


def _vllm_config(tmp_path, *, parallel: dict | None = None, store=None, extra: dict | None = None):
    """A real VllmConfig of the tiny test model (2 KV heads, head_dim 16, fp16), with a
    kvstore kv_transfer_config over `store` (and `extra` kv_connector_extra_config keys)
    when given."""
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig,
    )

    from kvstore.drivers.simulator import write_model_dir
    model = str(tmp_path / "model")
    if not os.path.exists(model):
        write_model_dir(model, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                        max_position_embeddings=4096)
    kw = {}
    if parallel:
        kw["parallel_config"] = ParallelConfig(**parallel)
    if store is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**kv_config(store, **(extra or {})))
    vc = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16",
                                             seed=0, max_model_len=1024),
                    cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"),
                    **kw)
    vc.cache_config.kv_cache_layout = "LBNHC"   # what the engine core resolves
    return vc


def _full(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=16, num_kv_heads=kw.pop("num_kv_heads", 2), head_size=16,
                             dtype=torch.float16, **kw)


def _swa(**kw):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    return SlidingWindowSpec(block_size=16, num_kv_heads=kw.pop("num_kv_heads", 2), head_size=16,
                             dtype=torch.float16, sliding_window=kw.pop("sliding_window", 64), **kw)


def _kv_cache_config(*group_specs):
    """A KVCacheConfig with one group (one layer) per spec."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    groups = [KVCacheGroupSpec([LAYER.format(i)], spec) for i, spec in enumerate(group_specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


# ------------------------------------------------------------------ unknown keys

@pytest.mark.parametrize("key", ["index_thread", "capcity"])
def test_index_thread_is_refused_at_start_as_any_unknown_key(tmp_path, key):
    """`index_thread` is no key of the connector (its index thread always runs; the
    synchronous index is the bench's baseline only): both roles refuse it before opening
    the store, with the message any unknown key (here a misspelt `capacity`) gets."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.vllm.connector import KVStoreConnector
    store = tmp_path / "store"
    vc = _vllm_config(tmp_path, store=store, extra={key: False})
    before = open_fds()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as ei:
            KVStoreConnector(vc, role, _kv_cache_config(_full()))
        msg = str(ei.value)
        assert msg.startswith(f"kvstore: unknown kv_connector_extra_config key(s) ['{key}']; "
                              "valid keys: ["), msg
        assert msg.endswith("] (see docs/CONFIG.md)"), msg
        assert "'index_thread'" not in msg.split("valid keys:")[1], msg
    assert not store.exists()
    assert not open_fds() - before


# ------------------------------------------------------------------ context parallelism

CP_CASES = [
    # vLLM 0.33 accepts DCP on this CPU-only machine as long as tp > num KV heads
    # (config/model.py:1583 refuses dcp with tp <= KV heads for GQA): tp=4 for 2 heads.
    ({"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
     "decode_context_parallel_size=2", "--decode-context-parallel-size/-dcp"),
    ({"prefill_context_parallel_size": 2},
     "prefill_context_parallel_size=2", "--prefill-context-parallel-size/-pcp"),
]


@pytest.mark.parametrize("parallel, setting, flag", CP_CASES, ids=["dcp", "pcp"])
def test_context_parallelism_is_refused_at_start_in_both_roles(tmp_path, parallel, setting, flag):
    """Under DCP vLLM hashes blocks of block_size * dcp tokens whose KV is interleaved
    across ranks: kvstore's per-rank mapping would be silently wrong, so both connector
    roles refuse before opening (or creating) the store."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.vllm.connector import KVStoreConnector
    store = tmp_path / "store"
    vc = _vllm_config(tmp_path, parallel=parallel, store=store)
    key = setting.split("=")[0]
    assert getattr(vc.parallel_config, key) == 2      # vLLM kept the setting
    before = open_fds()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as ei:
            KVStoreConnector(vc, role, _kv_cache_config(_full()))
        msg = str(ei.value)
        assert msg == (f"kvstore does not support context parallelism yet ({setting}). Run "
                       f"without {flag}, or remove the kvstore connector."), msg
    assert not store.exists()
    assert not open_fds() - before


def test_both_context_parallel_settings_are_named(tmp_path):
    from vllm.config import ParallelConfig

    from kvstore.vllm.config import check_parallel_layout
    pc = ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ConfigError) as ei:
        check_parallel_layout(pc)
    msg = str(ei.value)
    assert "decode_context_parallel_size=2, prefill_context_parallel_size=2" in msg, msg
    assert "--decode-context-parallel-size/-dcp and --prefill-context-parallel-size/-pcp" in msg
    # A field set after construction (what the engine core may do) is seen too.
    pc = ParallelConfig()
    check_parallel_layout(pc)
    pc.decode_context_parallel_size = 4
    with pytest.raises(ConfigError, match=r"decode_context_parallel_size=4\)"):
        check_parallel_layout(pc)


def test_pipeline_parallelism_is_refused_with_what_to_do(tmp_path):
    from vllm.config import ParallelConfig

    from kvstore.vllm.config import check_parallel_layout
    with pytest.raises(ConfigError) as ei:
        check_parallel_layout(ParallelConfig(pipeline_parallel_size=2))
    assert str(ei.value) == (
        "kvstore does not support pipeline parallelism yet (pipeline_parallel_size=2). Run "
        "without --pipeline-parallel-size/-pp (tensor parallelism is supported), or remove "
        "the kvstore connector.")


def test_tensor_parallelism_passes(tmp_path):
    from kvstore.vllm.config import layout_from_vllm
    vc = _vllm_config(tmp_path, parallel={"tensor_parallel_size": 2})
    assert layout_from_vllm(vc, _kv_cache_config(_full(num_kv_heads=1))).tp_size == 2


# ------------------------------------------------------------------ KV cache groups


def test_full_and_sliding_window_groups_are_served_with_their_groups_in_the_layout(tmp_path):
    from kvstore.vllm.config import layout_from_vllm
    vc = _vllm_config(tmp_path)
    hybrid = layout_from_vllm(vc, _kv_cache_config(_full(), _swa()))
    assert hybrid.groups == "full;swa:64"
    single = layout_from_vllm(vc, _kv_cache_config(_full()))
    assert single.groups == "" and "groups" not in single.to_dict()  # old fingerprints hold
    assert hybrid.first_difference(single) == ("groups", "full;swa:64", "")


def test_groups_of_different_layer_counts_point_to_disable_hybrid_kv_cache_manager(tmp_path):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvstore.vllm.config import layout_from_vllm
    groups = [KVCacheGroupSpec([LAYER.format(0), LAYER.format(1)], _full()),
              KVCacheGroupSpec([LAYER.format(2)], _swa())]
    with pytest.raises(ConfigError) as ei:
        layout_from_vllm(_vllm_config(tmp_path),
                         KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))
    assert str(ei.value) == (
        "kvstore serves full-attention and sliding-window groups of one block size, page and "
        "layer count; this model has 2 KV cache groups (1 FullAttentionSpec, 1 "
        "SlidingWindowSpec) differ. Start vLLM with --disable-hybrid-kv-cache-manager: it then "
        "serves the sliding-window layers as full attention in one group, which kvstore "
        "supports (or remove the kvstore connector).")


def test_vllm_hybrid_plan_and_its_single_group_fallback_are_both_served(tmp_path):
    """vLLM's own planner: with the hybrid KV cache manager the layers form a full and a
    sliding-window group (served, the groups in the layout); without it one
    FullAttentionSpec group (served as before)."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvstore.vllm.config import layout_from_vllm
    vc = _vllm_config(tmp_path)

    def plan(disable_hybrid: bool):
        vc.scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid
        specs = {LAYER.format(i): _swa() if i % 2 == 0 else _full() for i in range(4)}
        groups = get_kv_cache_groups(vc, specs)
        available = groups[0].kv_cache_spec.page_size_bytes * 4 * 8
        return get_kv_cache_config_from_groups(vc, groups, available)

    hybrid = plan(False)
    assert len(hybrid.kv_cache_groups) > 1
    lay = layout_from_vllm(vc, hybrid)
    assert sorted(lay.groups.split(";")) == ["full", "swa:64"] and lay.num_layers == 2
    single = plan(True)
    assert [type(g.kv_cache_spec) for g in single.kv_cache_groups] == [FullAttentionSpec]
    assert layout_from_vllm(vc, single).num_layers == 4


def test_mamba_without_prefix_caching_is_refused_saying_what_to_do(tmp_path):
    """vLLM caches Mamba state only in "align" mode, which it sets when prefix caching
    is on; "none" (prefix caching off) has nothing kvstore could store."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvstore.vllm.config import layout_from_vllm
    mamba = MambaSpec(block_size=16, shapes=((4, 64), (8, 16, 16)),
                      dtypes=(torch.float16, torch.float16))
    with pytest.raises(ConfigError) as ei:
        layout_from_vllm(_vllm_config(tmp_path), _kv_cache_config(_full(), _swa(), mamba))
    assert str(ei.value) == (
        "kvstore: this model has 3 KV cache groups (1 FullAttentionSpec, 1 SlidingWindowSpec, "
        "1 MambaSpec). vLLM caches Mamba state only with prefix caching on (Mamba cache mode "
        '"align"); this engine runs mamba_cache_mode=none. Start vLLM with '
        "--enable-prefix-caching, or remove the kvstore connector for this model.")


def test_mamba_in_align_mode_is_served_and_recorded_in_the_layout(tmp_path):
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvstore.vllm.config import layout_from_vllm
    full = _full()
    mamba = MambaSpec(block_size=16, shapes=((4, 64), (4, 16, 4)),
                      dtypes=(torch.float16, torch.float32), mamba_cache_mode="align",
                      page_size_padded=full.page_size_bytes * 3)
    # Its padded page differs from the attention page: refused, naming the pages.
    with pytest.raises(ConfigError, match=r"pages \[2048, 6144\]"):
        layout_from_vllm(_vllm_config(tmp_path), _kv_cache_config(full, _swa(), mamba))
    mamba = MambaSpec(block_size=16, shapes=((4, 64), (4, 16, 4)),
                      dtypes=(torch.float16, torch.float32), mamba_cache_mode="align",
                      page_size_padded=full.page_size_bytes)
    lay = layout_from_vllm(_vllm_config(tmp_path), _kv_cache_config(_swa(), full, mamba))
    # The carrier is the full-attention group wherever it is; one layer per group.
    assert lay.groups == "swa:64;full;mamba:mamba2:4x64,4x16x4:float16,float32"
    assert lay.num_layers == 1 and lay.block_bytes == full.page_size_bytes


def test_hybrid_hashes_finer_than_blocks_are_refused_naming_the_unit(tmp_path):
    from kvstore.vllm.config import layout_from_vllm
    vc = _vllm_config(tmp_path)
    kcc = _kv_cache_config(_full(), _swa())
    assert layout_from_vllm(vc, kcc).groups == "full;swa:64"
    kcc.hash_block_size = 8          # what vLLM resolves for --prefix-match-unit 8
    with pytest.raises(ConfigError) as ei:
        layout_from_vllm(vc, kcc)
    assert str(ei.value) == (
        "kvstore keys one block hash per 16-token block; this engine hashes blocks of 8 "
        "tokens (hash_block_size=8). Unset --prefix-match-unit (or set it to 16), or remove "
        "the kvstore connector for this model.")


def test_groups_without_a_single_group_fallback_get_no_false_advice(tmp_path):
    """Layers of different KV shapes stay several specs (UniformTypeKVCacheSpecs) even
    without the hybrid manager, and sliding-window layers without full attention are not
    promoted: the message must not promise the flag helps."""
    from kvstore.vllm.config import check_kv_cache_groups
    for specs in ((_full(), _swa(num_kv_heads=1)), (_swa(), _swa(sliding_window=32))):
        groups = _kv_cache_config(*specs).kv_cache_groups
        with pytest.raises(ConfigError) as ei:
            check_kv_cache_groups(groups)
        msg = str(ei.value)
        assert "--disable-hybrid-kv-cache-manager" not in msg, msg
        assert msg.endswith("kvstore does not support these groups yet: remove the kvstore "
                            "connector for this model."), msg


# ------------------------------------------------------------------ kv_load_failure_policy

_POLICY_WARNING = (
    'kvstore: kv_load_failure_policy is "fail" (vLLM\'s default): a block that fails '
    "kvstore's verification (checksum mismatch, I/O error, load timeout) fails the user's "
    'request instead of being recomputed. Set "kv_load_failure_policy": "recompute" in '
    "--kv-transfer-config.")


@pytest.mark.parametrize("policy", ["fail", None, "recompute"],
                         ids=["fail", "vllm-default", "recompute"])
def test_load_failure_policy_fail_warns_once_at_start(tmp_path, caplog, policy):
    from kvstore.drivers.simulator import EngineHarness
    ktc = kv_config(tmp_path / "store")
    if policy is None:
        del ktc["kv_load_failure_policy"]
    else:
        ktc["kv_load_failure_policy"] = policy
    caplog.set_level(logging.WARNING, logger="kvstore.vllm")
    # tp_size=2: one scheduler and two worker connectors, and still one warning
    h = EngineHarness(kv_transfer_config=ktc, workdir=str(tmp_path), tp_size=2)
    try:
        assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == (policy or "fail")
        warned = [r for r in caplog.records
                  if r.name == "kvstore.vllm" and "kv_load_failure_policy" in r.getMessage()]
        if policy == "recompute":
            assert not warned, [r.getMessage() for r in warned]
        else:
            got = [(r.levelno, r.getMessage()) for r in warned]
            assert got == [(logging.WARNING, _POLICY_WARNING)], got
    finally:
        h.shutdown()


# ------------------------------------------------------------------ CPU build core reservation
@pytest.mark.parametrize("forward_on_host,bind,reserved,ranks,advised", [
    (True, "auto", None, 1, "VLLM_CPU_NUM_OF_RESERVED_CPU=1"),     # CPU build, vLLM's binding
    (True, None, None, 2, "VLLM_CPU_NUM_OF_RESERVED_CPU=2"),
    (True, "auto", "1", 1, None),       # the operator chose the reservation
    (True, "0-3", None, 1, None),       # a binding of the operator's own
    (False, "auto", None, 1, None),     # GPUs: the forward leaves the cores alone
])
def test_cpu_reservation_advice(forward_on_host, bind, reserved, ranks, advised):
    from kvstore.vllm.connector import cpu_reservation_advice
    advice = cpu_reservation_advice(forward_on_host, bind, reserved, ranks)
    if advised is None:
        assert advice is None
    else:
        assert advised in advice and f"reserves {2 * ranks} core(s)" in advice
