"""Open file descriptors of this process, for leak checks (shared by conftest.py and the
helpers; a plain module because tests/e2e has a conftest.py of its own)."""
import os


def open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out
