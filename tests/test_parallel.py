"""Parallel slots (server/parallel.py, ``ktquest serve --parallel N``): through a real server (in process) and the
``openai`` client, 4 streams at once give the greedy text 4 requests one after the other give, their decode steps
batched; a client that leaves ends its reply alone; a reply held to a schema runs beside free ones; the RAM check
counts N caches."""

from __future__ import annotations

import threading

import openai
import pytest
from test_server_requests import _serving

import ktquest
from ktquest.config import ConfigError
from ktquest.context import check_parallel_fits
from ktquest.server.app import create_app
from ktquest.server.worker import Worker

QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 2 + 2?", "Why is the sky blue?")


@pytest.fixture(scope="module")
def served(bundled_gguf):
    engine = ktquest.load(bundled_gguf, max_seq_len=1024, threads=2)
    worker = Worker(engine, slots=2, parallel=4)
    with _serving(create_app(worker, "smol", queue=8)) as post:
        yield worker, post, openai.OpenAI(base_url=f"http://127.0.0.1:{post.port}/v1", api_key="none",
                                          max_retries=0, timeout=120)
    worker.parallel.close()


def _ask(client, q: str, stream: bool, max_tokens: int = 40, **kw) -> str:
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], temperature=0.0,
                                       max_tokens=max_tokens, stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content
    return "".join(e.choices[0].delta.content or "" for e in r if e.choices)


def test_parallel_streams_are_the_sequential_replies(served):
    worker, _, client = served
    alone = [_ask(client, q, stream=False) for q in QUESTIONS[:4]]
    steps0, batched0 = worker.parallel.steps, worker.parallel.batched
    together: list[str | None] = [None] * 4
    barrier = threading.Barrier(4)

    def one(i: int) -> None:
        barrier.wait()
        together[i] = _ask(client, QUESTIONS[i], stream=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    steps, batched = worker.parallel.steps - steps0, worker.parallel.batched - batched0
    assert worker.parallel.widest == 4 and batched / steps > 1.5  # side by side, several tokens a step
    assert len(worker.slots) == 4  # a slot each


def test_a_client_that_leaves_ends_its_reply_alone(served):
    """One stream closed after its first pieces: the others end as they would have alone."""
    worker, _, client = served
    alone = [_ask(client, q, stream=False, max_tokens=60) for q in QUESTIONS[1:3]]
    cancelled0 = worker.snapshot()["cancelled"]
    out: dict[int, str] = {}

    def leaver() -> None:
        s = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS[4]}],
                                           temperature=0.0, max_tokens=400, stream=True)
        for n, _ in enumerate(s):
            if n == 3:
                s.close()
                break

    def stay(i: int) -> None:
        out[i] = _ask(client, QUESTIONS[1 + i], stream=True, max_tokens=60)

    threads = [threading.Thread(target=leaver)] + [threading.Thread(target=stay, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [out[0], out[1]] == alone
    for _ in range(100):  # (the server sees the closed stream at its next token)
        if worker.snapshot()["cancelled"] > cancelled0:
            break
        threading.Event().wait(0.05)
    assert worker.snapshot()["cancelled"] == cancelled0 + 1


def test_a_held_reply_runs_beside_free_ones(served):
    import json

    _, _, client = served
    results: dict[str, str] = {}

    def held() -> None:
        results["json"] = _ask(client, "A person as JSON.", stream=False, max_tokens=80,
                               response_format={"type": "json_object"})

    def free() -> None:
        results["free"] = _ask(client, QUESTIONS[0], stream=False)

    threads = [threading.Thread(target=held), threading.Thread(target=free)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["free"] == _ask(client, QUESTIONS[0], stream=False)
    try:
        assert isinstance(json.loads(results["json"]), dict)
    except json.JSONDecodeError:  # (cut at max_tokens: an unfinished object, as OpenAI's)
        assert results["json"].lstrip().startswith("{")


def test_the_ram_check_counts_every_cache(tiny_llama):
    eng = ktquest.load(tiny_llama.path, max_seq_len=128, threads=1)
    check_parallel_fits(eng.config, eng.args, eng.max_seq_len, eng.device, eng.dtype, 4)  # (tiny: fits)
    with pytest.raises(ConfigError, match=r"--parallel 1000000000: .* KV caches of 128 tokens need"):
        check_parallel_fits(eng.config, eng.args, eng.max_seq_len, eng.device, eng.dtype, 10**9)


@pytest.fixture
def tiny_worker(tiny_llama):
    eng = ktquest.load(tiny_llama.path, max_seq_len=512, threads=1)
    worker = Worker(eng, slots=2, parallel=2)
    yield eng, worker
    worker.parallel.close()


def _gen(eng, n: int):
    return eng.config.generation.__class__(max_new_tokens=n, temperature=0.0)


def test_the_engine_waits_while_a_reply_runs(tiny_worker):
    """A call on the engine from another thread (a chat session, generate) waits until no reply runs: the first
    slot is the engine's own sequence, and the reply in it is not disturbed."""
    eng, worker = tiny_worker
    prompt = eng.tokenizer.encode("the cat sat on the mat", add_bos=False, parse_special=False)
    alone = worker.complete(prompt, _gen(eng, 120)).text
    started = threading.Event()
    out = {}

    def reply() -> None:
        out["text"] = worker.complete(prompt, _gen(eng, 120), on_text=lambda _: started.set()).text

    t = threading.Thread(target=reply)
    t.start()
    started.wait(30)
    eng.generate("a b c d", max_new_tokens=3)  # (waits for the reply)
    t.join(60)
    assert out["text"] == alone


def test_a_reply_that_ends_leaves_before_the_next_prompt_is_read(tiny_worker, monkeypatch):
    """The round that decodes a reply's last token hands its result back before a waiting prompt is read."""
    from ktquest.generate import Generation

    eng, worker = tiny_worker
    a = eng.tokenizer.encode("the cat sat", add_bos=False, parse_special=False)
    b = eng.tokenizer.encode("the dog sat on the log today", add_bos=False, parse_special=False)
    a_done, waited, threads = threading.Event(), [], []
    read = Generation.read_prompt

    def read_prompt(self):
        if list(self.prompt) == b:
            waited.append(a_done.wait(30))
        return read(self)

    monkeypatch.setattr(Generation, "read_prompt", read_prompt)

    def on_logits(token, logits, n=[0]):  # at a's last sampled token, b arrives
        n[0] += 1
        if n[0] == 5:
            threads.append(threading.Thread(target=worker.complete, args=(b, _gen(eng, 3))))
            threads[-1].start()

    worker.complete(a, _gen(eng, 5), on_logits=on_logits)
    a_done.set()
    threads[0].join(60)
    assert waited == [True]


def test_the_scheduler_lives_on_after_an_error(tiny_worker, monkeypatch):
    """An error the scheduler did not expect (here: while a cancelled prompt is put back) fails the replies it
    hit, and the next request is answered."""
    from ktquest.generate import Generation

    eng, worker = tiny_worker
    prompt = eng.tokenizer.encode("the cat sat on the mat " * 20, add_bos=False, parse_special=False)

    def broken(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(Generation, "interrupted", broken)
    calls = [0]

    def cancel_in_prefill() -> bool:
        calls[0] += 1
        return calls[0] > 1  # (not before the slot is taken: while the prompt is read)

    eng.config.chunk_size = 16
    with pytest.raises(RuntimeError, match="injected"):
        worker.complete(prompt, _gen(eng, 4), cancelled=cancel_in_prefill)
    monkeypatch.undo()
    r = worker.complete(prompt[:10], _gen(eng, 4))
    assert r.completion_tokens == 4 and not any(s.busy for s in worker.slots)
