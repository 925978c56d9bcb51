"""GGUF file -> model weights: which tensors an architecture needs under which GGUF names, checked
shapes, and the conversion to the layout the model code uses.

Q/K layout. llama.cpp's converter permutes the rows of llama's ``attn_q``/``attn_k`` (within each head,
row ``2i`` and ``2i+1`` hold the two halves of rotary pair ``i``) so that ggml can rotate adjacent pairs
("interleaved" RoPE). qwen2 files are not permuted (ggml's NEOX RoPE). ``model_weights`` undoes the llama
permutation, so both archs reach the model in the Hugging Face layout and the model has one RoPE style:
rotate-half (pair ``i`` = dims ``i`` and ``i + D/2``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ktquest.config import show
from ktquest.formats.gguf import GGUFError, GGUFTensors, open_gguf
from ktquest.models.args import BIAS_TENSORS, BLOCK_TENSORS, MODEL_TENSORS, ModelArgs, model_args
from ktquest.models.llama import BlockWeights, Transformer, TransformerWeights


@dataclass(slots=True)
class GGUFContents:
    """What ``read_gguf`` found: the file's metadata and tensors, and the model's hyper-parameters.

    ``metadata``: every key/value of the file (``ktquest.formats.gguf.GGUFFile``).
    """

    path: Path
    args: ModelArgs
    tensors: GGUFTensors  # raw file layout (llama Q/K still permuted); see model_weights
    metadata: dict[str, Any]


def _block_tensors(a: ModelArgs) -> dict[str, str]:
    """A block's tensors: model field -> GGUF name under "blk.{i}." (the biases only when the file has them)."""
    return BLOCK_TENSORS | (BIAS_TENSORS if a.qkv_bias else {})


def _expected_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs under its GGUF name, [rows, cols] (biases only when ``a.qkv_bias``)."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    model = {"tok_embeddings": (a.vocab_size, a.dim), "norm": (a.dim,), "output": (a.vocab_size, a.dim)}
    block = {"attn_norm": (a.dim,), "wq": (q, a.dim), "wk": (kv, a.dim), "wv": (kv, a.dim), "wo": (a.dim, q),
             "ffn_norm": (a.dim,), "w_gate": (a.ffn_dim, a.dim), "w_up": (a.ffn_dim, a.dim),
             "w_down": (a.dim, a.ffn_dim), "bq": (q,), "bk": (kv,), "bv": (kv,)}
    shapes = {n: model[f] for f, n in MODEL_TENSORS.items() if f != "output" or not a.tie_embeddings}
    for i in range(a.n_layers):
        shapes |= {f"blk.{i}.{n}": block[f] for f, n in _block_tensors(a).items()}
    return shapes


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Parse ``path``: metadata, ``ModelArgs`` and a lazy view of the tensors.

    Checks that every tensor the model needs is present with the right shape (before any dequantization),
    so a bad file fails fast with a ``GGUFError`` naming the tensor, the expected and the found shape.
    """
    f = open_gguf(path)
    args, tensors = model_args(f), f.tensors
    for name, expected in _expected_shapes(args).items():
        if name not in tensors:
            raise GGUFError(f"{f.path}: missing tensor {name!r} (expected shape {list(expected)})")
        found = tensors.shape(name)
        if found != expected:
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(found)}, expected {list(expected)} "
                            f"([rows, cols])")
    return GGUFContents(path=f.path, args=args, tensors=tensors, metadata=f.metadata)


# ---- model weights ----


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: interleaved pairs -> rotate-half halves, per head.

    w: [n_heads * D, ...] in GGUF order, where head h's rows are (x0, y0, x1, y1, ...);
    returns the Hugging Face order (x0, x1, ..., y0, y1, ...). Works for weights and biases.
    """
    rows = w.shape[0]
    d = rows // n_heads
    # [H, D/2, 2, ...] -> [H, 2, D/2, ...]
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


def _check_finite(path: Path, name: str, w: np.ndarray, dtype: torch.dtype) -> None:
    """GGUFError unless every weight of ``w`` is finite in ``dtype``: one NaN or inf weight makes every q/k it
    reaches non-finite, and the reply NaN or silently empty."""
    ends = (w.min(), w.max())  # NaN reaches both, +-inf one: a read of the array, no copy
    if torch.isfinite(torch.tensor(ends, dtype=torch.float64).to(dtype)).all():  # rounded as the weights will be
        return
    bad = ~np.isfinite(w)
    if bad.any():
        raise GGUFError(f"{path}: tensor {name!r} holds {int(bad.sum())} non-finite values "
                        f"({show(sorted({str(x) for x in w[bad][:1000]}))}); a model's weights must be finite")
    raise GGUFError(f"{path}: tensor {name!r} holds values up to {float(np.abs(w).max()):.4g}, past the range "
                    f"of {str(dtype).removeprefix('torch.')}; load it with dtype float32 or bfloat16")


def model_weights(contents: GGUFContents, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> TransformerWeights:
    """The model's tensors from the file, dequantized to ``dtype`` on ``device``, in the Hugging Face layout
    (llama's Q/K un-permuted)."""
    a, src = contents.args, contents.tensors

    def tensor(name: str, n_heads: int = 0) -> torch.Tensor:
        w = src[name].reshape(src.shape(name))
        if a.arch == "llama" and n_heads:
            w = unpermute_qk(w, n_heads)
        _check_finite(contents.path, name, w, dtype)
        return torch.from_numpy(w).to(device=device, dtype=dtype)

    heads = {"wq": a.n_heads, "wk": a.n_kv_heads, "bq": a.n_heads, "bk": a.n_kv_heads}
    layers = [BlockWeights(**{f: tensor(f"blk.{i}.{n}", heads.get(f, 0)) for f, n in _block_tensors(a).items()})
              for i in range(a.n_layers)]
    return TransformerWeights(
        tok_embeddings=tensor(MODEL_TENSORS["tok_embeddings"]),
        norm=tensor(MODEL_TENSORS["norm"]),
        output=None if a.tie_embeddings else tensor(MODEL_TENSORS["output"]),
        layers=layers)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_seq_len: int = 0) -> tuple[Transformer, GGUFContents]:
    """Read ``path`` and build the model on ``device``/``dtype``; returns (model, contents).

    max_seq_len: positions the RoPE tables cover; 0 = the trained context length (``resolve_max_seq_len``).
    """
    contents = read_gguf(path)
    return build_model(contents, device, dtype, max_seq_len), contents


def build_model(contents: GGUFContents, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                max_seq_len: int = 0) -> Transformer:
    """The model of a file ``read_gguf`` has read and checked, on ``device``/``dtype`` (RoPE tables for
    ``max_seq_len`` positions; 0 = the trained context length, capped: ``resolve_max_seq_len``)."""
    return Transformer(contents.args, model_weights(contents, dtype, device), max_seq_len=max_seq_len).eval()
