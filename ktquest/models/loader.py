"""GGUF file -> model weights: which tensors an architecture needs under which GGUF names, checked
shapes, and the conversion to the layout the model code uses.

Q/K layout. llama.cpp's converter permutes the rows of llama's ``attn_q``/``attn_k`` (within each head,
row ``2i`` and ``2i+1`` hold the two halves of rotary pair ``i``) so that ggml can rotate adjacent pairs
("interleaved" RoPE); internlm2's too, once it has split InternLM2's fused ``wqkv``. qwen2 files are not
permuted (ggml's NEOX RoPE). The weights keep the file's rows (they are read in place); ``qk_perm`` is the
gather the model applies to the q | k | v projection, so every arch reaches attention in the Hugging Face
layout and the model has one RoPE style: rotate-half (pair ``i`` = dims ``i`` and ``i + D/2``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ktquest.config import show
from ktquest.formats.chat_template import ChatTemplateError
from ktquest.formats.gguf import GGUFError, GGUFTensors, open_gguf
from ktquest.formats.tokenizer import Tokenizer, TokenizerError
from ktquest.layers.linear import Int8Weight, QuantWeight
from ktquest.models import chatglm, gemma3, llama, phi3, qwen2moe, qwen3, qwen3moe, qwen35
from ktquest.models.args import MODEL_TENSORS, Family, ModelArgs, RopeScaling, model_args, resolve_max_seq_len
from ktquest.models.block import EXPERT_STACKS, SMALL_TENSORS, VECTORS
from ktquest.models.dual_chunk import DualChunk
from ktquest.models.llama import BlockWeights, Transformer, TransformerWeights
from ktquest.models.rope import partial_rotary_order
from ktquest.native.enums import GGML_TYPES

# The architectures ktquest reads: GGUF name -> its family (models/<family>.py). Adding one is a family file and
# its line here (docs/design.md, "Adding an architecture").
FAMILIES: dict[str, Family] = {arch: f for f in (llama.FAMILY, qwen3.FAMILY, qwen3moe.FAMILY, qwen2moe.FAMILY,
                                                  gemma3.FAMILY, qwen35.FAMILY, chatglm.FAMILY, phi3.FAMILY)
                               for arch in f.archs}


@dataclass(slots=True)
class GGUFContents:
    """What ``read_gguf`` found: the file's metadata and tensors, and the model's hyper-parameters.

    ``metadata``: every key/value of the file (``ktquest.formats.gguf.GGUFFile``).
    """

    path: Path
    args: ModelArgs
    tensors: GGUFTensors  # raw file layout (llama/internlm2 Q/K permuted); see qk_perm
    metadata: dict[str, Any]


def _expected_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs under its GGUF name, [rows, cols] or [n_experts, rows, cols] (each block's as
    its BlockSpec says)."""
    model = {"tok_embeddings": (a.vocab_size, a.dim), "norm": (a.dim,), "output": (a.vocab_size, a.dim)}
    shapes = {n: model[f] for f, n in MODEL_TENSORS.items() if f != "output" or not a.tie_embeddings}
    for i, spec in enumerate(a.blocks):
        block = spec.shapes(a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim)
        shapes |= {f"blk.{i}.{n}": block[f] for f, n in spec.tensors().items()}
    return shapes


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Parse ``path``: metadata, ``ModelArgs`` and a lazy view of the tensors.

    Checks that every tensor the model needs is present with the right shape (before any dequantization),
    so a bad file fails fast with a ``GGUFError`` naming the tensor, the expected and the found shape.
    """
    f = open_gguf(path)
    args, tensors = model_args(f, FAMILIES), f.tensors
    for name, expected in _expected_shapes(args).items():
        if name not in tensors:
            raise GGUFError(f"{f.path}: missing tensor {name!r} (expected shape {list(expected)})")
        found = tensors.shape(name)
        if found != expected and not (len(expected) == 1 and found == (1, *expected)):  # a vector: [n] or [1, n]
            what = "[n_experts, rows, cols]: expert_count experts" if len(expected) == 3 else "[rows, cols]"
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(found)}, expected {list(expected)} "
                            f"({what})")
    return GGUFContents(path=f.path, args=args, tensors=tensors, metadata=f.metadata)


def read_tokenizer(contents: GGUFContents, chat_template: str | None = None) -> Tokenizer:
    """The file's tokenizer and chat template (``chat_template``'s Jinja text over the file's own, which is then
    not compiled: a broken one is replaced, not refused); ``GGUFError`` naming the file where its metadata cannot
    make them (a ``TokenizerError``, or a ``ChatTemplateError``: a template that does not compile)."""
    try:
        return Tokenizer.from_gguf_metadata(contents.metadata, chat_template)
    except (TokenizerError, ChatTemplateError) as e:
        raise GGUFError(f"{contents.path}: {e}") from None


# ---- model weights ----


def qk_perm(a: ModelArgs) -> torch.Tensor | None:
    """The gather that takes the file's fused q | k | v projection to the order the model's attention reads:
    q [H*D] | k [KVH*D] | v [KVH*D] (| gate [H*D] for ``attn_gate`` blocks), rotate-half RoPE in each q/k head;
    None where the file's order is that already (qwen2, qwen3).

    - adjacent pairs (``permuted_qk``): llama.cpp's converter stores llama's and internlm2's head h as (x0, y0,
      x1, y1, ...), rotary pair i in rows 2i and 2i + 1, for ggml's interleaved RoPE; ChatGLM's model rotates
      such pairs itself, over its first R = ``n_rot`` dims. Output j < R of a head reads row 2 (j % (R/2)) +
      j // (R/2); the rest keep their rows.
    - partial rotary (``rope_dim`` < D): then ``rope.partial_rotary_order`` within each q/k head.
    - ``attn_gate`` (qwen35): the file's q rows are [q_h (D), gate_h (D)] per head; q and then the gates.
    int64 [(H + 2 KVH) * D] (+ H*D with a gate)."""
    gated = any(b.attn_gate for b in a.blocks if b.mixer == "attention")
    if not (a.permuted_qk or a.rope_dim or gated):
        return None
    d, h, kvh = a.head_dim, a.n_heads, a.n_kv_heads
    j, r = torch.arange(d), a.rope_dim or d
    within = torch.cat([2 * (j[:r] % (r // 2)) + j[:r] // (r // 2), j[r:]]) if a.permuted_qk else j  # [D]
    if a.rope_dim:
        within = within[partial_rotary_order(d, a.rope_dim)]
    q_stride = 2 * d if gated else d
    q_end = h * q_stride
    parts = [(torch.arange(h)[:, None] * q_stride + within).reshape(-1),
             (q_end + torch.arange(kvh)[:, None] * d + within).reshape(-1),
             torch.arange(q_end + kvh * d, q_end + 2 * kvh * d)]
    if gated:
        parts.append((torch.arange(h)[:, None] * q_stride + d + j).reshape(-1))
    return torch.cat(parts)


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
                  device: str | torch.device = "cpu", encoded: bool = False,
                  int8: bool = False) -> TransformerWeights:
    """The model's tensors from the file, in the file's row order (llama's q/k: ``qk_perm``).

    encoded: every matrix stays in its GGUF encoding, a view of the mapped file (``QuantWeight``; types with
    no kernels are converted to Q8_0 once: ``encoded_weight``), the norms and biases in fp32 on the CPU.
    Otherwise every tensor is dequantized to ``dtype`` on ``device``; with int8 each matrix (the embedding table
    too) then becomes int8 rows and a scale a row (``Int8Weight``), one at a time.
    """
    a, src = contents.args, contents.tensors
    converted: list[str] = []

    def tensor(name: str, dt: torch.dtype = dtype, dev: str | torch.device = device) -> torch.Tensor:
        w = src[name].reshape(src.shape(name))
        _check_finite(contents.path, name, w, dt)
        return torch.from_numpy(w).to(device=dev, dtype=dt)

    def matrix(name: str) -> torch.Tensor | QuantWeight | Int8Weight:
        if encoded:
            return encoded_weight(contents, name, converted)
        if int8:  # rounded on the host, a panel of rows at a time: the device holds the int8 rows alone
            return Int8Weight.of(tensor(name, torch.float32, "cpu"), dtype).to(device)
        return tensor(name)

    def experts(name: str) -> torch.Tensor | tuple[QuantWeight, ...]:
        return encoded_experts(contents, name, converted) if encoded else tensor(name)

    # the vectors (norms, biases): dequantized in both cases (fp32 on the CPU when encoded)
    # [n], or [1, n] as some converters write a one-row Linear (qwen2moe's ffn_gate_inp_shexp; llama.cpp reads both)
    vector = (lambda n: tensor(n, torch.float32, "cpu").reshape(-1)) if encoded else (lambda n: tensor(n).reshape(-1))
    small = (lambda n: tensor(n, torch.float32, "cpu")) if encoded else tensor
    read = {f: vector for f in VECTORS} | {f: experts for f in EXPERT_STACKS} | {f: small for f in SMALL_TENSORS}
    layers = [BlockWeights(**{f: read.get(f, matrix)(f"blk.{i}.{n}") for f, n in spec.tensors().items()})
              for i, spec in enumerate(a.blocks)]
    weights = TransformerWeights(
        tok_embeddings=matrix(MODEL_TENSORS["tok_embeddings"]),
        norm=vector(MODEL_TENSORS["norm"]),
        output=None if a.tie_embeddings else matrix(MODEL_TENSORS["output"]),
        layers=layers, qkv_perm=qk_perm(a))
    if converted:
        print(f"ktquest: {len(converted)} tensor(s) of a type with no kernels converted to Q8_0 at load "
              f"({', '.join(sorted(set(converted)))})", file=sys.stderr)
    return weights


def encoded_weight(contents: GGUFContents, name: str, converted: list[str]) -> QuantWeight:
    """Tensor ``name`` as a ``QuantWeight``: a view of the mapped file, its blocks checked for non-finite
    scales; a type with no kernels (Q2_K, Q3_K, IQ*, ...) is dequantized and re-encoded as Q8_0 (its type
    appended to ``converted``)."""
    src = contents.tensors
    raw = src.raw(name)
    rows, cols = src.shape(name)
    t = raw.tensor_type.name
    if t not in GGML_TYPES:
        if cols % 32:
            raise GGUFError(f"{contents.path}: tensor {name!r} has type {t}, which has no kernels, and rows of "
                            f"{cols} values cannot be re-encoded as Q8_0 (blocks of 32)")
        w = src[name].reshape(rows, cols)
        _check_finite(contents.path, name, w, torch.float32)
        converted.append(t)
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        return QuantWeight(parts=(("Q8_0", np.ascontiguousarray(data, dtype=np.uint8)),), in_features=cols)
    data = np.asarray(raw.data).view(np.uint8).reshape(rows, -1)
    bad = nonfinite_blocks(t, data)
    if bad:
        raise GGUFError(f"{contents.path}: tensor {name!r} holds {bad} non-finite {t} "
                        f"{'values' if t in ('F32', 'F16', 'BF16') else 'block scales'}; a model's weights must "
                        f"be finite")
    return QuantWeight(parts=((t, data),), in_features=cols)


def encoded_experts(contents: GGUFContents, name: str, converted: list[str]) -> tuple[QuantWeight, ...]:
    """A stack of experts [n_experts, rows, cols] as one ``QuantWeight`` an expert, each a view of its rows of the
    mapped file: an expert's pages are read when a token is first routed to it, so its blocks are not scanned
    for non-finite scales here (that would read every expert; a non-finite expert output is caught by the next
    layer's check of q). A type with no kernels is re-encoded as Q8_0, expert by expert (``encoded_weight``)."""
    src = contents.tensors
    raw = src.raw(name)
    n, rows, cols = src.shape(name)
    t = raw.tensor_type.name
    if t not in GGML_TYPES:
        if cols % 32:
            raise GGUFError(f"{contents.path}: tensor {name!r} has type {t}, which has no kernels, and rows of "
                            f"{cols} values cannot be re-encoded as Q8_0 (blocks of 32)")
        w = src[name].reshape(n, rows, cols)
        _check_finite(contents.path, name, w, torch.float32)
        converted.append(t)
        return tuple(QuantWeight(parts=(("Q8_0", np.ascontiguousarray(
            gguf.quants.quantize(w[e], gguf.GGMLQuantizationType.Q8_0), dtype=np.uint8)),), in_features=cols)
            for e in range(n))
    data = np.asarray(raw.data).view(np.uint8).reshape(n, rows, -1)  # [n_experts, rows, row_bytes]
    return tuple(QuantWeight(parts=((t, data[e]),), in_features=cols) for e in range(n))


# Where each block type keeps its fp16 scales: (block bytes, offsets of the fp16 fields). A quantized weight is
# finite exactly when these are (the quants are small integers).
_SCALE_FIELDS = {"Q8_0": (34, (0,)), "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)),
                 "Q5_1": (24, (0, 2)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def nonfinite_blocks(t: str, data: np.ndarray) -> int:
    """How many values (F32/F16/BF16) or block scales (the quantized types) of ``data`` (uint8 [rows,
    row_bytes] in encoding ``t``) are NaN or infinite."""
    if t == "F32":
        return int(np.count_nonzero(~np.isfinite(data.view(np.float32))))
    if t in ("F16", "BF16"):
        mask = 0x7C00 if t == "F16" else 0x7F80  # all exponent bits set: inf or NaN
        return int(np.count_nonzero((data.view(np.uint16) & mask) == mask))
    block, offsets = _SCALE_FIELDS[t]
    blocks = data.reshape(-1, block)
    return sum(int(np.count_nonzero((blocks[:, o:o + 2].copy().view(np.uint16) & 0x7C00) == 0x7C00))
               for o in offsets)


FILE = "file"  # build_model's dual_chunk: the file's own


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_seq_len: int = 0,
               encoded: bool = False,
               rope_scaling: RopeScaling | None = None,
               dual_chunk: DualChunk | None | str = FILE, int8: bool = False) -> tuple[Transformer, GGUFContents]:
    """Read ``path`` and build the model on ``device``/``dtype``; returns (model, contents).

    max_seq_len: positions the RoPE tables cover; 0 = the trained context length (``resolve_max_seq_len``).
    encoded: the matrices stay in their GGUF encoding (``model_weights``; the CPU in fp32 only).
    rope_scaling, dual_chunk, int8: ``build_model``'s.
    """
    contents = read_gguf(path)
    return build_model(contents, device, dtype, max_seq_len, encoded, rope_scaling, dual_chunk, int8), contents


def build_model(contents: GGUFContents, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                max_seq_len: int = 0, encoded: bool = False,
                rope_scaling: RopeScaling | None = None,
                dual_chunk: DualChunk | None | str = FILE, int8: bool = False) -> Transformer:
    """The model of a file ``read_gguf`` has read and checked, on ``device``/``dtype`` (RoPE tables for
    ``max_seq_len`` positions; 0 = the trained context length: ``resolve_max_seq_len``).

    rope_scaling: None = the file's; else it replaces the file's in the model's args (the config's dynamic
    NTK, which no GGUF file can express: ``Config.rope_scaling``).
    dual_chunk: the file's dual chunk attention (``FILE``: its keys, or a known 1M release's), another, or None
    (off). A model whose positions end inside the first chunk has none (there DCA is plain attention), nor one
    with sliding-window or recurrent layers. Its cache is made with ``model.args.dual_chunk``.
    int8: the matrices as int8 rows (``model_weights``; not with encoded, nor for experts' stacks).
    """
    if encoded and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(f"weights in their GGUF encoding run on the CPU in float32, not {device}/{dtype}")
    if int8 and (encoded or any(b.ffn == "moe" for b in contents.args.blocks)):
        raise ValueError("int8 weights: dequantized, and for a model without experts (their stacks stay whole)")
    weights = model_weights(contents, dtype, device, encoded, int8)
    args = contents.args
    if rope_scaling is not None:
        args = dataclasses.replace(args, rope_scaling=rope_scaling)
    dc = args.dual_chunk if isinstance(dual_chunk, str) else dual_chunk
    if dc is not None and not dc.active(resolve_max_seq_len(args, max_seq_len)):
        dc = None
    if dc is not None and any(b.mixer != "attention" or b.attention != "global" for b in args.blocks):
        dc = None  # (sliding windows and recurrent layers do not take it: resolve_dual_chunk says so)
    args = dataclasses.replace(args, dual_chunk=dc)
    return Transformer(args, weights, max_seq_len=max_seq_len).eval()
