"""Dual chunk attention (models/dual_chunk.py, kv/dual_chunk_attention.py) against a reference written from the
paper's definition (An et al. 2024, "Training-Free Long-Context Scaling of Large Language Models", section 3:
intra-chunk, successive-chunk and inter-chunk position indices), with Qwen's deployed constants: a small chunk
(32, local 8: chunks of 24 positions) so every case is hit within a hundred tokens."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_SPECS, build_hf_model, gguf_metadata, hf_to_gguf_tensors, write_gguf

from ktquest.generate import decode_one_token
from ktquest.kv.dense import DenseKVCache
from ktquest.models.dual_chunk import DualChunk
from ktquest.models.llama import Transformer
from ktquest.models.loader import load_model
from ktquest.models.rope import apply_rope, rope_tables
from ktquest.native.decode import NativeDecoder

C, W = 32, 8  # chunk_size, local_size: chunks of L = 24 positions
DC = DualChunk(C, W)


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, heads, D] rotated rotate-half style, row n by the angle of position pos[n] (float64)."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [N, D/2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: float, chunk: int, local: int,
              temper: bool = True) -> torch.Tensor:
    """Causal attention of unrotated q [N, H, D] over k, v [N, KVH, D] at positions 0..N-1, each (query, key) pair
    scored at the position indices the paper gives it (s = chunk - local positions a chunk):

        key j:                      P_k = j mod s
        query i, key in its chunk:  P_q = i mod s                           (intra)
        the chunk before:           P_q = s + i mod s for i mod s < local,  (successive)
                                          else chunk (Qwen's; the paper c - 1)
        an earlier chunk:           P_q = chunk                             (inter)

    and the logits times max(1, 0.1 ln((i + 1) / chunk) + 1) with ``temper``. Row by row, float64."""
    n, h, d = q.shape
    g = h // k.shape[1]
    s = chunk - local
    out = torch.empty(n, h, d, dtype=torch.float64)
    pk = torch.arange(n) % s
    keys = rotate(k, pk, theta).repeat_interleave(g, 1)  # [N, H, D]
    for i in range(n):
        j = torch.arange(i + 1)
        ci, cj = i // s, j // s
        succ = s + i % s if i % s < local else chunk
        pq = torch.where(cj == ci, i % s, torch.where(cj == ci - 1, succ, chunk))  # [i + 1]
        qi = rotate(q[i].expand(i + 1, h, d), pq, theta)  # [i + 1, H, D]: query i at each key's index
        logits = (qi * keys[: i + 1]).sum(-1) / math.sqrt(d)  # [i + 1, H]
        if temper:
            logits = logits * max(1.0, 0.1 * math.log((i + 1) / chunk) + 1.0)
        p = logits.softmax(0)
        out[i] = torch.einsum("jh,jhd->hd", p, v[: i + 1].double().repeat_interleave(g, 1))
    return out


def model_rows(dc: DualChunk, theta: float, d: int, n: int):
    """The model's rope_rows over tables of positions 0..chunk_size (Transformer.rope_rows on a stand-in)."""
    args = SimpleNamespace(n_rot=d, head_dim=d, rope_theta=theta, rope_scaling=None, context_length=n)
    cos, sin = rope_tables(args, max(n, dc.chunk_size + 1), torch.float32, "cpu")
    stand_in = SimpleNamespace(dual_chunk=dc, rope_cos=cos[None], rope_sin=sin[None])
    return lambda start, t: Transformer.rope_rows(stand_in, 0, start, t)


@pytest.mark.parametrize("temper", [True, False])
def test_dense_dca_equals_the_papers_definition(temper):
    """Random q, k, v for 100 positions (GQA 4/2): chunked prefill (17, 7, 16, 25: across chunk edges, one chunk
    spanning two) then one query at a time (the decode kernel's three ranges), the model's rotations, against the
    reference row by row."""
    torch.manual_seed(0)
    n, h, kvh, d, theta = 100, 4, 2, 16, 10000.0
    dc = DualChunk(C, W, scale_logits=temper)
    q, k, v = torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    rows = model_rows(dc, theta, d, n)
    cache = DenseKVCache(1, kvh, d, n, dual_chunk=dc)
    got, start = [], 0
    for t in (17, 7, 16, 25) + (1,) * 35:
        c, s = rows(start, t)
        qv = torch.stack([apply_rope(q[start: start + t], c[i], s[i]) for i in (1, 2, 3)])
        got.append(cache.attend(0, qv, apply_rope(k[start: start + t], c[0], s[0]), v[start: start + t], start))
        start += t
    want = reference(q, k, v, theta, C, W, temper)
    torch.testing.assert_close(torch.cat(got).double(), want, atol=2e-5, rtol=2e-5)


def test_below_one_chunk_dca_is_plain_attention():
    """Every key in the query's chunk: the same as attention at the true positions, to the bit."""
    torch.manual_seed(1)
    n, h, kvh, d = 24, 4, 2, 16
    q, k, v = torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    rows = model_rows(DC, 1e4, d, 64)
    c, s = rows(0, n)
    plain = DenseKVCache(1, kvh, d, 64).attend(0, apply_rope(q, c[1], s[1]), apply_rope(k, c[0], s[0]), v, 0)
    qv = torch.stack([apply_rope(q, c[i], s[i]) for i in (1, 2, 3)])
    dca = DenseKVCache(1, kvh, d, 64, dual_chunk=DC).attend(0, qv, apply_rope(k, c[0], s[0]), v, 0)
    assert torch.equal(plain, dca)


# ---- a tiny qwen2 with DCA in its file ----


@pytest.fixture(scope="module")
def dca_model(tmp_path_factory, tiny_bpe):
    """Tiny qwen2 whose file carries dual chunk keys (chunk 32, local 8), and the same weights without them."""
    spec = TINY_SPECS["qwen2"]
    hf = build_hf_model(spec, len(tiny_bpe.tokens))
    tensors, md = hf_to_gguf_tensors(hf, spec), gguf_metadata(spec, len(tiny_bpe.tokens))
    d = tmp_path_factory.mktemp("dca")
    keys = {"qwen2.dual_chunk_attention.chunk_size": C, "qwen2.dual_chunk_attention.local_size": W}
    return (write_gguf(d / "dca.gguf", "qwen2", md | keys, tensors, tiny_bpe),
            write_gguf(d / "plain.gguf", "qwen2", md, tensors, tiny_bpe))


class ReferenceCache:
    """A cache that answers the model's three query rotations by the reference's case rule, pair by pair: the
    query row the key's chunk relation picks (independent of kv/dual_chunk_attention.py's ranges and merges)."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor] = [torch.empty(0)] * n_layers
        self.v: list[torch.Tensor] = [torch.empty(0)] * n_layers
        self.pos = 0

    def attend(self, layer, qv, k, v, start):
        self.k[layer] = torch.cat([self.k[layer][:start], k]) if start else k
        self.v[layer] = torch.cat([self.v[layer][:start], v]) if start else v
        s, out = C - W, []
        keys, values = self.k[layer], self.v[layer]
        g = qv.shape[2] // keys.shape[1]
        for t in range(qv.shape[1]):
            i = start + t
            j = torch.arange(i + 1)
            variant = torch.where(j // s == i // s, 0, torch.where(j // s == i // s - 1, 1, 2))  # [i + 1]
            qrow = qv[variant, t]  # [i + 1, H, D]
            logits = (qrow * keys[: i + 1].repeat_interleave(g, 1)).sum(-1) / math.sqrt(qv.shape[-1])
            out.append(torch.einsum("jh,jhd->hd", logits.softmax(0), values[: i + 1].repeat_interleave(g, 1)))
        if layer == len(self.k) - 1:
            self.pos = start + qv.shape[1]
        return torch.stack(out)


def test_the_model_with_dca_equals_the_reference(dca_model):
    """The tiny model's logits through chunked prefills and decode steps (the torch forward and the native
    decode step past the first chunk) against the same model over the reference cache in one pass."""
    model, _ = load_model(dca_model[0], max_seq_len=128, encoded=True)
    assert model.args.dual_chunk == DC
    tokens = torch.arange(3, 93) * 7 % 250  # 90 tokens: positions in chunks 0-3
    with torch.inference_mode():
        want = model(tokens, 0, ReferenceCache(model.args.n_layers))  # [90, V]
        cache = DenseKVCache(model.args.n_layers, model.args.n_kv_heads, model.args.head_dim, 128,
                             dual_chunk=model.args.dual_chunk)
        got = [model(tokens[:30], 0, cache), model(tokens[30:50], 30, cache)]
        got += [model(tokens[i: i + 1], i, cache) for i in range(50, 70)]
        model.decoder = NativeDecoder.build(model, threads=2)
        got += [decode_one_token(model, cache, int(tokens[i]))[None] for i in range(70, 90)]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_dca_off_and_short_caches_are_todays_model(dca_model):
    """The file without its keys, DCA turned off, and a cache that never leaves the first chunk: plain RoPE
    attention (the same logits, bit for bit); past the first chunk DCA changes them."""
    tokens = torch.arange(3, 43) * 5 % 250  # 40 tokens: past the first chunk of 24
    plain, _ = load_model(dca_model[1], max_seq_len=64)
    off, _ = load_model(dca_model[0], max_seq_len=64, dual_chunk=None)
    short, _ = load_model(dca_model[0], max_seq_len=24)
    on, _ = load_model(dca_model[0], max_seq_len=64)
    assert plain.args.dual_chunk is None and off.args.dual_chunk is None and short.args.dual_chunk is None

    def run(m, n):
        a = m.args
        cache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, dual_chunk=a.dual_chunk)
        with torch.inference_mode():
            return m(tokens[:n], 0, cache)

    assert torch.equal(run(off, 40), run(plain, 40)) and torch.equal(run(short, 24), run(plain, 24))
    assert torch.equal(run(on, 24), run(plain, 24))  # inside the first chunk
    assert not torch.allclose(run(on, 40)[30:], run(plain, 40)[30:], atol=1e-3)


# ---- the engine ----


def test_the_engine_turns_dca_on_for_its_file_and_says_so(dca_model, capsys, tmp_path):
    """A file with dual chunk keys: on by default (a line on stderr), its greedy reply the model's over a DCA
    cache; --set dual_chunk.mode=off: plain attention, said too; on for a file without the keys: a ConfigError
    naming them (long_context: test_dual_chunk_store.py). A KV file of the DCA session is refused by the one without, naming dual_chunk."""
    import ktquest
    from ktquest.config import ConfigError
    from ktquest.kv.files import KVFileError

    prompt = "tiny " * 40
    eng = ktquest.load(model=str(dca_model[0]), max_seq_len=128, threads=2, max_new_tokens=8)
    assert eng.args.dual_chunk == DC and "dual chunk attention: chunks of 24 positions" in capsys.readouterr().err
    reply = eng.generate(prompt)
    ids = eng.tokenizer.encode(prompt)
    assert len(ids) > 24  # the prompt leaves the first chunk
    model = eng.model
    cache = DenseKVCache(model.args.n_layers, model.args.n_kv_heads, model.args.head_dim, 128, dual_chunk=DC)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), 0, cache)[-1]
        out = [int(logits.argmax())]
        for _ in range(7):
            out.append(int(decode_one_token(model, cache, out[-1]).argmax()))
    assert reply == eng.tokenizer.decode(out)

    off = ktquest.load(model=str(dca_model[0]), max_seq_len=128, threads=2, **{"dual_chunk.mode": "off"})
    assert off.args.dual_chunk is None and "dual chunk attention off (dual_chunk.mode: off)" in capsys.readouterr().err
    eng.save_kv(tmp_path / "dca.kv")
    with pytest.raises(KVFileError, match="dual_chunk"):
        off.load_kv(tmp_path / "dca.kv")
    assert eng.load_kv(tmp_path / "dca.kv")[0] == eng.sequence.ids
    with pytest.raises(ConfigError, match="needs dual_chunk.chunk_size and dual_chunk.local_size"):
        ktquest.load(model=str(dca_model[1]), max_seq_len=128, **{"dual_chunk.mode": "on"})


def test_known_1m_files_and_bad_keys(tmp_path, tiny_bpe):
    """A qwen2 file of context 1,010,000 is one of Qwen's 1M releases (262144 / 8192); a context of 1,000,000 is
    not; dual chunk keys that are not integers, or a local size not below the chunk, are a GGUFError."""
    from ktquest.formats.gguf import GGUFError
    from ktquest.models.loader import read_gguf

    spec = TINY_SPECS["qwen2"]
    hf = build_hf_model(spec, len(tiny_bpe.tokens))
    tensors, md = hf_to_gguf_tensors(hf, spec), gguf_metadata(spec, len(tiny_bpe.tokens))

    def args(**keys):
        return read_gguf(write_gguf(tmp_path / "m.gguf", "qwen2", md | keys, tensors, tiny_bpe)).args

    assert args(**{"qwen2.context_length": 1_010_000}).dual_chunk == DualChunk(262_144, 8_192)
    assert args(**{"qwen2.context_length": 1_000_000}).dual_chunk is None
    with pytest.raises(GGUFError, match="local_size 32 must be in"):
        args(**{"qwen2.dual_chunk_attention.chunk_size": 32, "qwen2.dual_chunk_attention.local_size": 32})
    with pytest.raises(GGUFError, match="both must be integers"):
        args(**{"qwen2.dual_chunk_attention.chunk_size": 32.5, "qwen2.dual_chunk_attention.local_size": 8})


def test_dca_keeps_the_caches_rope_frequencies_and_skips_sliding_models(tmp_path, tiny_bpe):
    """The tables reach chunk_size for DCA's query positions, but their frequencies are the cache's: a LongRoPE
    model whose cache (60) is within its trained 64 keeps its short factors though chunk_size is 80. A model with
    sliding-window layers (gemma3) builds without DCA."""
    from conftest import GEMMA3_SPECS
    from tiny_glm_phi import GLM_PHI_SPECS, build_glm_phi, glm_phi_gguf_tensors, glm_phi_metadata

    spec = GLM_PHI_SPECS["phi3"]
    hf = build_glm_phi(spec, len(tiny_bpe.tokens))
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", glm_phi_metadata(spec), glm_phi_gguf_tensors(hf, spec), tiny_bpe)
    dca, _ = load_model(path, max_seq_len=60, dual_chunk=DualChunk(80, 40))
    plain, _ = load_model(path, max_seq_len=60)
    assert dca.args.dual_chunk is not None and dca.rope_cos.shape[1] == 81
    assert torch.equal(dca.rope_cos[:, :60], plain.rope_cos) and torch.equal(dca.rope_sin[:, :60], plain.rope_sin)

    g = GEMMA3_SPECS["gemma3"]
    hf = build_hf_model(g, len(tiny_bpe.tokens))
    gpath = write_gguf(tmp_path / "g.gguf", "gemma3", gguf_metadata(g, len(tiny_bpe.tokens)), hf_to_gguf_tensors(hf, g),
                       tiny_bpe)
    assert load_model(gpath, max_seq_len=128, dual_chunk=DC)[0].args.dual_chunk is None
