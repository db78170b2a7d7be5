"""The index vLLM's scheduler step consults: lookups from an in-memory table, LMDB writes
and fsyncs on an index thread behind it (`table.ServingIndex`)."""
