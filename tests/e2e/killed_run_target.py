"""The test that tests/e2e/test_killed_run.py starts in a pytest of its own and SIGKILLs:
a real server on a loop-mounted ext4 file system (the store on it), which reports where
both are and then waits to be killed. Not collected by a plain run of the suite (its name
does not match test_*.py); it runs only when named on pytest's command line."""
from __future__ import annotations

import json
import os
import time


def test_serve_on_a_loop_mount_until_killed(serve, small_disk):
    report = os.environ.get("KVSTORE_KILLED_RUN_REPORT")
    assert report, "run only by tests/e2e/test_killed_run.py"
    s = serve.server(small_disk / "store", extra={"capacity": "4M"}).start()
    with open(report + ".part", "w") as f:
        json.dump({"pytest_pid": os.getpid(), "server_pid": s.proc.pid,
                   "image": str(small_disk.parent / "disk.img"), "mount": str(small_disk)}, f)
    os.rename(report + ".part", report)
    time.sleep(3600)                    # until killed (the test's timeout ends it otherwise)
