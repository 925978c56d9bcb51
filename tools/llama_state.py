"""llama.cpp's KV cache filled without a prefill: a sequence-state file of N cells written directly and
loaded (bench_engines.py's ``llama.cpp-filled``), for decode speed at 32K-256K where llama.cpp's own prefill
would take hours on two cores.

Its dense decode step reads every cached K and V row whatever their values, so the rows are zeros (a score of
0 for every position: no NaN, and nothing for its flash attention to skip, which skips masked positions only).
The layout is not documented: it is read off the state the same context writes after a 16-token prompt
(``llama_state_seq_get_data``), whose parts scale with the tokens as follows (llama-cpp-python 0.3.36's
llama.cpp; ``probe`` checks each size against a second state of 32 tokens and refuses what it cannot account
for)::

    8 bytes             copied as written
    u32 n_stream (1)    u32 cells
    cells x             i32 pos, u32 n_seq (1), i32 seq (0); with several positions a token (M-RoPE), more
                        i32 between n_seq and seq (read off the probe: each the position, the token or a constant)
    u32 v_trans         u32 n_layer
    n_layer x           i32 k_type, u64 k_row_bytes, cells x k_row_bytes
    n_layer x           v_trans 0: i32 v_type, u64 v_row_bytes, cells x v_row_bytes
                        v_trans 1: i32 v_type, u32 v_elem_bytes, u32 v_dims, v_dims x cells x v_elem_bytes

The file around it (``llama_state_seq_save_file``): u32 magic, u32 version, u32 n_tokens, the token ids
(i32), then the state without its first 8 bytes (which the in-memory state alone has).

A hybrid model (qwen35, qwen3next: llama.cpp's hybrid memory) writes its attention layers' cache as above and
then its recurrent memory, whose size does not grow with the tokens::

    u32 cells (1)       i32 pos (the last token's), u32 n_seq (0)       then the states, copied as written

The recurrent states are copied from the probe's (their values do not change the decode step's work), with the
position set to the file's last token.
"""

from __future__ import annotations

import ctypes
import struct

PROBE = 16


def _seq_state(lc, llm) -> bytes:
    size = lc.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    lc.llama_state_seq_get_data(llm.ctx, buf, size, 0)
    return bytes(buf)


def _cell_columns(state: bytes, at: int, cells: int, tokens: list[int]) -> tuple[str | int, ...]:
    """What each i32 of a cell's record holds, for every cell i: "pos" (i), "token" (tokens[i]) or a constant.
    The plain record is (pos, n_seq 1, seq 0); a model with several positions per token (qwen35's M-RoPE) has
    more between n_seq and seq (its extra positions, and here the token)."""
    for words in range(3, 9):
        if at + 4 * words * cells > len(state):
            break
        w = struct.unpack_from(f"<{words * cells}i", state, at)
        rows = [w[i * words:(i + 1) * words] for i in range(cells)]
        if any(r[0] != i for i, r in enumerate(rows)) or any(r[1] != 1 or r[-1] != 0 for r in rows):
            continue
        cols: list[str | int] = []
        for c in range(words):
            col = [r[c] for r in rows]
            if col == list(range(cells)):  # (column 0 always: checked above)
                cols.append("pos")
            elif col == list(tokens[:cells]):
                cols.append("token")
            elif len(set(col)) == 1:
                cols.append(col[0])
            else:
                break
        else:
            return tuple(["pos", *cols[1:]])
    raise ValueError(f"llama.cpp state: {cells} cells whose records this tool cannot read")


def _parse(state: bytes, tokens: list[int]) -> dict:
    """The layout of a state (module docstring); ValueError where it is not that layout."""
    at = 8
    n_stream, cells = struct.unpack_from("<II", state, at)
    at += 8
    if n_stream != 1:
        raise ValueError(f"llama.cpp state with {n_stream} streams (1 expected)")
    cell = _cell_columns(state, at, cells, tokens)
    at += 4 * len(cell) * cells
    v_trans, n_layer = struct.unpack_from("<II", state, at)
    at += 8
    k = []
    for _ in range(n_layer):
        k.append(struct.unpack_from("<iQ", state, at))
        at += 12 + cells * k[-1][1]
    v = []
    for _ in range(n_layer):
        if v_trans:
            v.append(struct.unpack_from("<iII", state, at))
            at += 12 + v[-1][2] * cells * v[-1][1]
        else:
            v.append(struct.unpack_from("<iQ", state, at))
            at += 12 + cells * v[-1][1]
    tail = state[at:]  # a hybrid model's recurrent memory (module docstring); b"" otherwise
    if tail:
        cells_r, _pos, n_seq = struct.unpack_from("<IiI", tail, 0) if len(tail) >= 12 else (0, 0, 1)
        if (cells_r, n_seq) != (1, 0):
            raise ValueError(f"llama.cpp state of {len(state)} bytes, {at} accounted for, and the rest not one "
                             "recurrent cell")
    return dict(prefix=state[:8], cell=cell, v_trans=v_trans, k=k, v=v, tail_bytes=len(tail), tail=tail)


def probe(lc, llm, tokens: list[int]) -> dict:
    """The state layout of ``llm``'s context, from its states after ``PROBE`` and 2 x ``PROBE`` tokens."""
    layouts = []
    for n in (PROBE, 2 * PROBE):
        llm.reset()
        llm.eval(tokens[:n])
        layouts.append(_parse(_seq_state(lc, llm), tokens))
        if layouts[-1]["tail"] and struct.unpack_from("<i", layouts[-1]["tail"], 4)[0] != n - 1:
            raise ValueError(f"llama.cpp's recurrent cell after {n} tokens is not at position {n - 1}")
    shape = [{k: v for k, v in lay.items() if k != "tail"} for lay in layouts]
    if shape[0] != shape[1]:
        raise ValueError("llama.cpp's state layout changes with the tokens in it: not the one this tool writes")
    return layouts[1]


def write_file(path: str, layout: dict, tokens: list[int], chunk: int = 64 << 20) -> None:
    """A sequence-state file of ``len(tokens)`` cells at positions 0.. with zero K/V rows (and a hybrid model's
    recurrent states from the probe, at the last position)."""
    n = len(tokens)
    zeros = bytes(chunk)

    def blank(f, size: int) -> None:
        while size > 0:
            f.write(zeros[: min(size, chunk)])
            size -= chunk

    with open(path, "wb") as f:
        f.write(struct.pack("<III", 0x67677371, 3, n))  # "ggsq", the version 0.3.36 writes, tokens
        f.write(struct.pack(f"<{n}i", *tokens))
        f.write(struct.pack("<II", 1, n))  # (the file's state has no 8-byte prefix: the buffer's only)
        cell = layout.get("cell", ("pos", 1, 0))
        fmt = f"<{len(cell)}i"
        f.write(b"".join(struct.pack(fmt, *(i if c == "pos" else tokens[i] if c == "token" else c for c in cell))
                         for i in range(n)))
        f.write(struct.pack("<II", layout["v_trans"], len(layout["k"])))
        for k_type, row in layout["k"]:
            f.write(struct.pack("<iQ", k_type, row))
            blank(f, n * row)
        for v in layout["v"]:
            if layout["v_trans"]:
                f.write(struct.pack("<iII", *v))
                blank(f, v[2] * n * v[1])
            else:
                f.write(struct.pack("<iQ", *v))
                blank(f, n * v[1])
        tail = layout.get("tail", b"")
        if tail:
            f.write(tail[:4] + struct.pack("<i", n - 1) + tail[8:])


def load_file(lc, llm, path: str, tokens: list[int]) -> None:
    """Load ``path`` into ``llm``'s sequence 0; ``llm`` then continues at position len(tokens)."""
    n = len(tokens)
    out = (lc.llama_token * n)()
    count = ctypes.c_size_t(0)
    read = lc.llama_state_seq_load_file(llm.ctx, path.encode(), 0, out, n, ctypes.byref(count))
    if read == 0 or count.value != n:
        raise RuntimeError(f"llama.cpp did not load {path} ({read} bytes, {count.value} tokens of {n})")
    llm.input_ids[:n] = tokens
    llm.n_tokens = n
