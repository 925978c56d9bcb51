#!/usr/bin/env python3
"""Write a GGUF shaped like a real model: its tensor names, shapes and ggml types, random weights.

For speed and memory work on models the size people run, without downloading them. The file has what
llama.cpp's converter (convert_hf_to_gguf.py) and quantizer (llama-quantize) would write for the model:

- tensors: ``token_embd``, per block ``attn_norm``, ``attn_q/k/v`` (+ ``.bias`` for qwen2), ``attn_output``,
  (qwen3: ``attn_k_norm``, ``attn_q_norm`` over head_dim), ``ffn_norm``, ``ffn_gate/up/down`` (qwen3moe: the
  router ``ffn_gate_inp`` [experts, dim] in F32 and the stacks ``ffn_gate_exps/ffn_up_exps`` [experts, ffn, dim],
  ``ffn_down_exps`` [experts, dim, ffn]), then ``output_norm`` and ``output`` (absent when the embeddings are
  tied);
- types: the ``--type`` mix as llama-quantize picks it (llama-quant.cpp, ``llama_tensor_get_type``): for
  Q4_K_M most matrices Q4_K; ``attn_v`` and ``ffn_down`` Q6_K in the layers ``use_more_bits`` picks (the
  first and last eighth, and every third one between: about half); ``output`` Q6_K, and ``token_embd`` too
  when it is tied to the output; a matrix whose rows are not whole 256-blocks falls back (Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0; the tied/untied output -> Q8_0): Qwen2.5-0.5B's 896 columns do. An expert
  stack takes its dense kind's type (llama-quantize matches ``ffn_down`` in ``ffn_down_exps``; its 8-expert
  special cases do not apply to 128). Norms, biases and the router are F32;
- metadata: the converter's keys for the architecture (``attention.key_length``/``value_length`` where
  head_dim is not dim / heads; ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``),
  ``general.file_type`` and
  ``general.quantization_version`` 2, and the tokenizer of ``--tokenizer`` (default: the bundled SmolLM2)
  with its token list padded to the model's vocabulary with ``[PAD<id>]`` tokens of type UNUSED, as the
  converter pads Qwen's 151,665 tokens to 151,936. The padding tokens' rows of ``token_embd`` and ``output``
  are 10x smaller, as untrained rows are, so greedy text is made of real tokens.

Weights are random blocks with sane scales (random_blocks.py): dequantized std ~0.02 for the matrices,
norm weights ~1, biases std 0.05, no NaN/Inf. Tensors are streamed to disk in chunks; memory stays small.

Shapes (hyper-parameters from each model's config.json; copies of the official files where noted):

| --shape        | arch     | dim  | layers | heads/kv | ffn   | vocab  | rope theta | context   | eps   | tied |
|----------------|----------|------|--------|----------|-------|--------|------------|-----------|-------|------|
| qwen2.5-0.5b   | qwen2    | 896  | 24     | 14/2     | 4864  | 151936 | 1e6        | 32768     | 1e-6  | yes  |
| qwen2.5-1.5b   | qwen2    | 1536 | 28     | 12/2     | 8960  | 151936 | 1e6        | 32768     | 1e-6  | yes  |
| qwen2.5-7b     | qwen2    | 3584 | 28     | 28/4     | 18944 | 152064 | 1e6        | 32768     | 1e-6  | no   |
| qwen2.5-7b-1m  | qwen2    | 3584 | 28     | 28/4     | 18944 | 152064 | 1e7        | 1010000   | 1e-5  | no   |
| qwen2.5-14b    | qwen2    | 5120 | 48     | 40/8     | 13824 | 152064 | 1e6        | 32768     | 1e-6  | no   |
| qwen2.5-14b-1m | qwen2    | 5120 | 48     | 40/8     | 13824 | 152064 | 1e7        | 1010000   | 1e-5  | no   |
| llama3-8b      | llama    | 4096 | 32     | 32/8     | 14336 | 128256 | 5e5        | 8192      | 1e-5  | no   |
| smollm2-135m   | llama    | 576  | 30     | 9/3      | 1536  | (tok.) | 1e5        | 8192      | 1e-5  | yes  |
| qwen3-4b-2507  | qwen3    | 2560 | 36     | 32/8     | 9728  | 151936 | 5e6        | 262144    | 1e-6  | yes  |
| qwen3-8b       | qwen3    | 4096 | 36     | 32/8     | 12288 | 151936 | 1e6        | 40960     | 1e-6  | no   |
| qwen3-30b-a3b  | qwen3moe | 2048 | 48     | 32/4     | 6144  | 151936 | 1e7        | 262144    | 1e-6  | no   |
| tiny           | qwen2    | 256  | 4      | 4/2      | 640   | (tok.) | 1e6        | 4096      | 1e-6  | yes  |
| tiny-moe       | qwen3moe | 256  | 4      | 4/2      | 640   | (tok.) | 1e6        | 4096      | 1e-6  | no   |

The qwen3 shapes' head_dim is 128 (so q is 32 x 128 = 4096 wide on a 2560 or 2048 width); qwen3-30b-a3b has
128 experts of width 768, 8 used a token (the 2507 Instruct's config; 30.5B parameters, 3.3B active);
tiny-moe has head_dim 64 and 5 experts of width 320, 2 used.

Sources (Instruct configs; 0.5B/1.5B/7B/14B/7B-1M/Llama-3 through copies that name the original in
``_name_or_path``):
  qwen2.5-0.5b    huggingface.co/unsloth/Qwen2.5-0.5B-Instruct/blame/00bafb7cd8d700177637919923d0e579fe0cfa5f/config.json
  qwen2.5-1.5b    huggingface.co/onnx-community/Qwen2.5-1.5B-Instruct/blob/94677ac90364afdc2b476788d085a9680efde737/config.json
  qwen2.5-7b      huggingface.co/osllmai-community/Qwen2.5-7B-Instruct/blob/main/config.json
  qwen2.5-7b-1m   huggingface.co/AIFunOver/Qwen2.5-7B-Instruct-1M-openvino-8bit/blob/main/config.json
  qwen2.5-14b     huggingface.co/osllmai-community/Qwen2.5-14B-Instruct/blob/eaddfa685697f74aa707d6cd5cf36784cdcabe05/config.json
  qwen2.5-14b-1m  huggingface.co/Qwen/Qwen2.5-14B-Instruct-1M/blob/d5c878c4e4970d754350de81bb78658bb2748dc4/config.json
  llama3-8b       huggingface.co/zakkosi/jhcode-meta-llama3_eng/blob/main/config.json (Meta-Llama-3-8B-Instruct)
  qwen3-4b-2507   huggingface.co/Qwen/Qwen3-4B-Instruct-2507/blob/main/config.json (as quoted in a model card copy:
                  github.com/akougkas/warpio-cli warpio-docs/ai-docs/model_cards/qwen3:4b.md)
  qwen3-8b        huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
  qwen3-30b-a3b   huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507/blob/main/config.json (its values as public
                  test configs quote them; the model card: 48 layers, 32/4 heads, 128 experts, 8 active)
The hybrid shapes (``qwen3.5-9b``, ``qwen3.5-35b-a3b``, ``tiny-hybrid``: Gated DeltaNet layers) are in
shaped_hybrid.py with their tensors, the fused ones (``glm4-9b-1m``, ``phi3.5-mini``) in shaped_glm_phi.py.
``smollm2-135m`` is the bundled model's shape, for a machine that has only its tokenizer (a GPU machine the
98 MB file cannot travel to). ``tiny`` is ours: small dims for tests, ``ffn`` not whole 256-blocks (``ffn_down``
takes the fallback types), the tokenizer's vocabulary. A check of the mix: the qwen2.5-7b file is
4,681,224,608 bytes; the published Qwen2.5-7B-Instruct-Q4_K_M.gguf files are 4.68 GB
(huggingface.co/bartowski/Qwen2.5-7B-Instruct-GGUF, lmstudio-community/Qwen2.5-7B-Instruct-GGUF). The qwen3
files: 2.495 GB (4B-2507; published Q4_K_M 2.50 GB), 5.026 GB (8B; 5.03 GB), 18.555 GB (30B-A3B; 18.56 GB,
17.28 GiB). Examples:

    python tools/make_shaped_gguf.py --shape qwen2.5-1.5b --out /work/shaped/qwen2.5-1.5b-q4_k_m.gguf
    python tools/make_shaped_gguf.py --shape qwen2.5-7b-1m --context 131072 --out /tmp/q7-1m.gguf
    python tools/make_shaped_gguf.py --shape qwen2.5-0.5b --plan     # the tensor table only
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_blocks import random_blocks  # noqa: E402
from shaped_glm_phi import Fused, add_fused_metadata, display_name, fused_block_plans, rope_factor_plans  # noqa: E402
from shaped_hybrid import Hybrid, add_hybrid_metadata, mixer_plans, shared_expert_plans  # noqa: E402

Q = gguf.GGMLQuantizationType
WEIGHT_STD = 0.02  # of the dequantized matrices (a trained model's order of magnitude)
NORM_STD = 0.05  # norm weights: 1 +- this
BIAS_STD = 0.05
PAD_ROW_STD = 0.002  # embedding/output rows of the padding tokens: untrained, so greedy text is real tokens
CHUNK_BYTES = 32 << 20  # how much of a tensor is generated at a time


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # "qwen2" (attention biases) | "llama" | "qwen3" (QK-norm) | "qwen3moe" (QK-norm, experts)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int | None  # None: the tokenizer's own size
    rope_theta: float
    context: int
    eps: float
    tied: bool
    head_dim: int | None = None  # None: dim // n_heads (qwen3's is 128 whatever the width)
    experts: tuple[int, int, int] | None = None  # (expert_count, expert_used_count, expert ffn): qwen3moe
    hybrid: Hybrid | None = None  # qwen35, qwen35moe: the DeltaNet layers (shaped_hybrid.py)
    fused: Fused | None = None  # chatglm, phi3: fused q | k | v and gate | up (shaped_glm_phi.py)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 1e6, 32768, 1e-6, True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, 1e6, 32768, 1e-6, True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, 1e6, 32768, 1e-6, False),
    "qwen2.5-7b-1m": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, 1e7, 1010000, 1e-5, False),
    "qwen2.5-14b": Shape("qwen2", 5120, 48, 40, 8, 13824, 152064, 1e6, 32768, 1e-6, False),
    "qwen2.5-14b-1m": Shape("qwen2", 5120, 48, 40, 8, 13824, 152064, 1e7, 1010000, 1e-5, False),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 5e5, 8192, 1e-5, False),
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 1536, None, 1e5, 8192, 1e-5, True),
    "qwen3-4b-2507": Shape("qwen3", 2560, 36, 32, 8, 9728, 151936, 5e6, 262144, 1e-6, True, 128),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 12288, 151936, 1e6, 40960, 1e-6, False, 128),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 6144, 151936, 1e7, 262144, 1e-6, False, 128,
                           (128, 8, 768)),
    "qwen3.5-0.8b": Shape("qwen35", 1024, 24, 8, 2, 3584, 248320, 1e7, 262144, 1e-6, True, 256,
                          hybrid=Hybrid(16, 16, 128, 128, 64)),
    "qwen3.5-9b": Shape("qwen35", 4096, 32, 16, 4, 12288, 248320, 1e7, 262144, 1e-6, False, 256,
                        hybrid=Hybrid(16, 32, 128, 128, 64)),
    "qwen3.5-35b-a3b": Shape("qwen35moe", 2048, 40, 16, 2, 512, 248320, 1e7, 262144, 1e-6, False, 256,
                             (256, 8, 512), Hybrid(16, 32, 128, 128, 64, shared_ffn=512)),
    "glm4-9b-1m": Shape("chatglm", 4096, 40, 32, 4, 13696, 151552, 1e8, 1048576, 1.5625e-7, False,
                        fused=Fused(64, True)),
    "phi3.5-mini": Shape("phi3", 3072, 32, 32, 32, 8192, None, 1e4, 131072, 1e-5, False, fused=Fused(96, False, 4096)),
    "tiny-hybrid": Shape("qwen35", 256, 4, 4, 2, 640, None, 1e6, 4096, 1e-6, False, 64,
                         hybrid=Hybrid(2, 4, 32, 32, 16)),
    "tiny": Shape("qwen2", 256, 4, 4, 2, 640, None, 1e6, 4096, 1e-6, True),
    "tiny-moe": Shape("qwen3moe", 256, 4, 4, 2, 640, None, 1e6, 4096, 1e-6, False, 64, (5, 2, 320)),
}

# --type -> (the default type of the matrices, general.file_type)
FTYPES = {
    "Q4_K_M": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}
# llama-quant.cpp's tensor_type_fallback for a row that is not whole blocks of the chosen type
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols] or [n]
    qtype: Q
    std: float
    mean: float = 0.0
    pad_rows_from: int | None = None  # rows from here on are padding tokens' (std PAD_ROW_STD)

    @property
    def n_blocks(self) -> int:
        block, _ = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block

    @property
    def nbytes(self) -> int:
        return self.n_blocks * gguf.GGML_QUANT_SIZES[self.qtype][1]


# ---- which type each tensor gets ----


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp: the layers whose attn_v / ffn_down get more bits in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def matrix_type(kind: str, layer: int, n_layers: int, cols: int, ftype: str, tied: bool) -> Q:
    """The type llama-quantize gives a matrix of ``cols`` columns (llama_tensor_get_type, non-MoE, non-Falcon)."""
    default = FTYPES[ftype][0]
    qtype = default
    if kind == "output" or (kind == "token_embd" and tied):
        if cols % gguf.GGML_QUANT_SIZES[default][0]:
            qtype = Q.Q8_0
        elif default != Q.Q8_0:
            qtype = Q.Q6_K
    elif kind in ("attn_v", "ffn_down") and ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
        qtype = Q.Q6_K
    elif kind == "attn_qkv" and ftype in ("Q4_K_M", "Q5_K_M"):  # (a fused qkv: one step up)
        qtype = Q.Q5_K if ftype == "Q4_K_M" else Q.Q6_K
    if cols % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, Q.F16)
        if cols % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16
    return qtype


def plan_tensors(shape: Shape, ftype: str, vocab: int, n_tokens: int | None = None) -> list[TensorPlan]:
    """Every tensor of the file, in the order written: names, shapes, types, target statistics. Rows
    ``n_tokens`` and on of the embeddings and the output are padding tokens'."""
    dim, n = shape.dim, shape.n_layers
    q_dim, kv_dim = shape.head_size * shape.n_heads, shape.head_size * shape.n_kv_heads

    def matrix(name: str, kind: str, layer: int, rows: int, cols: int) -> TensorPlan:
        return TensorPlan(name, (rows, cols), matrix_type(kind, layer, n, cols, ftype, shape.tied), WEIGHT_STD)

    def norm(name: str, size: int) -> TensorPlan:
        return TensorPlan(name, (size,), Q.F32, NORM_STD, 1.0)

    def vector(name: str, size: tuple, mean: float, std: float) -> TensorPlan:
        return TensorPlan(name, size, Q.F32, std, mean)

    pad = None if n_tokens is None or n_tokens >= vocab else n_tokens
    plans = [replace(matrix("token_embd.weight", "token_embd", 0, vocab, dim), pad_rows_from=pad)]
    plans += rope_factor_plans(shape.fused, TensorPlan) if shape.fused is not None else []
    for i in range(n):
        p = f"blk.{i}."
        plans.append(norm(p + "attn_norm.weight", dim))
        if shape.hybrid is not None:  # the mixer, then the FFN after post_attention_norm
            plans += mixer_plans(shape, shape.hybrid, i, matrix, norm, vector)
            plans.append(norm(p + "post_attention_norm.weight", dim))
            if shape.hybrid.shared_ffn:
                plans += shared_expert_plans(shape, shape.hybrid, i, matrix, vector)
            plans += _ffn_plans(shape, i, matrix)
            continue
        if shape.fused is not None:  # the fused attention and FFN
            plans += fused_block_plans(shape, shape.fused, i, matrix, norm, vector)
            continue
        for proj, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            plans.append(matrix(p + proj + ".weight", proj, i, rows, dim))
            if shape.arch == "qwen2":
                plans.append(TensorPlan(p + proj + ".bias", (rows,), Q.F32, BIAS_STD))
        plans.append(matrix(p + "attn_output.weight", "attn_output", i, dim, q_dim))
        if shape.arch in ("qwen3", "qwen3moe"):
            plans += [norm(p + "attn_k_norm.weight", shape.head_size), norm(p + "attn_q_norm.weight", shape.head_size)]
        plans.append(norm(p + "ffn_norm.weight", dim))
        plans += _ffn_plans(shape, i, matrix)
    plans.append(norm("output_norm.weight", dim))
    if not shape.tied:
        plans.append(replace(matrix("output.weight", "output", n, vocab, dim), pad_rows_from=pad))
    return plans


def _ffn_plans(shape: Shape, i: int, matrix) -> list[TensorPlan]:
    """Layer i's FFN: SwiGLU, or the router (F32: llama-quantize skips ffn_gate_inp) and the expert stacks, each
    typed as its dense kind."""
    p, dim, ffn = f"blk.{i}.", shape.dim, shape.ffn
    if shape.experts is None:
        return [matrix(p + "ffn_gate.weight", "ffn_gate", i, ffn, dim), matrix(p + "ffn_up.weight", "ffn_up", i, ffn, dim),
                matrix(p + "ffn_down.weight", "ffn_down", i, dim, ffn)]
    n_exp, _, width = shape.experts
    plans = [TensorPlan(p + "ffn_gate_inp.weight", (n_exp, dim), Q.F32, WEIGHT_STD)]
    for kind, rows, cols in (("ffn_gate", width, dim), ("ffn_up", width, dim), ("ffn_down", dim, width)):
        plans.append(replace(matrix(p + kind + "_exps.weight", kind, i, rows, cols), shape=(n_exp, rows, cols)))
    return plans


# ---- metadata ----


def _gguf_type(value) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """The converter's type for a tokenizer value: ids UINT32, token types INT32, scores FLOAT32."""
    T = gguf.GGUFValueType
    scalar = {bool: T.BOOL, int: T.UINT32, float: T.FLOAT32, str: T.STRING}
    if isinstance(value, list):
        first = value[0] if value else ""
        return T.ARRAY, {int: T.INT32, float: T.FLOAT32, str: T.STRING}[type(first)]
    return scalar[type(value)], None


def tokenizer_fields(path: Path) -> tuple[dict, int]:
    """The ``tokenizer.*`` keys of ``path`` (plain values) and its token count."""
    # ktquest's bounded reader parses the 150k-entry token lists several times faster than the stock one
    from ktquest.formats.gguf import open_gguf

    md = {k: v for k, v in open_gguf(path).metadata.items() if k.startswith("tokenizer.")}
    if not md.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{path}: no tokenizer.ggml.tokens; pass a GGUF with a tokenizer as --tokenizer")
    return md, len(md["tokenizer.ggml.tokens"])


def pad_tokenizer(md: dict, n_tokens: int, vocab: int) -> list[tuple]:
    """The tokenizer keys with the token list padded to ``vocab`` by UNUSED ``[PAD<id>]`` tokens, as the
    converter pads Qwen's; as (key, value, type, sub_type) for GGUFWriter.add_key_value."""
    md = dict(md)
    pad = vocab - n_tokens
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [f"[PAD{i}]" for i in range(n_tokens, vocab)]
    if "tokenizer.ggml.token_type" in md:
        md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [int(gguf.TokenType.UNUSED)] * pad
    if "tokenizer.ggml.scores" in md:
        md["tokenizer.ggml.scores"] = md["tokenizer.ggml.scores"] + [0.0] * pad
    return [(k, v, *_gguf_type(v)) for k, v in md.items()]


def add_model_metadata(w: gguf.GGUFWriter, shape: Shape, name: str, ftype: str, context: int) -> None:
    """What convert_hf_to_gguf.py writes for the architecture, plus the quantizer's file type."""
    w.add_type("model")
    w.add_name(f"shaped {display_name(name)} (random weights)")
    w.add_block_count(shape.n_layers)
    w.add_context_length(context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    if shape.arch == "llama":
        w.add_rope_dimension_count(shape.head_size)
    if shape.head_dim is not None:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.experts is not None:
        n_exp, used, width = shape.experts
        w.add_expert_count(n_exp)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(width)
    if shape.hybrid is not None:
        add_hybrid_metadata(w, shape, shape.hybrid)
    if shape.fused is not None:
        add_fused_metadata(w, shape, shape.fused)
    w.add_file_type(int(FTYPES[ftype][1]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ---- writing ----


def write_tensor(fout, plan: TensorPlan, rng: np.random.Generator) -> None:
    """Stream ``plan``'s random blocks to ``fout`` in chunks of about CHUNK_BYTES."""
    type_size = gguf.GGML_QUANT_SIZES[plan.qtype][1]
    step = max(1, CHUNK_BYTES // type_size)
    end = plan.n_blocks
    split = end if plan.pad_rows_from is None else plan.pad_rows_from * (end // plan.shape[0])
    for lo, hi, std in ((0, split, plan.std), (split, end, PAD_ROW_STD)):
        for start in range(lo, hi, step):
            n = min(step, hi - start)
            if plan.qtype == Q.F32:
                blocks = random_blocks(plan.qtype, rng, n, std).view(np.float32) + np.float32(plan.mean)
            else:
                blocks = random_blocks(plan.qtype, rng, n, std)
            fout.write(memoryview(np.ascontiguousarray(blocks)).cast("B"))


def write_shaped_gguf(out: Path, shape: Shape, name: str, ftype: str = "Q4_K_M", context: int | None = None,
                      tokenizer: Path | None = None, seed: int = 0) -> list[TensorPlan]:
    """Write ``shape`` (called ``name`` in general.name) to ``out`` through ``out.part``, renamed when
    complete; returns the plan of its tensors."""
    if tokenizer is None:
        from ktquest.formats.bundled import bundled_model_path
        tokenizer = bundled_model_path()
    tok_fields, n_tokens = tokenizer_fields(Path(tokenizer))
    vocab = n_tokens if shape.vocab is None else shape.vocab
    if vocab < n_tokens:
        raise ValueError(f"{tokenizer}: the tokenizer has {n_tokens} tokens, more than the shape's "
                         f"vocabulary {vocab}")
    tok_fields = pad_tokenizer(tok_fields, n_tokens, vocab)
    plans = plan_tensors(shape, ftype, vocab, n_tokens)
    need = sum(p.nbytes for p in plans) + (64 << 20)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise OSError(f"{out.parent}: {need / 2**30:.2f} GiB needed for {out.name}, {free / 2**30:.2f} GiB free")

    part = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(part, shape.arch)
    add_model_metadata(w, shape, name, ftype, context or shape.context)
    for key, value, vtype, sub in tok_fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]  # GGUFWriter writes whole tensors only; the data section is streamed here instead
    try:
        for index, p in enumerate(plans):
            w.write_padding(fout, fout.tell())  # each tensor starts on the file's alignment
            write_tensor(fout, p, np.random.Generator(np.random.SFC64([seed, index])))
            w.write_padding(fout, p.nbytes)
    finally:
        w.close()
    os.replace(part, out)
    return plans


def print_plan(plans: list[TensorPlan]) -> None:
    for p in plans:
        print(f"{p.name:28s} {p.qtype.name:5s} {list(p.shape)!s:16s} {p.nbytes / 2**20:9.2f} MiB")
    mix = Counter(p.qtype.name for p in plans)
    print(f"{len(plans)} tensors, {sum(p.nbytes for p in plans) / 1e9:.3f} GB of data; "
          + ", ".join(f"{k} {v}" for k, v in sorted(mix.items())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, help="the GGUF to write (required unless --plan)")
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(FTYPES), help="the quantization mix (default Q4_K_M)")
    ap.add_argument("--context", type=int, help="context_length to record (default: the model's trained context)")
    ap.add_argument("--tokenizer", type=Path, help="GGUF whose tokenizer to copy (default: the bundled SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", action="store_true", help="print the tensor table and exit (nothing is written)")
    args = ap.parse_args(argv)
    if args.context is not None and args.context < 1:
        ap.error(f"--context must be >= 1, got {args.context}")
    if args.plan:
        vocab = SHAPES[args.shape].vocab
        if vocab is None:
            ap.error(f"--plan: shape {args.shape!r} takes its vocabulary from the tokenizer; write it instead")
        print_plan(plan_tensors(SHAPES[args.shape], args.type, vocab))
        return 0
    if args.out is None:
        ap.error("--out is required (or --plan)")
    t0 = time.perf_counter()
    try:
        plans = write_shaped_gguf(args.out, SHAPES[args.shape], args.shape, args.type, args.context,
                                  args.tokenizer, args.seed)
    except (OSError, ValueError) as e:
        print(f"make_shaped_gguf: error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    size = args.out.stat().st_size
    mix = Counter(p.qtype.name for p in plans)
    print(f"{args.out}: {args.shape} {args.type}, {len(plans)} tensors ("
          + ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
          + f"), {size / 1e9:.3f} GB in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
