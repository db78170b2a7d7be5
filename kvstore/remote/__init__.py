"""The store's second level: a KV pool shared by a fleet of engines (Mooncake Store).

The local NVMe store stays the first level. A separate process per engine, the fleet
agent (`agent.py`), sits between the two: on a local miss it fetches the missing blocks
from the pool, verifies them and writes them into the local store (the engine then finds
them there, as it finds what another engine attached to the store wrote); after a local
store it publishes the blocks to the pool. The engine talks to its agent through
`client.RemoteClient`, which never blocks the caller. docs/FLEET.md has the whole design.
"""
