"""vLLM general plugin: registers "KVStoreConnector" by name with vLLM's connector factory.

Runs in every vLLM process (front end, engine core, workers) through the
`vllm.general_plugins` entry point, so `"kv_connector": "KVStoreConnector"` works without
`kv_connector_module_path`. Idempotent: vLLM's factory raises on a duplicate name.
"""

NAME = "KVStoreConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvstore.vllm.connector", "KVStoreConnector")
