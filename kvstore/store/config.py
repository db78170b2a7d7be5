"""The settings of a store opened for serving (`StoreConfig`), shared by both ways into
vLLM: the connector's `kv_connector_extra_config` and a `secondary_tiers` entry of the
tier take the same keys for the store (docs/CONFIG.md), checked here once, each with an
error that names the key, the bad value and the accepted values. The connector's and the
tier's own options extend it (`kvstore.vllm.config.ConnectorConfig`,
`kvstore.vllm.tier_config.TierConfig`).

Never imports vLLM: whether vLLM's forward runs on this host's CPUs (which decides
`io_thread_nice`'s default) is asked by the caller.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

from kvstore.errors import ConfigError
from kvstore.format.layout import normalize_data_dirs, parse_size
from kvstore.io.rings import INFLIGHT_BYTES
from kvstore.io.threads import io_nice, parse_cpus

# The keys of a store's settings, as the connector and the tier take them.
STORE_KEYS = ("path", "capacity", "io_mode", "queue_depth", "inflight_bytes", "verify", "durability", "staging",
              "create", "slot_pool", "data_dirs", "device_eio_limit", "device_eio_window_s",
              "thread_cpus", "io_thread_nice", "on_model_change", "remote")


class Options:
    """Typed reads of a user's option dict, each refusing a bad value with a message that
    names the key and what it accepts."""

    def __init__(self, extra: dict, prefix: str = "kvstore"):
        self.extra, self.prefix = extra, prefix

    def choice(self, key: str, default, choices):
        v = self.extra.get(key, default)
        if v not in choices:
            raise ConfigError(f"{self.prefix}: {key}={v!r} is not valid; choose one of "
                              f"{', '.join(choices)}")
        return v

    def integer(self, key: str, default, lo: int, hi: int):
        v = self.extra.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{self.prefix}: {key}={v!r} must be an integer in {lo}..{hi}")
        return v

    def seconds(self, key: str, default) -> float:
        v = self.extra.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{self.prefix}: {key}={v!r} must be a positive number of seconds")
        return float(v)

    def boolean(self, key: str, default: bool) -> bool:
        v = self.extra.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.prefix}: {key}={v!r} must be true or false")
        return v


@dataclass(frozen=True)
class StoreConfig:
    """A store's settings for serving (docs/CONFIG.md): where, how big, how its I/O runs."""

    path: str
    capacity: int | None = None
    io_mode: str = "direct"
    queue_depth: int = 32
    inflight_bytes: int = INFLIGHT_BYTES   # bytes each ring keeps in flight at least
    verify: str = "checksum"
    durability: str = "fdatasync"
    staging_bytes: int = 256 << 20
    create: bool = True
    slot_pool: int | None = None
    data_dirs: tuple[str, ...] | None = None   # one directory per device (docs/CONFIG.md)
    device_eio_limit: int = 10        # EIOs within device_eio_window_s that fence a device
    device_eio_window_s: float = 600.0
    thread_cpus: frozenset[int] | None = None   # CPUs kvstore's threads run on (None: any)
    io_thread_nice: int = 0           # nice increment of kvstore's I/O threads (kvstore.io.threads)
    on_model_change: str = "reset"    # a store of other weights: "reset" it, or "refuse"
    remote: "RemoteConfig | None" = None   # a KV pool shared by a fleet (kvstore.remote)

    @property
    def sync(self) -> bool:
        """Whether data is flushed before its index commit."""
        return self.durability != "none"

    @staticmethod
    def store_fields(extra: dict, *, forward_on_host: bool, staging_default: int = 256 << 20,
                     prefix: str = "kvstore") -> dict:
        """The checked store settings of `extra` (only STORE_KEYS are read), as keyword
        arguments of StoreConfig or a subclass."""
        opt = Options(extra, prefix)
        path = extra.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(f'{prefix}: the configuration needs "path": the store directory on '
                              'local NVMe, e.g. {"path": "/mnt/nvme/kvstore", "capacity": "500G"}')
        capacity = extra.get("capacity")
        thread_cpus = parse_cpus(extra.get("thread_cpus"))
        return dict(
            path=os.path.abspath(os.path.expanduser(path)),
            capacity=None if capacity is None else parse_size(capacity),
            io_mode=opt.choice("io_mode", "direct", ("direct", "page_cache")),
            queue_depth=opt.integer("queue_depth", 32, 1, 4096),
            inflight_bytes=_inflight(extra.get("inflight_bytes", INFLIGHT_BYTES), prefix),
            verify=opt.choice("verify", "checksum", ("checksum", "header")),
            durability=opt.choice("durability", "fdatasync", ("fdatasync", "none")),
            staging_bytes=parse_size(extra.get("staging", staging_default)),
            create=opt.boolean("create", True),
            slot_pool=None if extra.get("slot_pool") is None
            else opt.integer("slot_pool", None, 1, 1 << 24),
            data_dirs=_data_dirs(extra.get("data_dirs"), prefix),
            device_eio_limit=opt.integer("device_eio_limit", 10, 1, 1 << 20),
            device_eio_window_s=opt.seconds("device_eio_window_s", 600.0),
            thread_cpus=thread_cpus,
            io_thread_nice=io_nice(thread_cpus, None if extra.get("io_thread_nice") is None
                                   else opt.integer("io_thread_nice", None, 0, 19),
                                   forward_on_host),
            on_model_change=opt.choice("on_model_change", "reset", ("reset", "refuse")),
            remote=RemoteConfig.parse(extra.get("remote"), prefix),
        )


def _inflight(value, prefix: str) -> int:
    """`inflight_bytes`: bytes (or "8M"), 0 to keep `queue_depth` alone, at most 4 GiB."""
    try:
        n = -1 if isinstance(value, bool) else 0 if value in (0, "0") else parse_size(value)
    except (ConfigError, ValueError, TypeError):
        n = -1
    if not 0 <= n <= 4 << 30:
        raise ConfigError(f'{prefix}: inflight_bytes={value!r} must be a size from 0 to "4G" (bytes '
                          'each io_uring ring keeps in flight at least, e.g. "8M"; 0: queue_depth alone)')
    return n


REMOTE_KINDS = ("mooncake",)


@dataclass(frozen=True)
class RemoteConfig:
    """The second level of a store: a KV pool the fleet shares (`"remote"` in the store's
    settings; docs/FLEET.md). kvstore's fleet agent (`kvstore.remote.agent`) fills the
    local store from it on a local miss and publishes what this node stores."""

    kind: str = "mooncake"
    master: str = "127.0.0.1:50051"     # Mooncake Store's master (host:port)
    local_hostname: str = "127.0.0.1"   # this node's address as the pool's peers reach it
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"               # "tcp", or "rdma" with `rdma_devices`
    rdma_devices: str = ""
    buffer_bytes: int = 64 << 20        # the agent's registered transfer buffer
    publish_queue: int = 4096           # blocks waiting to be published; more are dropped
    fetch_timeout_s: float = 2.0        # a lookup waits at most this for the pool

    @classmethod
    def parse(cls, value, prefix: str = "kvstore") -> "RemoteConfig | None":
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ConfigError(f'{prefix}: remote={value!r} must be an object, e.g. '
                              f'{{"kind": "mooncake", "master": "127.0.0.1:50051"}}')
        names = {f.name for f in fields(cls)} - {"buffer_bytes"} | {"buffer"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"{prefix}: unknown remote key(s) {unknown}; valid keys: "
                              f"{sorted(names)} (see docs/FLEET.md)")
        opt = Options(value, f"{prefix}: remote")
        master = value.get("master", cls.master)
        host, _, port = master.rpartition(":") if isinstance(master, str) else ("", "", "")
        if not host or not port.isdigit():
            raise ConfigError(f"{prefix}: remote master={master!r} must be host:port of Mooncake "
                              "Store's master, e.g. \"127.0.0.1:50051\"")
        strings = {}
        for name in ("local_hostname", "metadata_server", "rdma_devices"):
            v = value.get(name, getattr(cls, name))
            if not isinstance(v, str):
                raise ConfigError(f"{prefix}: remote {name}={v!r} must be a string")
            strings[name] = v
        buffer_bytes = parse_size(value.get("buffer", cls.buffer_bytes))
        if buffer_bytes < 1 << 20:
            raise ConfigError(f"{prefix}: remote buffer={value.get('buffer')!r} is under 1 MiB; "
                              "it must hold one block of every rank")
        return cls(kind=opt.choice("kind", "mooncake", REMOTE_KINDS), master=master,
                   protocol=opt.choice("protocol", "tcp", ("tcp", "rdma")),
                   buffer_bytes=buffer_bytes,
                   publish_queue=opt.integer("publish_queue", cls.publish_queue, 0, 1 << 24),
                   fetch_timeout_s=opt.seconds("fetch_timeout_s", cls.fetch_timeout_s), **strings)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["buffer"] = d.pop("buffer_bytes")
        return d


def _data_dirs(value, prefix: str) -> tuple[str, ...] | None:
    try:
        dirs = normalize_data_dirs(value)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}: {exc}") from None
    return tuple(dirs) if dirs else None
