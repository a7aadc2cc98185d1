#!/usr/bin/env bash
# Run every benchmark in sequence and collect its JSON, PNGs and printed output in results/.
#
#   benchmarks/run_all.sh            # full modes (several hours on 2 cores)
#   benchmarks/run_all.sh --quick    # quick modes (about 40 minutes)
#
# The paper's experiments come first (issue 5: predictability, slo_sweep, thousands, azure,
# isolation, scale, and peer_ray, which installs Ray Serve into .bench-venv/ray on first use),
# then the component and reliability benchmarks.
#
# Each benchmark's stdout+stderr goes to results/<name>.log (and the terminal); the load
# average before and after each one goes to results/run_all.log, since these numbers are only
# as good as the machine was quiet. A failing benchmark does not stop the others; the script
# exits 1 if any failed.
set -u -o pipefail

cd "$(dirname "$0")/.."
mode="${1:-}"
if [[ -n "$mode" && "$mode" != "--quick" ]]; then
    echo "usage: $0 [--quick]" >&2
    exit 2
fi
python="${PYTHON:-python}"
mkdir -p results
summary=results/run_all.log
echo "run_all ${mode:-full} started $(date -Is) on $(nproc) CPUs" > "$summary"
failed=()

run() {
    local name="$1"
    shift
    echo "== $name: $* (uptime:$(uptime | sed 's/.*load average/ load average/'))" | tee -a "$summary"
    local started=$SECONDS
    if "$python" -m "$@" 2>&1 | tee "results/$name.log"; then
        status=ok
    else
        status="failed ($?)"
        failed+=("$name")
    fi
    echo "== $name: $status in $((SECONDS - started)) s" \
        "(uptime:$(uptime | sed 's/.*load average/ load average/'))" | tee -a "$summary"
}

run predictability benchmarks.predictability $mode
run slo_sweep benchmarks.slo_sweep $mode
run thousands benchmarks.thousands $mode
run azure benchmarks.azure $mode
run isolation benchmarks.isolation $mode
run scale benchmarks.scale $mode
run peer_ray benchmarks.peer_ray $mode
run peer_mlserver benchmarks.peer_mlserver $mode
run codec benchmarks.codec $mode --json results/codec.json
run executor benchmarks.executor $mode --json results/executor.json
run idle_gap benchmarks.idle_gap $mode
run sim_scenarios benchmarks.sim_scenarios $mode --out results
run sched_bound benchmarks.sched_bound $mode --seeds 1,2
run buckets benchmarks.buckets $mode --seeds 1,2
run buckets_real benchmarks.buckets --real $mode
run overrun benchmarks.overrun $mode
if [[ -f benchmarks/controller.py ]]; then
    run controller benchmarks.controller $mode
fi
run overhead benchmarks.overhead $mode --json results/overhead.json
run overhead_v2 benchmarks.overhead_v2 $mode --json results/overhead_v2.json
run cpu_serving benchmarks.cpu_serving $mode --json results/cpu_serving.json
run faults benchmarks.faults $mode --json results/faults.json
run fuzz_api benchmarks.fuzz_api $mode
run overload benchmarks.overload $mode
run soak benchmarks.soak $mode

echo "run_all finished $(date -Is); failed: ${failed[*]:-none}" | tee -a "$summary"
[[ ${#failed[@]} -eq 0 ]]
