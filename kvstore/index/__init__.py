"""The LMDB index of a store: key -> slot, LRU order, free slots (`core.Index`, the one
class the rest of kvstore calls; its parts: `env`, `entries`, `slots`, `fences`, `check`),
and the O(entries) maintenance only fsck, index rebuilds and benchmarks use (`maint`).
Never touches slot files."""
