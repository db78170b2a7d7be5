"""Running a real vLLM engine with kvstore: models made here, `vllm serve` as a subprocess, an
OpenAI-API client. Never imports vLLM (the engine may live in another environment)."""
