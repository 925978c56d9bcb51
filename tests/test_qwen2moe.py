"""qwen2moe (models/qwen2moe.py): tiny Hugging Face Qwen2-MoE models (q/k/v biases, a shared expert gated by a
sigmoid, top-k as trained or renormalized) written to GGUF, against transformers in dense mode and through the
native decode step; the native MoE FFN with a shared expert (cpp/moe/) against the torch one on both kernel
paths; files whose shared expert disagrees with its keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import write_gguf
from test_long_context import CONFIGS
from test_moe import (
    FP32_ATOL,
    FP32_RTOL,
    check_chunked_logits_match_hf,
    greedy,
    greedy_run,
    make_cache,
    prompt_ids,
)
from test_moe_native import DIM, FFN, check_native_ffn, experts
from tiny_gguf import QWEN2MOE_SPECS, build_hf_model, gguf_metadata, hf_to_gguf_tensors

from ktquest.formats.gguf import GGUFError
from ktquest.layers.linear import QuantWeight
from ktquest.models.ffn import MoEFeedForward, route
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model, read_gguf
from ktquest.native import moe
from ktquest.native.decode import NativeDecoder

VOCAB = 320  # the test tokenizer's


@pytest.fixture(scope="module")
def qwen2moe_models(tmp_path_factory, tiny_bpe):
    """name -> (GGUF path, HF Qwen2MoeForCausalLM), each written once."""
    directory = tmp_path_factory.mktemp("qwen2moe")
    made = {}
    for name, spec in QWEN2MOE_SPECS.items():
        hf = build_hf_model(spec, len(tiny_bpe.tokens))
        path = write_gguf(directory / f"{name}.gguf", spec.arch, gguf_metadata(spec, len(tiny_bpe.tokens)),
                          hf_to_gguf_tensors(hf, spec), tiny_bpe)
        made[name] = (path, hf)
    return made


@pytest.fixture(params=sorted(QWEN2MOE_SPECS))
def tiny_qwen2moe(request, qwen2moe_models):
    return qwen2moe_models[request.param]


# ---- the model against Hugging Face ----


def test_qwen2moe_blocks_from_the_file(qwen2moe_models):
    for name, spec in QWEN2MOE_SPECS.items():
        model, _ = load_model(qwen2moe_models[name][0])
        a = model.args
        assert a.arch == "qwen2moe" and not a.permuted_qk and a.head_dim == spec.hd
        assert all(b.ffn == "moe" and b.qkv_bias and not b.qk_norm and b.shared_expert
                   and (b.n_experts, b.n_experts_used, b.expert_ffn, b.norm_topk, b.shared_ffn)
                   == (spec.n_experts, spec.n_used, spec.expert_ffn, spec.norm_topk, spec.shared_ffn)
                   for b in a.blocks)
        assert model.layers[0].ffn.n_experts == spec.n_experts and model.layers[0].ffn.shared is not None


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
def test_qwen2moe_logits_match_hf(tiny_qwen2moe, encoded):
    """Prefill in uneven chunks, then decode steps, vs one HF forward."""
    check_chunked_logits_match_hf(*tiny_qwen2moe, encoded)


def hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        return hf.generate(prompt[None], max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
def test_qwen2moe_greedy_tokens_equal_hf(tiny_qwen2moe, encoded):
    path, hf = tiny_qwen2moe
    model, _ = load_model(path, encoded=encoded)
    prompt = prompt_ids(20, model.args.vocab_size, seed=5)
    assert greedy(model, prompt, 12) == hf_greedy(hf, prompt, 12)


def test_native_decode_runs_qwen2moe_blocks(tiny_qwen2moe):
    """The native step (biases, router, experts and the gated shared expert in place) against the torch blocks on
    the same encoded weights: the same greedy tokens as they and transformers, the logits within fp32 rounding."""
    path, hf = tiny_qwen2moe
    model, _ = load_model(path, encoded=True)
    prompt = prompt_ids(21, model.args.vocab_size, seed=7)
    runs = []
    for decoder in (TorchDecoder(model), NativeDecoder.build(model, threads=2)):
        model.decoder = decoder
        runs.append(greedy_run(model, make_cache(model, 64), prompt, 16))
    assert isinstance(model.decoder, NativeDecoder)
    assert runs[1][0] == runs[0][0] == hf_greedy(hf, prompt, 16)
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_the_engine_runs_qwen2moe(qwen2moe_models):
    """ktquest.load on the CPU takes the native decode step; the reply is the torch path's greedy continuation."""
    import ktquest

    path = qwen2moe_models["qwen2moe"][0]
    engine = ktquest.load(path, config=CONFIGS / "default.yaml", chunk_size=8, max_new_tokens=6, threads=1)
    assert isinstance(engine.model.decoder, NativeDecoder)
    prompt = "the cat sat on the mat; the dog sat on the log. " * 2
    text = engine.generate(prompt, max_new_tokens=6)
    model, _ = load_model(path, encoded=True)
    expected, _ = greedy_run(model, make_cache(model, 64), torch.tensor(engine.tokenizer.encode(prompt)), 6)
    assert text == engine.tokenizer.decode(expected)


# ---- the native MoE FFN with a shared expert ----

SHARED_FFN = 512  # twice an expert's width, as in the released models (5632 vs 1408: four times)


def make_shared_ffn(qtype: str, n: int, k: int, norm: bool, seed: int = 0):
    """(torch MoEFeedForward, native MoeFfn, weights) with a shared expert: the router and the shared gate in F32
    (as llama.cpp keeps them), the experts and the shared expert in `qtype`."""
    rng = np.random.default_rng(seed)
    router = QuantWeight(parts=(("F32", rng.standard_normal((n, DIM), dtype=np.float32).view(np.uint8)),),
                         in_features=DIM)
    gate, up = experts(qtype, n, FFN, DIM, seed + 1), experts(qtype, n, FFN, DIM, seed + 2)
    down = experts(qtype, n, DIM, FFN, seed + 3)
    (s_gate,), (s_up,) = experts(qtype, 1, SHARED_FFN, DIM, seed + 4), experts(qtype, 1, SHARED_FFN, DIM, seed + 5)
    (s_down,) = experts(qtype, 1, DIM, SHARED_FFN, seed + 6)
    s_vec = torch.from_numpy(0.1 * rng.standard_normal(DIM, dtype=np.float32))  # [dim]
    ref = MoEFeedForward(router, gate, up, down, k, norm, shared=(s_gate, s_up, s_down, s_vec))
    nat = moe.MoeFfn(ref.router.qm, [e.w_gate_up.qm for e in ref.experts], [e.w_down.qm for e in ref.experts], k,
                     norm, shared_gate_up=ref.shared.w_gate_up.qm, shared_down=ref.shared.w_down.qm,
                     shared_gate=s_vec.numpy())
    return ref, nat, (router, gate, up, down, (s_gate, s_up, s_down, s_vec))


def dequantized_reference(ws, k: int, norm: bool, x: torch.Tensor) -> torch.Tensor:
    """x [dim] -> the MoE FFN with its shared expert in float64 on the dequantized weights."""
    router, gate, up, down, (s_gate, s_up, s_down, s_vec) = ws
    x = x.double()

    def d(q: QuantWeight) -> torch.Tensor:
        return torch.from_numpy(q.dequantize()).double()

    def swiglu(g, u, dn):
        return d(dn) @ (torch.nn.functional.silu(d(g) @ x) * (d(u) @ x))

    weights, ids = route((x @ d(router).T)[None], k, norm)
    y = sum(w * swiglu(gate[e], up[e], down[e]) for w, e in zip(weights[0].tolist(), ids[0].tolist()))
    return y + torch.sigmoid(s_vec.double() @ x) * swiglu(s_gate, s_up, s_down)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n,k,norm", [(5, 2, False), (4, 3, True), (1, 1, False)],
                         ids=["2-of-5", "3-of-4-renorm", "1-of-1"])
def test_moe_ffn_with_a_shared_expert_matches_torch(force_scalar, qtype, n, k, norm):
    ref, nat, ws = make_shared_ffn(qtype, n, k, norm, seed=n * 10 + k)
    check_native_ffn(ref, nat, qtype, k, norm, lambda x: dequantized_reference(ws, k, norm, x))


def test_moe_ffn_with_a_shared_expert_is_the_same_for_any_thread_count():
    _, nat, _ = make_shared_ffn("Q4_K", 5, 2, False)
    x = np.random.default_rng(3).standard_normal(DIM, dtype=np.float32)
    outs = []
    for threads in (1, 2, 3, 8):
        y = np.empty(DIM, np.float32)
        nat.run(x, y, threads)
        outs.append(y)
    assert all(np.array_equal(y, outs[0]) for y in outs[1:])


def test_moe_ffn_checks_its_shared_expert():
    ref, _, _ = make_shared_ffn("Q8_0", 3, 2, False)
    gu, dn = [e.w_gate_up.qm for e in ref.experts], [e.w_down.qm for e in ref.experts]
    s_gu, s_dn = ref.shared.w_gate_up.qm, ref.shared.w_down.qm
    s_vec = ref.shared_gate.detach().numpy()
    with pytest.raises(ValueError, match="give shared_gate_up, shared_down and shared_gate, or none"):
        moe.MoeFfn(ref.router.qm, gu, dn, 2, False, shared_gate_up=s_gu, shared_down=s_dn)
    with pytest.raises(ValueError, match=r"shared expert: expected gate \| up \[2 \* ffn_s, 256\]"):
        moe.MoeFfn(ref.router.qm, gu, dn, 2, False, shared_gate_up=s_gu, shared_down=dn[0], shared_gate=s_vec)
    with pytest.raises(ValueError, match="shared_gate"):
        moe.MoeFfn(ref.router.qm, gu, dn, 2, False, shared_gate_up=s_gu, shared_down=s_dn, shared_gate=s_vec[:7])


# ---- files whose shared expert disagrees with its keys ----


def _parts(name: str = "qwen2moe"):
    spec = QWEN2MOE_SPECS[name]
    return spec.arch, gguf_metadata(spec, VOCAB), hf_to_gguf_tensors(build_hf_model(spec, VOCAB), spec)


def _assert_error(path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def test_shared_expert_of_the_wrong_shape(tmp_path):
    arch, md, tensors = _parts()
    md["qwen2moe.expert_shared_feed_forward_length"] = 80  # the tensors hold 96
    _assert_error(write_gguf(tmp_path / "width.gguf", arch, md, tensors, None),
                  "'blk.0.ffn_gate_shexp.weight'", "[96, 64]", "expected [80, 64]")
    arch, md, tensors = _parts()
    tensors["blk.1.ffn_down_shexp.weight"] = tensors["blk.1.ffn_down_shexp.weight"][:, :90]
    _assert_error(write_gguf(tmp_path / "down.gguf", arch, md, tensors, None),
                  "'blk.1.ffn_down_shexp.weight'", "[64, 90]", "expected [64, 96]")
    arch, md, tensors = _parts()
    tensors["blk.2.ffn_gate_inp_shexp.weight"] = tensors["blk.2.ffn_gate_inp_shexp.weight"][:63]
    _assert_error(write_gguf(tmp_path / "gate.gguf", arch, md, tensors, None),
                  "'blk.2.ffn_gate_inp_shexp.weight'", "[63]", "expected [64]")
    arch, md, tensors = _parts()
    del tensors["blk.1.ffn_up_shexp.weight"]
    _assert_error(write_gguf(tmp_path / "missing.gguf", arch, md, tensors, None),
                  "missing tensor 'blk.1.ffn_up_shexp.weight'")


def test_shared_gate_as_one_row_and_widths_from_the_tensors(tmp_path):
    """The shared gate as a [1, dim] matrix (an unsqueezed Linear(dim, 1), which llama.cpp reads too), and no width
    keys (the experts' and the shared expert's widths from their tensors): the same model."""
    arch, md, tensors = _parts()
    ref, _ = load_model(write_gguf(tmp_path / "ref.gguf", arch, md, tensors, None), max_seq_len=32)
    for i in range(QWEN2MOE_SPECS["qwen2moe"].n_layers):
        tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"] = tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"][None]
    del md["qwen2moe.expert_shared_feed_forward_length"], md["qwen2moe.expert_feed_forward_length"]
    path = write_gguf(tmp_path / "row.gguf", arch, md, tensors, None)
    tokens = prompt_ids(9, VOCAB)
    for encoded in (False, True):
        model, _ = load_model(path, max_seq_len=32, encoded=encoded)
        assert model.args.blocks[0].shared_ffn == 96 and model.args.blocks[0].expert_ffn == 48
        with torch.inference_mode():
            got = model(tokens, 0, make_cache(model, 32))
            expected = ref(tokens, 0, make_cache(ref, 32))
        torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
