"""The generation loop (stops, seeds, multi-turn, interrupts) and the dense cache's bookkeeping."""

from __future__ import annotations

import time

import pytest
import torch

from ktquest.config import GenerationConfig
from ktquest.generate import GenerationResult, decode_one_token, generate, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.models.loader import load_model
from ktquest.sequence import Sequence

FP32_ATOL = 1e-4
FP32_RTOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    return model, tiny_llama.hf_model


def make_cache(model, max_seq_len: int = 64) -> DenseKVCache:
    a = model.args
    return DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_seq_len)


PROMPT = [5, 17, 42, 9, 100, 3, 250, 77, 8]


# ---- generation ----


def hf_greedy(hf, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


def test_greedy_generation_matches_hf(llama):
    model, hf = llama
    cache = make_cache(model)
    seq = Sequence(cache)
    res = generate(model, seq, PROMPT, GenerationConfig(max_new_tokens=8), stop_ids=set(), chunk_size=4)
    assert res.tokens == hf_greedy(hf, PROMPT, 8)
    assert res.stopped_by == "max_new_tokens" and res.n_prompt == len(PROMPT)
    assert cache.pos == len(PROMPT) + 8 and seq.ids == PROMPT + res.tokens  # every returned token is in the cache
    assert res.prefill_s > 0 and res.decode_s > 0 and res.decode_tok_s > 0 and res.prefill_tok_s > 0


def test_stops_at_eos_and_keeps_it_in_the_cache(llama):
    model, hf = llama
    expected = hf_greedy(hf, PROMPT, 6)
    stop = expected[3]
    first = expected.index(stop)
    cache = make_cache(model)
    streamed = []
    seq = Sequence(cache)
    res = generate(model, seq, PROMPT, GenerationConfig(max_new_tokens=20), stop_ids={stop, 10_000},
                   chunk_size=64, on_token=streamed.append)
    assert res.stopped_by == "eos" and res.tokens == expected[: first + 1] == streamed
    assert cache.pos == len(PROMPT) + len(res.tokens) and seq.ids == PROMPT + res.tokens


def test_multi_turn_continues_the_cache(llama):
    """Two turns on one cache == one prefill of the whole transcript."""
    model, _ = llama
    gen = GenerationConfig(max_new_tokens=5)
    seq = Sequence(make_cache(model))
    r1 = generate(model, seq, PROMPT, gen, set(), chunk_size=4)
    turn2 = [11, 12, 13]
    r2 = generate(model, seq, turn2, gen, set(), chunk_size=4)
    fresh = Sequence(make_cache(model))
    r = generate(model, fresh, PROMPT + r1.tokens + turn2, gen, set(), chunk_size=4)
    assert r2.tokens == r.tokens and seq.ids == fresh.ids[:-len(r.tokens)] + r2.tokens


def test_seeded_generation_is_reproducible(llama):
    model, _ = llama
    gen = GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, seed=123)
    runs = [generate(model, Sequence(make_cache(model)), PROMPT, gen, set(), chunk_size=3).tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_should_stop_interrupts(llama):
    model, _ = llama
    cache = make_cache(model)
    seq = Sequence(cache)
    seen = []
    res = generate(model, seq, PROMPT, GenerationConfig(max_new_tokens=20), set(), chunk_size=4,
                   on_token=seen.append, should_stop=lambda: len(seen) >= 3)
    assert res.stopped_by == "interrupted" and len(res.tokens) == 3
    assert cache.pos == len(PROMPT) + 3 and seq.ids == PROMPT + seen


class InterruptingCache(DenseKVCache):
    """Raises KeyboardInterrupt inside a forward pass (at ``layer``) on the ``at``-th call of that layer."""

    def __init__(self, *args, layer: int, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer, self.at, self.calls = layer, at, 0

    def attend(self, layer_idx, q, k, v, start_pos):
        out = super().attend(layer_idx, q, k, v, start_pos)
        if layer_idx == self.layer:
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt
        return out


@pytest.mark.parametrize("layer", [0, 1])  # mid-pass, and after the last layer stored its k/v
def test_ctrl_c_during_decode_leaves_the_cache_consistent(llama, layer):
    model, _ = llama
    a = model.args
    cache = InterruptingCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, layer=layer, at=1 + 4)  # 5th forward
    seq = Sequence(cache)
    res = generate(model, seq, PROMPT, GenerationConfig(max_new_tokens=20), set(), chunk_size=64)
    assert res.stopped_by == "interrupted"
    assert len(res.tokens) == 3 and cache.pos == len(PROMPT) + 3  # the 4th token's pass was interrupted
    assert seq.ids == PROMPT + res.tokens  # the 4th token, handed to the model, is not among them
    # The cache is a faithful transcript: carrying on gives what an uninterrupted run gives.
    full = generate(model, Sequence(make_cache(model)), PROMPT, GenerationConfig(max_new_tokens=5), set(), 64)
    assert res.tokens == full.tokens[:3]
    cache.at = -1
    assert int(decode_one_token(model, cache, full.tokens[3]).argmax()) == full.tokens[4]


# The 2nd chunk of PROMPT is cut in its first layer (its pass unfinished: it goes), or after its last layer
# stored its k/v (the chunk is whole in the cache: it stays).
@pytest.mark.parametrize(("layer", "kept"), [(0, 4), (1, 8)])
def test_ctrl_c_during_prefill_keeps_the_chunks_read(llama, layer, kept):
    model, _ = llama
    a = model.args
    assert a.n_layers == 2
    cache = InterruptingCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, layer=layer, at=3)
    prefill(model, cache, [1, 2, 3], chunk_size=8)  # an earlier turn: stays
    seq = Sequence(cache, [1, 2, 3])
    res = generate(model, seq, PROMPT, GenerationConfig(max_new_tokens=5), set(), chunk_size=4)
    assert res.stopped_by == "interrupted" and res.tokens == [] and res.n_prompt == kept
    assert cache.pos == 3 + kept and seq.ids == [1, 2, 3, *PROMPT[:kept]]
    # Going on from there gives what an uninterrupted run gives.
    cache.at = -1
    rest = generate(model, seq, PROMPT[kept:], GenerationConfig(max_new_tokens=5), set(), chunk_size=4)
    full = generate(model, Sequence(make_cache(model)), [1, 2, 3, *PROMPT], GenerationConfig(max_new_tokens=5),
                    set(), 4)
    assert rest.tokens == full.tokens and rest.n_prompt == len(PROMPT) - kept


def test_stops_when_the_cache_is_full(llama):
    model, _ = llama
    cache = make_cache(model, max_seq_len=len(PROMPT) + 4)
    res = generate(model, Sequence(cache), PROMPT, GenerationConfig(max_new_tokens=50), set(), chunk_size=4)
    assert res.stopped_by == "max_seq_len" and len(res.tokens) == 4 and cache.pos == cache.max_seq_len


def test_prompt_that_does_not_fit_raises_before_any_work(llama):
    model, _ = llama
    cache = make_cache(model, max_seq_len=16)
    prefill(model, cache, PROMPT, chunk_size=4)
    seq = Sequence(cache, PROMPT)
    with pytest.raises(ValueError, match=r"overflow.*max_seq_len=16"):
        generate(model, seq, PROMPT, GenerationConfig(), set(), chunk_size=4)
    assert cache.pos == len(PROMPT) and seq.ids == PROMPT


# ---- the dense cache ----


def test_cache_overflow_is_an_error():
    cache = DenseKVCache(n_layers=1, n_kv_heads=1, head_dim=4, max_seq_len=8)
    x = torch.zeros(5, 1, 4)
    cache.attend(0, x, x, x, 0)
    with pytest.raises(ValueError, match=r"positions 5\.\.9 do not fit in max_seq_len=8"):
        cache.attend(0, x, x, x, 5)
    with pytest.raises(ValueError, match="holds 5 tokens"):
        cache.attend(0, x[:1], x[:1], x[:1], 6)  # a gap
    assert cache.pos == 5


def test_truncate_and_reset(llama):
    model, _ = llama
    cache = make_cache(model)
    prefill(model, cache, PROMPT, chunk_size=4)
    wrong = decode_one_token(model, cache, 99)  # a token we then take back
    cache.truncate(len(PROMPT))
    right = decode_one_token(model, cache, 7)
    fresh = make_cache(model)
    prefill(model, fresh, PROMPT + [7], chunk_size=64)
    with torch.inference_mode():
        expected = model(torch.tensor(PROMPT + [7]), 0, make_cache(model))[-1]
    torch.testing.assert_close(right, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert not torch.allclose(wrong, right)
    with pytest.raises(ValueError, match="between 0 and the 10 tokens"):
        cache.truncate(11)
    cache.reset()
    assert cache.pos == 0
    again = prefill(model, cache, PROMPT + [7], chunk_size=3)
    torch.testing.assert_close(again, expected, atol=FP32_ATOL, rtol=FP32_RTOL)


def test_nbytes():
    cache = DenseKVCache(n_layers=3, n_kv_heads=2, head_dim=8, max_seq_len=10)
    assert cache.nbytes() == 2 * 3 * 2 * 10 * 8 * 4


# ---- timing ----


def test_steady_decode_speed_leaves_the_first_token_out():
    r = GenerationResult([1, 2, 3, 4, 5], 9, prefill_s=1.0, decode_s=3.0, stopped_by="eos", first_token_s=2.0)
    assert r.decode_tok_s == 4.0  # the 4 tokens after the first in the 1 s after it
    assert GenerationResult([7], 9, 1.0, 2.0, "eos", 2.0).decode_tok_s == 0.0  # one token: no steady rate
    assert GenerationResult([], 9, 1.0, 0.0, "interrupted").first_token_s == 0.0


def test_a_slow_first_decode_step_is_the_first_tokens_wait(llama, monkeypatch):
    """The first decode step after the prompt (where SnapKV's preselection runs) made slow: the wait is in
    first_token_s, measured to the moment the token is handed out, and not in the steady decode speed."""
    import ktquest.generate

    model, _ = llama
    real, slow = ktquest.generate.decode_one_token, 0.2

    def slow_first_step(model, cache, token):
        if cache.pos == len(PROMPT):  # the first generated token fed (not the prompt's last chunk of 1)
            time.sleep(slow)
        return real(model, cache, token)

    monkeypatch.setattr(ktquest.generate, "decode_one_token", slow_first_step)
    handed: list[float] = []
    t0 = time.perf_counter()
    res = generate(model, Sequence(make_cache(model)), PROMPT, GenerationConfig(max_new_tokens=6), set(), 4,
                   on_token=lambda t: handed.append(time.perf_counter()))
    assert len(res.tokens) == 6 and slow <= res.first_token_s < res.decode_s
    assert res.first_token_s <= handed[0] - t0 - res.prefill_s  # known by the time on_token gets it
    assert res.decode_tok_s == pytest.approx(5 / (res.decode_s - res.first_token_s))
    assert res.decode_tok_s > 5 * len(res.tokens) / res.decode_s  # the slow step left out, not dragging it down
