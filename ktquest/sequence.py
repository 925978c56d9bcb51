"""A conversation's tokens in one KV cache (in the spirit of nano-vllm's ``Sequence``).

A ``Sequence`` owns a cache's position: it knows the token ids at cache positions 0.. (``ids``), and it is the
only code that rewinds or resets its cache. The chat, the server's slots, KV files and generation go through
it; the cache itself only moves forward as tokens are read (``KVCache.attend`` / ``plan_decode``).

    seq.rewind_for(tokens)   keep the longest prefix of ``tokens`` the cache holds and can keep exactly
    generate(model, seq, tokens[len(seq):], ...)   read the rest, then the reply: ``ids`` grow with the cache
    seq.ids                  exactly the tokens the cache holds, after any turn (interrupted, failed or whole)

Ids past the cache's position are those handed to the model and not (yet, or no longer) in the cache: a prompt
being read, a token that raised. ``settle`` drops them; every public method leaves the sequence settled.
"""

from __future__ import annotations

from collections.abc import Sequence as Ids

from ktquest.kv.base import KVCache


def common_prefix_len(a: Ids[int], b: Ids[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Sequence:
    """The token ids a KV cache holds, and the one owner of its position (see the module docstring).

    ``owner``: whose conversation it is (a ``ChatSession``, the server's worker, None: nobody's); ``claim``
    hands it to another, forgetting the tokens."""

    def __init__(self, cache: KVCache, ids: Ids[int] = ()):
        """``ids``: the tokens ``cache`` holds already (as many as its position)."""
        if len(ids) != cache.pos:
            raise ValueError(f"a sequence of {len(ids)} tokens over a cache that holds {cache.pos}")
        self.cache = cache
        self._ids: list[int] = [int(t) for t in ids]  # the ids at positions 0..; valid up to cache.pos
        self.owner: object | None = None

    # ---- what it holds ----

    @property
    def ids(self) -> list[int]:
        """The token ids the cache holds, positions 0..len(self)-1 (a copy). ValueError where the cache moved on
        outside this sequence (its ids are unknown)."""
        if len(self._ids) < self.cache.pos:
            raise ValueError(f"the cache holds {self.cache.pos} tokens, its sequence knows {len(self._ids)}: it "
                             "was fed outside its Sequence")
        return self._ids[: self.cache.pos]

    def __len__(self) -> int:
        return self.cache.pos

    def shared(self, tokens: Ids[int]) -> int:
        """How many leading ``tokens`` the cache already holds (none known where it was fed outside this
        sequence)."""
        return common_prefix_len(self._ids[: self.cache.pos], tokens) if len(self._ids) >= self.cache.pos else 0

    # ---- moving the cache's position (the only code that does) ----

    def claim(self, owner: object | None) -> None:
        """The sequence becomes ``owner``'s conversation; another's (or nobody's: None) tokens are forgotten."""
        if owner is None or owner is not self.owner:
            self.reset()
        self.owner = owner

    def adopt(self, owner: object | None) -> None:
        """The tokens it holds become ``owner``'s conversation as they are (a KV file loaded for it)."""
        self.owner = owner

    def rewind_for(self, tokens: Ids[int]) -> int:
        """The cache is to hold ``tokens`` next: it keeps the longest prefix of them it holds and can keep
        exactly, but leaves at least the last token to read (the reply's logits come from it). Returns how
        many it kept: the turn reads ``tokens[len(self):]``."""
        return self.rewind(min(self.shared(tokens), len(tokens) - 1))

    def rewind(self, n: int) -> int:
        """Keep at most the first ``n`` tokens: as many as the cache can keep exactly (``KVCache.rewind_point``:
        n, or fewer where a sliding window moved past position n). Returns how many it kept."""
        self.cache.truncate(self.cache.rewind_point(max(0, min(n, self.cache.pos))))
        self.settle()
        return self.cache.pos

    def reset(self) -> None:
        """Forget every token (the cache's memory is kept)."""
        self.cache.reset()
        self._ids = []

    # ---- ids as the model reads them ----

    def feeding(self, tokens: Ids[int]) -> None:
        """``tokens`` are read next, after what the cache holds (``generate``; ``settle`` when it stopped)."""
        del self._ids[self.cache.pos:]
        self._ids.extend(int(t) for t in tokens)

    def settle(self) -> None:
        """The ids become exactly what the cache holds: those handed to the model past its position go."""
        del self._ids[self.cache.pos:]

    def restored(self, tokens: Ids[int]) -> None:
        """The cache was filled from a KV file holding ``tokens`` (``Engine.load_kv``)."""
        if len(tokens) != self.cache.pos:
            raise ValueError(f"a KV file's {len(tokens)} tokens, but its cache holds {self.cache.pos}")
        self._ids = list(tokens)
