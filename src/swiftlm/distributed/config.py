"""The distributed section of the config: processes, nodes (elastic ranges), rendezvous,
restarts, and the parallel strategies with their options. See `config/sections.py` for how
sections, fields and checks work."""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, within
from swiftlm.config.sections import doc

# What `--fsdp` accepts (ms-swift's spellings of FSDP2's full sharding).
FSDP_SPELLINGS = ("fsdp2", "full_shard", "shard")


# --max_restarts of an elastic job unless given: each node that leaves costs one.
ELASTIC_MAX_RESTARTS = 3


def node_range(nnodes: str) -> tuple[int, int]:
    """(fewest, most) nodes of `--nnodes N` or `--nnodes MIN:MAX` (torchrun's syntax)."""
    low, _, high = str(nnodes).partition(":")
    return int(low), int(high or low)


def _valid_nnodes(nnodes: str) -> bool:
    parts = str(nnodes).split(":")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        return False
    low, high = node_range(nnodes)
    return 1 <= low <= high


@dataclass
class DistArguments:
    nproc_per_node: int = doc(
        "Processes on this node; > 1 starts the job under torchrun (one process per GPU, or "
        "per CPU group with the gloo backend).",
        default=1,
    )
    nnodes: str = doc(
        "Nodes in the job: N, or MIN:MAX for an elastic job (torchrun's c10d rendezvous at "
        "--rdzv_endpoint): nodes may leave and join while it trains; at each change the workers "
        "restart at the new size and resume from the newest checkpoint with the same global "
        "batch (gradient accumulation adjusted). Needs --output_dir, the same on every node.",
        default="1",
    )
    node_rank: int = doc("Rank of this node, 0 .. nnodes-1.", default=0)
    master_addr: str = doc("Address of the rank-0 node.", default="127.0.0.1")
    master_port: int = doc("Port of the rank-0 node.", default=29500)
    rdzv_endpoint: str | None = doc(
        "Elastic jobs: HOST:PORT of the c10d rendezvous (torchrun's --rdzv_endpoint), the same "
        "on every node. The agent on that host keeps the rendezvous and must not leave. "
        "Default: --master_addr:--master_port.",
        default=None,
    )
    rdzv_id: str | None = doc(
        "Elastic jobs: the job's name at the rendezvous (torchrun's --rdzv_id), the same on "
        "every node. Default: derived from --output_dir as given.",
        default=None,
    )
    rdzv_conf: str | None = doc(
        "Elastic jobs: torchrun's --rdzv_conf, e.g. `last_call_timeout=5,join_timeout=600` "
        "(seconds a complete rendezvous waits for more nodes; for the first nodes to arrive).",
        default=None,
    )
    strategy: Literal["auto", "single", "ddp", "fsdp2", "deepspeed", "tp", "pp"] = doc(
        "How the model is spread over processes. auto: single for one process; for several "
        "(sft, pt), the layout `swiftlm plan` recommends for this model, batch and devices "
        "(chosen once before the workers start, printed with its estimates); fsdp2 with "
        "--fsdp, deepspeed with --deepspeed, tp with --tensor_parallel_size > 1.",
        default="auto",
    )
    tensor_parallel_size: int = doc(
        "Split each decoder block's projections (and their LoRA adapters) over this many "
        "processes (DTensor tensor parallel). The other processes form data-parallel groups "
        "sharded by FSDP2 on the same mesh.",
        default=1,
    )
    sequence_parallel_size: int = doc(
        "Sequence parallel (DeepSpeed-Ulysses, ms-swift's flag): each sample's tokens are cut "
        "into this many shards, one per process, and attention swaps sequence shards for head "
        "shards (all-to-all) so each process attends the whole sequence with 1/N of the "
        "heads, or passes key/value shards round a ring (--sequence_parallel_impl). sft and "
        "pt. The other processes form data-parallel groups.",
        default=1,
    )
    sequence_parallel_impl: Literal["auto", "ulysses", "ring"] = doc(
        "How sequence shards attend the whole sequence. ulysses: all-to-all to head shards "
        "(heads and key/value heads must divide by --sequence_parallel_size); ring: key/value "
        "shards passed round the group with an online softmax (any size, N - 1 hops per "
        "layer); auto: ulysses where the heads divide, else ring.",
        default="auto",
    )
    expert_parallel_size: int = doc(
        "Expert parallel for mixture-of-experts models (ms-swift's flag): each MoE layer's "
        "experts are split over this many data-parallel processes, which send each token to "
        "the process holding its expert and get the result back (two all-to-alls per layer). "
        "Must divide the processes and the experts; beside DDP or --fsdp fsdp2; sft and pt.",
        default=1,
    )
    pipeline_parallel_size: int = doc(
        "Split the decoder blocks into this many pipeline stages (1F1B schedule over the "
        "--gradient_accumulation_steps micro-batches; full or LoRA). The other processes form "
        "data-parallel groups: DDP, or FSDP2 with --fsdp fsdp2.",
        default=1,
    )
    deepspeed: str | None = doc(
        "DeepSpeed ZeRO: zero1, zero2, zero3, zero2_offload, zero3_offload, or a JSON config "
        "path (`auto` values are filled from the swiftlm flags).",
        default=None,
    )
    fsdp: str | None = doc(
        "ms-swift spelling: `--fsdp fsdp2` (or `full_shard`) selects --strategy fsdp2.",
        default=None,
    )
    fsdp_offload: bool = doc(
        "FSDP2 on GPUs: keep the sharded weights, gradients and optimizer states in CPU memory "
        "(CPUOffloadPolicy); the optimizer step then runs on the CPU.",
        default=False,
    )
    max_restarts: int | None = doc(
        "Restart failed workers up to N times; each restart resumes from the newest complete "
        "checkpoint. Default: 0, or 3 with --nnodes MIN:MAX (a node that leaves fails its "
        "peers' workers once; nodes that join cost no restart).",
        default=None,
    )
    heartbeat_timeout: float = doc(
        "Seconds a rank may go without progress (stuck in a collective, or dead) before every "
        "rank stops with an error naming it. 0 disables.",
        default=600.0,
    )
    dist_timeout: float = doc(
        "Timeout of every collective (process-group timeout), seconds.", default=1800.0
    )
    grad_compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = doc(
        "DDP gradient compression before the all-reduce: half precision, PowerSGD low-rank, or "
        "top-k sparsification with error feedback.",
        default="none",
    )
    topk_ratio: float = doc("Share of gradient entries top-k compression sends.", default=0.1)
    async_save: bool = doc(
        "Write checkpoints in the background while training continues: the weights and "
        "optimizer are copied to CPU memory (pinned on GPUs; one more copy of the checkpoint's "
        "tensors in memory) at the save, then written by a "
        "thread (one process, DDP, pipeline stages, --incremental_checkpoints; FSDP2 and tensor "
        "parallel through DCP's async_save). One save is in flight at a time; COMPLETE is "
        "written when its files are, and a failed write stops the run at the next save. "
        "DeepSpeed's engine writes its checkpoints synchronously.",
        default=False,
    )
    incremental_checkpoints: bool = doc(
        "One process or DDP: store each checkpoint's weights and optimizer state as "
        "content-addressed blocks (4 MiB) in <output_dir>/checkpoints/blocks/, shared by the "
        "run's checkpoints, with a blocks.json manifest per checkpoint: a block that did not "
        "change (frozen weights, unchanged optimizer entries) is not written again. Such a "
        "checkpoint resumes with swiftlm but is not a folder transformers/peft load as is (the "
        "default, false, writes folders that are); final/ is always in the standard format.",
        default=False,
    )

    def __post_init__(self):
        check_fields(
            self,
            nproc_per_node=at_least(1),
            nnodes=custom(
                _valid_nnodes,
                "--{flag} {value}: give a node count N >= 1, or MIN:MAX (1 <= MIN <= MAX)",
            ),
            node_rank=at_least(0),
            master_port=within(0, 65535),
            tensor_parallel_size=at_least(1, note="1: off"),
            sequence_parallel_size=at_least(1, note="1: off"),
            pipeline_parallel_size=at_least(1, note="1: off"),
            expert_parallel_size=at_least(1, note="1: off"),
            fsdp=custom(
                lambda v: v in FSDP_SPELLINGS,
                "--{flag} {value}: use fsdp2 (FSDP2, fully_shard per layer)",
            ),
            max_restarts=at_least(0),
            heartbeat_timeout=at_least(0, note="0 disables it"),
            dist_timeout=above(0),
            topk_ratio=custom(
                lambda v: 0 < v <= 1,
                "--{flag} {value}: must be in (0, 1], the fraction of gradient entries each rank "
                "sends (e.g. 0.1)",
            ),
        )

    @property
    def elastic(self) -> bool:
        """--nnodes MIN:MAX with MIN < MAX: nodes may leave and join while the job trains."""
        low, high = node_range(self.nnodes)
        return low < high

    @property
    def restarts(self) -> int:
        """--max_restarts, or its default: 0, or 3 for an elastic job."""
        if self.max_restarts is not None:
            return self.max_restarts
        return ELASTIC_MAX_RESTARTS if self.elastic else 0
