"""A model's hyper-parameters (``ModelArgs``) from its GGUF metadata: nothing is guessed from the file
name or a config, and a missing or inconsistent key is a ``GGUFError`` naming the file and the key."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ktquest.config import show
from ktquest.formats.gguf import GGUFError, GGUFFile, GGUFTensors
from ktquest.models.block import BlockSpec
from ktquest.models.dual_chunk import DualChunk, file_dual_chunk

# llama.cpp's names of the tensors outside the blocks: model field -> GGUF name (a block's: models/block.py)
MODEL_TENSORS = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}
# Per-frequency RoPE divisors [head_dim // 2]: llama3's, and LongRoPE's two sets (Phi-3's converter)
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the trained context.

    linear:   every inverse frequency divided by ``factor``.
    yarn:     YaRN (per-frequency blend of interpolation and extrapolation, cos/sin times ``attn_factor``).
    llama3:   per-frequency divisors ``freq_factors`` [head_dim // 2], stored by llama.cpp's converter as the
              ``rope_freqs.weight`` tensor (the low/high frequency factors themselves are not in the file).
    longrope: LongRoPE (Phi-3): per-frequency divisors, ``long_factors`` when the cache holds more than
              ``original_context_length`` tokens (llama.cpp's choice by n_ctx), else ``short_factors``
              (tensors ``rope_factors_long/short.weight``); cos/sin times ``attn_factor``.
    dynamic:  dynamic NTK, never from a file (GGUF cannot say it): the config's ``rope_scaling: dynamic``
              raises the base for a cache longer than the trained context (``models.rope.rope_frequencies``).
    """

    type: Literal["linear", "yarn", "llama3", "longrope", "dynamic"]
    factor: float = 1.0
    original_context_length: int = 0  # 0: the file's context_length
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attn_factor: float = 1.0  # cos/sin multiplier (yarn: on top of 0.1 * ln(factor) + 1)
    freq_factors: tuple[float, ...] | None = None  # llama3 (or any file with rope_freqs.weight)
    long_factors: tuple[float, ...] | None = None  # longrope
    short_factors: tuple[float, ...] | None = None  # longrope


@dataclass(slots=True, frozen=True)
class ModelArgs:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    context_length: int
    rope_scaling: RopeScaling | None
    tie_embeddings: bool
    blocks: tuple[BlockSpec, ...]  # [n_layers]: each layer's block, as its family builds it (models/block.py)
    # RoPE pairs adjacent q/k dims (llama's converter interleaves them; ChatGLM's model does): loader.qk_perm
    permuted_qk: bool = False
    rope_theta_local: float = 10000.0  # RoPE table 1's base (the sliding layers': BlockSpec.rope), unscaled
    emb_scale: float = 1.0  # the embeddings' multiplier (gemma: sqrt(dim))
    rope_dim: int = 0  # dims of each q/k head that RoPE rotates; 0 = head_dim (models/loader.qk_perm otherwise)
    # dual chunk attention (models/dual_chunk.py): the file's (its keys, or a known 1M release's), or the config's
    dual_chunk: DualChunk | None = None

    @property
    def n_rot(self) -> int:
        """The rotated dims of a head (``rope_dim``, or all of head_dim)."""
        return self.rope_dim or self.head_dim

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers that attend every position (the attention layers but the sliding-window ones)."""
        return tuple(i for i, b in enumerate(self.blocks) if b.mixer == "attention" and b.attention == "global")

    @property
    def delta_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers (no k/v: a recurrent state, ``kv/recurrent.py``)."""
        return tuple(i for i, b in enumerate(self.blocks) if b.mixer == "delta_net")

    @property
    def n_params(self) -> int:
        """Parameters in the matrices, every expert's included (the embedding table once, plus the LM head when
        untied)."""
        blocks = sum(math.prod(s) for b in self.blocks
                     for s in b.shapes(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim).values()
                     if len(s) > 1)
        return blocks + self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)


def _factor_tensor(path: Path, tensors: GGUFTensors, name: str, head_dim: int) -> tuple[float, ...] | None:
    """The RoPE divisors in tensor ``name`` [head_dim // 2], or None when the file has no such tensor."""
    if name not in tensors:
        return None
    shape = tensors.shape(name)
    if shape != (head_dim // 2,):
        raise GGUFError(f"{path}: tensor {name!r} has shape {list(shape)}, expected [head_dim/2] = "
                        f"[{head_dim // 2}] (one divisor per rotary frequency)")
    values = tensors[name].reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise GGUFError(f"{path}: tensor {name!r} holds {show(values.tolist())}: its values "
                        f"divide the RoPE frequencies and must be finite numbers > 0")
    return tuple(float(x) for x in values)


def _rope_scaling(m: Metadata, arch: str, tensors: GGUFTensors, head_dim: int) -> RopeScaling | None:
    path = m.path
    kind = m.string(f"{arch}.rope.scaling.type", "none")
    freq_factors, long, short = (_factor_tensor(path, tensors, n, head_dim) for n in ROPE_FACTOR_TENSORS)
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise GGUFError(f"{path}: unsupported {arch}.rope.scaling.type {show(kind)} (supported: none, "
                        f"linear, yarn, longrope, and llama3-style rope_freqs.weight)")
    if kind == "longrope" or long is not None or short is not None:
        # Phi-3's converter writes the two tensors (and, lately, the type): both sets, and no other scaling
        if long is None or short is None:
            raise GGUFError(f"{path}: LongRoPE needs both tensors 'rope_factors_long.weight' and "
                            f"'rope_factors_short.weight' [head_dim/2]; the file has "
                            f"{'neither' if long is None and short is None else 'only one'}")
        if kind not in ("none", "longrope") or freq_factors is not None:
            raise GGUFError(f"{path}: LongRoPE factors (rope_factors_long/short.weight) with "
                            f"{arch}.rope.scaling.type={show(kind)}"
                            f"{' and rope_freqs.weight' if freq_factors is not None else ''}: not supported "
                            f"(LongRoPE is the file's only RoPE scaling)")
        kind = "longrope"
    if kind == "none" and freq_factors is None:
        return None
    p = f"{arch}.rope.scaling."
    return RopeScaling(
        type="llama3" if kind == "none" else kind,
        factor=m.number(p + "factor", 0.0, default=1.0),
        original_context_length=m.integer(p + "original_context_length", 0, default=0),
        beta_fast=m.number(p + "yarn_beta_fast", 0.0, default=32.0),
        beta_slow=m.number(p + "yarn_beta_slow", 0.0, default=1.0),
        attn_factor=m.number(p + "attn_factor", 0.0, default=1.0),
        freq_factors=freq_factors,
        long_factors=long,
        short_factors=short,
    )


def resolve_max_seq_len(args: ModelArgs, max_seq_len: int) -> int:
    """The positions a model built alone covers: ``max_seq_len``, or for 0 the model's trained context length.
    (The engine's default for 0 also asks what fits in memory: ``ktquest.context.choose_context``.)"""
    return max_seq_len or args.context_length


_REQUIRED = object()
_INT_MAX = 2**31 - 1  # sizes reach the kernels as 32-bit ints
_BLOCK = re.compile(r"blk\.(\d+)\.")


class Metadata:
    """Typed, range-checked reads of a file's metadata: each failure a ``GGUFError`` naming the file, the key,
    the value and what is allowed."""

    def __init__(self, path: Path, md: dict[str, Any]):
        self.path, self.md = path, md

    def error(self, key: str, value: Any, allowed: str) -> GGUFError:
        return GGUFError(f"{self.path}: {key}={show(value)} is not allowed: {allowed}")

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self.md:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path}: missing required metadata key {key!r}")
            return default
        value = self.md[key]
        if isinstance(value, list):
            raise self.error(key, value, "a single value (lists, such as per-layer values, are not supported)")
        return value

    def integer(self, key: str, lo: int, hi: int = _INT_MAX, default: Any = _REQUIRED) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(key, value, f"an integer in [{lo}, {hi}]")
        return value

    def number(self, key: str, above: float, default: Any = _REQUIRED, why: str = "") -> float:
        """A finite number > ``above``."""
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not value > above:
            raise self.error(key, value, f"a finite number > {above:g}{why}")
        return float(value)

    def array(self, key: str, ok: Callable[[Any], bool], allowed: str) -> list:
        """The list at ``key``, each of its items ``ok``."""
        value = self.md[key]
        if not isinstance(value, list):
            raise self.error(key, value, allowed)
        for i, item in enumerate(value):
            if not ok(item):
                raise GGUFError(f"{self.path}: {key}[{i}]={show(item)} is not allowed: {key} is {allowed}")
        return value

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        value = self.value(key, default)
        if not isinstance(value, str):
            raise self.error(key, value, "a string")
        return value


# The tokenizer's keys besides the token lists and ids (ktquest.formats.tokenizer reads them), by type
_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_TOKENIZER_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                    "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces")


def _check_tokenizer(m: Metadata, vocab_size: int) -> None:
    """The tokenizer's keys have their types, its lists match the model's vocabulary, its merges join tokens
    of it, and its special token ids are in it (checked here, so the tokenizer libraries only ever see
    well-formed input)."""
    for key in _TOKENIZER_STRINGS:
        if key in m.md:
            m.string(key)
    for key in _TOKENIZER_FLAGS:
        if key in m.md and not isinstance(m.md[key], bool):
            raise m.error(key, m.md[key], "true or false")
    tokens = m.md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        m.array("tokenizer.ggml.tokens", lambda t: isinstance(t, str), "a list of strings")
        if len(tokens) != vocab_size:
            raise GGUFError(f"{m.path}: tokenizer.ggml.tokens has {len(tokens)} tokens, but the model's "
                            f"vocabulary (token_embd.weight's rows) is {vocab_size}; they must be equal")
        for key, ok, what in (("tokenizer.ggml.token_type", _is_int, "a list of integers"),
                              ("tokenizer.ggml.scores", _is_finite, "a list of finite numbers")):
            if key in m.md:
                values = m.array(key, ok, what)
                if len(values) != len(tokens):
                    raise GGUFError(f"{m.path}: {key} has {len(values)} entries; expected one per token "
                                    f"({len(tokens)})")
        if "tokenizer.ggml.merges" in m.md:
            vocab = set(tokens)
            for i, merge in enumerate(m.array("tokenizer.ggml.merges", lambda t: isinstance(t, str),
                                              "a list of strings")):
                left, _, right = merge.partition(" ")
                if not (left in vocab and right in vocab and left + right in vocab):
                    raise GGUFError(f"{m.path}: tokenizer.ggml.merges[{i}]={show(merge)} is not allowed: "
                                    f"'left right', where left, right and left+right are tokens")
    for name in _USED_TOKEN_IDS:  # others (padding, sep, ...) are never read: llama.cpp too only warns of them
        if f"tokenizer.ggml.{name}_token_id" in m.md:
            m.integer(f"tokenizer.ggml.{name}_token_id", 0, vocab_size - 1)


_USED_TOKEN_IDS = ("bos", "eos", "eot", "eom", "unknown")  # the special ids formats/tokenizer.py reads


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class Family:
    """What one architecture adds to the keys every architecture has (``model_args`` reads those): its GGUF
    names (``archs``), and ``read(m, tensors, arch, n_layers, dim)`` -> the ModelArgs fields it sets itself,
    ``blocks`` (one ``BlockSpec`` a layer) among them. One per model file (models/llama.py, models/gemma3.py)."""

    archs: tuple[str, ...]
    read: Callable[[Metadata, GGUFTensors, str, int, int], dict[str, Any]]


def model_args(f: GGUFFile, families: dict[str, Family]) -> ModelArgs:
    """The hyper-parameters of the model in ``f``, from its metadata (and the tensors a key may be missing
    for), each checked against what the model code can run; ``families``: architecture name -> its Family."""
    path, tensors = f.path, f.tensors
    m = Metadata(path, f.metadata)
    arch = m.string("general.architecture")
    if arch not in families:
        raise GGUFError(f"{path}: unsupported architecture {show(arch)} "
                        f"(supported: {', '.join(families)})")
    dim = m.integer(f"{arch}.embedding_length", 1)
    n_heads = m.integer(f"{arch}.attention.head_count", 1)
    n_kv_heads = m.integer(f"{arch}.attention.head_count_kv", 1, n_heads, default=n_heads)
    if n_heads % n_kv_heads != 0:
        raise GGUFError(f"{path}: {arch}.attention.head_count={n_heads} is not a multiple of "
                        f"{arch}.attention.head_count_kv={n_kv_heads}")
    # rotate-half RoPE pairs dim i with dim i + D/2: D even
    head_dim = m.integer(f"{arch}.attention.key_length", 2, default=dim // n_heads)
    if head_dim % 2:
        raise m.error(f"{arch}.attention.key_length", head_dim, "an even head_dim (RoPE rotates pairs of dims)")
    if m.integer(f"{arch}.attention.value_length", 1, default=head_dim) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length ({head_dim}); not supported")
    rope_dim = m.integer(f"{arch}.rope.dimension_count", 2, head_dim, default=head_dim)
    if rope_dim % 2:
        raise m.error(f"{arch}.rope.dimension_count", rope_dim, f"an even count of dims <= head_dim {head_dim}")
    embd = MODEL_TENSORS["tok_embeddings"]
    if embd not in tensors:
        raise GGUFError(f"{path}: missing tensor {embd!r}")
    vocab_size = m.integer(f"{arch}.vocab_size", 1, default=tensors.shape(embd)[0])
    _check_tokenizer(m, vocab_size)
    # The blocks are counted from the tensors: a block_count below them would drop layers silently, and the
    # shape checks of read_gguf loop over block_count.
    n_blocks = max((int(b.group(1)) for b in map(_BLOCK.match, tensors) if b), default=-1) + 1
    n_layers = m.integer(f"{arch}.block_count", 1)
    if n_layers != n_blocks:
        raise m.error(f"{arch}.block_count", n_layers, f"the number of blocks the file has tensors for "
                      f"({n_blocks}: blk.0 to blk.{n_blocks - 1})" if n_blocks else
                      "the number of blocks the file has tensors for, and it has none (no blk.* tensors)")
    context_length = m.integer(f"{arch}.context_length", 1)
    try:
        dual_chunk = file_dual_chunk(m.md, arch, context_length)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None
    args = ModelArgs(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=m.integer(f"{arch}.feed_forward_length", 1),
        vocab_size=vocab_size,
        norm_eps=m.number(f"{arch}.attention.layer_norm_rms_epsilon", 0.0),
        # llama.cpp's default when absent; the inverse frequencies are base^(-2i/head_dim)
        rope_theta=m.number(f"{arch}.rope.freq_base", 1.0, default=10000.0),
        context_length=context_length,
        rope_scaling=_rope_scaling(m, arch, tensors, rope_dim),
        tie_embeddings=MODEL_TENSORS["output"] not in tensors,
        rope_dim=0 if rope_dim == head_dim else rope_dim,
        dual_chunk=dual_chunk,
        **_family_fields(families[arch], m, tensors, arch, n_layers, dim),
    )
    return args


def _family_fields(family: Family, m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int,
                   dim: int) -> dict[str, Any]:
    """The fields ``family`` reads, its ``blocks`` checked: one BlockSpec a layer."""
    fields = family.read(m, tensors, arch, n_layers, dim)
    blocks = fields.get("blocks")
    if not (isinstance(blocks, tuple) and len(blocks) == n_layers and all(isinstance(b, BlockSpec) for b in blocks)):
        raise GGUFError(f"{m.path}: the {arch} family made {len(blocks) if isinstance(blocks, tuple) else blocks!r} "
                        f"block description(s) for {n_layers} blocks")
    return fields
