"""Fuzzing the native boundary (ktquest._C, every entry point of cpp/python/): sizes, dtypes and values drawn by
hypothesis, each case a valid call with up to two things changed (a size of 0, -1 or 2**62, another dtype, a
shape off by one, a strided view, NaN / inf values, a NaN scale, ...). The contract: a call succeeds or raises
one of the documented Python exceptions (ValueError, TypeError, IndexError, MemoryError, OverflowError) with
a message; never a signal, never a hang, never a runaway allocation (the child's peak RSS is bounded).

Each group of entry points runs in a child process (python this_file.py GROUP N): a signal kills the child,
not pytest, and the parent fails with the last case the child announced. One hypothesis loop per child, with
a fixed seed (derandomize) and no shrinking, so CI sees the same cases every run in a few seconds a group
(KTQ_FUZZ_SCALE=10 runs ten times as many).
tools/sanitize.sh runs this file under ASan + UBSan: the children inherit the sanitizers.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

ALLOWED = (ValueError, TypeError, IndexError, MemoryError, OverflowError)
GROUPS = {"sizes": 400, "kv_store": 300, "import": 300, "dense": 400, "gemv": 300, "decode": 200, "sample": 400}
TIMEOUT_S = 120  # a group takes seconds; a hang fails the test instead of blocking CI
PEAK_RSS_MIB = 1024  # a child stays near 60 MiB; a runaway allocation the OOM killer would not reach fails here


@pytest.mark.parametrize("group", list(GROUPS))
def test_native_entry_points_never_crash(group):
    env = dict(os.environ, PYTHONHASHSEED="0")
    try:
        site = ["-S"] if sys.flags.no_site else []  # as this interpreter (tools/sanitize.sh runs python -S)
        n = max(1, round(GROUPS[group] * float(os.environ.get("KTQ_FUZZ_SCALE", "1"))))
        r = subprocess.run([sys.executable, *site, __file__, group, str(n)], capture_output=True,
                           text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{group}: no result after {TIMEOUT_S} s (a hang?); last output:\n{(e.stderr or '')[-3000:]}")
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
        pytest.fail(f"{group}: the child ended with {how}; last output:\n{r.stderr[-6000:]}")
    assert f"fuzz {group}: " in r.stdout, r.stdout[-2000:]
    rss = int(r.stdout.rsplit("peak RSS ", 1)[1].split()[0])
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan's shadow memory and quarantine count as RSS
        assert rss <= PEAK_RSS_MIB, f"{group}: the child's peak RSS was {rss} MiB"


# ---- the child: one hypothesis loop over a group of entry points ----


def _child(group: str, n_examples: int) -> None:
    import gguf
    import numpy as np
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from ktquest import _C

    calls = {"ok": 0, "refused": 0}
    F32, I32, I64 = np.float32, np.int32, np.int64
    SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e38, -1e38, 65520.0, 1e-45]
    EDGE_INTS = [0, -1, -(2**31), 2**31 - 1, 2**31, 2**62, 2**63 - 1, -(2**63)]
    OTHER_DTYPES = [np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_]

    def describe(v) -> str:
        if isinstance(v, np.ndarray):
            flags = "" if v.flags.c_contiguous else " strided"
            return f"array{list(v.shape)} {v.dtype}{flags}"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(describe(x) for x in v) + ")"
        return repr(v)

    def call(name: str, fn, *args) -> object:
        """Announce the case (a crash then names it), run it, and hold the contract."""
        print(f"{name}({', '.join(map(describe, args))})", file=sys.stderr, flush=True)
        try:
            out = fn(*args)
        except ALLOWED as e:
            assert str(e), f"{name}: {type(e).__name__} without a message"
            calls["refused"] += 1
            return None
        calls["ok"] += 1
        return out

    def values(data, shape, dtype=F32) -> np.ndarray:
        """Random values of a shape, sometimes with special ones (NaN, inf, huge, fp16's overflow) inside."""
        n = int(np.prod(shape)) if len(shape) else 1
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
        if np.issubdtype(dtype, np.integer):
            return rng.integers(-3, 40, size=shape).astype(dtype)
        x = (rng.standard_normal(n) * data.draw(st.sampled_from([1.0, 1e-3, 1e4]), label="scale")).astype(dtype)
        if n and data.draw(st.booleans(), label="special"):
            x[data.draw(st.integers(0, n - 1), label="at")] = data.draw(st.sampled_from(SPECIAL), label="value")
        return x.reshape(shape)

    def mutate(data, v):
        """One thing changed about an argument, as a careless or hostile caller would."""
        if isinstance(v, np.ndarray):
            how = data.draw(st.sampled_from(["dtype", "ndim", "shape", "strided", "empty", "readonly", "object"]),
                            label="mutation")
            if how == "dtype":
                return v.astype(data.draw(st.sampled_from(OTHER_DTYPES), label="dtype"))
            if how == "ndim":
                return v.reshape(v.shape + (1,)) if data.draw(st.booleans(), label="deeper") else np.zeros((), v.dtype)
            if how == "shape":
                if v.ndim == 0:
                    return v.reshape(1)
                ax = data.draw(st.integers(0, v.ndim - 1), label="axis")
                grow = data.draw(st.booleans(), label="grow")
                pad = [(0, 0)] * v.ndim
                if grow:
                    pad[ax] = (0, 1)
                    return np.pad(v, pad)
                return np.ascontiguousarray(np.take(v, range(max(v.shape[ax] - 1, 0)), axis=ax))
            if how == "strided":
                if v.ndim == 0:
                    return v
                w = np.repeat(v, 2, axis=v.ndim - 1)
                return w[..., ::2]
            if how == "empty":
                return np.zeros((0,) + v.shape[1:], v.dtype)
            if how == "readonly":
                w = v.copy()
                w.flags.writeable = False
                return w
            return data.draw(st.sampled_from([None, "not an array", [1.0, 2.0], 3]), label="object")
        if isinstance(v, bool):
            return not v
        if isinstance(v, int):
            return data.draw(st.sampled_from(EDGE_INTS + [v + 1, v - 1, v * 2]), label="int")
        if isinstance(v, float):
            return data.draw(st.sampled_from(SPECIAL + [-v]), label="float")
        if isinstance(v, str):
            return data.draw(st.sampled_from(["", "bogus", v.lower(), v + "x"]), label="name")
        return v

    def maybe_mutate(data, args: list) -> list:
        """Up to two arguments changed (none in about a third of the cases: the valid call runs too)."""
        args = list(args)
        for _ in range(data.draw(st.sampled_from([0, 1, 1, 2]), label="n_mutations")):
            i = data.draw(st.integers(0, len(args) - 1), label="which")
            args[i] = mutate(data, args[i])
        return args

    def pick(data, label, valid, edges, odds=6):
        """Mostly a valid size, one time in odds + 1 an edge (0, -1, past int32, products past int64)."""
        if data.draw(st.sampled_from([False] * odds + [True]), label=label + ": edge?"):
            return data.draw(st.sampled_from(edges), label=label)
        return data.draw(valid, label=label)

    # ---- groups ----

    def sizes(data):
        """store_bytes / candidate_copy_bytes over wide integers (products that overflow), and the CPU switches."""
        ints = st.one_of(st.integers(-2, 70), st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**63 - 1))
        kv = data.draw(st.sampled_from(list(_C.KV_TYPES) + ["bogus"]), label="kv_type")
        an = data.draw(st.sampled_from(list(_C.ANCHOR_TYPES)), label="anchor_type")
        a = [data.draw(ints, label=f"size{i}") for i in range(5)]
        call("store_bytes", _C.store_bytes, a[0], a[1], a[2], a[3], a[4], kv, an, data.draw(ints, label="anum"))
        call("candidate_copy_bytes", _C.candidate_copy_bytes, a[0], a[1], a[2], a[4], kv, an,
             data.draw(st.booleans()), data.draw(ints, label="n_cand"),
             data.draw(st.sampled_from(list(_C.HEAD_MODES) + ["x"]), label="mode"))
        call("cpu_features", _C.cpu_features)
        call("use_avx2", _C.use_avx2)

    def new_store(data):
        cfg = [pick(data, "layers", st.integers(1, 3), [0, -1, 2**31 - 1]),
               pick(data, "kvh", st.integers(1, 3), [0, -1, 2**31 - 1]),
               pick(data, "D", st.sampled_from([8, 16, 32, 64]), [0, -1, 7, 2**16, 2**31 - 1]),
               pick(data, "max_seq_len", st.integers(1, 120), [0, 2**31, 2**62, 2**63 - 1], odds=3),
               pick(data, "block_size", st.sampled_from([1, 1, 2, 4, 7, 16]), [0, -1, 2**31 - 1]),
               data.draw(st.sampled_from(list(_C.KV_TYPES)), label="kv_type"),
               data.draw(st.sampled_from(list(_C.ANCHOR_TYPES)), label="anchor_type"),
               pick(data, "anchor_num", st.integers(1, 3), [0, -1, 2**31 - 1]),
               pick(data, "threads", st.integers(1, 3), [0, -1, 2**31 - 1])]
        cfg.append(cfg[6] in _C.LINEAR_ANCHORS and data.draw(st.booleans(), label="int8_candidates"))
        if isinstance(cfg[4], int) and cfg[4] > 0 and cfg[7] > cfg[4] and cfg[7] < 2**31 - 1:
            cfg[7] = cfg[4]  # FIXED/DYNAMIC: at most block_size anchors
        if data.draw(st.integers(0, 7), label="huge?") == 0:  # a capacity past the block ids at block size 1
            cfg[3], cfg[4] = data.draw(st.sampled_from([2**62, 2**63 - 1, 2**40]), label="huge"), 1
        cfg = maybe_mutate(data, cfg) if data.draw(st.booleans(), label="bad_config") else cfg
        return cfg, call("KVStore", _C.KVStore, *cfg)

    def kv_store(data):
        """A store built from a drawn config, then a drawn sequence of its operations, each maybe mutated."""
        cfg, s = new_store(data)
        if s is None:
            return
        L, KVH, D = cfg[0], cfg[1], cfg[2]
        if not (isinstance(KVH, int) and isinstance(D, int) and 0 < KVH * D <= 4096):
            return  # a store too wide to feed (its reservation and constructor were the case)
        mode_names = list(_C.HEAD_MODES)
        for _ in range(data.draw(st.integers(1, 12), label="n_ops")):
            op = data.draw(st.sampled_from(["append", "append", "append", "read", "read_range", "truncate", "anchors",
                                            "scores", "select", "attend", "select_attend", "decode_step", "plan",
                                            "misc"]), label="op")
            layer = data.draw(st.sampled_from([0, 0, L - 1, L, -1]), label="layer")
            G = data.draw(st.integers(1, 3), label="G")
            q = values(data, (KVH * G, D))
            nb = max(s.n_blocks(0), 1)
            mode = data.draw(st.sampled_from(mode_names), label="mode")
            n_sets = 1 if mode == "SHARED" else KVH
            k_per = np.full(n_sets, data.draw(st.integers(0, 4), label="k"), I32)
            excl = np.array([[0, data.draw(st.integers(0, nb), label="excl")]], I64)
            allowed = None if data.draw(st.booleans()) else np.tile(np.arange(min(nb, 3), dtype=I32), (n_sets, 1))
            out_ids = np.zeros((n_sets, 4), I32)
            out, lse = np.zeros((KVH * G, D), F32), np.zeros(KVH * G, F32)
            if op == "append":
                T = data.draw(st.integers(0, 9), label="T")
                dtype = data.draw(st.sampled_from(["float32", "float16", "bfloat16"]), label="in_dtype")
                arr = np.float32 if dtype == "float32" else np.int16
                kk = values(data, (T, KVH, D)).astype(arr) if arr is np.float32 else \
                    np.random.default_rng(T).integers(-20000, 20000, (T, KVH, D)).astype(np.int16)
                imp = None if data.draw(st.booleans()) else values(data, (T, KVH))
                call("append", s.append, *maybe_mutate(data, [layer, kk, kk.copy(), dtype, imp]))
            elif op == "read":
                call("read", s.read, *maybe_mutate(data, [layer]))
            elif op == "read_range":
                call("read_range", s.read_range, *maybe_mutate(data, [layer, data.draw(st.integers(-2, 12)),
                                                                      data.draw(st.integers(-2, 12))]))
            elif op == "truncate":
                call("truncate", s.truncate, *maybe_mutate(data, [layer, data.draw(st.integers(-2, 12))]))
            elif op == "anchors":
                call("read_anchors", s.read_anchors, layer)
            elif op == "scores":
                call("block_scores", s.block_scores, *maybe_mutate(data, [layer, q, mode]))
            elif op == "select":
                call("select", s.select, *maybe_mutate(data, [layer, q, mode, k_per, excl, allowed, out_ids]))
            elif op == "attend":
                blocks = np.tile(np.arange(min(nb, 2), dtype=I32), (1, 1))
                call("attend", s.attend, *maybe_mutate(data, [layer, q, blocks, out, lse]))
            elif op == "select_attend":
                call("select_attend", s.select_attend,
                     *maybe_mutate(data, [layer, q, mode, k_per, excl, allowed, out_ids, out, lse]))
            elif op in ("decode_step", "plan"):
                rows = data.draw(st.integers(1, 6), label="rows")
                wk, wv = values(data, (KVH, rows, D)), values(data, (KVH, rows, D))
                kind = data.draw(st.sampled_from(["none", "attend", "select"]), label="plan")
                if kind == "none":
                    plan = _C.StorePlan.none()
                elif kind == "attend":
                    plan = call("StorePlan.attend", _C.StorePlan.attend,
                                *maybe_mutate(data, [s, np.zeros((1, 1), I32)]))
                else:
                    plan = call("StorePlan.select", _C.StorePlan.select,
                                *maybe_mutate(data, [s, mode, k_per, excl, allowed, out_ids]))
                if plan is not None and op == "decode_step":
                    w0 = data.draw(st.integers(0, rows - 1), label="w0")
                    args = [layer, q, values(data, (KVH, D)), values(data, (KVH, D)), wk, wv, w0, rows, 0, 0,
                            data.draw(st.sampled_from([D ** -0.5, math.nan, 0.0]), label="scale"), 1, plan, out]
                    call("decode_step", s.decode_step, *maybe_mutate(data, args))
                elif plan is not None:
                    call("StorePlan.out_ids", lambda p: p.out_ids, plan)
            else:
                for name in ("length", "n_blocks"):
                    call(name, getattr(s, name), layer)
                call("nbytes", s.nbytes)
                call("reserved_bytes", s.reserved_bytes)
                call("cand_nbytes", s.cand_nbytes)
                call("last_timing", s.last_timing)

    def import_state(data):
        """A layer's state from untrusted bytes (KVStore.import_layer: KV files). A valid export of a small store
        (every kv_type and anchor type, with and without the index, filled and maybe cut back), then one field
        set to an edge (an anchor count or a DYNAMIC position: -1, 0, A, A + 1, the block's rows, 2**31 - 1, ...;
        a non-finite value in any region), random bytes, another length (0, 1, block_size +- 1, max_seq_len,
        max_seq_len + 1, 2**63 - 1, ...) or a wrong byte count; imported into a fresh store through the public
        API, then a drawn sequence of the operations that read the layer. The contract: the import is a
        ValueError with a message (the layer stays empty) or works, and every operation after it works."""
        import torch

        from ktquest.native.store import KVStore, Select

        kv = data.draw(st.sampled_from(list(_C.KV_TYPES)), label="kv_type")
        an = data.draw(st.sampled_from(list(_C.ANCHOR_TYPES)), label="anchor_type")
        bs = data.draw(st.sampled_from([1, 2, 4, 7, 8]), label="block_size")
        A = {"QUEST": 2, "BLOCK_MAX": 1, "BLOCK_MEAN": 1}.get(an) or \
            data.draw(st.integers(1, min(bs, 4)), label="A")
        KVH, D, G = data.draw(st.integers(1, 2), label="kvh"), 32, data.draw(st.integers(1, 2), label="G")
        cap = data.draw(st.integers(1, 40), label="max_seq_len")
        cfg = {"block_size": bs, "kv_type": kv, "anchor_type": an, "anchor_num": A,
               "int8_candidates": an in _C.LINEAR_ANCHORS and data.draw(st.booleans(), label="int8"),
               "index_group": data.draw(st.sampled_from([0, 1, 2, 3]), label="index_group"),
               "sticky_blocks": data.draw(st.sampled_from([0, 1]), label="sticky")}
        rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))

        def tokens(T):  # k, v [T, KVH, D], importance [T, KVH] (DYNAMIC)
            k = torch.from_numpy(rng.standard_normal((T, KVH, D)).astype(F32))
            imp = torch.from_numpy(rng.standard_normal((T, KVH)).astype(F32)) if an == "DYNAMIC" else None
            return k, k * 0.5, imp

        src = KVStore(1, KVH, D, cap, **cfg)
        T = data.draw(st.integers(0, cap), label="T")
        src.append(0, *tokens(T))
        if T and data.draw(st.booleans(), label="cut"):  # DYNAMIC then keeps fewer anchors than rows
            src.truncate(0, data.draw(st.integers(0, T), label="cut_to"))
        n, state = src.length(0), src.export_layer(0).copy()
        regions = {r: p for r, p in src.state_regions(n).items() if p[0][1] > 0}

        def put(region, value, dtype, index=None):  # value at an element of one head's piece of a region
            off, size = regions[region][data.draw(st.integers(0, KVH - 1), label="head")]
            item = np.dtype(dtype).itemsize
            i = data.draw(st.integers(0, size // item - 1), label="index") if index is None else index
            state[off + i * item: off + (i + 1) * item] = np.array([value], dtype).view(np.uint8)

        how = data.draw(st.sampled_from(["none", "count", "count", "pos", "value", "value", "bytes", "length",
                                         "size"]), label="mutation")
        length = n
        if how == "count" and "n_anchor" in regions or how == "pos" and "pos" in regions:
            b = data.draw(st.integers(0, src.n_blocks(0) - 1), label="block")
            rows = min(bs, n - b * bs)
            edge = data.draw(st.sampled_from([-1, 0, 1, A - 1, A, A + 1, rows - 1, rows, rows + 1, bs + 1,
                                              2**31 - 1, -(2**31)]), label="edge")
            j = data.draw(st.integers(0, A - 1), label="slot")
            put("pos" if how == "pos" else "n_anchor", edge, np.int32, b * A + j if how == "pos" else b)
        elif how == "value" and regions:
            region = data.draw(st.sampled_from(sorted(regions)), label="region")
            dtype = {"sums": np.float64, "bounds": np.float16, "n_anchor": np.int32, "pos": np.int32,
                     "anchors": np.float16 if src.anchor_elem_bytes == 2 else np.float32,
                     "kv": np.float16 if kv in ("FP16", "BF16") else np.float32}.get(region, np.float32)
            values = {np.int32: [-1, 2**31 - 1, -(2**31)], np.float16: [math.nan, math.inf, -math.inf, 65504.0]}
            value = data.draw(st.sampled_from(values.get(dtype, [math.nan, math.inf, -math.inf, 1e38, -0.0])),
                              label="value")
            put(region, value, dtype)
        elif how == "bytes" and state.size:
            for _ in range(data.draw(st.integers(1, 8), label="n_spots")):
                at = data.draw(st.integers(0, state.size - 1), label="at")
                state[at: at + 4] = rng.integers(0, 256, len(state[at: at + 4]), dtype=np.uint8)
        elif how == "length":
            length = data.draw(st.sampled_from([0, 1, bs - 1, bs, bs + 1, cap, cap + 1, n - 1, n + 1, 2**31 - 1,
                                                2**63 - 1]), label="length")
            if 0 <= length <= cap and data.draw(st.booleans(), label="resize"):  # the bytes of that length
                size = src.state_bytes(length)
                fill = rng.integers(0, 256, size, dtype=np.uint8) if data.draw(st.booleans(), label="noise") else \
                    np.zeros(size, np.uint8)
                fill[: min(size, state.size)] = state[:size]
                state = fill
        elif how == "size":
            state = data.draw(st.sampled_from([state[:-1], np.append(state, np.uint8(0)), state[:0],
                                               np.concatenate([state, state])]), label="size").copy()

        dst = KVStore(1, KVH, D, cap, **cfg)
        print(f"import_layer({how}: length {length}, {state.size} bytes, {kv} {an} A={A} bs={bs})",
              file=sys.stderr, flush=True)
        try:
            dst.import_layer(0, length, state)
            calls["ok"] += 1
            k, v = dst.read(0)  # what was taken is a store appends can make: finite rows, counts in [0, A]
            counts = dst.anchors(0)[1]
            assert bool(torch.isfinite(k).all() and torch.isfinite(v).all()), "non-finite rows imported"
            assert bool(((counts >= 0) & (counts <= A)).all()), f"anchor counts {counts.tolist()} imported"
        except ValueError as e:  # nothing else: the layer stays empty
            assert str(e) and dst.length(0) == 0, (e, dst.length(0))
            calls["refused"] += 1

        # ---- the operations that read the layer: each must work on what the import left ----
        modes = list(_C.HEAD_MODES)
        for _ in range(data.draw(st.integers(1, 6), label="n_ops")):
            op = data.draw(st.sampled_from(["scores", "select", "select_attend", "attend", "read", "truncate",
                                            "append", "decode"]), label="op")
            q = torch.from_numpy(rng.standard_normal((KVH * G, D)).astype(F32))
            mode = data.draw(st.sampled_from(modes), label="mode")
            nb, length = dst.n_blocks(0), dst.length(0)
            allowed = None
            if nb and data.draw(st.booleans(), label="candidates"):  # SnapKV's list: the candidate cache
                ids = list(range(0, nb, 2))
                allowed = ids if mode == "SHARED" else [ids] * KVH
            k = data.draw(st.integers(0, 3), label="k")
            rr = data.draw(st.sampled_from([1, 2, 16]), label="rerank")  # the second stage's width
            print(f"  {op} ({mode}, {length} tokens)", file=sys.stderr, flush=True)
            if op == "scores":
                dst.block_scores(0, q, mode)
                if cfg["index_group"]:
                    dst.group_bounds(0, q, mode)
                    dst.bounds(0)
            elif op == "select":
                dst.select(0, q, k, mode, allowed=allowed, rerank=rr)
            elif op == "select_attend":
                dst.select_attend(0, q, k, mode, allowed=allowed, rerank=rr)
            elif op == "attend":
                dst.attend(0, q, torch.arange(nb, dtype=torch.int32))
            elif op == "read":
                dst.read(0)
                dst.anchors(0)
            elif op == "truncate":
                dst.truncate(0, data.draw(st.integers(0, length), label="to"))
            elif length < cap and op == "append":
                dst.append(0, *tokens(data.draw(st.integers(1, cap - length), label="T")))
            elif length < cap:
                win = torch.from_numpy(rng.standard_normal((KVH, 3, D)).astype(F32))
                kv1, _, _ = tokens(2)
                dst.decode_step(0, q, kv1[0], kv1[1], win, win.clone(), 0, 3, (0, 0), D**-0.5, 1,
                                torch.empty(KVH * G, D), select=Select(k=2, mode=mode, allowed=allowed))

    def dense(data):
        KVH = pick(data, "kvh", st.integers(1, 4), [0], odds=20)
        G = pick(data, "G", st.integers(1, 4), [0], odds=20)
        D = pick(data, "D", st.sampled_from([1, 3, 8, 16, 64]), [0], odds=20)
        S = pick(data, "S", st.integers(1, 70), [0], odds=20)
        n = pick(data, "n", st.integers(min(1, S), S), [0, -1, S + 1, 2**62], odds=20)
        skip0 = pick(data, "skip0", st.integers(0, max(n, 0)), [-1, 2**62], odds=20)
        skip1 = pick(data, "skip1", st.integers(min(skip0, max(n, 0)), max(n, 0)), [-1, 2**62], odds=20)
        if skip0 == 0 and skip1 == n and data.draw(st.booleans(), label="keep_a_row"):
            skip1 = skip0
        args = [values(data, (KVH * G, D)), values(data, (KVH, S, D)), values(data, (KVH, S, D)), n,
                pick(data, "scale", st.sampled_from([1.0, 0.125, -2.0, 0.0]), [math.nan, math.inf]),
                np.zeros((KVH * G, D), F32), np.zeros(KVH * G, F32), data.draw(st.integers(1, 3)), skip0, skip1]
        call("dense_decode_attention", _C.dense_decode_attention, *maybe_mutate(data, args))

    def gemv(data):
        T, out = data.draw(st.integers(0, 3), label="T"), data.draw(st.integers(0, 70), label="out")
        inp = 32 * data.draw(st.integers(0, 3), label="in/32")
        w = values(data, (out, inp))
        bias = None if data.draw(st.booleans()) else values(data, (out,))
        m = call("QuantMatrix", _C.QuantMatrix, *maybe_mutate(data, [[("F32", w.view(np.uint8))], bias,
                                                                      data.draw(st.booleans(), label="x16")]))
        if m is not None:
            args = [m, values(data, (T, inp)), np.zeros((T, out), F32), data.draw(st.integers(1, 3))]
            call("gemv_matrix", _C.gemv_matrix, *maybe_mutate(data, args))
        x = values(data, (data.draw(st.integers(0, 40), label="n"),))
        call("rms_norm", _C.rms_norm, *maybe_mutate(data, [x, values(data, x.shape), 1e-5, np.zeros_like(x)]))
        call("set_force_scalar", _C.set_force_scalar, data.draw(st.booleans(), label="scalar"))

    def q8(data, out, inp):  # a Q8_0 QuantMatrix (bias or not) of random values or ones
        w = values(data, (out, inp)) if data.draw(st.booleans()) else np.ones((out, inp), F32)
        raw = gguf.quants.quantize(np.nan_to_num(w, posinf=1.0, neginf=-1.0), gguf.GGMLQuantizationType.Q8_0)
        return _C.QuantMatrix([("Q8_0", raw)], None if data.draw(st.booleans()) else np.zeros(out, F32))

    def decode(data):
        """DecodeLayer (its weights' shapes), its stages, and a whole token through a store."""
        KVH, G = data.draw(st.integers(1, 2), label="kvh"), data.draw(st.integers(1, 2), label="G")
        D = data.draw(st.sampled_from([32, 64]), label="D")  # H * D: whole Q8_0 groups
        H, dim, ffn = KVH * G, 32, 32
        norm = np.ones(dim, F32)
        weights = [q8(data, (H + 2 * KVH) * D, dim), q8(data, dim, H * D), q8(data, 2 * ffn, dim), q8(data, dim, ffn)]
        args = [norm, norm.copy(), 1e-5, *weights, H, KVH, D]
        if data.draw(st.booleans(), label="bad_layer"):
            i = data.draw(st.integers(0, len(args) - 1), label="which")
            if 3 <= i <= 6:  # a weight: another shape's matrix (a wrong [out, in]) or not a matrix at all
                args[i] = data.draw(st.sampled_from([weights[(i - 2) % 4], None, np.zeros(1, F32)]), label="w")
            else:
                args[i] = mutate(data, args[i])
        layer = call("DecodeLayer", _C.DecodeLayer, *args)
        if layer is None:
            return
        x = values(data, (dim,))
        cs, sn = values(data, (D,)), values(data, (D,))
        qkv = np.zeros((H + 2 * KVH) * D, F32)
        call("DecodeLayer.qkv", layer.qkv, *maybe_mutate(data, [x, cs, sn, qkv, 1]))
        call("DecodeLayer.out", layer.out, *maybe_mutate(data, [np.zeros(H * D, F32), x.copy(), 1]))
        n_layers, cap = data.draw(st.integers(1, 2), label="n_layers"), data.draw(st.integers(1, 12), label="cap")
        s = _C.KVStore(n_layers, KVH, D, cap, 4, data.draw(st.sampled_from(["FP32", "FP16", "Q8_0"])), "QUEST", 2, 1)
        for _ in range(data.draw(st.integers(0, 3), label="pre")):
            kk = values(data, (4, KVH, D))
            for li in range(n_layers):
                call("append", s.append, li, kk, kk, "float32", None)
        rows = data.draw(st.integers(1, 5), label="rows")
        windows = [(np.zeros((KVH, rows, D), F32), np.zeros((KVH, rows, D), F32)) for _ in range(n_layers)]
        plan = _C.StorePlan.none() if s.n_blocks(0) == 0 or data.draw(st.booleans()) else \
            _C.StorePlan.attend(s, np.zeros((1, 1), I32))
        layers = [("store", k, v, plan) for k, v in windows]
        if data.draw(st.booleans(), label="dense_layer"):  # a dense layer beside the store's: one store layer short
            layers.append(("dense", *windows[0], data.draw(st.integers(-1, rows), label="row"), 0, 0))
        args = [[layer] * len(layers), x, cs[None], sn[None], np.zeros(len(layers), I32), layers,
                data.draw(st.sampled_from([0.25, math.nan])), 1, s, data.draw(st.integers(0, rows - 1), label="w0"),
                rows, 0, 0]
        call("decode_token", _C.decode_token, *maybe_mutate(data, args))

    def sample(data):
        """SampleParams from drawn knobs, then sample / sample_distribution on drawn logits and histories."""
        knobs = [pick(data, "top_k", st.integers(0, 64), [-1, 2**31, 2**62]),
                 data.draw(st.sampled_from([1.0, 0.9, 0.5, 0.0]), label="top_p"),
                 data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]), label="min_p"),
                 data.draw(st.sampled_from([0.0, 0.7, 1.0, 1e-6, 1e-30, 30.0]), label="temperature"),
                 data.draw(st.sampled_from([1.0, 1.1, 2.0]), label="repeat"),
                 data.draw(st.sampled_from([0.0, 0.5, -1.0]), label="frequency"),
                 data.draw(st.sampled_from([0.0, 0.5, -1.0]), label="presence")]
        params = call("SampleParams", _C.SampleParams, *maybe_mutate(data, knobs))
        if params is None:
            return
        V = pick(data, "V", st.integers(1, 300), [0, 1, 2])
        logits = values(data, (V,))
        if V > 1 and data.draw(st.booleans(), label="ties"):
            logits[: V // 2] = logits[0]
        recent = values(data, (data.draw(st.integers(0, 40), label="n_recent"),), I32)
        if len(recent) and data.draw(st.booleans(), label="bad_id"):
            recent[0] = data.draw(st.sampled_from([-1, V, 2**31 - 1]), label="id")
        u = data.draw(st.sampled_from([0.0, 0.5, 0.999999, 1.0, -0.1, math.nan]), label="u")
        args = maybe_mutate(data, [logits, recent, params, u])
        tok = call("sample", _C.sample, *args)
        assert tok is None or 0 <= tok < args[0].size, (tok, describe(args[0]))  # a token of the logits given
        call("sample_distribution", _C.sample_distribution, *maybe_mutate(data, [logits, recent, params]))

    groups = {"sizes": sizes, "kv_store": kv_store, "import": import_state, "dense": dense, "gemv": gemv,
              "decode": decode, "sample": sample}

    @settings(max_examples=n_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        groups[group](data)

    fuzz()
    # VmHWM: this process image's peak RSS (getrusage's ru_maxrss keeps the parent's across fork + exec)
    with open("/proc/self/status") as f:
        rss = next(int(s.split()[1]) for s in f if s.startswith("VmHWM:")) // 1024  # kB -> MiB
    print(f"fuzz {group}: {n_examples} examples, {calls['ok']} calls succeeded, {calls['refused']} refused, "
          f"peak RSS {rss} MiB")


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
