"""Batched decode (``NativeDecoder.decode_batch``, cpp/decode/token_step.h ``decode_tokens``): one token of each of
several sequences through every block in one native call, each matrix read once for all of them. Token i's
logits are bit for bit what it gets decoded alone, in dense and long-context caches, on every tiny architecture
(sliding windows, QK-norm, experts); a native batch that raises leaves every cache as it was, and its tokens are
then decoded alone: the one that fails has its error, the others go on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ktquest
from ktquest import _C
from ktquest.engine import make_cache

PROMPTS = ([5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11] * 4, [60, 61, 62, 63] * 9, [100, 3, 4] * 7)
LC = {"mode": "long_context", "long_context": {"block_size": 4, "init_windows_len": 4, "local_windows_len": 8,
                                                  "second_select_num": 2, "dense_layer_num": 0}}


def _caches(eng, n: int):
    return [make_cache(eng.config, eng.args, eng.max_seq_len, eng.device, eng.dtype) for _ in range(n)]


def _run(eng, batched: bool, steps: int = 12) -> list[list[torch.Tensor]]:
    """Prefill the prompts in caches of their own, then greedy decode ``steps`` tokens of each: batched in one
    decode_batch call a step, or one sequence at a time; each step's logits [V] of each sequence."""
    caches = _caches(eng, len(PROMPTS))
    logits = [eng.prefill(p, cache=c) for p, c in zip(PROMPTS, caches)]
    out: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for _ in range(steps):
        tokens = [int(torch.argmax(x)) for x in logits]
        if batched:
            logits = eng.model.decoder.decode_batch(tokens, caches)
        else:
            logits = [eng.model.decoder.decode(t, c) for t, c in zip(tokens, caches)]
        for i, x in enumerate(logits):
            out[i].append(x.clone())
    return out


@pytest.mark.parametrize("mode", ["dense", "long_context"])
def test_a_batch_is_each_token_alone(tiny_model, mode, monkeypatch):
    kw = LC if mode == "long_context" else {}
    eng = ktquest.load(tiny_model.path, max_seq_len=128, threads=2, **kw)
    if eng.model.decoder.__class__.__name__ != "NativeDecoder":
        pytest.fail("the tiny models decode natively")
    calls = []
    real = _C.decode_tokens
    monkeypatch.setattr(_C, "decode_tokens", lambda *a: calls.append(1) or real(*a))
    alone, together = _run(eng, False), _run(eng, True)
    assert len(calls) == 12  # every step in one call (no sequence fell back to one at a time)
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_a_batch_on_the_bundled_model(bundled_gguf):
    """The bundled SmolLM2 (int16 activations, Q4_1): batched and alone agree bit for bit."""
    eng = ktquest.load(bundled_gguf, max_seq_len=256, threads=2)
    alone, together = _run(eng, False, 6), _run(eng, True, 6)
    assert all(torch.equal(x, y) for a, b in zip(alone, together) for x, y in zip(a, b))


def test_a_refused_batch_changes_no_cache(tiny_llama):
    """A token id outside the vocabulary, or a cache given twice, is refused before any work; a non-finite x in
    the second sequence makes the native batch raise (nothing held), and then each token alone: the first one's
    logits are its logits alone, the second is its error and its cache keeps what it had."""
    eng = ktquest.load(tiny_llama.path, max_seq_len=128, threads=1, **LC)
    dec = eng.model.decoder

    def filled():
        caches = _caches(eng, 2)
        for p, c in zip(PROMPTS, caches):
            eng.prefill(p, cache=c)
        return caches

    caches = filled()
    before = [c.pos for c in caches]
    with pytest.raises(IndexError, match="vocabulary"):
        dec.decode_batch([1, 10**6], caches)
    with pytest.raises(ValueError, match="distinct"):
        dec.decode_batch([1, 2], [caches[0], caches[0]])
    with pytest.raises(ValueError, match="one plan per sequence"):
        _C.decode_tokens(dec.blocks, np.zeros((0, 64), np.float32), np.zeros((0, 1, 16), np.float32),
                         np.zeros((0, 1, 16), np.float32), dec.rope, [], 1.0, 1)
    assert [c.pos for c in caches] == before
    real = dec.emb
    native = []

    class InfRow:  # token 7's embedding is inf: q is not finite in the first layer, of the second sequence
        num_embeddings = real.num_embeddings

        class quant:
            @staticmethod
            def rows(ids):
                x = real.quant.rows(ids)
                x[np.asarray(ids) == 7] = np.inf
                return x

    def counted(*args):
        try:
            return _C.decode_tokens(*args)
        except ValueError as e:
            native.append(str(e))
            raise

    dec.emb = InfRow
    try:
        import ktquest.native.decode as nd

        saved, nd._C = nd._C, type("C", (), {"decode_tokens": staticmethod(counted),
                                             "__getattr__": lambda self, k: getattr(_C, k)})()
        try:
            out = dec.decode_batch([5, 7], caches)
        finally:
            nd._C = saved
    finally:
        dec.emb = real
    assert native and "of sequence 1" in native[0] and "not finite" in native[0]
    assert isinstance(out[1], ValueError) and "not finite" in str(out[1])
    assert [c.pos for c in caches] == [before[0] + 1, before[1]]
    alone = filled()
    assert torch.equal(out[0], dec.decode(5, alone[0]))
    # and the caches go on as if nothing had failed: the next batch is each token alone
    again = dec.decode_batch([9, 9], caches)
    assert torch.equal(again[0], dec.decode(9, alone[0])) and torch.equal(again[1], dec.decode(9, alone[1]))
