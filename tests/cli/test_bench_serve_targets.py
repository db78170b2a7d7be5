"""`kvstore bench serve`'s verdicts on its own numbers: the no-reuse target compares kvstore
with vLLM alone phase for phase and judges the means, within the bench's stated noise."""
from __future__ import annotations

from kvstore.bench.serve_bench import NO_REUSE_NOISE, targets


def no_reuse(vllm: dict, kvstore: dict) -> dict:
    row = lambda rps: {"throughput_rps": rps}   # noqa: E731
    return {"workloads": {"no_reuse": {"vllm": {p: row(v) for p, v in vllm.items()},
                                       "kvstore": {p: row(v) for p, v in kvstore.items()}}}}


def test_no_reuse_is_judged_phase_for_phase_on_the_means():
    t = targets(no_reuse({"cold": 4.0, "warm": 5.0}, {"cold": 4.2, "warm": 4.9, "restart": 3.8}))["no_reuse"]
    assert t["cold_throughput_vs_vllm"] == 1.05
    assert t["warm_throughput_vs_vllm"] == 0.98
    assert t["restart_throughput_vs_vllm"] == 0.95      # a restart is a fresh server: vs cold
    assert t["throughput_vs_vllm"] == round((4.2 + 4.9 + 3.8) / (4.0 + 5.0 + 4.0), 2)
    assert t["met_throughput_not_lower"] is True


def test_no_reuse_below_the_noise_is_a_miss():
    low = 1 - NO_REUSE_NOISE - 0.03
    t = targets(no_reuse({"cold": 5.0, "warm": 5.0}, {"cold": 5.0 * low, "warm": 5.0 * low}))["no_reuse"]
    assert t["met_throughput_not_lower"] is False
    assert targets(no_reuse({"cold": 5.0}, {}))["no_reuse"]["met_throughput_not_lower"] is False


def test_rounds_report_each_numbers_median():
    from kvstore.bench.serve_bench import median_of
    row = lambda rps, hit, client="vllm bench serve": {   # noqa: E731
        "throughput_rps": rps, "external_hit_tokens": hit, "ttft_p99_ms": None if rps > 9 else rps,
        "client": client}
    rounds = [{"no_reuse": {"vllm": {"cold": row(4.0, 0), "warm": row(5.0, 0)}}},
              {"no_reuse": {"vllm": {"cold": row(5.5, 2), "warm": row(5.2, 0)}}},
              {"no_reuse": {"vllm": {"cold": row(10.0, 4)}, "kvstore": {"cold": row(3.0, 1)}}}]
    m = median_of(rounds)["no_reuse"]
    assert m["vllm"]["cold"] == {"throughput_rps": 5.5, "external_hit_tokens": 2,
                                 "ttft_p99_ms": 4.75, "client": "vllm bench serve"}
    assert m["vllm"]["warm"]["throughput_rps"] == 5.1          # only the rounds that ran it
    assert m["kvstore"]["cold"]["throughput_rps"] == 3.0
