"""The server's worker without HTTP: stop strings, slots, and prefix reuse that answers as a cold cache does,
dense and long_context (every block, and real selections: Quest, SnapKV preselection), also after a client
left mid-reply."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import ktquest
from ktquest.config import GenerationConfig
from ktquest.server.worker import StopText, Worker

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GREEDY = GenerationConfig(max_new_tokens=8, temperature=0.0)
TINY_LC = {"long_context.block_size": 4, "long_context.init_windows_len": 4, "long_context.local_windows_len": 8,
           "long_context.kv_type": "FP32"}
MODES = {
    "dense": {},
    "every block": {"mode": "long_context", **TINY_LC, "long_context.second_select_num": 1000},
    "quest": {"config": "quest.yaml", **TINY_LC, "long_context.second_select_num": 3},
    "snapkv": {"config": "snapkv.yaml", **TINY_LC, "long_context.preselect_block_count": 6,
               "long_context.second_select_num": 3},
}


def _engine(path, sets):
    sets = dict(sets)
    config = sets.pop("config", None)
    return ktquest.load(path, CONFIGS / config if config else None, max_seq_len=512, chunk_size=16, threads=1,
                        **sets)


def _prompt(engine, doc: str, question: str) -> list[int]:
    return engine.tokenizer.encode(f"{doc}\nQ: {question}\nA:")


DOC = "the cat sat on the mat and the dog sat on the log " * 12


def test_stop_text_holds_back_what_may_start_a_stop():
    s = StopText(["END", "\n\n"])
    assert s.push("hello E") == "hello "  # "E" may start END: held
    assert s.push("N") == ""
    assert s.push("Dx") == "" and s.hit and s.text == "hello " and s.push("more") == ""
    s = StopText(["stop"])
    assert s.push("a s") == "a " and s.push("to") == "" and s.push("ry\n") == "story\n"
    assert s.flush() == "" and not s.hit and s.text == "a story\n"
    s = StopText(["\n\n"])
    assert s.push("x\n") == "x" and s.flush() == "\n"  # the end of the reply: what was held goes out
    s = StopText(["b", "abc"])  # the stop that begins first wins
    assert s.push("xxabc") == "xx" and s.text == "xx"
    s = StopText([])
    assert s.push("anything") == "anything" and s.flush() == ""


def test_stop_text_work_is_linear_in_the_reply():
    """Stop strings that never match: each character is looked at a bounded number of times (counted as the
    interpreter's calls, whatever the implementation, and as the automata's steps), not once per held
    character per piece."""
    stops = ["a" * 500 + "c", "ab" * 300 + "c", "a" * 400 + "ca", "x" * 1000]  # never in the reply
    pieces = ["a"] * 10_000 + ["ab"] * 5_000 + ["y"] * 5_000  # a 20,000-piece reply
    chars = sum(map(len, pieces))
    budget = 10 * chars * len(stops)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += 1
        if calls > budget:
            raise RuntimeError(f"more than {budget:,} calls for {chars:,} characters")

    s = StopText(stops)
    out = []
    sys.setprofile(count)
    try:
        for p in pieces:
            out.append(s.push(p))
    finally:
        sys.setprofile(None)
    out.append(s.flush())
    assert "".join(out) == s.text == "".join(pieces) and not s.hit
    assert s.scanned <= 2 * chars * len(stops)


@pytest.mark.parametrize("mode", list(MODES))
def test_reuse_answers_as_cold(tiny_llama, mode):
    warm = Worker(_engine(tiny_llama.path, MODES[mode]))
    cold = _engine(tiny_llama.path, MODES[mode])
    first = _prompt(cold, DOC, "where did the cat sit?")
    r1 = warm.complete(first, GREEDY)
    assert r1.cached_tokens == 0 and r1.completion_tokens >= 1
    second = _prompt(cold, DOC, "and the dog?")
    r2 = warm.complete(second, GREEDY)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert r2.cached_tokens == shared > 100  # the document was not read again
    assert warm.counters.prefilled_tokens == len(first) + len(second) - shared
    for prompt, r in ((first, r1), (second, r2)):  # as a fresh cache answers each
        assert r.text == Worker(cold).complete(prompt, GREEDY).text


def test_slots_keep_recent_conversations(tiny_llama):
    engine = _engine(tiny_llama.path, {})
    x = _prompt(engine, DOC, "where did the cat sit?")
    y = _prompt(engine, "a completely different text about birds " * 8, "what about birds?")
    two = Worker(engine, slots=2)
    two.complete(x, GREEDY)
    two.complete(y, GREEDY)
    assert len(two.slots) == 2
    assert two.complete(x, GREEDY).cached_tokens == len(x) - 1  # still cached: all but the token fed again
    one = Worker(_engine(tiny_llama.path, {}), slots=1)
    one.complete(x, GREEDY)
    one.complete(y, GREEDY)
    assert one.complete(x, GREEDY).cached_tokens < 5  # y took the only slot: x is read again


def test_a_slot_a_chat_session_took_is_free_to_the_server(tiny_llama):
    """The first slot is the engine's own cache: a chat session of the engine may take it. The server's next
    request then neither reuses the chat's tokens nor loses its own conversation kept in another slot."""
    engine = _engine(tiny_llama.path, {})
    x = _prompt(engine, DOC, "where did the cat sit?")
    y = _prompt(engine, "a completely different text about birds " * 8, "what about birds?")
    worker = Worker(engine, slots=2)
    worker.complete(x, GREEDY)  # slot 0
    worker.complete(y, GREEDY)  # slot 1
    chat = engine.chat_session(document=DOC)  # the chat's tokens begin as x's do
    chat.send("where did the cat sit?")
    assert engine.sequence.owner is chat and worker.slots[0].seq is engine.sequence
    again = worker.complete(y, GREEDY)
    assert again.cached_tokens == len(y) - 1  # slot 1 kept y
    r = worker.complete(x, GREEDY)  # slot 0 is the chat's: read afresh, as a cold cache answers
    assert r.cached_tokens == 0 and engine.sequence.owner is worker
    assert r.text == Worker(_engine(tiny_llama.path, {})).complete(x, GREEDY).text


@pytest.mark.parametrize("mode", ["dense", "snapkv"])
def test_cancelled_mid_reply_keeps_the_cache_consistent(tiny_llama, mode):
    worker = Worker(_engine(tiny_llama.path, MODES[mode]))
    prompt = _prompt(worker.engine, DOC, "where did the cat sit?")
    pieces: list[str] = []
    r = worker.complete(prompt, GenerationConfig(max_new_tokens=50, temperature=0.0), on_text=pieces.append,
                        cancelled=lambda: len(pieces) >= 2)
    assert r.finish_reason == "cancelled" and r.completion_tokens < 50
    assert worker.counters.cancelled == 1
    again = worker.complete(prompt, GREEDY)
    assert again.cached_tokens == len(prompt) - 1
    assert again.text == Worker(_engine(worker.engine.model_path, MODES[mode])).complete(prompt, GREEDY).text
    # a client gone while its prompt is read: nothing generated, the chunks read stay
    worker.complete(_prompt(worker.engine, DOC * 2, "x"), GREEDY, cancelled=lambda: True)
    assert worker.counters.cancelled == 2
    assert worker.complete(prompt, GREEDY).text == again.text


def test_prefix_reuse_is_per_key(tiny_llama):
    """A request reuses only slots its own key filled: another key's prompt costs it everything, and its
    cached_tokens say nothing about that prompt. ``shared`` reuses across keys, ``off`` never."""
    engine = _engine(tiny_llama.path, {})
    x, y, z = (_prompt(engine, DOC, q) for q in ("where did the cat sit?", "and the dog?", "and the mat?"))
    worker = Worker(engine, slots=2)
    worker.complete(x, GREEDY, key="alice")
    assert worker.complete(y, GREEDY, key="bob").cached_tokens == 0
    assert [s.key for s in worker.slots] == ["alice", "bob"]  # bob did not take alice's slot
    assert worker.complete(z, GREEDY, key="alice").cached_tokens > 100  # alice's document: still cached
    assert worker.complete(y, GREEDY).cached_tokens == 0  # no key: the anonymous group, a key of its own
    assert worker.complete(x, GREEDY).cached_tokens > 100
    one = Worker(_engine(tiny_llama.path, {}), slots=1)  # one slot: bob takes it, from zero
    one.complete(x, GREEDY, key="alice")
    r = one.complete(y, GREEDY, key="bob")
    assert r.cached_tokens == 0
    assert r.text == Worker(_engine(tiny_llama.path, {})).complete(y, GREEDY).text  # as a cold cache
    shared = Worker(_engine(tiny_llama.path, {}), reuse="shared")
    shared.complete(x, GREEDY, key="alice")
    assert shared.complete(y, GREEDY, key="bob").cached_tokens > 100
    off = Worker(_engine(tiny_llama.path, {}), reuse="off")
    off.complete(x, GREEDY)
    assert off.complete(x, GREEDY).cached_tokens == 0
    with pytest.raises(ValueError, match="reuse='everyone'"):
        Worker(_engine(tiny_llama.path, {}), reuse="everyone")


def test_time_to_first_token_holds_a_slow_first_decode_step(tiny_llama, monkeypatch):
    """A request's time to first token runs from its turn on the worker to its first token: the slot's pick and
    rewind, the prefill and the first decode step (made slow here, as SnapKV's preselection may make it); the
    steady decode speed leaves that step out."""
    import ktquest.generate

    worker = Worker(_engine(tiny_llama.path, {}))
    prompt = _prompt(worker.engine, DOC, "where did the cat sit?")
    real, slow = ktquest.generate.decode_one_token, 0.2

    def slow_first_step(model, cache, token):
        if cache.pos == len(prompt):  # the first generated token fed
            time.sleep(slow)
        return real(model, cache, token)

    monkeypatch.setattr(ktquest.generate, "decode_one_token", slow_first_step)
    r = worker.complete(prompt, GREEDY)
    assert r.completion_tokens == 8 and r.ttft_s >= r.prefill_s + r.first_token_s and r.first_token_s >= slow
    assert r.decode_tok_s == pytest.approx(7 / (r.decode_s - r.first_token_s))
    assert r.decode_tok_s > 5 * r.completion_tokens / r.decode_s  # the slow step is not in it
    snap = worker.snapshot()
    assert snap["last"]["ttft_s"] == snap["ttft_s_mean"] == r.ttft_s and snap["answered"] == 1
    assert snap["last"]["decode_tok_s"] == r.decode_tok_s
