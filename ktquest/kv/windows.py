"""The long-context cache's device windows: the initial (sink) window and the local window of each layer, kept
on the device and attended there densely (``LongContextCache``, kv/long_context.py, holds them; this mixin
reads its ``win_k``/``win_v``, ``init_end``, ``buf0``, ``bs``, ``lc``, ``H``/``KVH``/``G``/``D``, ``scale``
and ``device``).

Window buffer, per layer: ``win_k/win_v [L, KVH, init_end + cap, D]``: index p < init_end holds position p;
index init_end + j holds position buf0 + j (buf0 block aligned, <= the local start). It is compacted (the
local window moved to the front) when a pass would not fit, in a prompt's pass of several tokens whose
window left rows behind, and in decode only once a quarter of it is dead, so decode appends in place;
capacity = local_windows_len + block_size + chunk_size, independent of the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ktquest.kv.attention import FLASH_CPU

FLASH_TILE = 64  # query tokens per flash call of _window_attention


@dataclass(slots=True)
class PassGeometry:
    """Where the windows stand for the current pass (the same for every layer)."""

    start: int = 0  # first position of the pass
    T: int = 0
    loc0: int = 0  # local window start (block aligned): context blocks are [ib, loc0 // bs)
    mask: torch.Tensor | None = None  # [T, W] additive, device: 0 = attend, -inf = not this part
    mask_rows: torch.Tensor | None = None  # [T*G, W]: the mask per query row (t, g)
    width: int = 0  # W: window buffer indexes 0..W-1 in use
    skip: tuple[int, int] = (0, 0)  # decode: window indexes [a, b) that left the window (the mask's -inf)
    decode: bool = False  # a decode step (one token past the prompt): it selects; a prompt's pass reads every block


class DeviceWindows:
    """Where positions lie in the window buffers, their moves, and the dense attention over them."""

    def _local_start(self, n: int) -> int:
        """First position of the local window when n tokens are held (block aligned, >= init_end)."""
        return max(self.init_end, (n - self.lc.local_windows_len) // self.bs * self.bs)

    def _window_row(self, pos: int) -> int:
        """Row of position ``pos`` in the window buffers: positions below init_end map to themselves, later
        ones to init_end + pos - buf0 (buf0 = init_end then)."""
        return self.init_end + pos - self.buf0 if pos >= self.init_end else pos

    def _past(self, start: int) -> tuple[int, tuple[int, int], int]:
        """Where the keys of the positions before ``start`` (<= pos) lie, disjoint and together all of them: window
        rows [0, init_rows) and [a, b) on the device, the store's context blocks [ib, lb)."""
        if start <= self.init_end:
            return start, (0, 0), self.ib
        loc0 = max(self.buf0, min(self._local_start(start), start // self.bs * self.bs))
        return self.init_end, (self._window_row(loc0), self._window_row(start)), loc0 // self.bs

    def _window_rows(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the local-window rows of layer ``layer`` that hold positions [buf0, start): what
        ``_window_to`` overwrites and ``_window_back`` puts back."""
        rows = slice(self.init_end, self._window_row(start))
        return self.win_k[layer, :, rows].clone(), self.win_v[layer, :, rows].clone()

    def _window_to(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s windows as they stand after positions [start, start + n) with K/V k, v [KVH, n, D]
        (the layer held positions [.., start)): the init window's rows, and the local window [buf, start + n)
        with buf = ``_local_start(start + n)``, from row init_end on. ``buf0`` is the caller's to set once
        every layer moved."""
        end, ie = start + k.shape[1], self.init_end
        wk, wv = self.win_k[layer], self.win_v[layer]  # [KVH, rows, D]
        if start < ie:  # prompt positions in the init window: rows = positions
            m = min(end, ie) - start
            wk[:, start: start + m], wv[:, start: start + m] = k[:, :m], v[:, :m]
        if end > ie:
            buf = self._local_start(end)
            if buf < start:  # its positions before the prompt move to the front (their rows lie further right)
                src = self._window_row(buf)
                wk[:, ie: ie + start - buf] = wk[:, src: src + start - buf].clone()
                wv[:, ie: ie + start - buf] = wv[:, src: src + start - buf].clone()
            first = max(start, buf)
            wk[:, ie + first - buf: ie + end - buf] = k[:, first - start:]
            wv[:, ie + first - buf: ie + end - buf] = v[:, first - start:]

    def _window_back(self, layer: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Undo ``_window_to`` with what ``_window_rows`` copied before it (buf0 unchanged since)."""
        n = saved[0].shape[1]
        self.win_k[layer, :, self.init_end: self.init_end + n] = saved[0]
        self.win_v[layer, :, self.init_end: self.init_end + n] = saved[1]

    def _window_attention(self, layer: int, q: torch.Tensor, g: PassGeometry):
        """Dense attention over the device windows: (out [T, H, D], lse [T, H], probs [KVH, T*G, W] or None).

        Rows are ordered (t, g) per KV head, so the [T, W] mask broadcasts over G without a copy, and for
        T = 1 every reshape is a view. CPU fp32 (not DYNAMIC, which needs probs): torch's flash kernel in query
        tiles of FLASH_TILE tokens, each against the columns its last query sees; probs None. Otherwise a
        baddbmm or bmm, one exp pass for the softmax and its log-sum-exp, and one bmm.
        """
        T, KVH, G, D = q.shape[0], self.KVH, self.G, self.D  # (a CPU fp32 decode step takes _decode_native)
        keys = self.win_k[layer, :, : g.width]  # [KVH, W, D]
        vals = self.win_v[layer, :, : g.width]
        qh = q.reshape(T, KVH, G, D).transpose(0, 1).reshape(KVH, T * G, D)  # [KVH, T*G, D]
        if FLASH_CPU is not None and self.device.type == "cpu" and self.lc.anchor_type != "DYNAMIC" \
                and keys.dtype == torch.float32:
            # torch's fused CPU flash attention returns the LSE too: 2-3x faster than the explicit ops below.
            # Query tiles of FLASH_TILE tokens, each against the key columns its last query sees ([0, w)): a
            # prompt chunk's causal square costs about half of one masked call (torch's CPU flash skips no
            # block of a mask, and with is_causal not the upper half of a 512-square either).
            outs, lses = [], []
            for t0 in range(0, T, FLASH_TILE):
                t1 = min(T, t0 + FLASH_TILE)
                w = g.width if g.mask is None else self._window_row(g.start + t1 - 1) + 1  # (the last tile: W)
                mask = None if g.mask is None else g.mask_rows[t0 * G: t1 * G, :w]  # [tile*G, w]
                o, s = FLASH_CPU(qh[None, :, t0 * G: t1 * G], keys[None, :, :w], vals[None, :, :w], 0.0, False,
                                 attn_mask=mask, scale=self.scale)
                outs.append(o)
                lses.append(s)
            out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))
            out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, self.H, D)
            return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, self.H), None
        if keys.dtype != torch.float32:
            qh, keys, vals = qh.float(), keys.float(), vals.float()
        if g.mask is None:  # decode, nothing to hide
            s = torch.bmm(qh, keys.transpose(1, 2)).mul_(self.scale)  # [KVH, G, W]
        elif T == 1:
            s = torch.baddbmm(g.mask, qh, keys.transpose(1, 2), alpha=self.scale)  # mask [1, W] broadcasts
        else:
            s = torch.bmm(qh, keys.transpose(1, 2)).mul_(self.scale)  # [KVH, T*G, W]
            s.view(KVH, T, G, g.width).add_(g.mask[:, None, :])
        # softmax and its log-sum-exp in one exp pass, in place (torch.logsumexp would run its own exp over a
        # temporary of the scores' size): [KVH, T*G, W]
        m = s.amax(-1, keepdim=True).clamp_min_(torch.finfo(s.dtype).min)  # a row of -inf keeps m finite
        probs = s.sub_(m).exp_()
        total = probs.sum(-1, keepdim=True)  # >= 1 in every row that has an unmasked key
        probs.div_(total)
        lse = (m + total.log()).squeeze(-1)  # [KVH, T*G]
        out = torch.bmm(probs, vals)  # [KVH, T*G, D]
        out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, self.H, D)
        return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, self.H), probs
