"""Built-in duration profiles for simulated executors and the simulator.

``resnet50-v100`` is ResNet50 v2 on an NVIDIA V100 as measured in the Clockwork paper
(Gujarati et al., OSDI 2020): weights 102 MB = 7 pages of 16 MiB, LOAD 8.3 ms over PCIe,
execute 2.73 / 4.05 / 5.88 / 9.93 / 17.33 ms at batch 1 / 2 / 4 / 8 / 16; a 32 GB V100 holds
1,376 such pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
MS_NS = 1_000_000


@dataclass(frozen=True, slots=True)
class SimProfile:
    """Durations of one model on one simulated device, and that device's page budget."""

    name: str
    execute_ns: dict[int, int]  # batch size -> execute duration
    load_ns: int
    weights_bytes: int
    weights_pages: int
    page_bytes: int = 16 * MIB
    pages_total: int = 1376
    input_shape: tuple[int, ...] = field(default=(3, 224, 224))  # per item, float32

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.execute_ns))


RESNET50_V100 = SimProfile(
    name="resnet50-v100",
    execute_ns={
        1: 2_730_000,
        2: 4_050_000,
        4: 5_880_000,
        8: 9_930_000,
        16: 17_330_000,
    },
    load_ns=8_300_000,
    weights_bytes=102 * 1_000_000,
    weights_pages=7,
)

BUILTIN_PROFILES: dict[str, SimProfile] = {RESNET50_V100.name: RESNET50_V100}
