"""A transformer block described once: what an architecture builds each layer from.

Every reader of a block takes it from its ``BlockSpec`` (``ModelArgs.blocks``, one a layer, set by the model's
family file): the loader (which tensors a block has, their shapes), the torch model (``models/llama.Block``),
the native decode step (``native/decode.py`` -> ``cpp/decode/decode_layer.h``) and the cache (which layers slide
over a window: ``kv/sliding.py``). A new kind of block (a MoE FFN, a linear-attention layer) is a new value of
one of these fields, read in each of those places, with its kernel in a folder of its own under ``cpp/``.

    x -> attn_norm -> Wqkv (+ bias) -> [q_norm, k_norm] -> RoPE (table ``rope``) -> attention (``attention``)
      -> Wo -> [post_attn_norm] -> + x -> ffn_norm -> FFN (``ffn``) -> [post_ffn_norm] -> + residual

The bracketed norms are ``qk_norm`` and ``sandwich_norms``. Wqkv is one matrix whatever the file holds:
``attn_q``, ``attn_k``, ``attn_v`` stacked, or the file's own fused ``attn_qkv`` (``fused_qkv``: Phi-3, ChatGLM),
and likewise the FFN's gate | up (``fused_gate_up``: one ``ffn_up`` of 2 x ffn rows, the gate's first).
RoPE is rotate-half over head_dim; a file that rotates
only ``rope_dim`` < head_dim dims of each head (Qwen3.5) reaches attention with its q/k dims gathered so that the
rotated pairs are (i, i + D/2) and the tables hold cos 1, sin 0 on the rest (``models/loader.qk_perm``). With
``attn_gate`` (Qwen3.5's full attention) the q projection carries a second [H*D] half per head, an output gate:
attention's output is multiplied by sigmoid(gate) before Wo.

A ``delta_net`` mixer (Qwen3.5, Qwen3-Next: ``mixer``) replaces attention by a Gated DeltaNet (``models/delta_net.py``):
    x -> attn_norm -> Wqkv -> causal conv (kernel ``conv_kernel``) -> silu -> q, k (l2-normed), v
      -> beta = sigmoid(W_beta x), g = ssm_a * softplus(W_alpha x + ssm_dt)
      -> the delta rule on a state S [Hv, Dk, Dv]:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(Dk)
      -> RMSNorm(o) * silu(W_z x) per value head -> W_out -> + x -> ffn_norm -> FFN -> + residual
Its state (the conv's last inputs and S) is the cache's, not k/v (``kv/recurrent.py``).

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
MixerKind = Literal["attention", "delta_net"]

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
# a delta_net block's mixer (llama.cpp's names for Qwen3.5 / Qwen3-Next) in place of wq, wk, wv, wo
DELTA_NET_TENSORS = {"w_in_qkv": "attn_qkv.weight", "w_in_z": "attn_gate.weight", "w_beta": "ssm_beta.weight",
                     "w_alpha": "ssm_alpha.weight", "ssm_a": "ssm_a", "ssm_dt": "ssm_dt.bias",
                     "conv1d": "ssm_conv1d.weight", "ssm_norm": "ssm_norm.weight", "w_ssm_out": "ssm_out.weight"}
# qwen3next files keep the model's in_proj_ba: beta's and alpha's rows fused, [Hk groups x (r betas, r alphas)]
FUSED_BA_TENSORS = {"w_ba": "ssm_ba.weight"}
# Phi-3's and ChatGLM's fused projections: q | k | v rows in one tensor (with its bias), gate | up rows in one
FUSED_QKV_TENSORS = {"wqkv": "attn_qkv.weight"}
FUSED_QKV_BIAS = {"bqkv": "attn_qkv.bias"}
FUSED_GATE_UP_TENSORS = {"w_gate_up": "ffn_up.weight"}
ATTENTION_TENSORS = ("wq", "wk", "wv", "wo")
VECTORS = {"attn_norm", "ffn_norm", "shexp_gate", "ssm_a", "ssm_dt", "ssm_norm", *BIAS_TENSORS, *QK_NORM_TENSORS,
           *SANDWICH_TENSORS, *FUSED_QKV_BIAS}
SMALL_TENSORS = {"conv1d"}  # read as fp32 tensors like the vectors: [conv_dim, conv_kernel], not a Linear


@dataclass(frozen=True, slots=True)
class DeltaNetSpec:
    """A Gated DeltaNet mixer's sizes (GGUF ``ssm.*`` keys): q/k heads of ``k_head_dim``, value heads of
    ``v_head_dim`` (``n_v_heads`` a multiple of ``n_k_heads``), the causal conv's kernel. ``grouped``: the file
    keeps the model's value-head order (qwen3next: head h reads q/k head h // r) and beta's and alpha's
    projections fused (``ssm_ba``); else tiled (qwen35: h reads h % n_k_heads) with ``ssm_beta``, ``ssm_alpha``."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    grouped: bool = False

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q | k | v."""
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim
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
    mixer: MixerKind = "attention"  # attention over the cache's k/v, or a Gated DeltaNet over a state (``delta``)
    delta: DeltaNetSpec | None = None
    attn_gate: bool = False  # attention's output times sigmoid(a gate the q projection also makes)
    ffn_norm_tensor: str = "ffn_norm.weight"  # the FFN's pre-norm's GGUF name (Qwen3.5: post_attention_norm)
    fused_qkv: bool = False  # the file holds q | k | v as one attn_qkv (and attn_qkv.bias with qkv_bias)
    fused_gate_up: bool = False  # the file holds the FFN's gate | up as one ffn_up [2 x ffn, dim]

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
        if (self.mixer == "delta_net") != (self.delta is not None):
            raise ValueError(f"BlockSpec: mixer={self.mixer!r} with delta={self.delta}: a delta_net block has its sizes, "
                             "an attention block none")
        if self.mixer == "delta_net" and (self.attn_gate or self.qkv_bias or self.qk_norm or self.window
                                          or self.fused_qkv):
            raise ValueError("BlockSpec: a delta_net block has no attention options (attn_gate, qkv_bias, qk_norm, "
                             "window, fused_qkv)")
        if self.fused_gate_up and self.ffn == "moe":
            raise ValueError("BlockSpec: fused_gate_up on a moe block (its experts' gate and up are stacks)")

    def tensors(self) -> dict[str, str]:
        """This block's tensors: field -> GGUF name under "blk.{i}."."""
        base = BASE_TENSORS
        if self.ffn == "moe":
            base = ({f: n for f, n in BASE_TENSORS.items() if f not in DENSE_FFN_TENSORS} | MOE_TENSORS
                    | (SHARED_EXPERT_TENSORS if self.shared_expert else {}))
        if self.mixer == "delta_net":
            base = {f: n for f, n in base.items() if f not in ATTENTION_TENSORS} | DELTA_NET_TENSORS
            if self.delta.grouped:
                base = {f: n for f, n in base.items() if f not in ("w_beta", "w_alpha")} | FUSED_BA_TENSORS
        base = base | {"ffn_norm": self.ffn_norm_tensor}
        bias = BIAS_TENSORS if self.qkv_bias else {}
        if self.fused_qkv:
            base = {f: n for f, n in base.items() if f not in ("wq", "wk", "wv")} | FUSED_QKV_TENSORS
            bias = FUSED_QKV_BIAS if self.qkv_bias else {}
        if self.fused_gate_up:
            base = {f: n for f, n in base.items() if f not in ("w_gate", "w_up")} | FUSED_GATE_UP_TENSORS
        return (base | bias | (QK_NORM_TENSORS if self.qk_norm else {})
                | (SANDWICH_TENSORS if self.sandwich_norms else {}))

    def shapes(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int) -> dict[str, tuple]:
        """Each of ``tensors()``'s fields' shape, [rows, cols] for matrices, [n_experts, rows, cols] for the
        expert stacks."""
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        e, ef, sf = self.n_experts, self.expert_ffn, self.shared_ffn
        d = self.delta or DeltaNetSpec(0, 0, 0, 0, 0)
        every = {"attn_norm": (dim,), "wq": (q * (2 if self.attn_gate else 1), dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, q),
                 "ffn_norm": (dim,), "w_gate": (ffn_dim, dim), "w_up": (ffn_dim, dim), "w_down": (dim, ffn_dim),
                 "bq": (q,), "bk": (kv,), "bv": (kv,), "q_norm": (head_dim,), "k_norm": (head_dim,),
                 "wqkv": (q + 2 * kv, dim), "bqkv": (q + 2 * kv,), "w_gate_up": (2 * ffn_dim, dim),
                 "post_attn_norm": (dim,), "post_ffn_norm": (dim,),
                 "w_router": (e, dim), "w_gate_exps": (e, ef, dim), "w_up_exps": (e, ef, dim),
                 "w_down_exps": (e, dim, ef), "w_gate_shexp": (sf, dim), "w_up_shexp": (sf, dim),
                 "w_down_shexp": (dim, sf), "shexp_gate": (dim,),
                 "w_in_qkv": (d.conv_dim, dim), "w_in_z": (d.value_dim, dim), "w_beta": (d.n_v_heads, dim),
                 "w_alpha": (d.n_v_heads, dim), "w_ba": (2 * d.n_v_heads, dim), "ssm_a": (d.n_v_heads,), "ssm_dt": (d.n_v_heads,),
                 "conv1d": (d.conv_dim, d.conv_kernel), "ssm_norm": (d.v_head_dim,), "w_ssm_out": (dim, d.value_dim)}
        return {f: every[f] for f in self.tensors()}
