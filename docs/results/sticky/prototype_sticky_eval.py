"""Prototype of sticky blocks (issue 31), kept as run on 2026-11-26: the native version is cpp/kvstore/sticky.cpp.
 Each layer/KV head forces the R blocks that took the most attention mass at the
last step, and their successors, into this step's selection (k - 2R fresh picks: the same budget)."""
import os, sys
sys.path.insert(0, "/work/main/tools")
import torch
import ktquest.kv.long_context as LC

R = int(os.environ.get("STICKY_R", "4"))
SUCC = int(os.environ.get("STICKY_SUCC", "1"))
BY = os.environ.get("STICKY_BY", "mass")
NEUTRAL = int(os.environ.get("STICKY_NEUTRAL", "1"))
orig_init = LC.LongContextCache.__init__
ORACLE = int(os.environ.get("ORACLE", "0"))
ORACLE_BLOCKS = []
if ORACLE:
    from ktquest.eval.tasks import make_sample
    from ktquest.formats.bundled import bundled_model_path
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf
    tok = Tokenizer.from_gguf_metadata(read_gguf(bundled_model_path()).metadata)
    smp = make_sample(tok, "passkey", int(os.environ["O_LEN"]), float(os.environ["O_DEPTH"]), 0, 0, os.environ["O_FILLER"])
    ids = tok.encode(smp.answer)
    t = smp.tokens
    for i in range(len(t) - len(ids) + 1):
        if t[i:i + len(ids)] == ids:
            ORACLE_BLOCKS = list(range(max(0, (i - 16) // 8), (i + len(ids) + 16) // 8 + 1)); break
    print("oracle blocks", ORACLE_BLOCKS, "answer", smp.answer, ids, file=sys.stderr)
    assert ORACLE_BLOCKS

def init(self, *a, **k):
    orig_init(self, *a, **k)
    self._native_decode = False
    self._forced, self._last_pos = {}, {}

def dc(self, layer, q, lb):
    qc = q[0].float().contiguous()
    blocks, select = self.planner.plan(layer, lb)
    if select is None:
        return self.store.attend(layer, qc, blocks, self._out, self._lse)
    pos = self.pos
    forced = self._forced.get(layer) if self._last_pos.get(layer) == pos - 1 else None
    if ORACLE:
        forced = [ORACLE_BLOCKS] * self.KVH
    self._last_pos[layer] = pos
    KVH, bs = self.KVH, self.bs
    k = select.k
    n_force = (len(forced[0]) if ORACLE else (2 * R if SUCC else R)) if (forced is not None and NEUTRAL) else 0
    ids = self.store.select(layer, qc, max(1, k - n_force), select.mode, select.exclude_ranges, select.allowed)
    if ids.dim() == 1:
        ids = ids[None].expand(KVH, -1)
    rows = []
    for h in range(KVH):
        s = set(int(x) for x in ids[h] if x >= 0)
        if forced is not None:
            s |= set(b for b in forced[h] if self.ib <= b < lb)
        rows.append(sorted(s))
    width = max(len(r) for r in rows)
    sel = torch.full((KVH, max(1, width)), -1, dtype=torch.int32)
    for h, r in enumerate(rows):
        sel[h, :len(r)] = torch.tensor(r, dtype=torch.int32)
    out, lse = self.store.attend(layer, qc, sel, self._out, self._lse)
    if R > 0 and BY == "score":  # the top R blocks by this step's anchor scores
        sc = self.store.block_scores(layer, qc, "SEPARATE")  # [KVH, nb]
        sc[:, : self.ib] = float("-inf")
        sc[:, lb:] = float("-inf")
        top = sc.topk(R, dim=1).indices.tolist()
        self._forced[layer] = [t + ([b + 1 for b in t] if SUCC else []) for t in top]
    elif R > 0:  # block masses among the attended store blocks, summed over the KV head's query heads
        K, _ = self.store.read_range(layer, 0, lb * bs)  # [T, KVH, D]
        G = qc.shape[0] // KVH
        new = []
        for h in range(KVH):
            r = torch.tensor(rows[h], dtype=torch.long)
            if len(r) == 0:
                new.append([]); continue
            tok = (r[:, None] * bs + torch.arange(bs)).reshape(-1)
            kk = K[tok, h]  # [n*bs, D]
            s = (qc[h * G:(h + 1) * G] @ kk.T) * self.scale  # [G, n*bs]
            m = torch.exp(s - lse[h * G:(h + 1) * G, None]).reshape(G, len(r), bs).sum((0, 2))
            top = r[m.topk(min(R, len(r))).indices].tolist()
            new.append(top + ([b + 1 for b in top] if SUCC else []))
        self._forced[layer] = new
    self.planner.record(layer, sel, lb)
    return out, lse

LC.LongContextCache.__init__ = init
LC.LongContextCache._decode_context = dc
import eval_longctx
sys.exit(eval_longctx.main(sys.argv[1:]))
