"""The device decode step (models/device_step.py) on the CPU: the same code a GPU runs, through ``FakeLane``, a
stream whose work, copies and marks run only when the host waits, so a missing wait or a buffer reused too
early gives wrong logits here. Against the model's forward pass (``TorchDecoder``) and the native step, for a
dense cache and every long-context preset; across width buckets, a rewind and a KV file load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ktquest.config import load_config
from ktquest.engine import make_cache
from ktquest.generate import prefill
from ktquest.models import device_step
from ktquest.models.device_lane import FakeLane
from ktquest.models.device_step import DeviceDecoder
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model
from ktquest.native import cpu
from ktquest.native.decode import NativeDecoder

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = ["dense", "quest", "snapkv", "ada_quest", "ada_snapkv", "ktransformers", "million"]
SMALL = dict(block_size=4, init_windows_len=4, local_windows_len=8, second_select_num=3, preselect_block_count=6,
             preselect_window=8, kv_type="FP16", anchor_num=2, index_group=0, int8_candidates=False)
TOKENS = (5, 9, 11, 200, 7, 31, 64, 2, 90, 17, 3, 8, 40, 41)


def small(name: str, **lc):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    keep = {k: v for k, v in (SMALL | lc).items() if cfg.long_context.preselect_block or "preselect" not in k}
    return dataclasses.replace(cfg, chunk_size=16, max_seq_len=256,
                               long_context=dataclasses.replace(cfg.long_context, **keep),
                               prefill=dataclasses.replace(cfg.prefill, exact_tokens=32, blocks=4, exact_tail=8))


@pytest.fixture(scope="module")
def model(tiny_llama):
    m, _ = load_model(tiny_llama.path)  # dequantized fp32: the weights a GPU holds
    return m


def run(model, cfg, decoder, prompt, tokens=TOKENS, between=None):
    """Prefill ``prompt``, then decode ``tokens`` with ``decoder``: (logits [n, V], the selections, the stats).
    between(cache, i) runs before token i (a rewind, a KV file load)."""
    cache = make_cache(cfg, model.args, 256, model.device, model.dtype)
    out = []
    with torch.inference_mode():
        prefill(model, cache, prompt, cfg.chunk_size)
        for i, tok in enumerate(tokens):
            if between is not None:
                cache = between(cache, i) or cache
            out.append(decoder.decode(tok, cache))
    sel = [] if not hasattr(cache, "selection") else [
        None if s is None else s.ids.clone() for s in map(cache.selection, range(model.args.n_layers))]
    stats = dataclasses.asdict(cache.stats) if hasattr(cache, "stats") else {}
    return torch.stack(out), sel, stats


def same(a, b, atol=2e-5):
    (l0, s0, st0), (l1, s1, st1) = a, b
    torch.testing.assert_close(l1, l0, atol=atol, rtol=atol)
    assert st1 == st0
    for x, y in zip(s0, s1):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


@pytest.mark.parametrize("name", PRESETS)
def test_device_step_matches_the_forward_pass(model, name):
    """Every preset: the device step's logits, selections and selection statistics are the forward pass's, its
    segments captured (replayed from the second token of a bucket on) and each layer's store part read only
    after the copy of its q | k | v reached the host."""
    cfg = small(name)
    prompt = torch.arange(3, 70) * 7 % 250
    lane = FakeLane()
    want = run(model, cfg, TorchDecoder(model), prompt)
    got = run(model, cfg, DeviceDecoder(model, lane), prompt)
    same(want, got)
    graphs = [w for kind, w in lane.log if kind == "graph"]
    assert len(graphs) > len(TOKENS) and lane.captured
    if name != "dense":  # a store part a layer: q|k|v to the host, a mark, the window's graph queued behind it
        kinds = [k for k, _ in lane.log]
        assert kinds.count("to_host") >= model.args.n_layers and kinds.count("to_device") > len(TOKENS)
        assert any(w[1].startswith("W") for w in graphs)


@pytest.mark.parametrize("name", ["dense", "quest", "snapkv"])
def test_device_step_matches_the_native_step(tiny_llama, model, name):
    """The device step on dequantized weights against the CPU's native step on the file's encoding: greedy
    tokens equal, logits within the file's rounding."""
    encoded, _ = load_model(tiny_llama.path, encoded=True)
    cfg = small(name)
    prompt = torch.arange(5, 60) * 13 % 250
    want, _, _ = run(encoded, cfg, NativeDecoder.build(encoded, threads=2), prompt)
    got, _, _ = run(model, cfg, DeviceDecoder(model, FakeLane()), prompt)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def buckets_rewind_and_a_kv_file_load(model, lane, name, fp16):
    """The context grows past several width buckets, is rewound, and the cache is replaced by one loaded from
    its KV file state: each new bucket is captured again and every token still matches the forward pass."""
    cfg = small(name)
    prompt = torch.arange(3, 6) * 7 % 250  # 3 tokens: the width starts in the 4-row bucket

    def between(cache, i):
        if i == 5:
            cache.truncate(cache.pos - 3)  # a rewind (Sequence.rewind_for)
        if i == 9 and hasattr(cache, "state"):
            meta, arrays = cache.state()
            fresh = make_cache(cfg, model.args, 256, model.device, model.dtype)
            fresh.load_state(meta, {k: v.clone() for k, v in arrays.items()})
            return fresh
        return None

    tokens = TOKENS * 2
    want = run(model, cfg, TorchDecoder(model), prompt, tokens, between)
    got = run(model, cfg, DeviceDecoder(model, lane), prompt, tokens, between)
    if fp16:  # (fp16 on a GPU: the selections may differ where two blocks' scores round alike)
        close_in_fp16(got[0], want[0])
    else:
        same(want, got)


@pytest.mark.parametrize("name", ["dense", "quest"])
def test_buckets_rewind_and_a_kv_file_load(model, monkeypatch, name):
    monkeypatch.setattr(device_step, "MIN_BUCKET", 4)
    lane = FakeLane()
    buckets_rewind_and_a_kv_file_load(model, lane, name, False)
    buckets = {key[2] for key in lane.captured}
    assert len(buckets) >= 3, buckets  # 8, 16, 32: each seen twice or more


def test_a_dense_cache_that_grows_gets_new_graphs(tiny_llama, monkeypatch):
    """A dense cache grows by replacing its buffers (past GROW_TOKENS): the graphs captured over the old ones
    go, the new ones are captured, also after a rewind back below the growth."""
    from ktquest.kv.dense import GROW_TOKENS

    monkeypatch.setattr(device_step, "MIN_BUCKET", 4)
    cfg = dataclasses.replace(small("dense"), max_seq_len=GROW_TOKENS + 64)
    model, _ = load_model(tiny_llama.path, max_seq_len=cfg.max_seq_len)
    prompt = torch.arange(GROW_TOKENS - 6) * 7 % 250

    def cache_of(m):
        return make_cache(cfg, m.args, cfg.max_seq_len, m.device, m.dtype)

    runs = []
    for decoder in (TorchDecoder(model), DeviceDecoder(model, lane := FakeLane())):
        cache, out = cache_of(model), []
        with torch.inference_mode():
            prefill(model, cache, prompt, 64)
            for i, tok in enumerate(TOKENS):
                if i == 10:
                    cache.truncate(GROW_TOKENS - 4)  # back below the growth: the grown buffers stay
                out.append(decoder.decode(tok, cache))
        runs.append(torch.stack(out))
        assert cache.generation >= 1
    torch.testing.assert_close(runs[1], runs[0], atol=2e-5, rtol=2e-5)
    assert [k for kind, k in lane.log if kind == "release"]  # the old generation's graphs went


def test_the_fake_lane_catches_a_missing_wait(model):
    """A step that forgot to wait for a layer's q | k | v reads host buffers the stream has not filled yet: the
    fake stream makes that visible on the CPU."""
    cfg = small("quest")
    prompt = torch.arange(3, 70) * 7 % 250
    want, _, _ = run(model, cfg, TorchDecoder(model), prompt, TOKENS[:3])
    lane = FakeLane()
    wait = lane.wait
    # the bug: a layer's wait (its window's graph queued behind the mark) skipped; the token's last wait kept
    lane.wait = lambda mark: wait(mark) if lane.queue[-1][0] == "mark" else None
    dec = DeviceDecoder(model, lane)
    try:
        got, _, _ = run(model, cfg, dec, prompt, TOKENS[:3])
    except ValueError:  # (the store refusing a NaN query is caught too)
        return
    assert not torch.allclose(got, want, atol=1e-3)


def test_what_the_device_step_leaves_to_the_forward_pass(tiny_models):
    """A model with MoE blocks is not the device step's; a prompt's one-token chunk and a cache without device
    buffers go through the forward pass."""
    moe, _ = load_model(tiny_models("qwen3moe").path)
    assert not DeviceDecoder.applies(moe)
    m, _ = load_model(tiny_models("llama").path)
    assert DeviceDecoder.applies(m)
    cfg = small("quest")
    cache = make_cache(cfg, m.args, 256, torch.device("cpu"), torch.float32)
    lane = FakeLane()
    dec = DeviceDecoder(m, lane)
    with torch.inference_mode():
        prefill(m, cache, torch.arange(3, 40), 16)
        cache.begin_prompt(cache.pos + 1)  # the next token is the prompt's last
        want = TorchDecoder(m).decode(7, make_and_fill(cfg, m, torch.arange(3, 40)))
        got = dec.decode(7, cache)
    assert not lane.log and not lane.queue  # nothing went through the lane
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def make_and_fill(cfg, m, prompt):
    cache = make_cache(cfg, m.args, 256, torch.device("cpu"), torch.float32)
    prefill(m, cache, prompt, 16)
    cache.begin_prompt(cache.pos + 1)
    return cache


def test_the_operators_threads_stay_hot_while_a_token_runs_its_store_parts(model, monkeypatch):
    """While a token's store parts run, the pool's idle threads spin HOT_SPIN_US (a layer's device work apart),
    and as before once it is done, also when the token raised."""
    cfg = small("quest")
    cache = make_cache(cfg, model.args, 256, model.device, model.dtype)
    seen = []
    part = cache.store_part
    before = cpu.pool_spin_us()
    with torch.inference_mode():
        prefill(model, cache, torch.arange(3, 70) * 7 % 250, 16)
        cache.store_part = lambda *a: (seen.append(cpu.pool_spin_us()), part(*a))[1]
        DeviceDecoder(model, FakeLane()).decode(5, cache)
        assert seen and set(seen) == {device_step.HOT_SPIN_US} and cpu.pool_spin_us() == before
        cache.store_part = lambda *a: 1 / 0
        with pytest.raises(ZeroDivisionError):
            DeviceDecoder(model, FakeLane()).decode(5, cache)
    assert cpu.pool_spin_us() == before


def test_int8_weights_through_the_device_step(tiny_llama):
    """Weights as int8 rows (``weights: int8``, where fp16 would not fit a GPU): the device step gives the
    forward pass's logits on them."""
    m8, _ = load_model(tiny_llama.path, int8=True)
    cfg = small("quest")
    prompt = torch.arange(3, 70) * 7 % 250
    same(run(m8, cfg, TorchDecoder(m8), prompt), run(m8, cfg, DeviceDecoder(m8, FakeLane()), prompt))


def test_a_token_outside_the_vocabulary_is_refused(model):
    cache = make_cache(small("dense"), model.args, 256, torch.device("cpu"), torch.float32)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        DeviceDecoder(model, FakeLane()).decode(model.args.vocab_size, cache)
    assert cache.pos == 0


# ---- on a GPU (skipped where torch sees none): CUDA graphs, pinned buffers, events ----

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def close_in_fp16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits [n, V] within fp16's rounding of the range, and the same argmax wherever the reference's top
    two are apart by more than that."""
    got, want = got.float().cpu(), want.float().cpu()
    tol = 2e-2 * float(want.max() - want.min())
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    top2 = want.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@CUDA
@pytest.mark.parametrize("name", PRESETS)
def test_on_cuda_the_device_step_matches_the_native_step(tiny_llama, name):
    """fp16 weights on the GPU, CUDA graphs: the CPU native step's logits within fp16's rounding."""
    from ktquest.models.device_lane import CudaLane

    gpu, _ = load_model(tiny_llama.path, device="cuda", dtype=torch.float16)
    encoded, _ = load_model(tiny_llama.path, encoded=True)
    cfg = small(name)
    prompt = torch.arange(5, 60) * 13 % 250
    want, _, _ = run(encoded, cfg, NativeDecoder.build(encoded, threads=2), prompt)
    lane = CudaLane(torch.device("cuda"))
    got, _, _ = run(gpu, cfg, DeviceDecoder(gpu, lane), prompt)
    assert lane.failed is None and lane.pools  # captured, and replayed without falling back
    close_in_fp16(got, want)


@CUDA
@pytest.mark.parametrize("name", ["dense", "quest", "snapkv"])
def test_on_cuda_graphs_replay_across_buckets_a_rewind_and_a_kv_file_load(tiny_llama, monkeypatch, name):
    from ktquest.models.device_lane import CudaLane

    monkeypatch.setattr(device_step, "MIN_BUCKET", 4)
    gpu, _ = load_model(tiny_llama.path, device="cuda", dtype=torch.float16)
    lane = CudaLane(torch.device("cuda"))
    buckets_rewind_and_a_kv_file_load(gpu, lane, name, True)
    assert lane.failed is None and len(lane.pools) >= 3


@CUDA
def test_on_cuda_int8_weights_through_the_device_step(tiny_llama):
    """int8 rows on the GPU (fp16 activations, CUDA graphs) against the same int8 rows on the CPU in fp32."""
    from ktquest.models.device_lane import CudaLane

    g8, _ = load_model(tiny_llama.path, device="cuda", dtype=torch.float16, int8=True)
    c8, _ = load_model(tiny_llama.path, int8=True)
    cfg = small("quest")
    prompt = torch.arange(3, 70) * 7 % 250
    want, _, _ = run(c8, cfg, TorchDecoder(c8), prompt)
    lane = CudaLane(torch.device("cuda"))
    got, _, _ = run(g8, cfg, DeviceDecoder(g8, lane), prompt)
    assert lane.failed is None
    close_in_fp16(got, want)
