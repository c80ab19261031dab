"""Model configuration: one dataclass, validated on construction, with named presets.

DeepSeek-V3 proportions for the GPU presets ``small``, ``medium`` and ``v3``: 256 routed experts + 1 shared,
top-8 routing over 8 groups with at most 4 groups per token (which caps a token at 4 nodes when experts are
laid out node-major), the first 3 layers dense, the routed weights scaled by 2.5; grouped-query attention.

The published architectures, exactly as their config.json (what :func:`moe.hf.from_hf_config` reads from it):
``deepseek-v3`` (671B, MLA with YaRN, one multi-token-prediction module), ``deepseek-v2-lite``
(16B: MLA without a query latent, a softmax router without groups or selection bias), ``qwen3-30b-a3b`` and
``qwen3-235b-a22b`` (grouped-query attention with q/k norms, a softmax router, no shared expert). Each family
has a CPU-sized shape with every one of its features: ``deepseek-v3-tiny`` and ``qwen3-moe-tiny``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["PRESETS", "ROUTER_SCORINGS", "MoEConfig", "preset"]

ROUTER_SCORINGS = ("sigmoid", "softmax")
"""How a router scores experts (``MoEConfig.router_scoring``; moe.models.router)."""


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Shape and routing hyper-parameters of the MoE transformer."""

    vocab_size: int = 128
    """Token vocabulary size (embedding rows and head columns)."""
    hidden_size: int = 32
    """Model width D."""
    num_layers: int = 2
    """Transformer blocks (the first ``num_dense_layers`` use a dense MLP)."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: int | None = None
    """Per-head width; None means ``hidden_size // num_heads`` (resolved by :attr:`attn_head_dim`)."""
    rope_theta: float = 10000.0
    """Rotary-position base."""
    dense_intermediate_size: int = 64
    """Intermediate width of the dense MLP of the first layers."""
    num_dense_layers: int = 0
    """The first k layers use a dense MLP instead of experts (DeepSeek-V3 uses 3)."""
    moe_layer_step: int = 1
    """From ``num_dense_layers`` on, layer i has experts when ``(i + 1) % moe_layer_step == 0`` (Qwen3-MoE's
    ``decoder_sparse_step``); 1: every layer."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense MLP whatever the two rules above say (Qwen3-MoE's ``mlp_only_layers``)."""
    attention: str = "gqa"
    """Attention, a name of :data:`moe.models.ATTENTIONS`: ``gqa`` (grouped-query with rotary positions),
    ``gqa-qk-norm`` (Qwen3: an RMSNorm over each head's q and k before the rotary embedding) or ``mla``
    (DeepSeek-V3's multi-head latent attention, shaped by the ``*_lora_rank``, ``*_head_dim`` and ``rope_*``
    fields; ``num_kv_heads`` and ``head_dim`` are not used)."""
    q_lora_rank: int | None = None
    """MLA: width of the query latent (V3: 1536); None projects queries straight from the hidden state."""
    kv_lora_rank: int = 16
    """MLA: width of the key/value latent (V3: 512)."""
    qk_nope_head_dim: int = 8
    """MLA: per-head query/key dims without position (V3: 128)."""
    qk_rope_head_dim: int = 4
    """MLA: per-head rotary query/key dims, the rotary key shared by all heads (V3: 64); even."""
    v_head_dim: int = 8
    """MLA: per-head value dims (V3: 128)."""
    rope_type: str = "default"
    """Rotary scaling: ``default`` (plain RoPE) or ``yarn`` (MLA only; V3's long-context extension)."""
    rope_factor: float | None = None
    """YaRN: how many times the pre-training context is stretched (V3: 40)."""
    rope_original_max_position_embeddings: int | None = None
    """YaRN: the pre-training context length (V3: 4096)."""
    rope_beta_fast: float = 32.0
    """YaRN: rotary pairs turning more than this many times over the original context keep their frequency."""
    rope_beta_slow: float = 1.0
    """YaRN: rotary pairs turning fewer than this many times are interpolated by ``rope_factor``."""
    rope_mscale: float | None = None
    """YaRN: numerator mscale of the cos/sin attention factor (V3: 1.0)."""
    rope_mscale_all_dim: float | None = None
    """YaRN: denominator mscale of the cos/sin factor and DeepSeek's softmax-scale correction (V3: 1.0)."""
    rope_attention_factor: float | None = None
    """YaRN: the cos/sin factor itself; None infers it from ``rope_factor`` and the two mscales."""
    rope_truncate: bool = True
    """YaRN: round the frequency ramp's ends to whole dims (transformers' default)."""
    rope_interleave: bool = True
    """MLA: rotary pairs are adjacent dims ``(2i, 2i+1)`` (DeepSeek's layout) rather than ``(i, i + R/2)``."""
    num_experts: int = 8
    """Routed experts E."""
    num_shared_experts: int = 1
    """Shared experts, fused into one MLP of ``num_shared_experts * moe_intermediate_size`` width."""
    moe_intermediate_size: int = 16
    """Intermediate width F of one expert."""
    top_k: int = 2
    """Routed experts per token."""
    n_group: int = 1
    """Expert groups for group-limited routing (1 disables it)."""
    topk_group: int = 1
    """Groups a token may pick experts from (caps the nodes a token is sent to)."""
    router_scoring: str = "sigmoid"
    """``sigmoid`` (DeepSeek-V3: independent scores, group-limited selection) or ``softmax`` (Qwen3-MoE: a
    softmax over the experts, then top-k; no groups)."""
    route_scale: float = 1.0
    """Multiplier on the routing weights (DeepSeek-V3: 2.5; ``routed_scaling_factor`` in config.json)."""
    norm_topk_prob: bool = True
    """Normalise the chosen experts' scores to sum to 1 before ``route_scale`` (DeepSeek-V3: True)."""
    bias_update_rate: float = 1e-3
    """Auxiliary-loss-free balancing: step of the per-expert bias nudge (gamma in the V3 report)."""
    seq_aux_loss_coef: float = 0.0
    """Weight of the sequence-wise balance loss (0 disables it; V3 uses 1e-4)."""
    router_aux_loss_coef: float = 0.0
    """Weight of Qwen3-MoE's load-balancing loss, config.json's ``router_aux_loss_coef`` (softmax routers; 0
    disables it): Switch Transformer's ``E * sum_e f_e * P_e`` over a micro-batch's tokens, ``f_e`` the
    fraction of tokens choosing expert e (summing to top_k), ``P_e`` its mean softmax probability. Computed per
    MoE layer and averaged over the layers; transformers pools every layer's router logits before the two
    means (one loss coupling all layers, so all pipeline stages), Megatron-LM adds each layer's loss at the
    full weight. Equal to transformers' for one MoE layer (:func:`moe.models.router.load_balancing_loss`)."""
    mtp_layers: int = 0
    """Multi-token-prediction modules after the last block (DeepSeek-V3 report section 2.2; config.json's
    ``num_nextn_predict_layers``): module k predicts token i+k+1 from module k-1's hidden state and token
    i+k's embedding, sharing the embedding and the output head (:mod:`moe.models.mtp`). 0: none."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal initialisation of every matrix."""

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "dense_intermediate_size": self.dense_intermediate_size,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"MoEConfig.{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.attention == "mla":
            self._check_mla()
        else:
            if self.head_dim is None and self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} does not split into {self.num_heads} heads")
            if self.attn_head_dim % 2:
                raise ValueError(f"head_dim={self.attn_head_dim} must be even for rotary embeddings")
            if self.rope_type != "default":  # the GQA blocks compute plain RoPE only: refuse, never ignore
                raise ValueError(f"rope_type={self.rope_type!r} is built for attention='mla' only")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"num_dense_layers={self.num_dense_layers} not in [0, {self.num_layers}]")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than num_experts={self.num_experts}")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} does not split into n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} is larger than n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"top_k={self.top_k} exceeds the experts of the {self.topk_group} eligible groups "
                f"({self.topk_group * (self.num_experts // self.n_group)})"
            )
        if min(self.num_shared_experts, self.seq_aux_loss_coef, self.bias_update_rate, self.mtp_layers) < 0:
            raise ValueError("num_shared_experts, seq_aux_loss_coef, bias_update_rate and mtp_layers must be >= 0")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        if self.router_aux_loss_coef and self.router_scoring != "softmax":
            raise ValueError("router_aux_loss_coef is the softmax router's balance loss: set router_scoring='softmax'")
        from moe.models import ATTENTIONS  # the registry holds the modules; imported here, not at import time

        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: choose one of {tuple(ATTENTIONS)}")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router_scoring={self.router_scoring!r}: choose one of {ROUTER_SCORINGS}")
        if self.router_scoring == "softmax" and self.n_group != 1:
            raise ValueError(f"router_scoring='softmax' takes no expert groups (n_group={self.n_group})")
        if self.moe_layer_step < 1:
            raise ValueError(f"moe_layer_step={self.moe_layer_step} must be >= 1")
        self.dense_layers = tuple(self.dense_layers)  # a TOML array arrives as a list
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers={self.dense_layers} outside [0, {self.num_layers})")

    def _check_mla(self) -> None:
        sizes = {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"MoEConfig.{name} must be positive, got {value}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings")
        from moe.models.rope import RopeConfig  # validates rope_type and YaRN's required fields

        RopeConfig.from_moe_config(self)

    @property
    def attn_head_dim(self) -> int:
        """The per-head width in use (``head_dim``, or ``hidden_size // num_heads`` when unset)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` uses routed experts (``num_dense_layers``, ``moe_layer_step``,
        ``dense_layers``). The multi-token-prediction modules (layers ``num_layers ..``) always do."""
        if layer >= self.num_layers:
            return True
        return (
            layer >= self.num_dense_layers and (layer + 1) % self.moe_layer_step == 0 and layer not in self.dense_layers
        )

    @property
    def moe_layers(self) -> list[int]:
        """The layers with routed experts, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def replace(self, **changes: object) -> MoEConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


_PRESETS: dict[str, MoEConfig] = {
    # Tests and the CPU demo: small enough for several gloo ranks on two cores; byte-level vocabulary, and
    # layers enough for DualPipeV at pp=2 (4 stages).
    "tiny": MoEConfig(vocab_size=256, num_layers=4),
    # One GPU: V3 proportions at ~1/16 width.
    "small": MoEConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        dense_intermediate_size=2816,
        num_dense_layers=1,
        num_experts=64,
        num_shared_experts=1,
        moe_intermediate_size=256,
        top_k=8,
        n_group=8,
        topk_group=4,
        route_scale=2.5,
        seq_aux_loss_coef=1e-4,
    ),
    # A node of 8 GPUs (EP=8): V3 expert layout at reduced depth and width.
    "medium": MoEConfig(
        vocab_size=129280,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        dense_intermediate_size=10944,
        num_dense_layers=1,
        num_experts=256,
        num_shared_experts=1,
        moe_intermediate_size=1408,
        top_k=8,
        n_group=8,
        topk_group=4,
        route_scale=2.5,
        seq_aux_loss_coef=1e-4,
    ),
    # DeepSeek-V3 sizes (GQA in place of MLA): 61 layers, 3 dense, 256 experts, top-8 over 4 of 8 groups.
    "v3": MoEConfig(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=128,
        dense_intermediate_size=18432,
        num_dense_layers=3,
        num_experts=256,
        num_shared_experts=1,
        moe_intermediate_size=2048,
        top_k=8,
        n_group=8,
        topk_group=4,
        route_scale=2.5,
        seq_aux_loss_coef=1e-4,
    ),
    # The published architectures, each field what its config.json says (tests/moe/models/test_presets.py reads
    # the config.json values through moe.hf.from_hf_config and compares). Training-only fields keep what the
    # reader gives a checkpoint: the selection-bias step (DeepSeek-V3: the default; the softmax routers:
    # none) and no sequence-wise loss.
    # deepseek-ai/DeepSeek-V3 (671B), with its one multi-token-prediction module (num_nextn_predict_layers).
    "deepseek-v3": MoEConfig(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rope_type="yarn",
        rope_factor=40.0,
        rope_original_max_position_embeddings=4096,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        rope_interleave=True,
        dense_intermediate_size=18432,
        num_dense_layers=3,
        num_experts=256,
        num_shared_experts=1,
        moe_intermediate_size=2048,
        top_k=8,
        n_group=8,
        topk_group=4,
        router_scoring="sigmoid",
        route_scale=2.5,
        norm_topk_prob=True,
        mtp_layers=1,
        norm_eps=1e-6,
    ),
    # deepseek-ai/DeepSeek-V2-Lite (16B): no query latent, the softmax router's greedy top-6 of 64 with the
    # weights left unnormalised and unscaled, 2 shared experts, YaRN with mscale = mscale_all_dim = 0.707.
    # No reader maps its config.json (model_type deepseek_v2): a preset to train, not a checkpoint to load.
    "deepseek-v2-lite": MoEConfig(
        vocab_size=102400,
        hidden_size=2048,
        num_layers=27,
        num_heads=16,
        num_kv_heads=16,
        attention="mla",
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rope_type="yarn",
        rope_factor=40.0,
        rope_original_max_position_embeddings=4096,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=0.707,
        rope_mscale_all_dim=0.707,
        rope_interleave=True,
        dense_intermediate_size=10944,
        num_dense_layers=1,
        num_experts=64,
        num_shared_experts=2,
        moe_intermediate_size=1408,
        top_k=6,
        router_scoring="softmax",
        route_scale=1.0,
        norm_topk_prob=False,
        bias_update_rate=0.0,  # topk_method "greedy": no selection bias
        norm_eps=1e-6,
    ),
    # Qwen/Qwen3-30B-A3B: every layer routed (decoder_sparse_step 1, mlp_only_layers []); the dense MLP width
    # is config.json's intermediate_size, which no layer of this model uses.
    "qwen3-30b-a3b": MoEConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        attention="gqa-qk-norm",
        dense_intermediate_size=6144,
        num_experts=128,
        num_shared_experts=0,
        moe_intermediate_size=768,
        top_k=8,
        router_scoring="softmax",
        route_scale=1.0,
        norm_topk_prob=True,
        bias_update_rate=0.0,  # Qwen3-MoE balances with an auxiliary loss, not a selection bias
        router_aux_loss_coef=0.001,
        norm_eps=1e-6,
    ),
    # Qwen/Qwen3-235B-A22B: as qwen3-30b-a3b, wider and deeper.
    "qwen3-235b-a22b": MoEConfig(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        attention="gqa-qk-norm",
        dense_intermediate_size=12288,
        num_experts=128,
        num_shared_experts=0,
        moe_intermediate_size=1536,
        top_k=8,
        router_scoring="softmax",
        route_scale=1.0,
        norm_topk_prob=True,
        bias_update_rate=0.0,
        router_aux_loss_coef=0.001,
        norm_eps=1e-6,
    ),
}
# CPU shapes of the two families (tests, demos): the published architecture, shrunk (byte-level vocabulary, 4
# layers for DualPipeV at pp=2, 8 experts that ep=2 divides, widths that run in milliseconds); every other field,
# every architecture feature, is the published one.
_PRESETS["deepseek-v3-tiny"] = _PRESETS["deepseek-v3"].replace(
    # MLA with a query latent, YaRN with an original context of 16 (so the interpolated frequencies matter on
    # short sequences), top-2 over 2 of 4 groups, a dense first layer; interleave, the shared expert and the
    # 2.5 scale as published.
    vocab_size=256,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rope_factor=4.0,
    rope_original_max_position_embeddings=16,
    dense_intermediate_size=64,
    num_dense_layers=1,
    num_experts=8,
    moe_intermediate_size=16,
    top_k=2,
    n_group=4,
    topk_group=2,
)
_PRESETS["qwen3-moe-tiny"] = _PRESETS["qwen3-30b-a3b"].replace(
    # q/k norms, a head width (16) other than hidden / heads (8), grouped kv heads, the softmax router's top-2
    # of 8 renormalised, no shared expert, rope base 1e6.
    vocab_size=256,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dense_intermediate_size=64,
    num_experts=8,
    moe_intermediate_size=16,
    top_k=2,
)
PRESETS: Mapping[str, MoEConfig] = MappingProxyType(_PRESETS)


def preset(name: str, **changes: object) -> MoEConfig:
    """A copy of preset ``name`` with ``changes`` applied (``KeyError`` lists the known presets)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)
