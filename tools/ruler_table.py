"""RULER's table from a folder of ``tools/eval_longctx.py --json`` runs (docs/results/issue63/ruler_queue.sh writes
one a task and store): accuracy per task and config, each config's average over the tasks it has, and its
difference from dense's average over the same tasks.

    python tools/ruler_table.py /work/runs/issue63/smollm2-135m_4096
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def collect(folder: Path) -> dict[str, dict[str, tuple[float, int]]]:
    """config -> task -> (correct, trials) summed over the folder's JSON runs."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for f in sorted(folder.glob("*.json")):
        for r in json.loads(f.read_text()).get("rows", []):
            cell = out[r["config"]][r["task"]]
            cell[0] += r["correct"]
            cell[1] += r["trials"]
    return {c: {t: (v[0], v[1]) for t, v in ts.items()} for c, ts in out.items()}


def table(acc: dict[str, dict[str, tuple[float, int]]]) -> str:
    tasks = sorted({t for ts in acc.values() for t in ts})
    configs = sorted(acc, key=lambda c: (c != "dense", c))
    head = "| config | " + " | ".join(tasks) + " | average | vs dense |"
    lines = [head, "|---" * (len(tasks) + 3) + "|"]
    dense = acc.get("dense", {})
    for c in configs:
        cells, shares = [], {}
        for t in tasks:
            if t in acc[c]:
                ok, n = acc[c][t]
                shares[t] = 100 * ok / n
                cells.append(f"{shares[t]:.0f}")
            else:
                cells.append("-")
        avg = sum(shares.values()) / len(shares) if shares else float("nan")
        both = [t for t in shares if t in dense]
        diff = "-"
        if both and c != "dense":
            d = sum(100 * dense[t][0] / dense[t][1] for t in both) / len(both)
            diff = f"{sum(shares[t] for t in both) / len(both) - d:+.1f}"
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {avg:.1f} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    a = ap.parse_args()
    print(table(collect(a.folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
