"""One way to open a store for serving, from its `StoreConfig`, used by the connector's
scheduler and workers and by the secondary tier alike:

- `ensure_serving_store`: the store exists, has this engine's layout and data directories,
  and holds this model's KV (created, re-initialised or refused: `ensure_store`);
- `open_serving_index`: the store's index side (`DiskStore`, writer of LMDB) with its
  in-memory lookup table and index thread (`ServingIndex`), for the process that plans;
- `open_rank_io`: one rank's data path (`RankIO`: slot files, rings, staging, device
  health), for each process that moves bytes (it never opens LMDB).
"""
from __future__ import annotations

from typing import Callable

from kvstore.format.layout import Layout
from kvstore.io.rank import RankIO
from kvstore.lookup.table import ServingIndex
from kvstore.store.config import StoreConfig
from kvstore.store.disk import DiskStore, ensure_store


def ensure_serving_store(cfg: StoreConfig, layout: Layout, identity=None) -> str:
    """Create the store (once, race-free among an engine's processes) or check it; see
    `kvstore.store.disk.ensure_store`. Returns its absolute path."""
    return ensure_store(cfg.path, layout, cfg.capacity, io_mode=cfg.io_mode, create=cfg.create,
                        data_dirs=cfg.data_dirs, identity=identity,
                        on_model_change=cfg.on_model_change)


def open_serving_index(cfg: StoreConfig, layout: Layout, identity=None, *,
                       pool_target: Callable[[int], int], announce=None,
                       evicted_keys: bool = False,
                       index_class: type[ServingIndex] = ServingIndex) -> ServingIndex:
    """The store's `ServingIndex` (its `DiskStore` is `.store`; closing the index leaves
    the store to the caller). `pool_target(num_slots)` sizes the pool of reserved slots
    from the store's capacity."""
    ensure_serving_store(cfg, layout, identity)
    store = DiskStore(cfg.path, layout, sync=cfg.sync)
    try:
        return index_class(store, pool_target=pool_target(store.geometry.num_slots),
                           announce=announce, probe_devices=cfg.io_mode,
                           thread_cpus=cfg.thread_cpus, evicted_keys=evicted_keys)
    except BaseException:
        store.close()
        raise


def open_rank_io(cfg: StoreConfig, layout: Layout, rank: int, *,
                 staging_bytes: int | None = None) -> RankIO:
    """Rank `rank`'s data path over the store (opened by `ensure_serving_store` first),
    with the store's I/O settings; `staging_bytes` overrides the configured staging."""
    return RankIO(cfg.path, rank, layout=layout, io_mode=cfg.io_mode, queue_depth=cfg.queue_depth,
                  staging_bytes=cfg.staging_bytes if staging_bytes is None else staging_bytes,
                  eio_limit=cfg.device_eio_limit, eio_window_s=cfg.device_eio_window_s,
                  thread_cpus=cfg.thread_cpus, thread_nice=cfg.io_thread_nice,
                  inflight_bytes=cfg.inflight_bytes)
