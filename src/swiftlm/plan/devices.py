"""The hardware a plan is for: `--devices 8xH100` (a built-in table of GPUs and their links)
or `--devices 2xcpu` (this machine, measured once by the probe in `probe.py`).

Table values are the vendors' data sheets: dense bf16 tensor-core FLOP/s (fp16 on V100, which
has no bf16), memory, memory bandwidth, the intra-node link per GPU and direction (NVLink
generation or PCIe) and the usual inter-node network per GPU (InfiniBand or Ethernet).
"""

from dataclasses import dataclass, replace

from swiftlm.errors import ConfigError
from swiftlm.monitor.mfu import GPU_PEAKS

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process's share of this machine) and its links."""

    name: str
    kind: str  # "gpu" or "cpu"
    flops: float  # achievable dense matmul FLOP/s in the compute dtype (table peak for GPUs)
    memory_bytes: float  # what one process may use
    memory_bandwidth: float  # bytes/s: what the optimizer step streams through
    intra_link: str
    intra_bandwidth: float  # bytes/s per device per direction inside a node (collective bus bw)
    inter_link: str
    inter_bandwidth: float  # bytes/s per device per direction between nodes
    baseline_bytes: float = 0.0  # runtime memory before the model (CPU: measured probe)
    baseline_deepspeed_bytes: float = 0.0  # the same with DeepSpeed imported
    collective_latency: float = 10e-6  # seconds per collective (CPU: measured by the probe)
    fp32_flops: float = 0.0  # CPU: matmul FLOP/s in float32 (full weights stay float32)
    # Bus bandwidth of reduce-scatter and all-gather inside a node when it differs from the
    # all-reduce's (gloo, measured by the probe); None: the same (NCCL's rings).
    reduce_scatter_bandwidth: float | None = None
    allgather_bandwidth: float | None = None

    def bandwidth(self, collective: str, spans_nodes: bool = False) -> float:
        """Bus bandwidth of `collective` ("all_reduce", "reduce_scatter", "all_gather",
        "all_to_all"). An all-to-all sends (n-1)/n of its buffer per rank, as an all-gather
        does: on gloo, where the probe measures no all-to-all, it runs at the all-gather's."""
        if spans_nodes:
            return self.inter_bandwidth
        own = {
            "reduce_scatter": self.reduce_scatter_bandwidth,
            "all_gather": self.allgather_bandwidth,
            "all_to_all": self.allgather_bandwidth,
        }
        return own.get(collective) or self.intra_bandwidth


def _gpu(name, flops, memory_gb, hbm_tbs, intra, intra_gbs, inter, inter_gbs) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        kind="gpu",
        flops=flops,
        memory_bytes=memory_gb * GB,
        memory_bandwidth=hbm_tbs * 1e12,
        intra_link=intra,
        intra_bandwidth=intra_gbs * GB,
        inter_link=inter,
        inter_bandwidth=inter_gbs * GB,
    )


GPUS = {
    "H100": _gpu("H100 SXM 80GB", GPU_PEAKS["H100"], 80, 3.35, "NVLink4", 450, "IB NDR 400G", 50),
    "H100-PCIE": _gpu("H100 PCIe 80GB", 756e12, 80, 2.0, "PCIe Gen5", 64, "IB NDR 400G", 50),
    "H200": _gpu("H200 SXM 141GB", GPU_PEAKS["H200"], 141, 4.8, "NVLink4", 450, "IB NDR 400G", 50),
    "A100-80G": _gpu(
        "A100 SXM 80GB", GPU_PEAKS["A100"], 80, 2.04, "NVLink3", 300, "IB HDR 200G", 25
    ),
    "A100-40G": _gpu(
        "A100 SXM 40GB", GPU_PEAKS["A100"], 40, 1.55, "NVLink3", 300, "IB HDR 200G", 25
    ),
    "L40S": _gpu("L40S 48GB", GPU_PEAKS["L40S"], 48, 0.864, "PCIe Gen4", 25, "Ethernet 100G", 12.5),
    "A10G": _gpu("A10G 24GB", GPU_PEAKS["A10"], 24, 0.6, "PCIe Gen4", 25, "Ethernet 100G", 12.5),
    "L4": _gpu("L4 24GB", GPU_PEAKS["L4"], 24, 0.3, "PCIe Gen4", 25, "Ethernet 100G", 12.5),
    "RTX4090": _gpu(
        "RTX 4090 24GB", GPU_PEAKS["4090"], 24, 1.0, "PCIe Gen4", 25, "Ethernet 10G", 1.25
    ),
    "V100": _gpu(
        "V100 SXM2 32GB (fp16)", GPU_PEAKS["V100"], 32, 0.9, "NVLink2", 150, "IB EDR 100G", 12.5
    ),
    "MI300X": _gpu("MI300X 192GB", 1307e12, 192, 5.3, "Infinity Fabric", 448, "IB NDR 400G", 50),
}
# Other spellings users type for the same devices.
ALIASES = {
    "H100-SXM": "H100",
    "H100SXM": "H100",
    "H100PCIE": "H100-PCIE",
    "A100": "A100-80G",
    "A100-80GB": "A100-80G",
    "A100-40GB": "A100-40G",
    "A10": "A10G",
    "4090": "RTX4090",
    "RTX-4090": "RTX4090",
}
CPU = "CPU"


@dataclass(frozen=True)
class Cluster:
    """`count` devices per node on `nnodes` nodes."""

    device: DeviceSpec
    per_node: int
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.per_node * self.nnodes

    def label(self) -> str:
        nodes = f" x {self.nnodes} nodes" if self.nnodes > 1 else ""
        return f"{self.per_node}x {self.device.name}{nodes}"


def known_devices() -> str:
    return ", ".join([*GPUS, "cpu"])


def parse_devices(value: str, nnodes: int = 1, memory_gib: float | None = None) -> Cluster:
    """`8xH100`, `H100` (one), `2xcpu`, `cpu` -> a Cluster. CPUs are probed (cached);
    `memory_gib` replaces the device's memory (a budget per device)."""
    count_text, sep, name = str(value).strip().partition("x")
    if not sep or not count_text.isdigit():
        count_text, name = "1", str(value).strip()
    key = name.upper().replace("_", "-").replace(" ", "")
    key = ALIASES.get(key, key)
    if key not in GPUS and key != CPU:
        raise ConfigError(
            f"--devices {value}: unknown device '{name}'; give COUNTxDEVICE (e.g. 8xH100, "
            f"2xcpu) with a device among: {known_devices()}"
        )
    count = int(count_text)
    if count < 1:
        raise ConfigError(f"--devices {value}: the count must be at least 1 (e.g. 8xH100)")
    if key == CPU:
        from swiftlm.plan.probe import cpu_device

        device = cpu_device(count)
    else:
        device = GPUS[key]
    if memory_gib is not None:
        device = replace(device, memory_bytes=memory_gib * GIB)
    return Cluster(device, count, nnodes)
