"""Child processes of the fault campaign (tests/test_fault_*.py): an EngineHarness with
the kvstore connector over a fixed store path, replaying a fixed prefix-heavy workload.

    python fault_child.py zygote STORE   # imports vLLM once, then forks servers
    python fault_child.py serve STORE --passes N   # one server, in this process

A zygote reads commands on stdin and writes replies on stdout, one line each:

    fork PASSES       ->  PID <pid>     (a new server, forked: no import cost)
    wait PID          ->  EXIT <pid> <status>
    quit

A server (forked or not) prints, one line each, `READY` once its harness is built,
`P <json>` after every batch of requests (harness stats so far: a SIGKILLed server has
already reported every mismatch it saw) and `DONE <json>` when all passes completed.
PASSES 0 means forever (until killed). A forked server's vLLM/torch modules come from
the zygote, which only imported them (no threads, no engine), so forking it is safe.
"""
from __future__ import annotations

import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BS = 16
CAPACITY = "640K"          # 40 slots at tp_size=2 (8 KiB per rank): constant eviction
HARNESS = dict(tp_size=2, num_gpu_blocks=32, max_num_batched_tokens=256, max_num_seqs=8)
STATS = ("steps", "requests_finished", "blocks_verified", "blocks_loaded", "blocks_mismatched",
         "external_hit_tokens", "invalid_block_ids")


def kv_config(store: str, **extra) -> dict:
    ex = {"path": store, "capacity": CAPACITY, "staging": "256K", "load_timeout_s": 5.0}
    ex.update(extra)
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": ex}


def workload(seed: int = 7) -> list[list[list[int]]]:
    """Batches of prompts: 5 shared documents (3-9 blocks) behind most requests, some
    with a shared system prefix, each with its own short question."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 30000) for _ in range(2 * BS)]
    docs = [[rng.randrange(10, 30000) for _ in range(rng.randrange(3 * BS, 9 * BS))] for _ in range(5)]
    batches = []
    for b in range(6):
        batch = []
        for _ in range(4):
            d = rng.choice(docs)
            head = system + d if rng.random() < 0.5 else d
            batch.append(head + [rng.randrange(10, 30000) for _ in range(rng.randrange(1, 40))])
        batches.append(batch)
    return batches


def make_harness(store: str, workdir: str, **extra):
    from kvstore.drivers.simulator import EngineHarness
    return EngineHarness(kv_transfer_config=kv_config(store, **extra), workdir=workdir, **HARNESS)


def serve(store: str, workdir: str, passes: int, out) -> None:
    h = make_harness(store, workdir)
    out("READY")
    batches = workload()
    n = 0
    try:
        while passes == 0 or n < passes:
            for batch in batches:
                h.run(batch, max_tokens=2)
                out("P " + json.dumps({k: h.stats[k] for k in STATS}))
            # vLLM's own prefix cache forgets everything: the next pass loads from disk.
            h.scheduler.reset_prefix_cache()
            n += 1
        h.idle_steps(2)
        h.drain()
        out("DONE " + json.dumps({k: h.stats[k] for k in STATS}))
    finally:
        h.shutdown()


def _out(line: str) -> None:
    os.write(1, (line + "\n").encode())   # one write per line: atomic on a pipe


def zygote(store: str) -> None:
    # Import what a server needs (seconds), but start nothing: no threads before fork.
    import kvstore.drivers.simulator  # noqa: F401
    import kvstore.vllm.connector  # noqa: F401
    import kvstore.vllm.scheduler  # noqa: F401
    import kvstore.vllm.worker  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401
    _out("ZYGOTE")
    workdir = os.path.dirname(store)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fork":
            passes = int(cmd[1])
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    serve(store, workdir, passes, _out)
                    code = 0
                finally:
                    os._exit(code)
            _out(f"PID {pid}")
        elif cmd[0] == "wait":
            pid, status = os.waitpid(int(cmd[1]), 0)
            _out(f"EXIT {pid} {status}")
        elif cmd[0] == "quit":
            return


if __name__ == "__main__":
    mode, store = sys.argv[1], sys.argv[2]
    if mode == "zygote":
        zygote(store)
    elif mode == "serve":
        passes = int(sys.argv[sys.argv.index("--passes") + 1]) if "--passes" in sys.argv else 0
        serve(store, os.path.dirname(store), passes, _out)
    else:
        raise SystemExit(f"unknown mode {mode}")
