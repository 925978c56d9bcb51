"""Log probabilities of a reply's tokens, as OpenAI's API gives them (``logprobs`` / ``top_logprobs``).

A token's log probability is log_softmax of the logits it was sampled from: the model's distribution, before the
sampler's temperature, penalties and cuts (as llama.cpp's server and vLLM report it by default). Each token's text
is what the reply's stream decoder gave for it (a token that ends inside a UTF-8 character gives "", the one that
completes it the character), so the tokens' texts laid end to end are the reply's text; a reply cut by a stop
string keeps the tokens that start before the cut. Streamed, each chunk carries the tokens whose text it
completes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    text: str  # the token's part of the reply's text
    start: int  # its offset in the reply's text, characters
    logprob: float
    top: tuple[tuple[str, float], ...]  # the most likely tokens (their own text) and their log probabilities


class LogprobCollector:
    """``on_logits`` of a generation (``Engine.run``): records each reply token's log probability and the ``top``
    most likely tokens; called on the generating thread, read (``take``) from another."""

    def __init__(self, tokenizer, top: int, stop_ids):
        self.tokenizer, self.top, self.stop_ids = tokenizer, top, set(stop_ids)
        self.decoder = tokenizer.stream_decoder()
        self.records: list[TokenLogprob] = []
        self.chars = 0  # the reply's text so far
        self.taken = 0  # records handed out
        self.lock = threading.Lock()

    def __call__(self, token: int, logits: torch.Tensor) -> None:
        if token in self.stop_ids:  # (the end of the turn is not part of the reply)
            return
        lp = torch.log_softmax(logits.float(), -1)
        top = ()
        if self.top:
            values, ids = lp.topk(self.top)
            top = tuple((self.tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids))
        text = self.decoder.push(token)
        with self.lock:
            self.records.append(TokenLogprob(token, text, self.chars, float(lp[token]), top))
            self.chars += len(text)

    def take(self, upto: int, final: bool = False) -> list[TokenLogprob]:
        """The records not handed out yet whose text ends by ``upto`` characters of the reply (``final``: that
        start before it: the reply ends there)."""
        with self.lock:
            out = []
            for r in self.records[self.taken:]:
                if (r.start < upto or (not r.text and r.start <= upto)) if final else r.start + len(r.text) <= upto:
                    out.append(r)
                else:
                    break
            self.taken += len(out)
            return out


def chat_logprobs(records: list[TokenLogprob]) -> dict:
    """A chat choice's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(r.text, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]}
                        for r in records]}


def completion_logprobs(records: list[TokenLogprob], offset: int = 0) -> dict:
    """A completion choice's ``logprobs``: parallel lists of the tokens, their log probabilities, their top
    alternatives ({text: logprob}) and their offsets in the text."""
    return {"tokens": [r.text for r in records], "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [dict(r.top) for r in records], "text_offset": [offset + r.start for r in records]}
