"""KV store (cpp/kvstore/, cpp/quant/kv_codec*): storage formats, incremental anchors, capacity, checked boundary.

The torch references below say what the store must hold: every stored row is the reference codec of the
appended row, and every block's anchors are computed from the stored (rounded) keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktquest import _C
from ktquest.native.store import KVStore

# ---- torch references ----


def ref_codec(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """What the store keeps for fp32 rows x [..., D] (D % 32 == 0 for Q types), dequantised to fp32."""
    if kv_type == "FP32":
        return x.clone()
    if kv_type == "FP16":
        return x.half().float()  # round-to-nearest-even
    if kv_type == "BF16":
        return x.bfloat16().float()
    g = x.reshape(*x.shape[:-1], -1, 32)
    if kv_type == "Q8_0":  # d = absmax / 127, q = round_half_even(x / d)
        d = g.abs().amax(-1, keepdim=True) / 127.0
        q = torch.where(d != 0, torch.round(g / d), torch.zeros_like(g)).clamp(-127, 127)
        return (d * q).reshape(x.shape)
    if kv_type == "Q4_0":  # max = the value of largest magnitude (first on ties), d = max / -8
        idx = g.abs().argmax(-1, keepdim=True)  # argmax returns the first maximal index
        d = torch.gather(g, -1, idx) / -8.0
        q = torch.where(d != 0, torch.round(g / d) + 8, torch.full_like(g, 8.0)).clamp(0, 15)
        return (d * (q - 8)).reshape(x.shape)
    raise ValueError(kv_type)


def fixed_positions(block_size: int, anchor_num: int) -> list[int]:
    return [j * block_size // anchor_num for j in range(anchor_num)]


def ref_anchor_lists(
    k: torch.Tensor,
    block_size: int,
    anchor_type: str,
    anchor_num: int,
    importance: torch.Tensor | None = None,
    kv_type: str = "FP32",
) -> list[list[torch.Tensor]]:
    """Per KV head, per block: the anchor rows [A_b, D] (as fp32) the store must hold. k: [T, KVH, D] stored keys.
    Over FP16 keys the linear anchors are kept as fp16: exact for QUEST / BLOCK_MAX (min and max of fp16 values),
    the nearest half of the fp32 mean for BLOCK_MEAN."""
    T, KVH, _ = k.shape
    half = kv_type == "FP16" and anchor_type in ("QUEST", "BLOCK_MAX", "BLOCK_MEAN")
    out = []
    for h in range(KVH):
        rows = []
        for b0 in range(0, T, block_size):
            kb = k[b0 : b0 + block_size, h].double()  # [n, D]
            if anchor_type == "QUEST":
                rows.append(torch.stack([kb.min(0).values, kb.max(0).values]).float())
            elif anchor_type == "BLOCK_MAX":
                rows.append(kb.max(0).values[None].float())
            elif anchor_type == "BLOCK_MEAN":  # fp64 sum and division, one rounding to fp32
                rows.append((kb.sum(0) / kb.shape[0]).float()[None])
            elif anchor_type == "FIXED":
                rows.append(
                    kb[[p for p in fixed_positions(block_size, anchor_num) if p < kb.shape[0]]].float()
                )
            elif anchor_type == "DYNAMIC":  # highest importance first, earlier token on ties
                imp = importance[b0 : b0 + block_size, h].tolist()
                order = sorted(range(len(imp)), key=lambda i: (-imp[i], i))[:anchor_num]
                rows.append(kb[sorted(order)].float())
            if half:
                rows[-1] = rows[-1].half().float()
        out.append(rows)
    return out


# ---- helpers ----


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def append_in_chunks(store: KVStore, layer: int, k, v, importance=None, chunks=(5, 1, 1, 37)):
    """A prefill in uneven chunks, then single decode tokens: the incremental paths all run."""
    t = 0
    for n in chunks:
        n = min(n, k.shape[0] - t)
        if n > 0:
            store.append(
                layer, k[t : t + n], v[t : t + n], None if importance is None else importance[t : t + n]
            )
        t += n
    mid = t + (k.shape[0] - t) // 2
    store.append(layer, k[t:mid], v[t:mid], None if importance is None else importance[t:mid])
    for i in range(mid, k.shape[0]):
        store.append(layer, k[i : i + 1], v[i : i + 1], None if importance is None else importance[i : i + 1])


def sorted_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows in a canonical order (DYNAMIC anchor slots are unordered)."""
    key = x.double() @ torch.linspace(1, 2, x.shape[-1], dtype=torch.float64)
    return x[torch.argsort(key)]


# ---- storage formats ----


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stored_rows_equal_reference_codec(force_scalar, kv_type, in_dtype):
    T, KVH, D = 83, 3, 64
    k = randn(T, KVH, D, seed=1, scale=2.0).to(in_dtype)
    v = randn(T, KVH, D, seed=2).to(in_dtype)
    k[3, 1, :32] = 0.0  # an all-zero group: scale 0
    k[4, 0, 5] = -k[4, 0].abs().max() - 1  # a negative group maximum (Q4_0 sign)
    store = KVStore(2, KVH, D, 100, block_size=16, kv_type=kv_type, threads_num=2)
    append_in_chunks(store, 1, k, v)
    ks, vs = store.read(1)
    assert store.length(1) == T and store.length(0) == 0
    torch.testing.assert_close(ks, ref_codec(k.float(), kv_type), rtol=0, atol=0)
    torch.testing.assert_close(vs, ref_codec(v.float(), kv_type), rtol=0, atol=0)


def test_fp16_rounding_is_bit_exact_on_edge_values(force_scalar):
    """Round-to-nearest-even incl. ties, subnormals and the largest finite halves, in both paths."""
    f16 = (
        torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    )  # all finite +
    lo, hi = f16[:-1].double(), f16[1:].double()
    mids = ((lo + hi) / 2).float()  # exact ties (representable in fp32)
    edge = torch.tensor([65504.0, 65519.99, -65519.99, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 1e-30, -0.0])
    x = torch.cat(
        [f16, -f16, mids, -mids, torch.nextafter(mids, torch.tensor(np.inf)), edge, randn(4096) * 1e3]
    )
    n = x.numel() // 64 * 64
    x = x[:n].reshape(-1, 1, 64)
    store = KVStore(1, 1, 64, x.shape[0], block_size=64, kv_type="FP16")
    store.append(0, x, x)
    ks, _ = store.read(0)
    assert torch.equal(ks.view(torch.int32), x.half().float().view(torch.int32))


@pytest.mark.parametrize("kv_type", ["FP16", "BF16", "Q8_0", "Q4_0"])
def test_scalar_and_avx2_store_the_same_bits(kv_type):
    T, KVH, D = 70, 2, 96
    k, v = randn(T, KVH, D, seed=3, scale=3.0), randn(T, KVH, D, seed=4)
    got = []
    for scalar in (False, True):
        _C.set_force_scalar(scalar)
        try:
            store = KVStore(1, KVH, D, T, block_size=16, kv_type=kv_type)
            store.append(0, k, v)
            got.append(store.read(0) + store.anchors(0))
        finally:
            _C.set_force_scalar(False)
    for a, b in zip(*got):
        assert torch.equal(a, b)


# ---- anchors ----


ANCHOR_CASES = [("QUEST", 2), ("BLOCK_MAX", 1), ("BLOCK_MEAN", 1), ("FIXED", 1), ("FIXED", 3), ("DYNAMIC", 4)]


@pytest.mark.parametrize(
    "anchor_type,anchor_num,block_size,T",
    [
        (a, n, bs, T)
        for a, n in ANCHOR_CASES
        for bs, T in [(1, 7), (16, 129), (64, 150), (128, 129)]
        if n <= bs
    ]
    + [("FIXED", 1, 1, 7), ("DYNAMIC", 1, 1, 7)],
)
def test_anchors_follow_appends(force_scalar, anchor_type, anchor_num, block_size, T):
    KVH, D = 2, 64
    k, v = randn(T, KVH, D, seed=5), randn(T, KVH, D, seed=6)
    imp = torch.randint(0, 4, (T, KVH), generator=torch.Generator().manual_seed(7)).float()  # many ties
    store = KVStore(
        1, KVH, D, T, block_size=block_size, kv_type="FP16", anchor_type=anchor_type, anchor_num=anchor_num
    )
    append_in_chunks(store, 0, k, v, imp if anchor_type == "DYNAMIC" else None)
    ks, _ = store.read(0)
    anchors, counts = store.anchors(0)
    nb = (T + block_size - 1) // block_size
    assert store.n_blocks(0) == nb and anchors.shape[:2] == (KVH, nb)
    ref = ref_anchor_lists(ks, block_size, anchor_type, anchor_num, imp, kv_type="FP16")
    for h in range(KVH):
        for b in range(nb):
            n = ref[h][b].shape[0]
            if anchor_type in ("FIXED", "DYNAMIC"):
                assert counts[h, b] == n
            got = anchors[h, b, :n]
            if anchor_type == "DYNAMIC":
                got, want = sorted_rows(got), sorted_rows(ref[h][b])
            else:
                want = ref[h][b]
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dynamic_tokens_without_importance_only_fill_free_slots():
    KVH, D, bs = 1, 32, 8
    k = randn(8, KVH, D, seed=8)
    store = KVStore(1, KVH, D, 64, block_size=bs, kv_type="FP32", anchor_type="DYNAMIC", anchor_num=2)
    store.append(0, k[:2], k[:2])  # no importance: fill the two slots
    store.append(0, k[2:4], k[2:4], torch.tensor([[5.0], [1.0]]))  # each evicts the later "no importance" one
    store.append(0, k[4:8], k[4:8])  # never evict
    a, c = store.anchors(0)
    assert c[0, 0] == 2
    torch.testing.assert_close(sorted_rows(a[0, 0]), sorted_rows(k[[2, 3], 0]), rtol=0, atol=0)


# ---- capacity and bytes ----


def test_capacity_is_a_clear_error_and_writes_nothing():
    KVH, D = 2, 32
    store = KVStore(2, KVH, D, 40, block_size=16, kv_type="Q8_0")
    k = randn(41, KVH, D)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        store.append(0, k, k)
    assert store.length(0) == 0
    store.append(0, k[:39], k[:39])
    with pytest.raises(ValueError, match="holds 39 tokens"):
        store.append(0, k[:2], k[:2])
    store.append(0, k[39:40], k[39:40])
    assert store.length(0) == 40
    torch.testing.assert_close(store.read(0)[0], ref_codec(k[:40], "Q8_0"), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kv_type,row_bytes,scale_bytes",
    [("FP32", 256, 0), ("FP16", 128, 0), ("BF16", 128, 0), ("Q8_0", 64, 8), ("Q4_0", 32, 8)],
)
def test_nbytes_counts_the_blocks_in_use(kv_type, row_bytes, scale_bytes):
    KVH, D, bs = 3, 64, 16
    store = KVStore(2, KVH, D, 1 << 20, block_size=bs, kv_type=kv_type, anchor_type="QUEST")
    assert store.nbytes() == 0
    assert store.reserved_bytes() >= 2 * 2 * KVH * (1 << 20) * row_bytes  # address space, not memory
    store.append(1, randn(17, KVH, D), randn(17, KVH, D))
    tile = -(-bs * (row_bytes + scale_bytes) // 64) * 64
    anchor_bytes = 2 if kv_type == "FP16" else 4  # QUEST anchors over FP16 keys are fp16
    assert store.anchor_elem_bytes == anchor_bytes
    per_block = 2 * tile + 2 * D * anchor_bytes + 4  # K, V tiles, QUEST min/max anchors, anchor count
    assert store.nbytes() == 2 * KVH * per_block


# ---- checked boundary ----


def test_constructor_rejects_bad_configs():
    with pytest.raises(ValueError, match="multiple of 32"):
        KVStore(1, 1, 48, 64, kv_type="Q4_0")
    with pytest.raises(ValueError, match="anchor_num"):
        KVStore(1, 1, 64, 64, block_size=4, anchor_type="FIXED", anchor_num=5)
    with pytest.raises(ValueError, match="kv_type"):
        KVStore(1, 1, 64, 64, kv_type="INT3")
    with pytest.raises(ValueError, match="block_size"):
        KVStore(1, 1, 64, 64, block_size=0)
    with pytest.raises(ValueError, match="anchor_type"):
        _C.KVStore(1, 1, 64, 64, 16, "FP16", "quest?", 2, 1)


def test_sizes_past_the_layout_are_refused_before_anything_is_reserved():
    """Every size of the store's layout is checked before it reserves memory (cpp/common/checked.h): a capacity
    past the int32 block ids, a product that overflows, an allocation that fails; each names the sizes."""
    with pytest.raises(ValueError, match=r"max_seq_len=4611686018427387904 in blocks of block_size=1 .*int32"):
        _C.KVStore(1, 1, 64, 1 << 62, 1, "FP16", "QUEST", 2, 1)  # reserved 0 bytes; an append then crashed
    with pytest.raises(ValueError, match="block ids are int32"):
        _C.store_bytes(1, 1, 64, 1 << 62, 1, "FP16", "QUEST", 2)
    with pytest.raises(OverflowError, match="anchors x head_dim"):  # A * D indexes an anchor row with int
        _C.store_bytes(1, 1, 1 << 20, 1 << 20, 1 << 20, "FP32", "FIXED", 1 << 20)
    with pytest.raises(OverflowError, match="overflows"):  # heads x blocks x tile bytes past 2**64
        _C.store_bytes(1, 1 << 30, 1 << 20, (1 << 31) - 1, 1, "FP32", "QUEST", 2)
    with pytest.raises(ValueError, match=r"n_layers must be in \[1, 4096\], got 2147483647"):  # bookkeeping per layer
        _C.KVStore(2**31 - 1, 1, 8, 16, 4, "FP32", "QUEST", 2, 1)
    with pytest.raises(OverflowError, match="candidate"):
        _C.candidate_copy_bytes(1, 1, 64, 1, "FP16", "QUEST", False, 1 << 62)
    # A layout that fits 64 bits but not the address space: MemoryError naming what was asked, not bad_alloc.
    need = _C.store_bytes(1, 1, 1 << 16, 1 << 30, 1 << 10, "FP32", "QUEST", 2)
    assert need > 1 << 48
    with pytest.raises(MemoryError, match=f"KVStore: reserving {need} bytes .*max_seq_len=1073741824"):
        _C.KVStore(1, 1, 1 << 16, 1 << 30, 1 << 10, "FP32", "QUEST", 2, 1)
    # The largest capacity the block ids allow is a store like any other: address space, filled on demand.
    st = KVStore(1, 1, 32, (1 << 31) - 1, block_size=1, kv_type="FP16")
    k = randn(3, 1, 32)
    st.append(0, k, k)
    torch.testing.assert_close(st.read(0)[0], k.half().float(), rtol=0, atol=0)


def test_reads_are_sized_under_the_store_lock():
    """read / anchors / block_scores / read_range while another thread appends: every result is the store at
    one moment (its outputs sized under the lock, never from an earlier length)."""
    import threading

    KVH, D, bs, T = 2, 32, 4, 400
    st = KVStore(1, KVH, D, T, block_size=bs, kv_type="FP32", anchor_type="BLOCK_MAX")
    k, q = randn(T, KVH, D, seed=1), randn(KVH, D, seed=2)
    done = threading.Event()

    def writer():
        for t in range(T):
            st.append(0, k[t : t + 1], k[t : t + 1])
        done.set()

    th = threading.Thread(target=writer)
    th.start()
    reads = 0
    while not done.is_set() or reads < 5:
        rk, rv = st.read(0)
        n = rk.shape[0]
        assert torch.equal(rk, k[:n]) and torch.equal(rv, k[:n])
        a, c = st.anchors(0)  # a: [KVH, nb, 1, D]; the last block may be partial (any of its prefixes)
        nb = a.shape[1]
        for b in range(nb):
            rows = range(1, bs + 1) if b == nb - 1 else [bs]
            assert any(torch.equal(a[:, b, 0], k[b * bs : b * bs + r].amax(0)) for r in rows), b
        assert st.block_scores(0, q).shape[1] >= nb
        reads += 1
    th.join()
    assert st.length(0) == T
    with pytest.raises(IndexError, match=r"read_range: \[0, 401\) is not inside the 400 tokens"):
        st.read_range(0, 0, T + 1)
    for t0, t1, step in [(0, T, 7), (5, 300, 64), (17, 17, 3), (0, T, 1 << 20)]:  # slabs that do not divide
        assert torch.equal(st.read_keys(0, t0, t1, step), st.read_range(0, t0, t1)[0])
    for t0, t1 in [(390, T + 1), (9, 3), (T + 5, T + 5), (0, 1 << 62)]:  # checked before anything is sized
        with pytest.raises(IndexError, match=rf"read_keys: \[{t0}, {t1}\) is not inside the 400 tokens"):
            st.read_keys(0, t0, t1, 4)
    with pytest.raises(ValueError, match="step"):
        st.read_keys(0, 0, 8, 0)
    with pytest.raises(IndexError, match="is not inside"):  # sized by what is stored, never by t1 - t0
        st.native.read_range(0, 0, (1 << 62))
    with pytest.raises(IndexError, match="is not inside"):
        st.native.read_range(0, -(1 << 62), 1)


def test_append_rejects_bad_input():
    KVH, D = 2, 32
    store = KVStore(2, KVH, D, 64, block_size=16, kv_type="FP16")
    k = randn(4, KVH, D)
    with pytest.raises(TypeError, match="dtype"):
        store.append(0, k.double(), k.double())
    with pytest.raises(TypeError, match="dtype"):
        store.append(0, k, k.half())
    with pytest.raises(ValueError, match="shape"):
        store.append(0, k[:, :1].contiguous(), k[:, :1].contiguous())
    with pytest.raises(ValueError, match="shape"):
        store.append(0, k, k[:3])
    with pytest.raises(ValueError, match="contiguous"):
        store.append(0, k.transpose(0, 1), k.transpose(0, 1))
    with pytest.raises(IndexError, match="layer 2"):
        store.append(2, k, k)
    with pytest.raises(IndexError, match="layer -1"):
        store.length(-1)
    for layer in (2, -2, 2**31 - 1):  # -1 alone means every layer (2**31 - 1 + 1 overflowed an int)
        with pytest.raises(IndexError, match=f"layer {layer} is out of range"):
            store.native.truncate(layer, 0)
    with pytest.raises(ValueError, match="importance"):
        store.append(0, k, k, torch.ones(4, KVH + 1))
    for bad in (float("nan"), float("inf")):
        kb = k.clone()
        kb[2, 1, 7] = bad
        with pytest.raises(ValueError, match="non-finite.*token 2, kv head 1"):
            store.append(0, kb, k)
        with pytest.raises(ValueError, match="non-finite"):
            store.append(0, k, kb)
    with pytest.raises(ValueError, match="overflows kv_type FP16"):
        store.append(0, k * 1e5, k)
    with pytest.raises(ValueError, match="importance contains a non-finite"):
        store.append(0, k, k, torch.full((4, KVH), float("nan")))
    assert store.length(0) == 0  # nothing was written by any failed call


def test_native_binding_checks_arrays_without_the_facade():
    st = _C.KVStore(1, 2, 32, 64, 16, "FP32", "QUEST", 2, 1)
    k = np.zeros((3, 2, 32), np.float32)
    with pytest.raises(TypeError, match="dtype"):
        st.append(0, k.astype(np.float64), k, "float32", None)
    with pytest.raises(ValueError, match="C-contiguous"):
        st.append(0, np.asfortranarray(k), k, "float32", None)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        st.append(0, k, k, "int8", None)
    with pytest.raises(TypeError):
        st.append(0, "not an array", k, "float32", None)
    with pytest.raises(ValueError, match="shape"):
        st.append(0, k, k[:2], "float32", None)


# ---- a layer's state from untrusted bytes (import_layer: KV files) ----


def exercise(store: KVStore, layer: int = 0, seed: int = 0) -> None:
    """Every operation that reads a layer's blocks: scores, the index, selection, attention, read-back, a decode
    step (window + store part, then its token appended), a truncate and an append into the last block."""
    from ktquest.native.store import Select

    KVH, D = store.n_kv_heads, store.head_dim
    q = randn(2 * KVH, D, seed=seed)
    store.block_scores(layer, q)
    store.block_scores(layer, q, "SHARED")
    if store.index_group:
        store.group_bounds(layer, q)
    store.select(layer, q, 2)
    store.select_attend(layer, q, 3, "SHARED")
    store.attend(layer, q, torch.arange(store.n_blocks(layer), dtype=torch.int32))
    store.read(layer)
    store.anchors(layer)
    if store.index_group:
        store.bounds(layer)
    n = store.length(layer)
    if n < store.max_seq_len:
        win = randn(KVH, 3, D, seed=seed + 1)
        kv = randn(2, KVH, D, seed=seed + 2)
        store.decode_step(layer, q, kv[0], kv[1], win, win.clone(), 0, 3, (0, 0), D**-0.5, 1,
                          torch.empty(2 * KVH, D), select=Select(k=2))
        store.truncate(layer, n // 2)
        store.append(layer, kv[:1], kv[1:], torch.ones(1, KVH) if store.anchor_type == "DYNAMIC" else None)
        store.select_attend(layer, q, 2)


def exported_layer(anchor_type="FIXED", anchor_num=3, kv_type="FP32", index_group=2, T=21, bs=8, **kw):
    """A store of 2 KV heads (blocks of 8 tokens: the last of T = 21 holds 5) and its layer 0 as bytes."""
    store = KVStore(1, 2, 32, 64, block_size=bs, kv_type=kv_type, anchor_type=anchor_type, anchor_num=anchor_num,
                    index_group=index_group, **kw)
    k, v = randn(T, 2, 32, seed=11), randn(T, 2, 32, seed=12)
    store.append(0, k, v, randn(T, 2, seed=13) if anchor_type == "DYNAMIC" else None)
    return store, store.export_layer(0)


def poke(state: np.ndarray, store: KVStore, n: int, region: str, head: int, byte: int, value, dtype) -> np.ndarray:
    """A copy of ``state`` (n tokens) with ``value`` as ``dtype`` written at byte ``byte`` of the head's piece of
    ``region``: offsets from the store's own layout (state_regions)."""
    off, size = store.state_regions(n)[region][head]
    raw = np.array([value], dtype=dtype).view(np.uint8)
    assert 0 <= byte and byte + raw.size <= size
    out = state.copy()
    out[off + byte: off + byte + raw.size] = raw
    return out


def kv_byte(store: KVStore, n: int, block: int, row: int, dim: int, v: bool = False) -> int:
    """Byte of element ``dim`` of token row ``row`` of ``block``'s K (V) tile in a head's ``kv`` piece."""
    tile = store.state_regions(n)["kv"][0][1] // (2 * store.n_blocks(0))  # [nb, 2, tile] per head
    elem = {"FP32": 4, "FP16": 2, "BF16": 2}[store.kv_type]
    return (2 * block + v) * tile + (row * store.head_dim + dim) * elem


NAN16, INF16 = np.uint16(0x7E00).view(np.float16), np.float16(np.inf)
IMPORT_CASES = {  # name: (store, region, head, byte in the head's piece, value, dtype, message)
    # counts that index memory: the scorers read n_anchor rows of a block's anchors (a huge count: SIGSEGV)
    "fixed count huge": ({}, "n_anchor", 1, 0, 2**31 - 1, np.int32, r"kv head 1, block 0 .*n_anchor=2147483647"),
    "fixed count -1": ({}, "n_anchor", 0, 8, -1, np.int32, r"block 2 \(5 tokens\): n_anchor=-1 .*FIXED .* are 2"),
    "fixed count of a full block in a partial one": ({}, "n_anchor", 0, 8, 3, np.int32, "n_anchor=3 .* are 2$"),
    "dynamic count A+1": ({"anchor_type": "DYNAMIC"}, "n_anchor", 1, 4, 4, np.int32, r"n_anchor=4 .* are 0\.\.3"),
    "dynamic count -2**31": ({"anchor_type": "DYNAMIC"}, "n_anchor", 0, 0, -(2**31), np.int32,
                             "n_anchor=-2147483648"),
    "block_max count": ({"anchor_type": "BLOCK_MAX", "anchor_num": 1}, "n_anchor", 0, 4, 2**30, np.int32,
                        "BLOCK_MAX anchors of a block of 8 tokens are 1"),
    "quest count": ({"anchor_type": "QUEST", "anchor_num": 2}, "n_anchor", 1, 0, 0, np.int32, "n_anchor=0"),
    # DYNAMIC positions are rows of their block; importances finite or -inf
    "dynamic pos past the block": ({"anchor_type": "DYNAMIC"}, "pos", 0, (2 * 3 + 0) * 4, 5, np.int32,
                                   r"block 2 \(5 tokens\): pos\[0\]=5 is not a row of the block \(0\.\.4\)"),
    "dynamic pos -1": ({"anchor_type": "DYNAMIC"}, "pos", 1, 4, -1, np.int32, r"pos\[1\]=-1"),
    "dynamic imp nan": ({"anchor_type": "DYNAMIC"}, "imp", 0, 0, np.nan, np.float32, r"imp\[0\]=nan"),
    # values the operations compute with: finite, as append keeps them
    "fixed anchor inf": ({}, "anchors", 1, (3 * 32 + 32 + 5) * 4, np.inf, np.float32,
                         "block 1 .*anchor 1 holds a non-finite value at dim 5"),
    "fp16 quest anchor nan": ({"anchor_type": "QUEST", "anchor_num": 2, "kv_type": "FP16"}, "anchors", 0, 2 * 40,
                              NAN16, np.float16, "anchor 1 holds a non-finite value at dim 8"),
    "block_mean sums nan": ({"anchor_type": "BLOCK_MEAN", "anchor_num": 1}, "sums", 0, (2 * 32 + 3) * 8, np.nan,
                            np.float64, "block 2 .*key sums hold a non-finite value at dim 3"),
    "fp16 key inf": ({"kv_type": "FP16"}, "kv", 1, ("k", 2, 4, 7), INF16, np.float16,
                     "kv head 1, block 2 .*k holds a non-finite value at token 20, dim 7"),
    "fp32 value nan": ({}, "kv", 0, ("v", 0, 0, 0), np.nan, np.float32,
                       "v holds a non-finite value at token 0, dim 0"),
    "q8 scale past fp32": ({"kv_type": "Q8_0"}, "kv", 0, None, 1e37, np.float32, "k scale .* of token 0, dims 0"),
    "index bound nan": ({}, "bounds", 1, 2 * 33, NAN16, np.float16,
                        r"kv head 1, index group 0: its max bound is NaN at dim 1"),
}


@pytest.mark.parametrize("case", list(IMPORT_CASES))
def test_import_refuses_a_state_appends_cannot_make(case):
    """A KV file's store bytes are untrusted (their checksums can be recomputed): a count, position or value no
    append makes is a ValueError naming the layer, KV head, block and value; the layer stays empty and every
    operation on the store works. Before these checks a huge anchor count crashed the next selection."""
    kw, region, head, byte, value, dtype, match = IMPORT_CASES[case]
    src, state = exported_layer(**kw)
    n = src.length(0)
    if isinstance(byte, tuple):  # a K/V element: (k or v, block, row, dim)
        byte = kv_byte(src, n, *byte[1:], v=byte[0] == "v")
    elif byte is None:  # block 0's K tile scales (Q8_0): after the block's rows of D int8
        byte = src.block_size * src.head_dim
    bad = poke(state, src, n, region, head, byte, value, dtype)
    dst = KVStore(1, 2, 32, 64, block_size=8, kv_type=src.kv_type, anchor_type=src.anchor_type,
                  anchor_num=src.anchor_num, index_group=2)
    with pytest.raises(ValueError, match=r"import_layer: layer 0, (kv head \d.*)?" + match):
        dst.import_layer(0, n, bad)
    assert dst.length(0) == 0  # nothing was copied
    exercise(dst)
    dst.truncate(0, 0)
    dst.import_layer(0, n, state)  # the state as exported: the same store
    q = randn(4, 32, seed=3)
    assert torch.equal(dst.block_scores(0, q), src.block_scores(0, q))
    assert all(torch.equal(a, b) for a, b in zip(dst.select_attend(0, q, 2), src.select_attend(0, q, 2)))


@pytest.mark.parametrize("anchor_type", ["FIXED", "DYNAMIC"])
def test_import_takes_every_state_appends_and_truncates_make(anchor_type):
    """The checks refuse no state the store makes: every length of a store filled and cut back (DYNAMIC keeps
    fewer anchors than rows after a truncate), exported and imported, is the same store."""
    src, _ = exported_layer(anchor_type, T=40, index_group=3)
    for n in (39, 33, 32, 31, 17, 9, 8, 3, 1, 0):
        src.truncate(0, n)
        dst = KVStore(1, 2, 32, 40, block_size=8, kv_type="FP32", anchor_type=anchor_type, anchor_num=3,
                      index_group=3)
        dst.import_layer(0, n, src.export_layer(0))
        assert torch.equal(dst.anchors(0)[1], src.anchors(0)[1])
        exercise(dst, seed=n)


def test_import_refusal_leaves_a_filled_layer_as_it_was():
    src, state = exported_layer("DYNAMIC")
    dst, _ = exported_layer("DYNAMIC", T=9)
    before = dst.read(0)
    bad = poke(state, src, 21, "n_anchor", 0, 0, 99, np.int32)
    with pytest.raises(ValueError, match="n_anchor=99"):
        dst.import_layer(0, 21, bad)
    assert dst.length(0) == 9 and all(torch.equal(a, b) for a, b in zip(dst.read(0), before))
    exercise(dst)
