"""`KVStoreConnector`: kvstore as a vLLM 0.33 KV-connector plugin.

Enable with::

    --kv-transfer-config '{"kv_connector":"KVStoreConnector","kv_connector_module_path":"kvstore.vllm",
      "kv_role":"kv_both","kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"path":"/mnt/nvme/kvstore","capacity":"500G"}}'

(or just "kv_connector":"KVStoreConnector": the package registers that name through a
`vllm.general_plugins` entry point). This class only dispatches: the scheduler role goes
to `KVStoreScheduler` (decides, no I/O), the worker role to `KVStoreWorker` (moves bytes).
This package is the only place in kvstore that imports vLLM.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from kvstore.vllm.config import (
    ConnectorConfig, carrier_group, kv_group_kinds, layout_from_vllm, unsupported_vllm,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults, SupportsHMA,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as _exc:    # a vLLM whose connector API kvstore does not know
    raise unsupported_vllm(f"importing its KV-connector API failed ({_exc})",
                           "the connector base class and the disk cache-hit source") from None
from kvstore.vllm.identity import identity_of_model_config
from kvstore.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta
from kvstore.vllm.metrics import KVStorePromMetrics, KVStoreStats

log = logging.getLogger("kvstore.vllm")


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """A persistent NVMe tier for vLLM's prefix cache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config)
        # Which weights and settings produce this engine's KV: a store of another model
        # is never served (re-initialised or refused, `on_model_change`).
        self.identity = identity_of_model_config(vllm_config.model_config)
        self.scheduler = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvstore.vllm.scheduler import KVStoreScheduler
            kv_events = getattr(vllm_config, "kv_events_config", None)
            events = bool(kv_events and kv_events.enable_kv_cache_events)
            kinds = kv_group_kinds(kv_cache_config.kv_cache_groups) \
                if kv_cache_config is not None else None
            self.scheduler = KVStoreScheduler(self.cfg, self.layout, vllm_config, events,
                                              group_kinds=kinds, identity=self.identity)
            log.info("kvstore: serving store %s (%s)", self.cfg.path, self.scheduler.store.stats())
            _warn_load_failure_policy(self._kv_transfer_config)
            _warn_cpu_reservation(vllm_config)
        self._rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0)
        if role == KVConnectorRole.WORKER and kv_cache_config is not None:
            # Refuse a KV cache kvstore cannot copy now, with what to change, rather than
            # when vLLM hands over its tensors.
            from kvstore.vllm.transfer import check_copyable
            check_copyable(kv_cache_config, (carrier_group(kv_cache_config.kv_cache_groups),))

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache is best effort: a preempted request simply recomputes.
        return False

    # ==== worker side ================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from kvstore.vllm.worker import KVStoreWorker
        _request_amx_permission()
        self.worker = KVStoreWorker(self.cfg, self.layout, self._rank, kv_caches,
                                    self._kv_cache_config, identity=self.identity)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVStoreMetadata):
            self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Stores are copied out of the KV cache within the step that planned them (on
        # CUDA: enqueued then, and the next step's forward is fenced behind the copy), so
        # a preempted request's blocks can be reused at once; nothing to flush.
        return None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self.worker is not None:
            self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        if self.worker is None:
            return None, None
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads and, for a hybrid model, the failed ones among them: vLLM
        refuses per-block `invalid_block_ids` when there are several KV cache groups."""
        res = super().get_transfer_results(finished_req_ids)
        if self.worker is not None:
            res.failed_recving = self.worker.take_failed_recving() & res.finished_recving
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self):
        return self.worker.build_worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self):
        if self.worker is not None:
            return self.worker.get_stats()
        if self.scheduler is not None:
            return self.scheduler.get_stats()
        return None

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # ==== scheduler side =============================================================
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.bind(kv_cache_manager)

    def on_new_request(self, request) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVStoreMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids):
        return self.scheduler.request_finished(request)

    def take_events(self):
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping until every in-flight store is committed.
        return self.scheduler is not None and self.scheduler.has_pending_stores()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVStoreStats(data=dict(data)) if data is not None else KVStoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _warn_load_failure_policy(kv_transfer_config) -> None:
    """Warn, once per engine (the scheduler role), when vLLM's kv_load_failure_policy is
    "fail" (its default): a block kvstore refuses to load then fails the request."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy == "fail":
        log.warning(
            'kvstore: kv_load_failure_policy is "fail" (vLLM\'s default): a block that fails '
            "kvstore's verification (checksum mismatch, I/O error, load timeout) fails the "
            "user's request instead of being recomputed. Set "
            '"kv_load_failure_policy": "recompute" in --kv-transfer-config.')


def cpu_reservation_advice(forward_on_host: bool, omp_bind: str | None, reserved_env: str | None,
                           ranks: int) -> str | None:
    """What to set when vLLM's CPU build keeps cores from the forward for kvstore, else None.

    The CPU build binds the forward's OpenMP threads to every core of a NUMA node but a
    reserved few, where the engine core process (the scheduler, spinning while it waits for
    the workers) and the API server run: one core per rank, and one more per rank whenever a
    KV connector is configured (for NIXL's transfer threads). kvstore's threads need no core
    of their own (its I/O thread waits on io_uring and runs in C), so that second core only
    leaves the forward one core short; on a small host (2 cores, one rank) nothing is left
    reserved, the engine core's busy loop preempts the forward's OpenMP threads, and request
    throughput drops to a third of vLLM alone's (docs/benchmarks.md, `kvstore bench serve`).
    Setting VLLM_CPU_NUM_OF_RESERVED_CPU binds as it should: the ranks per node, vLLM alone's
    default; on a host of 2 cores or fewer per rank, 0 (the forward on every core) served a
    176M-parameter model 1.5-1.8x faster than 1, with kvstore and without.
    Nothing to say on GPUs, with a binding of the operator's own, or with the variable set."""
    if not forward_on_host or (omp_bind or "auto") != "auto" or reserved_env not in (None, ""):
        return None
    return (f"kvstore: vLLM's CPU build reserves {2 * ranks} core(s) for its engine core when a KV "
            f"connector is configured ({ranks} for the engine, {ranks} for a NIXL connector's "
            "threads); kvstore needs none, and the extra reservation takes cores from the "
            "forward (on a host with 2 cores per NUMA node it leaves none for the engine core, "
            "whose busy loop then preempts the forward: a third of vLLM alone's throughput). Set "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU={ranks} in the server's environment to bind as vLLM "
            "alone does, or 0 on a host of 2 cores or fewer per rank (the forward on every core: "
            "1.5-1.8x faster with a 176M-parameter model; docs/benchmarks.md).")


def _warn_cpu_reservation(vllm_config) -> None:
    """Warn once per engine (the scheduler role) when `cpu_reservation_advice` has advice."""
    try:
        from vllm import envs
        forward_on_host = ConnectorConfig.forward_on_host()
        pc = vllm_config.parallel_config
        ranks = int(getattr(pc, "tensor_parallel_size", 1) or 1) * \
            int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        advice = cpu_reservation_advice(forward_on_host, getattr(envs, "VLLM_CPU_OMP_THREADS_BIND", None),
                                        os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"), ranks)
    except Exception:   # (a vLLM without these settings: nothing to advise)
        return
    if advice:
        log.warning(advice)


def _request_amx_permission() -> None:
    """Ask Linux for AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) before kvstore's
    io_uring rings and I/O thread start in this process.

    vLLM's CPU attention kernel uses AMX for bf16 without asking for it first. Without
    kvstore the first AMX user in the process happens to ask; with kvstore's rings and
    threads already running, the first prefix-hit attention died with SIGILL (vllm-cpu
    0.32, Sapphire Rapids VM; docs/real-engine.md). Asking here, once, is idempotent and
    costs nothing where AMX is absent.
    """
    try:
        import torch
        if hasattr(torch, "cpu") and torch.cpu._is_amx_tile_supported():
            if not torch._C._cpu._init_amx():
                log.warning("kvstore: Linux refused AMX permission; vLLM's CPU attention may fail")
    except (AttributeError, RuntimeError):   # not an x86 CPU build of torch
        return
