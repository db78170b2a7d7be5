"""The model identity of a store: which weights and settings produced its KV.

Two engines with the same model *name*, dtype and geometry (`Layout`) still produce other
KV when the weights differ (a fine-tune or a new revision written where the old one was),
when `config.json` differs (RoPE scaling, sliding window) or when vLLM is told to read the
checkpoint differently (`--revision`, `--quantization`, `--hf-overrides`, `--dtype`). The
identity records each of these as a short string; a store remembers the identity of the
engine that created it (`kvstore.json`, "model_identity") and an engine whose identity
differs never gets that store's blocks (`kvstore.store.disk.ensure_store`).

How the weights are identified, without reading a 140 GB checkpoint:

- a Hugging Face hub snapshot (a hub name found in the local cache, or a directory
  `.../models--org--name/snapshots/<commit>`): the commit, which names every byte;
- a local directory: `sha256:` of a sample of every weight file: its relative path and
  size, a safetensors file's whole header (names, shapes, dtypes, offsets), and of every
  tensor its first and last 4 KiB page plus one page per 64 MiB in between (tensors of up
  to 16 KiB whole). A fine-tune changes every tensor it trains throughout, so it changes
  the sample; a 70B checkpoint costs a few thousand 4 KiB reads. Other weight formats
  (.bin, .pt, .gguf, ...) are sampled the same way over the whole file.
- anything else (a hub name not in the local cache, a remote URL): `name:` the name and
  revision only, which cannot tell new weights under the same name apart (logged at start).

Never imports vLLM: the offline tools (`kvstore fsck --model`, `kvstore info`) use it too.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import asdict, dataclass, fields

from kvstore.errors import ConfigError

PAGE = 4096
WHOLE_TENSOR_BYTES = 4 * PAGE    # tensors up to this size are hashed whole
PAGE_EVERY = 64 << 20            # one more sampled page per this many bytes of a tensor
MAX_PAGES_PER_TENSOR = 64
MAX_SAFETENSORS_HEADER = 100 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5",
                   ".msgpack", ".npz", ".pkl")
# The checkpoint's own settings that change the KV a token sequence produces.
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "quant_config.json",
                "hf_quant_config.json")
UNSET = "-"
# The fields, causes first: a refusal or a reset names the first that differs.
IDENTITY_ORDER = ("weights", "config", "revision", "quantization", "hf_overrides", "model_dtype")


@dataclass(frozen=True)
class ModelIdentity:
    """What produced a store's KV besides its `Layout` (module docstring). Every field is
    a short string; UNSET ("-") where the engine sets nothing."""

    weights: str                 # "hf:<commit>", "sha256:<hex>" or "name:<model>[@rev]"
    config: str = UNSET          # "sha256:<hex>" of the checkpoint's config files
    revision: str = UNSET        # --revision
    quantization: str = UNSET    # --quantization
    hf_overrides: str = UNSET    # --hf-overrides (canonical JSON)
    model_dtype: str = UNSET     # --dtype as resolved (the model's compute dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "ModelIdentity":
        if not isinstance(d, dict):
            raise ConfigError(f"model_identity must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        bad = [k for k, v in d.items() if k not in names or not isinstance(v, str)]
        if bad or "weights" not in d:
            raise ConfigError(f"model_identity has unknown or malformed fields {sorted(bad)} "
                              f"(expected strings {sorted(names)})")
        return cls(**d)

    def differences(self, other: "ModelIdentity") -> list[tuple[str, str, str]]:
        """Every differing field as (name, ours, theirs), causes first."""
        return [(n, getattr(self, n), getattr(other, n)) for n in IDENTITY_ORDER
                if getattr(self, n) != getattr(other, n)]

    @property
    def verifiable(self) -> bool:
        """False when the weights are known by name only (new weights under the same name
        cannot be told apart)."""
        return not self.weights.startswith("name:")

    def describe(self) -> str:
        return ", ".join(f"{n}={getattr(self, n)}" for n in IDENTITY_ORDER
                         if getattr(self, n) != UNSET)


def describe_differences(diffs) -> str:
    """'weights sha256:ab.. -> sha256:cd..; config ...' for logs and errors."""
    return "; ".join(f"{n} {old} -> {new}" for n, old, new in diffs)


# -- the weights ------------------------------------------------------------------------

def _pages(f, start: int, n: int, h) -> None:
    """Hash a sample of bytes [start, start + n) of open file `f` into `h`."""
    if n <= WHOLE_TENSOR_BYTES:
        h.update(os.pread(f, n, start))
        return
    k = min(MAX_PAGES_PER_TENSOR - 2, n // PAGE_EVERY)
    offs = [start, start + n - PAGE]
    offs += [start + (n - PAGE) * (i + 1) // (k + 1) // PAGE * PAGE for i in range(k)]
    for off in sorted(offs):
        h.update(os.pread(f, PAGE, off))


def _safetensors_sample(f, size: int, h) -> bool:
    """Sample a safetensors file tensor by tensor; False if it is not one."""
    head = os.pread(f, 8, 0)
    if len(head) < 8:
        return False
    (hlen,) = struct.unpack("<Q", head)
    if not 2 <= hlen <= min(MAX_SAFETENSORS_HEADER, size - 8):
        return False
    raw = os.pread(f, hlen, 8)
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(meta, dict):
        return False
    h.update(raw)
    spans = []
    for name, t in meta.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        off = t.get("data_offsets")
        if (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off)
                and 0 <= off[0] <= off[1] <= size - 8 - hlen):
            spans.append((off[0], off[1]))
    for a, b in sorted(spans):
        if b > a:
            _pages(f, 8 + hlen + a, b - a, h)
    return True


def _weight_files(model_dir: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(model_dir, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES) and not name.startswith("."):
                out.append(os.path.relpath(os.path.join(root, name), model_dir))
    return sorted(out)


def weights_digest(model_dir: str) -> tuple[str, int, int]:
    """("sha256:<hex>", files, bytes) of a sample of every weight file under `model_dir`
    (module docstring); ("none", 0, 0) for a directory without weight files."""
    files = _weight_files(model_dir)
    if not files:
        return "none", 0, 0
    h = hashlib.sha256()
    total = 0
    for rel in files:
        path = os.path.join(model_dir, rel)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)   # (hub snapshots are symlinks)
        try:
            size = os.fstat(fd).st_size
            total += size
            h.update(f"{rel}\0{size}\0".encode())
            if not (rel.endswith(".safetensors") and _safetensors_sample(fd, size, h)):
                _pages(fd, 0, size, h)
        finally:
            os.close(fd)
    return "sha256:" + h.hexdigest()[:32], len(files), total


def config_digest(model_dir: str) -> str:
    """"sha256:<hex>" of the checkpoint's config files (CONFIG_FILES, parsed and written
    back canonically, so whitespace and key order do not count), UNSET if it has none."""
    h = hashlib.sha256()
    found = False
    for name in CONFIG_FILES:
        p = os.path.join(model_dir, name)
        if not os.path.isfile(p):
            continue
        found = True
        with open(p, "rb") as fh:
            raw = fh.read(16 << 20)
        try:
            raw = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        except (ValueError, UnicodeDecodeError):
            pass
        h.update(name.encode() + b"\0" + raw + b"\0")
    return "sha256:" + h.hexdigest()[:32] if found else UNSET


_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_cache_dir() -> str:
    """Where Hugging Face keeps downloaded snapshots (HF_HUB_CACHE, HF_HOME/hub, or
    ~/.cache/huggingface/hub), as `huggingface_hub` resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(home, "hub")


def snapshot_commit(model_dir: str) -> str | None:
    """The commit of a hub snapshot directory (.../models--org--name/snapshots/<commit>)."""
    real = os.path.normpath(model_dir)
    parent, commit = os.path.split(real)
    repo, snaps = os.path.split(parent)
    if snaps == "snapshots" and os.path.basename(repo).startswith("models--") \
            and _COMMIT.fullmatch(commit):
        return commit
    return None


def resolve_hub(name: str, revision: str | None) -> tuple[str, str] | None:
    """(snapshot directory, commit) of a hub model in the local cache, or None."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return None
    repo = os.path.join(hub_cache_dir(), "models--" + name.replace("/", "--"))
    rev = revision or "main"
    commit = rev if _COMMIT.fullmatch(rev) else None
    if commit is None:
        try:
            with open(os.path.join(repo, "refs", rev)) as f:
                commit = f.read().strip()
        except OSError:
            return None
    snap = os.path.join(repo, "snapshots", commit)
    return (snap, commit) if _COMMIT.fullmatch(commit) and os.path.isdir(snap) else None


def _setting(value) -> str:
    if value is None or value == {} or value == "":
        return UNSET
    if callable(value):
        return f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return str(value)


def model_identity(model: str, *, revision=None, quantization=None, hf_overrides=None,
                   model_dtype=None) -> tuple[ModelIdentity, str]:
    """The identity of `model` (a directory or a hub name) with vLLM's settings, and a
    short note on how the weights were identified (for the start-up log)."""
    model = str(model)
    snap = None
    if os.path.isdir(model):
        snap = model
        commit = snapshot_commit(model)
    else:
        hub = resolve_hub(model, revision)
        snap, commit = hub if hub else (None, None)
    if commit is not None:
        weights, how = f"hf:{commit}", f"hub snapshot {commit}"
    elif snap is not None:
        weights, nfiles, nbytes = weights_digest(snap)
        how = (f"a sample of {nfiles} weight file(s), {nbytes / (1 << 30):.2f} GiB" if nfiles
               else "no weight files in the directory")
    else:
        weights = f"name:{model}" + (f"@{revision}" if revision else "")
        how = ("by name only: neither a directory nor a hub snapshot in the local cache, so "
               "new weights under this name cannot be told apart")
    ident = ModelIdentity(
        weights=weights,
        config=config_digest(snap) if snap is not None else UNSET,
        revision=_setting(revision),
        quantization=_setting(quantization),
        hf_overrides=_setting(hf_overrides),
        model_dtype=_setting(model_dtype).replace("torch.", ""),
    )
    return ident, how
