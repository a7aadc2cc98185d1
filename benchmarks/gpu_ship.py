"""Bring the GPU check's wheels to a device machine that has no internet, in parts small enough
for one ``run`` call each (docs/gpu.md).

    python -m benchmarks.gpu_ship [--dir .gpu-wheels] [--part-mib 58]

Downloads (``pip download --no-deps``, binary wheels for CPython 3.12 on manylinux x86-64: the
device image's Python) the wheels in `WHEELS` into an ignored folder, checks each against the
sha256 recorded here, splits those larger than ``--part-mib`` into numbered parts, writes
``manifest.txt`` (what `gpu_check.sh` reassembles and verifies) and prints the ``run`` calls to
make. Invariant: a part plus the working tree stays under the 64 MiB a call may carry.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
CARRY_LIMIT_BYTES = 64 * MIB
# requirement -> (file name, sha256, bytes), as PyPI served them on 2026-12-03.
WHEELS = {
    "onnxruntime-gpu==1.31.1": (
        "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "05d548956197b9d01f59b625de740e0d6be3593f874e241a12dc0362650ecdf7",
        255_569_273,
    ),
    "pytest-asyncio==1.5.0": (
        "pytest_asyncio-1.5.0-py3-none-any.whl",
        "557f255ee03cc84f84a8d5f438bc9c6e0f714bf86970ae743c7ecb5a38d7e07d",
        17_215,
    ),
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def download(folder: Path) -> None:
    """pip-download every wheel of `WHEELS` not already in ``folder`` with the right hash."""
    missing = [
        requirement
        for requirement, (name, sha256, _) in WHEELS.items()
        if not (folder / name).is_file() or sha256_of(folder / name) != sha256
    ]
    if not missing:
        return
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms]
    subprocess.run([*command, "-d", str(folder), *missing], check=True)


def verify(folder: Path) -> None:
    """Raises SystemExit naming a wheel whose sha256 is not the recorded one."""
    for name, sha256, _ in WHEELS.values():
        actual = sha256_of(folder / name)
        if actual != sha256:
            raise SystemExit(f"{name}: sha256 {actual}, expected {sha256}; not shipping it")


def split(path: Path, part_bytes: int) -> list[Path]:
    """Cut ``path`` into ``NAME.part-NN`` files of at most ``part_bytes`` (equal sizes but the
    last); returns them in order."""
    size = path.stat().st_size
    count = -(-size // part_bytes)
    each = -(-size // count)
    parts = []
    with path.open("rb") as source:
        for index in range(count):
            part = path.with_name(f"{path.name}.part-{index:02d}")
            part.write_bytes(source.read(each))
            parts.append(part)
    return parts


def write_manifest(folder: Path, part_bytes: int) -> tuple[list[Path], list[Path]]:
    """Split the large wheels, write manifest.txt; returns (parts, small wheels)."""
    lines, parts, small = [], [], []
    for name, sha256, size in WHEELS.values():
        path = folder / name
        if size <= part_bytes:
            lines.append(f"extra {name} {sha256} {size}")
            small.append(path)
            continue
        for stale in folder.glob(f"{name}.part-*"):
            stale.unlink()
        pieces = split(path, part_bytes)
        lines.append(f"wheel {name} {sha256} {size} {len(pieces)}")
        lines += [f"part {p.name} {sha256_of(p)} {p.stat().st_size}" for p in pieces]
        parts += pieces
    (folder / "manifest.txt").write_text("\n".join(lines) + "\n")
    return parts, small


def ensure_ignored(folder: Path) -> None:
    """Keep the folder out of git (it would travel with every run call otherwise)."""
    ignored = subprocess.run(["git", "check-ignore", "-q", str(folder)], check=False).returncode
    if ignored != 0:
        exclude = Path(".git/info/exclude")
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as file:
            file.write(f"/{folder.as_posix().strip('/')}/\n")
        print(f"added /{folder}/ to .git/info/exclude (add it to .gitignore to keep it)")


def print_plan(folder: Path, parts: list[Path], small: list[Path]) -> None:
    """The ``run`` calls: one per part, the last one also carrying the rest and running."""
    tree_bytes = sum(
        Path(p).stat().st_size
        for p in subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        if p and Path(p).is_file()
    )
    print(f"working tree that travels: {tree_bytes / MIB:.1f} MiB")
    for index, part in enumerate(parts):
        carry = [str(part)]
        command = "bash benchmarks/gpu_check.sh stage"
        if index == len(parts) - 1:
            carry += [str(folder / "manifest.txt"), *map(str, small)]
            command = "bash benchmarks/gpu_check.sh run"
        total = tree_bytes + sum(Path(c).stat().st_size for c in carry)
        assert total < CARRY_LIMIT_BYTES, f"call {index + 1} would carry {total} bytes"
        print(f"call {index + 1}: carry={carry} command={command!r} ({total / MIB:.1f} MiB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path(".gpu-wheels"))
    parser.add_argument("--part-mib", type=int, default=58)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    ensure_ignored(args.dir)
    download(args.dir)
    verify(args.dir)
    parts, small = write_manifest(args.dir, args.part_mib * MIB)
    print((args.dir / "manifest.txt").read_text(), end="")
    print_plan(args.dir, parts, small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
