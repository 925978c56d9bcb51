"""Mixture-of-experts models (qwen3moe: models/qwen3moe.py, models/ffn.py) against Hugging Face's Qwen3-MoE on
the same weights, the routing's contract (ties, renormalization, k = 1), and files whose experts disagree with
their keys."""

from __future__ import annotations

import pytest
import torch
from conftest import MOE_SPECS, build_hf_model, gguf_metadata, hf_to_gguf_tensors, write_gguf
from test_long_context import CONFIGS, PRESETS, TOL, full_budget

from ktquest.formats.gguf import GGUFError
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.kv.long_context import LongContextCache
from ktquest.models.ffn import route
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model, read_gguf
from ktquest.native.decode import NativeDecoder

# fp32 throughout; the experts' outputs are summed in another order than Hugging Face's index_add_
FP32_ATOL = 1e-4
FP32_RTOL = 1e-4


def make_cache(model, max_seq_len: int) -> DenseKVCache:
    a = model.args
    return DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_seq_len)


def prompt_ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- routing ----


def ref_route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time, in plain Python: the k best experts, ties to the lower id."""
    ws, ids = [], []
    for row in logits.double().softmax(-1).tolist():
        best = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        w = torch.tensor([row[e] for e in best], dtype=torch.float64)
        ws.append(w / w.sum() if norm else w)
        ids.append(best)
    return torch.stack(ws).float(), torch.tensor(ids)


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "as-trained"])
@pytest.mark.parametrize("n_experts,k", [(1, 1), (5, 1), (7, 2), (8, 3), (19, 4), (128, 8)])
def test_route_matches_reference(n_experts, k, norm):
    logits = torch.randn(13, n_experts, generator=torch.Generator().manual_seed(n_experts))
    logits[3] = 0.0  # every expert tied
    logits[4, : n_experts // 2] = 1.5  # ties at the top
    weights, ids = route(logits, k, norm)
    ref_w, ref_ids = ref_route(logits, k, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(13), atol=1e-6, rtol=0)


def test_route_ties_take_the_lower_id():
    """torch.topk leaves the order of equal values unspecified; the route is lowest id first, as cpp/moe/'s."""
    weights, ids = route(torch.zeros(2, 8), 3, True)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))
    _, ids = route(torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]]), 4, False)
    assert ids.tolist() == [[1, 3, 5, 2]]


# ---- the model against Hugging Face ----


def test_moe_blocks_from_the_file(tiny_models):
    for name, spec in MOE_SPECS.items():
        model, _ = load_model(tiny_models(name).path)
        a = model.args
        assert a.arch == "qwen3moe" and a.head_dim == spec.hd
        assert all(b.ffn == "moe" and b.qk_norm and (b.n_experts, b.n_experts_used, b.expert_ffn, b.norm_topk) ==
                   (spec.n_experts, spec.n_used, spec.expert_ffn, spec.norm_topk) and not b.shared_expert
                   for b in a.blocks)
        assert model.layers[0].ffn.n_experts == spec.n_experts


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
def test_moe_logits_match_hf(tiny_moe, encoded):
    """Prefill in uneven chunks (groups of tokens per expert), then decode steps, vs one HF forward; the
    weights dequantized, or read in their encoding per expert."""
    check_chunked_logits_match_hf(*tiny_moe, encoded)


def check_chunked_logits_match_hf(path, hf, encoded: bool, cache_of=None, tol: float = FP32_ATOL) -> None:
    """48 tokens prefilled in uneven chunks (17, 7, 16), then 8 decode steps, against one HF forward;
    ``cache_of(model, max_seq_len)`` makes the cache (a dense one by default), ``tol`` the atol and rtol."""
    model, _ = load_model(path, max_seq_len=64, encoded=encoded)
    tokens = prompt_ids(48, model.args.vocab_size)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]  # [48, V]
        cache = (cache_of or make_cache)(model, 64)
        got = [model(tokens[0:17], 0, cache), model(tokens[17:24], 17, cache), model(tokens[24:40], 24, cache)]
        got += [model(tokens[i:i + 1], i, cache) for i in range(40, 48)]
    torch.testing.assert_close(torch.cat(got), expected, atol=tol, rtol=tol)


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    cache = make_cache(model, len(prompt) + n)
    with torch.inference_mode():
        logits = prefill(model, cache, prompt, chunk_size=8)
        out = [int(logits.argmax())]
        for _ in range(n - 1):
            out.append(int(decode_one_token(model, cache, out[-1]).argmax()))
    return out


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
def test_moe_greedy_tokens_equal_hf(tiny_moe, encoded):
    path, hf = tiny_moe
    model, _ = load_model(path, encoded=encoded)
    prompt = prompt_ids(20, model.args.vocab_size, seed=5)
    with torch.inference_mode():
        expected = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[0, 20:].tolist()
    assert greedy(model, prompt, 12) == expected


# ---- the native decode step (cpp/moe/ inside cpp/decode/) ----


def greedy_run(model, cache, prompt: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after a chunked prefill, and every step's logits [n, V]."""
    with torch.inference_mode():
        logits = [prefill(model, cache, prompt, chunk_size=8)]
        out = [int(logits[0].argmax())]
        for _ in range(n - 1):
            logits.append(decode_one_token(model, cache, out[-1]))
            out.append(int(logits[-1].argmax()))
    return out, torch.stack(logits)


def test_native_decode_greedy_tokens_equal_the_torch_path(tiny_moe):
    """The native step (router, top-k, the chosen experts' GEMVs in place, weighted sum) against the torch blocks
    on the same encoded weights: the same greedy tokens, the logits within fp32 rounding."""
    model, _ = load_model(tiny_moe.path, encoded=True)
    prompt = prompt_ids(21, model.args.vocab_size, seed=7)
    runs = []
    for decoder in (TorchDecoder(model), NativeDecoder.build(model, threads=2)):
        model.decoder = decoder
        runs.append(greedy_run(model, make_cache(model, 64), prompt, 16))
    assert runs[1][0] == runs[0][0]
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("name", PRESETS)
def test_long_context_presets_on_a_moe_model(tiny_models, name):
    """Every long-context preset, the store on every layer (dense_layer_num 0), its budget covering every block:
    the native decode step's logits equal a dense cache's (the store keeps fp32 K/V), greedy tokens too."""
    model, _ = load_model(tiny_models("qwen3moe").path, encoded=True)
    model.decoder = NativeDecoder.build(model, threads=2)
    a = model.args
    cfg = full_budget(name, block_size=4, kv_type="FP32", anchor_num=2, dense_layer_num=0)
    prompt = torch.arange(3, 60) * 7 % 250
    tokens, logits = greedy_run(model, LongContextCache(a, cfg, 256), prompt, 8)
    ref_tokens, ref_logits = greedy_run(model, make_cache(model, 256), prompt, 8)
    assert tokens == ref_tokens
    tol = TOL["FP32"] * 10  # logits: the error of three layers, amplified by the output projection
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol)


@pytest.mark.parametrize("config", ["default", "quest"])
def test_the_engine_runs_a_moe_model(tiny_models, config):
    """ktquest.load on the CPU: the experts stay in their encoding and decode takes the native step; with quest, the
    store holds every layer past small windows (its budget covers every block); the reply is the torch path's
    greedy continuation on a dense cache."""
    import ktquest

    path = tiny_models("qwen3moe").path
    small = {"init_windows_len": 4, "local_windows_len": 16, "block_size": 4, "dense_layer_num": 0}
    engine = ktquest.load(path, config=CONFIGS / f"{config}.yaml", chunk_size=8, max_new_tokens=6, threads=1,
                          **(small if config == "quest" else {}))
    assert isinstance(engine.model.decoder, NativeDecoder)
    assert isinstance(engine.cache, LongContextCache if config == "quest" else DenseKVCache)
    prompt = "the cat sat on the mat; the dog sat on the log. " * 2
    text = engine.generate(prompt, max_new_tokens=6)
    model, _ = load_model(path, encoded=True)
    expected, _ = greedy_run(model, make_cache(model, 64), torch.tensor(engine.tokenizer.encode(prompt)), 6)
    assert text == engine.tokenizer.decode(expected)


# ---- files whose experts disagree with their keys ----


def _moe_parts(name: str = "qwen3moe"):
    spec = MOE_SPECS[name]
    hf = build_hf_model(spec, 320)
    return spec.arch, gguf_metadata(spec, 320), hf_to_gguf_tensors(hf, spec)


def _assert_error(path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg


def test_expert_count_disagreeing_with_the_stacks(tmp_path):
    arch, md, tensors = _moe_parts()
    md["qwen3moe.expert_count"] = 4  # the stacks hold 5
    path = write_gguf(tmp_path / "count.gguf", arch, md, tensors, None)
    _assert_error(path, "'blk.0.ffn_gate_inp.weight'", "[5, 64]", "expected [4, 64]")
    arch, md, tensors = _moe_parts()
    tensors["blk.1.ffn_down_exps.weight"] = tensors["blk.1.ffn_down_exps.weight"][:4]
    path = write_gguf(tmp_path / "stack.gguf", arch, md, tensors, None)
    _assert_error(path, "'blk.1.ffn_down_exps.weight'", "[4, 64, 48]", "expected [5, 64, 48]", "n_experts")


def test_expert_width_disagreeing_with_the_key(tmp_path):
    arch, md, tensors = _moe_parts()
    md["qwen3moe.expert_feed_forward_length"] = 40
    path = write_gguf(tmp_path / "width.gguf", arch, md, tensors, None)
    _assert_error(path, "'blk.0.ffn_gate_exps.weight'", "[5, 48, 64]", "expected [5, 40, 64]")


@pytest.mark.parametrize("used", [6, 0])
def test_expert_used_count_out_of_range(tmp_path, used):
    arch, md, tensors = _moe_parts()
    md["qwen3moe.expert_used_count"] = used
    path = write_gguf(tmp_path / "used.gguf", arch, md, tensors, None)
    _assert_error(path, f"qwen3moe.expert_used_count={used}")


def test_missing_expert_stack_and_unsupported_gating(tmp_path):
    arch, md, tensors = _moe_parts()
    del tensors["blk.2.ffn_up_exps.weight"]
    _assert_error(write_gguf(tmp_path / "missing.gguf", arch, md, tensors, None),
                  "missing tensor 'blk.2.ffn_up_exps.weight'")
    arch, md, tensors = _moe_parts()
    md["qwen3moe.expert_gating_func"] = 2
    _assert_error(write_gguf(tmp_path / "sigmoid.gguf", arch, md, tensors, None),
                  "qwen3moe.expert_gating_func=2", "softmax")


def test_the_ram_checks_chunk_counts_the_experts_widths():
    """A chunk's activations (kv/memory.py) on a MoE block: the experts' width and count, not the file's
    dense feed_forward_length (Qwen3-30B-A3B: 6144 beside experts of 768)."""
    import dataclasses
    import types

    from ktquest.kv.memory import chunk_activation_bytes
    from ktquest.models.block import BlockSpec

    moe = BlockSpec(qk_norm=True, ffn="moe", n_experts=128, n_experts_used=8, expert_ffn=768, norm_topk=True)
    args = types.SimpleNamespace(n_layers=2, n_heads=32, n_kv_heads=4, head_dim=128, dim=2048, ffn_dim=6144,
                                 blocks=(moe, moe))
    base = chunk_activation_bytes(args, 512)
    assert chunk_activation_bytes(types.SimpleNamespace(**{**vars(args), "ffn_dim": 60000}), 512) == base
    wider = dataclasses.replace(moe, expert_ffn=20000)
    assert chunk_activation_bytes(types.SimpleNamespace(**{**vars(args), "blocks": (wider,)}), 512) > base
    shared = dataclasses.replace(moe, shared_expert=True, shared_ffn=20000)
    assert chunk_activation_bytes(types.SimpleNamespace(**{**vars(args), "blocks": (shared,)}), 512) > base
