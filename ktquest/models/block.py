"""A transformer block described once: what an architecture builds each layer from.

Every reader of a block takes it from its ``BlockSpec`` (``ModelArgs.blocks``, one a layer, set by the model's
family file): the loader (which tensors a block has, their shapes), the torch model (``models/llama.Block``),
the native decode step (``native/decode.py`` -> ``cpp/decode/decode_layer.h``) and the cache (which layers slide
over a window: ``kv/sliding.py``). A new kind of block (a MoE FFN, a linear-attention layer) is a new value of
one of these fields, read in each of those places, with its kernel in a folder of its own under ``cpp/``.

    x -> attn_norm -> Wqkv (+ bias) -> [q_norm, k_norm] -> RoPE (table ``rope``) -> attention (``attention``)
      -> Wo -> [post_attn_norm] -> + x -> ffn_norm -> FFN (``ffn``) -> [post_ffn_norm] -> + residual

The bracketed norms are ``qk_norm`` and ``sandwich_norms``. Every q/k head is rotated whole (rotate-half RoPE
over head_dim; a file with partial rotary dims is refused when read, ``models/args.py``).

A ``moe`` FFN (Qwen3-MoE, Qwen2-MoE) is a mixture of ``n_experts`` SwiGLU experts of width ``expert_ffn``: a router
[n_experts, dim] scores the token, softmax in fp32, the ``n_experts_used`` best experts run (renormalized to sum
to 1 where ``norm_topk``) and their outputs are summed by those weights; with ``shared_expert`` (Qwen2-MoE) a
SwiGLU of width ``shared_ffn`` is added, times sigmoid(ffn_gate_inp_shexp . x). The experts' tensors are stacked
[n_experts, rows, cols] (llama.cpp's ``ffn_*_exps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["global", "sliding"]
FfnKind = Literal["swiglu", "geglu", "moe"]

# A block's tensors: field of ``models.llama.BlockWeights`` -> GGUF name under "blk.{i}." (llama.cpp's names)
BASE_TENSORS = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
                "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
                "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
BIAS_TENSORS = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
QK_NORM_TENSORS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
SANDWICH_TENSORS = {"post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight"}
DENSE_FFN_TENSORS = ("w_gate", "w_up", "w_down")  # what a moe block has instead: MOE_TENSORS
MOE_TENSORS = {"w_router": "ffn_gate_inp.weight", "w_gate_exps": "ffn_gate_exps.weight",
               "w_up_exps": "ffn_up_exps.weight", "w_down_exps": "ffn_down_exps.weight"}
SHARED_EXPERT_TENSORS = {"w_gate_shexp": "ffn_gate_shexp.weight", "w_up_shexp": "ffn_up_shexp.weight",
                         "w_down_shexp": "ffn_down_shexp.weight", "shexp_gate": "ffn_gate_inp_shexp.weight"}
VECTORS = {"attn_norm", "ffn_norm", "shexp_gate", *BIAS_TENSORS, *QK_NORM_TENSORS, *SANDWICH_TENSORS}
EXPERT_STACKS = {"w_gate_exps", "w_up_exps", "w_down_exps"}  # [n_experts, rows, cols]; the rest are matrices


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """One layer's block (see the module docstring)."""

    qkv_bias: bool = False  # biases on the q, k and v projections (qwen2)
    qk_norm: bool = False  # each q and k head RMS-normed over head_dim before RoPE (gemma3)
    sandwich_norms: bool = False  # the attention's and the FFN's outputs RMS-normed before the residual adds
    attention: AttentionKind = "global"  # every past position, or the last ``window`` ones (the query's own included)
    window: int = 0
    rope: int = 0  # the RoPE table: 0 the file's base and scaling, 1 the sliding layers' local base (gemma3)
    ffn: FfnKind = "swiglu"  # gated FFN: silu(gate) * up (SwiGLU), tanh-GELU(gate) * up (GeGLU), or SwiGLU experts
    n_experts: int = 0  # moe: the experts, how many run a token, and their width
    n_experts_used: int = 0
    expert_ffn: int = 0
    norm_topk: bool = False  # moe: the chosen experts' probabilities renormalized to sum to 1
    shared_expert: bool = False  # moe: a SwiGLU of width shared_ffn beside the experts, gated by a sigmoid
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        if (self.attention == "sliding") != (self.window > 0):
            raise ValueError(f"BlockSpec: attention={self.attention!r} with window={self.window}: a sliding block "
                             "has a window >= 1, a global one none")
        moe = self.ffn == "moe"
        if moe and not (1 <= self.n_experts_used <= self.n_experts and self.expert_ffn >= 1):
            raise ValueError(f"BlockSpec: ffn='moe' with n_experts={self.n_experts}, n_experts_used="
                             f"{self.n_experts_used}, expert_ffn={self.expert_ffn}: 1 <= used <= experts and a "
                             f"width >= 1")
        if not moe and (self.n_experts or self.n_experts_used or self.shared_expert):
            raise ValueError(f"BlockSpec: experts on a block with ffn={self.ffn!r} (only 'moe' has them)")
        if self.shared_expert != (self.shared_ffn >= 1):
            raise ValueError(f"BlockSpec: shared_expert={self.shared_expert} with shared_ffn={self.shared_ffn}")

    def tensors(self) -> dict[str, str]:
        """This block's tensors: field -> GGUF name under "blk.{i}."."""
        base = BASE_TENSORS
        if self.ffn == "moe":
            base = ({f: n for f, n in BASE_TENSORS.items() if f not in DENSE_FFN_TENSORS} | MOE_TENSORS
                    | (SHARED_EXPERT_TENSORS if self.shared_expert else {}))
        return (base | (BIAS_TENSORS if self.qkv_bias else {}) | (QK_NORM_TENSORS if self.qk_norm else {})
                | (SANDWICH_TENSORS if self.sandwich_norms else {}))

    def shapes(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int) -> dict[str, tuple]:
        """Each of ``tensors()``'s fields' shape, [rows, cols] for matrices, [n_experts, rows, cols] for the
        expert stacks."""
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        e, ef, sf = self.n_experts, self.expert_ffn, self.shared_ffn
        every = {"attn_norm": (dim,), "wq": (q, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, q),
                 "ffn_norm": (dim,), "w_gate": (ffn_dim, dim), "w_up": (ffn_dim, dim), "w_down": (dim, ffn_dim),
                 "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (head_dim,), "k_norm": (head_dim,),
                 "post_attn_norm": (dim,), "post_ffn_norm": (dim,),
                 "w_router": (e, dim), "w_gate_exps": (e, ef, dim), "w_up_exps": (e, ef, dim),
                 "w_down_exps": (e, dim, ef), "w_gate_shexp": (sf, dim), "w_up_shexp": (sf, dim),
                 "w_down_shexp": (dim, sf), "shexp_gate": (dim,)}
        return {f: every[f] for f in self.tensors()}
