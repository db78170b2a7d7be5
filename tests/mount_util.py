"""Real file systems for tests: a loop-mounted ext4 image (needs root, as the suite runs)."""
from __future__ import annotations

import subprocess

import pytest


def loop_ext4(tmp_path, name: str, mib: int):
    """Make and loop-mount a `mib` MiB ext4 image at tmp_path/name; returns the mount point
    (a Path). The caller unmounts it."""
    img, mnt = tmp_path / f"{name}.img", tmp_path / name
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot loop-mount an ext4 image (needs root): {r.stderr}")
    return mnt
