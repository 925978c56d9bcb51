"""The dense KV cache: every position of every layer kept, attention by ``scaled_dot_product_attention``.

Layout: per layer, k, v: [1, KVH, capacity, D], head-major. ``layer_kv(l)[0][:, :n]`` is then a [KVH, n, D]
view with unit stride along D and each head's keys contiguous, which SDPA reads in place: the past is never
copied or re-laid out per step, and decode streams each head's keys from memory in order (on the CPU through
the C++ kernel of ``native.attention.dense_decode_attention``, elsewhere SDPA). Appending a chunk is a
small strided copy of [T, KVH, D] into [KVH, T, D]. GQA is SDPA's ``enable_gqa`` (no expanded K/V copy).

Memory on demand: a layer's capacity starts at ``GROW_TOKENS`` and grows as the conversation does, by half
again and to a multiple of ``GROW_TOKENS`` (a copy of that layer alone, amortised over the tokens that filled
it), up to ``max_seq_len``: a ceiling, not a reservation. The ceiling is still checked up front
(``check_dense_fits``): a cache that could never fit is refused before any work.

``pos`` counts the positions that hold valid k/v for every layer; it advances when the last layer of a
forward pass has stored its k/v, so a forward pass interrupted half-way leaves ``pos`` unchanged (the
half-written slots beyond it are overwritten by the next pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ktquest.kv.base import DeviceToken
from ktquest.kv.dual_chunk_attention import dca_decode, dca_prefill
from ktquest.kv.memory import check_dense_fits
from ktquest.kv.placement import Placement
from ktquest.models.dual_chunk import DualChunk
from ktquest.native.attention import dense_decode_attention
from ktquest.native.plans import TokenPlan, dense_layer

GROW_TOKENS = 1024  # a layer's first capacity, and the multiple its capacities are rounded up to


class DenseKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, threads: int = 1,
                 dual_chunk: DualChunk | None = None):
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1")
        check_dense_fits(n_layers, n_kv_heads, head_dim, max_seq_len, torch.device(device), dtype)
        self.n_layers, self.max_seq_len = n_layers, max_seq_len
        self.placement = Placement.of(device, dtype)
        self.device = self.placement.device
        shape = (1, n_kv_heads, min(max_seq_len, GROW_TOKENS), head_dim)
        self._k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]  # [1, KVH, cap, D]
        self._v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]  # [1, KVH, cap, D]
        self.pos = 0
        self._np: list | None = None  # numpy views of the layers for the native decode plan
        self.generation = 0  # counts the buffers' replacements (a device step captured over them is stale)
        # CPU fp32 decode goes to the C++ split-K kernel (native.attention.dense_decode_attention): SDPA read a
        # decode step's K/V at a fraction of the DRAM bandwidth the kernel streams them at.
        self.threads = max(1, threads)
        self.scale = head_dim ** -0.5
        self._mask_key: tuple[int, int] | None = None
        self._mask: torch.Tensor | None = None
        # dual chunk attention (models/dual_chunk.py): the model then sends q as [3, T, H, D], its three rotations
        self.dual_chunk = dual_chunk

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """Store k/v at start_pos..start_pos+T-1 and return causal attention over 0..start_pos+T-1.

        q: [T, H, D], k/v: [T, KVH, D] -> out [T, H, D]. start_pos may be < pos (overwrite, e.g. after a
        rewind) but not > pos (a gap), and the chunk must fit in max_seq_len.
        """
        t = q.shape[-3]
        end = start_pos + t
        if start_pos > self.pos or end > self.max_seq_len or start_pos < 0:
            self._raise_bad_positions(start_pos, end)
        if end > self._k[layer_idx].shape[2]:
            self._grow(layer_idx, end)
        out = self.write_attend(layer_idx, q, k, v, start_pos)
        if layer_idx == self.n_layers - 1:
            self.pos = end
        return out

    def reserve(self, start: int, end: int) -> None:
        """Positions [start, end) are written next (start <= pos, end <= max_seq_len; ValueError naming them
        otherwise): every layer grows to hold them first."""
        if start > self.pos or end > self.max_seq_len or start < 0:
            self._raise_bad_positions(start, end)
        for i in range(self.n_layers):
            if end > self._k[i].shape[2]:
                self._grow(i, end)

    def write_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     start_pos: int) -> torch.Tensor:
        """``attend`` without its checks and without moving ``pos``: the layer holds rows up to start_pos + T
        (``reserve``)."""
        t = q.shape[-3]
        end = start_pos + t
        k_all, v_all = self._k[layer_idx], self._v[layer_idx]  # [1, KVH, cap, D]
        k_all[:, :, start_pos:end] = k.transpose(0, 1)  # [KVH, T, D]
        v_all[:, :, start_pos:end] = v.transpose(0, 1)
        if q.dim() == 4:  # dual chunk attention's three rotations of q
            if self.dual_chunk is None:
                raise ValueError("the model sends dual chunk attention's queries to a cache made without it "
                                 "(make it with the model's args.dual_chunk)")
            if self.dual_chunk.active(end):
                if t == 1 and self.placement.native:
                    return dca_decode(q[:, 0], k_all[0], v_all[0], start_pos, self.scale, self.dual_chunk,
                                      self.threads)[None]
                return dca_prefill(q, k_all[0], v_all[0], start_pos, self.scale, self.dual_chunk).to(q.dtype)
            q = q[0]  # every key in the query's chunk: the intra rotation is the true position
        if t == 1 and self.placement.native:  # decode: the one query sees every position
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

    def prompt_layers(self, start: int, n: int) -> DensePromptLayers:
        """A prompt of ``n`` tokens at ``start`` read layer by layer (``KVCache.prompt_layers``)."""
        return DensePromptLayers(self, start, n)

    def prefill_device_bytes(self, n: int) -> int:
        """Device bytes a layer-major prompt of ``n`` tokens adds: none (the cache holds every token)."""
        return 0

    def _grow(self, layer_idx: int, end: int) -> None:
        """Layer ``layer_idx``'s capacity to at least ``end`` tokens (by half again, to a multiple of
        GROW_TOKENS, at most max_seq_len); the tokens it holds are copied over."""
        old = self._k[layer_idx]
        cap = -(-max(end, old.shape[2] * 3 // 2) // GROW_TOKENS) * GROW_TOKENS
        cap = min(self.max_seq_len, cap)
        for bufs in (self._k, self._v):
            new = bufs[layer_idx].new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.pos] = bufs[layer_idx][:, :, : self.pos]
            bufs[layer_idx] = new
        self._np = None
        self.generation += 1

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K and V, [KVH, capacity, D] each (positions 0..pos-1 valid)."""
        return self._k[layer_idx][0], self._v[layer_idx][0]

    @property
    def capacity(self) -> int:
        """Tokens every layer can hold without growing."""
        return min(k.shape[2] for k in self._k)

    def _chunk_mask(self, start_pos: int, t: int) -> torch.Tensor:
        """[T, start_pos + T] bool: chunk query i (position start_pos + i) sees keys 0..start_pos + i.

        Built once per forward pass and shared by all layers.
        """
        if self._mask_key != (start_pos, t):
            qpos = torch.arange(start_pos, start_pos + t, device=self.device)[:, None]
            kpos = torch.arange(start_pos + t, device=self.device)[None, :]
            self._mask, self._mask_key = kpos <= qpos, (start_pos, t)
        return self._mask

    def _raise_bad_positions(self, start_pos: int, end: int) -> None:
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start_pos}..{end - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (the cache holds {self.pos} tokens)")
        raise ValueError(f"KV cache: cannot write positions {start_pos}..{end - 1}: the cache holds "
                         f"{self.pos} tokens, so a chunk must start at 0..{self.pos}")

    def begin_prompt(self, end: int, then_decode: bool = True) -> None:
        """(Every prompt is read exactly.)"""

    def plan_decode(self, pos: int) -> TokenPlan | None:
        """The whole decode token at ``pos`` in one native call (``KVCache.plan_decode``), every layer grown to
        hold it first; None off the CPU in fp32 (the token then goes block by block through ``attend``)."""
        if not self.placement.native or (self.dual_chunk is not None and self.dual_chunk.active(pos + 1)):
            return None  # (past the first chunk, dual chunk attention's token goes through the model's layers)
        self.reserve(pos, pos + 1)
        if self._np is None:  # numpy views of every layer, made again only when a layer grew
            self._np = [(k[0].numpy(), v[0].numpy()) for k, v in zip(self._k, self._v)]
        return TokenPlan(pos, [dense_layer(k, v, pos) for k, v in self._np], self.scale)

    def device_token(self, pos: int) -> DeviceToken | None:
        """``KVCache.device_token``: every layer grown to hold ``pos``; its query attends rows [0, pos]. None
        with dual chunk attention past its first chunk."""
        if self.dual_chunk is not None and self.dual_chunk.active(pos + 1):
            return None
        self.reserve(pos, pos + 1)
        return DeviceToken(pos, pos, pos + 1, generation=self.generation)

    def device_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer][0], self._v[layer][0]

    def commit_device_token(self, token: DeviceToken) -> None:
        self.pos = token.pos + 1

    def commit_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` is in every layer."""
        self.pos = plan.pos + 1

    def abort_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` raised part-way: rows at ``plan.pos`` may be written, past ``pos``: nothing to
        undo."""

    def reset(self) -> None:
        """Forget every token (the memory is kept)."""
        self.pos = 0

    def prompt_read(self, end: int) -> None:
        """A layer-major prompt ending at ``end`` is in every layer (``DensePromptLayers.done``)."""
        self.pos = end

    def rewind_point(self, n: int) -> int:
        """``KVCache.rewind_point``: every prefix is kept exactly."""
        return n

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        self.pos = n

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps (``ktquest.kv.files``): the tokens held, each layer's k/v [KVH, pos, D]."""
        arrays = {}
        for i in range(self.n_layers):
            arrays[f"k{i}"], arrays[f"v{i}"] = self._k[i][0, :, : self.pos], self._v[i][0, :, : self.pos]
        return {"pos": self.pos}, arrays

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        """The cache becomes what ``state`` gave (shapes checked by the caller, ``files.expect``)."""
        n = meta["pos"]
        for i in range(self.n_layers):
            if n > self._k[i].shape[2]:
                self.pos = 0  # nothing to copy over
                self._grow(i, n)
            self._k[i][0, :, :n] = arrays[f"k{i}"]
            self._v[i][0, :, :n] = arrays[f"v{i}"]
        self.pos = n

    def state_shapes(self, meta: dict, path: str = "") -> dict[str, tuple]:
        """The arrays ``load_state`` takes for ``meta``: name -> (shape, dtype); KVFileError for a bad ``meta``."""
        from ktquest.kv.files import check_meta

        n, (_, kvh, _, d) = check_meta(path, meta, "pos", 0, self.max_seq_len), self._k[0].shape
        return {f"{kv}{i}": ((kvh, n, d), self._k[0].dtype) for i in range(self.n_layers) for kv in "kv"}

    def check_state(self, meta: dict, arrays: dict[str, torch.Tensor], path: str = "") -> None:
        """KVFileError unless ``load_state`` takes ``meta`` and ``arrays`` (their names, shapes and dtypes)."""
        from ktquest.kv.files import expect

        expect(path, arrays, self.state_shapes(meta, path))

    def nbytes(self) -> int:
        """Bytes held now (the capacity grown so far, not max_seq_len's)."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self._k, self._v))


class DensePromptLayers:
    """A prompt read layer by layer into a dense cache (``KVCache.prompt_layers``): every layer is grown to hold
    it first, each chunk writes its rows and attends rows [0, its end); ``pos`` moves when every layer is done."""

    def __init__(self, cache: DenseKVCache, start: int, n: int):
        end = start + n
        if n < 1:
            raise ValueError(f"layer-major prompt: {n} tokens")
        cache.reserve(start, end)
        cache.truncate(start)  # rows past start are overwritten
        self.cache, self.start, self.end = cache, start, end
        self.device_bytes = 0

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """``KVCache.attend`` for the layer being read (its chunks in order)."""
        if not (self.start <= start_pos and start_pos + q.shape[-3] <= self.end):
            raise ValueError(f"layer-major prompt: positions {start_pos}..{start_pos + q.shape[-3] - 1} are outside "
                             f"the prompt's {self.start}..{self.end - 1}")
        return self.cache.write_attend(layer_idx, q, k, v, start_pos)

    def layer_done(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` read the whole prompt."""

    def done(self) -> None:
        """Every layer read the prompt: the cache holds it."""
        self.cache.prompt_read(self.end)

    def abort(self) -> None:
        """The read stopped part-way: the cache holds what it held before the prompt."""
