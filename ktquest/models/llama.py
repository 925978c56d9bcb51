"""The transformer every family runs: Transformer -> Block -> Attention / FeedForward / RMSNorm, each block as
its ``BlockSpec`` says (models/block.py); and the llama family (``llama``, ``qwen2``, ``internlm2``), whose
``FAMILY`` reads its blocks from a GGUF file's metadata (models/gemma3.py is another family).

Batch size is always 1, so activations are [T, ...] with no batch dimension. Weights arrive in the
Hugging Face layout under the model's own names (``models/loader.py`` maps GGUF names and un-permutes
llama's and internlm2's Q/K), so RoPE is rotate-half for every arch: rotary pair i is (dim i, dim i + D/2).
Attention itself lives behind ``cache.attend`` (``ktquest.kv.base.KVCache``): the model computes q, k, v and
RoPE, the cache stores k/v and returns causal attention over everything it holds (dense or sparse).

This is the reference path (prefill chunks, CUDA, dequantized weights). The CPU decode step on the weights
in their GGUF encoding runs the same math natively: ``ktquest.native.decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ktquest.formats.gguf import GGUFTensors
from ktquest.kv.base import KVCache
from ktquest.layers.linear import Embedding, Int8Weight, Linear, QuantWeight, stack_rows
from ktquest.models.args import Family, Metadata, ModelArgs, resolve_max_seq_len
from ktquest.models.block import BIAS_TENSORS, BlockSpec
from ktquest.models.delta_net import GatedDeltaNet
from ktquest.models.ffn import FeedForward, MoEFeedForward
from ktquest.models.rope import apply_rope, partial_rotary_order, rope_tables, rope_variants

# a dequantized tensor, the file's encoding read in place, or int8 rows (layers/linear.py)
Matrix = torch.Tensor | QuantWeight | Int8Weight


@dataclass(slots=True)
class BlockWeights:
    """One block's tensors, [out, in] for matrices, in the file's row order (llama q/k: ``qkv_perm``)."""

    attn_norm: torch.Tensor  # [dim]
    ffn_norm: torch.Tensor  # [dim]
    wq: Matrix | None = None  # [H*D, dim] ([2*H*D, dim]: q and its gate per head, BlockSpec.attn_gate)
    wk: Matrix | None = None  # [KVH*D, dim]
    wv: Matrix | None = None  # [KVH*D, dim]
    wo: Matrix | None = None  # [dim, H*D]
    w_gate: Matrix | None = None  # [ffn, dim] (a dense FFN)
    w_up: Matrix | None = None  # [ffn, dim]
    w_down: Matrix | None = None  # [dim, ffn]
    wqkv: Matrix | None = None  # [(H + 2 KVH) * D, dim]: q | k | v fused in the file (BlockSpec.fused_qkv)
    bqkv: torch.Tensor | None = None  # [(H + 2 KVH) * D]
    w_gate_up: Matrix | None = None  # [2 * ffn, dim]: gate | up fused in the file (BlockSpec.fused_gate_up)
    bq: torch.Tensor | None = None  # [H*D] (BlockSpec.qkv_bias)
    bk: torch.Tensor | None = None  # [KVH*D]
    bv: torch.Tensor | None = None  # [KVH*D]
    q_norm: torch.Tensor | None = None  # [D] (BlockSpec.qk_norm)
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [dim] (BlockSpec.sandwich_norms)
    post_ffn_norm: torch.Tensor | None = None  # [dim]
    # BlockSpec.ffn == "moe": the router, and the experts' stacks (a tensor, or a QuantWeight an expert)
    w_router: Matrix | None = None  # [E, dim]
    w_gate_exps: torch.Tensor | tuple[QuantWeight, ...] | None = None  # [E, ffn_e, dim]
    w_up_exps: torch.Tensor | tuple[QuantWeight, ...] | None = None  # [E, ffn_e, dim]
    w_down_exps: torch.Tensor | tuple[QuantWeight, ...] | None = None  # [E, dim, ffn_e]
    w_gate_shexp: Matrix | None = None  # [ffn_s, dim] (BlockSpec.shared_expert)
    w_up_shexp: Matrix | None = None  # [ffn_s, dim]
    w_down_shexp: Matrix | None = None  # [dim, ffn_s]
    shexp_gate: torch.Tensor | None = None  # [dim]
    # BlockSpec.mixer == "delta_net" (models/delta_net.py), in place of wq, wk, wv, wo
    w_in_qkv: Matrix | None = None  # [conv_dim, dim]
    w_in_z: Matrix | None = None  # [Hv*Dv, dim]
    w_beta: Matrix | None = None  # [Hv, dim]
    w_alpha: Matrix | None = None  # [Hv, dim]
    w_ba: Matrix | None = None  # [2 Hv, dim]: beta's and alpha's rows fused (DeltaNetSpec.grouped)
    ssm_a: torch.Tensor | None = None  # [Hv]
    ssm_dt: torch.Tensor | None = None  # [Hv]
    conv1d: torch.Tensor | None = None  # [conv_dim, K]
    ssm_norm: torch.Tensor | None = None  # [Dv]
    w_ssm_out: Matrix | None = None  # [dim, Hv*Dv]


@dataclass(slots=True)
class TransformerWeights:
    tok_embeddings: Matrix  # [V, dim]
    norm: torch.Tensor  # [dim]
    output: Matrix | None  # [V, dim]; None: tied to tok_embeddings
    layers: list[BlockWeights]
    # The gather from the file's q | k | v rows to the Hugging Face order, int64 [(H + 2 KVH) * D] (llama
    # files: models/loader.qk_perm), or None.
    qkv_perm: torch.Tensor | None = None


class DecodeStep(Protocol):
    """One decode token through the model: ``decode(token, cache)`` feeds ``token`` at ``cache.pos`` and
    returns its logits [V]. Two implementations: ``TorchDecoder`` (the model's forward pass: CUDA, dequantized
    weights) and ``ktquest.native.decode.NativeDecoder`` (the CPU on GGUF-encoded weights)."""

    def decode(self, token: int, cache: KVCache) -> torch.Tensor: ...


class TorchDecoder:
    """The decode step as the model's forward pass of one token."""

    def __init__(self, model: Transformer):
        self.model = model

    def decode(self, token: int, cache: KVCache) -> torch.Tensor:
        model = self.model
        x = torch.tensor([token], dtype=torch.long, device=model.device)  # [1]
        if x.device.type != "cpu":
            return model(x, cache.pos, cache)[0]
        # On the CPU a decode step is a few hundred tiny torch ops around the native GEMV and attention (which
        # use their own thread pool): each op would pay a fork/join of torch's threads for microseconds of
        # work, so torch runs them on one thread.
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return model(x, cache.pos, cache)[0]
        finally:
            torch.set_num_threads(n)


# ---- layers ----


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.shape = tuple(weight.shape)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Attention(nn.Module):
    """q, k, v from one fused projection [q (H*D) | k (KVH*D) | v (KVH*D) (| gate (H*D))], gathered into the
    rotate-half order (``loader.qk_perm``), with the block's biases, QK-norm and output gate (``BlockSpec``);
    attention is the cache's."""

    def __init__(self, args: ModelArgs, layer_idx: int, spec: BlockSpec, w: BlockWeights,
                 qkv_perm: torch.Tensor | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        if spec.fused_qkv:  # the file's own q | k | v
            wqkv, bqkv = w.wqkv, w.bqkv
        else:
            wqkv, bqkv = stack_rows(w.wq, w.wk, w.wv), torch.cat([w.bq, w.bk, w.bv]) if spec.qkv_bias else None
        self.wqkv = Linear(wqkv, bqkv, out_perm=qkv_perm)
        self.wo = Linear(w.wo)
        # a head's dims as the gather leaves them (partial rotary: rope.partial_rotary_order), for the QK-norms
        order = partial_rotary_order(args.head_dim, args.rope_dim) if args.rope_dim else slice(None)
        self.q_norm = RMSNorm(w.q_norm[order], args.norm_eps) if spec.qk_norm else None  # [D]
        self.k_norm = RMSNorm(w.k_norm[order], args.norm_eps) if spec.qk_norm else None  # [D]
        self.gated = spec.attn_gate
        self.dual_chunk = args.dual_chunk is not None  # cos/sin then [4, T, 1, D]: Transformer.rope_rows

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        out = self.wqkv(x)  # [T, (H + 2*KVH) * D (+ H*D)]
        qkv = out[:, : (h + 2 * kvh) * d].view(t, h + 2 * kvh, d)  # [T, H + 2*KVH, D]
        if self.dual_chunk:  # k once at its key position, q three ways (kv/dual_chunk_attention.py)
            q = qkv[:, :h] if self.q_norm is None else self.q_norm(qkv[:, :h])
            k = qkv[:, h: h + kvh] if self.k_norm is None else self.k_norm(qkv[:, h: h + kvh])
            k = apply_rope(k, cos[0], sin[0])  # [T, KVH, D]
            q = torch.stack([apply_rope(q, cos[i], sin[i]) for i in (1, 2, 3)])  # [3, T, H, D]
        elif self.q_norm is None:
            qk = apply_rope(qkv[:, : h + kvh], cos, sin)  # [T, H + KVH, D]: q and k rotated in one go
            q, k = qk[:, :h], qk[:, h:]  # [T, H, D], [T, KVH, D]
        else:
            q = apply_rope(self.q_norm(qkv[:, :h]), cos, sin)  # [T, H, D]
            k = apply_rope(self.k_norm(qkv[:, h: h + kvh]), cos, sin)  # [T, KVH, D]
        att = cache.attend(self.layer_idx, q, k, qkv[:, h + kvh:], start_pos).reshape(t, h * d)  # [T, H*D]
        if self.gated:
            att = att * torch.sigmoid(out[:, (h + 2 * kvh) * d:])
        return self.wo(att)  # [T, dim]


class Block(nn.Module):
    """Pre-norm residual block as its ``BlockSpec`` says: x + attn(norm(x)), then h + ffn(norm(h)), each
    sublayer's output normed first where the spec has sandwich norms."""

    def __init__(self, args: ModelArgs, layer_idx: int, w: BlockWeights, qkv_perm: torch.Tensor | None):
        super().__init__()
        spec = args.blocks[layer_idx]
        self.attn_norm = RMSNorm(w.attn_norm, args.norm_eps)
        # the mixer: attention over the cache's k/v, or a Gated DeltaNet over the cache's state
        self.attn = GatedDeltaNet(args, layer_idx, spec, w) if spec.mixer == "delta_net" else \
            Attention(args, layer_idx, spec, w, qkv_perm)
        self.ffn_norm = RMSNorm(w.ffn_norm, args.norm_eps)
        if spec.ffn == "moe":
            shared = ((w.w_gate_shexp, w.w_up_shexp, w.w_down_shexp, w.shexp_gate) if spec.shared_expert else None)
            self.ffn = MoEFeedForward(w.w_router, w.w_gate_exps, w.w_up_exps, w.w_down_exps, spec.n_experts_used,
                                      spec.norm_topk, shared)
        else:
            gate_up = w.w_gate_up if spec.fused_gate_up else stack_rows(w.w_gate, w.w_up)
            self.ffn = FeedForward(gate_up, w.w_down, spec.ffn)
        self.post_attn_norm = RMSNorm(w.post_attn_norm, args.norm_eps) if spec.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(w.post_ffn_norm, args.norm_eps) if spec.sandwich_norms else None
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), start_pos, cos, sin, cache)
        h = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        f = self.ffn(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class Transformer(nn.Module):
    """Token ids -> logits.  Built by ``models/loader.py`` from a GGUF file: embedding, the blocks (each as its
    ``BlockSpec`` says), final norm, head, RoPE tables."""

    def __init__(self, args: ModelArgs, weights: TransformerWeights, max_seq_len: int = 0):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(Block(args, i, w, weights.qkv_perm) for i, w in enumerate(weights.layers))
        self.norm = RMSNorm(weights.norm, args.norm_eps)
        tied = weights.output is None
        table = weights.tok_embeddings
        self.output = Linear(table if tied else weights.output)
        # Tied: the embedding table and the LM head are one tensor (or one mapping of the file, one Int8Weight).
        self.tok_embeddings = Embedding(self.output.weight if tied and self.output.weight is not None else table)
        self.max_seq_len = resolve_max_seq_len(args, max_seq_len)
        # The activations' dtype and device (fp32 on the CPU where the weights are encoded).
        self.dtype, self.device = weights.norm.dtype, weights.norm.device
        # RoPE tables [n_tables, S, D]: one, or (gemma3) the global layers' and the sliding layers'
        # (layer_rope[i]: layer i's table, BlockSpec.rope)
        self.dual_chunk = args.dual_chunk  # DCA (models/dual_chunk.py): its positions reach chunk_size
        n_pos = self.max_seq_len if self.dual_chunk is None else max(self.max_seq_len, self.dual_chunk.chunk_size + 1)
        tables = [rope_tables(a, self.max_seq_len, self.dtype, self.device, n_pos) for a in rope_variants(args)]
        self.register_buffer("rope_cos", torch.stack([c for c, _ in tables]), persistent=False)
        self.register_buffer("rope_sin", torch.stack([s for _, s in tables]), persistent=False)
        self.layer_rope = [b.rope for b in args.blocks]
        self.emb_scale = args.emb_scale
        # The decode step (``generate.decode_one_token``): this model's forward pass for one token, or the native
        # step on the weights in their GGUF encoding (ktquest.native.decode.NativeDecoder), which
        # ``native.decode.use_native_decode`` sets where it applies: one contract, ``DecodeStep``.
        self.decoder: DecodeStep = TorchDecoder(self)

    def check_positions(self, start_pos: int, t: int) -> None:
        """ValueError unless positions start_pos..start_pos+t-1 are within the RoPE tables."""
        if start_pos < 0 or start_pos + t > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + t - 1} exceed the model's rope tables "
                             f"(max_seq_len {self.max_seq_len})")

    def rope_rows(self, table: int, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions start..start+t-1 in RoPE table ``table``: [T, 1, D] each; with dual chunk
        attention [4, T, 1, D]: the keys' rows (their place in their chunk), then the queries' intra, successive
        and inter rows (models/dual_chunk.py), those times the query's logit temperature."""
        if self.dual_chunk is None:
            return self.rope_cos[table, start: start + t, None], self.rope_sin[table, start: start + t, None]
        dc = self.dual_chunk
        pos = torch.arange(start, start + t, device=self.rope_cos.device)
        index = torch.cat([dc.key_positions(pos)[None], dc.query_positions(pos)])  # [4, T]
        temper = torch.ones(4, t, 1, 1, dtype=torch.float64, device=pos.device)
        temper[1:] = dc.logit_scale(pos)[:, None, None]
        cos, sin = self.rope_cos[table][index][:, :, None], self.rope_sin[table][index][:, :, None]  # [4, T, 1, D]
        return (cos * temper).to(cos.dtype), (sin * temper).to(sin.dtype)

    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        """tokens: [T] at positions start_pos..start_pos+T-1 -> logits [T, V] ([1, V] with last_only)."""
        t = tokens.shape[0]
        self.check_positions(start_pos, t)
        x = self.tok_embeddings(tokens)  # [T, dim]
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        rows = {r: self.rope_rows(r, start_pos, t) for r in set(self.layer_rope)}
        for layer, r in zip(self.layers, self.layer_rope):
            x = layer(x, start_pos, *rows[r], cache)
        if last_only:
            x = x[-1:]  # [1, dim]: prefill only needs the next-token logits
        return self.output(self.norm(x))  # [T, V]

    def prefill_layers(self, tokens: torch.Tensor, start_pos: int, cache: KVCache, chunk_size: int,
                       on_progress=None) -> torch.Tensor:
        """Layer-major prefill: tokens [N] at start_pos.. -> the last token's logits [V].

        Layer 0 reads every chunk of the prompt, then layer 1, ...: the hidden states x [N, dim] wait in host
        memory in the compute dtype, each layer's K/V of the prompt stay with the cache's ``prompt_layers``
        (on the device) until the layer is done. on_progress(i, n) after each chunk of each layer (i: the
        tokens' share of the work done). Anything raised undoes the prompt (``PromptLayers.abort``)."""
        n = tokens.shape[0]
        self.check_positions(start_pos, n)
        pin = self.device.type == "cuda"
        x = torch.empty(n, self.args.dim, dtype=self.dtype, pin_memory=pin)  # [N, dim] host
        for a in range(0, n, chunk_size):
            e = self.tok_embeddings(tokens[a: a + chunk_size])  # [C, dim]
            x[a: a + chunk_size] = e * self.emb_scale if self.emb_scale != 1.0 else e
        prompt = cache.prompt_layers(start_pos, n)
        try:
            for i, (layer, r) in enumerate(zip(self.layers, self.layer_rope)):
                for a in range(0, n, chunk_size):
                    b, s = min(n, a + chunk_size), start_pos + a
                    cos, sin = self.rope_rows(r, s, b - a)
                    x[a:b] = layer(x[a:b].to(self.device, non_blocking=True), s, cos, sin, prompt)
                    if on_progress is not None:
                        on_progress((i * n + b) // len(self.layers), n)
                prompt.layer_done(i)
            prompt.done()
        except BaseException:
            prompt.abort()
            raise
        return self.output(self.norm(x[-1:].to(self.device)))[0]  # [V]


# ---- the family: llama, qwen2, internlm2 ----


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    """Every block alike: pre-norm, SwiGLU, global attention; q/k/v biases in qwen2 (and any llama file that
    carries them). llama's and internlm2's converters interleave q/k rows for ggml's RoPE."""
    spec = BlockSpec(qkv_bias=arch == "qwen2" or f"blk.0.{BIAS_TENSORS['bq']}" in tensors)
    return {"blocks": (spec,) * n_layers, "permuted_qk": arch in ("llama", "internlm2")}


FAMILY = Family(archs=("llama", "qwen2", "internlm2"), read=_family_args)
