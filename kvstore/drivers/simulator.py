"""CPU engine harness: a real vLLM ``Scheduler`` plus N worker-side KV connectors
over CPU KV tensors, with a deterministic "forward" and a byte-exact verifier.

Used by the tests, the demo and the benchmarks. Nothing here needs a GPU.

The harness plays the roles vLLM's ``EngineCore`` and ``GPUModelRunner`` play:

    schedule() -> per rank: handle_preemptions, bind_connector_metadata,
    [start_load_kv if the step has sync loads], verify newly scheduled
    requests, forward (per layer: wait_for_layer_load, write KV, save_kv_layer),
    [start_load_kv otherwise], wait_for_save, get_transfer_results,
    get_block_ids_with_load_errors, get_kv_connector_stats,
    build_connector_worker_meta, clear_connector_metadata
    -> KVOutputAggregator over the ranks -> update_from_output.

The forward writes, for every computed token position ``p`` of every layer ``l``
and rank ``r``, bytes that are a pure function of (hash of token ids[0..p], l,
p, r). Any block the request starts with (``num_computed_tokens > 0`` at its
first scheduling: local prefix-cache hit or external load) is checked against
that function before the forward runs, so a connector that delivers wrong bytes
is caught (``blocks_mismatched``).

With ``sliding_window`` set the model is hybrid: two KV cache groups of the same
block size (full attention over the first half of the layers, sliding window over
the second half), planned by vLLM's own ``get_kv_cache_groups`` /
``get_kv_cache_config_from_groups`` with the hybrid KV cache manager on, so the
groups' tensors alias one allocation and vLLM's ``HybridKVCacheCoordinator``
schedules them. Each layer is written and verified through its own group's block
table; sliding-window layers are verified only inside the window vLLM keeps
(positions ``>= num_computed_tokens - num_retained_tokens``).

With ``mamba=True`` a Mamba group joins them (three groups with ``sliding_window``):
vLLM's ``MambaSpec`` in "align" mode, a ``[num_blocks, 1, 1, state_bytes]`` int8 view
on a page padded to the attention page. Its fake state is a pure function of (hash of
the prefix, layer, rank) written into the state block of the step's last position; a
request that starts from a hit is checked on the state block at the hit's end, and every
later step of a request reads (checks) the state it continues from, as an SSM does.

`EngineHarness` is the engine loop and the entry points (requests, stepping, draining,
the leak check, test helpers), over its parts: `sim_content.py` (the model directory and
the deterministic content), `sim_build.py` (the ``VllmConfig``, the KV cache groups and
the scheduler: `EngineOptions` -> `EngineSetup`, `KVGroups`), `sim_ranks.py` (`Workers`:
the simulated ranks, their KV tensors and connectors, the forward), `sim_requests.py`
(`Requests`: block tables, prefix hashes, the plan of a step) and `sim_verify.py`
(`Verifier`: the byte-for-byte checks).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.drivers.sim_build import EngineOptions, build_scheduler, build_setup, make_block_hasher
from kvstore.drivers.sim_content import (
    expected_state_bytes,
    expected_token_bytes,
    prefix_hashes,
    write_model_dir,
)
from kvstore.drivers.sim_ranks import Rank, Workers
from kvstore.drivers.sim_requests import Requests
from kvstore.drivers.sim_content import HarnessError
from kvstore.drivers.sim_verify import Verifier

__all__ = [
    "write_model_dir",
    "EngineHarness",
    "expected_token_bytes",
    "expected_state_bytes",
    "prefix_hashes",
    "HarnessError",
]

_HARNESS_IDS = itertools.count()


class EngineHarness:
    """A real vLLM Scheduler + ``tp_size`` worker-side connectors on CPU.

    Args:
        model_dir: directory with a config.json; written (tiny llama) if None.
        kv_transfer_config: dict of ``KVTransferConfig`` fields, or None for no
            connector (plain prefix caching).
        num_gpu_blocks: size of the "GPU" KV cache (small, so it overflows).
        layout: KV cache layout name (``LBNHC``, ``LBHNC``, ``BLNHC``, ...).
        kv_events: enable KV cache events with the "null" publisher (True), or with the
            KVEventsConfig fields given (a dict, e.g. vLLM's ZMQ publisher).
        async_scheduling: build an AsyncScheduler and lag update_from_output by
            one step, like vLLM's async engine loop.
        sliding_window: None (default) for one full-attention KV cache group. A
            window in tokens for a hybrid model: group 0 is FullAttentionSpec over
            the first half of the layers, group 1 SlidingWindowSpec(sliding_window)
            over the second half (num_layers must be even, >= 2), both with
            ``block_size``, planned with vLLM's hybrid KV cache manager enabled.
        mamba: add a Mamba group (vLLM's ``MambaSpec`` in ``mamba_cache_mode``
            "align", states padded to the attention page): the layers split in equal
            parts, full attention first, then sliding window (if set), then Mamba.
            The fake forward writes, after each step, the state of the prefix's last
            token into the block of that position; a request starting from a hit is
            verified on the state block at its hit's end, and each later step reads
            the state it continues from (``states_read``; a wrong one counts in
            ``blocks_mismatched``). An int k > 1 makes k Mamba
            groups (a hybrid with k times as many Mamba layers as attention layers,
            which vLLM splits into groups of equal size).
        mamba_cache_mode: the cache config's (and MambaSpec's) mode with ``mamba``.
        retention_interval: vLLM's ``prefix_cache_retention_interval`` (sliding-window
            and Mamba checkpoints it keeps: 0, its default, only the replay boundary
            and shared-prefix junctions; N also one every N tokens; None all).
    """

    def __init__(
        self,
        model_dir: str | None = None,
        *,
        workdir: str | None = None,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        dtype: str = "float16",
        block_size: int = 16,
        num_gpu_blocks: int = 64,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_transfer_config: dict | None = None,
        kv_events: bool | dict = False,
        tp_size: int = 1,
        layout: str = "LBNHC",
        async_scheduling: bool = False,
        hash_algo: str = "sha256",
        verify: bool = True,
        sliding_window: int | None = None,
        mamba: bool | int = False,
        mamba_cache_mode: str = "align",
        retention_interval: int | None = 0,
    ):
        if num_kv_heads % tp_size:
            raise ValueError("num_kv_heads must be divisible by tp_size")
        self._tmp = None
        if model_dir is None:
            if workdir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-harness-")
                workdir = self._tmp.name
            model_dir = write_model_dir(
                os.path.join(workdir, "model"),
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                max_position_embeddings=max(8192, max_model_len),
            )
        self.model_dir = model_dir
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.tp_size = tp_size
        self.layout_name = layout
        self.verify_enabled = verify
        self.async_scheduling = async_scheduling
        setup = build_setup(model_dir, EngineOptions(
            dtype=dtype, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            kv_transfer_config=kv_transfer_config, kv_events=kv_events, tp_size=tp_size,
            layout=layout, async_scheduling=async_scheduling, hash_algo=hash_algo,
            sliding_window=sliding_window, mamba=mamba, mamba_cache_mode=mamba_cache_mode,
            retention_interval=retention_interval))
        self._set_setup(setup)

        self.scheduler = build_scheduler(setup, async_scheduling, block_size)
        self._block_hasher = make_block_hasher(self.kv_cache_config.hash_block_size, hash_algo)
        self.scheduler_connector = self.scheduler.connector
        self._workers = Workers(setup.groups, self.token_bytes)
        try:
            self._workers.build(self.vllm_config, self.kv_cache_config, layout, block_size,
                                tp_size)
        except BaseException:
            # A worker connector refused to start (bad config, layout mismatch): close
            # what was built, so the store's writer lock is not held by a half-made engine.
            self._workers.close_partial()
            self.scheduler.shutdown()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise
        self.ranks: list[Rank] = self._workers.ranks
        self.worker_connectors = [rk.connector for rk in self.ranks]

        self.stats: dict[str, int] = {
            "steps": 0,
            "tokens_computed": 0,
            "requests_added": 0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "blocks_verified": 0,
            "blocks_loaded": 0,
            "blocks_mismatched": 0,
            "states_read": 0,
            "local_hit_tokens": 0,
            "external_hit_tokens": 0,
            "finished_recving": 0,
            "finished_sending": 0,
            "invalid_block_ids": 0,
            "failed_recving": 0,
        }
        self.mismatches: list[dict] = []  # details of the first mismatches
        self.events: list[Any] = []  # KV events seen through the publisher
        self.kv_connector_stats: list[Any] = []
        self.finished: dict[str, list[int]] = {}  # req id -> output token ids
        self._outputs: dict[str, list[int]] = {}
        self._requests = Requests(self.scheduler, setup.groups, block_size, self.vocab_size)
        self._verifier = Verifier(setup.groups, block_size, self.ranks, self._requests,
                                  self.stats, self.mismatches)
        self._verifier.forget_owner_of_new_blocks(self.scheduler.kv_cache_manager.block_pool)
        self._req_counter = itertools.count()
        self._hid = next(_HARNESS_IDS)
        self._pending: tuple[Any, Any] | None = None  # async scheduling lag
        self.last_step_executed = False   # the last step scheduled tokens (ran the model)
        self._closed = False
        self._collect_events()  # hook the publisher before the first step

    def _set_setup(self, setup) -> None:
        """The model's shape, KV cache groups and configs, as attributes."""
        shape, groups = setup.shape, setup.groups
        self.num_layers = shape.num_layers
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.vocab_size = shape.vocab_size
        self.sliding_window = setup.sliding_window
        self.mamba = setup.mamba
        #: kind of each KV cache group: "full", then "swa" and/or "mamba" (once per group)
        self.group_kinds = setup.group_kinds
        self.dtype = setup.dtype
        self.vllm_config = setup.vllm_config
        self.kv_cache_config = setup.kv_cache_config
        self.layer_names = groups.layer_names
        self.group_specs = groups.specs
        self.num_groups = groups.num_groups
        #: group of each layer (index into ``layer_names``)
        self.layer_groups = groups.layer_groups
        #: layer indices of each group
        self.group_layers = groups.group_layers
        #: whether each group is a Mamba group (one state block per request position)
        self.group_is_mamba = groups.is_mamba
        #: bytes of one Mamba state (one layer, one rank): what a Mamba block holds
        self.mamba_state_bytes = groups.mamba_state_bytes
        self.page_bytes = setup.page_bytes
        # bytes of one token of one layer on one rank
        self.token_bytes = setup.token_bytes

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        req_id: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        if req_id is None:
            req_id = f"h{self._hid}-r{next(self._req_counter)}"
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            skip_reading_prefix_cache=skip_reading_prefix_cache or None,
        )
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._block_hasher,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(req)
        self.stats["requests_added"] += 1
        return req_id

    def abort(self, req_ids: str | Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        if isinstance(req_ids, str):
            req_ids = [req_ids]
        aborted = self.scheduler.finish_requests(
            list(req_ids), RequestStatus.FINISHED_ABORTED
        )
        self.stats["requests_aborted"] += len(aborted)

    # -------------------------------------------------------------- stepping
    # -------------------------------------------------------------- stepping

    def step(self) -> dict:
        """Run one engine step. Returns the EngineCoreOutputs dict of
        update_from_output (possibly of the previous step with async
        scheduling)."""
        so = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.last_step_executed = so.total_num_scheduled_tokens > 0
        # Update the block tables, prepare this step's writes (same for every rank,
        # content differs) per KV cache group.
        plan = self._requests.plan_step(so)
        self.stats["tokens_computed"] += plan.tokens
        # Phase 1, every rank: bind metadata, synchronous loads.
        self._workers.bind(so)
        # The Mamba states this step's forward reads, before it writes (decode updates
        # the state block in place), as an SSM reads them: overwritten by anything but
        # the request's own previous step, they are a mismatch.
        if self.verify_enabled:
            for read in plan.state_reads:
                self._verifier.read_state(read)
        # Phase 2, every rank: forward (writes this step's tokens).
        self._workers.forward(plan.writes)
        self._verifier.record_writes(plan.writes)
        # Verify the prefix every newly scheduled request starts from. After
        # the forward, because a request may hit blocks that another request
        # computes in this same step (the attention kernel would read them
        # after the KV write of the layer, as in vLLM).
        if self.verify_enabled:
            for f in plan.first:
                self._verifier.verify(f.req_id, f.num_computed)
        # Phase 3, every rank: async load start, save, results.
        outputs = self._workers.outputs(so, plan.req_ids, plan.sampled)
        mro = self._workers.aggregate(outputs)
        if self._workers.aggregator is not None:
            kco = mro.kv_connector_output
            if kco is not None:
                self.stats["finished_recving"] += len(kco.finished_recving or ())
                self.stats["finished_sending"] += len(kco.finished_sending or ())
                self.stats["invalid_block_ids"] += len(kco.invalid_block_ids or ())
                self.stats["failed_recving"] += len(kco.failed_recving or ())

        if self.async_scheduling:
            prev, self._pending = self._pending, (so, mro)
            if prev is None:
                return {}
            return self._update(*prev)
        return self._update(so, mro)

    def _update(self, so, mro) -> dict:
        eco = self.scheduler.update_from_output(so, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self._outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = self._outputs.pop(o.request_id)
                    self.stats["requests_finished"] += 1
            st = outs.scheduler_stats
            if st is not None:
                pcs = st.prefix_cache_stats
                if pcs is not None:
                    self.stats["local_hit_tokens"] += int(pcs.hits)
                cpcs = st.connector_prefix_cache_stats
                if cpcs is not None:
                    self.stats["external_hit_tokens"] += int(cpcs.hits)
                if st.kv_connector_stats:
                    self.kv_connector_stats.append(st.kv_connector_stats)
        self._requests.drop_freed()  # requests freed without output (e.g. aborted)
        self._collect_events()
        return eco

    def _collect_events(self) -> None:
        pub = self.scheduler.kv_event_publisher
        # The null publisher drops batches; wrap publish once to keep them.
        if not getattr(pub, "_kvstore_harness_wrapped", False):
            orig = pub.publish

            def publish(batch, _orig=orig, _sink=self.events):
                _sink.extend(batch.events)
                return _orig(batch)

            try:
                pub.publish = publish
                pub._kvstore_harness_wrapped = True
            except Exception:  # pragma: no cover - publisher without __dict__
                pass

    def busy(self) -> bool:
        """True while vLLM's EngineCore would keep stepping."""
        return self.scheduler.has_requests() or self._pending is not None

    def drain(self, max_steps: int | None = None, timeout_s: float = 120.0) -> None:
        """Step until the engine would go idle (``Scheduler.has_requests()``
        false). Raises HarnessError after ``max_steps`` steps (if given) or
        ``timeout_s`` seconds: background I/O makes the step count vary, so the
        bound that matters is time."""
        import time as _time

        self._collect_events()
        deadline = _time.monotonic() + timeout_s
        steps = 0
        while True:
            if not self.scheduler.has_requests():
                if self._pending is not None:
                    prev, self._pending = self._pending, None
                    self._update(*prev)
                    continue
                return
            if (max_steps is not None and steps >= max_steps) or _time.monotonic() > deadline:
                break
            self.step()
            steps += 1
            # As vLLM's EngineCore after a step that ran no model while requests remain
            # (waiting for their KV loads, delayed frees): a 1 ms sleep that yields the
            # GIL to the transfer threads (`_process_engine_step`, vLLM 0.32 and 0.33).
            # Without it the harness spins on empty steps, and kvstore's nice-19 I/O
            # threads crawl through the loads (docs/benchmarks.md).
            if not self.last_step_executed and self.scheduler.has_requests():
                _time.sleep(0.001)
        raise HarnessError(
            f"engine still busy after {steps} steps / {timeout_s:.0f}s: "
            f"{len(self.scheduler.requests)} requests, "
            f"waiting={len(self.scheduler.waiting)}, "
            f"kv_holding_waiting={len(self.scheduler.kv_holding_waiting)}, "
            f"running={len(self.scheduler.running)}"
        )

    def idle_steps(self, n: int) -> None:
        """Run ``n`` steps with nothing to schedule (vLLM's EngineCore does not
        do this by itself; use it to let a connector finish background work)."""
        for _ in range(n):
            self.step()

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 1,
        *,
        idle_steps: int = 0,
        max_steps: int | None = None,
        cache_salt: str | None = None,
    ) -> dict:
        """Add ``prompts``, step until the engine is idle, return stats."""
        for p in prompts:
            self.add_request(p, max_tokens=max_tokens, cache_salt=cache_salt)
        self.drain(max_steps)
        if idle_steps:
            self.idle_steps(idle_steps)
            self.drain(max_steps)
        return dict(self.stats)

    # ------------------------------------------------------------ checks/etc
    def forget_finished(self) -> None:
        """Drop the per-request history of finished requests (outputs, block tables),
        so that a long soak measures the product's memory, not the harness's."""
        self.finished.clear()
        self._requests.last_tables.clear()
        self.kv_connector_stats.clear()
        self.events.clear()

    def assert_no_leaks(self) -> None:
        s = self.scheduler
        problems = []
        if s.requests:
            problems.append(f"requests={list(s.requests)}")
        if len(s.waiting) or len(s.kv_holding_waiting) or s.running:
            problems.append(
                f"queues waiting={len(s.waiting)} "
                f"kv_holding_waiting={len(s.kv_holding_waiting)} running={len(s.running)}"
            )
        if s.finished_req_ids:
            problems.append(f"finished_req_ids={s.finished_req_ids}")
        if s.finished_recving_kv_req_ids or s.failed_recving_kv_req_ids:
            problems.append("recving sets not empty")
        if s._inflight_prefills:
            problems.append("inflight prefills")
        mgr = s.kv_cache_manager
        for stm in mgr.coordinator.single_type_managers:
            if stm.req_to_blocks:
                problems.append(f"req_to_blocks={list(stm.req_to_blocks)}")
        pool = mgr.block_pool
        held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
        if held:
            problems.append(f"blocks with ref_cnt>0: {held[:20]}")
        free = pool.free_block_queue.num_free_blocks
        if free != pool.num_gpu_blocks - 1:
            problems.append(f"free blocks {free} != {pool.num_gpu_blocks - 1}")
        if problems:
            raise HarnessError("leak: " + "; ".join(problems))

    def block_table(self, req_id: str) -> list[int]:
        """Group-0 block table of a request as the worker saw it last (also
        after the request finished)."""
        return self.block_tables(req_id)[0]

    def block_tables(self, req_id: str) -> tuple[list[int], ...]:
        """Block table of every KV cache group of a request (one list per group, as
        ``KVCacheBlocks.get_block_ids()``), as the worker saw it last, also after the
        request finished. Block id 0 is vLLM's null block (sliding-window blocks
        outside the window)."""
        return self._requests.tables_of(req_id)

    def layers_of_group(self, group: int) -> list[int]:
        """Layer indices (for ``byte_views``, ``corrupt_block``) of a KV cache group."""
        return list(self.group_layers[group])

    def corrupt_block(self, block_id: int, rank: int = 0, layer: int = 0,
                      byte: int = 0) -> None:
        """Flip one byte of ``block_id`` in a rank's KV cache (test helper). ``layer``
        indexes ``layer_names``; the block is read through that layer's group (see
        ``layer_groups``/``layers_of_group``). Byte ``b`` is, in the logical
        ``[H, N, C]`` page, head ``b // (N*C)``, token ``b // C % N``, byte ``b % C``."""
        bv = self.ranks[rank].byte_views[layer]  # [B, H, N, Cbytes], strided
        _, nh, nn, nc = bv.shape
        hi, rest = divmod(byte % (nh * nn * nc), nn * nc)
        ni, ci = divmod(rest, nc)
        bv[block_id, hi, ni, ci] ^= 0xFF

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown()
        try:
            self.scheduler.shutdown()
            # vLLM's ZMQ publisher closes its sockets but leaves its context (and the
            # context's fds) to the process; a harness is a whole engine: it ends it.
            ctx = getattr(self.scheduler.kv_event_publisher, "_ctx", None)
            if ctx is not None and not ctx.closed:
                ctx.term()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> EngineHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
