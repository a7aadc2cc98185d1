"""GPU check (issue 7): the CUDA executor on a real GPU, in one run of at most five minutes.

    bash benchmarks/gpu_check.sh run            # on the device machine: wheels, then this
    python -m benchmarks.gpu_check [--quick] [--out DIR] [--ops cuda|host] [--budget-s S]

Sections, in order; each is recorded even when an earlier one failed, and the JSON is
rewritten after each, so a run cut short still leaves what it measured:

1. ``environment``: GPU, driver, CUDA runtime, CuPy, NVML clock, onnxruntime (package and the
   CUDA version it was built for), the libraries its CUDA provider wants (``ldd``) and the
   CUDA libraries the machine has (nvidia-* wheels, ldconfig).
2. ``cuda_provider``: whether the CUDA execution provider really loads (`device_ops.open_cuda`).
3. ``conformance``: the executor conformance suite on the CUDA executor and the GPU tests of
   tests/executors/test_cuda_backend.py (``pytest -k cuda``), counts and the log's tail.
4. ``copy_floor``: host-to-device copies from pinned memory (one memcpy per size, CUDA events).
5. ``models``: the ``resnet-like`` demo model and a generated ~100 MB MLP, per weights mode:
   LOAD (copy into pages + binding) against the copy floor of the same bytes, measured
   alternately; INFER per batch size, one action at a time: host-clock phases and the
   CUDA-event execute time, p50/p99/p99.9/p99.99/max, the SM clock while it ran; a plain ONNX
   Runtime CUDA session's ``run()`` of the same model as a reference.

Targets from the paper (a V100): LOAD near the PCIe floor; INFER p99.99 within 1% of the median.
``--ops host`` runs sections 4-5 on `HostOps` (host memory, ONNX Runtime's CPU provider) to
check this script without a GPU; those numbers are not GPU numbers. Writes ``gpu_check.json``
(and ``gpu_conformance.log``) to ``--out`` (default ``$OUT``, else ``results/``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu_models import build_big_mlp
from benchmarks.lib import machine_description, percentile, percentile_of, percentiles, table

MIB = 1 << 20
NAME = "gpu_check"


@dataclass(frozen=True)
class Plan:
    infer_runs: dict[int, int]  # batch size -> timed INFERs (one action at a time)
    warmup: int
    load_cycles: dict[str, int]  # weights mode -> LOAD/UNLOAD cycles
    other_mode_infers: int  # b1 INFERs in the "initializers" mode
    baseline_runs: int
    floor_reps: int


FULL = Plan(
    {1: 10_000, 4: 2_000, 16: 1_000}, 200, {"inputs": 50, "initializers": 20}, 2_000, 1_000, 20
)
QUICK = Plan({1: 1_000, 4: 300, 16: 200}, 50, {"inputs": 10, "initializers": 5}, 300, 200, 5)


class Budget:
    """Wall-clock budget of the whole run; sections ask it how much is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def tail_stats_ns(values: Iterable[int]) -> dict[str, Any]:
    """n, p50, p99, p99.9, p99.99 and max in µs, and p99.99 over p50."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    stats: dict[str, Any] = {"n": len(ordered)}
    stats |= percentiles(ordered, (50, 99, 99.9, 99.99), scale=1e-3, digits=2, suffix="_us")
    stats["p99.99_over_p50"] = round(
        percentile(ordered, 99.99) / max(1, percentile(ordered, 50)), 4
    )
    return stats


def log(text: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", flush=True)


# --- 1, 2: environment and the CUDA provider ----------------------------------------------


def _run(command: list[str], timeout_s: float = 20) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"({command[0]}: {error})"
    return (done.stdout + done.stderr).strip()


def _cuda_libraries_present() -> dict[str, list[str]]:
    """CUDA/cuDNN libraries in nvidia-* wheels and in the loader cache, by file name."""
    wheels = sorted(
        {
            Path(path).name
            for site in sys.path
            for path in glob.glob(f"{site}/nvidia/*/lib/lib*.so*")
            if re.search(r"lib(cudart|cublas|cublasLt|cudnn|curand|cufft)\.so", path)
        }
    )
    ldconfig = _run(["ldconfig", "-p"])
    system = sorted(
        set(re.findall(r"(lib(?:cudart|cublas|cublasLt|cudnn|curand|cufft)\.so[.\d]*)", ldconfig))
    )
    return {"nvidia_wheels": wheels, "ldconfig": system}


def environment() -> dict[str, Any]:
    """What the GPU run ran on (section 1)."""
    import onnxruntime as ort
    from clockwork_async.executors.device_ops import package_info

    package, cuda = package_info()
    provider_lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    ldd = (
        _run(["ldd", str(provider_lib)]) if provider_lib.exists() else "(no CUDA provider library)"
    )
    wanted = re.findall(r"^\s*(\S+)\s+=>\s+(.*?)(?:\s+\(0x[0-9a-f]+\))?$", ldd, re.MULTILINE)
    info: dict[str, Any] = {
        "nvidia_smi": _run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm,pcie.link.gen.max,pcie.link.width.max",
                "--format=csv",
            ]
        ),
        "onnxruntime": {
            "version": ort.__version__,
            "package": package,
            "built_for_cuda": cuda,
            "file": ort.__file__,
            "available_providers": ort.get_available_providers(),
        },
        "cuda_provider_library_wants": {
            name: where for name, where in wanted if "cu" in name or "not found" in where
        },
        "cuda_libraries_present": _cuda_libraries_present(),
    }
    try:
        import cupy

        runtime = cupy.cuda.runtime
        info["cupy"] = {
            "version": cupy.__version__,
            "cuda_runtime": runtime.runtimeGetVersion(),
            "cuda_driver": runtime.driverGetVersion(),
        }
    except Exception as error:  # no CuPy, or no driver
        info["cupy"] = {"error": str(error)}
    try:
        import pynvml

        info["nvidia_ml_py"] = getattr(pynvml, "__version__", "installed")
    except ImportError:
        info["nvidia_ml_py"] = "not installed"
    return info


def cuda_provider() -> dict[str, Any]:
    """Section 2: does the CUDA execution provider load (CUDA 13 image vs the wheel's CUDA)?"""
    from clockwork_async.executors.device_ops import cuda_unavailable_reason

    start = time.monotonic()
    reason = cuda_unavailable_reason("cuda:0")
    return {
        "loads": reason is None,
        "reason": reason,
        "check_s": round(time.monotonic() - start, 2),
    }


# --- 3: conformance ------------------------------------------------------------------------


def conformance(out_dir: Path, budget: Budget) -> dict[str, Any]:
    """The conformance suite and the GPU tests, as pytest subprocesses."""
    command = [
        sys.executable,
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"),
        *("tests/executors/test_conformance.py", "tests/executors/test_cuda_backend.py"),
    ]
    result = _pytest(command, out_dir / "gpu_conformance.log", min(150.0, budget.left_s() - 120))
    if result["exit"] not in (0, None) and budget.left_s() > 200:
        # Strict first (warnings are errors, as in CI); if that failed, again with warnings
        # shown but not fatal, so a warning from a GPU library does not hide the results.
        relaxed = _pytest(
            [*command, "-W", "default"], out_dir / "gpu_conformance_relaxed.log", 90.0
        )
        result["relaxed_warnings"] = relaxed
    return result


def _pytest(command: list[str], log_path: Path, timeout_s: float) -> dict[str, Any]:
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(10.0, timeout_s))
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:
        partial = [
            part.decode() if isinstance(part, bytes) else part or ""
            for part in (error.stdout, error.stderr)
        ]
        output, status = "".join(partial) + f"\n(timed out after {timeout_s:.0f} s)", None
    log_path.write_text(output)
    summary = [
        line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)
    ]
    counts = {
        k: int(v)
        for v, k in re.findall(
            r"(\d+) (passed|failed|skipped|errors?)", summary[-1] if summary else ""
        )
    }
    return {
        "exit": status,
        "counts": counts,
        "summary": summary[-1] if summary else "",
        "seconds": round(time.monotonic() - start, 1),
        "tail": output[-2500:],
    }


# --- 4: the copy floor ---------------------------------------------------------------------


class Floor:
    """One host-to-device memcpy of N bytes from pinned memory, timed by the ops' marks."""

    def __init__(self, ops: Any, size_bytes: int) -> None:
        self.ops = ops
        self.size_bytes = size_bytes
        with ops.activate():
            self.host = ops.host_array(size_bytes)
            self.host[:] = 1
            self.device, self.address = ops.io_buffer(size_bytes)
            self.stream = ops.new_stream()

    def copy_ns(self) -> int:
        ops = self.ops
        with ops.activate():
            first = ops.mark(self.stream)
            ops.copy_to_device(self.address, self.host, self.stream)
            last = ops.mark(self.stream)
            ops.synchronize(self.stream)
            return int(ops.elapsed_ns(first, last))


def copy_floor(ops: Any, sizes: Iterable[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for size in sorted(set(sizes)):
        floor = Floor(ops, size)
        for _ in range(3):
            floor.copy_ns()
        samples = sorted(floor.copy_ns() for _ in range(reps))
        p50 = percentile(samples, 50)
        rows.append(
            {"bytes": size, "p50_us": round(p50 / 1e3, 2), "GB_per_s": round(size / p50, 2)}
        )
        del floor
    return rows


# --- 5: models -----------------------------------------------------------------------------


def make_backend(ops_name: str, mode: str, weights_bytes: int) -> Any:
    from clockwork_async.executors.onnxruntime_cuda import BoundOrtBackend, make_cuda_backend

    sizes = {"page_bytes": 16 * MIB, "io_bytes": 64 * MIB, "workspace_bytes": 2 << 30}
    if ops_name == "cuda":
        return make_cuda_backend("cuda:0", weights_bytes=weights_bytes, weights_mode=mode, **sizes)  # type: ignore[arg-type]
    from clockwork_async.executors.device_ops import HostOps

    pages = weights_bytes // sizes["page_bytes"]
    return BoundOrtBackend(
        HostOps(),
        page_bytes=sizes["page_bytes"],
        pages_total=pages,
        io_bytes=sizes["io_bytes"],
        workspace_bytes=sizes["workspace_bytes"],
        weights_mode=mode,  # type: ignore[arg-type]
    )


def _feeds(model: Any, batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch_size)
    return {
        spec.name: rng.standard_normal([batch_size if d == -1 else d for d in spec.shape]).astype(
            spec.dtype
        )
        for spec in model.inputs
    }


def _free_mib(backend_or_ops: Any) -> float | None:
    ops = getattr(backend_or_ops, "_ops", backend_or_ops)
    read: Callable[[], int] | None = getattr(ops, "free_bytes", None)
    return round(read() / MIB, 1) if read is not None else None


def measure_loads(backend: Any, model: Any, cycles: int, budget: Budget) -> dict[str, Any]:
    """LOAD/UNLOAD cycles, each followed by the copy floor of the same bytes."""
    from clockwork_async.executors.pages import PageCache

    floor = Floor(backend._ops, model.weights_bytes)
    cache = PageCache(backend.arena.pages_total)
    loads: dict[str, list[int]] = {}
    floors: list[int] = []
    for _ in range(cycles):
        if budget.left_s() < 20:
            break
        runs = cache.allocate(model.run_pages)
        loaded, durations = backend.load(model, runs)
        backend.unload(loaded)
        cache.free(runs)
        for key, value in durations.items():
            loads.setdefault(key, []).append(value)
        floors.append(floor.copy_ns())
    result: dict[str, Any] = {key: tail_stats_ns(values) for key, values in loads.items()}
    result["floor_memcpy"] = tail_stats_ns(floors)
    floor_p50 = result["floor_memcpy"].get("p50_us")
    for key in loads:
        p50 = result[key].get("p50_us")
        result[f"{key}_over_floor"] = round(p50 / floor_p50, 3) if p50 and floor_p50 else None
    result["runs"] = list(model.run_pages)
    return result


def measure_infers(
    backend: Any, model: Any, plan: Plan, batches: dict[int, int], budget: Budget
) -> dict[str, Any]:
    """INFERs one at a time per batch size: phases, execute_gpu and the SM clock."""
    from clockwork_async.executors.pages import PageCache

    cache = PageCache(backend.arena.pages_total)
    runs = cache.allocate(model.run_pages)
    loaded, _ = backend.load(model, runs)
    per_batch: dict[str, Any] = {}
    try:
        for batch_size, count in batches.items():
            if batch_size not in model.batch_sizes or budget.left_s() < 25:
                continue
            feeds = _feeds(model, batch_size)
            for _ in range(plan.warmup):
                backend.infer(loaded, batch_size, feeds)
            phases: dict[str, list[int]] = {}
            clocks: list[int] = []
            start = time.monotonic()
            for index in range(count):
                _, durations = backend.infer(loaded, batch_size, feeds)
                for key, value in durations.items():
                    phases.setdefault(key, []).append(value)
                phases.setdefault("total", []).append(
                    durations["copy_in"] + durations["execute"] + durations["copy_out"]
                )
                if index % 100 == 0:
                    clocks.append(backend.device_clock_mhz())
                    if budget.left_s() < 20:
                        break
            stats: dict[str, Any] = {key: tail_stats_ns(v) for key, v in phases.items()}
            stats["sm_clock_mhz"] = {
                "min": min(clocks),
                "median": int(percentile_of(clocks, 50)),
                "max": max(clocks),
            }
            stats["wall_s"] = round(time.monotonic() - start, 2)
            per_batch[str(batch_size)] = stats
    finally:
        backend.unload(loaded)
        cache.free(runs)
    return per_batch


def plain_session_baseline(path: Path, ops_name: str, runs: int) -> dict[str, Any]:
    """A default ONNX Runtime session of the original model, ``run()`` at batch 1 (its own
    input/output copies included), for reference."""
    import onnxruntime as ort

    providers = (
        ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if ops_name == "cuda"
        else ["CPUExecutionProvider"]
    )
    session = ort.InferenceSession(str(path), providers=providers)
    feeds = {
        i.name: np.random.default_rng(0)
        .standard_normal([1 if not isinstance(d, int) else d for d in i.shape])
        .astype(np.float32)
        for i in session.get_inputs()
    }
    for _ in range(50):
        session.run(None, feeds)
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        session.run(None, feeds)
        samples.append(time.perf_counter_ns() - start)
    return {"providers": session.get_providers(), "run_b1": tail_stats_ns(samples)}


def measure_model(
    ops_name: str,
    name: str,
    path: Path,
    plan: Plan,
    budget: Budget,
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fill ``result`` mode by mode, calling ``save`` after each (a crash keeps the rest)."""
    result.update({"model": name, "file_bytes": path.stat().st_size})
    for mode in ("inputs", "initializers"):
        if budget.left_s() < 30:
            result[mode] = {"skipped": "out of time"}
            continue
        log(f"{name}: weights as {mode}")
        result[mode] = {"started": True}
        save()
        try:
            result[mode] = _measure_mode(ops_name, mode, name, path, plan, budget)
        except Exception as error:  # record and go on to the next mode
            result[mode] = {"error": f"{type(error).__name__}: {error}"}
        save()
    if budget.left_s() > 25:
        result["plain_session"] = _guard(
            lambda: plain_session_baseline(path, ops_name, plan.baseline_runs)
        )
        save()


def _measure_mode(
    ops_name: str, mode: str, name: str, path: Path, plan: Plan, budget: Budget
) -> dict[str, Any]:
    backend = make_backend(ops_name, mode, weights_bytes=2 << 30)
    try:
        out: dict[str, Any] = {"kind": backend.kind, "free_mib_after_pools": _free_mib(backend)}
        start = time.monotonic()
        model = backend.register(name, str(path), [1, 4, 16])
        out["register_s"] = round(time.monotonic() - start, 2)
        out["free_mib_after_register"] = _free_mib(backend)
        out["weights_bytes"] = model.weights_bytes
        out["inline_bytes"] = model.inline_bytes
        out["batch_sizes"] = list(model.batch_sizes)
        out["load"] = measure_loads(backend, model, plan.load_cycles[mode], budget)
        batches = plan.infer_runs if mode == "inputs" else {1: plan.other_mode_infers}
        out["infer"] = measure_infers(backend, model, plan, batches, budget)
        return out
    finally:
        backend.close()


# --- the run -------------------------------------------------------------------------------


def summary_rows(report: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for model in report.get("models", []):
        for mode in ("inputs", "initializers"):
            section = model.get(mode, {})
            load = section.get("load", {})
            for batch, stats in section.get("infer", {}).items():
                execute, gpu = stats.get("execute", {}), stats.get("execute_gpu", {})
                rows.append(
                    [
                        f"{model['model']} {mode} b{batch}",
                        execute.get("n"),
                        execute.get("p50_us"),
                        execute.get("p99.99_us"),
                        execute.get("p99.99_over_p50"),
                        gpu.get("p50_us"),
                        gpu.get("p99.99_over_p50"),
                        stats.get("total", {}).get("p50_us"),
                        load.get("load", {}).get("p50_us"),
                        load.get("floor_memcpy", {}).get("p50_us"),
                        stats.get("sm_clock_mhz", {}).get("median"),
                    ]
                )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke test)")
    parser.add_argument("--ops", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "results"))
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop measuring after this")
    parser.add_argument("--skip-conformance", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    budget, plan = Budget(args.budget_s), QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": NAME,
        "quick": args.quick,
        "ops": args.ops,
        "machine": machine_description(),
    }
    path = args.out / f"{NAME}.json"

    def save() -> None:
        report["elapsed_s"] = round(args.budget_s - budget.left_s(), 1)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    sections: list[tuple[str, Callable[[], Any]]] = [
        ("environment", environment),
        ("cuda_provider", cuda_provider),
    ]
    if not args.skip_conformance and args.ops == "cuda":
        sections.append(("conformance", lambda: conformance(args.out, budget)))
    for key, run in sections:
        log(f"{key} ...")
        try:
            report[key] = run()
        except Exception as error:
            report[key] = {"error": f"{type(error).__name__}: {error}"}
        log(f"{key}: {json.dumps(report[key], default=str)[:400]}")
        save()
    if args.ops == "cuda" and not report.get("cuda_provider", {}).get("loads"):
        log("the CUDA provider does not load: measuring the copy floor only")
    ops = _open_ops(args.ops, report)
    models_dir = Path(tempfile.mkdtemp(prefix="gpu-check-models-"))
    try:
        paths = _models(models_dir)
        if ops is not None:
            log("copy floor ...")
            sizes = [MIB, 16 * MIB, 256 * MIB] + [p.stat().st_size for p in paths.values()]
            report["copy_floor"] = _guard(lambda: copy_floor(ops, sizes, plan.floor_reps))
            save()
        if ops is not None and (args.ops == "host" or report.get("cuda_provider", {}).get("loads")):
            report["models"] = []
            for name, model_path in paths.items():
                report["models"].append({})
                measure_model(args.ops, name, model_path, plan, budget, report["models"][-1], save)
    finally:
        shutil.rmtree(models_dir, ignore_errors=True)
    save()
    headers = [
        "model mode batch",
        "n",
        "exec p50",
        "exec p99.99",
        "ratio",
        "gpu p50",
        "gpu ratio",
        "total p50",
        "LOAD p50",
        "floor p50",
        "MHz",
    ]
    print(table(headers, summary_rows(report)))
    print(f"wrote {path}")
    return 0


def _guard(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _open_ops(ops_name: str, report: dict[str, Any]) -> Any:
    if ops_name == "host":
        from clockwork_async.executors.device_ops import HostOps

        return HostOps()
    try:
        from clockwork_async.executors.device_ops import CudaOps

        return CudaOps(0)
    except Exception as error:
        report["copy_floor"] = {"error": f"{type(error).__name__}: {error}"}
        return None


def _models(directory: Path) -> dict[str, Path]:
    from clockwork_async.models.demo import generate_demo_models

    paths = {"resnet-like": generate_demo_models(directory, names=["resnet-like"])["resnet-like"]}
    big = directory / "mlp-100mb.onnx"
    import onnx

    onnx.save(build_big_mlp(), str(big))
    paths["mlp-100mb"] = big
    return paths


if __name__ == "__main__":
    sys.exit(main())
