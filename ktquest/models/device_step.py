"""The decode step on a GPU (a ``DecodeStep``, models/llama.py): the device part of every layer captured once
in CUDA graphs, the store's part run on the host between them, the two crossing through page-locked buffers.

    per token:  (token, pos, w0, width, skip) -> device
                A_0       embedding, the token's RoPE rows, layer 0's head: norm, Wqkv, RoPE, QK-norms, the
                          k/v written to row w0 of the layer's device buffers
                for each layer l:
                    q|k|v of l -> host                                          mark
                    W_l       the device buffers' dense attention: out, LSE    (the GPU, while ...)
                    host      wait the mark; the store part of l: select, attend, append   (... the CPU operator)
                    out|LSE of the store part -> device
                    A_{l+1}   the LSE merge, Wo, residual, FFN, then layer l+1's head (A_L: final norm, LM head)
                host waits: logits

A token with no store part (a dense cache; a long-context cache whose context has no block between its windows
yet) runs every graph back to back with one wait at the end (the long-context cache then appends each layer's
k/v). Each segment is captured the second time its (cache, device buffers, width bucket) comes (the first runs
eagerly: the warm-up), so a context that grows past a bucket, a rewind and a KV file load only pick another
bucket's graphs. The stream is a ``Lane`` (models/device_lane.py): ``CudaLane`` on a GPU, ``FakeLane`` runs this
very code on the CPU with the copies and marks of a real stream (tests/test_device_step.py).

Where it does not apply (a model with DeltaNet or MoE blocks, dual chunk attention, a sliding-window or
recurrent cache, DYNAMIC anchors, a prompt's one-token chunk) the token goes through ``TorchDecoder``.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.nn.functional as F

from ktquest.kv.base import DeviceToken
from ktquest.models.device_lane import Lane
from ktquest.models.llama import TorchDecoder
from ktquest.models.rope import apply_rope
from ktquest.native.cpu import hot_pool

MIN_BUCKET = 256  # the smallest width bucket (rows attended by a captured window attention)
# While a token's store parts run, the operator's threads spin this long between calls instead of sleeping
# after 200 us: a layer's device segment and the copies between two store parts take a few hundred us.
HOT_SPIN_US = 5000


class DeviceDecoder:
    """``model``'s decode step on its device through ``lane`` (see the module docstring). ``trace``: a list
    that receives ("device", name, mark_a, mark_b) around each segment and ("host", name, t0, t1) around each
    store part, for a timeline (tools/bench_device_decode.py)."""

    def __init__(self, model, lane: Lane):
        self.model, self.lane = model, lane
        self.fallback = TorchDecoder(model)
        a = model.args
        self.H, self.KVH, self.D, self.L = a.n_heads, a.n_kv_heads, a.head_dim, a.n_layers
        self.G = self.H // self.KVH
        self.scale = a.head_dim ** -0.5
        dev, dt = model.device, model.dtype
        H, KVH, D, L = self.H, self.KVH, self.D, self.L
        self.ints = torch.zeros(6, dtype=torch.long, device=dev)  # token, pos, w0, width, skip a, skip b
        self.ints_host = lane.host_buffer((6,), torch.long)
        self.x = torch.zeros(1, a.dim, dtype=dt, device=dev)  # the residual stream
        self.cos = torch.zeros(model.rope_cos.shape[0], D, dtype=model.rope_cos.dtype, device=dev)  # [tables, D]
        self.sin = torch.zeros_like(self.cos)
        self.qkv = torch.zeros(L, H + 2 * KVH, D, dtype=dt, device=dev)  # each layer's q | k | v
        self.qkv32 = torch.zeros(L, H + 2 * KVH, D, dtype=torch.float32, device=dev)  # ... as the store takes it
        self.qkv_host = lane.host_buffer((L, H + 2 * KVH, D), torch.float32)
        self.gate = torch.zeros(L, H * D, dtype=dt, device=dev)  # attention's output gate (BlockSpec.attn_gate)
        self.w_out = torch.zeros(L, H, D, dtype=torch.float32, device=dev)  # the device buffers' attention
        self.w_lse = torch.zeros(L, H, dtype=torch.float32, device=dev)
        self.part = torch.zeros(L, H * D + H, dtype=torch.float32, device=dev)  # the store part's out | LSE
        self.part_host = lane.host_buffer((L, H * D + H), torch.float32)
        self.logits = torch.zeros(a.vocab_size, dtype=dt, device=dev)
        self.steps: dict[tuple, tuple] = {}  # (cache id, generation, bucket, store) -> (cache ref, fns, replays)
        self.trace: list | None = None

    @staticmethod
    def applies(model) -> bool:
        """Whether every block is one this step runs: attention (gated or not) and a dense FFN; no dual chunk
        attention, no sliding window."""
        a = model.args
        return a.dual_chunk is None and all(s.mixer == "attention" and s.ffn != "moe" and s.attention == "global"
                                            for s in a.blocks)

    # ---- one token ----

    def decode(self, token: int, cache) -> torch.Tensor:
        model = self.model
        if not hasattr(cache, "device_token"):
            return self.fallback.decode(token, cache)
        pos = cache.pos
        model.check_positions(pos, 1)
        if not 0 <= token < self.logits.shape[0]:
            raise IndexError(f"token id {token} is outside the vocabulary (0..{self.logits.shape[0] - 1})")
        tok = cache.device_token(pos)
        if tok is None:
            return self.fallback.decode(token, cache)
        rows = cache.device_buffers(0)[0].shape[1]
        bucket = min(rows, max(MIN_BUCKET, 1 << (tok.width - 1).bit_length()))
        appends = hasattr(cache, "store_part")
        segs = self._segments(cache, tok, bucket, tok.store)
        self.ints_host.copy_(torch.tensor([token, pos, tok.w0, tok.width, *tok.skip]))
        try:
            with hot_pool(HOT_SPIN_US) if tok.store else contextlib.nullcontext():
                self._run(cache, tok, segs, appends)
        except BaseException:
            self.lane.finish()  # (nothing of this token stays queued; the cache drops its half at the next pass)
            raise
        cache.commit_device_token(tok)
        return self.logits.clone()

    def _run(self, cache, tok: DeviceToken, segs: list, appends: bool) -> None:
        lane = self.lane
        lane.to_device(self.ints, self.ints_host)
        self._replay(segs[0], "A0")
        if tok.store:
            for layer in range(self.L):
                lane.to_host(self.qkv_host[layer], self.qkv32[layer])
                ready = lane.mark()
                self._replay(segs[1 + 2 * layer], f"W{layer}")
                lane.wait(ready)
                self._store_part(cache, layer)
                lane.to_device(self.part[layer], self.part_host[layer])
                self._replay(segs[2 + 2 * layer], f"A{layer + 1}")
        else:
            for seg in segs[1:]:
                self._replay(seg, "")
            if appends:
                lane.to_host(self.qkv_host, self.qkv32)
        lane.wait(lane.mark())
        if appends and not tok.store:
            for layer in range(self.L):
                self._store_part(cache, layer)

    def _store_part(self, cache, layer: int) -> None:
        H, KVH, D = self.H, self.KVH, self.D
        t0 = time.perf_counter() if self.trace is not None else 0.0
        qkv, host = self.qkv_host[layer], self.part_host[layer]
        if cache.store_part(layer, qkv[:H], qkv[H: H + KVH], qkv[H + KVH:], host[: H * D].view(H, D),
                            host[H * D:]) is None:  # (the part's out and LSE are written into the host buffer)
            host[: H * D] = 0.0
            host[H * D:] = float("-inf")
        if self.trace is not None:
            self.trace.append(("host", f"S{layer}", t0, time.perf_counter()))

    def _replay(self, seg, name: str) -> None:
        if self.trace is None:
            seg()
            return
        a = self.lane.mark()
        seg()
        self.trace.append(("device", name, a, self.lane.mark()))

    # ---- the segments, built per bucket and captured at their second use ----

    def _segments(self, cache, tok: DeviceToken, bucket: int, store: bool) -> list:
        """The token's segments: run eagerly the first time their key comes (the warm-up), captured the second.
        An entry holds its cache weakly (a new cache may get a dead one's id) and goes with it, or when the
        cache's device buffers are replaced (another generation)."""
        key = (id(cache), tok.generation, bucket, store)
        stale = [k for k, e in self.steps.items()  # a dead cache's (its buffers), a replaced generation's
                 if e[0]() is None or (e[0]() is cache and k[1] != tok.generation)]
        for k in stale:
            del self.steps[k]
            self.lane.release(k)
        entry = self.steps.get(key)
        if entry is None or entry[0]() is not cache:
            fns = self._build(cache, bucket, store)
            self.steps[key] = (weakref.ref(cache), fns, None)
            return [lambda f=f: self.lane.run(f) for f in fns]
        ref, fns, segs = entry
        if segs is None:
            segs = [self.lane.capture(f, key) for f in fns]
            self.steps[key] = (ref, fns, segs)
        return segs

    def _build(self, cache, bucket: int, store: bool) -> list:
        """The token's segments as plain functions over the static buffers: A_0, then W_l, A_{l+1} a layer."""
        bufs = [cache.device_buffers(i) for i in range(self.L)]
        dense = not hasattr(cache, "store_part")  # a dense cache: SDPA over every row, no LSE needed
        dev = self.x.device
        cols = torch.arange(bucket, device=dev)
        # the rows the token's query sees, made once a token for every layer: [0, width) but [skip)
        ok = torch.zeros(bucket, dtype=torch.bool, device=dev)
        bias = torch.zeros(bucket, dtype=torch.float32, device=dev)  # 0 where seen, -inf elsewhere
        last = self.L - 1

        def first():
            m = self.model
            e = m.tok_embeddings(self.ints[0:1])
            self.x.copy_(e * m.emb_scale if m.emb_scale != 1.0 else e)
            self.cos.copy_(m.rope_cos.index_select(1, self.ints[1:2])[:, 0])
            self.sin.copy_(m.rope_sin.index_select(1, self.ints[1:2])[:, 0])
            width, a, b = self.ints[3], self.ints[4], self.ints[5]
            torch.logical_and(cols < width, (cols < a) | (cols >= b), out=ok)
            if not dense:  # (SDPA takes ok itself)
                bias.copy_(torch.where(ok, 0.0, float("-inf")))
            self._head(0, bufs[0])

        def window(layer):
            def fn():
                self._window(layer, bufs[layer], bucket, ok, bias, dense)
            fn.__name__ = f"W{layer}"
            return fn

        def then(layer):
            def fn():
                self._tail(layer, store)
                if layer == last:
                    m = self.model
                    self.logits.copy_(m.output(m.norm(self.x))[0])
                else:
                    self._head(layer + 1, bufs[layer + 1])
            fn.__name__ = f"A{layer + 1}"
            return fn

        first.__name__ = "A0"
        out = [first]
        for layer in range(self.L):
            out += [window(layer), then(layer)]
        return out

    def _head(self, layer: int, buf: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Layer ``layer`` up to its q | k | v (as ``models.llama.Attention``) and the k/v write at row w0."""
        H, KVH, D = self.H, self.KVH, self.D
        block = self.model.layers[layer]
        at = block.attn
        out = at.wqkv(block.attn_norm(self.x))  # [1, (H + 2 KVH) D (+ H D)]
        n = (H + 2 * KVH) * D
        qkv = out[:, :n].view(1, H + 2 * KVH, D)
        r = self.model.layer_rope[layer]
        cos, sin = self.cos[r].view(1, 1, D), self.sin[r].view(1, 1, D)
        if at.q_norm is None:
            qk = apply_rope(qkv[:, : H + KVH], cos, sin)
        else:
            qk = torch.cat([apply_rope(at.q_norm(qkv[:, :H]), cos, sin),
                            apply_rope(at.k_norm(qkv[:, H: H + KVH]), cos, sin)], 1)
        self.qkv[layer, : H + KVH].copy_(qk[0])
        self.qkv[layer, H + KVH:].copy_(qkv[0, H + KVH:])
        self.qkv32[layer].copy_(self.qkv[layer])
        if at.gated:
            self.gate[layer].copy_(out[0, n:])
        k, v = buf
        row = self.ints[2:3]
        k.index_copy_(1, row, self.qkv[layer, H: H + KVH, None])
        v.index_copy_(1, row, self.qkv[layer, H + KVH:, None])

    def _window(self, layer: int, buf, bucket: int, ok: torch.Tensor, bias: torch.Tensor, dense: bool) -> None:
        """The query against rows [0, bucket) of the device buffers, those ``ok`` (``bias`` 0) and no others:
        out into w_out; its LSE into w_lse (a long-context cache merges it with the store part)."""
        KVH, G, D = self.KVH, self.G, self.D
        keys, vals = buf[0][:, :bucket], buf[1][:, :bucket]  # [KVH, B, D]
        q = self.qkv[layer, : self.H].view(KVH, G, D)
        if dense:  # the query heads of a KV head as its rows (no GQA expansion); SDPA's fp32 accumulation
            o = F.scaled_dot_product_attention(q[None], keys[None], vals[None], attn_mask=ok[None, None, None])
            self.w_out[layer].copy_(o[0].reshape(self.H, D))
            return
        # scores [KVH, G, B] with the rows not seen at -inf, in one kernel
        sc = torch.baddbmm(bias[None, None], q.float(), keys.float().transpose(1, 2), alpha=self.scale)
        m = sc.amax(-1, keepdim=True)
        p = sc.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        o = torch.bmm(p.div_(total), vals.float())  # [KVH, G, D]
        self.w_out[layer].copy_(o.reshape(self.H, D))
        self.w_lse[layer].copy_((m + total.log()).reshape(self.H))

    def _tail(self, layer: int, store: bool) -> None:
        """The LSE merge with the store part (``kv.attention.merge_attention``), Wo, the residual and the FFN."""
        H, D = self.H, self.D
        block = self.model.layers[layer]
        att = self.w_out[layer]  # [H, D] fp32
        if store:
            o, lse = self.part[layer, : H * D].view(H, D), self.part[layer, H * D:]
            w2 = torch.sigmoid(lse - self.w_lse[layer]).nan_to_num_(0.0)
            att = torch.lerp(att, o, w2[:, None])
        att = att.to(self.x.dtype).view(1, H * D)
        if block.attn.gated:
            att = att * torch.sigmoid(self.gate[layer][None])
        a = block.attn.wo(att)
        h = self.x + (a if block.post_attn_norm is None else block.post_attn_norm(a))
        f = block.ffn(block.ffn_norm(h))
        self.x.copy_(h + (f if block.post_ffn_norm is None else block.post_ffn_norm(f)))
