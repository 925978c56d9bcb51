"""The cache of a hybrid model (Qwen3.5: Gated DeltaNet layers beside a few attention layers).

``RecurrentCache`` is the model's ``KVCache``: each attention layer, renumbered 0..n_attention-1, goes to the
configured cache (dense, or long_context with its store and sparse operator: presets and knobs apply to the
attention layers alone), and each DeltaNet layer reads and updates its state here (``recurrent``): the causal
conv's last K-1 inputs [K-1, conv_dim] and the delta rule's S [Hv, Dk, Dv], both fp32.

A state cannot be rewound: it is a sum over every token. So the cache keeps checkpoints, copies of every
DeltaNet layer's state at a position: at each prompt's start and end (turn boundaries: a regenerated reply
rewinds to the end of its prompt, a follow-up whose template re-renders the last reply, dropping its thinking
or re-tokenizing its end, to the start of that reply) and every ``every`` tokens of a prompt (the config's
``state_checkpoint_tokens``: a server request that shares a long document with a cached one but asks another
question goes back to the last copy before the question), the latest ``keep`` of them (``state_checkpoints``).
A copy every N tokens is taken layer by layer, as each layer reaches a multiple of N at a chunk's start, so both
prefill orders take it. ``rewind_point(n)`` is the latest checkpoint at or before n (0, the empty state, at
least), and the caller feeds the tokens after it again.
"""

from __future__ import annotations

import torch

from ktquest.kv.base import check_write
from ktquest.native.plans import TokenPlan

DEFAULT_KEEP = 8


class RecurrentStates:
    """Every DeltaNet layer's state, and where each layer is (``hi``: the positions it has read)."""

    def __init__(self, n_layers: int, spec, device: torch.device):
        self.conv = torch.zeros(n_layers, spec.conv_kernel - 1, spec.conv_dim, device=device)  # [L, K-1, C]
        self.ssm = torch.zeros(n_layers, spec.n_v_heads, spec.k_head_dim, spec.v_head_dim, device=device)
        self.hi = [0] * n_layers

    def copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv.clone(), self.ssm.clone()

    def copy_nbytes(self) -> int:
        """The bytes of one copy (a checkpoint)."""
        return self.nbytes()

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor], pos: int) -> None:
        self.conv.copy_(saved[0])
        self.ssm.copy_(saved[1])
        self.hi = [pos] * len(self.hi)

    def reset(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()
        self.hi = [0] * len(self.hi)

    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class RecurrentCache:
    """A ``KVCache`` (kv/base.py) for a hybrid model: see the module docstring. ``main``: the attention layers'
    cache (made for ``global_args(args)``)."""

    def __init__(self, args, main, device: torch.device, every: int = 0, keep: int = DEFAULT_KEEP):
        """every: a checkpoint each ``every`` prompt tokens (0: turn boundaries only); keep: the latest kept."""
        self.main = main
        self.every, self.keep = every, keep
        self.max_seq_len = main.max_seq_len
        delta = args.delta_layers
        specs = {args.blocks[i].delta for i in delta}
        if len(specs) != 1 or any(b.attention != "global" for b in args.blocks):
            raise ValueError("RecurrentCache: the DeltaNet layers must share one size, beside global attention")
        # model layer -> (is a DeltaNet layer, index in its cache)
        self.route = {layer: (False, j) for j, layer in enumerate(args.global_layers)}
        self.route |= {layer: (True, j) for j, layer in enumerate(delta)}
        self.states = RecurrentStates(len(delta), specs.pop(), device)
        self.checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> the states there
        self._taking: dict[int, tuple[torch.Tensor, torch.Tensor, set[int]]] = {}  # layer by layer: the layers in
        self.last_layer = args.n_layers - 1
        self.pos = 0
        self._prompt_end = -1  # the end of the prompt being read: a checkpoint once every layer is there

    @property
    def lc(self):
        """The attention layers' long_context knobs (a long_context ``main``)."""
        return self.main.lc

    def retune(self, lc):
        return self.main.retune(lc)

    # ---- the model's calls ----

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """``KVCache.attend`` of an attention layer (the main cache's)."""
        check_write(start_pos, q.shape[0], self.pos, self.max_seq_len)
        out = self.main.attend(self.route[layer_idx][1], q, k, v, start_pos)
        self._wrote(layer_idx, start_pos + q.shape[0])
        return out

    def recurrent(self, layer_idx: int, start_pos: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeltaNet layer ``layer_idx``'s state for its next ``t`` tokens at ``start_pos`` (where the layer is):
        (conv [K-1, C], S [Hv, Dk, Dv]) views the layer updates in place."""
        check_write(start_pos, t, self.pos, self.max_seq_len)
        j = self.route[layer_idx][1]
        if start_pos != self.states.hi[j]:
            raise ValueError(f"recurrent state of layer {layer_idx}: it has read {self.states.hi[j]} tokens and "
                             f"cannot go on from position {start_pos} (rewind to a checkpoint: rewind_point)")
        out = self.layer_state(j, start_pos, t)
        self._wrote(layer_idx, start_pos + t)
        return out

    def layer_state(self, j: int, start_pos: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeltaNet layer j (of the cache's) is to read t tokens at start_pos: its part of a checkpoint due there
        is copied first; its (conv, S) views."""
        s = self.states
        if self.every and self.keep and start_pos and start_pos % self.every == 0 \
                and start_pos not in self.checkpoints:
            conv, ssm, done = self._taking.setdefault(start_pos, (torch.empty_like(s.conv), torch.empty_like(s.ssm),
                                                                  set()))
            conv[j], ssm[j] = s.conv[j], s.ssm[j]
            done.add(j)
            if len(done) == len(s.hi):
                del self._taking[start_pos]
                self._keep(start_pos, (conv, ssm))
        s.hi[j] = start_pos + t
        return s.conv[j], s.ssm[j]

    def _wrote(self, layer_idx: int, end: int) -> None:
        if layer_idx == self.last_layer:
            self.pos = end
            if end == self._prompt_end:
                self.checkpoint()

    # ---- prompts and decode ----

    def begin_prompt(self, end: int, then_decode: bool = True) -> None:
        """A prompt is read next from ``pos`` to ``end``: the states at both are checkpoints (turn boundaries)."""
        self.checkpoint()
        self._prompt_end = end
        self.main.begin_prompt(end, then_decode)

    def checkpoint(self) -> None:
        """Keep the states at ``pos`` (every layer is there; 0 needs none)."""
        if self.pos and self.keep and self.pos not in self.checkpoints:
            self._keep(self.pos, self.states.copy())

    def _keep(self, pos: int, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A checkpoint at ``pos``; past ``keep`` of them, the earliest goes."""
        self.checkpoints[pos] = states
        while len(self.checkpoints) > self.keep:
            del self.checkpoints[min(self.checkpoints)]

    def prompt_layers(self, start: int, n: int) -> RecurrentPromptLayers:
        return RecurrentPromptLayers(self, start, n)

    def prefill_device_bytes(self, n: int) -> int:
        """The main cache's workspace and the copy of the states kept to undo an interrupted prompt."""
        return self.main.prefill_device_bytes(n) + self.states.nbytes()

    def plan_decode(self, pos: int) -> TokenPlan | None:
        return None  # (the DeltaNet layers run in torch: block by block through attend / recurrent)

    def commit_decode(self, plan: TokenPlan) -> None:
        raise AssertionError("RecurrentCache plans no decode token")

    abort_decode = commit_decode

    # ---- rewinding ----

    def rewind_point(self, n: int) -> int:
        """The longest prefix of at most ``n`` tokens the cache can be truncated to exactly: n where the states
        are there (n = pos), else the latest checkpoint at or before n, or 0."""
        if n >= self.pos and all(h == self.pos for h in self.states.hi):
            return self.pos
        return max((p for p in self.checkpoints if p <= n), default=0)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos, and ``rewind_point(n) == n``)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        if n == self.pos and all(h == n for h in self.states.hi):  # (a cut chunk leaves some layers past it)
            self.main.truncate(n)
            return
        if n and n not in self.checkpoints:
            raise ValueError(f"truncate({n}): the recurrent state is kept at positions "
                             f"{sorted(self.checkpoints) or 'none'} and 0 only (rewind_point)")
        if n:
            self.states.restore(self.checkpoints[n], n)
        else:
            self.states.reset()
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= n}
        self._taking.clear()
        self.main.truncate(n)
        self.pos = n

    def reset(self) -> None:
        self.states.reset()
        self.checkpoints.clear()
        self._taking.clear()
        self.main.reset()
        self.pos = 0

    def prompt_read(self, end: int) -> None:
        self.pos = end
        if end == self._prompt_end:
            self.checkpoint()

    def nbytes(self) -> int:
        """The attention layers' cache, the states and their checkpoints."""
        return self.main.nbytes() + self.state_bytes()

    def state_bytes(self) -> int:
        """The DeltaNet layers' states and the checkpoints held now (``/stats``)."""
        return self.states.nbytes() * (1 + len(self.checkpoints) + len(self._taking))

    # ---- KV files ----

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps: the attention layers' cache's state and the DeltaNet layers' states at pos."""
        m, ma = self.main.state()
        return {"pos": self.pos, "main": m}, \
            {**{f"main.{k}": v for k, v in ma.items()}, "conv": self.states.conv, "ssm": self.states.ssm}

    def state_shapes(self, meta: dict, path: str = "") -> dict[str, tuple]:
        from ktquest.kv.files import KVFileError, check_meta

        pos = check_meta(path, meta, "pos", 0, self.max_seq_len)
        main = self.main.state_shapes(meta.get("main"), path)
        if meta["main"]["pos"] != pos:
            raise KVFileError(f"{path}: the attention layers hold {meta['main']['pos']} tokens, the cache {pos}")
        s = self.states
        return {**{f"main.{k}": v for k, v in main.items()},
                "conv": (tuple(s.conv.shape), s.conv.dtype), "ssm": (tuple(s.ssm.shape), s.ssm.dtype)}

    def check_state(self, meta: dict, arrays: dict[str, torch.Tensor], path: str = "") -> None:
        """KVFileError unless ``load_state`` takes ``meta`` and ``arrays`` (the DeltaNet states among them, of
        this model's shapes; the attention layers' cache checks its own)."""
        from ktquest.kv.files import KVFileError, expect

        expect(path, arrays, self.state_shapes(meta, path))
        if not all(torch.isfinite(arrays[k]).all() for k in ("conv", "ssm")):
            raise KVFileError(f"{path}: the recurrent states hold non-finite values")
        self.main.check_state(meta["main"], {k[5:]: v for k, v in arrays.items() if k.startswith("main.")}, path)

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        self.main.load_state(meta["main"], {k[5:]: v for k, v in arrays.items() if k.startswith("main.")})
        self.checkpoints.clear()
        self._taking.clear()
        self.states.restore((arrays["conv"], arrays["ssm"]), meta["pos"])
        self.pos = meta["pos"]


class RecurrentPromptLayers:
    """A prompt read layer by layer into a ``RecurrentCache``: each DeltaNet layer reads its chunks in order
    through its own state, the attention layers through the main cache's ``prompt_layers``. The states at the
    prompt's start are a checkpoint, and what an interrupted prompt is put back to."""

    def __init__(self, cache: RecurrentCache, start: int, n: int):
        check_write(start, n, cache.pos, cache.max_seq_len)
        if cache.rewind_point(start) != start:
            raise ValueError(f"KV cache: cannot rewind to position {start} (the recurrent state is kept at "
                             f"checkpoints only: rewind_point)")
        if start < cache.pos:
            cache.truncate(start)
        cache.checkpoint()
        self._saved = cache.states.copy()
        self.cache, self.start, self.end = cache, start, start + n
        self.main = cache.main.prompt_layers(start, n)
        self.device_bytes = self.main.device_bytes + cache.states.nbytes()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        return self.main.attend(self.cache.route[layer_idx][1], q, k, v, start_pos)

    def recurrent(self, layer_idx: int, start_pos: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, j = self.cache.states, self.cache.route[layer_idx][1]
        if start_pos != s.hi[j] or start_pos + t > self.end:
            raise ValueError(f"recurrent state of layer {layer_idx}: it has read {s.hi[j]} tokens and cannot go "
                             f"on from position {start_pos}")
        return self.cache.layer_state(j, start_pos, t)

    def layer_done(self, layer_idx: int) -> None:
        delta, j = self.cache.route[layer_idx]
        if not delta:
            self.main.layer_done(j)

    def done(self) -> None:
        self.main.done()
        self.cache.prompt_read(self.end)
        self._saved = None

    def abort(self) -> None:
        self.main.abort()
        self.cache.states.restore(self._saved, self.start)
        self.cache.checkpoints = {p: s for p, s in self.cache.checkpoints.items() if p <= self.start}
        self.cache._taking.clear()
        self._saved = None
