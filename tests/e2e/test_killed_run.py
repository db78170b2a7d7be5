"""A test run killed with SIGKILL in the middle of an e2e test leaves no server process and
no mount behind: the server dies with the process that started it (kvstore.drivers.server:
PR_SET_PDEATHSIG and a parent-watch pipe that ends its process group, engine core and
workers included), and the run's mounts live in its own mount namespace (tests/conftest.py),
which ends with its last process (the loop device, attached with autoclear, detaches).

The run under test is a real pytest of this suite on killed_run_target.py: a real
`vllm serve` whose store is on a loop-mounted ext4 image."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _session_pids(sid: int) -> list[int]:
    """Processes of session `sid` (the server's: it is its session's leader)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(pid))
        except (OSError, IndexError):
            continue
    return out


def _loop_devices(image: str) -> str:
    r = subprocess.run(["losetup", "-j", image], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def _until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} after {timeout:.0f} s"   # a hang only
        time.sleep(0.5)
    return time.monotonic() - t0


def test_a_killed_test_run_leaves_no_server_and_no_mount(tmp_path):
    report = str(tmp_path / "report.json")
    log = tmp_path / "inner.log"
    env = {**os.environ, "KVSTORE_KILLED_RUN_REPORT": report}
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "--basetemp", str(tmp_path / "inner"),
                                os.path.join(HERE, "killed_run_target.py")],
                               cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600       # a server start: bounds a hang only
        while not os.path.exists(report):
            assert run.poll() is None, f"the inner run ended ({run.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no server after 600 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        with open(report) as f:
            rep = json.load(f)
        assert rep["pytest_pid"] == run.pid
        server = rep["server_pid"]
        # Up to the kill: the server, its engine core, the loop device under the mount.
        procs = _session_pids(server)
        assert server in procs and len(procs) >= 2, procs
        assert _loop_devices(rep["image"]), "the image is not attached to a loop device"
        with open(f"/proc/{run.pid}/mountinfo") as f:
            assert f" {rep['mount']} " in f.read(), "the inner run's mount is not in its namespace"
        run.send_signal(signal.SIGKILL)
        assert run.wait(60) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    # After it: no process of the server's session, no loop device on the image.
    try:
        gone = _until(lambda: not _session_pids(server), 120,
                      "processes of the killed run's server are still running")
        detached = _until(lambda: not _loop_devices(rep["image"]), 60,
                          "the killed run's loop device is still attached")
        print(f"after the kill: server processes gone in {gone:.1f} s, loop device detached "
              f"{detached:.1f} s later")
        with open("/proc/self/mountinfo") as f:
            assert f" {rep['mount']} " not in f.read()
    finally:                                    # what a failure found is not left running
        for pid in _session_pids(server):
            os.kill(pid, signal.SIGKILL)
