"""The model identity of a vLLM engine (`kvstore.format.identity`), for the connector
and the tier: the weights and config of `--model`, and the vLLM settings that change the
KV a token sequence produces.

Covered: the weights (hub commit or a sampled digest), the checkpoint's config files,
`--revision`, `--quantization`, `--hf-overrides` and `--dtype` (the tier: weights and
config files only, see `identity_of_offload_model`); the KV cache dtype, block size and
geometry are in the `Layout`. Not covered here because vLLM's block hashes already
separate them: LoRA adapters (by adapter name and path), multimodal inputs (by content)
and `cache_salt`.
"""
from __future__ import annotations

import logging

from kvstore.format.identity import ModelIdentity, model_identity

log = logging.getLogger("kvstore.vllm")

_logged: set[str] = set()


def identity_of_model_config(model_config) -> ModelIdentity:
    """The identity of the model a vLLM `ModelConfig` serves."""
    return _identity(str(model_config.model), revision=getattr(model_config, "revision", None),
                     quantization=getattr(model_config, "quantization", None),
                     hf_overrides=getattr(model_config, "hf_overrides", None),
                     model_dtype=getattr(model_config, "dtype", None))


def identity_of_offload_model(name: str, vllm_config=None) -> ModelIdentity:
    """The identity of the model behind an `OffloadingConfig`, which gives the tier the
    model's name only (its KV cache dtype is in the tier's `Layout`): the weights and
    config files of that directory or hub snapshot; with the engine's `VllmConfig` of that
    model (where vLLM has made it the current one), its settings too."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and str(getattr(mc, "model", "")) == str(name):
        return identity_of_model_config(mc)
    return _identity(str(name))


def _identity(model: str, **settings) -> ModelIdentity:
    ident, how = model_identity(model, **settings)
    if model not in _logged:        # once per process and model
        _logged.add(model)
        (log.info if ident.verifiable else log.warning)(
            "kvstore: model identity of %s: %s (weights identified by %s)", model,
            ident.describe(), how)
    return ident
