"""Engine and chat sessions: the golden reply of the bundled model, multi-turn KV reuse, limits, interrupts.

The bundled SmolLM2 runs greedy with fp32 decode weights (deterministic on the CPU). The tiny GGUF of
conftest covers loading options and chunked prefill quickly.
"""

from __future__ import annotations

import pytest
import torch
from test_model_args import tiny_model_parts, write_model

import ktquest
from ktquest.config import Config, ConfigError
from ktquest.engine import PromptTooLongError
from ktquest.formats.gguf import GGUFError
from ktquest.kv.dense import DenseKVCache
from ktquest.native.decode import NativeDecoder

QUESTION = "What is the capital of France?"
GOLDEN_REPLY = "The capital of France is Paris."  # the same as HF transformers' Llama on these weights
GOLDEN_PROMPT_TOKENS = 37  # SmolLM's default system prompt + the question, ChatML
FOLLOW_UP = "And of Italy?"
FOLLOW_UP_TOKENS = 14  # "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smol(bundled_gguf):
    return ktquest.load(bundled_gguf, weights="dequantize", max_seq_len=1024, max_new_tokens=48)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return ktquest.load(tiny_llama.path, chunk_size=8, max_new_tokens=6, threads=1)


def _fresh_reply(engine, messages, text):
    """The reply of a new session that prefills the whole conversation at once."""
    fresh = engine.chat_session()
    fresh.messages = [dict(m) for m in messages]
    return fresh.send(text)


# ---- the bundled model ----


def test_golden_reply(smol):
    pieces = []
    reply = smol.chat_session().send(QUESTION, on_text=pieces.append)
    assert reply.text == GOLDEN_REPLY
    assert "".join(pieces) == reply.text  # streamed text is the reply
    s = reply.stats
    assert (s.prompt_tokens, s.stopped_by, s.context_tokens) == (GOLDEN_PROMPT_TOKENS, "eos", 45)
    assert s.prefill_tok_s > 0 and s.decode_tok_s > 0


def test_golden_reply_on_the_default_gguf_weights(bundled_gguf):
    # What `ktquest chat` runs out of the box: the file's Q4_1 weights read in place (no fp32 copy), the
    # decode step native, prefill on dequantized panels.
    eng = ktquest.load(bundled_gguf, max_seq_len=256, max_new_tokens=16)
    assert eng.config.weights == "auto" and eng.weights == "gguf" and eng.device.type == "cpu"
    assert isinstance(eng.model.decoder, NativeDecoder) and eng.model.layers[0].attn.wqkv.quant.parts[0][0] == "Q4_1"
    assert eng.chat_session().send(QUESTION).text == GOLDEN_REPLY


def test_raw_completion(smol):
    streamed = []
    text = smol.generate("The capital of France is", max_new_tokens=2, on_text=streamed.append)
    assert text == " Paris." and "".join(streamed) == text
    with pytest.raises(ConfigError, match="unknown generation option 'max_tokens'"):
        smol.generate("x", max_tokens=2)


def test_multi_turn_reuses_the_cache(smol):
    s = smol.chat_session()
    first = s.send(QUESTION)
    second = s.send(FOLLOW_UP)
    # only the new turn was prefilled: the cache held the first turn, its reply and <|im_end|>
    tok = smol.tokenizer
    whole = tok.encode_chat(tok.apply_chat_template(s.messages[:3]))
    assert second.stats.prompt_tokens == len(whole) - first.stats.context_tokens == FOLLOW_UP_TOKENS
    assert second.text == "The capital of Italy is Rome."
    fresh = _fresh_reply(smol, s.messages[:2], FOLLOW_UP)
    assert fresh.stats.prompt_tokens == len(whole)
    assert (fresh.text, fresh.stats.context_tokens) == (second.text, second.stats.context_tokens)
    assert s.stats().turns == 2
    assert s.stats().load_s == smol.load_s > 0  # /stats shows the load time


def test_prompt_too_long_changes_nothing(smol):
    s = smol.chat_session()
    s.send(QUESTION)
    before = ([dict(m) for m in s.messages], smol.cache.pos, s.stats())
    with pytest.raises(PromptTooLongError, match=r"prompt too long: \d+ tokens, but the context holds 1024"):
        s.send("word " * 1100)
    assert ([dict(m) for m in s.messages], smol.cache.pos, s.stats()) == before
    assert s.send(FOLLOW_UP).stats.prompt_tokens == FOLLOW_UP_TOKENS  # the cache is still in use


def _stop_after(n: int):
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > n

    return should_stop


def _raise_on_piece(n: int):
    seen = []

    def on_text(piece: str) -> None:
        seen.append(piece)
        if len(seen) == n:
            raise KeyboardInterrupt

    return on_text


@pytest.mark.parametrize("how", ["should_stop", "ctrl_c_in_on_text"])
def test_interrupted_reply_is_kept(smol, how):
    s = smol.chat_session()
    if how == "should_stop":
        reply = s.send(QUESTION, should_stop=_stop_after(3))
    else:
        reply = s.send(QUESTION, on_text=_raise_on_piece(3))
    assert reply.stats.stopped_by == "interrupted"
    assert reply.text and GOLDEN_REPLY.startswith(reply.text) and reply.text != GOLDEN_REPLY
    assert s.messages[-1] == {"role": "assistant", "content": reply.text}
    # the conversation goes on, and the cache holds exactly what a fresh prefill would
    nxt = s.send(FOLLOW_UP)
    fresh = _fresh_reply(smol, s.messages[:2], FOLLOW_UP)
    assert (nxt.text, nxt.stats.context_tokens) == (fresh.text, fresh.stats.context_tokens)
    assert nxt.stats.prompt_tokens < fresh.stats.prompt_tokens


def test_interrupt_while_reading_the_prompt_drops_the_turn_and_keeps_what_was_read(tiny):
    s = tiny.chat_session()
    s.send("hello there")
    messages, pos = [dict(m) for m in s.messages], tiny.cache.pos
    seen = []

    def on_progress(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 2:  # after the second chunk (chunk_size 8)
            raise KeyboardInterrupt

    question = "the cat sat on the mat; " * 4
    reply = s.send(question, on_progress=on_progress)
    held = tiny.cache.pos
    assert (reply.text, reply.stats.stopped_by, reply.stats.new_tokens) == ("", "interrupted", 0)
    # the conversation is unchanged; the cache holds a prefix of it and the two chunks of the new turn read
    assert s.messages == messages and reply.stats.prompt_tokens == 16 == seen[1]
    assert reply.stats.context_tokens == held and held - 16 <= pos
    again = s.send(question)  # goes on from what was read
    fresh = _fresh_reply(tiny, messages, question)
    assert (again.text, again.stats.context_tokens) == (fresh.text, fresh.stats.context_tokens)
    assert again.stats.prompt_tokens == fresh.stats.prompt_tokens - held


def test_reset(smol):
    s = smol.chat_session()
    s.send(QUESTION)
    s.reset()
    assert s.messages == [] and s.stats().context_tokens == 0 and s.stats().turns == 0
    assert s.send(QUESTION).stats.prompt_tokens == GOLDEN_PROMPT_TOKENS


def test_reset_keeping_the_cache_reads_only_what_differs(tiny):
    doc = "Once upon a time there was a tiny model that read a long story. " * 4
    s = tiny.chat_session(document=doc)
    first = s.send("Who was there?")
    s.reset(keep_cache=True)
    assert s.messages == [] and s.stats().turns == 0
    again = s.send("What did it read?")  # the same document, another question: only the question is read
    fresh = tiny.chat_session(document=doc).send("What did it read?")
    assert again.text == fresh.text and again.stats.context_tokens == fresh.stats.context_tokens
    assert again.stats.prompt_tokens < fresh.stats.prompt_tokens - first.stats.new_tokens
    s.document = "Another story altogether."
    s.reset(keep_cache=True)
    other = s.send("Who?")  # nothing in common but the template's opening: read (almost) in full
    assert other.text == tiny.chat_session(document="Another story altogether.").send("Who?").text


def test_sessions_take_turns_on_one_cache(smol):
    a, b = smol.chat_session(), smol.chat_session(system="You answer in one word.")
    a.send(QUESTION)
    b.send(QUESTION)
    second = a.send(FOLLOW_UP)  # b used the cache meanwhile: a's conversation is read again in full
    assert second.stats.prompt_tokens == second.stats.context_tokens - second.stats.new_tokens
    assert second.text == "The capital of Italy is Rome."


def test_document_goes_with_the_first_message(tiny):
    s = tiny.chat_session(system="sys", document="Once upon a time there was a tiny model.")
    s.send("Who was there?")
    s.send("And then?")
    assert [(m["role"], m["content"]) for m in s.messages if m["role"] != "assistant"] == [
        ("system", "sys"), ("user", "Once upon a time there was a tiny model.\n\nWho was there?"),
        ("user", "And then?")]
    s.reset()
    assert s.messages == [{"role": "system", "content": "sys"}]
    s.send("Who?")
    assert s.messages[1]["content"] == "Once upon a time there was a tiny model.\n\nWho?"


# ---- the tiny model: loading options and chunked prefill ----


def test_chunked_prefill_and_progress(tiny):
    s = tiny.chat_session()
    progress = []
    first = s.send("the quick brown fox jumps over the lazy dog", on_progress=lambda d, t: progress.append((d, t)))
    n = first.stats.prompt_tokens
    assert n > 8 and progress == [(min(d, n), n) for d in range(8, n + 8, 8)]
    second = s.send("hello world")
    fresh = _fresh_reply(tiny, s.messages[:2], "hello world")
    assert (second.text, second.stats.context_tokens) == (fresh.text, fresh.stats.context_tokens)


def test_the_engines_prefill_goes_through_its_sequence(tiny, tmp_path):
    """Engine.prefill of the engine's own cache records its tokens in the engine's Sequence, so a KV file saved
    after it loads back; a cache fed outside its Sequence is refused when saved (its ids are unknown), not
    written as a file no engine could load."""
    from ktquest.generate import prefill

    tokens = tiny.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    tiny.sequence.claim(None)
    tiny.prefill(tokens)
    assert tiny.sequence.ids == tokens and tiny.cache.pos == len(tokens)
    tiny.save_kv(tmp_path / "a.kvq")
    assert tiny.load_kv(tmp_path / "a.kvq")[0] == tokens
    prefill(tiny.model, tiny.cache, tokens[:3], 8)  # the cache moves on, its sequence does not know
    with pytest.raises(ValueError, match="fed outside its Sequence"):
        tiny.save_kv(tmp_path / "b.kvq")
    assert not (tmp_path / "b.kvq").exists()
    tiny.sequence.claim(None)


def test_tiny_prompt_too_long(tiny):
    with pytest.raises(PromptTooLongError, match="context holds 256"):
        tiny.chat_session().send("dog " * 300)
    with pytest.raises(PromptTooLongError):
        tiny.generate("dog " * 300)


def test_load_options(tiny_llama):
    e = ktquest.load(tiny_llama.path, config=Config(threads=1), max_seq_len=64, temperature=0.5, seed=3)
    assert (e.config.threads, e.max_seq_len, e.cache.max_seq_len) == (1, 64, 64)
    assert (e.config.generation.temperature, e.config.generation.seed) == (0.5, 3)
    assert (e.device.type, e.dtype) == ("cpu", torch.float32)
    assert torch.get_num_threads() == 1
    assert e.tokenizer.stop_ids == {0, 2}
    # sampling is seeded: the same seed gives the same text
    assert e.generate("the cat", max_new_tokens=5) == e.generate("the cat", max_new_tokens=5)


def test_load_errors(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'nonsense'"):
        ktquest.load(tiny_llama.path, nonsense=1)
    with pytest.raises(ConfigError, match="chunk_size=0"):
        ktquest.load(tiny_llama.path, chunk_size=0)
    with pytest.raises(ConfigError, match=r"max_seq_len=\d+ is not allowed: .* GiB"):  # before allocating
        ktquest.load(tiny_llama.path, mode="long_context", max_seq_len=2**34)
    with pytest.raises(ConfigError, match=r"max_seq_len=\d+ is not allowed: .*block ids are int32"):  # 2**34 blocks
        ktquest.load(tiny_llama.path, mode="long_context", max_seq_len=2**40)
    with pytest.raises(GGUFError, match="no such file"):
        ktquest.load(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        ktquest.load(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_unavailable(tiny_llama):
    with pytest.raises(ConfigError, match="device='cuda' is not allowed: CUDA is not available"):
        ktquest.load(tiny_llama.path, device="cuda")


# ---- what the Python API refuses, before any work (issue 25) ----


def test_a_dense_cache_must_fit(tiny_llama, monkeypatch):
    import ktquest.kv.memory

    monkeypatch.setattr(ktquest.kv.memory, "available_ram", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=r"^max_seq_len=4096 is not allowed: the dense KV cache would need 2\.0 MiB "
                                          r"\(K and V, 2 layers x 2 KV heads x 16 x 4096 tokens in float32\) and "
                                          r"1\.0 MiB of RAM is available; lower max_seq_len or use mode long_context$"):
        ktquest.load(tiny_llama.path, max_seq_len=4096, device="cpu")
    with pytest.raises(ConfigError, match="the dense KV cache would need 2.0 MiB"):
        DenseKVCache(2, 2, 16, 4096)  # the cache checks too, for any caller
    assert ktquest.load(tiny_llama.path, max_seq_len=1024, device="cpu").cache.nbytes() == 1 << 19


def test_a_dense_cache_past_any_memory_is_refused_before_allocating(tiny_llama):
    with pytest.raises(ConfigError, match=r"max_seq_len=2147483647 .* would need 1024\.00 GiB"):
        ktquest.load(tiny_llama.path, max_seq_len=2**31 - 1, device="cpu")


def test_a_long_context_store_of_a_type_the_model_cannot_use(tiny_llama):
    """head_dim 16 is not whole groups of 32: said before the store's size is counted (which needs them)."""
    with pytest.raises(ConfigError, match=r"^long_context.kv_type='Q4_0' is not allowed for this model: .* "
                                          r"head_dim is 16; use FP16, BF16 or FP32$"):
        ktquest.load(tiny_llama.path, mode="long_context", kv_type="Q4_0")


def test_a_million_token_context_that_does_not_fit_is_not_the_default_reservation(tmp_path, tiny_bpe,
                                                                                  monkeypatch):
    path = write_model(tmp_path / "1m.gguf", *tiny_model_parts(tiny_bpe), {"llama.context_length": 1 << 20})
    # the tiny dense cache: 512 B/token, beside the weights
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: (64 << 20) + path.stat().st_size)
    e = ktquest.load(path, device="cpu", max_new_tokens=2)
    assert e.args.context_length == 1 << 20
    assert e.max_seq_len == e.cache.max_seq_len == e.model.max_seq_len == e.model.rope_cos.shape[1] == 1 << 17
    assert e.context_note.startswith("context 131,072 tokens (the model's trained 1,048,576 would need")
    assert isinstance(e.generate("the cat"), str)


def test_load_overrides_are_typed(tiny_llama):
    """Keyword overrides are values, not YAML text: 1e-05 is a number (YAML 1.1 would read the string)."""
    e = ktquest.load(tiny_llama.path, temperature=1e-5, seed=2**63 - 1, max_seq_len=64)
    assert (e.config.generation.temperature, e.config.generation.seed) == (1e-5, 2**63 - 1)
    with pytest.raises(ConfigError, match=r"generation.temperature=nan is not allowed: a finite number"):
        ktquest.load(tiny_llama.path, temperature=float("nan"))
    with pytest.raises(ConfigError, match=r"threads=2.0 has the wrong type: expected int"):
        ktquest.load(tiny_llama.path, threads=2.0)
    with pytest.raises(TypeError, match=r"^model must be str or PathLike or None, not int$"):
        ktquest.load(5)
    with pytest.raises(TypeError, match=r"^config must be Config or str or PathLike or None, not dict$"):
        ktquest.load(tiny_llama.path, config={"threads": 1})


@pytest.mark.parametrize("call, error, message", [
    (lambda e: e.generate(5), TypeError, "prompt must be str, not int"),
    (lambda e: e.generate(None), TypeError, "prompt must be str, not NoneType"),
    (lambda e: e.generate(b"the cat"), TypeError, "prompt must be str, not bytes"),
    (lambda e: e.generate(""), ValueError, "prompt '' is empty: it encodes to no tokens"),
    (lambda e: e.generate("x", on_text="print"), TypeError, "on_text must be callable or None, not str"),
    (lambda e: e.generate("x", should_stop=True), TypeError, "should_stop must be callable or None, not bool"),
    (lambda e: e.generate("x", max_new_tokens="5"), ConfigError, "generation.max_new_tokens='5' has the wrong type"),
    (lambda e: e.generate("x", max_new_tokens=0), ConfigError, "generation.max_new_tokens=0 is not allowed"),
    (lambda e: e.generate("x", temperature=1e-9), ConfigError, "generation.temperature=1e-09 is not allowed"),
    (lambda e: e.generate("x", seed=-1), ConfigError, "generation.seed=-1 is not allowed"),
    (lambda e: e.generate("x", nonsense=1), ConfigError, "unknown generation option 'nonsense'"),
    (lambda e: e.chat_session(system=5), TypeError, "system must be str or None, not int"),
    (lambda e: e.chat_session(document=[1]), TypeError, "document must be str or None, not list"),
    (lambda e: e.chat_session().send(["hi"]), TypeError, "user_text must be str, not list"),
    (lambda e: e.chat_session().send("hi", on_progress=3), TypeError, "on_progress must be callable or None"),
])
def test_wrong_arguments_are_refused_before_any_work(tiny, call, error, message):
    s = tiny.chat_session()
    s.send("the cat")
    held = tiny.cache.pos
    with pytest.raises(error) as info:
        call(tiny)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert (tiny.sequence.owner, tiny.cache.pos) == (s, held)  # the conversation in the cache is intact


OPENMP_PROBE = """
import os, sys, ktquest
print(os.environ.get("GOMP_SPINCOUNT"), end=" ")  # import alone: nothing set
if sys.argv[1] == "torch-first":
    import torch
print(ktquest.set_openmp_spin(), os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize("env, order, expected", [
    ({}, "ktquest-first", "None True 10000"), ({}, "torch-first", "None False None"),
    ({"GOMP_SPINCOUNT": "7"}, "ktquest-first", "7 False 7"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "ktquest-first", "None False None")])
def test_set_openmp_spin_only_before_torch_and_never_over_the_user(env, order, expected):
    """``set_openmp_spin`` (the CLI's and the server's process) shortens the spin of torch's idle OpenMP
    workers; ``import ktquest`` alone changes nothing (the runtime is shared with other OpenMP libraries), nor
    does the call once torch is loaded (libgomp has read its settings) or over a user's own setting."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", OPENMP_PROBE, order], env={**base, **env}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    assert out == expected
