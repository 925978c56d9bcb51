"""Whether a KV file fits the engine that loads it: the fingerprints both must agree on, and a file read and
checked whole (``read``) before anything of it reaches a cache.

The config's fingerprint (``cache_fingerprint``) holds every setting that changes what the cache stores, as the
engine applies it: the numbers each key and value is computed with (the compute dtype, the weights' encoding
and the activations' rounding on it), the RoPE frequencies the keys were rotated by (``rope``: the file's
scaling or the config's dynamic NTK, at the cache's length: dynamic NTK and LongRoPE choose theirs by
max_seq_len) and the positions (``dual_chunk``: a key's place in its chunk), the layout (mode; a long_context cache's knobs and chunk_size; a sliding-window model's keep),
and how a long_context cache's later layers were computed (its selection knobs, the prefill's mode: a sparse
prefill attends a selection, so the keys of every layer after the first differ). Head counts and dims are the
model file's (its own fingerprint).
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import TYPE_CHECKING, NamedTuple

import torch

from ktquest.config import Config, show, to_dict
from ktquest.kv import files
from ktquest.kv.files import KVFileError
from ktquest.kv.sliding import HybridCache
from ktquest.models.rope import rope_frequencies, rope_variants

if TYPE_CHECKING:
    from ktquest.engine import Engine

# what a difference in a fingerprint's key means, where its values do not say it
_HINTS = {"rope": " (the keys were rotated by other RoPE frequencies: rope_scaling, rope_scaling_factor, or "
                  "max_seq_len under dynamic NTK or LongRoPE)",
          "dual_chunk": " (dual chunk attention rotates the keys at their place in their chunk and shapes every "
                        "later layer's keys through its attention: dual_chunk.mode, chunk_size, local_size, "
                        "scale_logits)"}


class Contents(NamedTuple):
    """A KV file checked against a cache: what fills it (``load_state(meta, arrays)``, the sequence's tokens)."""

    tokens: list[int]
    meta: dict
    arrays: dict[str, torch.Tensor]
    extra: dict


def cache_fingerprint(eng: Engine) -> dict:
    """The settings that shape ``eng``'s KV cache, as applied (see the module docstring)."""
    c, model = eng.config, eng.model
    out = {"mode": c.mode, "dtype": str(eng.dtype).removeprefix("torch."), "weights": eng.weights,
           "rope": rope_fingerprint(model.args, model.max_seq_len)}
    dc = model.args.dual_chunk
    if dc is not None:  # the keys past the first chunk were rotated at their place in their chunk
        out["dual_chunk"] = {"chunk_size": dc.chunk_size, "local_size": dc.local_size, "scale_logits": dc.scale_logits}
    if eng.weights == "gguf":  # (dequantized weights multiply the activations as they are)
        out["activations"] = eng.activations
    if isinstance(eng.cache, HybridCache):
        out["sliding_window_keep"] = c.sliding_window_keep
    if c.mode == "long_context":
        out["chunk_size"] = c.chunk_size
        out["long_context"] = {k: v for k, v in to_dict(c)["long_context"].items() if k != "threads_num"}
        p = c.prefill
        out["prefill"] = {"mode": p.mode} if p.mode == "exact" else \
            {"mode": p.mode, "exact_tokens": p.exact_tokens, "blocks": p.blocks, "select_queries": p.select_queries,
             "exact_tail": p.exact_tail}
    return out


def with_later_keys(config):
    """A file's config fingerprint with the long_context keys added since it was written (``rerank``, ...) at
    their defaults: what the cache was made with then, when those knobs did not exist."""
    if not isinstance(config, dict) or not isinstance(config.get("long_context"), dict):
        return config
    now = {k: v for k, v in to_dict(Config())["long_context"].items() if k != "threads_num"}
    return {**config, "long_context": {**{k: v for k, v in now.items() if k not in config["long_context"]},
                                       **config["long_context"]}}


def rope_fingerprint(args, max_len: int) -> str:
    """A digest of the RoPE frequencies and cos/sin multiplier of each of the model's tables (``rope_variants``)
    for a cache of ``max_len`` tokens: the rotation every cached key went through."""
    h = hashlib.sha256()
    for a in rope_variants(args):
        inv_freq, mscale = rope_frequencies(a, max_len)
        h.update(inv_freq.numpy().tobytes() + struct.pack("<d", mscale))
    return h.hexdigest()[:16]


def read(path: str | os.PathLike, cache, model: dict, config: dict, vocab_size: int) -> Contents:
    """The KV file at ``path`` read whole and checked for ``cache`` (the model file's fingerprint ``model``, the
    config's ``config``, token ids below ``vocab_size``); nothing is changed. ``KVFileError`` naming what is
    wrong: unreadable, truncated, corrupted, crafted, or written for another model or a config whose cache
    differs."""
    header, arrays = files.load(path)
    theirs = header.get("model")
    if theirs != model:
        name = theirs.get("name") if isinstance(theirs, dict) else None
        raise KVFileError(f"{path} was written for another model ({show(name)}); this is {model['name']!r} "
                          f"({model['bytes']:,} bytes)")
    theirs = with_later_keys(header.get("config"))
    if theirs != config:
        raise KVFileError(f"{path} was written with a config whose KV cache differs: "
                          f"{differences(theirs, config)}")
    tokens, meta = arrays.pop("tokens", None), header.get("cache")
    cache.check_state(meta, arrays, str(path))
    if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int32 or len(tokens) != meta["pos"] or \
            (len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size):
        raise KVFileError(f"{path}: its token ids do not match its cache")
    extra = header.get("extra")
    return Contents(tokens.tolist(), meta, arrays, extra if isinstance(extra, dict) else {})


def conversation(path: str | os.PathLike, extra: dict) -> dict:
    """The conversation ``ChatSession.save`` kept in ``extra``: {"system", "document", "messages"}, each typed;
    KVFileError for a file that holds none."""
    chat = extra.get("chat")
    ok = isinstance(chat, dict) and all(k in chat and isinstance(chat[k], (str, type(None))) for k in ("system", "document"))
    messages = chat.get("messages") if ok else None
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                               isinstance(m.get("content"), str) and
                                               isinstance(m.get("reasoning_content", ""), str) for m in messages)):
        raise KVFileError(f"{path}: holds a KV cache but no conversation (written by save_kv, not "
                          "ChatSession.save)")
    return {"system": chat["system"], "document": chat["document"],
            "messages": [{k: m[k] for k in ("role", "content", "reasoning_content") if k in m} for m in messages]}


def differences(a: object, b: dict, prefix: str = "") -> str:
    """What differs between a file's config fingerprint ``a`` and this engine's ``b``, as one line."""
    if not isinstance(a, dict):
        return "the file has none"
    if a.get("mode", b.get("mode")) != b.get("mode"):  # the rest follows from the mode
        return f"{prefix}mode is {show(a.get('mode'))} in the file, {b.get('mode')!r} here"
    out = []
    for key in sorted(set(a) | set(b)):  # (JSON's keys are strings)
        x, y = a.get(key), b.get(key)
        name = key if len(key) <= 60 else key[:57] + "..."
        if isinstance(x, dict) and isinstance(y, dict):
            if x != y:
                out.append(differences(x, y, f"{prefix}{name}."))
        elif x != y:
            what = f"{show(x)} in the file, {y!r} here" if key in a and key in b else \
                ("not in the file" if key in b else "in the file only")
            out.append(f"{prefix}{name} is {what}{_HINTS.get(key, '')}")
    return "; ".join(out[:8]) + ("; ..." if len(out) > 8 else "")
