"""The LMDB index of a store: key -> slot, LRU order, free slots (`core.Index`), and the
O(entries) maintenance only fsck, index rebuilds and benchmarks use (`maint`). Never
touches slot files."""
