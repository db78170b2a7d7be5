"""The `kvstore` command line: info, fsck, warmup, bench, demo.

Built on click (subcommands, typed options, generated --help) rather than argparse
plumbing. Tools go through the engine API (`kvstore.engine.DiskStore`), never around it.
Errors a user can act on are printed as one line on stderr with exit status 1 (fsck has
its own e2fsck-style codes).
"""
from __future__ import annotations

import json
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
    """kvstore: a persistent NVMe disk tier for vLLM's KV cache."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


@main.group()
def bench():
    """Benchmarks that print a table (and --json)."""


@bench.command("io")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Directory on the device to measure (default: a temporary directory).")
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


@bench.command("index")
@click.option("--entries", default="100000,1000000,10000000", show_default=True,
              help="Comma-separated index sizes.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_index(entries, directory, as_json):
    """LMDB index: prefix lookups, lookups/s, commits with evictions, open time."""
    from kvstore.bench import index_bench
    try:
        sizes = [int(x) for x in entries.split(",") if x.strip()]
    except ValueError:
        _fail(KVStoreError(f"--entries must be comma-separated integers, got {entries!r}"))
    out = index_bench.run(sizes, as_json, directory)
    if as_json:
        click.echo(json.dumps(out, indent=2))


if __name__ == "__main__":  # pragma: no cover
    main()
