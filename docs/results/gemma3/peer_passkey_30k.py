# Two of the 30K classic pass-key prompts of docs/results/gemma3/h200/passkey_30720_dense.json (seed 0), the same
# tokens fed to llama.cpp (llama-cpp-python 0.3.36, greedy, 2 threads): does Gemma 3 270M itself miss them?
# python docs/results/gemma3/peer_passkey_30k.py > docs/results/gemma3/peer_passkey_30k.log
import sys, time
from llama_cpp import Llama
from ktquest.formats.gguf import open_gguf
from ktquest.formats.tokenizer import Tokenizer
from ktquest.formats.bundled import bundled_model_path
from ktquest.eval.tasks import make_sample
path = str(bundled_model_path('gemma3-270m'))
tok = Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
llm = Llama(path, n_ctx=31232, n_threads=2, n_batch=512, verbose=False)
for depth, trial in [(0.1, 0), (0.7, 1)]:
    s = make_sample(tok, 'passkey', 30720, depth, 0, trial, 'classic')
    ids = s.tokens
    t = time.perf_counter()
    llm.reset()
    out = []
    for i, x in enumerate(llm.generate(ids, temp=0.0, top_k=1)):
        if i == 0: pf = time.perf_counter() - t
        out.append(x)
        if len(out) >= 10: break
    print(depth, trial, 'answer', s.answer, 'llama.cpp reply', repr(llm.detokenize(out).decode(errors='replace')), f'prefill {pf:.0f}s, {len(ids)} tokens', flush=True)
