"""Published training runs the planner can express, each with its sources: what ``moe.plan --published`` reruns.

A :class:`PublishedRun` is one run as its source states it: the model (a preset of
:data:`moe.models.config.PRESETS`), the device and cluster, the layout (schedule, pp, dp, ep, micro-batches,
recompute, stage layout), the batch and sequence length, the precision, the memory options, and the
tokens/s/GPU as published. Where a source does not state a detail, the entry says so in its ``notes`` and
takes the planner's default; nothing here was chosen by comparing a prediction with a run.

Only runs without tensor or context parallelism: the planner lays out pp x dp x ep alone, so a run with
TP > 1 or CP > 1 is refused (:class:`PublishedRun` raises) and listed in :data:`SKIPPED` with the reason.
:mod:`moe.plan.reruns` times and sizes each at its layout and breaks down the gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from moe.plan.costs import MemoryOptions, Precision
from moe.plan.search import Candidate

__all__ = ["DEEPSEEK_V3_REPORT", "RUNS", "SKIPPED", "PublishedRun", "Source"]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a figure was published and the figure as published."""

    where: str
    """URL, repository file at a commit, or paper and section/table."""
    quote: str
    """The numbers as published there (and how the entry's value follows from them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    """One published training run at its own layout, precision and device."""

    name: str
    model: str
    """A preset of :data:`moe.models.config.PRESETS`."""
    gpu: str
    """A device profile of :data:`moe.plan.hardware.GPUS`."""
    gpus: int
    gpus_per_node: int
    layout: Candidate
    """The run's schedule, pp, dp, ep, micro-batches per step, comm SMs, recompute and stage layout; ``auto``
    where the source states none (then the planner's layout, as ``--deepseek-v3`` picks it)."""
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    micro_batch: int
    precision: Precision
    options: MemoryOptions
    tokens_per_s_per_gpu: float
    """As published (or as it follows from the published figures: see the sources)."""
    sources: tuple[Source, ...]
    memory_gb: float | None = None
    """Memory per GPU the source states, decimal GB (None: not stated)."""
    memory_note: str = "not stated"
    """What the source says of memory, in words."""
    model_tflops_per_gpu: float | None = None
    """Model TFLOP/s per GPU as published (None: not stated): with the tokens/s, the FLOPs per token it counts."""
    dp_overlapped: Source | None = None
    """Where the source says the data-parallel gradient reduction overlaps the backward (the planner adds it
    after the pipeline: :mod:`moe.plan.reruns` then sizes that as a term of the gap)."""
    notes: tuple[str, ...] = ()
    """What the run does that the planner does not model or takes nominally, each with its source."""
    figures: Mapping[str, float] = field(default_factory=dict)
    """Other published figures the side-by-side reports (by name)."""
    tensor_parallel: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel != 1 or self.context_parallel != 1:
            raise ValueError(
                f"{self.name}: TP={self.tensor_parallel} CP={self.context_parallel} is not expressible: the planner "
                "lays out pp x dp x ep only (list it in moe.plan.published.SKIPPED)"
            )
        if not self.sources:
            raise ValueError(f"{self.name}: a published run needs a source")
        if self.layout.pp * self.layout.dp != self.gpus:
            raise ValueError(f"{self.name}: pp x dp = {self.layout.pp * self.layout.dp}, not its {self.gpus} GPUs")
        if self.layout.num_chunks * self.layout.dp * self.micro_batch != self.global_batch:
            raise ValueError(f"{self.name}: chunks x dp x micro-batch is not its global batch {self.global_batch}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


# DeepSeek-V3 technical report (arXiv 2412.19437): the numbers the planner is set beside, never fitted to.
_V3 = "DeepSeek-V3 technical report (arXiv 2412.19437)"
DEEPSEEK_V3_REPORT = PublishedRun(
    name="DeepSeek-V3 report",
    model="deepseek-v3",
    gpu="h800",
    gpus=2048,
    gpus_per_node=8,
    # 3.2: DualPipe over 16-way PP, 64-way EP over 8 nodes, ZeRO-1 DP; 3.2.2: 20 of 132 SMs communicate. 3.2.3:
    # recompute of every RMSNorm and MLA up-projection (the planner's selective). No stage layout is stated.
    layout=Candidate("dualpipe", 16, 128, 64, 120, 20, "selective"),
    seq_len=4096,
    global_batch=15360,
    micro_batch=1,
    # 3.3: FP8 GEMMs (Fprop, Dgrad, Wgrad) for the linears, 1x128 / 128x128 tiles; 3.3.4: the activation before the
    # MoE up-projections dispatched in FP8 (and the gradient before the down-projections), combine in bf16.
    precision=Precision(fp8=True),
    # 3.2.3 and 3.3.3: what fits the 80 GB of an H800 (each a planner option, modelled as footprint.py says;
    # fp8_activations caches the routed experts' inputs in FP8 as the report does, but keeps the output
    # projection's input in bf16 where the report uses E5M6).
    options=MemoryOptions(state_dtype="bfloat16", fp8_activations=True, mtp_shared=True),
    # Table 1: 2664K H800 GPU hours of pre-training for 14.8T tokens (section 4.1): 14.8e12 / (2.664e6 x 3600 s)
    # = 1,543 tokens/s per GPU; the same as "180K H800 GPU hours per trillion tokens" (section 1: 2664K / 14.8).
    tokens_per_s_per_gpu=14.8e12 / (2.664e6 * 3600),
    sources=(
        Source(
            f"{_V3}, Table 1 and section 4.1",
            "pre-training 2664K H800 GPU hours for 14.8T tokens: "
            "14.8e12 / (2,664,000 x 3,600 s) = 1,543 tokens/s per GPU (section 1: 180K GPU hours per trillion "
            "tokens)",
        ),
        Source(
            f"{_V3}, section 3.2 and 3.2.2",
            "2,048 H800 GPUs, 8 per node; 16-way PP (DualPipe), 64-way EP over 8 "
            "nodes, ZeRO-1 DP; 20 SMs for communication",
        ),
        Source(
            f"{_V3}, section 4.2",
            "sequence length 4K; batch size 15,360 (after a ramp from 3,072 over the first 469B tokens)",
        ),
        Source(
            f"{_V3}, sections 3.2.3, 3.3",
            "recompute of RMSNorm and MLA up-projections; FP8 GEMMs, FP8 dispatch; AdamW moments in BF16",
        ),
    ),
    memory_gb=80,
    memory_note="fits in the H800's 80 GB with these options (3.2.3); no per-GPU figure",
    notes=(
        f"batch ramp 3,072 -> 15,360 sequences over the first 469B of 14.8T tokens ({_V3}, 4.2): smaller steps, "
        "more bubble",
        f"whether the 2,664K GPU hours include restarts, evaluation or stragglers is not stated ({_V3}, Table 1: "
        "'the official training of DeepSeek-V3' only); the report states no rollback (section 1)",
        f"expert load: auxiliary-loss-free balancing ({_V3}, 2.1.2); no imbalance figure for the run, so the "
        "planner's balanced routing (--expert-imbalance 1)",
    ),
    # 3.2.2: "the computation-to-communication ratio is approximately 1:1" for cross-node EP.
    figures=MappingProxyType({"compute_to_a2a": 1.0}),
)

# Megatron-Bridge's performance summary (the 25.11 NeMo container, DGX-B200 table) and the performance recipes of
# that release (Megatron-Bridge v0.2.0, 2025-11-26). The MoE rows' footnote: "In MoE training benchmarks, we
# force-balance the token distribution among experts and all benchmarks are token-dropless."
_MB_DOC = (
    "Megatron-Bridge docs/performance-summary.md@df0289c1 (2026-02-23; since 26.08 in "
    "docs/performance-summary-archive.md@067f987d, docs.nvidia.com/nemo/megatron-bridge/latest/"
    "performance-summary-archive.html)"
)
_MB = f"{_MB_DOC}, '25.11 NeMo Container', 'System: DGX-B200'"
_MB_COLUMNS = "Model | #-GPUs | Precision | GBS | MBS | Sequence Length | FSDP | TP | PP | CP | VP | EP | GA | Tokens / sec / GPU | Model TFLOP / sec / GPU"  # noqa: E501
_MB_BALANCED = Source(
    f"{_MB}, footnote",
    "'In MoE training benchmarks, we force-balance the token distribution among experts and all benchmarks are "
    "token-dropless': balanced routing (--expert-imbalance 1)",
)
_MB_RECIPES = "Megatron-Bridge v0.2.0 (2025-11-26)"
_MXFP8 = (
    "MXFP8 (the summary's FP8-MX: 1x32 blocks with an E8M0 scale, 'GB200 and B200 systems, 32x32'): the planner "
    "times these GEMMs at the B200's dense FP8 peak x the Hopper fraction of the same shape class (moe/plan/"
    "efficiency.py: no B200 figure is published) and moves 1 + 1/32 bytes an element, what DeepSeek's 1 + 4/128 "
    "(fp32 per 128) also is; not modelled: the second, column-wise quantized copy MXFP8 keeps for the weight gradient"
)
_NCCL_A2A = (
    "all-to-all through Megatron's default dispatcher (the recipe sets no moe_flex_dispatcher_backend: NCCL, not "
    "DeepEP), timed at DeepEP's published B200 rates; the SMs it takes are not stated (none reserved here)"
)

MEGATRON_BRIDGE_V3_B200 = PublishedRun(
    name="Megatron-Bridge DeepSeek-V3 (25.11)",
    model="deepseek-v3",
    gpu="b200",
    gpus=256,
    gpus_per_node=8,
    # PP16 (VP 1: plain 1F1B), EP8 inside a node, DP16 with the distributed optimizer; moe_a2a_overlap=False, so no
    # all-to-all is overlapped (the 1F1B family run unpaired); the recipe's layout for (PP 16, VP 1).
    layout=Candidate("1f1b", 16, 16, 8, 128, 0, "selective", "Et*4|(t*4|)*14tmL", overlap=False),
    seq_len=4096,
    global_batch=2048,
    micro_batch=1,
    precision=Precision(fp8=True),
    # distributed_fused_adam: exp_avg and exp_avg_sq in bf16, fp32 main params (the recipe's optimizer).
    options=MemoryOptions(state_dtype="bfloat16", mtp_shared=True),
    tokens_per_s_per_gpu=2139,
    model_tflops_per_gpu=557,
    sources=(
        Source(
            _MB,
            f"{_MB_COLUMNS}: 'DeepSeekV3 (w/ MTP) | 256 | FP8-MX | 2048 | 1 | 4096 | 0 | 1 | 16 | 1 | 1 | 8 | "
            "128 | 2139 | 557'",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/deepseek/workload_base_configs.py, "
            "DEEPSEEK_V3_B200_FP8_MX_BASE_CONFIG",
            "num_gpus=256, pipeline_model_parallel_size=16, "
            "expert_model_parallel_size=8, global_batch_size=2048, recompute_modules=['mla_up_proj'], "
            "moe_a2a_overlap=False (micro_batch_size 1, the WorkloadBaseConfig default)",
        ),
        Source(
            f"{_MB_RECIPES} src/megatron/bridge/recipes/deepseek/deepseek_v3.py, pretrain_config",
            "mtp_num_layers=1; layout_map[(16, 1)] = embedding + 4 decoder | 14 x 4 decoder | decoder + mtp + loss "
            "(Et*4|(t*4|)*14tmL); use_distributed_optimizer=True, overlap_grad_reduce=True; exp_avg_dtype and "
            "exp_avg_sq_dtype bf16, main_grads_dtype bf16",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/deepseek/deepseek_llm_pretrain.py",
            "seq_length 4096, recompute_granularity 'selective', moe_router_force_load_balancing True",
        ),
        _MB_BALANCED,
    ),
    dp_overlapped=Source(
        f"{_MB_RECIPES} src/megatron/bridge/recipes/deepseek/deepseek_v3.py",
        "DistributedDataParallelConfig(overlap_grad_reduce=True, ...); deepseek_v3_b200_config sets "
        "comm_overlap.overlap_grad_reduce = True",
    ),
    notes=(
        _MXFP8,
        _NCCL_A2A,
        "recompute: the run recomputes the MLA up-projections only (recompute_modules=['mla_up_proj']); the "
        "planner's selective also reruns the RMSNorms",
        "gradients: the run keeps and reduces them in bf16 (main_grads_dtype, grad_reduce_in_fp32=False); the "
        "planner sizes and reduces fp32 ones",
    ),
)

MEGATRON_BRIDGE_QWEN3_30B_B200 = PublishedRun(
    name="Megatron-Bridge Qwen3-30B-A3B (25.11)",
    model="qwen3-30b-a3b",
    gpu="b200",
    gpus=8,
    gpus_per_node=8,
    # PP1 x EP8 on one node, DP8; no recompute (set_qwen3_common_configs: recompute_granularity None), no
    # all-to-all overlap (the base config's moe_a2a_overlap default False).
    layout=Candidate("1f1b", 1, 8, 8, 64, 0, "none"),
    seq_len=4096,
    global_batch=512,
    micro_batch=1,
    precision=Precision(fp8=True),
    options=MemoryOptions(state_dtype="bfloat16", mtp_shared=True),
    tokens_per_s_per_gpu=9299,
    model_tflops_per_gpu=214,
    sources=(
        Source(
            _MB,
            f"{_MB_COLUMNS}: 'Qwen3_30B_a3B | 8 | FP8-MX | 512 | 1 | 4096 | 0 | 1 | 1 | 1 | 1 | 8 | 64 | 9299 | 214'",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/qwen3/workload_base_configs.py, "
            "QWEN3_30B_A3B_B200_FP8_MX_BASE_CONFIG",
            "expert_model_parallel_size=8, global_batch_size=512, "
            "num_gpus=8, cuda_graph_scope=['moe_router', 'moe_preprocess'] (no moe_a2a_overlap: False)",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/qwen3/qwen3_llm_pretrain.py, set_qwen3_common_configs",
            "recompute_granularity None, seq_length 4096, moe_router_force_load_balancing True",
        ),
        _MB_BALANCED,
    ),
    notes=(
        _MXFP8,
        _NCCL_A2A,
        "optimizer state: the Qwen3 recipe's dtypes are not read here (bf16 moments taken, as the DeepSeek-V3 "
        "recipe's); the data-parallel overlap of its gradient reduction is not read either",
        "CUDA graphs over the router and the MoE preprocessing (cuda_graph_scope): fewer launches than one per op",
    ),
)

MEGATRON_BRIDGE_QWEN3_235B_B200 = PublishedRun(
    name="Megatron-Bridge Qwen3-235B-A22B (25.11)",
    model="qwen3-235b-a22b",
    gpu="b200",
    gpus=64,
    gpus_per_node=8,
    # PP8 with VP2 (interleaved 1F1B, 2 modules per rank: the planner's interleaved-1f1b), EP8, DP8; its all-to-all
    # overlapped with the other micro-batch's compute (moe_a2a_overlap=True); no recompute.
    layout=Candidate("interleaved-1f1b", 8, 8, 8, 128, 0, "none"),
    seq_len=4096,
    global_batch=1024,
    micro_batch=1,
    precision=Precision(fp8=True),
    options=MemoryOptions(state_dtype="bfloat16", mtp_shared=True),
    tokens_per_s_per_gpu=3269,
    model_tflops_per_gpu=484,
    sources=(
        Source(
            _MB,
            f"{_MB_COLUMNS}: 'Qwen3_235B_a22B | 64 | FP8-MX | 1024 | 1 | 4096 | 0 | 1 | 8 | 1 | 2 | 8 | 128 | "
            "3269 | 484'",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/qwen3/workload_base_configs.py, "
            "QWEN3_235B_A22B_B200_FP8_CS_BASE_CONFIG",
            "num_gpus=64, pipeline_model_parallel_size=8, "
            "expert_model_parallel_size=8, global_batch_size=1024, moe_a2a_overlap=True "
            "(virtual_pipeline_model_parallel_size=4 there; the table's VP 2 is taken)",
        ),
        Source(
            f"{_MB_RECIPES} scripts/performance/configs/qwen3/qwen3_llm_pretrain.py, set_qwen3_common_configs",
            "recompute_granularity None, seq_length 4096, moe_router_force_load_balancing True",
        ),
        _MB_BALANCED,
    ),
    notes=(
        _MXFP8,
        _NCCL_A2A,
        "the summary's VP 2 and the v0.2.0 recipe's VP 4 disagree: the table's (the published number's) is taken",
        "optimizer state: the Qwen3 recipe's dtypes are not read here (bf16 moments taken, as the DeepSeek-V3 "
        "recipe's); the data-parallel overlap of its gradient reduction is not read either",
    ),
)

RUNS: tuple[PublishedRun, ...] = (
    DEEPSEEK_V3_REPORT,
    MEGATRON_BRIDGE_V3_B200,
    MEGATRON_BRIDGE_QWEN3_30B_B200,
    MEGATRON_BRIDGE_QWEN3_235B_B200,
)
"""Every published run ``--published`` reruns, in the order it prints them."""

_MB_H100 = "'System: DGX-H100'"
SKIPPED: tuple[tuple[str, str], ...] = (
    ("Megatron-Bridge Qwen3-235B-A22B on 256 H100 (25.11, 1,575 tokens/s/GPU)",
     f"TP 2 ({_MB_DOC}, '25.11 NeMo Container', {_MB_H100})"),
    ("Megatron-Bridge DeepSeek-V3 on 1,024 H100 (25.09, 1,297 tokens/s/GPU)",
     f"TP 2 ({_MB_DOC}, '25.09 NeMo Container', {_MB_H100})"),
    ("Megatron-Bridge Qwen3-30B-A3B on 16 H100 (25.11, 5,275 tokens/s/GPU)",
     "VP 24: 24 modules per rank; the planner's interleaved 1F1B holds 2 (the same table)"),
    ("Megatron-Bridge runs on DGX-GB200 / GB300 (NVL72)", "no device profile: NVLink domains of 72 GPUs, not 8"),
)  # fmt: skip
"""Published runs found but not expressible, with why."""
