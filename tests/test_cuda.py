"""On a CUDA device (skipped where torch sees none): the fused attention with its LSE against a float64
reference; layer-major prefill there against chunk order and against the CPU; a first prompt attends on the
device alone and each layer's K/V cross to the DRAM store once; the device memory a layer-major prefill
holds stays within ``Engine.prefill_device_bytes`` and is flat in the prompt's length with slabs; a stopped
prompt leaves the cache as it was; a chat on the device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ktquest
from ktquest.config import load_config
from ktquest.engine import make_cache
from ktquest.generate import decode_one_token, prefill
from ktquest.kv import attention, layer_prefill
from ktquest.kv.attention import attention_lse
from ktquest.kv.memory import prompt_token_device_bytes
from ktquest.models.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def reference(q, k, v, scale, causal):
    """softmax(q k^T scale) v and its logsumexp, in float64 on the CPU: q [B, M, D], k/v [B, S, D]."""
    q, k, v = (x.cpu().double() for x in (q, k, v))
    s = torch.einsum("bmd,bsd->bms", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bms,bsd->bmd", s.softmax(-1), v), torch.logsumexp(s, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu().double(), b.cpu().double()
    return float((a - b).norm() / b.norm())


# ---- attention_lse: the fused kernels ----


CASES = [(1, 1, False), (7, 19, False), (96, 1500, False), (1, 1, True), (19, 19, True), (130, 130, True)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("D", [16, 64, 128, 256])
@pytest.mark.parametrize("M,S,causal", CASES)
def test_fused_attention_lse_matches_float64(dtype, tol, D, M, S, causal):
    assert attention._cuda_kernel(CUDA, dtype, D) is not None  # the fused kernel runs, not the tiles
    g = torch.Generator().manual_seed(M * 1000 + S + D)
    q, k, v = (torch.randn(3, n, D, generator=g).to(CUDA, dtype) for n in (M, S, S))
    out, lse = attention_lse(q, k, v, D ** -0.5, causal=causal)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == (3, M, D) and lse.shape == (3, M)
    want_out, want_lse = reference(q, k, v, D ** -0.5, causal)  # over the rounded inputs
    assert rel(out, want_out) < tol
    assert (lse.cpu().double() - want_lse).abs().max() < 1e-3  # the kernels' LSE is fp32 in every dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,S", [(5, 0), (0, 5)])
def test_fused_attention_lse_of_an_empty_set(dtype, M, S):
    """No keys: a part that weighs nothing in a merge (out 0, lse -inf), as the tiled path gives."""
    q, k = torch.randn(2, M, 64, device=CUDA, dtype=dtype), torch.randn(2, S, 64, device=CUDA, dtype=dtype)
    out, lse = attention_lse(q, k, k, 0.125)
    assert out.shape == (2, M, 64) and lse.shape == (2, M)
    assert not out.any() and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("heads,M,S", [(2, 64, 300), (2, 600, 4000), (12, 512, 512), (2, 3072, 20000),
                                       (1, 64, 70000)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_flash_scratch_within_its_bound(heads, M, S, D):
    """What flash allocates beside its inputs and output (its split-KV accumulators) against
    ``fused_scratch_bytes`` for a prefill whose calls include this shape."""
    q = torch.randn(heads, M, D, device=CUDA, dtype=torch.float16)
    k, v = (torch.randn(heads, S, D, device=CUDA, dtype=torch.float16) for _ in range(2))
    attention_lse(q, k, v, D ** -0.5)  # warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = attention_lse(q, k, v, D ** -0.5)
    torch.cuda.synchronize()
    # beside the kernel's fp16 output and LSE: its scratch while it runs, then the output's fp32 copy
    held = torch.cuda.max_memory_allocated() - base - heads * M * (D * 2 + 4)
    bound = attention.fused_scratch_bytes(CUDA, torch.float16, heads, heads, D, M, S)
    assert held <= max(bound, heads * M * D * 4) + 4096  # (+ a few small tensors' 512-byte rounding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_equals_tiled_from_strided_views(monkeypatch, dtype):
    """Keys and values as the layer prefill passes them (a workspace's first rows: strided views)."""
    g = torch.Generator().manual_seed(1)
    ws = torch.randn(2, 300, 64, generator=g).to(CUDA, dtype)
    q = torch.randn(2, 40, 64, generator=g).to(CUDA, dtype)
    fused = attention_lse(q, ws[:, :170], ws[:, 5:175], 0.125)
    monkeypatch.setattr(attention, "_cuda_kernel", lambda *a: None)
    monkeypatch.setattr(attention, "LSE_TILE", 64)
    tiled = attention_lse(q, ws[:, :170], ws[:, 5:175], 0.125)
    assert rel(fused[0], tiled[0]) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert (fused[1] - tiled[1]).abs().max() < 1e-3


# ---- layer-major prefill on the device ----


def small_long_context(name: str, **prefill_keys):
    """A preset with windows and blocks small enough that the tiny prompts have context blocks, its store in
    fp32 (a lossy store differs by order: chunk order reads the prompt's earlier chunks back from it)."""
    over = [("long_context.block_size", 4), ("long_context.init_windows_len", 5),
            ("long_context.local_windows_len", 12), ("long_context.kv_type", "FP32"), ("chunk_size", 16),
            ("max_seq_len", 256)]
    return load_config(CONFIGS / f"{name}.yaml", over + [(f"prefill.{k}", v) for k, v in prefill_keys.items()])


def config(name: str):
    if name == "dense":
        return load_config(None, [("chunk_size", 16), ("max_seq_len", 256)])
    return dataclasses.replace(small_long_context(name), sliding_window_keep=16)


def prompt(n: int, seed: int = 0, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def read_turns(model, cfg, turns, order, device, dtype, n_decode=6):
    """Prefill each turn in the ``order`` given, then decode greedily: each turn's end logits (fp32, CPU), the
    greedy tokens, the cache."""
    cache = make_cache(cfg, model.args, 256, device, dtype)
    logits = [prefill(model, cache, t, cfg.chunk_size, order=order).float().cpu() for t in turns]
    tok, out = int(logits[-1].argmax()), []
    for _ in range(n_decode):
        out.append(tok)
        tok = int(decode_one_token(model, cache, tok).argmax())
    return logits, out, cache


TURNS = [prompt(87), prompt(37, seed=1), prompt(1, seed=2)]


@pytest.fixture(scope="module")
def models(tiny_models):
    """(name, device, dtype) -> the tiny model there (llama, or gemma3 for the hybrid cache)."""
    made = {}

    def get(arch, device, dtype):
        if (arch, device, dtype) not in made:
            made[arch, device, dtype] = load_model(tiny_models(arch).path, device, dtype)[0]
        return made[arch, device, dtype]

    return get


@pytest.mark.parametrize("name", ["dense", "quest", "snapkv", "ada_quest", "gemma3"])
def test_layer_order_on_the_device_equals_chunk_order_and_the_cpu(models, name):
    arch = "gemma3" if name == "gemma3" else "llama"
    cfg = config("quest" if name == "gemma3" else name)
    want, want_tokens, _ = read_turns(models(arch, CPU, torch.float32), cfg, TURNS, "chunk", CPU, torch.float32)
    m = models(arch, CUDA, torch.float32)
    for order in ("chunk", "layer"):
        got, tokens, _ = read_turns(m, cfg, TURNS, order, CUDA, torch.float32)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
        assert tokens == want_tokens, order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["dense", "quest", "gemma3"])
def test_layer_order_in_half_precision_tracks_fp32(models, name, dtype):
    arch = "gemma3" if name == "gemma3" else "llama"
    cfg = config("quest" if name == "gemma3" else name)
    want, _, _ = read_turns(models(arch, CPU, torch.float32), cfg, TURNS, "chunk", CPU, torch.float32)
    m = models(arch, CUDA, dtype)
    layer, _, _ = read_turns(m, cfg, TURNS, "layer", CUDA, dtype)
    chunk, _, _ = read_turns(m, cfg, TURNS, "chunk", CUDA, dtype)
    # the model's rounding is the same in both orders: layer order is as close to fp32 as chunk order
    slack = 1e-2 if dtype == torch.float16 else 4e-2
    for a, b, c in zip(layer, chunk, want):
        assert rel(a, c) < 1.25 * rel(b, c) + slack
        assert rel(a, b) < 5 * slack


def test_a_first_prompt_attends_on_the_device_and_crosses_to_the_store_once(models, monkeypatch):
    m = models("llama", CUDA, torch.float16)
    cfg = config("quest")
    monkeypatch.setattr(layer_prefill, "SLAB_TO_STORE", 32)  # several bulk copies a layer
    cache = make_cache(cfg, m.args, 256, CUDA, torch.float16)
    appended: list[tuple[int, int]] = []
    real_append = cache.store.append

    def append(layer, k, v):
        assert k.device.type == "cpu" and k.shape[0] <= 32
        appended.append((layer, k.shape[0]))
        return real_append(layer, k, v)

    def attend(*args, **kwargs):
        raise AssertionError("the store's CPU operator was asked to attend during a first prompt")

    monkeypatch.setattr(cache.store, "append", append)
    monkeypatch.setattr(type(cache.store), "attend", attend)
    n = 150
    prefill(m, cache, prompt(n), cfg.chunk_size, order="layer")
    # each layer once, in bulk copies of at most 32 tokens, in layer order
    assert [layer for layer, _ in appended] == [i for i in range(m.args.n_layers) for _ in range(-(-n // 32))]
    for i in range(m.args.n_layers):
        assert sum(t for layer, t in appended if layer == i) == n
    # chunk order reads the past's blocks through the operator: the spy above would see it
    with pytest.raises(AssertionError, match="CPU operator"):
        prefill(m, make_cache(cfg, m.args, 256, CUDA, torch.float16), prompt(n), cfg.chunk_size, order="chunk")


@pytest.mark.parametrize("name", ["dense", "quest", "gemma3"])
def test_an_interrupted_prompt_on_the_device_leaves_the_cache_as_it_was(models, name):
    arch = "gemma3" if name == "gemma3" else "llama"
    m = models(arch, CUDA, torch.float32)
    cfg = config("quest" if name == "gemma3" else name)
    first, second, third = prompt(60), prompt(70, seed=1), prompt(9, seed=2)
    _, expected, _ = read_turns(m, cfg, [first, third], "layer", CUDA, torch.float32)
    cache = make_cache(cfg, m.args, 256, CUDA, torch.float32)
    prefill(m, cache, first, cfg.chunk_size, order="layer")
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prefill(m, cache, second, cfg.chunk_size, on_progress=progress, order="layer")
    assert cache.pos == len(first)
    logits = prefill(m, cache, third, cfg.chunk_size, order="layer")
    tok, out = int(logits.argmax()), []
    for _ in range(len(expected)):
        out.append(tok)
        tok = int(decode_one_token(m, cache, tok).argmax())
    assert out == expected


# ---- device memory ----


def device_peak(eng, tokens) -> int:
    """Device bytes a prefill of ``tokens`` into a fresh cache held at its peak, beyond what was there before."""
    cache = make_cache(eng.config, eng.model.args, eng.max_seq_len, eng.device, eng.dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eng.prefill(tokens, cache)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("name", ["quest", "gemma3"])
def test_the_device_peak_stays_within_the_reported_bound(tiny_models, name, dtype):
    path = tiny_models("gemma3" if name == "gemma3" else "llama").path
    peaks = {}
    for slab in (0, 512):
        cfg = load_config(CONFIGS / "quest.yaml", [("max_seq_len", 4096), ("chunk_size", 128),
                                                   ("prefill.order", "layer"), ("prefill.slab_tokens", slab)])
        eng = ktquest.load(path, cfg, device="cuda", dtype=dtype)
        eng.prefill(prompt(200, seed=9), make_cache(cfg, eng.model.args, 4096, eng.device, eng.dtype))  # warm
        bound = eng.prefill_device_bytes()
        a = eng.model.args
        for n in (1024, 4000):
            peak = device_peak(eng, prompt(n, seed=n))
            assert peak <= bound, (slab, n, peak, bound)
            peaks[slab, n] = peak
    kv = 2 * a.n_kv_heads * (4000 - 1024) * a.head_dim * eng.dtype.itemsize  # one layer's K/V of the difference
    per_token = (4000 - 1024) * prompt_token_device_bytes(a)
    # the whole prompt's K/V of a layer (less a few of the small tensors' 512-byte rounding, which may differ
    # at the two peaks)
    assert peaks[0, 4000] - peaks[0, 1024] >= kv - 8 * 512
    assert peaks[512, 4000] - peaks[512, 1024] <= per_token  # slabs: only what is counted per token grows


def test_a_chat_on_the_device_in_layer_order(tiny_llama):
    replies = {}
    for device, order in (("cpu", "chunk"), ("cuda", "layer")):
        cfg = small_long_context("quest", order=order)
        eng = ktquest.load(tiny_llama.path, cfg, max_new_tokens=8, threads=1, device=device, dtype="float32")
        chat = eng.chat_session(system="be brief", document="some words " * 4)
        replies[device] = [chat.send(m).text for m in ("hello there", "and then?")]
    assert replies["cpu"] == replies["cuda"] and all(replies["cuda"])
