"""A store as one object: `disk.DiskStore` (fingerprint, writer lock, index and slot files,
kept crash-consistent) and `shared` (several engines on one store: the store lock, leases,
the shared slot state)."""
