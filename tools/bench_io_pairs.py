"""Alternate `kvstore bench io` over one directory and over several (issue 15): does
striping one store over N directories cost anything against one? Pairs of one round
each (kvstore and fio), medians at the end.

    .venv/bin/python tools/bench_io_pairs.py --dirs /tmp/b1,/tmp/b2,/tmp/b3 --pairs 4
"""
import argparse
import statistics

from kvstore.bench import io_bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dirs", required=True, help="comma-separated; the first is the one-directory case")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--block-size", default="2M")
    a = ap.parse_args()
    dirs = a.dirs.split(",")
    cases = {"1": dirs[0], str(len(dirs)): ",".join(dirs)}
    res = {k: [] for k in cases}
    for _ in range(a.pairs):
        for key, d in cases.items():
            out = io_bench.run(d, a.size, a.block_size, 32, False, 1, systems=("kvstore", "fio"))
            r = out["results"]
            row = (r["kvstore"]["write_gbps"], r["kvstore"]["read_gbps"], r["fio"]["write_gbps"],
                   r["fio"]["read_gbps"])
            res[key].append(row)
            occ = [round(x["read_queue_occupancy"], 1) for x in out["per_device"]]
            print(f"{key} dir(s): kvstore write {row[0]:.2f} read {row[1]:.2f} | fio write {row[2]:.2f} "
                  f"read {row[3]:.2f} | read in flight per ring {occ}", flush=True)
    for key, rows in res.items():
        m = [statistics.median(x[i] for x in rows) for i in range(4)]
        print(f"{key} dir(s) median: kvstore write {m[0]:.2f} read {m[1]:.2f} | fio write {m[2]:.2f} read {m[3]:.2f}")


if __name__ == "__main__":
    main()
