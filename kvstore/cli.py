"""The `kvstore` command line: info, fsck, warmup, bench, demo, fleet.

Built on click (subcommands, typed options, generated --help) rather than argparse
plumbing. Tools go through the engine API (`kvstore.store.disk.DiskStore`), never around it.
Errors a user can act on are printed as one line on stderr with exit status 1 (fsck has
its own e2fsck-style codes).
"""
from __future__ import annotations

import json
import os
import logging
import sys

import click

from kvstore.errors import KVStoreError


def _fail(exc: Exception, code: int = 1):
    click.echo(f"kvstore: error: {exc}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.version_option(package_name="kvstore")
def main(verbose: bool):
    """kvstore: a persistent NVMe disk tier for vLLM's KV cache.

    \b
    In vLLM, one JSON flag either way (README.md, docs/CONFIG.md):
      as a KV connector:  "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm"
      as a secondary tier of OffloadingConnector:  "secondary_tiers": [{"type": "KVStoreTier",
                          "module_path": "kvstore.vllm.tier", "path": ..., "capacity": ...}]
      either way, a KV pool shared by a fleet:  "remote": {"master": "HOST:PORT"} (kvstore fleet)
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


@main.group()
def fleet():
    """A Mooncake Store KV pool on this machine, shared by engines (docs/FLEET.md)."""


@fleet.command("up")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Where the pool's state and logs go (default: $XDG_RUNTIME_DIR or "
                   "~/.cache, kvstore-fleet).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the master and the pool client bind to.")
@click.option("--master-port", default=50051, show_default=True, type=click.IntRange(0, 65535))
@click.option("--client-port", default=50052, show_default=True, type=click.IntRange(0, 65535))
@click.option("--pool-size", default="4G", show_default=True,
              help="Memory the pool client holds for the pool.")
def fleet_up(directory, host, master_port, client_port, pool_size):
    """Start Mooncake's master and a pool client; print the "remote" settings to use."""
    from kvstore.tools import fleet as fleet_mod
    try:
        fl = fleet_mod.up(directory, host=host, master_port=master_port,
                          client_port=client_port, pool_size=pool_size)
    except KVStoreError as exc:
        _fail(exc)
    click.echo(json.dumps({"remote": fl.remote_config(), "dir": fl.dir,
                           "master_pid": fl.master_pid, "pool_client_pid": fl.client_pid}))


@fleet.command("down")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None)
def fleet_down(directory):
    """Stop the pool started by `kvstore fleet up` (its blocks are gone with it)."""
    from kvstore.tools import fleet as fleet_mod
    fl = fleet_mod.down(directory)
    click.echo("no fleet running" if fl is None else f"stopped the pool at {fl.master}")


@fleet.command("status")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None)
def fleet_status(directory):
    """Whether the pool's processes run, as JSON."""
    from kvstore.tools import fleet as fleet_mod
    fl = fleet_mod.Fleet.load(os.path.abspath(directory or fleet_mod.default_dir()))
    if fl is None:
        _fail(KVStoreError("no fleet recorded there; start one with `kvstore fleet up`"))
    click.echo(json.dumps({"remote": fl.remote_config(), **fl.alive()}))


@main.group()
def bench():
    """Benchmarks that print a table (and --json)."""


@bench.command("fleet")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Scratch directory for the stores (default: a temporary directory).")
@click.option("--blocks", default=512, show_default=True, type=click.IntRange(1),
              help="Blocks moved each way per round.")
@click.option("--block-size", default="2M", show_default=True, help="Bytes per block (one rank).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 20))
@click.option("--index-entries", default=100_000, show_default=True, type=click.IntRange(0),
              help="Entries prefilled in the step section's store.")
@click.option("--requests", default=64, show_default=True, type=click.IntRange(1),
              help="Prompts of the step section.")
@click.option("--ttft", "with_ttft", is_flag=True,
              help="Also time to first token with real `vllm serve` engines (recompute, pool "
                   "hit, local hit): three server starts.")
@click.option("--model", default="demo", show_default=True, help="Model of the --ttft section.")
@click.option("--length", default=2000, show_default=True, type=click.IntRange(64),
              help="Document tokens of the --ttft section.")
@click.option("--samples", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--python", default=None, help="The engine's Python (default: .venv-engine).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of the results.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def bench_fleet(directory, blocks, block_size, rounds, index_entries, requests, with_ttft, model,
                length, samples, python, plot_path, as_json):
    """The fleet's KV pool (Mooncake Store) through kvstore vs Mooncake's own transfers, the
    scheduler thread's time with the pool on, and (--ttft) B's TTFT for A's documents."""
    from kvstore.bench import fleet_bench
    try:
        out = fleet_bench.run(blocks, block_size, rounds, index_entries, requests, with_ttft,
                              model, length, samples, python, directory,
                              say=(lambda m: click.echo(m, err=True)) if as_json else click.echo)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    if plot_path:
        fleet_bench.plot(out, plot_path)
    if as_json:
        click.echo(json.dumps(out, indent=2))


@bench.command("io")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory on the device to measure, or several comma-separated (A,B,C: "
                   "one per device; kvstore stripes a store over them, fio runs a job on each "
                   "at once). Default: a temporary directory.")
@click.option("--size", default="4G", show_default=True, help="Total bytes per system and phase.")
@click.option("--block-size", default="2M", show_default=True, help="Bytes per I/O (e.g. 2M, 128K).")
@click.option("--queue-depth", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--page-cache", is_flag=True, help="Buffered I/O instead of O_DIRECT.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Alternating rounds; medians are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def bench_io(directory, size, block_size, queue_depth, page_cache, rounds, as_json):
    """The I/O core vs fio (io_uring) vs one blocking thread, same disk and settings."""
    from kvstore.bench import io_bench
    try:
        out = io_bench.run(directory, size, block_size, queue_depth, page_cache, rounds)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else io_bench.format_table(out))


@bench.command("warmup")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory on the device (both stores and fio's files). Default: a "
                   "temporary directory under /var/tmp.")
@click.option("--block-sizes", default="128K,2M", show_default=True,
              help="Comma-separated bytes per block.")
@click.option("--size", default="1G", show_default=True, help="Bytes of blocks copied per round.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Alternating rounds; medians are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def bench_warmup(directory, block_sizes, size, rounds, as_json):
    """`kvstore warmup --from-store --all` (a store copied) vs fio reading then writing the
    same slots."""
    from kvstore.bench import warmup_bench
    sizes = tuple(x.strip() for x in block_sizes.split(",") if x.strip())
    if not sizes:
        _fail(KVStoreError("--block-sizes: give comma-separated sizes, e.g. 128K,2M"))
    try:
        out = warmup_bench.run(directory, sizes, size, rounds,
                               log=None if as_json else (lambda m: click.echo(m, err=True)))
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else warmup_bench.format_table(out))


@bench.command("index")
@click.option("--entries", default="100000,1000000,10000000", show_default=True,
              help="Comma-separated index sizes.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_index(entries, directory, as_json):
    """LMDB index: prefix lookups, lookups/s, commits with evictions, open time; and the
    connector's in-memory table (warm prefixes, the 511-block pinned walk with cold caches)."""
    from kvstore.bench import index_bench
    try:
        sizes = [int(x) for x in entries.split(",") if x.strip()]
    except ValueError:
        _fail(KVStoreError(f"--entries must be comma-separated integers, got {entries!r}"))
    if not sizes:
        _fail(KVStoreError(f"--entries names no size (got {entries!r}): give e.g. --entries 1000000"))
    small = [n for n in sizes if n < index_bench.CHAIN]
    if small:   # its reserve/commit rounds take CHAIN slots of a full index
        _fail(KVStoreError(f"--entries: each size must be at least {index_bench.CHAIN:,} "
                           f"(the bench commits {index_bench.CHAIN:,} keys at a time), got {small}"))
    try:
        out = index_bench.run(sizes, as_json, directory)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(out, indent=2))


@bench.command("peers")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory on the device to measure, or several comma-separated (A,B,C: one "
                   "per device; kvstore stripes a store over them, fio runs a job on each at once, "
                   "the one-thread baseline a thread on each, vLLM's fs tier, which takes one "
                   "root, the first). Default: a temporary directory.")
@click.option("--block-sizes", default="128K,512K,2M", show_default=True,
              help="Comma-separated block sizes (bytes of payload per block).")
@click.option("--size", default="1G", show_default=True,
              help="Total bytes per system per block size (stored, then loaded; split evenly "
                   "over several directories).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Alternating rounds; medians are reported.")
@click.option("--queue-depth", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--page-cache", is_flag=True, help="Buffered I/O instead of O_DIRECT (every system).")
@click.option("--samples", default=20, show_default=True, type=click.IntRange(1, 10000),
              help="Prefix loads timed per system per round (under background stores).")
@click.option("--prefix-blocks", default=1000, show_default=True, type=click.IntRange(1),
              help="Blocks in the prefix whose load time is measured (capped by --prefix-max).")
@click.option("--prefix-max", default="128M", show_default=True,
              help="Cap on the prefix's bytes (large blocks get a shorter prefix; the table says so).")
@click.option("--staging", default="256M", show_default=True,
              help="kvstore RankIO staging memory (one ring batch).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also save a PNG chart (matplotlib) to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def bench_peers(directory, block_sizes, size, rounds, queue_depth, page_cache, samples,
                prefix_blocks, prefix_max, staging, plot_path, as_json):
    """kvstore vs vLLM's fs tier vs one blocking thread vs fio (needs the `vllm` extra)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        _fail(KVStoreError("`kvstore bench peers` compares against vLLM's own fs tier and needs "
                           "vLLM: pip install 'kvstore[vllm]'"))
    from kvstore.bench import peers_bench
    try:
        out = peers_bench.run(directory, size, block_sizes, queue_depth, page_cache, rounds,
                              prefix_blocks, prefix_max, samples, staging)
        if plot_path:
            peers_bench.plot(out, plot_path)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else peers_bench.format_table(out))



# ---------------------------------------------------------------- operator tools: info, fsck, warmup

def _progress_factory(enabled: bool = True):
    """Progress reporters on stderr: tqdm on a terminal, plain lines when not a TTY."""
    from kvstore.tools import Progress

    def make(desc, total=None, unit=""):
        return Progress(desc, total, unit, enabled=enabled)
    return make


@main.command("info")
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def info_cmd(store, as_json):
    """Fingerprint, capacity, slot usage, counters, files and attached engines of STORE.

    Read-only and lock-free: safe while engines use the store.
    """
    from kvstore.tools import info as info_mod
    try:
        out = info_mod.gather(store)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else info_mod.format_text(out))
    if out.get("index_error"):
        sys.exit(1)


class _FsckCommand(click.Command):
    """e2fsck exit statuses: a usage error is 16 (click's default would be 2)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            exc.exit_code = 16
            raise


@main.command("fsck", cls=_FsckCommand)
@click.argument("store", type=click.Path(file_okay=False))
@click.option("--deep", is_flag=True, help="Also verify every payload checksum (reads every used slot).")
@click.option("--repair", is_flag=True,
              help="Fix what is found (an offline repair: refused, naming their pids, while engines "
                   "are attached).")
@click.option("--rebuild-index", is_flag=True,
              help="Recreate index/ from the slots (reads and verifies every slot; implies --repair).")
@click.option("--json", "as_json", is_flag=True, help="Print every finding and the counts as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@click.option("--queue-depth", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--staging", default="256M", show_default=True,
              help="Staging memory for --deep reads (shared by two rings per rank, each double-buffered).")
@click.option("--model", default=None,
              help="Also check that the store's KV is this model's: a model directory or a hub name "
                   "in the local cache (its weights and config files against the store's model identity).")
def fsck_cmd(store, deep, repair, rebuild_index, as_json, quiet, queue_depth, staging, model):
    """Check STORE (and with --repair, fix it), like e2fsck.

    Read-only by default and safe while engines use the store. Exit status (a sum, as
    e2fsck): 0 clean, 1 errors corrected, 4 errors left uncorrected, 8 operational error,
    16 usage error, 32 cancelled.
    """
    from kvstore.format.layout import parse_size
    from kvstore.tools import fsck as fsck_mod
    try:
        staging_bytes = parse_size(staging)
    except KVStoreError as exc:
        click.echo(f"kvstore fsck: error: --staging: {exc}", err=True)
        sys.exit(fsck_mod.EXIT_USAGE)
    try:
        rep = fsck_mod.fsck(store, deep=deep, repair=repair, rebuild_index=rebuild_index,
                            progress=_progress_factory(not quiet), staging_bytes=staging_bytes,
                            queue_depth=queue_depth, model=model)
    except KeyboardInterrupt:
        click.echo("kvstore fsck: cancelled", err=True)
        sys.exit(fsck_mod.EXIT_CANCELLED)
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=2))
    else:
        click.echo(fsck_mod.format_text(rep))
    sys.exit(rep.exit_code)



@main.command("warmup")
@click.argument("store", type=click.Path(file_okay=False))
@click.argument("prompts", required=False, type=click.Path(dir_okay=False, exists=True))
@click.option("--from-store", "from_store", type=click.Path(file_okay=False), default=None,
              help="Copy blocks from this store (same layout), verifying checksums.")
@click.option("--model", default=None,
              help="Compute the KV with vLLM and this local model directory (vLLM's CUDA build on a GPU, "
                   "or its CPU build: run this command with the engine venv's Python).")
@click.option("--capacity", default=None,
              help="Create STORE (when it does not exist) with this capacity, e.g. 500G (default with "
                   "--from-store: the source's).")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE",
              help="With --model: a vLLM engine argument (repeatable), e.g. block_size=32, dtype=float32; "
                   "VALUE is read as JSON when it parses, else as a string.")
@click.option("--all", "all_blocks", is_flag=True,
              help="With --from-store: copy every block of the source, hottest first (no PROMPTS).")
@click.option("--tokenizer", default=None,
              help="Local tokenizer directory for text/chat prompts (default: --model, else the "
                   "store's model when it is a directory).")
@click.option("--format", "fmt", type=click.Choice(["auto", "text", "jsonl", "tokens"]), default="auto",
              show_default=True, help="PROMPTS format: text lines, JSONL (prompt/messages/token ids) "
                                      "or token-id lists.")
@click.option("--dry-run", is_flag=True, help="Say what would be written; write nothing (no lock).")
@click.option("--allow-evict-hotter", is_flag=True,
              help="When the store is full, evict existing entries (LRU first) to make room.")
@click.option("--chunk-blocks", default=None, type=click.IntRange(1, 1 << 20),
              help="Blocks copied per batch (default: 64 MiB of blocks).")
@click.option("--connector-config", default=None,
              help="With --model: JSON merged into the connector's kv_connector_extra_config.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def warmup_cmd(store, prompts, from_store, model, capacity, engine_arg, all_blocks, tokenizer, fmt, dry_run,
               allow_evict_hotter, chunk_blocks, connector_config, as_json, quiet):
    """Fill STORE before traffic arrives, from PROMPTS (or --all of another store).

    Blocks already in STORE are skipped, so an interrupted run resumes where it stopped.
    A tier store (`KVStoreTier`'s) is filled only with --from-store SRC --all: its chunk keys
    cannot be computed from prompts.
    Existing entries are never evicted unless --allow-evict-hotter is given.
    """
    from kvstore.tools import warmup as warmup_mod
    extra = None
    if connector_config:
        try:
            extra = json.loads(connector_config)
            if not isinstance(extra, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            _fail(KVStoreError(f"--connector-config must be a JSON object ({exc})"))
    engine_args = {}
    for item in engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(KVStoreError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. block_size=32"))
        try:
            engine_args[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            engine_args[key.replace("-", "_")] = value
    try:
        sm = warmup_mod.warmup(store, prompts, from_store=from_store, model=model, all_blocks=all_blocks,
                               capacity=capacity, engine_args=engine_args or None,
                               tokenizer=tokenizer, fmt=fmt, dry_run=dry_run,
                               allow_evict_hotter=allow_evict_hotter, chunk_blocks=chunk_blocks,
                               progress=_progress_factory(not quiet), connector_config=extra)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(sm.to_json(), indent=2) if as_json else warmup_mod.format_text(sm))
    if sm.stopped == "interrupted":
        sys.exit(130)


@bench.command("tier")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory on the device (both tiers and fio use it). Default: a temporary "
                   "directory under /var/tmp.")
@click.option("--chunk-sizes", default="128K,2M,8M", show_default=True,
              help="Comma-separated bytes per offloaded chunk: a multiple of 2 MiB is 16-token "
                   "blocks of a 7B-class layout (128 KiB of KV per token; 2 MiB is vLLM's "
                   "default 16-token chunk), a multiple of 64 KiB below it one 16-token block "
                   "of fewer layers.")
@click.option("--chunk-tokens", default=None,
              help="Instead of --chunk-sizes: comma-separated tokens per chunk of the 7B-class "
                   "layout (multiples of 16).")
@click.option("--size", default="1G", show_default=True,
              help="Bytes of chunks stored per system per chunk size (2x the kvstore capacity).")
@click.option("--capacity", default=None,
              help="kvstore tier capacity (default: half of --size).")
@click.option("--primary", default="256M", show_default=True,
              help="vLLM's CPU primary tier (cpu_bytes_to_use); the load phase promotes this "
                   "many bytes of the most recent chunks.")
@click.option("--job-tokens", default=1024, show_default=True, type=click.IntRange(16),
              help="Tokens per request (one store job, one load job).")
@click.option("--step-ms", default=1.0, show_default=True, type=click.FloatRange(0, 1000),
              help="Pause between scheduler steps (the forward pass).")
@click.option("--queue-depth", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 50),
              help="Rounds per system; medians are reported.")
@click.option("--systems", default="kvstore,fs,fio,fio-slots", show_default=True,
              help="Comma-separated subset of: kvstore, fs, fio (sequential at the chunk size), "
                   "fio-slots (fio with kvstore's own pattern: a slot per chunk, its header "
                   "included).")
@click.option("--durability", default="fdatasync", show_default=True,
              type=click.Choice(["fdatasync", "none"]),
              help="The kvstore tier's durability (the fs tier never syncs).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also save a PNG chart (matplotlib): store and load GB/s per chunk size.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
def bench_tier(directory, chunk_sizes, chunk_tokens, size, capacity, primary, job_tokens, step_ms,
               queue_depth, rounds, systems, durability, plot_path, as_json):
    """kvstore as a vLLM secondary tier vs vLLM's fs tier vs fio, behind vLLM's manager."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        _fail(KVStoreError("`kvstore bench tier` runs vLLM's TieringOffloadingManager and needs "
                           "vLLM: pip install 'kvstore[vllm]'"))
    from kvstore.bench import tier_bench
    if chunk_tokens is not None:
        try:
            tokens = [int(x) for x in chunk_tokens.split(",") if x.strip()]
        except ValueError:
            _fail(KVStoreError(f"--chunk-tokens: give comma-separated integers, got {chunk_tokens!r}"))
        bad = [t for t in tokens if t <= 0 or t % tier_bench.BLOCK_TOKENS]
        if bad or not tokens:
            _fail(KVStoreError(f"--chunk-tokens: give positive multiples of {tier_bench.BLOCK_TOKENS} "
                               f"(vLLM's block), got {chunk_tokens!r}"))
        sizes = tuple(t * tier_bench.TOKEN_BYTES for t in tokens)
    else:
        sizes = tuple(x.strip() for x in chunk_sizes.split(",") if x.strip())
        if not sizes:
            _fail(KVStoreError("--chunk-sizes: give comma-separated sizes, e.g. 128K,2M,8M"))
    if plot_path and not os.path.isdir(os.path.dirname(os.path.abspath(plot_path))):
        _fail(KVStoreError(f"--plot {plot_path}: its directory does not exist (create it, or "
                           "name another file)"))
    names = tuple(x.strip() for x in systems.split(",") if x.strip())
    bad = [x for x in names if x not in tier_bench.SYSTEMS]
    if bad or not names:
        _fail(KVStoreError(f"--systems: choose from {', '.join(tier_bench.SYSTEMS)}, got {systems!r}"))
    try:
        out = tier_bench.run(directory, sizes, size, capacity, primary, job_tokens, step_ms,
                             queue_depth, rounds, names,
                             log=None if as_json else (lambda m: click.echo(m, err=True)),
                             durability=durability)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else tier_bench.format_table(out))
    if plot_path:
        try:    # the numbers are out already: a plot that cannot be written loses nothing
            tier_bench.plot(out, plot_path)
        except (OSError, ValueError) as exc:
            _fail(KVStoreError(f"--plot {plot_path}: cannot write the chart ({exc}); the results "
                               "are above"))


@bench.command("connector")
@click.option("--index-entries", default=1_000_000, show_default=True, type=click.IntRange(0, 1 << 31),
              help="Entries prefilled into the index (0: an empty 2G store).")
@click.option("--requests", default=256, show_default=True, type=click.IntRange(1, 100000),
              help="Prompts per phase, one step's token budget each: about as many steps. "
                   "The p99 of fewer than 100 steps is their slowest (the default is 256).")
@click.option("--prompt-tokens", default=8192, show_default=True, type=click.IntRange(32, 8192))
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run the synchronous baseline index (every index operation on the "
                   "scheduler thread).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Scratch directory (default: the system temp directory).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also save a PNG chart (matplotlib) of the per-step distributions.")
@click.option("--engines", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Engine processes on the one store at once (each reported; the load phase "
                   "replays another engine's prompts). More than 1 skips the baseline.")
@click.option("--thread-cpus", default=None, metavar="CPULIST",
              help="The connector's thread_cpus: run kvstore's threads only on these CPUs "
                   "(\"1\", \"6-7\"), as an operator who sets CPUs aside for them would.")
@click.option("--io-thread-nice", default=None, type=click.IntRange(0, 19),
              help="The connector's io_thread_nice: how far below the index thread kvstore's "
                   "I/O threads run (default: 19, or 0 where vLLM's forward runs on these CPUs: "
                   "its CPU build without --thread-cpus).")
@click.option("--forward-ms", default=10.0, show_default=True, type=click.FloatRange(0, 10000),
              help="Sleep after each step that computed tokens, standing in for the model's "
                   "forward (the harness runs none); kvstore's threads refill the slot pool "
                   "meanwhile, so every store step plans a full step of blocks. 0: step back "
                   "to back (most store steps then find the pool dry).")
@click.option("--json", "as_json", is_flag=True)
def bench_connector(index_entries, requests, prompt_tokens, baseline, directory, plot_path,
                    engines, thread_cpus, io_thread_nice, forward_ms, as_json):
    """Connector time on vLLM's scheduler thread per step (p50/p99/max), store and load phases."""
    from kvstore.bench import connector_bench
    from kvstore.io.threads import parse_cpus
    try:
        parse_cpus(thread_cpus)     # a bad list fails here, not after minutes of prefill
    except KVStoreError as exc:
        _fail(exc)
    if plot_path and not os.path.isdir(os.path.dirname(os.path.abspath(plot_path))):
        _fail(f"--plot {plot_path}: its directory does not exist (create it, or name another "
              "file); nothing was run")
    try:
        out = connector_bench.run(index_entries=index_entries, requests=requests,
                                  prompt_tokens=prompt_tokens, baseline=baseline and engines == 1,
                                  workdir=directory, engines=engines, thread_cpus=thread_cpus,
                                  io_thread_nice=io_thread_nice, forward_ms=forward_ms)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else connector_bench.format_table(out))
    if plot_path:
        try:    # the numbers are out already: a plot that cannot be written loses nothing
            connector_bench.plot(out, plot_path)
        except OSError as exc:
            _fail(f"--plot {plot_path}: cannot write the chart ({exc}); the results are above")


@bench.command("ttft")
@click.option("--lengths", default="1000,4000,8000", show_default=True, help="Prefix lengths in tokens.")
@click.option("--samples", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Distinct prompts per length.")
@click.option("--model", default="demo", show_default=True,
              type=click.Choice(["demo", "tiny", "demo-gemma2", "tiny-gemma2"]))
@click.option("--python", "python", default=None, help="Python whose vLLM serves (see `kvstore demo`).")
@click.option("--systems", default=None,
              help="Comma-separated subset of: kvstore (the connector), kvstore-tier and fs-tier "
                   "(vLLM's OffloadingConnector with a CPU primary and kvstore's or vLLM's fs tier "
                   "behind it), and the peer connectors (default: all).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Where stores and peer tiers live (default: a temporary directory).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_ttft(lengths, samples, model, python, systems, directory, plot_path, as_json):
    """TTFT of a real `vllm serve`: prefill, vLLM's prefix cache, kvstore after a restart, peers."""
    from kvstore.bench import ttft_bench
    try:
        ls = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        _fail(KVStoreError(f"--lengths must be comma-separated integers, got {lengths!r}"))
    say = (lambda *a: click.echo(*a, err=True)) if as_json else click.echo
    try:
        out = ttft_bench.run(ls, samples, model, python,
                             [s.strip() for s in systems.split(",")] if systems else None, directory, say=say)
        if plot_path:
            ttft_bench.plot(out, plot_path)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(ttft_bench.to_json(out), indent=2) if as_json else ttft_bench.format_table(out))


@bench.command("serve")
@click.option("--systems", default=None, help="Comma-separated subset of: vllm, kvstore, ceiling, "
              "offload-fs, kvstore-tier (default: all; a system that cannot start on this engine is listed "
              "with its error).")
@click.option("--workloads", default=None, help="Comma-separated subset of: prefix_repetition, doc_qa, "
              "no_reuse (default: all).")
@click.option("--model", default="demo", show_default=True,
              type=click.Choice(["demo", "tiny", "demo-gemma2", "tiny-gemma2"]))
@click.option("--python", "python", default=None, help="Python whose vLLM serves (see `kvstore demo`).")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 1024), help="Requests in flight.")
@click.option("--prefix-len", default=1000, show_default=True, type=click.IntRange(32, 10**6))
@click.option("--suffix-len", default=32, show_default=True, type=click.IntRange(1, 10**6))
@click.option("--num-prefixes", default=10, show_default=True, type=click.IntRange(1, 10**5))
@click.option("--num-prompts", default=24, show_default=True, type=click.IntRange(1, 10**6))
@click.option("--output-len", default=16, show_default=True, type=click.IntRange(1, 10**5))
@click.option("--documents", default=10, show_default=True, type=click.IntRange(1, 10**4))
@click.option("--doc-tokens", default=1000, show_default=True, type=click.IntRange(32, 10**6))
@click.option("--questions", default=2, show_default=True, type=click.IntRange(1, 1000),
              help="Questions per document in the doc_qa query round.")
@click.option("--no-reuse-prompts", default=8, show_default=True, type=click.IntRange(1, 10**6))
@click.option("--kv-fraction", default=0.5, show_default=True, type=float,
              help="vLLM's KV cache as a fraction of the reused working set (never below the "
                   "requests in flight at max_model_len each).")
@click.option("--capacity", default="8G", show_default=True, help="kvstore's store capacity.")
@click.option("--restart-all", is_flag=True, help="Run the restart phase for every system, not only kvstore.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]),
              help="The dtype the servers run the model in (float32 computes several times faster on "
                   "a CPU without bf16 instructions).")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 20),
              help="Run the systems this many times, interleaved (vllm, kvstore, ..., vllm, kvstore, "
                   "...; each round on new stores), and report every number's median: one phase "
                   "of a few seconds moves by 10% between identical runs on a small host.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Where stores and server logs live (default: a temporary directory).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_serve(systems, workloads, model, python, concurrency, prefix_len, suffix_len, num_prefixes,
                num_prompts, output_len, documents, doc_tokens, questions, no_reuse_prompts, kv_fraction,
                capacity, restart_all, dtype, rounds, directory, plot_path, as_json):
    """A real `vllm serve` under concurrent load past its KV cache: vLLM alone, with kvstore, the ceiling."""
    from kvstore.bench import serve_bench
    say = (lambda *a: click.echo(*a, err=True)) if as_json else click.echo
    split = lambda x: [p.strip() for p in x.split(",") if p.strip()] if x else None   # noqa: E731
    try:
        out = serve_bench.run(model=model, python=python, systems=split(systems), workloads=split(workloads),
                              concurrency=concurrency, prefix_len=prefix_len, suffix_len=suffix_len,
                              num_prefixes=num_prefixes, num_prompts=num_prompts, output_len=output_len,
                              documents=documents, doc_tokens=doc_tokens, questions=questions,
                              no_reuse_prompts=no_reuse_prompts, kv_fraction=kv_fraction, capacity=capacity,
                              restart_all=restart_all, rounds=rounds, dtype=dtype,
                              directory=directory, say=say)
    except (KVStoreError, OSError, RuntimeError) as exc:
        _fail(exc)
    click.echo(json.dumps(out, indent=2) if as_json else serve_bench.format_table(out))
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo(f"--plot {plot_path}: matplotlib is not installed; no plot (the results are above)", err=True)
            return
        try:
            serve_bench.plot(out, plot_path)
        except OSError as exc:
            _fail(f"--plot {plot_path}: cannot write the chart ({exc}); the results are above")


@bench.command("soak")
@click.option("--requests", default=20000, show_default=True, type=click.IntRange(1, 10**7))
@click.option("--interval", default=2000, show_default=True, type=click.IntRange(1, 10**7))
@click.option("--capacity", default="16M", show_default=True, help="Store capacity (far below the working set).")
@click.option("--second-sight", "second_sight", is_flag=True,
              help="Run the workload twice (same seed), with admission off and with "
                   "\"admission\": \"second_sight\", and report bytes written and hit rate side by side.")
@click.option("--admission-window", default=None, type=click.IntRange(16, 1 << 28),
              help="admission_window of the second-sight run (default: the connector's).")
@click.option("--seed", default=11, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
def bench_soak(requests, interval, capacity, second_sight, admission_window, seed, as_json):
    """A long replay with constant eviction: memory, fds and pins must stay flat."""
    from kvstore.bench import soak_bench
    echo = (lambda *a: None) if as_json else click.echo
    try:
        if second_sight:
            out = soak_bench.compare_admission(requests=requests, interval=interval,
                                               capacity=capacity, seed=seed,
                                               admission_window=admission_window, out=echo)
        else:
            out = soak_bench.run(requests=requests, interval=interval, capacity=capacity,
                                 seed=seed, out=echo)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    elif second_sight:
        click.echo(f"second_sight writes {100 * out['bytes_written_ratio']:.0f}% of the bytes; disk "
                   f"hit rate {100 * out['disk_hit_rate_delta']:+.1f} points")
        for adm, r in out["runs"].items():
            click.echo(f"verdict ({adm}): " + ", ".join(
                f"{k}={'yes' if ok else 'NO'}" for k, ok in r["verdict"].items()))
    else:
        v = out["verdict"]
        click.echo(f"{out['requests']} requests in {out['seconds']:.0f} s ({out['req_per_s']:.0f} req/s); "
                   f"RSS growth over the second half {out['rss_growth_mb_second_half']:+.1f} MiB, "
                   f"fd growth {out['fd_growth_second_half']:+d}, pinned at end {out['final_pinned']}")
        click.echo("verdict: " + ", ".join(f"{k}={'yes' if ok else 'NO'}" for k, ok in v.items()))
    if not out["ok"]:
        sys.exit(1)


@main.command()
@click.option("--store", type=click.Path(file_okay=False), default=None,
              help="Keep the store in this directory (default: a temporary one, removed after).")
@click.option("--capacity", default="4G", show_default=True, help="Store capacity when creating it.")
@click.option("--model", default="demo", show_default=True,
              help="'demo' (about 175M parameters, made here on first use), 'tiny', their "
                   "Gemma 2 versions 'demo-gemma2' and 'tiny-gemma2' (a sliding window on every "
                   "other layer: a hybrid model), or a model directory made by kvstore.")
@click.option("--python", "python", default=None,
              help="Python whose vLLM serves (default: this one if its vLLM runs here, else "
                   ".venv-engine from `make engine`).")
@click.option("--documents", default=2, show_default=True, type=click.IntRange(0, 100))
@click.option("--doc-tokens", default=3000, show_default=True, type=click.IntRange(32, 100000))
@click.option("--sessions", default=3, show_default=True, type=click.IntRange(0, 100),
              help="Multi-turn chat sessions.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 256),
              help="Requests in flight (each chat and each document is a lane; lanes run side by side).")
@click.option("--sequential", is_flag=True, help="One request at a time (same as --concurrency 1).")
@click.option("--simulated", is_flag=True,
              help="The scheduler-level replay instead (vLLM's scheduler with a stand-in model runner; "
                   "checks every loaded block byte for byte).")
@click.option("--json", "as_json", is_flag=True)
def demo(store, capacity, model, python, documents, doc_tokens, sessions, concurrency, sequential, simulated,
         as_json):
    """Serve chats + shared documents with a real `vllm serve`, restart it, replay: hits from disk.

    On vLLM's CPU build each server gets the core reservation that measured fastest for
    the model (VLLM_CPU_NUM_OF_RESERVED_CPU: 0 on a host of 2 cores or fewer, where the
    forward is the work; else 1), unless the environment sets it."""
    if simulated:
        from kvstore.drivers import demo_simulated as sim
        try:
            out = sim.run(store=store, capacity=capacity)
        except (KVStoreError, OSError) as exc:
            _fail(exc)
        click.echo(json.dumps(out, indent=2) if as_json else sim.format_report(out))
        if out["blocks_mismatched"]:
            sys.exit(1)
        return
    from kvstore.drivers import demo as demo_mod
    say = (lambda *a: click.echo(*a, err=True)) if as_json else click.echo
    try:
        out = demo_mod.run(store=store, capacity=capacity, model=model, python=python,
                           documents=documents, doc_tokens=doc_tokens, sessions=sessions,
                           concurrency=1 if sequential else concurrency, say=say)
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(json.dumps(demo_mod.to_json(out), indent=2) if as_json else demo_mod.format_report(out))
    if not out["identical"] or out["after_restart"]["disk_hit_tokens"] <= 0:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
