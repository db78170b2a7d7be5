"""Prefix-heavy traffic for a real server: multi-turn chats and questions over shared documents.

Prompts are words of the model's own vocabulary (`kvstore.drivers.models`), so a prompt of
n words is n tokens. The same seed gives the same traffic; a chat's later turns carry the
model's own earlier answers, so two runs agree on every prompt exactly when they agreed
on every answer.
"""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.drivers.client import Client, Completion
from kvstore.drivers.models import ModelSpec, words


@dataclass
class Request:
    kind: str                       # "document" or "chat"
    name: str                       # e.g. "doc1/q2", "chat0/turn1"
    prompt: str | None = None       # document questions: a text completion
    session: int | None = None      # chats: the session whose history is sent
    user: str | None = None


@dataclass
class Workload:
    """Questions over shared documents, interleaved with multi-turn chats."""
    spec: ModelSpec
    seed: int = 7
    documents: int = 2
    doc_tokens: int = 3000
    questions: int = 3
    sessions: int = 3
    turns: int = 3
    system_tokens: int = 400
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self):
        rng = random.Random(self.seed)
        self.system = words(self.spec, self.system_tokens, rng)
        docs = [words(self.spec, self.doc_tokens, rng) for _ in range(self.documents)]
        doc_q = [[f"{d} {words(self.spec, rng.randint(16, 48), rng)}" for _ in range(self.questions)]
                 for d in docs]
        users = [[words(self.spec, rng.randint(24, 96), rng) for _ in range(self.turns)]
                 for _ in range(self.sessions)]
        for step in range(max(self.questions, self.turns)):
            for i in range(self.documents):
                if step < self.questions:
                    self.requests.append(Request("document", f"doc{i}/q{step}", prompt=doc_q[i][step]))
            for s in range(self.sessions):
                if step < self.turns:
                    self.requests.append(Request("chat", f"chat{s}/turn{step}", session=s, user=users[s][step]))

    def replay(self, client: Client, max_tokens: int = 16, on_done=None) -> list[Completion]:
        """Send every request in order (one at a time, as a latency-bound user would)."""
        history = {s: [{"role": "system", "content": self.system}] for s in range(self.sessions)}
        out = []
        for req in self.requests:
            if req.kind == "document":
                c = client.complete(req.prompt, max_tokens=max_tokens)
            else:
                msgs = history[req.session] + [{"role": "user", "content": req.user}]
                c = client.chat(msgs, max_tokens=max_tokens)
                history[req.session] = msgs + [{"role": "assistant", "content": c.text.strip()}]
            out.append(c)
            if on_done:
                on_done(req, c)
        return out

    def replay_concurrent(self, url: str, concurrency: int = 4, max_tokens: int = 16,
                          on_done=None) -> list[Completion]:
        """Send every request with up to `concurrency` in flight, as a server sees many users.

        Each chat session and each document is a lane whose requests go in order (a turn
        carries the answers before it); lanes run side by side, each on its own client of
        `url`. The completions come back in `requests` order, so they compare one for one
        with `replay`'s. `on_done(req, completion)` is called from the sending thread.
        """
        lanes: dict[tuple, list[int]] = {}
        for i, req in enumerate(self.requests):
            key = ("chat", req.session) if req.kind == "chat" else ("doc", req.name.split("/")[0])
            lanes.setdefault(key, []).append(i)
        out: list[Completion | None] = [None] * len(self.requests)
        lock = threading.Lock()

        def lane(indices: list[int]) -> None:
            client = Client(url)
            history = [{"role": "system", "content": self.system}]
            for i in indices:
                req = self.requests[i]
                if req.kind == "document":
                    c = client.complete(req.prompt, max_tokens=max_tokens)
                else:
                    msgs = history + [{"role": "user", "content": req.user}]
                    c = client.chat(msgs, max_tokens=max_tokens)
                    history = msgs + [{"role": "assistant", "content": c.text.strip()}]
                out[i] = c
                if on_done:
                    with lock:
                        on_done(req, c)
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            for f in [pool.submit(lane, idx) for idx in lanes.values()]:
                f.result()
        return out
