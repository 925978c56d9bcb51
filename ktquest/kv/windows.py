"""The long-context cache's device windows: every layer's initial (sink) window and local window, kept on the
device and attended there densely (``LongContextCache``, kv/long_context.py, owns one ``Windows``).

Buffer, per layer: ``k/v [L, KVH, init_end + cap, D]``: index p < init_end holds position p; index init_end + j
holds position buf0 + j (buf0 block aligned, <= the local window's start). It is compacted (the local window
moved to the front) when a pass would not fit, in a prompt's pass of several tokens whose window left rows
behind, and in decode only once a quarter of it is dead, so decode appends in place; capacity = cap =
local_windows_len + block_size + chunk_size, independent of the prompt length.

A pass's geometry (where its rows go, which rows each of its queries sees) is a ``PassGeometry``, made once for
every layer by ``begin_pass``. The windows' attention is the pass's (kv/long_context_pass.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ktquest.kv.placement import Placement


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
    w0: int = 0  # the pass's first row


class Windows:
    """Every layer's init and local window on the device (see the module docstring): where positions lie in the
    buffers, their moves, and what the KV files keep of them."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, init_end: int, local_len: int,
                 block_size: int, cap: int, placement: Placement):
        self.init_end, self.local_len, self.bs, self.cap = init_end, local_len, block_size, cap
        self.placement = placement
        shape = (n_layers, n_kv_heads, init_end + cap, head_dim)
        self.k = torch.zeros(shape, device=placement.device, dtype=placement.dtype)  # [L, KVH, init_end + cap, D]
        self.v = torch.zeros(shape, device=placement.device, dtype=placement.dtype)
        # numpy views of each layer's buffers for the native decode calls (the buffers are never replaced)
        self.views = [(self.k[i].numpy(), self.v[i].numpy()) for i in range(n_layers)] if placement.native else None
        self.buf0 = init_end  # position of row init_end

    def reset(self) -> None:
        self.buf0 = self.init_end

    def load(self, k: torch.Tensor, v: torch.Tensor, buf0: int) -> None:
        """The buffers and their first local position as a KV file kept them (shapes checked by its reader)."""
        self.k.copy_(k)
        self.v.copy_(v)
        self.buf0 = buf0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    # ---- where positions lie ----

    def local_start(self, n: int) -> int:
        """First position of the local window when n tokens are held (block aligned, >= init_end)."""
        return max(self.init_end, (n - self.local_len) // self.bs * self.bs)

    def pass_loc0(self, start: int, T: int) -> int:
        """The local window's start for a pass over [start, start + T): strictly the last local_len tokens of
        start + T, but never past the store's full blocks (a context block must be in the store before the
        chunk)."""
        return max(self.init_end, min(self.local_start(start + T), start // self.bs * self.bs))

    def row(self, pos: int) -> int:
        """Row of position ``pos`` in the buffers: positions below init_end map to themselves, later ones to
        init_end + pos - buf0."""
        return self.init_end + pos - self.buf0 if pos >= self.init_end else pos

    def past(self, start: int, ib: int) -> tuple[int, tuple[int, int], int]:
        """Where the keys of the positions before ``start`` lie, disjoint and together all of them: rows
        [0, init_rows) and [a, b) of the buffers, the store's context blocks [ib, lb)."""
        if start <= self.init_end:
            return start, (0, 0), ib
        loc0 = max(self.buf0, min(self.local_start(start), start // self.bs * self.bs))
        return self.init_end, (self.row(loc0), self.row(start)), loc0 // self.bs

    # ---- a pass ----

    def begin_pass(self, start: int, T: int, decode: bool, group: int, mask_skip: bool) -> PassGeometry:
        """The geometry of a pass over positions [start, start + T) (held: [0, start)), the buffers compacted
        first where it says so. group: query heads per KV head (the mask's rows); mask_skip: a decode step's
        skipped stretch as a mask too (the native kernel skips it by itself)."""
        ie, bs, dev = self.init_end, self.bs, self.placement.device
        loc0 = self.pass_loc0(start, T)
        # Compact (move [loc0, start) to the front of the local part) when the pass would not fit, in a
        # prompt's pass of several tokens whenever rows left the window (then the window attention scores
        # no dead rows; at most local_len rows move, none in million.yaml's full prefill chunks), or in decode
        # once a quarter of the window is dead weight that every step would read and mask. (A cut pass leaves
        # buf0 at its loc0, past the local window of the positions held: ``refill``.)
        if (start + T - self.buf0 > self.cap or (T > 1 and loc0 > self.buf0)
                or (T == 1 and loc0 - self.buf0 > max(bs, self.cap // 4))):
            m, off = start - loc0, ie + loc0 - self.buf0
            for buf in (self.k, self.v):
                buf[:, :, ie: ie + m] = buf[:, :, off: off + m].clone()
            self.buf0 = loc0
        width = ie + start + T - self.buf0 if start + T > ie else start + T
        # Additive mask [T, W]: query start+i sees window index j iff its position p(j) <= start+i and p(j) is
        # in the init window or in [loc0, ...). Decode sees every index but the dropped ones.
        drop = loc0 - self.buf0 if start >= ie else 0  # positions [buf0, loc0) left the window
        skip = (0, 0)
        if decode:
            mask = None
            if drop > 0:
                skip = (ie, ie + drop)
            if drop > 0 and mask_skip:
                mask = torch.zeros(1, width, device=dev)
                mask[:, skip[0]: skip[1]] = float("-inf")
        else:
            j = torch.arange(width, device=dev)
            p = torch.where(j < ie, j, self.buf0 + j - ie)  # [W] positions
            qpos = torch.arange(start, start + T, device=dev)[:, None]  # [T, 1]
            ok = (p[None, :] <= qpos) & ((p < ie) | (p >= loc0))[None, :]
            mask = torch.zeros(T, width, device=dev).masked_fill_(~ok, float("-inf"))
        rows = None if mask is None else mask.repeat_interleave(group, 0)  # [T*G, W]
        return PassGeometry(start, T, loc0, mask, rows, width, skip, decode, self.row(start))

    def write(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, KVH, D] into rows [row, row + T) of ``layer``."""
        T = k.shape[0]
        self.k[layer, :, row: row + T] = k.transpose(0, 1)
        self.v[layer, :, row: row + T] = v.transpose(0, 1)

    def refill(self, n: int, store) -> None:
        """With ``n`` tokens held, the buffers hold the local window of n again (``buf0`` <= its start): where
        they start past it (after a truncate, or after a prompt's pass that compacted up to its own local
        window and was cut), the rows they still hold move right and positions [loc0, buf0) come from the
        store (``KVStore.read_range``)."""
        loc0 = self.local_start(n)  # >= init_end: with n <= init_end the init window holds them all
        if loc0 >= self.buf0:
            return
        ie, kept = self.init_end, max(0, n - self.buf0)
        shift, m = self.buf0 - loc0, min(n, self.buf0) - loc0
        for layer in range(self.k.shape[0] if loc0 < n else 0):
            for buf in (self.k, self.v):
                buf[layer, :, ie + shift: ie + shift + kept] = buf[layer, :, ie: ie + kept].clone()
            k, v = store.read_range(layer, loc0, loc0 + m)  # [m, KVH, D] fp32
            self.k[layer, :, ie: ie + m] = k.transpose(0, 1).to(self.k)
            self.v[layer, :, ie: ie + m] = v.transpose(0, 1).to(self.v)
        self.buf0 = loc0

    # ---- a prompt read layer by layer (kv/layer_prefill.py) ----

    def gather(self, layer: int, init_rows: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``layer``'s rows [0, init_rows) and [a, b): keys, values [KVH, n, D]."""
        a, b = rows
        k, v = self.k[layer], self.v[layer]  # [KVH, rows, D]
        return torch.cat([k[:, :init_rows], k[:, a:b]], 1), torch.cat([v[:, :init_rows], v[:, a:b]], 1)

    def saved_rows(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of ``layer``'s local rows that hold positions [buf0, start): what ``move_to`` overwrites and
        ``put_back`` restores."""
        rows = slice(self.init_end, self.row(start))
        return self.k[layer, :, rows].clone(), self.v[layer, :, rows].clone()

    def move_to(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``layer``'s windows as they stand after positions [start, start + n) with K/V k, v [KVH, n, D] (the
        layer held positions [.., start)): the init window's rows, and the local window [buf, start + n) with
        buf = ``local_start(start + n)``, from row init_end on. ``buf0`` moves once every layer moved
        (``moved``)."""
        end, ie = start + k.shape[1], self.init_end
        wk, wv = self.k[layer], self.v[layer]  # [KVH, rows, D]
        if start < ie:  # prompt positions in the init window: rows = positions
            m = min(end, ie) - start
            wk[:, start: start + m], wv[:, start: start + m] = k[:, :m], v[:, :m]
        if end > ie:
            buf = self.local_start(end)
            if buf < start:  # its positions before the prompt move to the front (their rows lie further right)
                src = self.row(buf)
                wk[:, ie: ie + start - buf] = wk[:, src: src + start - buf].clone()
                wv[:, ie: ie + start - buf] = wv[:, src: src + start - buf].clone()
            first = max(start, buf)
            wk[:, ie + first - buf: ie + end - buf] = k[:, first - start:]
            wv[:, ie + first - buf: ie + end - buf] = v[:, first - start:]

    def moved(self, end: int) -> None:
        """Every layer ``move_to`` the positions up to ``end``: row init_end holds the local window's start."""
        self.buf0 = max(self.init_end, self.local_start(end))

    def put_back(self, layer: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Undo ``move_to`` with what ``saved_rows`` copied before it (buf0 unchanged since)."""
        n = saved[0].shape[1]
        self.k[layer, :, self.init_end: self.init_end + n] = saved[0]
        self.v[layer, :, self.init_end: self.init_end + n] = saved[1]
