"""The dense KV cache: every position of every layer kept, attention by ``scaled_dot_product_attention``.

Layout: k, v: [L, KVH, max_seq_len, D], head-major. ``k[l, :, :n]`` is then a [KVH, n, D] view with unit
stride along D and each head's keys contiguous, which SDPA reads in place: the past is never copied or
re-laid out per step, and decode streams each head's keys from memory in order (on the CPU through
the C++ kernel of ``kv.attention.dense_decode_attention``, elsewhere SDPA). Appending a chunk is a
small strided copy of [T, KVH, D] into [KVH, T, D]. GQA is SDPA's ``enable_gqa`` (no expanded K/V copy).

``pos`` counts the positions that hold valid k/v for every layer; it advances when the last layer of a
forward pass has stored its k/v, so a forward pass interrupted half-way leaves ``pos`` unchanged (the
half-written slots beyond it are overwritten by the next pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ktquest.kv.attention import dense_decode_attention
from ktquest.kv.memory import check_dense_fits


class DenseKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, threads: int = 1):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
        check_dense_fits(n_layers, n_kv_heads, head_dim, max_seq_len, torch.device(device), dtype)
        self.n_layers, self.max_seq_len = n_layers, max_seq_len
        shape = (n_layers, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, KVH, S, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, KVH, S, D]
        # Per-layer views [1, KVH, S, D], made once: a decode step then costs one slice per tensor.
        self._k = [self.k[i, None] for i in range(n_layers)]
        self._v = [self.v[i, None] for i in range(n_layers)]
        self.pos = 0
        # CPU fp32 decode goes to the C++ split-K kernel (kv/attention.dense_decode_attention): SDPA read a decode
        # step's K/V at a fraction of the DRAM bandwidth the kernel streams them at.
        self._native_decode = self.k.device.type == "cpu" and dtype == torch.float32
        self.threads = max(1, threads)
        self.scale = head_dim ** -0.5
        self._mask_key: tuple[int, int] | None = None
        self._mask: torch.Tensor | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """Store k/v at start_pos..start_pos+T-1 and return causal attention over 0..start_pos+T-1.

        q: [T, H, D], k/v: [T, KVH, D] -> out [T, H, D]. start_pos may be < pos (overwrite, e.g. after a
        rewind) but not > pos (a gap), and the chunk must fit in max_seq_len.
        """
        t = q.shape[0]
        end = start_pos + t
        if start_pos > self.pos or end > self.max_seq_len or start_pos < 0:
            self._raise_bad_positions(start_pos, end)
        k_all, v_all = self._k[layer_idx], self._v[layer_idx]  # [1, KVH, S, D]
        k_all[:, :, start_pos:end] = k.transpose(0, 1)  # [KVH, T, D]
        v_all[:, :, start_pos:end] = v.transpose(0, 1)
        if layer_idx == self.n_layers - 1:
            self.pos = end
        if t == 1 and self._native_decode:  # decode: the one query sees every position
            out, _ = dense_decode_attention(q[0], k_all[0], v_all[0], end, self.scale, self.threads)
            return out[None]  # [1, H, D]
        keys, values = k_all[:, :, :end], v_all[:, :, :end]  # [1, KVH, end, D]
        if t == 1:  # [1, H, D] -> [1, H, 1, D] is a view
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, enable_gqa=True)
            return out.squeeze(2)  # [1, H, D]
        query = q.transpose(0, 1)[None]  # [1, H, T, D]
        if start_pos == 0:  # a chunk from 0: plain top-left causal
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            mask = self._chunk_mask(start_pos, t)  # [T, end]
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, H, D]

    def _chunk_mask(self, start_pos: int, t: int) -> torch.Tensor:
        """[T, start_pos + T] bool: chunk query i (position start_pos + i) sees keys 0..start_pos + i.

        Built once per forward pass and shared by all layers.
        """
        if self._mask_key != (start_pos, t):
            qpos = torch.arange(start_pos, start_pos + t, device=self.k.device)[:, None]
            kpos = torch.arange(start_pos + t, device=self.k.device)[None, :]
            self._mask, self._mask_key = kpos <= qpos, (start_pos, t)
        return self._mask

    def _raise_bad_positions(self, start_pos: int, end: int) -> None:
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start_pos}..{end - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (the cache holds {self.pos} tokens)")
        raise ValueError(f"KV cache: cannot write positions {start_pos}..{end - 1}: the cache holds "
                         f"{self.pos} tokens, so a chunk must start at 0..{self.pos}")

    def plan_decode(self, pos: int) -> None:
        """The decode step goes block by block through ``attend`` (``KVCache.plan_decode``)."""

    def commit_decode(self, plan) -> None:  # never planned
        raise AssertionError("DenseKVCache makes no decode plans")

    abort_decode = commit_decode

    def reset(self) -> None:
        """Forget every token (the memory is kept)."""
        self.pos = 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        self.pos = n

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
