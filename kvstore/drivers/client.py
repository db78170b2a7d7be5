"""An OpenAI-API client of a `vllm serve`, as applications talk to it (the `openai` package).

Every request streams, so the time to the first token (TTFT) is what a user waits; the
output comes back as token ids and their logprobs (vLLM's `return_tokens_as_token_ids`),
so two runs can be compared token for token, not by decoded text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Completion:
    """One streamed completion: its first-token latency and every output token."""
    ttft_s: float
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None   # vLLM's prompt_tokens_details (GPU + disk hits)
    itl_s: list[float] = field(default_factory=list)   # gaps between chunks that carried tokens

    def same_tokens(self, other: "Completion") -> bool:
        return self.token_ids == other.token_ids

    def max_logprob_diff(self, other: "Completion") -> float:
        if len(self.logprobs) != len(other.logprobs):
            return float("inf")
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs)), default=0.0)


def _token_id(tok: str) -> int:
    # return_tokens_as_token_ids renders each token as "token_id:N"
    return int(tok.rsplit(":", 1)[1])


class Client:
    """Streams completions and chats from one server (`base_url` like http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, model: str = "model", timeout_s: float = 600.0):
        from openai import OpenAI
        self.model = model
        self.api = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="kvstore", timeout=timeout_s,
                          max_retries=0)

    def complete(self, prompt: str | list[int], max_tokens: int = 8) -> Completion:
        """A greedy text (or token-id) completion."""
        t0 = time.perf_counter()
        stream = self.api.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})

        def tokens(ch):
            lp = ch.logprobs
            if lp is None or not lp.tokens:
                return [], [], ch.text or ""
            return [_token_id(t) for t in lp.tokens], [float(x) for x in lp.token_logprobs], ch.text or ""
        return self._collect(stream, t0, tokens)

    def chat(self, messages: list[dict], max_tokens: int = 8) -> Completion:
        """A greedy chat turn (the model's chat template renders the history)."""
        t0 = time.perf_counter()
        stream = self.api.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            logprobs=True, top_logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})

        def tokens(ch):
            text = (ch.delta.content or "") if ch.delta else ""
            lp = ch.logprobs
            if lp is None or not lp.content:
                return [], [], text
            return [_token_id(c.token) for c in lp.content], [float(c.logprob) for c in lp.content], text
        return self._collect(stream, t0, tokens)

    def _collect(self, stream, t0: float, tokens) -> Completion:
        """Read a stream: `tokens(choice)` gives (ids, logprobs, text) of one chunk."""
        out = Completion(ttft_s=0.0, total_s=0.0)
        last = None
        for chunk in stream:
            if chunk.choices:
                ids, lps, text = tokens(chunk.choices[0])
                if ids:
                    now = time.perf_counter()
                    if not out.token_ids:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
                out.token_ids += ids
                out.logprobs += lps
                out.text += text
            if chunk.usage is not None:
                self._usage(out, chunk.usage)
        out.total_s = time.perf_counter() - t0
        return out

    @staticmethod
    def _usage(out: Completion, usage) -> None:
        out.prompt_tokens = usage.prompt_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and getattr(details, "cached_tokens", None) is not None:
            out.cached_tokens = details.cached_tokens
