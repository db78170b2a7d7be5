"""What a store's bytes mean: the layout fingerprint (`kvstore.json`), slot geometry and
sizes. The bottom of the package: imports nothing of kvstore but its errors."""
