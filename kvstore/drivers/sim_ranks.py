"""The CPU harness's simulated model ranks, in the roles vLLM's ``GPUModelRunner`` and
worker play: `Workers` builds, per tensor-parallel rank, the CPU KV tensors (vLLM's
``allocate_kv_cache``), the worker-side KV connector and the forward context, and runs
each step's worker side on every rank: bind the connector metadata and start the loads,
the fake forward (per layer: wait for its load, write the deterministic content of
`kvstore.drivers.sim_content`, save it), then wait for the saves and collect the
transfer results into one ``ModelRunnerOutput`` per rank, aggregated like vLLM's
``KVOutputAggregator``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvstore.drivers.sim_content import expected_state_bytes, expected_token_bytes

if TYPE_CHECKING:
    from kvstore.drivers.sim_build import KVGroups

__all__ = ["Rank", "Workers"]


@dataclass(slots=True)
class Rank:
    rank: int
    vllm_config: Any
    connector: Any  # worker-side connector or None
    kv_caches: dict  # layer name -> [B, H, N, C] view (spec dtype)
    byte_views: list  # per layer, uint8 view [B, H, N, Cbytes]
    forward_context: Any = None


class Workers:
    """The ranks (``ranks``) and what runs on them each step.

    ``created``: every worker connector made, also of a rank that failed to start
    (what `close_partial` shuts down)."""

    def __init__(self, groups: KVGroups, token_bytes: int):
        self.groups = groups
        self.token_bytes = token_bytes   # bytes of one token of one layer on one rank
        self.ranks: list[Rank] = []
        self.created: list[Any] = []
        self.aggregator = None

    def build(self, vllm_config, kv_cache_config, layout_name: str, block_size: int,
              tp_size: int) -> None:
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.forward_context import ForwardContext
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = KVCacheLayout[layout_name]
        layer_names = self.groups.layer_names
        for r in range(tp_size):
            rank_config = copy.copy(vllm_config)
            pc = copy.copy(vllm_config.parallel_config)
            pc.rank = r  # what vLLM's WorkerBase sets (worker_base.py:86)
            object.__setattr__(rank_config, "parallel_config", pc)
            kv_caches = allocate_kv_cache(
                kv_cache_config,
                torch.device("cpu"),
                layout,
                [block_size] * self.groups.num_groups,
            )
            byte_views = [kv_caches[n].view(torch.uint8) for n in layer_names]
            connector = None
            if vllm_config.kv_transfer_config is not None:
                with set_current_vllm_config(rank_config):
                    connector = KVConnectorFactory.create_connector(
                        config=rank_config,
                        role=KVConnectorRole.WORKER,
                        kv_cache_config=kv_cache_config,
                    )
                    self.created.append(connector)
                    connector.register_kv_caches(kv_caches)
            ctx = ForwardContext(
                no_compile_layers={
                    n: SimpleNamespace(kv_cache=kv_caches[n], layer_name=n)
                    for n in layer_names
                },
                attn_metadata={n: SimpleNamespace() for n in layer_names},
                slot_mapping={},
            )
            self.ranks.append(
                Rank(r, rank_config, connector, kv_caches, byte_views, ctx)
            )
        if self.ranks[0].connector is not None:
            self.aggregator = KVOutputAggregator.from_connector(
                self.ranks[0].connector, tp_size
            )

    def close_partial(self) -> None:
        """A worker connector refused to start: shut down the ones built."""
        for rk in self.ranks:
            if rk.connector is not None:
                rk.connector.shutdown()
        for c in self.created:
            c.shutdown()

    def shutdown(self) -> None:
        for rk in self.ranks:
            if rk.connector is not None:
                rk.connector.shutdown()

    # ------------------------------------------------------------ one step

    def bind(self, so) -> None:
        """Phase 1, every rank: bind the step's connector metadata, synchronous loads."""
        for rk in self.ranks:
            c = rk.connector
            if c is not None:
                meta = so.kv_connector_metadata
                c.handle_preemptions(meta)
                c.bind_connector_metadata(meta)
                if so.has_sync_kv_loads:
                    c.start_load_kv(rk.forward_context)

    def forward(self, writes: list[list[Any]]) -> None:
        """Phase 2, every rank: the forward (writes this step's tokens and states)."""
        for rk in self.ranks:
            self._forward_write(rk, writes)

    def _forward_write(self, rk: Rank, writes: list[list[Any]]) -> None:
        """``writes[g]``: this step's `TokenWrites` (or `StateWrite`) in group ``g``'s
        blocks; each layer writes through its own group's table."""
        import torch

        groups = self.groups
        for li, name in enumerate(groups.layer_names):
            if rk.connector is not None:
                rk.connector.wait_for_layer_load(name)
            bv = rk.byte_views[li]
            g = groups.layer_groups[li]
            if groups.is_mamba[g]:
                for w in writes[g]:
                    exp = expected_state_bytes(w.prefix_hash, li, rk.rank,
                                               groups.mamba_state_bytes)
                    bv[w.block_id, 0, 0, :] = torch.from_numpy(exp)
            else:
                for w in writes[g]:
                    exp = expected_token_bytes(w.hashes, w.positions, li, rk.rank,
                                               self.token_bytes)
                    val = torch.from_numpy(exp).reshape(len(w.positions), bv.shape[1],
                                                        bv.shape[3])
                    bv[torch.from_numpy(w.block_ids), :, torch.from_numpy(w.offsets), :] = val
            if rk.connector is not None:
                rk.connector.save_kv_layer(
                    name, rk.kv_caches[name], rk.forward_context.attn_metadata[name]
                )

    def outputs(self, so, req_ids: list[str], sampled: list[list[int]]) -> list[Any]:
        """Phase 3, every rank: asynchronous load start, save, transfer results; one
        ``ModelRunnerOutput`` per rank."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        outputs: list[Any] = []
        for rk in self.ranks:
            c = rk.connector
            kv_out = None
            if c is not None:
                if not so.has_sync_kv_loads:
                    c.start_load_kv(rk.forward_context)
                c.wait_for_save()
                tr = c.get_transfer_results(so.finished_req_ids)
                kv_out = KVConnectorOutput(
                    finished_sending=tr.finished_sending or None,
                    finished_recving=tr.finished_recving or None,
                    failed_recving=tr.failed_recving,
                    invalid_block_ids=c.get_block_ids_with_load_errors(),
                    kv_connector_stats=c.get_kv_connector_stats(),
                    kv_cache_events=c.get_kv_connector_kv_cache_events(),
                    kv_connector_worker_meta=c.build_connector_worker_meta(),
                )
                c.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=list(req_ids),
                    req_id_to_index={r: j for j, r in enumerate(req_ids)},
                    sampled_token_ids=[list(x) for x in sampled],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=None,
                    kv_connector_output=kv_out,
                )
            )
        return outputs

    def aggregate(self, outputs: list[Any]):
        """The ranks' outputs as one (the first rank's without a connector)."""
        if self.aggregator is None:
            return outputs[0]
        return self.aggregator.aggregate(outputs, 0)
