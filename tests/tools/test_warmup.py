"""kvstore warmup: key derivation against vLLM, prompt formats, copying from a store.

Source stores are filled with the blocks of real prompts keyed by `prompt_block_keys`
(the same derivation the connector uses); warm-up must copy exactly those blocks,
byte-exact and verified, skip what is present, resume after an interrupt, never evict
existing entries unless told to, and keep the source's hotness order with --all.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from kvstore.store import shared
from kvstore.cli import main
from kvstore.store.disk import DiskStore, WriterLock, slot_file_path
from kvstore.errors import ConfigError, LayoutMismatch, StoreLocked
from kvstore.format.layout import Layout
from kvstore.tools import warmup as W
from kvstore.vllm.keys import prompt_block_keys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BS = 16           # tokens per block
BLOCK = 8192
SLOT = 4096 + BLOCK


def layout(tp=1, **kw):
    d = dict(model="tiny", dtype="float16", block_size=BS, block_bytes=BLOCK, num_layers=2,
             num_kv_heads=2, head_dim=16, tp_size=tp)
    d.update(kw)
    return Layout(**d)


def payload_of(k: bytes, rank: int) -> np.ndarray:
    """Deterministic KV stand-in: a pure function of the block key and rank."""
    seed = int.from_bytes(k[:8], "little") ^ (rank * 0x9E3779B9)
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def prompts(n=12, seed=0, shared_prefix=48):
    rng = random.Random(seed)
    system = [rng.randrange(5, 30000) for _ in range(shared_prefix)]  # a shared system prompt
    return [system + [rng.randrange(5, 30000) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


def write_jsonl(path, plist, field="prompt_token_ids"):
    with open(path, "w") as f:
        for p in plist:
            f.write(json.dumps({field: p}) + "\n")
    return str(path)


def make_src(path, plist, cap=200, tp=1, lay=None):
    lay = lay or layout(tp)
    with DiskStore.create(str(path), lay, cap * SLOT * lay.tp_size, io=True, staging_bytes=1 << 20) as st:
        for ids in plist:
            ks = prompt_block_keys(ids, BS)
            st.put(ks, lambda i, r, ks=ks: payload_of(ks[i], r))
    return str(path)


def make_dst(path, cap=200, tp=1, lay=None):
    lay = lay or layout(tp)
    DiskStore.create(str(path), lay, cap * SLOT * lay.tp_size).close()
    return str(path)


def all_keys(plist):
    return list(dict.fromkeys(k for p in plist for k in prompt_block_keys(p, BS)))


def check_dst(path, keys, tp=1):
    """Every key served byte-exact from the destination."""
    with DiskStore(path, io=True, staging_bytes=1 << 20) as st:
        assert st.index.check_consistency() == []
        for k in keys:
            got = st.get([k], touch=False)
            assert k in got, k.hex()
            assert [bytes(x) for x in got[k]] == [payload_of(k, r).tobytes() for r in range(tp)]


# ------------------------------------------------------------------ keys

def test_keys_match_vllm_request_block_hashes():
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from kvstore.vllm.config import block_key   # what the connector stores and looks up
    init_none_hash(sha256)
    ids = prompts(1)[0] + list(range(100, 140))
    for salt in (None, "tenant-a"):
        req = Request("r", ids, SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(BS, sha256))
        mine = prompt_block_keys(ids, BS, cache_salt=salt)
        assert len(mine) == len(ids) // BS == len(req.block_hashes)
        assert mine == [block_key(h) for h in req.block_hashes]
        assert mine == [make_block_hash_with_group_id(h, 0) for h in req.block_hashes]
        assert prompt_block_keys(ids, BS, group=3, cache_salt=salt) == [
            block_key(h, 3) for h in req.block_hashes]
    assert prompt_block_keys(ids, BS)[0] != prompt_block_keys(ids, BS, cache_salt="x")[0]
    assert prompt_block_keys(ids[:BS - 1], BS) == []
    with pytest.raises(ConfigError):
        prompt_block_keys(ids, BS, group=-1)


# ------------------------------------------------------------------ input formats

def test_read_prompts_formats(tmp_path):
    t = tmp_path / "p.txt"
    t.write_text("hello world\n\n{not json but text\nw1 w2\n")
    items = W.read_prompts(str(t))
    assert [i.text for i in items] == ["hello world", "{not json but text", "w1 w2"]
    assert [i.line for i in items] == [1, 3, 4]
    j = tmp_path / "p.jsonl"
    j.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "hello"}, {"prompt": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}, {"token_ids": [6]},
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"}, [7, 8, 9]]) + "\n")
    items = W.read_prompts(str(j))
    assert items[0].text == "hello" and items[1].token_ids == [1, 2, 3] and items[2].token_ids == [4, 5]
    assert items[3].token_ids == [6] and items[4].messages[0]["content"] == "hi"
    assert items[4].cache_salt == "s" and items[5].token_ids == [7, 8, 9]
    tok = tmp_path / "t.txt"
    tok.write_text("[1, 2]\n[3]\n")
    assert [i.token_ids for i in W.read_prompts(str(tok), "tokens")] == [[1, 2], [3]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1]}\n{"nothing": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: no prompt"):
        W.read_prompts(str(bad))
    bad.write_text('{"prompt": [1, -2]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: token ids"):
        W.read_prompts(str(bad))
    bad.write_text('{"prompt": [1]}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        W.read_prompts(str(bad), "jsonl")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny local HF tokenizer (word level) with a chat template, in a model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from kvstore.drivers.simulator import write_model_dir
    d = tmp_path_factory.mktemp("tok")
    write_model_dir(d)
    words = ["<s>", "</s>", "<unk>", "system", "user", "assistant", ":"] + [f"w{i}" for i in range(200)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(str(d))
    return str(d)


def test_text_and_chat_prompts_through_tokenizer(tmp_path, tokenizer_dir):
    text = " ".join(f"w{i}" for i in range(40))
    chat = [{"role": "system", "content": " ".join(f"w{i}" for i in range(60, 100))},
            {"role": "user", "content": "w1 w2 w3"}]
    tok = W._Tokenizer(tokenizer_dir)
    text_ids = tok.ids(W.PromptItem(1, text=text))
    chat_ids = tok.ids(W.PromptItem(2, messages=chat))
    # completions: BOS + words; chat: the template's rendering, no second BOS
    assert text_ids == [0] + [7 + i for i in range(40)]
    assert chat_ids[:4] == [0, 3, 6, 7 + 60] and chat_ids[-2:] == [5, 6] and chat_ids.count(0) == 1
    src = make_src(tmp_path / "src", [text_ids, chat_ids])
    dst = make_dst(tmp_path / "dst")
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": text}) + "\n" + json.dumps({"messages": chat}) + "\n")
    sm = W.warmup(dst, str(pf), from_store=src, tokenizer=tokenizer_dir)
    want = all_keys([text_ids, chat_ids])
    assert sm.blocks_written == len(want) and sm.tokens == len(text_ids) + len(chat_ids)
    check_dst(dst, want)
    # text prompts without a tokenizer: a clear error
    with pytest.raises(ConfigError, match="--tokenizer"):
        W.warmup(make_dst(tmp_path / "d2"), str(pf), from_store=src)


# ------------------------------------------------------------------ from a store

def test_from_store_copies_verifies_and_resumes(tmp_path):
    plist = prompts(12)
    src = make_src(tmp_path / "src", plist, tp=2)
    dst = make_dst(tmp_path / "dst", tp=2)
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    want = all_keys(plist)

    dry = W.warmup(dst, pf, from_store=src, dry_run=True)
    assert dry.dry_run and dry.blocks_written == len(want)
    assert dry.bytes_written == len(want) * BLOCK * 2
    with DiskStore(dst, readonly=True) as st:
        assert st.stats()["used_slots"] == 0          # dry run wrote nothing

    sm = W.warmup(dst, pf, from_store=src)
    assert sm.prompts == 12 and sm.blocks_written == len(want) and sm.stopped is None
    assert sm.blocks == len(want) and sm.blocks_present == 0   # shared blocks counted once
    check_dst(dst, want, tp=2)
    # the destination's LRU: first prompt hottest, each chain's head before its tail
    with DiskStore(dst, readonly=True) as st:
        hot = [e.key for e in st.index.iter_lru(hottest_first=True)]
    first = prompt_block_keys(plist[0], BS)
    assert hot[:len(first)] == first

    again = W.warmup(dst, pf, from_store=src)          # resumable: nothing left to do
    assert again.blocks_written == 0 and again.prompts_complete == 12
    assert again.blocks_present == len(want)


def test_interrupted_run_resumes(tmp_path):
    plist = prompts(10, seed=3)
    src = make_src(tmp_path / "src", plist)
    dst = make_dst(tmp_path / "dst")
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    calls = {"n": 0}

    class Boom:
        def __init__(self, *a):
            pass

        def update(self, n=1, **kw):
            calls["n"] += n
            if calls["n"] >= 4:
                raise KeyboardInterrupt

        def close(self):
            pass

    sm = W.warmup(dst, pf, from_store=src, progress=Boom, chunk_blocks=2)
    assert sm.stopped == "interrupted" and 0 < sm.blocks_written < len(all_keys(plist))
    with DiskStore(dst) as st:
        assert st.index.check_consistency() == [] and st.stats()["reserved_slots"] == 0
    rest = W.warmup(dst, pf, from_store=src)
    assert sm.blocks_written + rest.blocks_written == len(all_keys(plist))
    check_dst(dst, all_keys(plist))


def test_chain_stops_at_missing_or_corrupt_source_block(tmp_path):
    plist = prompts(2, seed=5, shared_prefix=0)
    plist = [p + list(range(100, 164)) for p in plist]
    k0, k1 = prompt_block_keys(plist[0], BS), prompt_block_keys(plist[1], BS)
    src = make_src(tmp_path / "src", plist)
    with DiskStore(src) as st:
        st.drop([k0[2]])                                  # a hole in prompt 0's chain
        e = st.lookup(k1[1])
    fd = os.open(slot_file_path(src, 0, 0), os.O_RDWR)   # a corrupt block in prompt 1's chain
    os.pwrite(fd, b"\xff\xff", e.slot * SLOT + 4096 + 77)
    os.close(fd)
    dst = make_dst(tmp_path / "dst")
    sm = W.warmup(dst, write_jsonl(tmp_path / "p.jsonl", plist), from_store=src)
    assert sm.blocks_written == 2 + 1
    assert sm.blocks_failed_verification == 1
    assert sm.blocks_not_in_source == 1                  # prompt 0's chain ends at the hole
    assert sm.blocks_after_break == (len(k0) - 3) + (len(k1) - 2)   # unreachable after a hole
    check_dst(dst, k0[:2] + k1[:1])
    with DiskStore(dst, readonly=True) as st:
        assert st.lookup(k1[1]) is None and st.lookup(k0[3]) is None


def test_full_store_never_evicts_unless_allowed(tmp_path):
    plist = prompts(8, seed=7, shared_prefix=0)
    want = all_keys(plist)
    src = make_src(tmp_path / "src", plist)
    dst = make_dst(tmp_path / "dst", cap=len(want) // 2 + 4)
    old = [b"old-entry-%02d" % i for i in range(4)]
    with DiskStore(dst, io=True, staging_bytes=1 << 20) as st:
        st.put(old, lambda i, r: payload_of(old[i], r))
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    sm = W.warmup(dst, pf, from_store=src)
    assert sm.stopped == "store full" and sm.blocks_no_space > 0 and sm.evictions == 0
    assert sm.blocks_written == len(want) // 2
    check_dst(dst, old)                                  # nothing existing was evicted
    sm2 = W.warmup(dst, pf, from_store=src, allow_evict_hotter=True)
    assert sm2.evictions == 4 and sm2.blocks_written == 4   # only the old entries made room
    with DiskStore(dst, readonly=True) as st:
        assert all(st.lookup(k) is None for k in old)
    # the first prompts (warmed first) are intact chains
    check_dst(dst, prompt_block_keys(plist[0], BS))
    r = CliRunner().invoke(main, ["warmup", dst, pf, "--from-store", src, "-q"])
    assert r.exit_code == 0 and "--allow-evict-hotter" in r.output


def test_all_copies_hottest_first_and_keeps_order(tmp_path):
    plist = prompts(6, seed=11)
    src = make_src(tmp_path / "src", plist)
    with DiskStore(src, io=True, staging_bytes=1 << 20) as st:
        st.get(prompt_block_keys(plist[3], BS))          # prompt 3 becomes the hottest
        src_order = [e.key for e in st.index.iter_lru(hottest_first=True)]
    dst = make_dst(tmp_path / "dst", cap=len(src_order) - 3)
    sm = W.warmup(dst, None, from_store=src, all_blocks=True, chunk_blocks=4)
    assert sm.blocks_written == len(src_order) - 3 and sm.stopped == "store full"
    with DiskStore(dst, readonly=True) as st:
        dst_order = [e.key for e in st.index.iter_lru(hottest_first=True)]
    assert dst_order == src_order[:len(dst_order)]       # the hottest made it, in order
    check_dst(dst, dst_order)
    r = CliRunner().invoke(main, ["warmup", dst, "--from-store", src, "--all", "--json", "-q"])
    assert r.exit_code == 0 and json.loads(r.output)["blocks_present"] == len(dst_order)


def test_cli_json_and_errors(tmp_path):
    plist = prompts(4, seed=13)
    src = make_src(tmp_path / "src", plist)
    dst = make_dst(tmp_path / "dst")
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    r = CliRunner().invoke(main, ["warmup", dst, pf, "--from-store", src, "--dry-run", "--json", "-q"])
    assert r.exit_code == 0
    doc = json.loads(r.output)
    assert doc["dry_run"] and doc["blocks_written"] == len(all_keys(plist))
    r = CliRunner().invoke(main, ["warmup", dst, pf, "--from-store", src, "-q"])
    assert r.exit_code == 0 and f"wrote {len(all_keys(plist))}" in r.output
    # another layout
    other = make_dst(tmp_path / "other", lay=layout(dtype="bfloat16"))
    with pytest.raises(LayoutMismatch, match="dtype"):
        W.warmup(other, pf, from_store=src)
    # an offline repair holds the destination exclusively: refused, saying so (a dry run works)
    lock = WriterLock(dst)
    try:
        with pytest.raises(StoreLocked, match="offline repair"):
            W.warmup(dst, pf, from_store=src)
        r = CliRunner().invoke(main, ["warmup", dst, pf, "--from-store", src, "-q"])
        assert r.exit_code == 1 and "fsck --repair" in r.output and "--dry-run" in r.output
        assert W.warmup(dst, pf, from_store=src, dry_run=True).blocks_present == len(all_keys(plist))
    finally:
        lock.release()
    r = CliRunner().invoke(main, ["warmup", dst, pf])
    assert r.exit_code == 1 and "--from-store" in r.output


# An engine serving from the store in its own process: it stores blocks of its own, then
# answers each stdin line (a JSON list of hex keys) with what it reads for them
# ({key: [sha256 of each rank's bytes]} or null), through its own handle.
SERVING = textwrap.dedent(r"""
    import hashlib, json, sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from kvstore.store.disk import DiskStore
    st = DiskStore(sys.argv[1], io=True, staging_bytes=1 << 20)
    own = [b"own-block-%02d" % i for i in range(int(sys.argv[3]))]
    assert st.put(own, lambda i, r: np.full(8192, i + 1, np.uint8)) == own
    print("ready", flush=True)
    for line in sys.stdin:
        out = {}
        for h in json.loads(line):
            k = bytes.fromhex(h)
            got = st.get([k], touch=False)
            out[h] = [hashlib.sha256(bytes(b)).hexdigest() for b in got[k]] if k in got else None
        print(json.dumps(out), flush=True)
    st.close()
""")


def test_warmup_next_to_a_serving_engine(tmp_path, monkeypatch):
    """An engine process is attached to (and serving from) the destination: warmup
    attaches next to it (a lease of kind "warmup"), writes every block without evicting
    the engine's own, and the engine then reads the warmed blocks through its own
    handle, byte-exact on every rank. The --model path attaches to a served store the same
    way."""
    plist = prompts(10, seed=21)
    want = all_keys(plist)
    src = make_src(tmp_path / "src", plist, tp=2)
    dst = make_dst(tmp_path / "dst", cap=len(want) + 8, tp=2)
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    eng = subprocess.Popen([sys.executable, "-c", SERVING, dst, REPO, "6"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert eng.stdout.readline().strip() == "ready"
        seen = []

        def progress(desc, total, unit):   # called while warmup is attached: who is there?
            seen.append({(e.pid, e.kind) for e in shared.engines(dst) if e.alive})
            return None
        sm = W.warmup(dst, pf, from_store=src, progress=progress)
        assert seen and seen[0] == {(eng.pid, "engine"), (os.getpid(), "warmup")}
        assert sm.blocks_written == len(want) and sm.stopped is None and sm.evictions == 0
        assert [(e.pid, e.alive) for e in shared.engines(dst)] == [(eng.pid, True)]   # warmup left

        def ask(keys):
            eng.stdin.write(json.dumps([k.hex() for k in keys]) + "\n")
            eng.stdin.flush()
            return json.loads(eng.stdout.readline())
        got = ask(want)
        for k in want:
            assert got[k.hex()] == [hashlib.sha256(payload_of(k, r).tobytes()).hexdigest()
                                    for r in range(2)], k.hex()
        own = [b"own-block-%02d" % i for i in range(6)]
        assert all(v is not None for v in ask(own).values())      # nothing of the engine's evicted

        # a second run next to it: everything is there already
        again = W.warmup(dst, pf, from_store=src)
        assert again.blocks_written == 0 and again.blocks_present == len(want)

        # --model: no refusal for a served store; it goes on to start vLLM (stubbed here)
        class Started(Exception):
            pass

        def fake_engine(*a, **kw):
            raise Started
        monkeypatch.setattr(W, "_engine_runs_here", lambda: None)
        monkeypatch.setattr(W, "_engine", fake_engine)
        extra = write_jsonl(tmp_path / "x.jsonl", prompts(2, seed=99, shared_prefix=0))
        with pytest.raises(Started):
            W.warmup(dst, extra, model=str(tmp_path))
    finally:
        if eng.poll() is None:
            eng.stdin.close()
            eng.wait(30)
    assert eng.returncode == 0
    check_dst(dst, want, tp=2)


def test_model_refused_while_an_offline_repair_holds_the_store(tmp_path, monkeypatch):
    dst = make_dst(tmp_path / "dst")
    pf = write_jsonl(tmp_path / "p.jsonl", prompts(2))
    monkeypatch.setattr(W, "_engine_runs_here", lambda: None)
    monkeypatch.setattr(W, "_engine", lambda *a, **kw: pytest.fail("vLLM started during a repair"))
    lock = WriterLock(dst)
    try:
        with pytest.raises(StoreLocked, match="offline repair"):
            W.warmup(dst, pf, model=str(tmp_path))
    finally:
        lock.release()


def test_model_where_this_vllm_cannot_run_says_what_to_do(tmp_path):
    """This venv's vLLM is the CUDA build; without a GPU, --model names the CPU engine.
    (tests/e2e warms a store with the real CPU engine.)"""
    import torch
    dst = make_dst(tmp_path / "dst")
    pf = write_jsonl(tmp_path / "p.jsonl", prompts(1))
    r = CliRunner().invoke(main, ["warmup", dst, pf, "--model", str(tmp_path)])
    if torch.cuda.is_available():
        assert "cannot run here" not in r.output
        return
    assert r.exit_code == 1
    assert "cannot run here" in r.output and "make engine" in r.output and "--from-store" in r.output


def test_model_dry_run_plans_within_the_free_slots(tmp_path):
    """--model --dry-run needs no engine: it plans which prompts fit the free slots
    (the connector would evict otherwise) and writes nothing."""
    plist = prompts(6, seed=17, shared_prefix=32)
    want = all_keys(plist)
    dst = make_dst(tmp_path / "dst", cap=len(want) - 3)
    pf = write_jsonl(tmp_path / "p.jsonl", plist)
    dry = W.warmup(dst, pf, model=str(tmp_path), dry_run=True)
    assert dry.stopped == "store full" and dry.blocks_no_space > 0
    assert 0 < dry.blocks_written <= len(want) - 3
    with DiskStore(dst, readonly=True) as st:
        assert st.stats()["used_slots"] == 0
    with pytest.raises(ConfigError, match="does not exist yet"):
        W.warmup(str(tmp_path / "new"), pf, model=str(tmp_path), dry_run=True)


def test_all_into_a_new_store_creates_it_with_the_source_layout(tmp_path):
    """Seeding a new node is one command: NEW is created with the source's layout and
    (unless --capacity says otherwise) its capacity."""
    plist = prompts(4, seed=5)
    src = make_src(tmp_path / "src", plist)
    new = tmp_path / "new"
    r = CliRunner().invoke(main, ["warmup", str(new), "--from-store", src, "--all", "--json", "-q"])
    assert r.exit_code == 0, r.output
    sm = json.loads(r.output)
    with DiskStore(src, readonly=True) as s, DiskStore(str(new), readonly=True) as d:
        assert d.layout == s.layout
        assert d.stats()["capacity_slots"] == s.stats()["capacity_slots"]
        assert d.stats()["used_slots"] == s.stats()["used_slots"] == sm["blocks_written"] > 0
    check_dst(str(new), all_keys(plist))
    small = tmp_path / "small"
    r = CliRunner().invoke(main, ["warmup", str(small), "--from-store", src, "--all", "--capacity",
                                  str(4 * SLOT), "--json", "-q"])
    assert r.exit_code == 0, r.output
    with DiskStore(str(small), readonly=True) as d:
        assert d.stats()["capacity_slots"] == 4 and d.stats()["used_slots"] == 4
    r = CliRunner().invoke(main, ["warmup", str(small), "--from-store", src, "--all", "--capacity", "1G"])
    assert r.exit_code == 1 and "exists already" in r.output
