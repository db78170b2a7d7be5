"""The vLLM connector of kvstore (the only package that imports vLLM).

`kv_connector_module_path: "kvstore.vllm"` with `kv_connector: "KVStoreConnector"`
resolves to `kvstore.vllm.connector.KVStoreConnector`.
"""
from kvstore.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
