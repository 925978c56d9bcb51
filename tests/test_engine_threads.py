"""One engine, several users (``ktquest.engine_lock``): calls from two threads take turns, each answered exactly
as it is alone; a call from inside the engine's own callback is a RuntimeError, and the engine goes on working."""

from __future__ import annotations

import threading
import time

import pytest

import ktquest

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was a tiny"]
REENTERED = r"ktquest: {} called from inside its own callback"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return ktquest.load(tiny_llama.path, chunk_size=4, max_new_tokens=10, threads=1)


def _slow(*_: object) -> None:
    """A callback that lets the other thread run (every chunk and every piece of text)."""
    time.sleep(0.002)


def _in_threads(*calls) -> list:
    """Each of ``calls`` on a thread of its own, all at once; their results (an exception is re-raised here)."""
    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread never finished: deadlock"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_two_threads_generate_as_each_does_alone(tiny):
    alone = [tiny.generate(p) for p in PROMPTS]
    assert alone[0] != alone[1]

    def three(p: str):
        return lambda: [tiny.generate(p, on_text=_slow, on_progress=_slow) for _ in range(3)]

    assert _in_threads(*(three(p) for p in PROMPTS)) == [[a] * 3 for a in alone]


def test_two_threads_chat_as_each_does_alone(tiny):
    questions = [["Hello world!", "The capital of France"], ["the cat sat on", "the dog sat on the log"]]

    def conversation(qs: list[str], on_text=None) -> list[str]:
        chat = tiny.chat_session()
        return [chat.send(q, on_text=on_text).text for q in qs]

    alone = [conversation(qs) for qs in questions]
    together = _in_threads(*(lambda qs=qs: conversation(qs, _slow) for qs in questions),
                           lambda: [tiny.generate(PROMPTS[0], on_text=_slow)])  # a raw completion cuts in
    assert together[:2] == alone and together[2] == [tiny.generate(PROMPTS[0])]


@pytest.mark.parametrize("callback", ["on_text", "on_progress", "should_stop"])
def test_generate_from_its_own_callback_is_refused(tiny, callback):
    expected = tiny.generate(PROMPTS[0])
    calls = []

    def reenter(*_: object) -> bool:
        calls.append(1)
        tiny.generate(PROMPTS[1])
        return False

    with pytest.raises(RuntimeError, match=REENTERED.format("Engine.generate")):
        tiny.generate(PROMPTS[0], **{callback: reenter})
    assert calls == [1]  # refused at once, nothing run
    assert tiny.generate(PROMPTS[0]) == expected and tiny.generate(PROMPTS[1]) != expected


def test_chat_from_its_own_callback_is_refused(tiny, tmp_path):
    chat = tiny.chat_session()
    first = chat.send("Hello world!").text
    for entry, reenter in [("ChatSession.send", lambda piece: chat.send("again")),
                           ("ChatSession.reset", lambda piece: chat.reset()),
                           ("Engine.save_kv", lambda piece: tiny.save_kv(tmp_path / "x.kvq")),
                           ("Engine.load_kv", lambda piece: tiny.load_kv(tmp_path / "x.kvq"))]:
        with pytest.raises(RuntimeError, match=REENTERED.format(entry)):
            chat.send("The capital of France", on_text=reenter)
    assert chat.messages[-1]["content"] == first  # every refused turn dropped, the conversation as it was
    fresh = tiny.chat_session()
    assert [fresh.send(q).text for q in ("Hello world!", "The capital of France")] == \
        [first, chat.send("The capital of France").text]


def test_the_server_worker_and_a_chat_take_turns(tiny):
    from ktquest.config import GenerationConfig
    from ktquest.server.worker import Worker

    gen = GenerationConfig(max_new_tokens=10, temperature=0.0)
    prompt = tiny.tokenizer.encode(PROMPTS[1])
    worker = Worker(tiny)
    alone = (worker.complete(prompt, gen).text, tiny.chat_session().send("Hello world!").text)
    together = _in_threads(lambda: [worker.complete(prompt, gen, on_text=_slow).text for _ in range(3)],
                           lambda: [tiny.chat_session().send("Hello world!", on_text=_slow).text for _ in range(3)])
    assert together == [[alone[0]] * 3, [alone[1]] * 3]
