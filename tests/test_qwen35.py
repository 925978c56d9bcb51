"""Hybrid models (qwen35, qwen35moe, qwen3next: models/qwen35.py, models/delta_net.py, kv/recurrent.py) against
transformers' Qwen3.5 on the same weights: logits through chunked prefills and decode steps, greedy tokens, the
long-context presets on the attention layers, the recurrent state's checkpoints and rewinds, KV files, and files
whose DeltaNet keys are wrong."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf
from test_long_context import PRESETS, full_budget
from test_moe import check_chunked_logits_match_hf
from tiny_qwen35 import QWEN35_SPECS, build_qwen35, qwen35_gguf_tensors, qwen35_metadata

import ktquest
from ktquest.formats.gguf import GGUFError
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.kv.long_context import LongContextCache
from ktquest.kv.recurrent import RecurrentCache
from ktquest.kv.sliding import global_args
from ktquest.models.loader import load_model, read_gguf

ATOL = RTOL = 2e-4  # fp32; the delta rule's recurrence summed in another order than transformers' chunked form


@pytest.fixture(scope="module")
def qwen35_models(tmp_path_factory, tiny_bpe):
    """name -> (GGUF path, transformers model), each written once."""
    directory, made = tmp_path_factory.mktemp("qwen35"), {}

    def get(name: str):
        if name not in made:
            spec = QWEN35_SPECS[name]
            hf = build_qwen35(spec, len(tiny_bpe.tokens))
            path = write_gguf(directory / f"{name}.gguf", spec.arch, qwen35_metadata(spec),
                              qwen35_gguf_tensors(hf, spec), tiny_bpe)
            made[name] = (path, hf)
        return made[name]

    return get


def hybrid_cache(model, max_seq_len: int, main=None, every: int = 0, keep: int = 8) -> RecurrentCache:
    g = global_args(model.args)
    main = main or DenseKVCache(g.n_layers, g.n_kv_heads, g.head_dim, max_seq_len)
    return RecurrentCache(model.args, main, torch.device("cpu"), every, keep)


def prompt_ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def greedy_run(model, cache, prompt: torch.Tensor, n: int, chunk: int = 8) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        logits = [prefill(model, cache, prompt, chunk_size=chunk)]
        out = [int(logits[0].argmax())]
        for _ in range(n - 1):
            logits.append(decode_one_token(model, cache, out[-1]))
            out.append(int(logits[-1].argmax()))
    return out, torch.stack(logits)


# ---- the model against transformers ----


@pytest.mark.parametrize("name", sorted(QWEN35_SPECS))
def test_blocks_from_the_file(qwen35_models, name):
    spec = QWEN35_SPECS[name]
    model, _ = load_model(qwen35_models(name)[0])
    a = model.args
    assert a.arch == spec.arch and a.rope_dim == spec.rope_dim and a.head_dim == spec.head_dim
    kinds = ["attention" if (i + 1) % spec.interval == 0 else "delta_net" for i in range(spec.n_layers)]
    assert [b.mixer for b in a.blocks] == kinds
    d = a.blocks[0].delta
    assert (d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel, d.grouped) == (
        spec.n_k_heads, spec.n_v_heads, spec.k_head_dim, spec.v_head_dim, spec.conv_kernel, spec.next)
    assert all(b.attn_gate and b.qk_norm for b in a.blocks if b.mixer == "attention")
    assert all(b.ffn == ("moe" if spec.moe else "swiglu") for b in a.blocks)


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
@pytest.mark.parametrize("name", sorted(QWEN35_SPECS))
def test_chunked_logits_match_transformers(qwen35_models, name, encoded):
    """48 tokens prefilled in uneven chunks (17, 7, 16: the conv's state across chunk edges), then 8 decode
    steps, against one transformers forward."""
    check_chunked_logits_match_hf(*qwen35_models(name), encoded, hybrid_cache, ATOL)


@pytest.mark.parametrize("name", sorted(QWEN35_SPECS))
def test_greedy_tokens_equal_transformers(qwen35_models, name):
    path, hf = qwen35_models(name)
    model, _ = load_model(path, encoded=True)
    prompt = prompt_ids(20, model.args.vocab_size, seed=5)
    with torch.inference_mode():
        expected = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[0, 20:].tolist()
    assert greedy_run(model, hybrid_cache(model, 64), prompt, 12)[0] == expected


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_prefill_chunk_sizes_and_orders_leave_the_same_state(qwen35_models, chunk):
    model, _ = load_model(qwen35_models("qwen35")[0], encoded=True)
    prompt = prompt_ids(45, model.args.vocab_size, seed=3)
    ref = hybrid_cache(model, 64)
    with torch.inference_mode():
        ref_logits = prefill(model, ref, prompt, chunk_size=45)
        for order in ("chunk", "layer"):
            cache = hybrid_cache(model, 64)
            logits = prefill(model, cache, prompt, chunk_size=chunk, order=order)
            torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(cache.states.ssm, ref.states.ssm, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.states.conv, ref.states.conv, atol=5e-5, rtol=1e-4)  # (GEMV vs GEMM)
            assert cache.pos == 45 and cache.states.hi == [45] * len(model.args.delta_layers)


@pytest.mark.parametrize("name", PRESETS)
def test_long_context_presets_on_the_attention_layers(qwen35_models, name):
    """Every long-context preset on the attention layers (the store on each: dense_layer_num 0), its budget
    covering every block: the same logits and greedy tokens as a dense cache."""
    model, _ = load_model(qwen35_models("qwen35")[0], encoded=True)
    g = global_args(model.args)
    cfg = full_budget(name, block_size=4, kv_type="FP32", anchor_num=2, dense_layer_num=0)
    prompt = torch.arange(3, 60) * 7 % 250
    tokens, logits = greedy_run(model, hybrid_cache(model, 256, LongContextCache(g, cfg, 256)), prompt, 8)
    ref_tokens, ref_logits = greedy_run(model, hybrid_cache(model, 256), prompt, 8)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


# ---- the recurrent state: checkpoints and rewinds ----


def test_a_rewind_goes_to_a_checkpoint_and_continues_as_one_that_never_stopped(qwen35_models):
    model, _ = load_model(qwen35_models("qwen35")[0], encoded=True)
    v = model.args.vocab_size
    turns = torch.cat([prompt_ids(n, v, seed=s) for n, s in ((11, 1), (7, 2), (9, 3))])
    follow = prompt_ids(6, v, seed=9)

    def conversation() -> RecurrentCache:
        cache = hybrid_cache(model, 128)
        for a, b in ((0, 11), (11, 18), (18, 27)):
            prefill(model, cache, turns[a:b], chunk_size=4)  # each prompt's start and end are checkpoints
        for _ in range(3):
            decode_one_token(model, cache, 5)  # a reply's tokens: no checkpoints
        return cache

    with torch.inference_mode():
        cache = conversation()
        assert sorted(cache.checkpoints) == [11, 18, 27] and cache.pos == 30
        assert cache.rewind_point(30) == 30 and cache.rewind_point(29) == 27 and cache.rewind_point(20) == 18
        assert cache.rewind_point(17) == 11 and cache.rewind_point(5) == 0
        with pytest.raises(ValueError, match=r"truncate\(20\): the recurrent state is kept at positions \[11, 18, 27"):
            cache.truncate(20)
        for point in (27, 18, 11, 0):
            cache = conversation()
            cache.truncate(point)
            assert cache.pos == point and sorted(cache.checkpoints) == [p for p in (11, 18, 27) if p <= point]
            rest = torch.cat([turns[point:], follow])
            got = prefill(model, cache, rest, chunk_size=5)
            fresh = hybrid_cache(model, 128)
            want = prefill(model, fresh, torch.cat([turns[:point], rest]), chunk_size=5)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(cache.states.ssm, fresh.states.ssm, atol=1e-5, rtol=1e-5)


def test_an_interrupted_prompt_leaves_the_states_as_they_were(qwen35_models):
    model, _ = load_model(qwen35_models("qwen35")[0], encoded=True)
    v = model.args.vocab_size
    for order in ("chunk", "layer"):
        cache = hybrid_cache(model, 128)
        with torch.inference_mode():
            prefill(model, cache, prompt_ids(12, v), chunk_size=4)
            saved = (cache.states.ssm.clone(), cache.states.conv.clone())
            calls = 0

            def stop(done, total):
                nonlocal calls
                calls += 1
                if calls == 2:
                    raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                prefill(model, cache, prompt_ids(20, v, seed=4), chunk_size=4, order=order, on_progress=stop)
            cache.truncate(cache.rewind_point(12))  # what a sequence does after an interruption
            assert cache.pos == 12
            assert torch.equal(cache.states.ssm, saved[0]) and torch.equal(cache.states.conv, saved[1])


@pytest.mark.parametrize("order", ["chunk", "layer"])
def test_checkpoints_every_n_tokens_in_both_orders(qwen35_models, order):
    """A prompt of 45 tokens in chunks of 4 with a checkpoint every 8: copies at 8, 16, ... 40 (chunk starts) and
    at its end, each the state a prompt of that length leaves; the latest ``keep`` kept; a rewind to one of them
    continues as a conversation that never stopped."""
    model, _ = load_model(qwen35_models("qwen35")[0], encoded=True)
    prompt = prompt_ids(45, model.args.vocab_size, seed=6)
    with torch.inference_mode():
        cache = hybrid_cache(model, 128, every=8, keep=4)
        prefill(model, cache, prompt, chunk_size=4, order=order)
        assert sorted(cache.checkpoints) == [24, 32, 40, 45]  # 8, 16, ..., 40 and 45 taken: the latest 4 kept
        for p in (24, 40):
            ref = hybrid_cache(model, 128)
            prefill(model, ref, prompt[:p], chunk_size=4)
            torch.testing.assert_close(cache.checkpoints[p][1], ref.states.ssm, atol=1e-5, rtol=1e-5)
        assert cache.state_bytes() == cache.states.nbytes() * 5  # the live state and 4 copies
        cache.truncate(cache.rewind_point(37))
        assert cache.pos == 32
        got = prefill(model, cache, prompt[32:], chunk_size=4)
        torch.testing.assert_close(got, prefill(model, hybrid_cache(model, 128), prompt, chunk_size=4),
                                   atol=ATOL, rtol=RTOL)


# ---- the engine ----


@pytest.mark.parametrize("config", ["dense", "snapkv"])
def test_the_engine_chats_with_a_hybrid_model(qwen35_models, config, tmp_path):
    """ktquest.load on the CPU: a reply equal to the torch path's greedy continuation; a follow-up turn reads
    only itself (the recurrent state goes on); a KV file round-trips the states."""
    path = qwen35_models("qwen35")[0]
    small = {"init_windows_len": 4, "local_windows_len": 16, "block_size": 4, "dense_layer_num": 0}
    engine = ktquest.load(path, config, chunk_size=8, max_new_tokens=6, threads=1, max_seq_len=256,
                          **(small if config == "snapkv" else {}))
    assert isinstance(engine.cache, RecurrentCache)
    prompt = "the cat sat on the mat; the dog sat on the log. " * 2
    text = engine.generate(prompt, max_new_tokens=6)
    model, _ = load_model(path, encoded=True)
    expected, _ = greedy_run(model, hybrid_cache(model, 256), torch.tensor(engine.tokenizer.encode(prompt)), 6)
    assert text == engine.tokenizer.decode(expected)
    chat = engine.chat_session()
    first = chat.send("the cat sat")
    second = chat.send("on the mat")
    # from the first reply's start (a checkpoint) on: the first prompt is not read again
    assert second.stats.prompt_tokens <= second.stats.context_tokens - first.stats.prompt_tokens
    kv = tmp_path / "chat.kv"
    chat.save(kv)
    other = ktquest.load(path, config, chunk_size=8, max_new_tokens=6, threads=1, max_seq_len=256,
                         **(small if config == "snapkv" else {}))
    restored = other.load_session(kv)
    assert torch.equal(other.cache.states.ssm, engine.cache.states.ssm)
    assert restored.send("the end").text == chat.send("the end").text


# ---- files the family refuses ----


@pytest.mark.parametrize("key, value, needle", [
    ("qwen35.ssm.time_step_rank", 5, "qwen35.ssm.time_step_rank=5 is not allowed: a multiple of "
                                     "qwen35.ssm.group_count=2"),
    ("qwen35.ssm.inner_size", 100, "qwen35.ssm.inner_size=100 is not allowed: a multiple of"),
    ("qwen35.ssm.state_size", 0, "qwen35.ssm.state_size=0 is not allowed"),
    ("qwen35.rope.dimension_count", 7, "qwen35.rope.dimension_count=7 is not allowed"),
    ("qwen35.ssm.conv_kernel", 3, "tensor 'blk.0.ssm_conv1d.weight' has shape [208, 4], expected [208, 3]"),
])
def test_a_file_with_wrong_delta_net_keys_is_one_error(tmp_path, tiny_bpe, key, value, needle):
    spec = QWEN35_SPECS["qwen35"]
    hf = build_qwen35(spec, len(tiny_bpe.tokens))
    path = write_gguf(tmp_path / "bad.gguf", spec.arch, qwen35_metadata(spec) | {key: value},
                      qwen35_gguf_tensors(hf, spec), tiny_bpe)
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    assert str(path) in str(info.value) and needle in str(info.value) and "\n" not in str(info.value)


def test_the_states_are_said_counted_and_checked(qwen35_models, monkeypatch, capsys):
    """The memory a hybrid model's states take is said once at load, /stats shows it apart from the KV cache,
    and a checkpoint count that does not fit is refused with the figure."""
    import io
    import re
    import sys

    from ktquest.cli import main
    from ktquest.config import ConfigError
    from ktquest.kv import memory

    path = qwen35_models("qwen35")[0]
    engine = ktquest.load(path, max_seq_len=128, threads=1)
    one = memory.recurrent_state_bytes(engine.args)
    assert one == engine.cache.states.nbytes()
    assert engine.state_note == (f"recurrent state {one / 2**20:.1f} MiB (3 DeltaNet layers), and "
                                 f"{one / 2**20:.1f} MiB a checkpoint at each turn boundary and every 512 prompt "
                                 f"tokens, the last 8 kept: up to {9 * one / 2**20:.1f} MiB")
    chat = engine.chat_session()
    chat.send("the cat")
    stats = chat.stats()
    assert stats.state_bytes == one * (1 + len(engine.cache.checkpoints)) > one
    assert stats.kv_cache_bytes == engine.cache.main.nbytes()
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat\n/stats\n"))
    assert main(["chat", "-m", str(path), "-c", "128", "-n", "2"]) == 0
    out, err = capsys.readouterr()
    assert "ktquest: recurrent state " in err and re.search(r"recurrent state\s+[\d.]+ MiB \(with its checkpoints\)", out)
    monkeypatch.setattr(memory, "available_ram", lambda: 3 * one)
    with pytest.raises(ConfigError, match=r"^state_checkpoints=8 is not allowed: the recurrent states would need .* "
                                          r"\(9 copies of .*\) and .* of RAM is available; lower state_checkpoints$"):
        ktquest.load(path, max_seq_len=128, threads=1)
    assert ktquest.load(path, max_seq_len=128, threads=1, state_checkpoints=1).cache.keep == 1


def test_the_server_reuses_a_documents_states(qwen35_models):
    """Another question about the same document rewinds to the last checkpoint inside the document (every 16
    tokens here), a follow-up to the end of the last prompt: cached_tokens say so, and the replies are a cold
    engine's."""
    from test_server_requests import _serving

    from ktquest.server.app import create_app
    from ktquest.server.worker import Worker

    path = qwen35_models("qwen35")[0]
    sets = dict(max_seq_len=256, threads=1, chunk_size=8, state_checkpoint_tokens=16, temperature=0.0)
    doc = "the cat sat on the mat; the dog sat on the log; " * 4

    def ask(post, messages):
        status, r = post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 6,
                                                   "temperature": 0})
        assert status == 200, r
        return r["choices"][0]["message"]["content"], r["usage"]

    with _serving(create_app(Worker(ktquest.load(path, **sets)), "tiny")) as post:
        q1 = [{"role": "user", "content": f"{doc}\n\nwhere is the cat?"}]
        _, u1 = ask(post, q1)
        q2 = [{"role": "user", "content": f"{doc}\n\nwhere is the dog?"}]
        a2, u2 = ask(post, q2)
        shared = u1["prompt_tokens"] - 8  # the document, about: the questions differ in their last tokens
        assert shared - 16 <= u2["prompt_tokens_details"]["cached_tokens"] <= shared
        q3 = q2 + [{"role": "assistant", "content": a2}, {"role": "user", "content": "and the mat?"}]
        a3, u3 = ask(post, q3)
        assert u3["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"]
    for messages, answer in ((q2, a2), (q3, a3)):  # each asked of a cold engine
        with _serving(create_app(Worker(ktquest.load(path, **sets)), "tiny")) as post:
            assert ask(post, messages)[0] == answer


@pytest.mark.parametrize("change, needle", [
    (lambda a: {k: v for k, v in a.items() if k != "ssm"}, "ssm"),  # the states missing
    (lambda a: a | {"ssm": a["ssm"][:, :-1].contiguous()}, "ssm"),  # of another shape
    (lambda a: a | {"conv": a["conv"] * float("nan")}, "not finite"),
])
def test_a_kv_file_without_the_states_or_with_others_is_refused(qwen35_models, tmp_path, change, needle):
    """A KV file must hold the DeltaNet states of this model's shapes (finite): otherwise one KVFileError line,
    and the conversation in the engine is unchanged."""
    from ktquest.kv import files
    from ktquest.kv.files import KVFileError

    path = qwen35_models("qwen35")[0]
    engine = ktquest.load(path, max_seq_len=128, threads=1, max_new_tokens=4)
    chat = engine.chat_session()
    chat.send("the cat sat")
    kv = tmp_path / "h.kvq"
    chat.save(kv)
    header, arrays = files.load(kv)
    files.save(tmp_path / "bad.kvq", {k: v for k, v in header.items() if k not in ("arrays", "payload_bytes")},
               change(dict(arrays)))
    other = ktquest.load(path, max_seq_len=128, threads=1, max_new_tokens=4)
    other_chat = other.chat_session()
    other_chat.send("a dog")
    held, ssm = list(other.sequence.ids), other.cache.states.ssm.clone()
    with pytest.raises(KVFileError, match=needle) as info:
        other.load_session(tmp_path / "bad.kvq")
    assert "\n" not in str(info.value)
    assert other.sequence.ids == held and torch.equal(other.cache.states.ssm, ssm)


def test_list_counts_a_hybrids_states(qwen35_models, monkeypatch):
    """ktquest list's fit check adds the DeltaNet states and their checkpoints to the weights and the attention
    layers' KV, as the engine does."""
    from ktquest import catalog
    from ktquest.kv import memory

    info = catalog.read_info(qwen35_models("qwen35")[0])
    g = global_args(info.args)
    kv = memory.dense_bytes(g.n_layers, g.n_kv_heads, g.head_dim, info.args.context_length, torch.float32)
    states = memory.recurrent_state_bytes(info.args) * 9  # the live one and 8 checkpoints
    for ram, fits in ((info.file_size + kv + states, True), (info.file_size + kv + states - 1, False)):
        monkeypatch.setattr(memory, "available_ram", lambda ram=ram: ram)
        assert catalog.fits(info, "dense") is fits
