import sys, time, statistics
import ktquest
ktquest.set_openmp_spin()
import torch
from ktquest.config import load_config
mode = sys.argv[1]
eng = ktquest.load(None, f"configs/{mode}.yaml" if mode != "dense" else None, threads=2, max_seq_len=4096)
sys.path.insert(0, "tools")
from common import context_tokens
toks = context_tokens(eng.tokenizer, 1024)
from ktquest.engine import make_cache
ts = []
for i in range(6):
    cache = make_cache(eng.config, eng.model.args, eng.max_seq_len, eng.device, eng.dtype)
    t0 = time.perf_counter(); eng.prefill(toks, cache); ts.append(time.perf_counter() - t0)
print(mode, "prefill 1K median s", round(statistics.median(ts[1:]), 4), [round(t, 3) for t in ts])
