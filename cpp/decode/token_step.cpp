// A token's decode through every block (token_step.h).
#include "decode/token_step.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/dense_attn.h"
#include "common/finite.h"

namespace ktq {

namespace {

// A DENSE layer's attention: k/v of the token at row w0, then q over rows [0, w0] but the skipped stretch.
// qkv: [(H + 2 KVH) * D] rows q | k | v; attn: [H * D]; lse: [H] scratch.
void dense_step(const DecodeLayerWeights& w, const DenseStep& d, const float* qkv, float scale, int n_threads,
                float* attn, float* lse) {
  const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
  for (int h = 0; h < KVH; ++h) {  // k, v of KV head h at row w0
    std::memcpy(d.k + (h * d.rows + d.w0) * D, qkv + int64_t(H + h) * D, sizeof(float) * D);
    std::memcpy(d.v + (h * d.rows + d.w0) * D, qkv + int64_t(H + KVH + h) * D, sizeof(float) * D);
  }
  dense_decode_attention(qkv, H, KVH, D, d.k, d.v, d.rows * D, d.w0 + 1, scale, attn, lse, n_threads, d.skip0,
                         d.skip1);
}

}  // namespace

void decode_token(DecodeLayer* const* blocks, const TokenLayer* layers, int n_layers, KVStore* st, float* x,
                  const float* cos, const float* sin, float scale, int n_threads) {
  const SeqStep seq{layers, st, cos, sin};
  decode_tokens(blocks, n_layers, &seq, 1, x, scale, n_threads);
}

void decode_tokens(DecodeLayer* const* blocks, int n_layers, const SeqStep* seqs, int n_seqs, float* x, float scale,
                   int n_threads) {
  const int64_t dim = n_layers > 0 ? blocks[0]->dim() : 0;
  const size_t S = size_t(n_seqs);
  // x [S, dim], then per sequence and STORE layer its window rows at w0 before the token: [2, KVH, D] each
  thread_local std::vector<float> kept, buf;
  thread_local std::vector<int64_t> len;       // [S, n_layers]: the store layer's length before the token (STORE)
  thread_local std::vector<size_t> saved_at;   // [S, n_layers]: where a STORE layer's rows are kept
  thread_local std::vector<const float*> rope;  // [2, S]: each token's cos and sin row for the layer
  size_t room = S * size_t(dim);
  for (int i = 0; i < n_layers; ++i)
    for (size_t s = 0; s < S; ++s)
      if (seqs[s].layers[i].kind == LayerKind::STORE)
        room += size_t(2) * blocks[i]->weights().n_kv_heads * blocks[i]->weights().head_dim;
  kept.resize(room);
  len.assign(S * size_t(n_layers), 0);
  saved_at.assign(S * size_t(n_layers), 0);
  rope.resize(2 * S);
  std::memcpy(kept.data(), x, sizeof(float) * S * dim);
  // sequence s's layer i window rows at w0 (STORE): K (which 0) or V (1) of KV head h, in the buffer and as kept
  auto row = [&](size_t s, int i, int which, int h) {
    const WindowView& w = seqs[s].layers[i].step.win;
    return (which ? w.v : w.k) + (h * w.rows + w.w0) * blocks[i]->weights().head_dim;
  };
  auto saved = [&](size_t s, int i, int which, int h) {
    const int KVH = blocks[i]->weights().n_kv_heads, D = blocks[i]->weights().head_dim;
    return kept.data() + saved_at[s * n_layers + i] + (size_t(which) * KVH + h) * D;
  };
  int i = 0;
  try {
    size_t at = S * size_t(dim);
    for (; i < n_layers; ++i) {
      DecodeLayer& block = *blocks[i];
      const DecodeLayerWeights& w = block.weights();
      const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
      const int64_t nq = block.qkv_size(), na = block.attn_size();
      buf.resize(S * size_t(nq + na) + size_t(H));
      float *qkv = buf.data(), *attn = qkv + S * nq, *lse = attn + S * na;
      for (size_t s = 0; s < S; ++s) {
        const int r = seqs[s].layers[i].rope;
        rope[s] = seqs[s].cos + int64_t(r) * D, rope[S + s] = seqs[s].sin + int64_t(r) * D;
      }
      block.qkv(x, int64_t(S), rope.data(), rope.data() + S, qkv, n_threads);
      for (size_t s = 0; s < S; ++s)  // as the store would, before anything is written
        if (first_non_finite(qkv + s * nq, int64_t(H) * D) >= 0)
          throw std::invalid_argument("layer " + std::to_string(i) + (S > 1 ? " of sequence " + std::to_string(s) : "") +
                                      ": q is not finite (the layer's input overflowed?)");
      for (size_t s = 0; s < S; ++s) {  // each token attends its own sequence's cache
        const TokenLayer& L = seqs[s].layers[i];
        const float* q = qkv + s * nq;
        if (L.kind == LayerKind::DENSE) {
          dense_step(w, L.dense, q, scale, n_threads, attn + s * na, lse);
        } else {
          KVStore& st = *seqs[s].st;
          saved_at[s * n_layers + i] = at;
          at += size_t(2) * KVH * D;
          len[s * n_layers + i] = st.length(L.store_layer);
          for (int which = 0; which < 2; ++which)
            for (int h = 0; h < KVH; ++h) std::memcpy(saved(s, i, which, h), row(s, i, which, h), sizeof(float) * D);
          layer_step(st, L.store_layer, q, H, q + int64_t(H) * D, q + int64_t(H + KVH) * D, L.step, scale, n_threads,
                     attn + s * na);
        }
      }
      block.out(attn, x, int64_t(S), n_threads);
    }
  } catch (...) {
    for (size_t s = 0; s < S; ++s)
      for (int j = 0; j <= i && j < n_layers; ++j) {
        const TokenLayer& L = seqs[s].layers[j];
        if (L.kind != LayerKind::STORE || saved_at[s * n_layers + j] == 0) continue;  // (not reached at layer i)
        seqs[s].st->truncate(L.store_layer, len[s * n_layers + j]);
        const int KVH = blocks[j]->weights().n_kv_heads, D = blocks[j]->weights().head_dim;
        for (int which = 0; which < 2; ++which)
          for (int h = 0; h < KVH; ++h) std::memcpy(row(s, j, which, h), saved(s, j, which, h), sizeof(float) * D);
      }
    std::memcpy(x, kept.data(), sizeof(float) * S * dim);
    throw;
  }
}

}  // namespace ktq
