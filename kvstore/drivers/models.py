"""Random-weight models made on this machine, for the real-engine demo, bench and tests.

The model hub is out of reach, so kvstore makes its own: a Llama with random weights
(transformers `LlamaForCausalLM`, a fixed seed, `save_pretrained`), a Gemma 2 (sliding-
window attention on every other layer: a hybrid model, full-attention and sliding-window
KV cache groups in vLLM) or an LFM2 (short-convolution layers between attention layers: a
hybrid whose conv layers keep a state in a Mamba KV cache group), and a word-level
tokenizer trained locally with `tokenizers` over a fixed synthetic vocabulary, with a chat
template, so `vllm serve DIR` serves it exactly as it serves a downloaded model (text and
chat prompts through the OpenAI API). One word of the vocabulary is one token, which makes
prompt lengths in tokens exact.

Models are generated on first use and never committed. A directory holds a `kvstore-model.json`
stamp with the spec it was made from: an existing directory with the same stamp is reused,
any other content is refused rather than overwritten.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass

from kvstore.errors import ConfigError

STAMP = "kvstore-model.json"
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@dataclass(frozen=True)
class ModelSpec:
    """What a generated model is made of; the stamp in its directory."""
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_words: int
    max_position_embeddings: int = 16384
    dtype: str = "bfloat16"
    seed: int = 1234
    initializer_range: float = 0.02
    # Bumped when the generator changes what it writes, so old directories are remade.
    format: int = 1
    # "llama"; "gemma2": layers 0, 2, ... attend to the last `sliding_window` tokens only;
    # "lfm2": layers 0, 2, ... are short convolutions (a state per request), 1, 3, ... attention.
    arch: str = "llama"
    sliding_window: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_cache_groups(self) -> int:
        """vLLM's KV cache groups for this model: one for a Llama; a Gemma 2's full-attention
        and sliding-window layers, an LFM2's attention and conv layers, two. The groups
        share vLLM's block pool, so a KV cache of N blocks gives each group N / groups."""
        return 1 if self.arch == "llama" else 2

    def approx_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_words + len(SPECIALS)
        kv = self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        return self.num_layers * per_layer + 2 * v * h + h


# The dtype the engine serves these models in. Random weights give nearly flat next-token
# distributions, so in bf16 the rounding differences between two prefill splits of the same
# prompt (a prefix from cache + the rest, or all at once: GEMMs of different row counts
# round differently) flip greedy tokens, with or without kvstore (measured: 4 of 15 demo
# completions). In float32 the same comparison is bit-exact, so a token that differs
# means the KV differed. Checkpoints stay bf16 (upcasting is exact).
SERVE_DTYPE = "float32"

# Tests: a few MB, a prefill of 1k tokens takes a fraction of a second on two cores.
TINY = ModelSpec("tiny", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_words=4000)
# Demo and `kvstore bench ttft`: about 170M parameters, so that a 4k-token prefill takes
# seconds on two cores, as a real (small) model's would.
DEMO = ModelSpec("demo", hidden_size=768, num_layers=24, num_heads=12, num_kv_heads=4,
                 intermediate_size=2048, vocab_words=16000)
# Tests of hybrid models: TINY's size as a Gemma 2 with a 64-token window on every other
# layer (two full-attention and two sliding-window layers: two KV cache groups of one page
# size), so prompts of a few hundred tokens reach far past the window.
TINY_GEMMA2 = ModelSpec("tiny-gemma2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, vocab_words=4000, arch="gemma2", sliding_window=64)
# The demo's and `kvstore bench ttft`'s hybrid model: DEMO's size as a Gemma 2 whose
# sliding-window layers see the last 1024 tokens of prompts of several thousand.
DEMO_GEMMA2 = ModelSpec("demo-gemma2", hidden_size=768, num_layers=24, num_heads=12, num_kv_heads=4,
                        intermediate_size=2048, vocab_words=16000, arch="gemma2", sliding_window=1024)
# Tests of Mamba-style hybrids: TINY's size as an LFM2 (vLLM's CPU build runs its short
# convolutions; its Mamba1/Mamba2 kernels it does not have, docs/CONFIG.md).
TINY_LFM2 = ModelSpec("tiny-lfm2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, vocab_words=4000, arch="lfm2")
SPECS = {s.name: s for s in (TINY, DEMO, TINY_GEMMA2, DEMO_GEMMA2, TINY_LFM2)}
ARCHS = ("llama", "gemma2", "lfm2")


def default_dir(name: str) -> str:
    """Where `ensure_model(name)` keeps a model by default: one fixed path per spec, so a
    store kept from an earlier run (whose layout names the model path) serves again."""
    root = os.environ.get("KVSTORE_MODELS_DIR") or os.path.join(tempfile.gettempdir(), "kvstore-models")
    return os.path.join(root, name)


def vocabulary(spec: ModelSpec) -> list[str]:
    """The synthetic words of the tokenizer: pronounceable, distinct, deterministic."""
    rng = random.Random(spec.seed)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    out = []
    while len(out) < spec.vocab_words:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
        if w not in words:
            words.add(w)
            out.append(w)
    return out


def words(spec: ModelSpec, n: int, rng: random.Random) -> str:
    """n random vocabulary words: exactly n tokens of this model's tokenizer."""
    vocab = vocabulary(spec)
    return " ".join(rng.choice(vocab) for _ in range(n))


def stamp_of(spec: ModelSpec) -> dict:
    """The stamp of a spec: its fields, less `arch` and `sliding_window` where they are the
    Llama defaults (a Llama's stamp is the same as before those fields existed, so its
    directory is reused)."""
    d = asdict(spec)
    if spec.arch == "llama" and not spec.sliding_window:
        del d["arch"], d["sliding_window"]
    return d


def _read_stamp(path: str) -> dict | None:
    try:
        with open(os.path.join(path, STAMP)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure_model(name_or_spec: str | ModelSpec = "tiny", path: str | None = None) -> str:
    """The directory of the model `name_or_spec`, generated there first if missing.

    Needs torch and transformers (both come with vLLM). Writing goes to a temporary
    directory renamed into place, so an interrupted run never leaves a half model.
    """
    spec = SPECS.get(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
    if spec is None:
        raise ConfigError(f"unknown model {name_or_spec!r}; choose one of {', '.join(SPECS)}")
    if spec.arch not in ARCHS:
        raise ConfigError(f"model {spec.name}: unknown arch {spec.arch!r}; choose one of {', '.join(ARCHS)}")
    if (spec.arch == "gemma2") != (spec.sliding_window > 0):
        raise ConfigError(f"model {spec.name}: sliding_window={spec.sliding_window} needs arch "
                          "gemma2 (and gemma2 a sliding_window > 0)")
    path = os.path.abspath(path or default_dir(spec.name))
    stamp = _read_stamp(path)
    if stamp == stamp_of(spec):
        return path
    if os.path.exists(path) and os.listdir(path):
        if stamp is None:
            raise ConfigError(f"{path} exists and is not a model made by kvstore; choose another "
                              "directory (or remove it)")
        shutil.rmtree(path)  # ours, made from another spec: remake it
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{spec.name}-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        _write_tokenizer(spec, tmp)
        _write_weights(spec, tmp)
        with open(os.path.join(tmp, STAMP), "w") as f:
            json.dump(stamp_of(spec), f, indent=1)
        if os.path.isdir(path):
            os.rmdir(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_tokenizer(spec: ModelSpec, out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIALS + vocabulary(spec))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[4:])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(out)


def _write_weights(spec: ModelSpec, out: str) -> None:
    import torch
    common = dict(
        vocab_size=len(SPECIALS) + spec.vocab_words, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5, initializer_range=spec.initializer_range,
        bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if spec.arch == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM
        # layer_types: sliding window on layers 0, 2, ... (Gemma 2's own pattern); vLLM
        # gives the two kinds one KV cache group each.
        cfg = Gemma2Config(
            **common, sliding_window=spec.sliding_window, query_pre_attn_scalar=spec.head_dim,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(spec.num_layers)],
            tie_word_embeddings=True)
        cls = Gemma2ForCausalLM
    elif spec.arch == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM
        # conv_dim and block_dim: read by vLLM 0.32's LFM2 (lfm2.py), not written by
        # this transformers' Lfm2Config.
        cfg = Lfm2Config(
            **common, norm_eps=1e-5, conv_L_cache=3, conv_dim=spec.hidden_size,
            block_dim=spec.hidden_size, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)],
            tie_word_embeddings=True)
        cls = Lfm2ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        cls = LlamaForCausalLM
    torch.manual_seed(spec.seed)
    model = cls(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
