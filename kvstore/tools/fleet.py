"""`kvstore fleet up | down | status`: a Mooncake Store pool on this machine for tests,
the demo and a first try: its master (`mooncake_master`) and one standalone pool client
(`mooncake_client`, which holds the pool's memory, `--global_segment_size`), both bound
to loopback unless told otherwise, started in sessions of their own and recorded in
`<dir>/fleet.json`. A fleet of nodes runs one master and one pool client per node
(docs/FLEET.md); every engine's `"remote"` names the master.

The HTTP metadata server Mooncake offers listens on every interface whatever its host
flag says: it is never started; peers find each other by P2P handshake.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from kvstore.errors import KVStoreError
from kvstore.format.layout import parse_size

STATE = "fleet.json"


def default_dir() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache"),
                        "kvstore-fleet")


def _binary(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.access(here, os.X_OK) else shutil.which(name)
    if not found:
        raise KVStoreError(f"{name} not found: install Mooncake Store with "
                           "`pip install 'kvstore[fleet]'` (mooncake-transfer-engine-non-cuda; "
                           "it needs the Debian packages libibverbs1 libnuma1 libcurl4)")
    return found


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Fleet:
    """A running pool: where its processes listen and their pids."""
    dir: str
    host: str
    master_port: int
    client_port: int
    pool_bytes: int
    master_pid: int = 0
    client_pid: int = 0

    @property
    def master(self) -> str:
        return f"{self.host}:{self.master_port}"

    def remote_config(self) -> dict:
        """The `"remote"` settings an engine on this machine uses with this pool."""
        return {"kind": "mooncake", "master": self.master, "local_hostname": self.host}

    def save(self) -> None:
        tmp = os.path.join(self.dir, STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, os.path.join(self.dir, STATE))

    @classmethod
    def load(cls, directory: str) -> "Fleet | None":
        try:
            with open(os.path.join(directory, STATE)) as f:
                return cls(**json.load(f))
        except FileNotFoundError:
            return None

    def alive(self) -> dict[str, bool]:
        return {"master": _pid_alive(self.master_pid), "pool_client": _pid_alive(self.client_pid)}


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:     # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _wait_listening(host: str, port: int, proc: subprocess.Popen, what: str, log: str,
                    timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _listening(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = ""
            try:
                with open(log) as f:
                    tail = f.read()[-1500:]
            except OSError:
                pass
            if proc.poll() is None:
                proc.kill()
            raise KVStoreError(f"{what} did not start listening on {host}:{port} "
                               f"(log {log}):\n{tail}")
        time.sleep(0.1)


def up(directory: str | None = None, *, host: str = "127.0.0.1", master_port: int = 0,
       client_port: int = 0, pool_size="1G", env: dict | None = None) -> Fleet:
    """Start a master and a pool client (ports 0: free ones); returns the `Fleet`."""
    pool_bytes = parse_size(pool_size)     # a bad size is refused before anything is made
    for what, port in (("--master-port", master_port), ("--client-port", client_port)):
        if port and _listening(host, port):
            # (the new process would fail to bind while the readiness check saw the old one)
            raise KVStoreError(f"{host}:{port} is in use ({what}): another fleet or service "
                               "listens there; stop it, or give another port (0: a free one)")
    directory = os.path.abspath(directory or default_dir())
    os.makedirs(directory, exist_ok=True)
    old = Fleet.load(directory)
    if old is not None and any(old.alive().values()):
        raise KVStoreError(f"a fleet already runs from {directory} (master {old.master}); "
                           "`kvstore fleet down` first, or choose another --dir")
    fl = Fleet(directory, host, master_port or free_port(host), client_port or free_port(host),
               pool_bytes)
    e = dict(os.environ, **(env or {}))
    e.setdefault("MC_TCP_BIND_ADDRESS", host)
    metrics_port = free_port(host)
    mlog = os.path.join(directory, "master.log")
    with open(mlog, "ab") as lf:
        master = subprocess.Popen(
            [_binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={fl.master_port}",
             f"--metrics_host={host}", f"--metrics_port={metrics_port}",
             "--enable_http_metadata_server=false"],
            stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e,
            start_new_session=True)
    fl.master_pid = master.pid
    fl.save()
    _wait_listening(host, fl.master_port, master, "mooncake_master", mlog)
    clog = os.path.join(directory, "pool-client.log")
    with open(clog, "ab") as lf:
        client = subprocess.Popen(
            [_binary("mooncake_client"), f"--master_server_address={fl.master}",
             "--metadata_server=P2PHANDSHAKE", f"--host={host}", f"--port={fl.client_port}",
             f"--global_segment_size={pool_bytes}", "--protocol=tcp"],
            stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e,
            start_new_session=True)
    fl.client_pid = client.pid
    fl.save()
    try:
        _wait_listening(host, fl.client_port, client, "mooncake_client", clog)
    except KVStoreError:
        _stop(fl.master_pid)
        raise
    return fl


def _stop(pid: int, timeout: float = 10.0) -> None:
    if not _pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        try:     # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def down(directory: str | None = None) -> Fleet | None:
    """Stop the fleet recorded in `directory` (the pool's content is gone with it)."""
    directory = os.path.abspath(directory or default_dir())
    fl = Fleet.load(directory)
    if fl is None:
        return None
    _stop(fl.client_pid)
    _stop(fl.master_pid)
    os.unlink(os.path.join(directory, STATE))
    return fl
