"""The Gated DeltaNet mixer (Qwen3.5, Qwen3-Next: ``BlockSpec.mixer == "delta_net"``), the reference path in
torch: its projections, the causal conv over the cache's last inputs, and the gated delta rule over the cache's
state (``kv/recurrent.py``), one token after another.

Per value head (``DeltaNetSpec``: ``n_v_heads`` heads of ``v_head_dim``, each reading q/k head ``j % n_k_heads``:
llama.cpp's converter stores a qwen35's value heads tiled, [K0v0, K1v0, ..., K0v1, K1v1, ...]; a qwen3next's keep
the model's grouped order, head j reading q/k head j // r, ``DeltaNetSpec.grouped``) and token t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t^T k_t))^T     (S'_t = exp(g_t) S_{t-1}; S is [Dk, Dv])
    o_t = S_t^T q_t / sqrt(Dk)

with q, k l2-normed per head, beta = sigmoid(W_beta x), g = ssm_a * softplus(W_alpha x + ssm_dt) (ssm_a is
-exp(A_log), as the converter writes it). The state stays in fp32. On the CPU the recurrence runs natively
(``native/delta.py``, cpp/delta/: the heads in parallel, AVX2 with a scalar twin); ``delta_rule`` here is its
torch reference (and the CUDA path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktquest.layers.linear import Linear
from ktquest.models.block import BlockSpec
from ktquest.native.delta import gated_delta_rule


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference model's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, C] inputs, state: [K-1, C] the inputs before them (updated in place to the last K-1),
    weight: [C, K] -> silu(depthwise causal conv) [T, C]: out[t] = sum_k weight[:, k] * in[t - (K-1) + k]."""
    t, k = x.shape[0], weight.shape[1]
    window = torch.cat([state.to(x.dtype), x])  # [K-1+T, C]
    out = window[:t] * weight[:, 0]  # [T, C]
    for i in range(1, k):
        out.addcmul_(window[i: i + t], weight[:, i])
    state.copy_(window[t:])
    return F.silu(out, inplace=True)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """The gated delta rule token by token, fp32: q, k [T, Hk, Dk] (l2-normed, q scaled), v [T, Hv, Dv],
    g, beta [T, Hv]; state [Hv, Dk, Dv] updated in place -> o [T, Hv, Dv]. Value head h reads q/k head h % Hk,
    or h // (Hv / Hk) where ``grouped``."""
    rep = v.shape[1] // q.shape[1]
    spread = (lambda x: x.repeat_interleave(rep, 1)) if grouped else (lambda x: x.repeat(1, rep, 1))
    q, k = spread(q), spread(k)
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s.mul_(g[t].exp()[:, None, None])
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]  # [Hv, Dv]
        s.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out


class GatedDeltaNet(nn.Module):
    """A delta_net block's mixer: x [T, dim] at ``start_pos`` -> [T, dim], its state the cache's
    (``cache.recurrent(layer_idx, start_pos, T)``)."""

    def __init__(self, args, layer_idx: int, spec: BlockSpec, w):
        super().__init__()
        d = spec.delta
        self.layer_idx, self.spec, self.eps = layer_idx, d, args.norm_eps
        self.w_in_qkv = Linear(w.w_in_qkv)  # [conv_dim, dim]
        self.w_in_z = Linear(w.w_in_z)  # [Hv*Dv, dim]
        # beta's and alpha's projections: two, or one fused [Hk x (r betas, r alphas), dim] (grouped files)
        self.w_ba = Linear(w.w_ba) if d.grouped else None
        self.w_beta = None if d.grouped else Linear(w.w_beta)  # [Hv, dim]
        self.w_alpha = None if d.grouped else Linear(w.w_alpha)  # [Hv, dim]
        self.w_out = Linear(w.w_ssm_out)  # [dim, Hv*Dv]
        f32 = dict(dtype=torch.float32)
        self.register_buffer("ssm_a", w.ssm_a.to(**f32), persistent=False)  # [Hv]
        self.register_buffer("ssm_dt", w.ssm_dt.to(**f32), persistent=False)  # [Hv]
        self.register_buffer("conv_w", w.conv1d.to(**f32), persistent=False)  # [conv_dim, K]
        self.register_buffer("norm_w", w.ssm_norm, persistent=False)  # [Dv]

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache) -> torch.Tensor:
        d, t = self.spec, x.shape[0]
        conv_state, ssm_state = cache.recurrent(self.layer_idx, start_pos, t)
        kd = d.n_k_heads * d.k_head_dim
        mixed = causal_conv(self.w_in_qkv(x).float(), conv_state, self.conv_w)  # [T, conv_dim] fp32
        q = l2_normalize(mixed[:, :kd].view(t, d.n_k_heads, d.k_head_dim), self.eps) * d.k_head_dim ** -0.5
        k = l2_normalize(mixed[:, kd: 2 * kd].view(t, d.n_k_heads, d.k_head_dim), self.eps)
        v = mixed[:, 2 * kd:].view(t, d.n_v_heads, d.v_head_dim)
        if d.grouped:
            ba = self.w_ba(x).float().view(t, d.n_k_heads, 2, d.n_v_heads // d.n_k_heads)
            b, a = ba[:, :, 0].reshape(t, d.n_v_heads), ba[:, :, 1].reshape(t, d.n_v_heads)
        else:
            b, a = self.w_beta(x).float(), self.w_alpha(x).float()
        beta = torch.sigmoid(b)  # [T, Hv]
        g = self.ssm_a * F.softplus(a + self.ssm_dt)  # [T, Hv], <= 0
        o = _delta_rule(q, k, v.contiguous(), g, beta, ssm_state, self.w_out.threads, d.grouped)  # [T, Hv, Dv]
        z = self.w_in_z(x).view(t, d.n_v_heads, d.v_head_dim)
        o = F.rms_norm(o, (d.v_head_dim,), eps=self.eps).to(x.dtype) * self.norm_w * F.silu(z)
        return self.w_out(o.reshape(t, d.value_dim))  # [T, dim]


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, threads: int, grouped: bool) -> torch.Tensor:
    """``delta_rule``: native on the CPU (the state in place; the heads on ``threads`` threads, as the layer's
    matmuls: ``layers.linear.set_threads``), the torch reference elsewhere."""
    if state.device.type != "cpu":
        return delta_rule(q, k, v, g, beta, state, grouped)
    return gated_delta_rule(q, k, v, g, beta, state, threads, grouped)
