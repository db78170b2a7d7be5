"""What drives kvstore from outside: a real vLLM engine (models made here, `vllm serve` as a
subprocess, an OpenAI-API client, workloads), the CPU harness that runs vLLM's real scheduler
with worker connectors in one process (`simulator`), and the demos built on both. Used by
the CLI, the benchmarks and the tests; the server side never imports vLLM (the engine may
live in another environment)."""
