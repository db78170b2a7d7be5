"""A real Mooncake Store pool on loopback (`kvstore.tools.fleet`): its master and one
standalone pool client, started by the tests and stopped after them."""
import pytest

from kvstore.tools import fleet as fleet_mod


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A pool for the module's tests (they use keys of their own stores)."""
    fl = fleet_mod.up(str(tmp_path_factory.mktemp("fleet")), pool_size="256M")
    yield fl
    fleet_mod.down(fl.dir)


@pytest.fixture
def own_pool(tmp_path):
    """A pool of the test's own, for tests that kill a part of it."""
    fl = fleet_mod.up(str(tmp_path / "fleet"), pool_size="64M")
    yield fl
    fleet_mod.down(fl.dir)
