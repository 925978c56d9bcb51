"""Dual chunk attention (DCA: An et al. 2024, "Training-Free Long-Context Scaling of Large Language Models"), as
Qwen2.5-7B/14B-Instruct-1M and the Qwen3-2507 1M models are run past their trained 262,144 positions.

The sequence is cut into chunks of L = chunk_size - local_size positions. A key is rotated once, at its place in
its chunk (pos mod L). A query at position i is rotated three ways, and each key is scored with the one its chunk
calls for (c = chunk_size):

    the query's own chunk (intra):    q at i mod L               distance i - j, as trained
    the chunk before it (successive): q at min(L + i mod L, c)   i - j while i mod L < local_size (the true
                                                                 distance across the chunk edge), then c - j mod L
    every earlier chunk (inter):      q at c                     c - j mod L, at most c

so no distance exceeds the trained context. The three are one softmax: each part's attention and log-sum-exp are
merged exactly (``kv/dual_chunk_attention.py``). Below L every key is in the query's chunk and DCA is plain
attention. With ``scale_logits`` a query's logits at position i are multiplied by max(1, 0.1 ln((i + 1) / c) + 1),
the temperature Qwen's deployment (vLLM's) adds past the trained context; the successive and inter positions are
theirs too (c, where the paper puts c - 1).

A file says its sizes with the keys ``{arch}.dual_chunk_attention.chunk_size`` and ``.local_size`` (no converter
writes them yet); a qwen-family file of context 1,010,000 is one of Qwen's 1M releases, whose config.json gives
chunk_size 262144 and local_size 8192. The config (``dual_chunk``) turns it on or off and may set the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Qwen's 1M releases: context_length 1010000 in their GGUF files, and this in their config.json
KNOWN_1M_CONTEXT = 1_010_000
QWEN_ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen2moe")
QWEN_1M_CHUNK, QWEN_1M_LOCAL = 262_144, 8_192


@dataclass(frozen=True, slots=True)
class DualChunk:
    chunk_size: int  # c: the trained context no distance exceeds
    local_size: int  # positions past a chunk edge that keep their true distance to the chunk before
    scale_logits: bool = True  # the temperature past c (module docstring)

    def __post_init__(self) -> None:
        if not 1 <= self.local_size < self.chunk_size:
            raise ValueError(f"dual chunk attention: local_size {self.local_size} must be in [1, chunk_size) "
                             f"with chunk_size {self.chunk_size}")

    @property
    def length(self) -> int:
        """L: positions a chunk holds."""
        return self.chunk_size - self.local_size

    def active(self, end: int) -> bool:
        """Whether a query before ``end`` can see a key of an earlier chunk (else DCA is plain attention)."""
        return end > self.length

    def bounds(self, ci: int) -> tuple[int, int]:
        """(succ, intra): where the keys a query of chunk ci scores by its successive, then its intra rotation
        begin (the inter rotation before succ); positions."""
        n = self.length
        return max(0, (ci - 1) * n), ci * n

    def block_bounds(self, ci: int, block_size: int) -> tuple[int, int]:
        """``bounds`` in blocks of ``block_size`` (which divides the chunks): the store's query variants."""
        succ, intra = self.bounds(ci)
        return succ // block_size, intra // block_size

    def groups(self, start: int, t: int) -> list[tuple[int, int, int]]:
        """The queries at [start, start + t) by chunk: [(qa, qb, ci)], each [qa, qb) in chunk ci."""
        n = self.length
        return [(max(start, ci * n), min(start + t, (ci + 1) * n), ci)
                for ci in range(start // n, (start + t - 1) // n + 1)]

    def key_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos % self.length

    def query_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """[3, T]: the intra, successive and inter positions of queries at ``pos`` [T]."""
        inner = pos % self.length
        return torch.stack([inner, (inner + self.length).clamp(max=self.chunk_size),
                            torch.full_like(pos, self.chunk_size)])

    def logit_scale(self, pos: torch.Tensor) -> torch.Tensor:
        """[T] float64: each query's logit multiplier (1 up to chunk_size positions, or without scale_logits)."""
        n = (pos + 1).to(torch.float64)
        if not self.scale_logits:
            return torch.ones_like(n)
        return (0.1 * torch.log(n / self.chunk_size) + 1.0).clamp(min=1.0)

    def describe(self) -> str:
        tempered = f", logits tempered past {self.chunk_size:,}" if self.scale_logits else ""
        return (f"dual chunk attention: chunks of {self.length:,} positions (chunk_size {self.chunk_size:,}, "
                f"local_size {self.local_size:,}){tempered}")


def file_dual_chunk(md: dict, arch: str, context_length: int) -> DualChunk | None:
    """The file's DCA: its keys, or Qwen's sizes for a qwen-family file of context 1,010,000 (one of Qwen's 1M
    releases); None for any other file. Bad keys: ValueError naming them."""
    p = f"{arch}.dual_chunk_attention."
    if p + "chunk_size" in md or p + "local_size" in md:
        c, w = md.get(p + "chunk_size"), md.get(p + "local_size")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (c, w)):
            raise ValueError(f"{p}chunk_size={c!r} and {p}local_size={w!r}: both must be integers")
        return DualChunk(c, w)
    if arch in QWEN_ARCHS and context_length == KNOWN_1M_CONTEXT:
        return DualChunk(QWEN_1M_CHUNK, QWEN_1M_LOCAL)
    return None


def long_context_refusal(dc: DualChunk, lc) -> str | None:
    """Why a long_context cache of knobs ``lc`` cannot run ``dc``, or None: the store attends each block by its
    chunk's rotation, so a chunk must be whole blocks; DYNAMIC anchors take each token's attention, which the
    rotations' parts do not give."""
    if dc.length % lc.block_size:
        return (f"long_context.block_size {lc.block_size}, which does not divide dual chunk attention's chunks of "
                f"{dc.length:,} positions")
    if lc.anchor_type == "DYNAMIC":
        return "long_context.anchor_type DYNAMIC"
    return None


def resolve_dual_chunk(config, args, max_seq_len: int) -> tuple[DualChunk | None, str | None]:
    """The dual chunk attention a session runs (``config.dual_chunk`` over the file's ``args.dual_chunk``) and a
    line for stderr saying what it is, or None. ConfigError where the config asks for what cannot run."""
    from ktquest.config import ConfigError

    cfg, file_dc = config.dual_chunk, args.dual_chunk
    if cfg.mode == "off" or (cfg.mode == "auto" and file_dc is None):
        off = "dual_chunk.mode: off" if file_dc is not None else None
        return None, (f"ktquest: dual chunk attention off ({off}): positions past {file_dc.chunk_size:,} are "
                      "not ones the model was trained on" if off else None)
    chunk = cfg.chunk_size or (file_dc.chunk_size if file_dc else 0)
    local = cfg.local_size or (file_dc.local_size if file_dc else 0)
    if not (chunk and local):
        raise ConfigError("dual_chunk.mode: on needs dual_chunk.chunk_size and dual_chunk.local_size: the file "
                          "gives neither (it is not a known 1M dual chunk model)")
    try:
        dc = DualChunk(chunk, local, cfg.scale_logits)
    except ValueError as e:
        raise ConfigError(f"dual_chunk: {e}") from None
    why = None
    if any(b.mixer != "attention" or b.attention != "global" for b in args.blocks):
        why = "a model with sliding-window or recurrent layers"
    elif config.mode == "long_context":
        why = long_context_refusal(dc, config.long_context)
    if why is not None:
        if cfg.mode == "on":
            raise ConfigError(f"dual_chunk.mode: on with {why}; set dual_chunk.mode: off or auto")
        return None, (f"ktquest: dual chunk attention off with {why}: positions past {dc.chunk_size:,} are not "
                      "ones the model was trained on")
    if not dc.active(max_seq_len):  # the cache never leaves the first chunk: DCA is plain attention there
        return None, (f"ktquest: dual chunk attention past {dc.length:,} positions: this cache of {max_seq_len:,} "
                      "never gets there")
    how = "dual_chunk.mode: on" if cfg.mode == "on" else "a known 1M model; --set dual_chunk.mode=off turns it off"
    return dc, f"ktquest: {dc.describe()} ({how})"
