"""The llama family (``llama``, ``qwen2``): Transformer -> Block -> Attention / FeedForward / RMSNorm.

Batch size is always 1, so activations are [T, ...] with no batch dimension. Weights arrive in the
Hugging Face layout (the loader un-permutes llama's Q/K), so RoPE is rotate-half for both archs: rotary
pair i is (dim i, dim i + D/2). Attention itself lives behind ``cache.attend``: the model computes q, k, v
and RoPE, the cache stores k/v and returns causal attention over everything it holds (dense or sparse).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ktquest.gguf_loader import ModelArgs
from ktquest.linear import Linear


class AttentionCache(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (views, maybe non-contiguous) for positions start_pos..+T-1.

        Stores k/v and returns causal attention over positions 0..start_pos+T-1: out [T, H, D].
        """
        ...

    # Optional: ``decode_block(layer_idx, fused, x, cos, sin, start_pos, threads) -> bool`` runs a whole
    # block's CPU decode step natively (qkv, attention, out: DecodeLayer.step_long_context) and returns
    # True, or returns False and the block falls back to qkv / attend / out.


# ---- rotary embeddings ----


def rope_frequencies(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float64) after rope scaling, and the cos/sin multiplier (yarn's mscale)."""
    d, base, s = args.head_dim, args.rope_theta, args.rope_scaling
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    if s is None:
        return inv_freq, 1.0
    if s.freq_factors is not None:  # llama3 (llama.cpp's rope_freqs.weight): theta_i / factor_i
        inv_freq = inv_freq / torch.tensor(s.freq_factors, dtype=torch.float64)
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "yarn":
        # YaRN: extrapolate (keep) the fast-rotating dims, interpolate (divide by factor) the slow ones,
        # with a linear ramp between the dims turning beta_fast and beta_slow times over the trained context.
        orig = s.original_context_length or args.context_length

        def correction_dim(n_rot: float) -> float:
            return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(s.beta_fast)), 0)
        high = min(math.ceil(correction_dim(s.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / s.factor * ramp + inv_freq * (1 - ramp)
        mscale = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
        return inv_freq, mscale * s.attn_factor
    return inv_freq, 1.0  # llama3: the freq factors above are all of it


def rope_tables(args: ModelArgs, max_len: int, dtype: torch.dtype,
                device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, D], angles computed in float64 (fp32 angles drift by ~1e-3 rad at 8K positions).

    sin carries rotate-half's sign: ``rotate_half(x) * sin_full == roll(x, D/2) * sin``.
    """
    inv_freq, mscale = rope_frequencies(args)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [S, D/2]
    cos, sin = angles.cos() * mscale, angles.sin() * mscale
    cos = torch.cat([cos, cos], dim=-1)  # [S, D]
    sin = torch.cat([-sin, sin], dim=-1)  # [S, D]
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n, D], cos/sin: [T, 1, D] -> [T, n, D] (rotate-half)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


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
    def __init__(self, args: ModelArgs, layer_idx: int, w: Mapping[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{layer_idx}."
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # One fused projection: rows [q (H*D) | k (KVH*D) | v (KVH*D)].
        wqkv = torch.cat([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        bqkv = None
        if args.qkv_bias:
            bqkv = torch.cat([w[p + "attn_q.bias"], w[p + "attn_k.bias"], w[p + "attn_v.bias"]])
        self.wqkv = Linear(wqkv, bqkv)
        self.wo = Linear(w[p + "attn_output.weight"])

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(t, h + 2 * kvh, d)  # [T, H + 2*KVH, D]
        qk = apply_rope(qkv[:, : h + kvh], cos, sin)  # [T, H + KVH, D]: q and k rotated in one go
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh:]  # [T, H, D], [T, KVH, D], [T, KVH, D]
        out = cache.attend(self.layer_idx, q, k, v, start_pos)  # [T, H, D]
        return self.wo(out.reshape(t, h * d))  # [T, dim]


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        self.w_gate_up = Linear(torch.cat([w_gate, w_up]))  # [2*ffn, dim]
        self.w_down = Linear(w_down)  # [dim, ffn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [T, ffn] each
        return self.w_down(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, w: Mapping[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{layer_idx}."
        self.attn_norm = RMSNorm(w[p + "attn_norm.weight"], args.norm_eps)
        self.attn = Attention(args, layer_idx, w)
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"], args.norm_eps)
        self.ffn = FeedForward(w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
        self.layer_idx = layer_idx
        self.fused = None  # native decode stages (enable_fused_decode), or None
        self.threads = 1

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: AttentionCache) -> torch.Tensor:
        if self.fused is not None and x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.decode_fused(x, (x[0].numpy(), cos[0, 0].numpy(), sin[0, 0].numpy()), start_pos, cache)
        h = x + self.attn(self.attn_norm(x), start_pos, cos, sin, cache)
        return h + self.ffn(self.ffn_norm(h))

    def enable_fused_decode(self, threads: int) -> bool:
        """Run single-token CPU decode as two native calls around attention (cpp/decode_layer.h): the same
        math as forward() on the layers' Q8_0 weights. False (and off) unless every Linear has its Q8_0 copy."""
        a, f = self.attn, self.ffn
        packs = [m._q8 for m in (a.wqkv, a.wo, f.w_gate_up, f.w_down)]
        self.fused = None
        if any(p is None for p in packs):
            return False
        from ktquest import _C

        self.fused = _C.DecodeLayer(self.attn_norm.weight.detach().numpy(), self.ffn_norm.weight.detach().numpy(),
                                    self.attn_norm.eps, *packs, a.n_heads, a.n_kv_heads, a.head_dim)
        self.threads = max(1, threads)
        return True

    def decode_fused(self, x: torch.Tensor, rows: tuple, start_pos: int, cache: AttentionCache) -> torch.Tensor:
        """forward() for one token on the native stages: x [1, dim] -> [1, dim] (updated in place).
        rows: numpy views of (x[0], the token's RoPE cos row, its sin row) [dim], [D], [D]."""
        x_np, cos_np, sin_np = rows
        native = getattr(cache, "decode_block", None)
        if native is not None and native(self.layer_idx, self.fused, x_np, cos_np, sin_np, start_pos, self.threads):
            return x
        a = self.attn
        h, kvh = a.n_heads, a.n_kv_heads
        qkv = torch.empty(1, h + 2 * kvh, a.head_dim)  # [1, H + 2*KVH, D], q and k rotated
        self.fused.qkv(x_np, cos_np, sin_np, qkv.view(-1).numpy(), self.threads)
        q, k, v = qkv[:, :h], qkv[:, h: h + kvh], qkv[:, h + kvh:]  # [1, H, D], [1, KVH, D], [1, KVH, D]
        out = cache.attend(self.layer_idx, q, k, v, start_pos)  # [1, H, D]
        self.fused.out(out.reshape(-1).contiguous().numpy(), x_np, self.threads)
        return x


class Transformer(nn.Module):
    """Token ids -> logits.  Built from GGUF-named tensors in the Hugging Face layout (``model_weights``)."""

    def __init__(self, args: ModelArgs, weights: Mapping[str, torch.Tensor], max_seq_len: int = 0):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(Block(args, i, weights) for i in range(args.n_layers))
        self.norm = RMSNorm(weights["output_norm.weight"], args.norm_eps)
        self.output = Linear(weights["token_embd.weight" if args.tie_embeddings else "output.weight"])
        # Tied: the embedding table and the LM head are one tensor.
        self.tok_embeddings = self.output.weight if args.tie_embeddings else \
            nn.Parameter(weights["token_embd.weight"], requires_grad=False)  # [V, dim]
        self.max_seq_len = max_seq_len or args.context_length
        emb = self.tok_embeddings
        cos, sin = rope_tables(args, self.max_seq_len, emb.dtype, emb.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [S, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [S, D]
        self._native: tuple = (None, ())  # (the LM head's Q8_0 pack, decode_native's numpy views of it all)

    def decode_native(self, token: int, start_pos: int, cache: AttentionCache) -> torch.Tensor | None:
        """forward() of one token on the CPU without torch ops: the embedding row, every block's native
        stages (the whole token in one call where the cache has ``decode_token``), the final RMSNorm and
        the LM head's Q8_0 GEMV. Logits [V], or None where the native stages do not cover the model (the
        caller then runs forward()). Between tokens the caches are cold (the weights streamed through
        them), and a torch op then costs 100-200 us, so every one of them counts."""
        head, nat = self._native
        if head is not self.output._q8:  # first call, or the decode weights changed
            head, nat = self._native = (self.output._q8, self._native_parts())
        if not nat or not self._all_fused:
            return None
        if not 0 <= start_pos < self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos} exceed the model's rope tables "
                             f"(max_seq_len {self.max_seq_len})")
        from ktquest import _C

        emb, cos, sin, norm_w, (qw, dw, b), head_threads = nat
        if not 0 <= token < emb.shape[0]:
            raise IndexError(f"token id {token} is outside the vocabulary (0..{emb.shape[0] - 1})")
        x = emb[token].copy()  # [dim]
        self._decode_blocks(torch.from_numpy(x)[None], (x, cos[start_pos], sin[start_pos]), start_pos, cache)
        xn = np.empty_like(x)
        _C.rms_norm(x, norm_w, self.norm.eps, xn)
        logits = np.empty((1, qw.shape[0]), np.float32)
        _C.gemv_q8_0(xn[None], qw, dw, b, logits, head_threads)
        return torch.from_numpy(logits[0])  # [V]

    def _decode_blocks(self, x: torch.Tensor, rows: tuple, start_pos: int, cache: AttentionCache) -> None:
        """Every block's native decode step of one token, x [1, dim] updated in place; rows: numpy views of
        (x[0], the token's RoPE cos row, its sin row). The whole token in one call where the cache has
        ``decode_token`` (long_context), else block by block."""
        native = getattr(cache, "decode_token", None)
        if native is None or not native([layer.fused for layer in self.layers], *rows, start_pos,
                                        self.layers[0].threads):
            for layer in self.layers:
                layer.decode_fused(x, rows, start_pos, cache)

    def _native_parts(self) -> tuple:
        """numpy views for decode_native (embedding [V, dim], rope cos/sin [S, D], final norm weight [dim],
        the LM head's Q8_0 pack, threads), or () where the model is not fp32 on the CPU with a Q8_0 head."""
        emb = self.tok_embeddings
        if emb.device.type != "cpu" or emb.dtype != torch.float32 or self.output._q8 is None:
            return ()
        return (emb.detach().numpy(), self.rope_cos.numpy(), self.rope_sin.numpy(),
                self.norm.weight.detach().numpy(), self.output._q8, self.output._threads)

    @property
    def _all_fused(self) -> bool:
        """Every block has its native decode stages (Block.enable_fused_decode)."""
        return all(layer.fused is not None for layer in self.layers)

    def forward(self, tokens: torch.Tensor, start_pos: int, cache: AttentionCache,
                last_only: bool = False) -> torch.Tensor:
        """tokens: [T] at positions start_pos..start_pos+T-1 -> logits [T, V] ([1, V] with last_only)."""
        t = tokens.shape[0]
        if start_pos + t > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + t - 1} exceed the model's rope tables "
                             f"(max_seq_len {self.max_seq_len})")
        cos = self.rope_cos[start_pos: start_pos + t, None]  # [T, 1, D]
        sin = self.rope_sin[start_pos: start_pos + t, None]  # [T, 1, D]
        x = F.embedding(tokens, self.tok_embeddings)  # [T, dim]
        if t == 1 and x.device.type == "cpu" and x.dtype == torch.float32 and self._all_fused:
            # One token on the native stages: the numpy views once per token, not per layer, and no module
            # dispatch (a few microseconds a layer, against ~300 of work).
            self._decode_blocks(x, (x[0].numpy(), cos[0, 0].numpy(), sin[0, 0].numpy()), start_pos, cache)
        else:
            for layer in self.layers:
                x = layer(x, start_pos, cos, sin, cache)
        if last_only:
            x = x[-1:]  # [1, dim]: prefill only needs the next-token logits
        return self.output(self.norm(x))  # [T, V]
