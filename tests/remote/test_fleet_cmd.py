"""`kvstore fleet up`: what a careless call gets: a port another process holds, a second
fleet in the same directory, a size that is not one. Each is refused with the reason, and
leaves the running fleet as it was."""
import os
import socket

import pytest

from kvstore.errors import KVStoreError
from kvstore.tools import fleet


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(KVStoreError, match=f"127.0.0.1:{port} is in use \\(--master-port\\)"):
            fleet.up(str(tmp_path / "f"), master_port=port, pool_size="64M")
    assert fleet.Fleet.load(str(tmp_path / "f")) is None


def test_a_second_fleet_in_one_directory_and_a_bad_size_are_refused(fleet_pool, tmp_path):
    with pytest.raises(KVStoreError, match="a fleet already runs from"):
        fleet.up(fleet_pool.dir, pool_size="64M")
    assert all(fleet_pool.alive().values())
    with pytest.raises(KVStoreError, match="cannot parse size"):
        fleet.up(str(tmp_path / "g"), pool_size="lots")
    assert not os.path.exists(tmp_path / "g")
