"""A mixture-of-experts model in its GGUF encoding keeps only the experts a token was routed to resident:
the experts are views of the mapped file, so the pages of an expert no token used are never read (no copy,
no scan at load). Measured on the process's own mapping of the file (its Rss in /proc/self/smaps: the pages
this process touched, whatever else the page cache holds)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from test_make_shaped_gguf import _tool, tokenizer_gguf  # noqa: F401 (a fixture)

import ktquest
from ktquest.native.decode import NativeDecoder

N_EXPERTS, USED = 16, 1
FOLIO = 2 << 20  # the largest page-cache folio (a PMD): a fault maps at most the folio it falls in


def mapped_rss(path: str) -> int:
    """Bytes of ``path``'s mappings resident in this process."""
    total, current = 0, False
    real = os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's header line: "start-end perms offset dev inode [path]"
                current = line.rstrip().endswith(real)
            elif current and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def sparse_moe(tmp_path_factory, tokenizer_gguf):  # noqa: F811
    """qwen3moe, one layer of 16 experts of which one runs a token, in Q8_0: each expert matrix 2.1 MiB (a
    kernel with large page-cache folios maps a whole folio, up to 2 MiB, around a touched page: the bound
    below allows one on each side of every matrix an expert reads)."""
    shaped = _tool("make_shaped_gguf")
    out = tmp_path_factory.mktemp("moe") / "sparse-moe.gguf"
    shape = dataclasses.replace(shaped.SHAPES["tiny-moe"], vocab=384, n_layers=1, dim=1024,
                                ffn=2048, experts=(N_EXPERTS, USED, 2048))
    plans = shaped.write_shaped_gguf(out, shape, "sparse-moe", ftype="Q8_0", tokenizer=tokenizer_gguf,
                                     context=512)
    expert_bytes = sum(p.nbytes for p in plans if "_exps." in p.name)
    return out, expert_bytes


def test_only_the_routed_experts_pages_become_resident(sparse_moe):
    path, expert_bytes = sparse_moe
    eng = ktquest.load(path, weights="gguf", max_seq_len=64, threads=1)
    assert isinstance(eng.model.decoder, NativeDecoder)
    loaded = mapped_rss(str(path))
    rest = os.path.getsize(path) - expert_bytes  # the header, the tokenizer and every other tensor
    assert loaded < rest + (256 << 10), (loaded, rest)  # loading read no expert (256 KB: fault-around)
    # two prompt tokens and a decoded one: at most 3 of the 16 experts ran
    eng.generate("ab", max_new_tokens=2)
    used = mapped_rss(str(path)) - loaded
    one = expert_bytes / N_EXPERTS
    assert 0.9 * one < used <= 3 * one + 3 * 3 * 2 * FOLIO, (used, one)  # (about 40% of the experts at most)
