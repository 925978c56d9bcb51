"""A model's hyper-parameters (``ModelArgs``) from its GGUF metadata: nothing is guessed from the file
name or a config, and a missing or inconsistent key is a ``GGUFError`` naming the file and the key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ktquest.formats.gguf import GGUFError, GGUFFile, GGUFTensors

SUPPORTED_ARCHS = ("llama", "qwen2")

# llama.cpp's tensor names, shared by llama and qwen2: model field -> GGUF name (blocks under "blk.{i}.").
MODEL_TENSORS = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}
BLOCK_TENSORS = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
                 "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
                 "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
BIAS_TENSORS = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the trained context.

    linear: every inverse frequency divided by ``factor``.
    yarn:   YaRN (per-frequency blend of interpolation and extrapolation, cos/sin scaled by ``attn_factor``).
    llama3: per-frequency divisors ``freq_factors`` [head_dim // 2], stored by llama.cpp's converter as the
            ``rope_freqs.weight`` tensor (the low/high frequency factors themselves are not in the file).
    """

    type: Literal["linear", "yarn", "llama3"]
    factor: float = 1.0
    original_context_length: int = 0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attn_factor: float = 1.0  # yarn: extra cos/sin multiplier on top of 0.1 * ln(factor) + 1
    freq_factors: tuple[float, ...] | None = None  # llama3 (or any file with rope_freqs.weight)


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
    qkv_bias: bool
    tie_embeddings: bool


def _rope_scaling(path: Path, md: dict[str, Any], arch: str, tensors: GGUFTensors,
                  head_dim: int) -> RopeScaling | None:
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        n = math.prod(tensors.shape("rope_freqs.weight"))
        if n != head_dim // 2:
            raise GGUFError(f"{path}: tensor 'rope_freqs.weight' has {n} values, "
                            f"expected head_dim/2 = {head_dim // 2}")
        freq_factors = tuple(float(x) for x in tensors["rope_freqs.weight"].reshape(-1))
    if kind == "none" and freq_factors is None:
        return None
    if kind not in ("none", "linear", "yarn"):
        raise GGUFError(f"{path}: unsupported {arch}.rope.scaling.type {kind!r} "
                        f"(supported: none, linear, yarn, and llama3-style rope_freqs.weight)")
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind != "none" and factor <= 0:
        raise GGUFError(f"{path}: {arch}.rope.scaling.factor={factor} must be > 0")
    return RopeScaling(
        type="llama3" if kind == "none" else kind,
        factor=factor,
        original_context_length=int(md.get(f"{arch}.rope.scaling.original_context_length", 0)),
        beta_fast=float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        attn_factor=float(md.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
        freq_factors=freq_factors,
    )


def model_args(f: GGUFFile) -> ModelArgs:
    """The hyper-parameters of the model in ``f``, from its metadata (and the tensors a key may be missing for)."""
    path, md, tensors = f.path, f.metadata, f.tensors

    def need(key: str) -> Any:
        if key not in md:
            raise GGUFError(f"{path}: missing required metadata key {key!r}")
        value = md[key]
        if isinstance(value, list):
            raise GGUFError(f"{path}: metadata key {key!r} is a per-layer list {value[:4]}..., "
                            f"only a single value is supported")
        return value

    arch = need("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} "
                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    dim = int(need(f"{arch}.embedding_length"))
    n_heads = int(need(f"{arch}.attention.head_count"))
    n_kv_heads = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(md.get(f"{arch}.attention.key_length", dim // n_heads))
    if int(md.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length ({head_dim}); not supported")
    if n_heads % n_kv_heads != 0:
        raise GGUFError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count={rope_dim} differs from head_dim {head_dim} "
                        f"(partial rotary embeddings are not supported)")
    embd = MODEL_TENSORS["tok_embeddings"]
    if embd not in tensors:
        raise GGUFError(f"{path}: missing tensor {embd!r}")
    vocab_size = int(md.get(f"{arch}.vocab_size", tensors.shape(embd)[0]))
    return ModelArgs(
        arch=arch,
        n_layers=int(need(f"{arch}.block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(need(f"{arch}.feed_forward_length")),
        vocab_size=vocab_size,
        norm_eps=float(need(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),  # llama.cpp's default when absent
        context_length=int(need(f"{arch}.context_length")),
        rope_scaling=_rope_scaling(path, md, arch, tensors, head_dim),
        # qwen2 always has Q/K/V biases; a llama file may carry them too.
        qkv_bias=arch == "qwen2" or f"blk.0.{BIAS_TENSORS['bq']}" in tensors,
        tie_embeddings=MODEL_TENSORS["output"] not in tensors,
    )
