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

# A small, fast profile for tests of simulated executors: 3 MiB of weights (one 16 MiB page),
# inputs of 4 floats, sub-millisecond to 2 ms actions.
TINY_SIM = SimProfile(
    name="tiny-sim",
    execute_ns={1: 500_000, 2: 600_000, 4: 800_000, 8: 1_200_000, 16: 2_000_000},
    load_ns=1_000_000,
    weights_bytes=3 * MIB,
    weights_pages=1,
    input_shape=(4,),
)

BUILTIN_PROFILES: dict[str, SimProfile] = {
    profile.name: profile for profile in (RESNET50_V100, TINY_SIM)
}


# --- Profile files (appended; built-in profiles above stay the reference) -------------------


class ProfileError(ValueError):
    """An unknown profile name, or a profile file that cannot be read or is malformed."""


def resolve_profile(name_or_path: str) -> SimProfile:
    """A built-in profile by name, else a profile file (TOML or JSON) by path.

    Raises ProfileError naming the known built-in profiles when neither exists.
    """
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    if name_or_path.endswith((".toml", ".json")) or "/" in name_or_path:
        return load_profile_file(name_or_path)
    known = ", ".join(sorted(BUILTIN_PROFILES))
    raise ProfileError(f"unknown profile {name_or_path!r}; known profiles: {known}")


def load_profile_file(path: str) -> SimProfile:
    """Read a profile file: TOML (``.toml``) or JSON, with keys ``name``, ``execute_ms``
    (batch size -> ms), ``load_ms``, ``weights_bytes``, and optionally ``weights_pages``
    (default: weights rounded up to pages), ``page_bytes``, ``pages_total``.

    Raises ProfileError on a missing file, bad syntax, or missing/invalid fields.
    """
    import json
    import tomllib

    try:
        with open(path, "rb") as stream:
            raw = tomllib.load(stream) if path.endswith(".toml") else json.load(stream)
    except (OSError, ValueError) as error:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ProfileError(f"cannot read profile file {path}: {error}") from None
    try:
        return _profile_from_mapping(raw)
    except (KeyError, TypeError, ValueError) as error:
        raise ProfileError(f"bad profile file {path}: {error!r}") from None


def _profile_from_mapping(raw: dict[str, object]) -> SimProfile:
    execute_ms = raw["execute_ms"]
    if not isinstance(execute_ms, dict) or not execute_ms:
        raise ValueError("execute_ms must map batch sizes to milliseconds")
    execute_ns = {int(batch): round(float(ms) * MS_NS) for batch, ms in execute_ms.items()}
    page_bytes = int(str(raw.get("page_bytes", 16 * MIB)))
    weights_bytes = int(str(raw["weights_bytes"]))
    default_pages = -(-weights_bytes // page_bytes)
    profile = SimProfile(
        name=str(raw["name"]),
        execute_ns=execute_ns,
        load_ns=round(float(str(raw["load_ms"])) * MS_NS),
        weights_bytes=weights_bytes,
        weights_pages=int(str(raw.get("weights_pages", default_pages))),
        page_bytes=page_bytes,
        pages_total=int(str(raw.get("pages_total", 1376))),
    )
    if min(profile.execute_ns) < 1 or min(profile.execute_ns.values()) <= 0:
        raise ValueError("batch sizes and durations must be positive")
    if profile.load_ns <= 0 or profile.weights_pages < 1 or profile.pages_total < 1:
        raise ValueError("load_ms, weights_pages and pages_total must be positive")
    return profile
