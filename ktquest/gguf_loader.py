"""Read a GGUF file: hyper-parameters (``ModelArgs``), tensors (dequantized to float32) and raw metadata.

Everything the model needs comes from the file; nothing is guessed from the file name or a config.
Parsing is done by the ``gguf`` package (``GGUFReader``); this module turns its output into plain Python
values and clear ``GGUFError`` messages that name the file and what is wrong with it.

Q/K layout. llama.cpp's converter permutes the rows of llama's ``attn_q``/``attn_k`` (within each head,
row ``2i`` and ``2i+1`` hold the two halves of rotary pair ``i``) so that ggml can rotate adjacent pairs
("interleaved" RoPE). qwen2 files are not permuted (ggml's NEOX RoPE). ``model_weights`` undoes the llama
permutation, so both archs reach the model in the Hugging Face layout and the model has one RoPE style:
rotate-half (pair ``i`` = dims ``i`` and ``i + D/2``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import gguf
import numpy as np
import torch

if TYPE_CHECKING:
    from ktquest.models.llama import Transformer

SUPPORTED_ARCHS = ("llama", "qwen2")
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file is not a GGUF model this runtime can load; the message names the file and the problem."""


# ---- hyper-parameters ----


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


# ---- tensors ----


def dequantize_tensor(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, name: str = "?",
                      path: str | os.PathLike = "?") -> np.ndarray:
    """Raw GGUF tensor data (as ``GGUFReader`` maps it) -> a new, writable float32 array [rows, cols].

    Covers every type ``gguf.quants`` can dequantize (F32, F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, IQ*, TQ*,
    MXFP4, ...) plus F64; anything else raises ``GGUFError`` naming the tensor and its type.
    """
    qtype = gguf.GGMLQuantizationType(ggml_type)
    if qtype == gguf.GGMLQuantizationType.F64:
        return np.asarray(data, dtype=np.float64).astype(np.float32)
    try:
        out = gguf.quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {name!r} has type {qtype.name}, which cannot be dequantized "
                        f"(the gguf package has no dequantizer for it)") from None
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.array(out, dtype=np.float32)  # a copy: F32 comes back as a view of the read-only map
    return out.astype(np.float32, copy=False)


class GGUFTensors(Mapping):
    """name -> float32 ndarray, dequantized on each access (nothing is kept); shapes are [rows, cols]."""

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self._path = path
        self._by_name = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._by_name[name]
        return dequantize_tensor(t.data, t.tensor_type, name, self._path)

    def __contains__(self, name: object) -> bool:  # Mapping's default would dequantize the tensor
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def shape(self, name: str) -> tuple[int, ...]:
        """[rows, cols] (numpy / torch order: GGUF's dims reversed)."""
        return tuple(int(d) for d in reversed(self._by_name[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self._by_name[name].tensor_type.name


@dataclass(slots=True)
class GGUFContents:
    """What ``read_gguf`` found.

    ``metadata`` holds every key/value of the file under its GGUF key, as plain Python values
    (str, int, float, bool, list[str], list[int], list[float]). The tokenizer keys, when present:

    - ``tokenizer.ggml.model`` (str: "gpt2" = byte-level BPE, "llama" = SentencePiece)
    - ``tokenizer.ggml.pre`` (str: pre-tokenizer name, e.g. "smollm", "qwen2", "llama-bpe")
    - ``tokenizer.ggml.tokens`` (list[str]), ``tokenizer.ggml.scores`` (list[float]),
      ``tokenizer.ggml.token_type`` (list[int]: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)
    - ``tokenizer.ggml.merges`` (list[str], "a b")
    - ``tokenizer.ggml.bos_token_id``, ``eos_token_id``, ``eot_token_id``, ``unknown_token_id``,
      ``padding_token_id`` (int)
    - ``tokenizer.ggml.add_bos_token``, ``add_eos_token``, ``add_space_prefix`` (bool)
    - ``tokenizer.chat_template`` (str, Jinja)
    """

    path: Path
    args: ModelArgs
    tensors: GGUFTensors  # raw file layout (llama Q/K still permuted); see model_weights
    metadata: dict[str, Any]


# ---- reading ----


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):  # defensive: contents() already returns Python scalars
        value = value.item()
    return value


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` parsing a plain ndarray view of its memory map.

    The reader slices its ``np.memmap`` once per metadata value (~250k times for a 49K-token vocabulary
    with its merges) and numpy's memmap subclass makes each slice several times slower: 2x on the whole load.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)  # keeps the mapping alive through .base
        return super()._get(offset, dtype, count, override_order)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                            f"{t.data_offset + t.n_bytes}, the file has {size} bytes")
    return reader


def _expected_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, [rows, cols] (biases only when ``a.qkv_bias``)."""
    q_rows, kv_rows = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (a.vocab_size, a.dim),
                                          "output_norm.weight": (a.dim,)}
    if not a.tie_embeddings:
        shapes["output.weight"] = (a.vocab_size, a.dim)
    for i in range(a.n_layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (a.dim,),
            p + "attn_q.weight": (q_rows, a.dim),
            p + "attn_k.weight": (kv_rows, a.dim),
            p + "attn_v.weight": (kv_rows, a.dim),
            p + "attn_output.weight": (a.dim, q_rows),
            p + "ffn_norm.weight": (a.dim,),
            p + "ffn_gate.weight": (a.ffn_dim, a.dim),
            p + "ffn_up.weight": (a.ffn_dim, a.dim),
            p + "ffn_down.weight": (a.dim, a.ffn_dim),
        }
        if a.qkv_bias:
            shapes |= {p + "attn_q.bias": (q_rows,), p + "attn_k.bias": (kv_rows,),
                       p + "attn_v.bias": (kv_rows,)}
    return shapes


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


def _model_args(path: Path, md: dict[str, Any], tensors: GGUFTensors) -> ModelArgs:
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
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = int(md.get(f"{arch}.vocab_size", tensors.shape("token_embd.weight")[0]))
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
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
    )


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Parse ``path``: metadata, ``ModelArgs`` and a lazy view of the tensors.

    Checks that every tensor the model needs is present with the right shape (before any dequantization),
    so a bad file fails fast with a ``GGUFError`` naming the tensor, the expected and the found shape.
    """
    path = Path(path)
    reader = _open_reader(path)
    try:
        metadata = {name: _field_value(f) for name, f in reader.fields.items()
                    if not name.startswith("GGUF.")}  # GGUF.version etc.: the reader's own bookkeeping
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: corrupt metadata ({type(e).__name__}: {e})") from None
    tensors = GGUFTensors(path, reader)
    args = _model_args(path, metadata, tensors)
    for name, expected in _expected_shapes(args).items():
        if name not in tensors:
            raise GGUFError(f"{path}: missing tensor {name!r} (expected shape {list(expected)})")
        found = tensors.shape(name)
        if found != expected:
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(found)}, expected {list(expected)} "
                            f"([rows, cols])")
    return GGUFContents(path=path, args=args, tensors=tensors, metadata=metadata)


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


def model_weights(contents: GGUFContents, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """GGUF tensor name -> torch tensor [rows, cols] in the Hugging Face layout (llama Q/K un-permuted)."""
    a, src = contents.args, contents.tensors
    out: dict[str, torch.Tensor] = {}
    for name in _expected_shapes(a):
        w = src[name].reshape(src.shape(name))
        if a.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_qk(w, a.n_heads if ".attn_q." in name else a.n_kv_heads)
        out[name] = torch.from_numpy(w).to(device=device, dtype=dtype)
    return out


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_seq_len: int = 0) -> tuple[Transformer, GGUFContents]:
    """Read ``path`` and build the model on ``device``/``dtype``; returns (model, contents).

    max_seq_len: positions the RoPE tables cover; 0 = the trained context length.
    """
    from ktquest.models.llama import Transformer  # the model imports ModelArgs from here

    contents = read_gguf(path)
    model = Transformer(contents.args, model_weights(contents, dtype, device), max_seq_len=max_seq_len)
    return model.eval(), contents
