"""The CPU decode step of one token on the GGUF-encoded weights, in native code: llama2.c's
``transformer(token, pos)``.

    x = embedding[token]
    for each block:      qkv stage (RMSNorm, Wqkv, RoPE) -> attention (the cache's) -> out stage
                         (Wo + residual, RMSNorm, SwiGLU FFN or experts + residual)      cpp/decode/
    logits = head(rmsnorm(x))

The same math as ``ktquest.models.llama`` on the layers' ``QuantWeight`` matrices (``layers/linear.py``), with
no torch op on the way: between tokens the caches are cold (the weights streamed through them) and a torch
op then costs 100-200 us. Where the cache can plan the token ahead (``KVCache.plan_decode``: a dense
cache; dense windows with fixed block lists or fresh selections, Ada-KV budgets included; sliding windows
beside either), every block runs in one native call, each with its own RoPE table; where it cannot (a GPU,
DYNAMIC anchors), the blocks run one by one around ``cache.attend``.
"""

from __future__ import annotations

import numpy as np
import torch

from ktquest import _C
from ktquest.kv.base import KVCache
from ktquest.layers.linear import set_threads
from ktquest.models.block import BlockSpec
from ktquest.models.device_lane import CudaLane
from ktquest.models.device_step import DeviceDecoder
from ktquest.models.ffn import MoEFeedForward
from ktquest.models.rope import apply_rope
from ktquest.native import matrix
from ktquest.native.moe import MoeFfn


class NativeDecoder:
    """The decode step of ``model`` (a ``Transformer`` whose weights stay in their GGUF encoding) in native code.

    Build with ``NativeDecoder.build(model, threads)`` (None where a weight is a torch tensor: the
    ``dequantize`` path); ``decode(token, cache)`` -> logits [V]."""

    def __init__(self, model, threads: int):
        self.threads = max(1, threads)
        self.blocks = [_decode_layer(b, spec) for b, spec in zip(model.layers, model.args.blocks)]  # [n_layers] _C.DecodeLayer
        a = model.args
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.emb = model.tok_embeddings  # Embedding of a QuantWeight [V, dim]
        self.emb_scale = model.emb_scale
        self.cos, self.sin = model.rope_cos.numpy(), model.rope_sin.numpy()  # [n_tables, S, D]
        self.rope = np.asarray(model.layer_rope, np.int32)  # [n_layers]: each layer's table
        self.norm_w, self.eps = model.norm.weight.detach().numpy(), model.norm.eps  # [dim]
        self.head = model.output.qm  # _C.QuantMatrix [V, dim]
        self.check_positions = model.check_positions
        # dual chunk attention past its first chunk: q and k come unrotated from the qkv stage (identity rows) and
        # are rotated by the model's rows (k once, q three ways: models/dual_chunk.py)
        self.dual_chunk, self.rope_rows = model.args.dual_chunk, model.rope_rows
        self._identity = (np.ones(a.head_dim, np.float32), np.zeros(a.head_dim, np.float32))
        self._qkv = np.empty((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, np.float32)

    @classmethod
    def build(cls, model, threads: int) -> NativeDecoder | None:
        if any(s.mixer != "attention" or s.attn_gate for s in model.args.blocks):
            return None  # (a hybrid model's DeltaNet layers and gated attention run in torch for now)
        linears = [model.output] + [m for b in model.layers for m in _linears(b)]
        if model.tok_embeddings.quant is None or any(m.qm is None for m in linears):
            return None
        return cls(model, threads)

    def decode(self, token: int, cache: KVCache, planned: bool = True) -> torch.Tensor:
        """Feed ``token`` at cache.pos through every block; returns its logits [V]. ``planned=False`` runs
        the blocks one by one around ``cache.attend`` even where the cache could plan the token (the
        reference the planned path is tested against; a profile of each layer's attention)."""
        pos = cache.pos
        self.check_positions(pos, 1)
        vocab = self.emb.num_embeddings
        if not 0 <= token < vocab:
            raise IndexError(f"token id {token} is outside the vocabulary (0..{vocab - 1})")
        x = self.emb.quant.rows(np.array([token]))[0]  # [dim]
        if self.emb_scale != 1.0:
            x *= np.float32(self.emb_scale)
        # [n_tables, D]: the token's RoPE rows (a copy of a few floats where there are several tables)
        cos, sin = np.ascontiguousarray(self.cos[:, pos]), np.ascontiguousarray(self.sin[:, pos])
        plan = cache.plan_decode(pos) if planned else None
        if plan is not None:  # every block in one native call
            try:
                plan.run(self.blocks, x, cos, sin, self.rope, self.threads)
            except BaseException:
                cache.abort_decode(plan)
                raise
            cache.commit_decode(plan)
        else:  # block by block around the cache's attention
            self.decode_blocks(x, cos, sin, pos, cache)
        xn = np.empty_like(x)
        _C.rms_norm(x, self.norm_w, self.eps, xn)
        logits = np.empty((1, self.head.out_features), np.float32)
        matrix.gemv(self.head, xn[None], logits, self.threads)
        return torch.from_numpy(logits[0])  # [V]

    def decode_batch(self, tokens: list[int], caches: list[KVCache]) -> list[torch.Tensor | Exception]:
        """One token of each of several sequences (the server's parallel slots): token i at caches[i].pos, each
        cache its own sequence's; returns each token's logits [V]. Where every cache plans its token, one native
        call runs them all, each matrix read once for the N tokens (``_C.decode_tokens``, all or nothing); token
        i's logits are what ``decode(tokens[i], caches[i])`` gives, bit for bit. Where a cache cannot plan, or
        the native call raised (no cache holds its token then), each token is decoded alone, and one that
        fails has its exception in its place (its cache without it) while the others go on."""
        n = len(tokens)
        if len(caches) != n or n == 0 or len({id(c) for c in caches}) != n:
            raise ValueError(f"decode_batch: one token for each of {n} distinct caches, got {len(caches)} caches")
        vocab = self.emb.num_embeddings
        for t in tokens:
            if not 0 <= t < vocab:
                raise IndexError(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        pos = [c.pos for c in caches]
        for p in pos:
            self.check_positions(p, 1)
        plans = []
        try:
            for c, p in zip(caches, pos):
                plans.append(c.plan_decode(p))
        except BaseException:
            for c, plan in zip(caches, plans):
                if plan is not None:
                    c.abort_decode(plan)
            raise
        if n == 1 or any(p is None for p in plans) or len({p.scale for p in plans}) != 1:
            for c, plan in zip(caches, plans):  # (not planned together: one by one, the same logits)
                if plan is not None:
                    c.abort_decode(plan)
            return self._each(tokens, caches)
        x = self.emb.quant.rows(np.asarray(tokens))  # [N, dim]
        if self.emb_scale != 1.0:
            x *= np.float32(self.emb_scale)
        cos = np.ascontiguousarray(self.cos[:, pos].transpose(1, 0, 2))  # [N, n_tables, D]
        sin = np.ascontiguousarray(self.sin[:, pos].transpose(1, 0, 2))
        seqs = [(p.layers, None if p.store is None else p.store.native, p.w0, p.width, *p.skip, None) for p in plans]
        try:
            _C.decode_tokens(self.blocks, x, cos, sin, self.rope, seqs, plans[0].scale, self.threads)
        except Exception:  # (nothing held: each token alone, a failure its own)
            for c, plan in zip(caches, plans):
                c.abort_decode(plan)
            return self._each(tokens, caches)
        except BaseException:
            for c, plan in zip(caches, plans):
                c.abort_decode(plan)
            raise
        for c, plan in zip(caches, plans):
            c.commit_decode(plan)
        xn = np.empty_like(x)
        for i in range(n):
            _C.rms_norm(x[i], self.norm_w, self.eps, xn[i])
        logits = np.empty((n, self.head.out_features), np.float32)
        matrix.gemv(self.head, xn, logits, self.threads)
        return list(torch.from_numpy(logits))  # N x [V]

    def _each(self, tokens: list[int], caches: list[KVCache]) -> list[torch.Tensor | Exception]:
        out: list[torch.Tensor | Exception] = []
        for t, c in zip(tokens, caches):
            try:
                out.append(self.decode(t, c))
            except Exception as e:  # noqa: BLE001 - that sequence's alone (decode leaves its cache as it was)
                out.append(e)
        return out

    def decode_blocks(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: int, cache: KVCache) -> None:
        """Every block of one token, each as qkv stage -> ``cache.attend`` -> out stage; x [dim] in place,
        cos/sin [n_tables, D]."""
        h, kvh, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = torch.from_numpy(self._qkv).view(1, h + 2 * kvh, d)  # [1, H + 2*KVH, D], q and k rotated
        q, k, v = qkv[:, :h], qkv[:, h: h + kvh], qkv[:, h + kvh:]  # [1, H, D], [1, KVH, D], [1, KVH, D]
        # (with dual chunk attention always its rotations: a long-context cache records a prompt's last token's
        # for SnapKV even within the first chunk)
        dual = self.dual_chunk is not None
        rows = {r: self.rope_rows(int(r), pos, 1) for r in set(self.rope.tolist())} if dual else {}
        for i, (block, r) in enumerate(zip(self.blocks, self.rope)):
            if dual:  # unrotated from the stage, then k at its key position and q three ways
                block.qkv(x, *self._identity, self._qkv, self.threads)
                c, s = rows[int(r)]  # [4, 1, 1, D]
                qv = torch.stack([apply_rope(q, c[j], s[j]) for j in (1, 2, 3)])  # [3, 1, H, D]
                out = cache.attend(i, qv, apply_rope(k, c[0], s[0]), v, pos)
            else:
                block.qkv(x, cos[r], sin[r], self._qkv, self.threads)
                out = cache.attend(i, q, k, v, pos)  # [1, H, D]
            block.out(out.reshape(-1).contiguous().numpy(), x, self.threads)


def use_native_decode(model, threads: int) -> None:
    """Give every Linear of ``model`` ``threads``, and the model its native CPU decode step (``model.decoder``)
    where its weights are in their GGUF encoding; on a GPU the device step (CUDA graphs around the store's CPU
    operator: models/device_step.py) where its blocks allow; elsewhere it keeps its forward pass
    (``TorchDecoder``). The one place the decode step is chosen."""
    set_threads(model, threads)
    native = NativeDecoder.build(model, threads)
    if native is not None:
        model.decoder = native
    elif model.device.type == "cuda" and DeviceDecoder.applies(model):  # dequantized weights on a GPU
        model.decoder = DeviceDecoder(model, CudaLane(model.device))


def _linears(block) -> list:
    """A block's Linear layers: wqkv, wo, then its FFN's (w_gate_up, w_down; a MoE FFN's router, the experts' and
    the shared expert's)."""
    ffn = block.ffn
    if isinstance(ffn, MoEFeedForward):
        ffns = [*ffn.experts, *([] if ffn.shared is None else [ffn.shared])]
        return [block.attn.wqkv, block.attn.wo, ffn.router, *(m for f in ffns for m in (f.w_gate_up, f.w_down))]
    return [block.attn.wqkv, block.attn.wo, ffn.w_gate_up, ffn.w_down]


def _moe(ffn: MoEFeedForward) -> object:
    """A MoE FFN's native twin (cpp/moe/moe_ffn.h): its router's and experts' matrices, read in place."""
    shared = {}
    if ffn.shared is not None:
        shared = dict(shared_gate_up=ffn.shared.w_gate_up.qm, shared_down=ffn.shared.w_down.qm,
                      shared_gate=ffn.shared_gate.detach().numpy())
    return MoeFfn(ffn.router.qm, [e.w_gate_up.qm for e in ffn.experts], [e.w_down.qm for e in ffn.experts],
                  ffn.n_used, ffn.norm_topk, **shared)


def _decode_layer(block, spec: BlockSpec) -> object:
    """A block's native decode stages (cpp/decode/decode_layer.h) as its ``BlockSpec`` says: its norms and its
    Linear layers' matrices, the QK-norms and sandwich norms where it has them, its FFN kind."""
    a = block.attn
    perm = a.wqkv.out_perm

    def w(norm) -> np.ndarray:
        return norm.weight.detach().numpy()

    extras = {}
    if spec.ffn == "moe":
        extras["moe"] = _moe(block.ffn)
    if spec.qk_norm:
        extras |= dict(q_norm=w(a.q_norm), k_norm=w(a.k_norm))
    if spec.sandwich_norms:
        extras |= dict(post_attn_norm=w(block.post_attn_norm), post_ffn_norm=w(block.post_ffn_norm))
    ffn = (None, None) if spec.ffn == "moe" else (block.ffn.w_gate_up.qm, block.ffn.w_down.qm)
    return _C.DecodeLayer(w(block.attn_norm), w(block.ffn_norm), block.attn_norm.eps, a.wqkv.qm, a.wo.qm, *ffn,
                          a.n_heads, a.n_kv_heads, a.head_dim, None if perm is None else perm.to(torch.int32).numpy(),
                          ffn=spec.ffn, **extras)
