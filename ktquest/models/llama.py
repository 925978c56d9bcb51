"""The llama family (``llama``, ``qwen2``, ``internlm2``): Transformer -> Block -> Attention / FeedForward /
RMSNorm, and the skeleton other families build on (``models/gemma3.py``).

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

from ktquest.kv.base import KVCache
from ktquest.layers.linear import Embedding, Linear, QuantWeight, stack_rows
from ktquest.models.args import ModelArgs, resolve_max_seq_len
from ktquest.models.rope import apply_rope, rope_tables, rope_variants

Matrix = torch.Tensor | QuantWeight  # a dequantized tensor, or the file's encoding read in place


@dataclass(slots=True)
class BlockWeights:
    """One block's tensors, [out, in] for matrices, in the file's row order (llama q/k: ``qkv_perm``)."""

    attn_norm: torch.Tensor  # [dim]
    wq: Matrix  # [H*D, dim]
    wk: Matrix  # [KVH*D, dim]
    wv: Matrix  # [KVH*D, dim]
    wo: Matrix  # [dim, H*D]
    ffn_norm: torch.Tensor  # [dim]
    w_gate: Matrix  # [ffn, dim]
    w_up: Matrix  # [ffn, dim]
    w_down: Matrix  # [dim, ffn]
    bq: torch.Tensor | None = None  # [H*D] (qwen2)
    bk: torch.Tensor | None = None  # [KVH*D]
    bv: torch.Tensor | None = None  # [KVH*D]
    q_norm: torch.Tensor | None = None  # [D] (gemma3: models/gemma3.py)
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [dim]
    post_ffn_norm: torch.Tensor | None = None  # [dim]


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
    def __init__(self, args: ModelArgs, layer_idx: int, w: BlockWeights, qkv_perm: torch.Tensor | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # One fused projection: rows [q (H*D) | k (KVH*D) | v (KVH*D)], gathered into the rotate-half order.
        bqkv = None if w.bq is None else torch.cat([w.bq, w.bk, w.bv])
        self.wqkv = Linear(stack_rows(w.wq, w.wk, w.wv), bqkv, out_perm=qkv_perm)
        self.wo = Linear(w.wo)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(t, h + 2 * kvh, d)  # [T, H + 2*KVH, D]
        qk = apply_rope(qkv[:, : h + kvh], cos, sin)  # [T, H + KVH, D]: q and k rotated in one go
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh:]  # [T, H, D], [T, KVH, D], [T, KVH, D]
        out = cache.attend(self.layer_idx, q, k, v, start_pos)  # [T, H, D]
        return self.wo(out.reshape(t, h * d))  # [T, dim]


class FeedForward(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act = silu (SwiGLU) or
    tanh-GELU (GeGLU, gemma)."""

    def __init__(self, w_gate: Matrix, w_up: Matrix, w_down: Matrix, activation: str = "silu"):
        super().__init__()
        self.w_gate_up = Linear(stack_rows(w_gate, w_up))  # [2*ffn, dim]
        self.w_down = Linear(w_down)  # [dim, ffn]
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [T, ffn] each
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w_down(act.mul_(up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, w: BlockWeights, qkv_perm: torch.Tensor | None):
        super().__init__()
        self.attn_norm = RMSNorm(w.attn_norm, args.norm_eps)
        self.attn = Attention(args, layer_idx, w, qkv_perm)
        self.ffn_norm = RMSNorm(w.ffn_norm, args.norm_eps)
        self.ffn = FeedForward(w.w_gate, w.w_up, w.w_down)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), start_pos, cos, sin, cache)
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids -> logits.  Built by ``models/loader.py`` from a GGUF file.

    The skeleton every family shares (embedding, blocks, final norm, head, RoPE tables); a family's file
    subclasses it with its own ``block`` (``models/gemma3.py``)."""

    block = Block  # the family's block: (args, layer_idx, BlockWeights, qkv_perm) -> nn.Module

    def __init__(self, args: ModelArgs, weights: TransformerWeights, max_seq_len: int = 0):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(self.block(args, i, w, weights.qkv_perm) for i, w in enumerate(weights.layers))
        self.norm = RMSNorm(weights.norm, args.norm_eps)
        tied = weights.output is None
        table = weights.tok_embeddings
        self.output = Linear(table if tied else weights.output)
        # Tied: the embedding table and the LM head are one tensor (or one mapping of the file).
        self.tok_embeddings = Embedding(self.output.weight if tied and self.output.quant is None else table)
        self.max_seq_len = resolve_max_seq_len(args, max_seq_len)
        # The activations' dtype and device (fp32 on the CPU where the weights are encoded).
        self.dtype, self.device = weights.norm.dtype, weights.norm.device
        # RoPE tables [n_tables, S, D]: one, or (gemma3) the global layers' and the sliding layers'
        # (layer_rope[i]: layer i's table)
        tables = [rope_tables(a, self.max_seq_len, self.dtype, self.device) for a in rope_variants(args)]
        self.register_buffer("rope_cos", torch.stack([c for c, _ in tables]), persistent=False)
        self.register_buffer("rope_sin", torch.stack([s for _, s in tables]), persistent=False)
        self.layer_rope = [1 if args.swa_layers and args.swa_layers[i] else 0 for i in range(args.n_layers)]
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

    def forward(self, tokens: torch.Tensor, start_pos: int, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        """tokens: [T] at positions start_pos..start_pos+T-1 -> logits [T, V] ([1, V] with last_only)."""
        t = tokens.shape[0]
        self.check_positions(start_pos, t)
        cos = self.rope_cos[:, start_pos: start_pos + t, None]  # [n_tables, T, 1, D]
        sin = self.rope_sin[:, start_pos: start_pos + t, None]  # [n_tables, T, 1, D]
        x = self.tok_embeddings(tokens)  # [T, dim]
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        for layer, r in zip(self.layers, self.layer_rope):
            x = layer(x, start_pos, cos[r], sin[r], cache)
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
                    cos = self.rope_cos[r, s: s + b - a, None]  # [C, 1, D]
                    sin = self.rope_sin[r, s: s + b - a, None]
                    x[a:b] = layer(x[a:b].to(self.device, non_blocking=True), s, cos, sin, prompt)
                    if on_progress is not None:
                        on_progress((i * n + b) // len(self.layers), n)
                prompt.layer_done(i)
            prompt.done()
        except BaseException:
            prompt.abort()
            raise
        return self.output(self.norm(x[-1:].to(self.device)))[0]  # [V]
