// ---- the KV store: storage, selection, attention, a layer's decode step, and its byte layout
// (cpp/kvstore/, cpp/select/, cpp/decode/layer_step.h) ----
#include <algorithm>
#include <string>

#include "common/checked.h"
#include "decode/layer_step.h"
#include "kvstore/cand_cache.h"
#include "kvstore/kv_store.h"
#include "kvstore/layout.h"
#include "python/args.h"
#include "python/bind.h"
#include "python/step_args.h"
#include "quant/qgroup.h"
#include "select/ada.h"

namespace ktq::python {

namespace {

// A store's config from the constructor's arguments (the names checked against the enums' tables).
StoreConfig store_config(int n_layers, int n_kv_heads, int head_dim, int64_t max_seq_len, int block_size,
                         const std::string& kv_type, const std::string& anchor_type, int anchor_num, int threads_num,
                         bool int8_candidates, int index_group, float quest_centre = 0.f, int sticky_blocks = 0) {
  StoreConfig c;
  c.n_layers = n_layers;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.max_seq_len = max_seq_len;
  c.block_size = block_size;
  c.kv_type = parse_enum<KVType>(kv_type, "kv_type", kKVTypeNames);
  c.anchor_type = parse_enum<AnchorType>(anchor_type, "anchor_type", kAnchorTypeNames);
  c.anchor_num = anchor_num;
  c.threads_num = threads_num;
  c.int8_candidates = int8_candidates;
  c.index_group = index_group;
  c.quest_centre = quest_centre;
  c.sticky_blocks = sticky_blocks;
  return c;
}

}  // namespace

void bind_kv_store(py::module_& m) {
  py::class_<KVStore>(m, "KVStore", "Blocked KV cache with anchors and sparse decode attention (see ktquest/native/store.py).")
      .def(py::init([](int n_layers, int n_kv_heads, int head_dim, int64_t max_seq_len, int block_size,
                       const std::string& kv_type, const std::string& anchor_type, int anchor_num, int threads_num,
                       bool int8_candidates, int index_group, float quest_centre, int sticky_blocks) {
             return new KVStore(store_config(n_layers, n_kv_heads, head_dim, max_seq_len, block_size, kv_type,
                                             anchor_type, anchor_num, threads_num, int8_candidates, index_group,
                                             quest_centre, sticky_blocks));
           }),
           py::arg("n_layers"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("max_seq_len"),
           py::arg("block_size"), py::arg("kv_type"), py::arg("anchor_type"), py::arg("anchor_num"),
           py::arg("threads_num"), py::arg("int8_candidates") = false, py::arg("index_group") = 0,
           py::arg("quest_centre") = 0.f, py::arg("sticky_blocks") = 0)
      .def_property_readonly("anchor_slots", &KVStore::anchor_slots)
      .def_property_readonly("anchor_elem_bytes", &KVStore::anchor_elem_bytes, "2 = fp16 anchors, 4 = fp32")
      .def("length", &KVStore::length, py::arg("layer"))
      .def("n_blocks", &KVStore::n_blocks, py::arg("layer"))
      .def("nbytes", &KVStore::nbytes)
      .def("reserved_bytes", &KVStore::reserved_bytes)
      .def("cand_nbytes", &KVStore::cand_nbytes)
      .def("cand_copies", &KVStore::cand_copies)
      .def("append", [](KVStore& st, int layer, const py::handle& k_obj, const py::handle& v_obj,
                        const std::string& dtype, const py::handle& imp_obj) {
        const int H = st.config().n_kv_heads, D = st.config().head_dim;
        InType in;
        py::array k, v;
        auto same = [&](auto tag) {
          using T = decltype(tag);
          auto ka = array_arg<T>(k_obj, "k", {-1, H, D});
          auto va = array_arg<T>(v_obj, "v", {ka.shape(0), H, D});
          k = ka, v = va;
        };
        if (dtype == "float32") in = InType::F32, same(float{});
        else if (dtype == "float16") in = InType::F16, same(int16_t{});  // raw fp16 bits
        else if (dtype == "bfloat16") in = InType::BF16, same(int16_t{});  // raw bf16 bits
        else throw py::value_error("k/v dtype '" + dtype + "' is not one of float32, float16, bfloat16");
        const int64_t T = k.shape(0);
        const float* imp = nullptr;
        py::array_t<float> ia;
        if (!imp_obj.is_none()) {
          ia = array_arg<float>(imp_obj, "importance", {T, H});
          imp = ia.data();
        }
        const void* kp = k.data();
        const void* vp = v.data();
        py::gil_scoped_release nogil;
        st.append(layer, kp, vp, in, T, imp);
      }, py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("dtype"), py::arg("importance"),
         "k, v: [T, KVH, D] (float32, or float16/bfloat16 as int16 bits named by dtype); importance [T, KVH] or None.")
      .def("read", [](const KVStore& st, int layer) {
        const int64_t H = st.config().n_kv_heads, D = st.config().head_dim;
        for (;;) {  // sized from length(), filled under the store's lock: again if the layer changed in between
          const int64_t T = st.length(layer);
          py::array_t<float> k({T, H, D}), v({T, H, D});
          float *kp = k.mutable_data(), *vp = v.mutable_data();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = st.read(layer, T, kp, vp);
          }
          if (done) return py::make_tuple(k, v);
        }
      }, py::arg("layer"), "Dequantised (k, v), each [length, KVH, D] fp32.")
      .def("read_range", [](const KVStore& st, int layer, int64_t t0, int64_t t1) {
        const int64_t H = st.config().n_kv_heads, D = st.config().head_dim;
        // The range is checked (again, under the lock) by the store: here only so that the output is sized
        // by what the layer holds, never by t1 - t0 alone.
        const int64_t len = st.length(layer);
        if (t0 < 0 || t0 > t1 || t1 > len)
          throw py::index_error("read_range: [" + std::to_string(t0) + ", " + std::to_string(t1) +
                                ") is not inside the " + std::to_string(len) + " tokens of layer " +
                                std::to_string(layer));
        const int64_t T = t1 - t0;
        py::array_t<float> k({T, H, D}), v({T, H, D});
        float *kp = k.mutable_data(), *vp = v.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.read_range(layer, t0, t1, kp, vp);
        }
        return py::make_tuple(k, v);
      }, py::arg("layer"), py::arg("t0"), py::arg("t1"), "Dequantised (k, v) of tokens [t0, t1), [t1 - t0, KVH, D].")
      .def("truncate", [](KVStore& st, int layer, int64_t n) {
        py::gil_scoped_release nogil;
        st.truncate(layer, n);
      }, py::arg("layer"), py::arg("n"), "Keep the first n tokens of a layer (-1 = all); partial-block anchors recomputed.")
      .def("read_anchors", [](const KVStore& st, int layer) {
        const int64_t H = st.config().n_kv_heads, D = st.config().head_dim, A = st.anchor_slots();
        for (;;) {  // as read
          const int64_t nb = st.n_blocks(layer);
          py::array_t<float> a({H, nb, A, D});
          py::array_t<int32_t> c({H, nb});
          float* ap = a.mutable_data();
          int32_t* cp = c.mutable_data();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = st.read_anchors(layer, nb, ap, cp);
          }
          if (done) return py::make_tuple(a, c);
        }
      }, py::arg("layer"), "(anchors [KVH, n_blocks, A, D] fp32, counts [KVH, n_blocks] int32).")
      .def("n_groups", &KVStore::n_groups, py::arg("layer"))
      .def("state_bytes", &KVStore::state_bytes, py::arg("length"),
           "Bytes of a layer's state (export_layer) when it holds `length` tokens.")
      .def("state_pieces", [](const KVStore& st, int64_t length) {
        py::list out;
        for (const KVStore::StatePiece& p : st.state_pieces(length))
          out.append(py::make_tuple(p.name, p.head, p.offset, p.bytes));
        return out;
      }, py::arg("length"), "[(region, kv head, offset, bytes)] of a layer's state of `length` tokens, in order.")
      .def("export_layer", [](const KVStore& st, int layer) {
        py::array_t<uint8_t> out(py::ssize_t(st.state_bytes(st.length(layer))));
        uint8_t* p = out.mutable_data();
        const size_t n = size_t(out.size());
        py::gil_scoped_release nogil;
        st.export_layer(layer, p, n);
        return out;
      }, py::arg("layer"), "The layer's state as bytes, uint8 [state_bytes(length(layer))].")
      .def("import_layer", [](KVStore& st, int layer, int64_t length, const py::handle& obj) {
        auto a = ndim_arg<uint8_t>(obj, "state", 1);
        const uint8_t* p = a.data();
        const size_t n = size_t(a.size());
        py::gil_scoped_release nogil;
        st.import_layer(layer, length, p, n);
      }, py::arg("layer"), py::arg("length"), py::arg("state"),
         "The layer becomes `length` tokens read from `state` (uint8 [state_bytes(length)], as export_layer gave).")
      .def("check_import", [](const KVStore& st, int layer, int64_t length, const py::handle& obj) {
        auto a = ndim_arg<uint8_t>(obj, "state", 1);
        const uint8_t* p = a.data();
        const size_t n = size_t(a.size());
        py::gil_scoped_release nogil;
        st.check_import(layer, length, p, n);
      }, py::arg("layer"), py::arg("length"), py::arg("state"),
         "ValueError unless import_layer would take `state` for `length` tokens (nothing changes).")
      .def("read_bounds", [](const KVStore& st, int layer) {
        const int64_t H = st.config().n_kv_heads, D = st.config().head_dim;
        for (;;) {  // as read
          const int64_t ng = st.n_groups(layer);
          py::array_t<float> b({H, ng, int64_t(2), D});
          float* bp = b.mutable_data();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = st.read_bounds(layer, ng, bp);
          }
          if (done) return b;
        }
      }, py::arg("layer"), "The index's group rows [KVH, n_groups, 2, D] as fp32 (kept as fp16 rounded outward): each group's min "
         "row, then max row.")
      .def("group_bounds", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode,
                              const py::handle& variants) {
        py::array_t<float> q;
        QueryVariants var;
        const int H = query_arg(st, q_obj, q, variants, var);
        const HeadMode hm = head_mode(mode);
        const float* qp = q.data();
        for (;;) {  // as read
          const int64_t ng = st.n_groups(layer);
          py::array_t<double> out({int64_t(hm == HeadMode::SHARED ? 1 : st.config().n_kv_heads), ng});
          double* op = out.mutable_data();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = st.group_bounds(layer, qp, H, hm, ng, op, var);
          }
          if (done) return out;
        }
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("variants") = py::none(),
         "The index's bound of every group [n_sets, n_groups] fp64: at least the fp32 score of any of its blocks.")
      .def("block_scores", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode,
                              const py::handle& variants) {
        py::array_t<float> q;
        QueryVariants var;
        const int H = query_arg(st, q_obj, q, variants, var);
        const HeadMode hm = head_mode(mode);
        const float* qp = q.data();
        for (;;) {  // as read
          const int64_t nb = st.n_blocks(layer);
          py::array_t<float> out({int64_t(hm == HeadMode::SHARED ? 1 : st.config().n_kv_heads), nb});
          float* op = out.mutable_data();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = st.block_scores(layer, qp, H, hm, nb, op, var);
          }
          if (done) return out;
        }
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("variants") = py::none(),
         "Unscaled block scores [n_sets, n_blocks]. variants: None, or dual chunk attention's block bounds "
         "(succ, intra) with q [3, H, D] (cpp/select/request.h QueryVariants); as in select, attend, select_attend.")
      .def("cache_candidates", [](KVStore& st, int layer, const std::string& mode, const py::handle& exclude,
                                  const py::handle& allowed) {
        SelectRequest r;
        r.mode = head_mode(mode);
        const int n_sets = r.mode == HeadMode::SHARED ? 1 : st.config().n_kv_heads;
        const auto ex = array_arg<int64_t>(exclude, "exclude", {-1, 2});
        const auto al = array_arg<int32_t>(allowed, "allowed", {n_sets, -1});
        r.exclude = ex.data();
        r.n_exclude = checked_int(ex.shape(0), "exclude rows");
        r.allowed = al.data();
        r.allowed_cols = checked_int(al.shape(1), "allowed columns");
        py::gil_scoped_release nogil;
        st.cache_candidates(layer, r);
      }, py::arg("layer"), py::arg("mode"), py::arg("exclude"), py::arg("allowed"),
         "The candidate list's copies made now, for the decode steps that pass the same list and exclusions.")
      .def("snapkv_scores", [](KVStore& st, int layer, const py::handle& q_obj, int64_t q_pos0, int64_t n_keys,
                               int64_t n_blocks, int pool, const std::string& merge, const py::handle& variants) {
        const int D = st.config().head_dim;
        SnapKVRequest r;
        if (!variants.is_none()) {
          const auto b = variants.cast<std::pair<int64_t, int64_t>>();
          r.var = QueryVariants{3, b.first, b.second};
        }
        // [W, H, D], or [3, W, H, D] with variants
        const auto q = r.var.n == 1 ? array_arg<float>(q_obj, "q", {-1, -1, D})
                                    : array_arg<float>(q_obj, "q", {3, -1, -1, D});
        if (merge != "mean" && merge != "max")
          throw py::value_error("snapkv_scores: merge='" + merge + "' is not allowed: 'mean' or 'max'");
        const int w_dim = r.var.n == 1 ? 0 : 1;
        r.q = q.data();
        r.W = checked_int(q.shape(w_dim), "q window");
        r.H = checked_int(q.shape(w_dim + 1), "q heads");
        r.q_pos0 = q_pos0, r.n_keys = n_keys, r.n_blocks = n_blocks, r.pool = pool, r.max_merge = merge == "max";
        if (n_blocks < 0 || n_blocks > st.max_blocks())
          throw py::value_error("snapkv_scores: n_blocks=" + std::to_string(n_blocks) + " is not allowed: 0.." +
                                std::to_string(st.max_blocks()));
        py::array_t<float> out({int64_t(st.config().n_kv_heads), n_blocks});
        float* op = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.snapkv_scores(layer, r, op);
        }
        return out;
      }, py::arg("layer"), py::arg("q"), py::arg("q_pos0"), py::arg("n_keys"), py::arg("n_blocks"), py::arg("pool"),
         py::arg("merge"), py::arg("variants") = py::none(),
         "SnapKV's block scores [KVH, n_blocks] of a prompt's last queries q [W, H, D]; variants: None, or dual "
         "chunk attention's token bounds (succ, intra) with q [3, W, H, D].")
      .def("select", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode, const py::handle& k,
                        const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                        const py::handle& ada, const py::handle& variants, int rerank) {
        py::array_t<float> q;
        QueryVariants var;
        const int H = query_arg(st, q_obj, q, variants, var);
        SelectArgs a;
        select_args(st, a, mode, k, exclude, allowed, out_ids, ada, rerank);
        const float* qp = q.data();
        int32_t* ip = a.out_ids.mutable_data();
        const int cols = checked_int(a.out_ids.shape(1), "out_ids columns");
        py::gil_scoped_release nogil;
        st.select(layer, qp, H, a.req, ip, cols, var);
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("k"), py::arg("exclude"), py::arg("allowed"),
         py::arg("out_ids"), py::arg("ada") = py::none(), py::arg("variants") = py::none(), py::arg("rerank") = 1,
         "ada: None, or (num, den): the sum of k split over the sets by Ada-KV with alpha = num / den "
         "(cpp/select/ada.h). rerank: the second stage's width (cpp/kvstore/rerank.h; 1 = the anchors' top k).")
      .def("attend", [](KVStore& st, int layer, const py::handle& q_obj, const py::handle& blocks_obj,
                        const py::handle& out_obj, const py::handle& lse_obj, const py::handle& block_lse_obj,
                        const py::handle& variants) {
        py::array_t<float> q;
        QueryVariants var;
        const int H = query_arg(st, q_obj, q, variants, var);
        auto blocks = array_arg<int32_t>(blocks_obj, "blocks", {-1, -1});
        auto out = array_arg<float>(out_obj, "out", {H, st.config().head_dim});
        auto lse = array_arg<float>(lse_obj, "lse", {H});
        if (!out.writeable() || !lse.writeable()) throw py::value_error("out/lse: must be writeable");
        const BlockSets b{blocks.data(), checked_int(blocks.shape(0), "blocks rows"),
                          checked_int(blocks.shape(1), "blocks columns")};
        py::array_t<float> block_lse;
        if (!block_lse_obj.is_none()) {
          const int KVH = st.config().n_kv_heads;
          block_lse = array_arg<float>(block_lse_obj, "block_lse", {KVH, b.cols, H / KVH});
          if (!block_lse.writeable()) throw py::value_error("block_lse: must be writeable");
        }
        const float* qp = q.data();
        float* op = out.mutable_data();
        float* lp = lse.mutable_data();
        float* bp = block_lse_obj.is_none() ? nullptr : block_lse.mutable_data();
        py::gil_scoped_release nogil;
        st.attend(layer, qp, H, b, op, lp, bp, var);
      }, py::arg("layer"), py::arg("q"), py::arg("blocks"), py::arg("out"), py::arg("lse"),
         py::arg("block_lse") = py::none(), py::arg("variants") = py::none(),
         "block_lse: None, or [KVH, blocks columns, G] fp32 for each block's own log-sum-exp per query head.")
      .def("select_attend", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode,
                               const py::handle& k, const py::handle& exclude, const py::handle& allowed,
                               const py::handle& out_ids, const py::handle& out_obj, const py::handle& lse_obj,
                               const py::handle& ada, const py::handle& variants, int rerank) {
        py::array_t<float> q;
        QueryVariants var;
        const int H = query_arg(st, q_obj, q, variants, var);
        SelectArgs a;
        select_args(st, a, mode, k, exclude, allowed, out_ids, ada, rerank);
        auto out = array_arg<float>(out_obj, "out", {H, st.config().head_dim});
        auto lse = array_arg<float>(lse_obj, "lse", {H});
        if (!out.writeable() || !lse.writeable()) throw py::value_error("out/lse: must be writeable");
        const float* qp = q.data();
        int32_t* ip = a.out_ids.mutable_data();
        const int cols = checked_int(a.out_ids.shape(1), "out_ids columns");
        float* op = out.mutable_data();
        float* lp = lse.mutable_data();
        py::gil_scoped_release nogil;
        st.select_attend(layer, qp, H, a.req, ip, cols, op, lp, var);
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("k"), py::arg("exclude"), py::arg("allowed"),
         py::arg("out_ids"), py::arg("out"), py::arg("lse"), py::arg("ada") = py::none(),
         py::arg("variants") = py::none(), py::arg("rerank") = 1)
      .def("decode_step", [](KVStore& st, int layer, const py::handle& q_obj, const py::handle& k_obj,
                             const py::handle& v_obj, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
                             int64_t width, int64_t skip0, int64_t skip1, float scale, int n_threads,
                             const StorePlan& plan, const py::handle& out_obj) {
        const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
        py::array_t<float> q;
        const int H = query_arg(st, q_obj, q);
        auto k = array_arg<float>(k_obj, "k", {KVH, D});
        auto v = array_arg<float>(v_obj, "v", {KVH, D});
        auto out = array_arg<float>(out_obj, "out", {H, D});
        if (!out.writeable()) throw py::value_error("out: must be writeable");
        StepArgs a;  // q, scale and k/v are checked by layer_step before it writes anything
        step_args(st, a, H, wk_obj, wv_obj, w0, width, skip0, skip1, n_threads, plan);
        const float *qp = q.data(), *kp = k.data(), *vp = v.data();
        float* op = out.mutable_data();
        py::gil_scoped_release nogil;
        layer_step(st, layer, qp, H, kp, vp, a.step, scale, n_threads, op);
      }, py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("win_k"), py::arg("win_v"),
         py::arg("w0"), py::arg("width"), py::arg("skip0"), py::arg("skip1"), py::arg("scale"), py::arg("n_threads"),
         py::arg("plan"), py::arg("out"),
         "One long_context decode step of a layer (cpp/decode/layer_step.h): k/v [KVH, D] written to row w0 of the "
         "window win_k/win_v [KVH, rows, D], window rows [0, width) but [skip0, skip1) attended densely, the store part "
         "attended sparsely, "
         "merged by LSE into out [H, D]; then k/v appended to the store. The store part is `plan` (a StorePlan: none, "
         "a fixed block list, or a selection into its out_ids).")
      .def("last_timing", [](const KVStore& st) {
        const StageTiming t = st.last_timing();
        return py::make_tuple(t.score_s, t.topk_s, t.attend_s, t.rerank_s);
      }, "(score_s, topk_s, attend_s, rerank_s) of the last select/attend call.")
      .def("last_index_stats", [](const KVStore& st) {
        const IndexStats s = st.last_index_stats();
        return py::make_tuple(s.groups, s.blocks_scored, s.candidates);
      }, "(group bounds, blocks scored, candidate blocks) of the last selection the selector ran, summed over "
         "its sets (a selection served by the candidate copy is not counted).")
      .def("set_walk_index", &KVStore::set_walk_index, py::arg("on"),
           "Selections walk the hierarchical index (True, the default) or scan every block as a store without "
           "one does (False): the same picks, for timing one against the other on one store.")
      .def("set_sticky_blocks", &KVStore::set_sticky_blocks, py::arg("R"),
           "sticky_blocks from now on (0..MAX_STICKY_BLOCKS); the blocks kept so far are dropped.");

  // ---- what C++ owns and tells Python: the enums' names, the store's byte layout ----
  m.attr("KV_TYPES") = names_tuple(kKVTypeNames);
  m.attr("Q8_GROUP") = kQGroup;  // values per fp32 scale in the store's Q8_0/Q4_0 rows
  m.attr("MAX_STICKY_BLOCKS") = kMaxStickyBlocks;  // StoreConfig::sticky_blocks at most
  m.attr("MAX_RERANK") = kMaxRerank;               // a selection's rerank at most
  m.attr("ANCHOR_TYPES") = names_tuple(kAnchorTypeNames);
  m.attr("HEAD_MODES") = names_tuple(kHeadModeNames);
  py::list linear;  // the anchor types whose block score is one dot product with an anchor row
  for (size_t i = 0; i < std::size(kAnchorTypeNames); ++i)
    if (linear_anchors(AnchorType(i))) linear.append(py::str(kAnchorTypeNames[i]));
  m.attr("LINEAR_ANCHORS") = py::tuple(linear);
  m.def("store_bytes", [](int n_layers, int n_kv_heads, int head_dim, int64_t max_seq_len, int block_size,
                          const std::string& kv_type, const std::string& anchor_type, int anchor_num, int index_group) {
    return store_bytes(store_config(n_layers, n_kv_heads, head_dim, max_seq_len, block_size, kv_type, anchor_type,
                                    anchor_num, 1, false, index_group));
  }, py::arg("n_layers"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("max_seq_len"), py::arg("block_size"),
     py::arg("kv_type"), py::arg("anchor_type"), py::arg("anchor_num"), py::arg("index_group") = 0,
     "Bytes a full KVStore of this config reserves (K, V, scales, anchors, anchor counts, BLOCK_MEAN sums, DYNAMIC "
     "importances and positions, the index's group bounds): the layout the store reserves its regions from "
     "(cpp/kvstore/layout.h).");
  m.def("ada_budgets", [](const py::handle& scores_obj, const py::handle& counts_obj, int64_t total, int64_t num,
                          int64_t den) {
    auto scores = array_arg<float>(scores_obj, "scores", {-1, -1});
    const int n_sets = checked_int(scores.shape(0), "scores rows");
    auto counts = array_arg<int64_t>(counts_obj, "counts", {n_sets});
    const int64_t N = scores.shape(1);
    std::vector<float> flat;  // set after set, each set's first counts[s] scores
    for (int s = 0; s < n_sets; ++s) {
      if (counts.data()[s] < 0 || counts.data()[s] > N)
        throw py::value_error("counts[" + std::to_string(s) + "] = " + std::to_string(counts.data()[s]) +
                              " must lie in [0, " + std::to_string(N) + "] (the scores' columns)");
      flat.insert(flat.end(), scores.data() + s * N, scores.data() + s * N + counts.data()[s]);
    }
    py::array_t<int32_t> out(n_sets);
    std::vector<float> scratch;
    ada_budgets(n_sets, counts.data(), flat.data(), total, num, den, out.mutable_data(), scratch);
    return out;
  }, py::arg("scores"), py::arg("counts"), py::arg("total"), py::arg("num"), py::arg("den"),
     "Ada-KV budgets (cpp/select/ada.h) of n_sets sets: set s's candidates score scores[s, :counts[s]] (fp32 "
     "[n_sets, N]); total blocks to split, alpha = num / den. int32 [n_sets].");
  m.def("candidate_copy_bytes", [](int n_layers, int n_kv_heads, int head_dim, int block_size,
                                   const std::string& kv_type, const std::string& anchor_type, bool int8_candidates,
                                   int64_t n_candidates, const std::string& head_mode_name) {
    if (n_candidates < 0) throw py::value_error("n_candidates must be >= 0, got " + std::to_string(n_candidates));
    const int64_t room = candidate_room(n_candidates);  // checked: OverflowError past int64
    // The anchor count and the capacity do not change a candidate's bytes: any valid value will do.
    const StoreConfig c = store_config(n_layers, n_kv_heads, head_dim, 1, block_size, kv_type, anchor_type, 1, 1,
                                       int8_candidates, 0);
    return candidate_copy_bytes(c, head_mode(head_mode_name), room);
  }, py::arg("n_layers"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("kv_type"),
     py::arg("anchor_type"), py::arg("int8_candidates"), py::arg("n_candidates"), py::arg("head_mode") = "SEPARATE",
     "Bytes of the store's candidate copies (cpp/kvstore/cand_cache.h) as built for n_candidates preselected blocks "
     "per set in every layer, with the room they keep for later blocks: anchor rows, their int8 scales, ids and K/V "
     "tiles, as a CandCache lays them out (0 for FIXED / DYNAMIC anchors, which are never cached). head_mode "
     "SHARED keeps one id list for all KV heads.");
}

}  // namespace ktq::python
