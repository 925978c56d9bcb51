"""The cache of a model whose layers mix sliding-window and global attention (gemma3: five of every six
layers attend only the last ``window`` positions).

``HybridCache`` is the model's ``KVCache``: it sends each sliding layer to ``WindowKV`` (its last positions
on the device, never in the DRAM store) and each global layer, renumbered 0..n_global-1, to the configured
cache (dense, or long_context with its store, selection and sparse operator: presets and knobs apply to the
global layers alone, ``dense_layer_num`` counts them).

WindowKV keeps each layer's positions [base, hi) in rows [0, hi - base) of a [KVH, rows, D] buffer: a
window that slides by compaction (the newest positions moved to the front every ``COMPACT_TOKENS``), so
the positions a query attends are always contiguous rows. Beyond the window it keeps ``keep`` positions (the
config's ``sliding_window_keep``, at least a chunk) more, so a conversation can rewind that far exactly (a
chat turn that re-tokenizes the end of the last reply) and an interrupted chunk leaves the window it
started from. A rewind further back cannot be
served from the buffer: ``rewind_point`` then says 0 and the caller feeds the conversation again.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ktquest.kv.base import check_write
from ktquest.kv.placement import Placement
from ktquest.native.attention import dense_decode_attention
from ktquest.native.plans import TokenPlan, dense_layer

COMPACT_TOKENS = 256  # the buffer's slack: rows moved to the front once every this many tokens


def global_args(args):
    """``args`` as the global layers' cache sees them: ``n_layers`` = the global layers."""
    g = args.global_layers
    return dataclasses.replace(args, n_layers=len(g), blocks=tuple(args.blocks[i] for i in g))


class WindowKV:
    """The sliding layers' k/v: each layer's last positions, at least ``window - 1 + keep`` of them."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int, keep: int,
                 device: torch.device, dtype: torch.dtype, threads: int = 1):
        self.window, self.keep = window, keep
        self.rows = window - 1 + self.keep + COMPACT_TOKENS
        shape = (n_layers, n_kv_heads, self.rows, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, KVH, rows, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, KVH, rows, D]
        self.base = [0] * n_layers  # layer l holds positions [base[l], hi[l]) in rows [0, hi - base)
        self.hi = [0] * n_layers
        self.scale = head_dim ** -0.5
        self.threads = threads
        self.placement = Placement.of(device, dtype)
        # numpy views of each layer's buffers for the native decode plan (the buffers are never replaced)
        self._np = [(self.k[i].numpy(), self.v[i].numpy()) for i in range(n_layers)] if self.placement.native else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] at positions start..start+T-1 -> out [T, H, D]: each query attends the
        ``window`` positions ending at its own. Stores k/v (positions from ``start`` on are replaced)."""
        t, end = q.shape[0], start + q.shape[0]
        lo = max(0, start - self.window + 1)  # the first position a query of the chunk sees
        if start > self.hi[layer] or lo < self.base[layer]:
            raise ValueError(f"sliding window of layer {layer}: cannot attend from position {start}: it holds "
                             f"positions {self.base[layer]}..{self.hi[layer] - 1}")
        if t == 1 and self.placement.native:  # decode: the window is rows [end - window, end) - base
            self._store(layer, k, v, start)
            b = self.base[layer]
            out, _ = dense_decode_attention(q[0], self.k[layer], self.v[layer], end - b, self.scale,
                                            self.threads, skip=(0, max(0, end - self.window - b)))
            return out[None]  # [1, H, D]
        b = self.base[layer]
        keys = torch.cat([self.k[layer][:, lo - b: start - b], k.transpose(0, 1)], dim=1)  # [KVH, end - lo, D]
        values = torch.cat([self.v[layer][:, lo - b: start - b], v.transpose(0, 1)], dim=1)
        qpos = torch.arange(start, end, device=q.device)[:, None]  # [T, 1]
        kpos = torch.arange(lo, end, device=q.device)[None, :]  # [1, end - lo]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)  # [T, end - lo]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                             enable_gqa=True)  # [1, H, T, D]
        self._store(layer, k, v, start)
        return out[0].transpose(0, 1)  # [T, H, D]

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Positions start..end-1 into the layer's rows (``_make_room`` first)."""
        end = start + k.shape[0]
        b = self._make_room(layer, start, end)
        first = max(start, b)  # a chunk longer than the buffer keeps its newest positions
        self.k[layer, :, first - b: end - b] = k[first - start:].transpose(0, 1)
        self.v[layer, :, first - b: end - b] = v[first - start:].transpose(0, 1)
        self.hi[layer] = end

    def _make_room(self, layer: int, start: int, end: int) -> int:
        """Rows for positions [start, end): past ``rows``, the oldest positions make way (the newest
        ``rows - COMPACT_TOKENS`` are kept, moved to the front). Returns the layer's base."""
        b = self.base[layer]
        if end - b > self.rows:
            nb = end - (self.rows - COMPACT_TOKENS)  # the new base
            if nb < start:  # positions [nb, start) stay: to the front
                for buf in (self.k, self.v):
                    buf[layer, :, : start - nb] = buf[layer, :, nb - b: start - b].clone()
            b = self.base[layer] = nb
        return b

    def plan_decode(self, pos: int) -> list[tuple]:
        """Every layer's part of a native decode token at ``pos`` (``native.plans.dense_layer``: its buffers, the
        token's row, the positions before its window skipped); ``decoded`` once the token ran."""
        out = []
        for layer, (k, v) in enumerate(self._np):
            if pos != self.hi[layer] or max(0, pos - self.window + 1) < self.base[layer]:
                raise ValueError(f"sliding window of layer {layer}: cannot decode position {pos}: it holds "
                                 f"positions {self.base[layer]}..{self.hi[layer] - 1}")
            b = self._make_room(layer, pos, pos + 1)
            out.append(dense_layer(k, v, pos - b, (0, max(0, pos + 1 - self.window - b))))
        return out

    def decoded(self, pos: int) -> None:
        """The token planned at ``pos`` is in every layer."""
        self.hi = [pos + 1] * len(self.hi)

    def can_rewind(self, n: int) -> bool:
        """Whether every layer still holds the window of a query at position n (positions n-window+1..n-1)."""
        lo = max(0, n - self.window + 1)
        return n == 0 or all(b <= lo and n <= h for b, h in zip(self.base, self.hi))

    def truncate(self, n: int) -> None:
        if not self.can_rewind(n):
            raise ValueError(f"truncate({n}): the sliding-window layers no longer hold positions "
                             f"{max(0, n - self.window + 1)}..{n - 1}")
        if n == 0:
            self.reset()
        self.hi = [n] * len(self.hi)

    def reset(self) -> None:
        self.base = [0] * len(self.base)
        self.hi = [0] * len(self.hi)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps (``ktquest.kv.files``): each layer's positions [base, hi), k/v [KVH, hi - base, D]."""
        arrays = {}
        for i, (b, h) in enumerate(zip(self.base, self.hi)):
            arrays[f"k{i}"], arrays[f"v{i}"] = self.k[i, :, : h - b], self.v[i, :, : h - b]
        return {"base": list(self.base), "hi": list(self.hi)}, arrays

    def state_shapes(self, meta: dict, path: str, pos: int) -> dict[str, tuple]:
        """The arrays ``load_state`` takes for ``meta`` of a cache of ``pos`` tokens; KVFileError for a bad
        ``meta``: each layer holds positions up to pos, the window before pos among them."""
        from ktquest.kv.files import KVFileError

        n, lo = len(self.base), max(0, pos - self.window + 1)
        base, hi = (meta.get("base"), meta.get("hi")) if isinstance(meta, dict) else (None, None)
        if not (isinstance(base, list) and isinstance(hi, list) and len(base) == len(hi) == n and
                all(type(b) is int and type(h) is int and h == pos and 0 <= b <= lo and h - b <= self.rows
                    for b, h in zip(base, hi))):
            raise KVFileError(f"{path}: the sliding-window layers' positions are not allowed here")
        _, kvh, _, d = self.k.shape
        return {f"{kv}{i}": ((kvh, h - b, d), self.k.dtype) for i, (b, h) in enumerate(zip(base, hi)) for kv in "kv"}

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        for i, (b, h) in enumerate(zip(meta["base"], meta["hi"])):
            self.k[i, :, : h - b], self.v[i, :, : h - b] = arrays[f"k{i}"], arrays[f"v{i}"]
        self.base, self.hi = list(meta["base"]), list(meta["hi"])


class HybridCache:
    """A ``KVCache`` (kv/base.py) for sliding-window + global layers: see the module docstring.

    ``main``: the global layers' cache (made for ``global_args(args)``); ``windows``: the sliding layers'."""

    def __init__(self, args, main, device: torch.device, dtype: torch.dtype, keep: int, threads: int = 1):
        """keep: positions each sliding layer keeps past its window (raised to a chunk by the caller)."""
        self.main = main
        self.max_seq_len = main.max_seq_len
        swa = [i for i, b in enumerate(args.blocks) if b.attention == "sliding"]
        windows = {args.blocks[i].window for i in swa}
        if len(windows) != 1:
            raise ValueError(f"HybridCache: the sliding layers' windows are {sorted(windows)}: one window is kept")
        # model layer -> (is sliding, index in its cache)
        self.route = {layer: (False, j) for j, layer in enumerate(args.global_layers)}
        self.route |= {layer: (True, j) for j, layer in enumerate(swa)}
        self.windows = WindowKV(len(swa), args.n_kv_heads, args.head_dim, windows.pop(),
                                min(keep, self.max_seq_len), device, dtype, threads)
        self.last_layer = args.n_layers - 1
        self.pos = 0

    @property
    def lc(self):
        """The global layers' long_context knobs (a long_context ``main``)."""
        return self.main.lc

    def retune(self, lc):
        """``LongContextCache.retune`` of the global layers (the only ones that select)."""
        return self.main.retune(lc)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """``KVCache.attend``: the layer's window or the global cache."""
        sliding, j = self.route[layer_idx]
        check_write(start_pos, q.shape[0], self.pos, self.max_seq_len)
        out = (self.windows if sliding else self.main).attend(j, q, k, v, start_pos)
        if layer_idx == self.last_layer:
            self.pos = start_pos + q.shape[0]
        return out

    def prompt_layers(self, start: int, n: int) -> HybridPromptLayers:
        """A prompt of ``n`` tokens at ``start`` read layer by layer (``KVCache.prompt_layers``)."""
        return HybridPromptLayers(self, start, n)

    def prefill_device_bytes(self, n: int) -> int:
        """Device bytes a layer-major prompt of ``n`` tokens adds: the global layers' workspace and the copy of
        the sliding layers' windows kept to undo an interrupted prompt."""
        return self.main.prefill_device_bytes(n) + self.windows.nbytes()

    def plan_decode(self, pos: int) -> TokenPlan | None:
        """The native plan of a decode token at ``pos`` (``KVCache.plan_decode``): the global layers' part as their
        cache plans it, the sliding layers' windows as dense layers beside it, in the model's layer order. None
        where the global cache plans none (a GPU, DYNAMIC anchors, a prompt's token)."""
        if not self.windows.placement.native or pos != self.pos:
            return None
        main = self.main.plan_decode(pos)
        if main is None:
            return None
        try:
            sliding = self.windows.plan_decode(pos)
        except BaseException:  # (a plan begun is committed or aborted: KVCache.plan_decode)
            self.main.abort_decode(main)
            raise
        layers = [sliding[j] if is_sliding else main.layers[j] for is_sliding, j in
                  (self.route[i] for i in range(self.last_layer + 1))]
        return TokenPlan(pos, layers, main.scale, main.store, main.w0, main.width, main.skip, state=main)

    def commit_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` is in every layer."""
        self.main.commit_decode(plan.state)
        self.windows.decoded(plan.pos)
        self.pos = plan.pos + 1

    def abort_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` raised part-way (the sliding layers' rows past their positions are unused)."""
        self.main.abort_decode(plan.state)

    def begin_prompt(self, end: int, then_decode: bool = True) -> None:
        self.main.begin_prompt(end, then_decode)

    def rewind_point(self, n: int) -> int:
        """The longest prefix of at most ``n`` tokens the cache can be truncated to exactly: n, or 0 when
        the sliding layers no longer hold the window before position n."""
        return n if self.windows.can_rewind(n) else 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos, and ``rewind_point(n) == n``)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        self.windows.truncate(n)
        self.main.truncate(n)
        self.pos = n

    def reset(self) -> None:
        self.windows.reset()
        self.main.reset()
        self.pos = 0

    def prompt_read(self, end: int) -> None:
        """A layer-major prompt ending at ``end`` is in every layer (``HybridPromptLayers.done``)."""
        self.pos = end

    def nbytes(self) -> int:
        return self.main.nbytes() + self.windows.nbytes()

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps: the global layers' cache's state and the windows', their arrays prefixed."""
        (m, ma), (w, wa) = self.main.state(), self.windows.state()
        return {"pos": self.pos, "main": m, "windows": w}, \
            {**{f"main.{k}": v for k, v in ma.items()}, **{f"win.{k}": v for k, v in wa.items()}}

    def state_shapes(self, meta: dict, path: str = "") -> dict[str, tuple]:
        from ktquest.kv.files import KVFileError, check_meta

        pos = check_meta(path, meta, "pos", 0, self.max_seq_len)
        main = self.main.state_shapes(meta.get("main"), path)
        if meta["main"]["pos"] != pos:
            raise KVFileError(f"{path}: the global layers hold {meta['main']['pos']} tokens, the cache {pos}")
        return {**{f"main.{k}": v for k, v in main.items()},
                **{f"win.{k}": v for k, v in self.windows.state_shapes(meta.get("windows"), path, pos).items()}}

    def check_state(self, meta: dict, arrays: dict[str, torch.Tensor], path: str = "") -> None:
        """KVFileError unless ``load_state`` takes ``meta`` and ``arrays`` (the global layers' cache checks its own)."""
        from ktquest.kv.files import expect

        expect(path, arrays, self.state_shapes(meta, path))
        self.main.check_state(meta["main"], {k[5:]: v for k, v in arrays.items() if k.startswith("main.")}, path)

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        self.main.load_state(meta["main"], {k[5:]: v for k, v in arrays.items() if k.startswith("main.")})
        self.windows.load_state(meta["windows"], {k[4:]: v for k, v in arrays.items() if k.startswith("win.")})
        self.pos = meta["pos"]


class HybridPromptLayers:
    """A prompt read layer by layer into a ``HybridCache``: the sliding layers through their windows (each keeps
    its own positions, so layer-major order needs nothing more of them), the global layers through the global
    cache's ``prompt_layers``. The sliding windows are copied first: a prompt stopped part-way puts them back."""

    def __init__(self, cache: HybridCache, start: int, n: int):
        check_write(start, n, cache.pos, cache.max_seq_len)
        if cache.rewind_point(start) != start:
            raise ValueError(f"KV cache: cannot rewind to position {start} (the sliding layers moved past it)")
        if start < cache.pos:
            cache.truncate(start)
        w = cache.windows
        self._saved = (w.k.clone(), w.v.clone(), list(w.base), list(w.hi))
        self.cache, self.start, self.end = cache, start, start + n
        self.main = cache.main.prompt_layers(start, n)
        self.device_bytes = self.main.device_bytes + w.k.nbytes + w.v.nbytes

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        sliding, j = self.cache.route[layer_idx]
        if sliding:
            return self.cache.windows.attend(j, q, k, v, start_pos)
        return self.main.attend(j, q, k, v, start_pos)

    def layer_done(self, layer_idx: int) -> None:
        sliding, j = self.cache.route[layer_idx]
        if not sliding:
            self.main.layer_done(j)

    def done(self) -> None:
        self.main.done()
        self.cache.prompt_read(self.end)
        self._saved = None

    def abort(self) -> None:
        self.main.abort()
        w = self.cache.windows
        k, v, w.base, w.hi = self._saved
        w.k.copy_(k)
        w.v.copy_(v)
        self._saved = None
