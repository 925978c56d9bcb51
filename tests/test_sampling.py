"""The sampler (ktquest/native/sample.py over cpp/sample/sampler.h) against numpy references: each penalty, top-k /
top-p / min-p and their edges, the draw's distribution, seeds, both kernel paths; and the chat's default
sampling on the bundled model."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch

import ktquest
from ktquest.config import CHAT_GENERATION, ConfigError, GenerationConfig
from ktquest.native.sample import Sampler

# ---- numpy references (written from the definitions, one token at a time) ----


def ref_penalties(logits, recent, repeat, frequency, presence):
    out = np.array(logits, dtype=np.float64)
    counts = collections.Counter(int(t) for t in recent)
    for tok, c in counts.items():
        x = out[tok]
        x = x / repeat if x > 0 else x * repeat
        out[tok] = x - c * frequency - presence
    return out


def ref_kept(logits, top_k, top_p, min_p):
    """Sorted candidates (ids) after top-k, then top-p, then min-p (llama.cpp's order), the best first."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if 0 < top_k < len(order):
        order = order[:top_k]
    x = np.array([logits[i] for i in order], dtype=np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    n = len(order)
    if top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        mass, n = 0.0, 0
        while n < len(order) and mass < top_p:
            mass += p[n]
            n += 1
    if min_p > 0.0:
        n = min(n, max(1, sum(1 for q in p[:n] if q >= min_p * p[0])))
    return order[:n]


def ref_probs(logits, temperature=1.0):
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    return p / p.sum()


def logits_of(seed: int, n: int = 300, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def distribution(logits, recent=(), **gen):
    """The sampler's candidates and probabilities (ids, probs) for numpy logits; checks they come back intact."""
    x = torch.from_numpy(np.array(logits, dtype=np.float32))
    before = x.clone()
    ids, probs = Sampler(GenerationConfig(**gen)).distribution(x, list(recent))
    assert np.array_equal(x.numpy(), before.numpy(), equal_nan=True)  # penalized in place for the call only
    return ids, probs


# ---- penalties ----


@pytest.mark.parametrize("repeat, frequency, presence", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7),
                                                         (1.1, 0.2, 0.3), (0.8, -0.5, -1.0)])
def test_penalties_match_reference(force_scalar, repeat, frequency, presence):
    """With nothing truncated at temperature 1 the distribution is the softmax of the penalized logits."""
    logits = logits_of(1)
    recent = [3, 3, 7, 299, 7, 7, 12, 0, 3, 150, -1, 300]  # the last two are outside the vocabulary: ignored
    ids, probs = distribution(logits, recent, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                              repeat_penalty=repeat, frequency_penalty=frequency, presence_penalty=presence)
    want = ref_probs(ref_penalties(logits, recent[:-2], repeat, frequency, presence))
    assert sorted(ids.tolist()) == list(range(300))
    np.testing.assert_allclose(probs, want[ids], rtol=1e-5, atol=1e-12)


def test_repeat_penalty_only_sees_the_last_n_tokens():
    logits = np.zeros(10, np.float32)
    logits[4] = 5.0  # the best, seen long ago
    logits[6] = 4.9
    gen = GenerationConfig(repeat_penalty=2.0, repeat_last_n=3)
    history = [4, 1, 1, 1]  # 4 is outside the last 3
    assert Sampler(gen)(torch.from_numpy(logits), history) == 4
    assert Sampler(gen)(torch.from_numpy(logits), [1, 4, 1]) == 6  # 5.0 / 2 < 4.9


# ---- truncation ----


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (40, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.5, 0.0),
                                                 (0, 0.9, 0.0), (0, 1.0, 0.05), (40, 0.95, 0.05), (7, 0.3, 0.2),
                                                 (500, 1.0, 0.0), (300, 0.99, 0.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_matches_reference(force_scalar, top_k, top_p, min_p, seed):
    logits = logits_of(seed)
    ids, probs = distribution(logits, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    assert ids.tolist() == ref_kept(logits, top_k, top_p, min_p)
    np.testing.assert_allclose(probs, ref_probs(logits[ids], 0.7), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 19, 129, 49152])
@pytest.mark.parametrize("k", [1, 3, 40])
def test_top_k_over_odd_vocabularies(force_scalar, n, k):
    """Sizes around the AVX2 width, a real vocabulary, many ties and NaN (ranked as -inf)."""
    rng = np.random.default_rng(n * 100 + k)
    logits = np.round(rng.standard_normal(n) * 2).astype(np.float32)  # few distinct values: ties everywhere
    logits[rng.integers(0, n, size=n // 50)] = np.nan  # (none below 50: one finite logit must remain)
    ref = np.where(np.isnan(logits), -np.inf, logits)
    ids, _ = distribution(logits, temperature=1.0, top_k=k, top_p=1.0, min_p=0.0)
    assert ids.tolist() == sorted(range(n), key=lambda i: (-ref[i], i))[:k]


@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.999, 0.0), (1.0, 0.05), (0.95, 0.05), (0.5, 1e-6)])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_top_k_off_over_a_large_vocabulary(force_scalar, top_p, min_p, scale):
    """Past 4096 ids with top-k off, only the ids a top-p or min-p cut can keep are ranked (cpp/sample: by the
    mass a bin of logits holds): the kept candidates and their probabilities are the reference's, from a
    distribution nearly flat (top-p keeps most ids) to a peaked one, with ties and NaN."""
    logits = logits_of(int(scale * 10), n=20000, scale=scale)
    logits[::1000] = logits[1]  # ties with one of the first ids
    logits[7::3001] = np.nan
    ids, probs = distribution(logits, temperature=0.7, top_k=0, top_p=top_p, min_p=min_p)
    ref = np.where(np.isnan(logits), -np.inf, logits)
    assert ids.tolist() == ref_kept(ref, 0, top_p, min_p)
    np.testing.assert_allclose(probs, ref_probs(logits[ids], 0.7), rtol=1e-5, atol=1e-12)


def empty_bin_logits() -> np.ndarray:
    """100 logits within 0.12 nats of the best whose mass, summed in id order, reaches half the total but
    summed best first falls short of it by an ulp; then nothing for 0.18 nats; then a tail that sets the total
    (summed in id order as the sampler's pass does); -inf to 5,000 ids."""
    for seed in range(1000):
        rng = np.random.default_rng(seed)
        x = [0.0] + [float(np.float32(-v)) for v in rng.uniform(0.0, 0.12, 99)]
        head_ids = sum(math.exp(v) for v in x)
        head_best = sum(math.exp(v) for v in sorted(x, reverse=True))
        if not head_ids > head_best:
            continue
        total, ladder = head_ids, [float(np.float32(-0.3 - 0.125 * i)) for i in range(318)]
        while not head_best < total * 0.5 <= head_ids:
            step = next((v for v in ladder if (total + math.exp(v)) * 0.5 <= head_ids), None)
            if step is None:
                break
            x.append(step)
            total += math.exp(step)
        if head_best < total * 0.5 <= head_ids:
            return np.array(x + [-np.inf] * (5000 - len(x)), np.float32)
    raise AssertionError("no such logits")


def test_top_p_whose_prefix_closes_past_an_empty_bin():
    """The binned sums say top-p's prefix ends in the first bin, the ranked ones say it needs one id more, past an
    empty bin: it is still kept (the bins are all taken then)."""
    logits = empty_bin_logits()
    ids, _ = distribution(logits, temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)
    assert ids.tolist() == ref_kept(np.asarray(logits, np.float64), 0, 0.5, 0.0)
    assert len(ids) == 101


def test_with_no_cut_a_large_vocabulary_is_drawn_in_id_order():
    """top-k off, top-p 1, min-p 0 past 4096 ids: nothing is ranked; u from the seeded stream picks the first id
    whose cumulative tempered probability, in id order, passes it."""
    logits = logits_of(3, n=8192, scale=4.0)
    logits[100] = np.nan
    gen = GenerationConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    s, rng = Sampler(gen), np.random.default_rng(11)
    p = ref_probs(np.where(np.isnan(logits), -np.inf, logits), 0.9)
    cdf = np.cumsum(p)
    for _ in range(200):
        want = int(np.searchsorted(cdf, rng.random(), side="right"))
        assert s(torch.from_numpy(logits)) == want


def test_truncation_edges():
    one_hot = np.full(50, -1e9, np.float32)
    one_hot[17] = 0.0  # all the mass on one token
    ids, probs = distribution(one_hot, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert ids[0] == 17 and probs[0] == 1.0 and len(ids) == 50  # nothing truncated: the rest at p = 0
    for top_k, top_p, min_p in ((10, 0.5, 0.5), (0, 0.999, 0.0), (0, 1.0, 1e-6), (1, 1.0, 0.0)):
        ids, _ = distribution(one_hot, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
        assert ids.tolist() == [17]
    ties = np.zeros(20, np.float32)  # ties: the lower ids first

    def kept(**kw):
        return distribution(ties, temperature=1.0, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw})[0].tolist()
    assert kept(top_k=5) == [0, 1, 2, 3, 4]
    assert kept(top_p=0.5) == list(range(10))  # 10 x 1/20 reach the mass 0.5
    assert kept(min_p=0.9) == list(range(20))  # each as likely as the best
    assert kept(top_k=100) == list(range(20))  # k above the vocabulary: all


def test_non_finite_logits_are_an_error():
    for bad in (np.nan, np.inf):
        logits = np.full(10, bad, np.float32)
        with pytest.raises(ValueError, match="not finite"):
            Sampler(GenerationConfig(temperature=0.5))(torch.from_numpy(logits))


# ---- the draw ----


def test_greedy_is_argmax_after_the_penalties(force_scalar):
    for seed in range(5):
        logits = torch.from_numpy(logits_of(seed))
        assert Sampler(GenerationConfig())(logits) == int(logits.argmax())
        best = int(logits.argmax())
        gen = GenerationConfig(repeat_penalty=1e3)
        assert Sampler(gen)(logits, [best]) == int(np.argmax(ref_penalties(logits.numpy(), [best], 1e3, 0, 0)))


def test_the_draw_follows_the_tempered_distribution(force_scalar):
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0], np.float32)
    gen = GenerationConfig(temperature=0.7, seed=5)
    s = Sampler(gen)
    n = 20000
    counts = np.bincount([s(torch.from_numpy(logits)) for _ in range(n)], minlength=5)
    p = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.from_numpy(logits_of(0))
    for top_k, top_p, min_p in ((3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.1)):
        s = Sampler(GenerationConfig(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=1))
        drawn = {s(logits) for _ in range(300)}
        assert drawn <= set(ref_kept(logits.numpy(), top_k, top_p, min_p)) and len(drawn) > 1


def test_seeded_sampling_is_reproducible():
    logits = torch.from_numpy(logits_of(0))
    gen = GenerationConfig(**CHAT_GENERATION, seed=3)
    a, b = Sampler(gen), Sampler(gen)
    history: list[int] = []
    seq = []
    for _ in range(50):
        t = a(logits, history)
        history.append(t)
        seq.append(t)
    history2: list[int] = []
    for t in seq:
        assert b(logits, history2) == t
        history2.append(t)
    assert len(set(seq)) > 1


def test_bad_sampling_values_are_config_errors():
    for key, value in (("min_p", 1.0), ("min_p", -0.1), ("repeat_penalty", 0.0), ("repeat_last_n", -1),
                       ("presence_penalty", 2.5), ("frequency_penalty", -3.0)):
        with pytest.raises(ConfigError, match=f"generation.{key}="):
            GenerationConfig(**{key: value})


# ---- the chat's defaults on the bundled model ----


@pytest.mark.slow
def test_same_seed_same_tokens_at_1_and_2_threads(bundled_gguf):
    texts = []
    for threads in (1, 2):
        eng = ktquest.load(bundled_gguf, threads=threads, max_seq_len=512, max_new_tokens=24, seed=11,
                           **CHAT_GENERATION)
        texts.append(eng.generate("The history of the printing press"))
    assert texts[0] == texts[1] and len(texts[0]) > 20


@pytest.mark.slow
def test_chat_defaults_do_not_loop_on_a_long_poem(bundled_gguf):
    """The prompt that looped greedily (one line repeated until stopped): with the chat's defaults no line
    repeats more than twice in 200 tokens."""
    eng = ktquest.load(bundled_gguf, config="configs/quest.yaml", max_seq_len=2048, max_new_tokens=200,
                       **CHAT_GENERATION)
    reply = eng.chat_session().send("Write a long poem about the json decoder.").text
    lines = [ln.strip() for ln in reply.splitlines() if ln.strip()]
    assert len(lines) >= 5, reply
    assert max(collections.Counter(lines).values()) <= 2, reply
