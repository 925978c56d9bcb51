"""``ktquest pull`` and ``ktquest list``: a model repository's GGUF into the local hub cache (``ktquest.hub``), and
the models ``--model`` can take with what this machine holds of them (``ktquest.catalog``)."""

from __future__ import annotations

from ktquest import catalog, hub
from ktquest.cli_args import UsageError


def pull(text: str) -> int:
    """Download ``text`` (OWNER/NAME[:QUANT|:FILE]); print the file and the ``--model`` that takes it."""
    ref = hub.parse_ref(text)
    if ref is None:
        raise UsageError(f"pull {text}: not a model repository's name: OWNER/NAME[:QUANT|:FILE], e.g. "
                         "Qwen/Qwen2.5-7B-Instruct-1M-GGUF:Q4_K_M")
    path = hub.pull(ref)
    print(f"{path}\nchat with it: ktquest chat -m {ref}")
    return 0


def _fits(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


def list_models() -> int:
    """A table of the bundled and downloaded models (header-only reads; nothing is loaded)."""
    rows = [("model", "arch", "params", "quant", "trained ctx", "size", "RAM: dense", "RAM: long_context")]
    notes = []
    for m in catalog.cached_models():
        i = m.info
        params = f"{i.n_params / 1e9:.2f}B" if i.n_params else "-"
        ctx = f"{i.context_length:,}" if i.context_length else "-"
        rows.append((m.name, i.arch or "-", params, i.file_type or "-", ctx, f"{i.file_size / 2**30:.2f} GiB",
                     _fits(m.fits_dense), _fits(m.fits_long_context)))
        notes += [f"{m.name}: {n}" for n in m.notes] + ([f"{m.name}: {i.error}"] if i.error else [])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip())
    for n in notes:
        print(n)
    print("\nRAM: whether this machine holds the model at its trained context (weights and KV cache; long_context: "
          "the snapkv preset's store). 'ktquest pull OWNER/NAME:QUANT' adds one.")
    return 0
