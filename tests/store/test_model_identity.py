"""Model identity: the weights digest, and what a store of another model gets at open
(`ensure_store`: re-initialised, or refused), for single- and multi-directory stores; the
offline tools (`kvstore info`, `kvstore fsck --model`, `kvstore warmup --from-store`)."""
import json
import logging
import os
import shutil
import struct

import numpy as np
import pytest

from kvstore import LayoutMismatch, StoreLocked
from kvstore.format.identity import ModelIdentity, model_identity, weights_digest
from kvstore.format.layout import Layout, read_fingerprint, stored_identity
from kvstore.store.disk import DiskStore, ensure_store
from kvstore.tools import fsck as fsck_mod
from kvstore.tools import info as info_mod
from kvstore.tools.warmup import warmup

BB = 4096
LAYOUT = Layout(model="tiny", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                num_kv_heads=2, head_dim=16)
CAP = 64 * (BB + 4096)


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file (the format's header + raw little-endian data)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": "F16", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_model(d, seed: int, *, rope_theta: float = 10000.0, big: int = 1 << 20) -> str:
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(os.path.join(d, "model.safetensors"), {
        "embed": rng.standard_normal(big // 2).astype(np.float16),     # sampled
        "norm": rng.standard_normal(64).astype(np.float16),           # hashed whole
    })
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "rope_theta": rope_theta}, f)
    return str(d)


def ident(model_dir, **kw) -> ModelIdentity:
    return model_identity(model_dir, **kw)[0]


def fill(path, n=5):
    with DiskStore(path, LAYOUT, io=True) as st:
        ks = [b"k%04d" % i for i in range(n)]
        st.put(ks, lambda i, r: np.full(BB, i + 1, np.uint8))
        return st.stats()["used_slots"]


# -- the digest ---------------------------------------------------------------------------

def test_weights_digest_follows_values_not_paths(tmp_path):
    a = make_model(tmp_path / "a", 1)
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    assert ident(a) == ident(b)                     # a copy (moved checkpoint): the same
    c = make_model(tmp_path / "c", 2)               # same names and shapes, other values
    assert ident(a).weights != ident(c).weights
    assert ident(a).config == ident(c).config
    d = make_model(tmp_path / "d", 1, rope_theta=500000.0)
    assert ident(a).weights == ident(d).weights and ident(a).config != ident(d).config
    assert weights_digest(str(tmp_path / "a"))[1:] == (1, os.path.getsize(f"{a}/model.safetensors"))


def test_digest_sees_a_change_in_one_small_tensor_and_in_a_large_ones_middle(tmp_path):
    a = make_model(tmp_path / "a", 1, big=64 << 20)
    base = ident(a).weights
    p = f"{a}/model.safetensors"
    (hlen,) = struct.unpack("<Q", open(p, "rb").read(8))
    meta = json.loads(open(p, "rb").read(8 + hlen)[8:])
    for name, at in (("norm", 10), ("embed", None)):
        lo, hi = meta[name]["data_offsets"]
        # (the embed tensor's one middle page: halfway, page-aligned from its start)
        off = 8 + hlen + lo + (at if at is not None else (hi - lo - 4096) // 2 // 4096 * 4096)
        with open(p, "r+b") as f:
            f.seek(off)
            old = f.read(2)
            f.seek(off)
            f.write(bytes(x ^ 0xFF for x in old))
        assert ident(a).weights != base, name
        base = ident(a).weights


def test_settings_and_unresolvable_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    a = make_model(tmp_path / "a", 1)
    assert ident(a, quantization="fp8").differences(ident(a))[0][0] == "quantization"
    assert ident(a, hf_overrides={"rope_theta": 1.0}).hf_overrides == '{"rope_theta":1.0}'
    named = ident("org/not-cached")
    assert named.weights == "name:org/not-cached" and not named.verifiable
    # a hub snapshot in the local cache: its commit
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / commit
    make_model(snap, 3)
    os.makedirs(tmp_path / "hub" / "models--org--m" / "refs")
    (tmp_path / "hub" / "models--org--m" / "refs" / "main").write_text(commit)
    assert ident("org/m").weights == f"hf:{commit}" == ident(str(snap)).weights


# -- at open ------------------------------------------------------------------------------

def test_changed_weights_reset_the_store_and_log_what_changed(tmp_path, caplog):
    m = make_model(tmp_path / "m", 1)
    path = str(tmp_path / "s")
    ensure_store(path, LAYOUT, CAP, identity=ident(m))
    assert fill(path) == 5
    ensure_store(path, LAYOUT, CAP, identity=ident(m))      # same model: kept
    with DiskStore(path, LAYOUT) as st:
        assert st.stats()["used_slots"] == 5
    make_model(tmp_path / "m", 2)                          # new weights, same name
    with caplog.at_level(logging.WARNING, logger="kvstore.store.disk"):
        ensure_store(path, LAYOUT, CAP, identity=ident(m))
    msg = caplog.text
    assert "re-initialised" in msg and "5 block(s) dropped" in msg and "weights sha256:" in msg
    with DiskStore(path, LAYOUT, io=True) as st:
        assert st.stats()["used_slots"] == 0
        assert st.get([b"k0000"]) == {}
    assert stored_identity(read_fingerprint(path)[2]) == ident(m)
    # the old blocks are gone from the slot files too: a rebuild of the index finds none
    rep = fsck_mod.fsck(path, rebuild_index=True)
    assert rep.stats.get("rebuilt_entries") == 0, fsck_mod.format_text(rep)


def test_refuse_names_the_field(tmp_path):
    m = make_model(tmp_path / "m", 1)
    path = str(tmp_path / "s")
    ensure_store(path, LAYOUT, CAP, identity=ident(m))
    fill(path)
    with pytest.raises(LayoutMismatch, match="holds KV of another model: config") as ei:
        ensure_store(path, LAYOUT, CAP, identity=ident(make_model(tmp_path / "m", 1, rope_theta=1.0)),
                     on_model_change="refuse")
    assert ei.value.field == "model_identity.config"
    with DiskStore(path, LAYOUT) as st:                     # nothing lost
        assert st.stats()["used_slots"] == 5


def test_store_without_identity_is_not_trusted(tmp_path):
    path = str(tmp_path / "s")
    DiskStore.create(path, LAYOUT, CAP).close()            # a tool's store: no identity
    fill(path)
    m = make_model(tmp_path / "m", 1)
    with pytest.raises(LayoutMismatch, match="model_identity unrecorded"):
        ensure_store(path, LAYOUT, identity=ident(m), on_model_change="refuse")
    ensure_store(path, LAYOUT, identity=ident(m))
    with DiskStore(path, LAYOUT) as st:
        assert st.stats()["used_slots"] == 0


def test_an_attached_engine_of_the_old_model_is_never_reset_under(tmp_path):
    path = str(tmp_path / "s")
    ensure_store(path, LAYOUT, CAP, identity=ident(make_model(tmp_path / "a", 1)))
    fill(path)
    with DiskStore(path, LAYOUT):                           # an engine serving model a
        with pytest.raises(StoreLocked, match="two models on one path are refused"):
            ensure_store(path, LAYOUT, CAP, identity=ident(make_model(tmp_path / "b", 2)))
    with DiskStore(path, LAYOUT) as st:
        assert st.stats()["used_slots"] == 5


def test_reset_of_a_store_over_several_data_directories(tmp_path):
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    for d in dirs:
        os.mkdir(d)
    path = str(tmp_path / "s")
    m = make_model(tmp_path / "m", 1)
    ensure_store(path, LAYOUT, CAP, identity=ident(m), data_dirs=dirs, io_mode="page_cache")
    with DiskStore(path, LAYOUT, io=True, io_mode="page_cache") as st:
        st.put([b"a", b"b", b"c"], lambda i, r: np.full(BB, 7, np.uint8))
    make_model(tmp_path / "m", 2)
    ensure_store(path, LAYOUT, CAP, identity=ident(m), data_dirs=dirs, io_mode="page_cache")
    with DiskStore(path, LAYOUT, io=True, io_mode="page_cache") as st:
        assert st.stats()["used_slots"] == 0
        assert st.put([b"a"], lambda i, r: np.full(BB, 9, np.uint8)) == [b"a"]
        assert st.get([b"a"])[b"a"][0][0] == 9
    assert read_fingerprint(path)[2]["data_dirs"] == dirs


def test_info_and_fsck_show_the_identity(tmp_path):
    m = make_model(tmp_path / "m", 1)
    path = str(tmp_path / "s")
    ensure_store(path, LAYOUT, CAP, identity=ident(m))
    out = info_mod.gather(path)
    assert out["model_identity"]["weights"] == ident(m).weights
    assert "identity      weights=sha256:" in info_mod.format_text(out)
    assert fsck_mod.fsck(path, model=m).exit_code == 0
    make_model(tmp_path / "m", 2)
    rep = fsck_mod.fsck(path, model=m)
    assert [f.kind for f in rep.findings] == ["model_changed"]
    assert rep.exit_code == fsck_mod.EXIT_UNCORRECTED
    assert "weights sha256:" in fsck_mod.format_text(rep)


def test_warmup_from_store_keeps_the_identity_and_refuses_another_models_store(tmp_path):
    a, b = make_model(tmp_path / "a", 1), make_model(tmp_path / "b", 2)
    src, dst, other = (str(tmp_path / n) for n in ("src", "dst", "other"))
    ensure_store(src, LAYOUT, CAP, identity=ident(a))
    fill(src)
    warmup(dst, None, from_store=src, all_blocks=True)
    assert stored_identity(read_fingerprint(dst)[2]) == ident(a)
    ensure_store(dst, LAYOUT, identity=ident(a))            # the engine keeps the copy
    with DiskStore(dst, LAYOUT) as st:
        assert st.stats()["used_slots"] == 5
    ensure_store(other, LAYOUT, CAP, identity=ident(b))
    with pytest.raises(LayoutMismatch, match="refusing to copy"):
        warmup(other, None, from_store=src, all_blocks=True)
