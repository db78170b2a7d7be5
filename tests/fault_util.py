"""Helpers of the fault campaign (tests/test_fault_*.py): child servers (through the
zygote of fault_child.py) and `kvstore fsck --json` as an operator runs it."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHILD = os.path.join(HERE, "fault_child.py")

# fsck finding kinds that are not corruption. A killed writer leaves only reservations
# (counted in stats["reserved_in_flight"], never reported as a finding; the next writer
# open reclaims them), so no finding kind is acceptable after a crash.
RECLAIMABLE_KINDS: frozenset[str] = frozenset()


def fsck_json(store, *args: str, timeout: float = 60) -> tuple[int, dict]:
    """`python -m kvstore.cli fsck --json -q [args] STORE` in a new process."""
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--json", "-q", *args, str(store)],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"fsck printed no JSON (exit {r.returncode}): {r.stdout!r} {r.stderr!r}")
    return r.returncode, doc


def corruption(doc: dict) -> list[dict]:
    """fsck findings that mean damage (everything but the reclaimable kinds)."""
    return [f for f in doc["findings"] if f["kind"] not in RECLAIMABLE_KINDS]


class Zygote:
    """A process that imported vLLM once and forks harness servers on demand (see
    fault_child.py). Replies and server output arrive as lines on one pipe."""

    def __init__(self, store, log):
        self.log = str(log)
        self._buf = b""
        self.proc = subprocess.Popen([sys.executable, CHILD, "zygote", str(store)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "ab"))
        line = self.readline(120)
        assert line == "ZYGOTE", f"zygote did not start: {line!r}\n{self.log_tail()}"

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def _send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float) -> str | None:
        """Next line, or None when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"zygote died\n{self.log_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def lines_for(self, seconds: float) -> list[str]:
        """Every line that arrives within `seconds`."""
        out, deadline = [], time.monotonic() + seconds
        while (line := self.readline(max(0.0, deadline - time.monotonic()))) is not None:
            out.append(line)
        return out

    def lines_until(self, marker: str, timeout: float) -> list[str]:
        """Every line up to and including `marker` (or all that came within `timeout`)."""
        out, deadline = [], time.monotonic() + timeout
        while (line := self.readline(max(0.0, deadline - time.monotonic()))) is not None:
            out.append(line)
            if line == marker:
                break
        return out

    def fork(self, passes: int) -> tuple[int, list[str]]:
        """Start a server; returns its pid (and any line it printed before the reply)."""
        self._send(f"fork {passes}")
        early = []
        while True:
            line = self.readline(60)
            assert line is not None, f"no reply to fork\n{self.log_tail()}"
            if line.startswith("PID "):
                return int(line.split()[1]), early
            early.append(line)

    def wait(self, pid: int, timeout: float = 120) -> tuple[int, list[str]]:
        """Reap a server: (wait status, the lines it printed that were not read yet)."""
        self._send(f"wait {pid}")
        rest = []
        while True:
            line = self.readline(timeout)
            assert line is not None, f"server {pid} did not end\n{self.log_tail()}"
            if line.startswith(f"EXIT {pid} "):
                return int(line.split()[2]), rest
            rest.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stdin.close()


def progress(lines: list[str]) -> list[dict]:
    """The `P {json}` / `DONE {json}` stats lines of a server."""
    return [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith(("P ", "DONE "))]
