// ---- a block's decode stages and a whole token through every block, dense or store layers (cpp/decode/) ----
#include <memory>
#include <string>
#include <vector>

#include "common/finite.h"
#include "decode/decode_layer.h"
#include "decode/token_step.h"
#include "kvstore/kv_store.h"
#include "python/args.h"
#include "python/bind.h"
#include "python/py_moe.h"
#include "python/quant_matrix.h"
#include "python/step_args.h"

namespace ktq::python {

namespace {

// The Python object keeps the weight arrays alive; shapes are checked once here, at construction.
struct PyDecodeLayer {
  std::vector<py::object> keep;
  std::unique_ptr<DecodeLayer> layer;
};

// A matrix argument: a QuantMatrix of [out, in] (-1: any), kept alive by the layer.
const QuantMatrix& matrix_arg(PyDecodeLayer& L, const py::handle& obj, const char* name, int64_t out, int64_t in) {
  if (!py::isinstance<PyQuantMatrix>(obj))
    throw py::type_error(std::string(name) + ": expected a QuantMatrix, got " +
                         py::str(py::type::of(obj)).cast<std::string>());
  const QuantMatrix& m = obj.cast<const PyQuantMatrix&>().m;
  if ((out >= 0 && m.out != out) || m.in != in)
    throw py::value_error(std::string(name) + ": expected [" + (out >= 0 ? std::to_string(out) : "any") + ", " +
                          std::to_string(in) + "], got [" + std::to_string(m.out) + ", " + std::to_string(m.in) + "]");
  L.keep.push_back(py::reinterpret_borrow<py::object>(obj));
  return m;
}

// The layer's heads match the store's. index: the layer's place in a whole-token call, or -1.
void layer_check(const PyDecodeLayer& L, const KVStore& st, int index) {
  const DecodeLayerWeights& w = L.layer->weights();
  if (st.config().n_kv_heads != w.n_kv_heads || st.config().head_dim != w.head_dim)
    throw py::value_error("store: " + std::to_string(st.config().n_kv_heads) + " KV heads of dim " +
                          std::to_string(st.config().head_dim) + ", " +
                          (index < 0 ? std::string("the layer") : "layer " + std::to_string(index)) + " has " +
                          std::to_string(w.n_kv_heads) + " of dim " + std::to_string(w.head_dim));
}

// The blocks of a whole-token call: DecodeLayers of one dim and head_dim, one per layer plan (n of them).
std::vector<DecodeLayer*> block_args(const py::list& blocks_obj, int n_plans) {
  const int n = int(py::len(blocks_obj));
  if (n < 1 || n_plans != n)
    throw py::value_error("blocks and layers: expected one layer plan per block (at least one), got " +
                          std::to_string(n) + " and " + std::to_string(n_plans));
  std::vector<DecodeLayer*> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    if (!py::isinstance<PyDecodeLayer>(blocks_obj[i]))
      throw py::type_error("blocks[" + std::to_string(i) + "]: expected a DecodeLayer, got " +
                           py::str(py::type::of(blocks_obj[i])).cast<std::string>());
    out[size_t(i)] = blocks_obj[i].cast<PyDecodeLayer&>().layer.get();
    if (out[size_t(i)]->dim() != out[0]->dim() || out[size_t(i)]->weights().head_dim != out[0]->weights().head_dim)
      throw py::value_error("blocks[" + std::to_string(i) + "]: dim " + std::to_string(out[size_t(i)]->dim()) +
                            " and head_dim " + std::to_string(out[size_t(i)]->weights().head_dim) + ", block 0 has " +
                            std::to_string(out[0]->dim()) + " and " + std::to_string(out[0]->weights().head_dim));
  }
  return out;
}

// One sequence's token plan, checked: its layers (TokenLayer each) and store; the arrays they borrow stay here.
struct [[gnu::visibility("hidden")]] SeqArgs {
  std::vector<TokenLayer> layers;
  std::vector<StepArgs> args;            // the STORE layers' window arrays
  std::vector<py::array_t<float>> keep;  // the DENSE layers' arrays
  KVStore* st = nullptr;
};

void seq_args(SeqArgs& seq, const std::string& where, const py::list& blocks_obj,
              const std::vector<DecodeLayer*>& blocks, const py::array_t<int32_t>& rope, int64_t n_tables,
              const py::list& layers_obj, const py::object& store_obj, int64_t w0, int64_t width, int64_t skip0,
              int64_t skip1, int n_threads) {
  const int n = int(blocks.size()), D = blocks[0]->weights().head_dim;
  if (int(py::len(layers_obj)) != n)
    throw py::value_error(where + "layers: expected " + std::to_string(n) + " layer plans (one per block), got " +
                          std::to_string(py::len(layers_obj)));
  if (!store_obj.is_none() && !py::isinstance<KVStore>(store_obj))
    throw py::type_error(where + "store: expected a KVStore or None, got " +
                         py::str(py::type::of(store_obj)).cast<std::string>());
  KVStore* st = store_obj.is_none() ? nullptr : &store_obj.cast<KVStore&>();
  seq.st = st;
  seq.layers.assign(size_t(n), TokenLayer{});
  seq.args.assign(size_t(n), StepArgs{});
  int store_layers = 0;
  for (int i = 0; i < n; ++i) {  // every argument of every layer is checked before the first layer runs
    const std::string at = where + "layers[" + std::to_string(i) + "]";
    TokenLayer& L = seq.layers[size_t(i)];
    const DecodeLayerWeights& w = blocks[size_t(i)]->weights();
    L.rope = rope.data()[i];
    if (L.rope < 0 || L.rope >= n_tables)
      throw py::value_error("rope[" + std::to_string(i) + "]=" + std::to_string(L.rope) + ": expected a table "
                            "of cos/sin, 0.." + std::to_string(n_tables - 1));
    const py::handle o = layers_obj[i];
    const bool tuple = py::isinstance<py::tuple>(o) && py::len(o) >= 1 && py::isinstance<py::str>(o[py::int_(0)]);
    const std::string kind = tuple ? o[py::int_(0)].cast<std::string>() : "";
    if (kind == "dense" && py::len(o) == 6) {
      auto k = array_arg<float>(o[py::int_(1)], (at + ".k").c_str(), {w.n_kv_heads, -1, D});
      auto v = array_arg<float>(o[py::int_(2)], (at + ".v").c_str(), {w.n_kv_heads, k.shape(1), D});
      if (!k.writeable() || !v.writeable()) throw py::value_error(at + ": k/v must be writeable");
      const int64_t r = int_item(o, 3, at + ".w0"), a = int_item(o, 4, at + ".skip0"), b = int_item(o, 5, at + ".skip1");
      if (r < 0 || r >= k.shape(1) || a < 0 || b < a || b > r)
        throw py::value_error(at + ": row w0=" + std::to_string(r) + " and skip [" + std::to_string(a) + ", " +
                              std::to_string(b) + ") must satisfy 0 <= skip0 <= skip1 <= w0 < " +
                              std::to_string(k.shape(1)) + " (the buffer's rows)");
      L.kind = LayerKind::DENSE;
      L.dense = DenseStep{k.mutable_data(), v.mutable_data(), k.shape(1), r, a, b};
      seq.keep.push_back(k), seq.keep.push_back(v);
    } else if (kind == "store" && py::len(o) == 4) {
      if (st == nullptr) throw py::value_error(at + ": a store layer, but no store was given");
      if (store_layers >= st->config().n_layers)
        throw py::value_error(at + ": store layer " + std::to_string(store_layers) + ", the store has " +
                              std::to_string(st->config().n_layers));
      layer_check(blocks_obj[i].cast<const PyDecodeLayer&>(), *st, i);
      const py::handle p = o[py::int_(3)];
      if (!py::isinstance<StorePlan>(p))
        throw py::type_error(at + "[3]: expected a StorePlan, got " + py::str(py::type::of(p)).cast<std::string>());
      step_args(*st, seq.args[size_t(i)], w.n_heads, o[py::int_(1)], o[py::int_(2)], w0, width, skip0, skip1,
                n_threads, p.cast<const StorePlan&>());
      L.kind = LayerKind::STORE;
      L.store_layer = store_layers++;
      L.step = seq.args[size_t(i)].step;
    } else {
      throw py::value_error(at + ": expected ('dense', k, v, w0, skip0, skip1) or ('store', win_k, win_v, plan)");
    }
  }
  if (st != nullptr && store_layers != st->config().n_layers)
    throw py::value_error(where + "layers: " + std::to_string(store_layers) + " store layers, the store has " +
                          std::to_string(st->config().n_layers) + " (one per store layer)");
}

}  // namespace

void bind_decode(py::module_& m) {
  py::class_<PyDecodeLayer>(m, "DecodeLayer",
                            "One block's decode step around attention, on GGUF-encoded weights (cpp/decode/decode_layer.h).")
      .def(py::init([](const py::handle& attn_norm, const py::handle& ffn_norm, float eps, const py::handle& wqkv,
                       const py::handle& wo, const py::handle& w_gate_up, const py::handle& w_down, int n_heads,
                       int n_kv_heads, int head_dim, const py::handle& qkv_perm, const py::handle& q_norm,
                       const py::handle& k_norm, const py::handle& post_attn_norm, const py::handle& post_ffn_norm,
                       const std::string& ffn, const py::handle& moe) {
             const HeadShape hs = head_shape(n_heads, n_kv_heads, head_dim);  // ValueError / OverflowError
             auto L = std::make_unique<PyDecodeLayer>();
             auto an = array_arg<float>(attn_norm, "attn_norm", {-1});
             const int64_t dim = check_positive(an.shape(0), "attn_norm: dim");
             auto fn = array_arg<float>(ffn_norm, "ffn_norm", {dim});
             DecodeLayerWeights w;
             w.attn_norm = an.data();
             w.ffn_norm = fn.data();
             L->keep.push_back(an);
             L->keep.push_back(fn);
             w.eps = eps;
             w.wqkv = matrix_arg(*L, wqkv, "wqkv", hs.qkv, dim);
             w.wo = matrix_arg(*L, wo, "wo", dim, hs.attn);
             if (ffn == "moe") {  // the experts instead of one gated FFN
               if (!w_gate_up.is_none() || !w_down.is_none())
                 throw py::value_error("ffn='moe': w_gate_up and w_down must be None (the experts are in `moe`)");
               if (!py::isinstance<PyMoeFfn>(moe))
                 throw py::type_error("moe: expected a MoeFfn for ffn='moe', got " +
                                      py::str(py::type::of(moe)).cast<std::string>());
               w.moe = moe.cast<const PyMoeFfn&>().ffn->weights();
               L->keep.push_back(py::reinterpret_borrow<py::object>(moe));
             } else {
               if (!moe.is_none()) throw py::value_error("moe: only a block with ffn='moe' takes one");
               w.w_gate_up = matrix_arg(*L, w_gate_up, "w_gate_up", -1, dim);
               const int64_t two_ffn = w.w_gate_up.out;
               if (two_ffn % 2 != 0)
                 throw py::value_error("w_gate_up: expected 2 * ffn rows (gate | up), got " + std::to_string(two_ffn));
               w.w_down = matrix_arg(*L, w_down, "w_down", dim, two_ffn / 2);
             }
             if (!qkv_perm.is_none()) {
               auto p = array_arg<int32_t>(qkv_perm, "qkv_perm", {hs.qkv});
               w.qkv_perm.assign(p.data(), p.data() + hs.qkv);
             }
             // the optional norms: [D] for q/k heads, [dim] for the two outputs (None: absent)
             auto optional_norm = [&](const py::handle& obj, const char* name, int64_t n) -> const float* {
               if (obj.is_none()) return nullptr;
               auto a = array_arg<float>(obj, name, {n});
               L->keep.push_back(a);
               return a.data();
             };
             w.q_norm = optional_norm(q_norm, "q_norm", head_dim);
             w.k_norm = optional_norm(k_norm, "k_norm", head_dim);
             w.post_attn_norm = optional_norm(post_attn_norm, "post_attn_norm", dim);
             w.post_ffn_norm = optional_norm(post_ffn_norm, "post_ffn_norm", dim);
             if (ffn == "swiglu")
               w.ffn = FfnKind::SWIGLU;
             else if (ffn == "geglu")
               w.ffn = FfnKind::GEGLU;
             else if (ffn == "moe")
               w.ffn = FfnKind::MOE;
             else
               throw py::value_error("ffn='" + ffn + "' is not allowed: 'swiglu', 'geglu' or 'moe'");
             w.n_heads = n_heads;
             w.n_kv_heads = n_kv_heads;
             w.head_dim = head_dim;
             L->layer = std::make_unique<DecodeLayer>(w);
             return L;
           }),
           py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("eps"), py::arg("wqkv"), py::arg("wo"),
           py::arg("w_gate_up"), py::arg("w_down"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"),
           py::arg("qkv_perm") = py::none(), py::kw_only(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("post_attn_norm") = py::none(),
           py::arg("post_ffn_norm") = py::none(), py::arg("ffn") = "swiglu", py::arg("moe") = py::none())
      .def("qkv", [](PyDecodeLayer& L, const py::handle& x_obj, const py::handle& cos_obj, const py::handle& sin_obj,
                     const py::handle& out_obj, int n_threads) {
             const int64_t D = L.layer->weights().head_dim;
             auto x = array_arg<float>(x_obj, "x", {L.layer->dim()});
             auto c = array_arg<float>(cos_obj, "cos", {D});
             auto s = array_arg<float>(sin_obj, "sin", {D});
             auto o = array_arg<float>(out_obj, "out", {L.layer->qkv_size()});
             check_threads(n_threads);
             const float *xp = x.data(), *cp = c.data(), *sp = s.data();
             float* op = o.mutable_data();
             py::gil_scoped_release nogil;
             L.layer->qkv(xp, cp, sp, op, n_threads);
           }, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("n_threads"),
           "x [dim] -> out [(H + 2 KVH) * D]: RMSNorm, the qkv projection, RoPE on q and k.")
      .def("out", [](PyDecodeLayer& L, const py::handle& attn_obj, const py::handle& x_obj, int n_threads) {
             auto a = array_arg<float>(attn_obj, "attn", {L.layer->attn_size()});
             auto x = array_arg<float>(x_obj, "x", {L.layer->dim()});
             check_threads(n_threads);
             const float* ap = a.data();
             float* xp = x.mutable_data();
             py::gil_scoped_release nogil;
             L.layer->out(ap, xp, n_threads);
           }, py::arg("attn"), py::arg("x"), py::arg("n_threads"),
           "x [dim] += Wo attn [H * D] (post-attention-normed with sandwich norms), then x += the FFN (SwiGLU, "
           "GeGLU, or the routed experts of a MoeFfn) of RMSNorm(x) (post-FFN-normed likewise), in place.");

  m.def("rms_norm", [](const py::handle& x_obj, const py::handle& w_obj, float eps, const py::handle& out_obj) {
          auto x = array_arg<float>(x_obj, "x", {-1});
          auto w = array_arg<float>(w_obj, "w", {x.shape(0)});
          auto o = array_arg<float>(out_obj, "out", {x.shape(0)});
          if (!o.writeable()) throw py::value_error("out: must be writeable");
          if (!(eps >= 0.f)) throw py::value_error("eps must be >= 0, got " + std::to_string(eps));
          check_finite(eps, "eps");
          const float *xp = x.data(), *wp = w.data();
          float* op = o.mutable_data();
          py::gil_scoped_release nogil;
          rms_norm(xp, wp, x.shape(0), eps, op);
        }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out"),
        "out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] for x, w, out [n] fp32 (the decode stages' RMSNorm).");

  m.def("decode_token", [](const py::list& blocks_obj, const py::handle& x_obj, const py::handle& cos_obj,
                           const py::handle& sin_obj, const py::handle& rope_obj, const py::list& layers_obj,
                           float scale, int n_threads, const py::object& store_obj, int64_t w0, int64_t width,
                           int64_t skip0, int64_t skip1) {
          check_threads(n_threads);
          check_finite(scale, "scale");
          const std::vector<DecodeLayer*> blocks = block_args(blocks_obj, int(py::len(layers_obj)));
          const int n = int(blocks.size()), D = blocks[0]->weights().head_dim;
          auto x = array_arg<float>(x_obj, "x", {blocks[0]->dim()});
          auto c = array_arg<float>(cos_obj, "cos", {-1, D});
          auto s = array_arg<float>(sin_obj, "sin", {c.shape(0), D});
          auto rope = array_arg<int32_t>(rope_obj, "rope", {n});
          if (!x.writeable()) throw py::value_error("x: must be writeable");
          SeqArgs seq;
          seq_args(seq, "", blocks_obj, blocks, rope, c.shape(0), layers_obj, store_obj, w0, width, skip0, skip1,
                   n_threads);
          float* xp = x.mutable_data();
          const float *cp = c.data(), *sp = s.data();
          py::gil_scoped_release nogil;
          decode_token(blocks.data(), seq.layers.data(), n, seq.st, xp, cp, sp, scale, n_threads);
        }, py::arg("blocks"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rope"), py::arg("layers"),
        py::arg("scale"), py::arg("n_threads"), py::arg("store") = py::none(), py::arg("w0") = 0,
        py::arg("width") = 0, py::arg("skip0") = 0, py::arg("skip1") = 0,
        "A whole decode token through every block in one call (cpp/decode/token_step.h): block i makes q/k/v from x "
        "with RoPE row rope[i] of cos/sin [n_tables, D], attends as layers[i] says, and updates x in place: "
        "('dense', k, v, w0, skip0, skip1) writes k/v at row w0 of k/v [KVH, rows, D] and attends rows [0, w0] "
        "but [skip0, skip1); ('store', win_k, win_v, plan) is the next layer of `store`: its window rows [0, width) "
        "but [skip0, skip1) with the token at row w0, and the store part `plan` (a StorePlan). Every argument is "
        "checked first; all or nothing.");

  m.def("decode_tokens", [](const py::list& blocks_obj, const py::handle& x_obj, const py::handle& cos_obj,
                            const py::handle& sin_obj, const py::handle& rope_obj, const py::list& seqs_obj,
                            float scale, int n_threads) {
          check_threads(n_threads);
          check_finite(scale, "scale");
          const int S = int(py::len(seqs_obj));
          if (S < 1) throw py::value_error("seqs: expected one plan per sequence (at least one), got none");
          auto first = seqs_obj[0];
          if (!py::isinstance<py::tuple>(first) || py::len(first) != 7)
            throw py::value_error("seqs[0]: expected (layers, store, w0, width, skip0, skip1, None)");
          const std::vector<DecodeLayer*> blocks = block_args(blocks_obj, int(py::len(first[py::int_(0)])));
          const int n = int(blocks.size()), D = blocks[0]->weights().head_dim;
          auto x = array_arg<float>(x_obj, "x", {S, blocks[0]->dim()});
          auto c = array_arg<float>(cos_obj, "cos", {S, -1, D});
          auto s = array_arg<float>(sin_obj, "sin", {S, c.shape(1), D});
          auto rope = array_arg<int32_t>(rope_obj, "rope", {n});
          if (!x.writeable()) throw py::value_error("x: must be writeable");
          std::vector<SeqArgs> seqs(static_cast<size_t>(S));
          std::vector<SeqStep> steps(static_cast<size_t>(S));
          for (int k = 0; k < S; ++k) {
            const std::string at = "seqs[" + std::to_string(k) + "]";
            const py::handle o = seqs_obj[k];
            if (!py::isinstance<py::tuple>(o) || py::len(o) != 7 || !py::isinstance<py::list>(o[py::int_(0)]))
              throw py::value_error(at + ": expected (layers, store, w0, width, skip0, skip1, None)");
            seq_args(seqs[size_t(k)], at + ".", blocks_obj, blocks, rope, c.shape(1), o[py::int_(0)].cast<py::list>(),
                     py::reinterpret_borrow<py::object>(o[py::int_(1)]), int_item(o, 2, at + ".w0"),
                     int_item(o, 3, at + ".width"), int_item(o, 4, at + ".skip0"), int_item(o, 5, at + ".skip1"),
                     n_threads);
            for (int j = 0; j < k; ++j)  // (two tokens of one store in one step would write its rows twice)
              if (seqs[size_t(k)].st != nullptr && seqs[size_t(j)].st == seqs[size_t(k)].st)
                throw py::value_error(at + ": its store is seqs[" + std::to_string(j) + "]'s: one token a sequence");
            const int64_t off = int64_t(k) * c.shape(1) * D;
            steps[size_t(k)] = SeqStep{seqs[size_t(k)].layers.data(), seqs[size_t(k)].st, c.data() + off, s.data() + off};
          }
          float* xp = x.mutable_data();
          py::gil_scoped_release nogil;
          decode_tokens(blocks.data(), n, steps.data(), S, xp, scale, n_threads);
        }, py::arg("blocks"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rope"), py::arg("seqs"),
        py::arg("scale"), py::arg("n_threads"),
        "One token of each of S sequences through every block in one call, the weights read once for all of them "
        "(cpp/decode/token_step.h decode_tokens): x [S, dim] in place, cos/sin [S, n_tables, D] each token's RoPE "
        "rows, rope [n_layers]; seqs[s] = (layers, store, w0, width, skip0, skip1, None): sequence s's plan as "
        "decode_token takes it. Token s's x is what decode_token gives it alone. Every argument is checked first; "
        "all or nothing.");
}

}  // namespace ktq::python
