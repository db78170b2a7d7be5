"""The engine's side of the fleet agent: `RemoteClient` starts the agent process
(`agent.py`), hands it fetches and publishes without ever blocking the caller (a bounded
queue drained by a writer thread; answers collected by a reader thread), and starts it
again, at most every `RESTART_S`, if it dies. Nothing here raises into the engine: an
agent that is not running answers every fetch with nothing (the engine computes)."""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvstore.store.config import RemoteConfig

log = logging.getLogger("kvstore.remote")


@dataclass(slots=True)
class FetchAnswer:
    """The agent's answer to a fetch: the slots and generations of the prefix of the
    asked keys that the local store holds now (found there, or filled from the pool)."""
    slots: list[int]
    generations: list[int]
    seconds: float = 0.0

    @property
    def blocks(self) -> int:
        return len(self.slots)


class RemoteClient:
    """See the module docstring. `ask`, `answer`, `publish` and `stats` are for one
    thread (the engine's scheduler thread)."""

    RESTART_S = 10.0
    START_TIMEOUT_S = 60.0

    def __init__(self, store_path: str, cfg: RemoteConfig, *, io_mode: str = "direct"):
        self.store_path, self.cfg, self.io_mode = store_path, cfg, io_mode
        self._q: queue.Queue = queue.Queue(maxsize=max(64, cfg.publish_queue // 16 + 64))
        self._answers: dict[int, FetchAnswer] = {}
        self._abandoned: set[int] = set()   # fetches no one waits for any more
        self._stats: dict = {}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._out: Connection | None = None
        self._in: Connection | None = None
        self._reader: threading.Thread | None = None
        self._alive = False
        self._started_at = -1e9
        self._closed = False
        self.dropped_publish = 0        # blocks the engine side had no room to queue
        self.starts = 0
        self.failure = ""
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-fleet-client",
                                        daemon=True)
        self._writer.start()

    # -- the caller's side (never blocks) -------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def down(self) -> bool:
        """The agent failed or exited (and is not starting): nothing it is asked is answered."""
        return self._closed or (not self._alive and bool(self.failure))

    def ask(self, token: int, keys: list[bytes]) -> bool:
        """Queue a fetch of `keys` (the agent answers once it runs, if it is starting);
        False when it is down (the caller goes on without the pool)."""
        if self.down:
            self._kick()
            return False
        try:
            self._q.put_nowait(("fetch", token, keys))
            return True
        except queue.Full:
            return False

    def answer(self, token: int) -> FetchAnswer | None:
        """Fetch `token`'s answer (the entries local afterwards), or None while it runs
        (or when the agent died with it)."""
        with self._lock:
            return self._answers.pop(token, None)

    def abandon(self, token: int) -> None:
        """Nobody waits for fetch `token` any more: its answer, if it comes, is dropped."""
        with self._lock:
            if self._answers.pop(token, None) is None:
                self._abandoned.add(token)

    def publish(self, keys: list[bytes]) -> None:
        if not keys or self._closed:
            return
        if not self._alive and self.failure:     # down (not starting): nothing to queue for
            self.dropped_publish += len(keys)
            self._kick()
            return
        try:
            self._q.put_nowait(("publish", keys))
        except queue.Full:
            self.dropped_publish += len(keys)

    def request_stats(self) -> None:
        if self._alive:
            try:
                self._q.put_nowait(("stats", 0))
            except queue.Full:
                pass

    def stats(self) -> dict:
        """The agent's counters as last reported (`request_stats` asks for fresh ones),
        with the engine side's drops."""
        with self._lock:
            s = dict(self._stats)
        s["publish_dropped"] = s.get("publish_dropped", 0) + self.dropped_publish
        s["agent_running"] = self._alive
        s["agent_starts"] = self.starts
        return s

    def fds(self) -> list[int]:
        """The file descriptors this client holds (the pipes to the agent): leak checks."""
        return [c.fileno() for c in (self._out, self._in) if c is not None and not c.closed]

    def _kick(self) -> None:
        """Wake the writer so it restarts a dead agent when its back-off allows."""
        try:
            self._q.put_nowait(("noop",))
        except queue.Full:
            pass

    # -- the writer thread ----------------------------------------------------------------
    def _write_loop(self) -> None:
        self._start()
        while True:
            wait = None     # a running agent: block until there is something to send
            if not self._alive:     # a dead one: wake when its back-off ends, asked or not
                wait = max(0.0, self._started_at + self.RESTART_S - time.monotonic())
            try:
                msg = self._q.get(timeout=wait)
            except queue.Empty:
                msg = ("noop",)
            if msg[0] == "close":
                break
            if not self._alive:
                if time.monotonic() - self._started_at >= self.RESTART_S:
                    self._start()
                if not self._alive:
                    if msg[0] == "publish":
                        self.dropped_publish += len(msg[1])
                    continue
            if msg[0] == "noop":
                continue
            try:
                self._out.send(msg)
            except (OSError, ValueError):
                self._alive = False
        self._stop()

    def _start(self) -> None:
        self._started_at = time.monotonic()
        self._stop()
        r_in, w_in = os.pipe()      # engine -> agent
        r_out, w_out = os.pipe()    # agent -> engine
        env = dict(os.environ)
        if self.cfg.protocol == "tcp":
            env.setdefault("MC_TCP_BIND_ADDRESS", self.cfg.local_hostname)
        env.setdefault("GLOG_minloglevel", "1")     # Mooncake's info lines, off
        cmd = [sys.executable, "-m", "kvstore.remote.agent", "--store", self.store_path,
               "--remote", json.dumps(self.cfg.to_dict()), "--io-mode", self.io_mode,
               "--fd-in", str(r_in), "--fd-out", str(w_out)]
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(r_in, w_out), env=env,
                                          stdin=subprocess.DEVNULL)
        except OSError as exc:
            for fd in (r_in, w_in, r_out, w_out):
                os.close(fd)
            self._failed(f"cannot start the fleet agent: {exc}")
            return
        os.close(r_in)
        os.close(w_out)
        self._out = Connection(w_in, readable=False)
        self._in = inbox = Connection(r_out, writable=False)
        self.starts += 1
        if not inbox.poll(self.START_TIMEOUT_S):
            first = ("failed", "the fleet agent did not start in time")
        else:
            try:
                first = inbox.recv()
            except (EOFError, OSError):
                first = ("failed", f"the fleet agent exited (code {self._proc.poll()})")
        if first[0] != "ready":
            self._in = None
            inbox.close()
            self._failed(first[1])
            return
        self._alive = True
        self.failure = ""
        self._reader = threading.Thread(target=self._read_loop, args=(inbox,),
                                        name="kvstore-fleet-answers", daemon=True)
        self._reader.start()

    def _failed(self, why: str) -> None:
        self.failure = why
        self._alive = False
        log.warning("kvstore: %s; serving from the local store without the pool (retrying "
                    "in %.0f s)", why, self.RESTART_S)
        self._stop()

    def _read_loop(self, inbox: Connection) -> None:
        while True:
            try:
                msg = inbox.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                if msg[0] == "fetched":
                    if msg[1] in self._abandoned:
                        self._abandoned.discard(msg[1])
                    else:
                        self._answers[msg[1]] = FetchAnswer(msg[2], msg[3], msg[4])
                elif msg[0] == "stats":
                    self._stats = msg[2]
        inbox.close()
        if self._in is inbox:
            self._in = None
        if not self._closed:
            self._alive = False
            self.failure = "the fleet agent exited"
            log.warning("kvstore: the fleet agent exited; serving from the local store, "
                        "restarting it")
            self._kick()

    def _stop(self) -> None:
        self._alive = False
        if self._out is not None:
            try:
                self._out.close()
            except OSError:
                pass
            self._out = None
        p, self._proc = self._proc, None
        if p is not None:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # the agent is gone: its answers' pipe ends (the reader closes it)
        r, self._reader = self._reader, None
        if r is not None and r is not threading.current_thread():
            r.join(timeout=10)

    def close(self) -> None:
        """Stop the agent (it finishes the message at hand; queued publishes are dropped)."""
        if self._closed:
            return
        self._closed = True
        while True:     # room for the close message, whatever is queued
            try:
                self._q.put_nowait(("close",))
                break
            except queue.Full:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
        self._writer.join(timeout=30)
