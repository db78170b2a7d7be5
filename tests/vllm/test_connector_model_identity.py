"""The connector's store follows the model's identity through vLLM's real scheduler: the
same model after a restart loads from disk; new weights or a new config.json under the
same directory never get the old blocks (the store is re-initialised, or refused with
on_model_change "refuse"), in the scheduler and in the workers."""
import json
import os

import numpy as np
import pytest

from connector_util import kv_harness, prompts, sched, settle
from kvstore import LayoutMismatch
from kvstore.drivers.simulator import write_model_dir
from kvstore.format.layout import read_fingerprint, stored_identity


def weights(model_dir: str, seed: int) -> None:
    """A weight file (the harness does not read it; kvstore's identity does)."""
    rng = np.random.default_rng(seed)
    with open(os.path.join(model_dir, "model.bin"), "wb") as f:
        f.write(rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())


def run(store, model_dir, ps, **extra) -> dict:
    with kv_harness(store, model_dir=model_dir, extra=extra or None) as h:
        st = h.run(ps, max_tokens=2)
        settle(h)
        st["used_slots"] = sched(h).store.stats()["used_slots"]
        return st


def test_same_model_loads_changed_weights_or_config_never_do(tmp_path, caplog):
    store = tmp_path / "store"
    md = write_model_dir(tmp_path / "model")
    weights(md, 1)
    ps = prompts(21, 4, 70)        # 4 full blocks each
    assert run(store, md, ps)["used_slots"] == 16
    assert run(store, md, ps)["external_hit_tokens"] == 4 * 64       # same model: from disk
    first = stored_identity(read_fingerprint(str(store))[2])

    weights(md, 2)                  # new weights, same directory, same shapes
    st = run(store, md, ps)
    assert st["external_hit_tokens"] == 0 and st["blocks_loaded"] == 0
    assert st["used_slots"] == 16   # stored again, for the new weights
    assert "re-initialised it for this one: 16 block(s) dropped" in caplog.text
    second = stored_identity(read_fingerprint(str(store))[2])
    assert [d[0] for d in first.differences(second)] == ["weights"]
    assert run(store, md, ps)["external_hit_tokens"] == 4 * 64

    cfg = os.path.join(md, "config.json")
    with open(cfg) as f:
        doc = json.load(f)
    doc["rope_theta"] = doc.get("rope_theta", 10000.0) * 2
    with open(cfg, "w") as f:
        json.dump(doc, f)
    with pytest.raises(LayoutMismatch, match="holds KV of another model: config") as ei:
        run(store, md, ps, on_model_change="refuse")
    assert ei.value.field == "model_identity.config"
    assert stored_identity(read_fingerprint(str(store))[2]) == second   # refused: untouched
    st = run(store, md, ps)
    assert st["external_hit_tokens"] == 0 and st["blocks_loaded"] == 0
