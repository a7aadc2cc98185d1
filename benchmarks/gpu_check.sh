#!/usr/bin/env bash
# The GPU check on a bare NVIDIA machine without internet (docs/gpu.md has the whole sequence).
#
#   bash benchmarks/gpu_check.sh stage          # after a run call that carried one wheel part
#   bash benchmarks/gpu_check.sh run [ARGS]     # reassemble + verify the wheel, install, check
#
# `stage` keeps the wheel parts that `run` calls carried (.gpu-wheels/, made here by
# `python -m benchmarks.gpu_ship`) in $STAGE, outside the working tree, and lists them.
# `run` stages too, reassembles every wheel of manifest.txt from its parts, checks its sha256,
# installs the wheels and this checkout into $SITE (nothing in the image changes), then runs
# `python3 -m benchmarks.gpu_check ARGS` under `timeout`, writing to $OUT (else results/).
# Exit status: gpu_check's, or 3 when parts are missing or a checksum differs (said on stderr
# and in $OUT/gpu_check.json).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=${CLOCKWORK_GPU_WHEELS:-.gpu-wheels}
STAGE=${CLOCKWORK_GPU_STAGE:-/var/tmp/clockwork-gpu-wheels}
SITE=${CLOCKWORK_GPU_SITE:-/tmp/clockwork-gpu-site}
OUT_DIR=${OUT:-results}
PY=${PYTHON:-python3}
LIMIT_S=${CLOCKWORK_GPU_LIMIT_S:-265}  # wheels and install take ~20 s more: under 5 minutes

say() { echo "[gpu_check.sh $(date +%H:%M:%S)] $*"; }

fail() {  # fail MESSAGE: report in JSON and on stderr, exit 3
    mkdir -p "$OUT_DIR"
    printf '{"benchmark": "gpu_check", "error": "%s"}\n' "$1" >"$OUT_DIR/gpu_check.json"
    echo "gpu_check.sh: $1" >&2
    exit 3
}

stage() {
    mkdir -p "$STAGE"
    for file in "$WHEELS"/*; do
        [ -f "$file" ] || continue
        target="$STAGE/$(basename "$file")"
        if [ ! -f "$target" ] || [ "$(stat -c %s "$file")" != "$(stat -c %s "$target")" ]; then
            cp "$file" "$target"
        fi
    done
    say "staged in $STAGE:"
    ls -l "$STAGE"
}

reassemble() {  # every "wheel NAME SHA SIZE N" line of the manifest, from its N parts
    local manifest="$STAGE/manifest.txt" kind name sha size count index part
    [ -f "$manifest" ] || fail "no manifest.txt in $STAGE: carry .gpu-wheels/manifest.txt"
    while read -r kind name sha size count; do
        case "$kind" in
        wheel)
            for ((index = 0; index < count; index++)); do
                part=$(printf '%s/%s.part-%02d' "$STAGE" "$name" "$index")
                [ -f "$part" ] || fail "missing $(basename "$part"): stage every part first (docs/gpu.md)"
            done
            cat $(for ((index = 0; index < count; index++)); do printf '%s/%s.part-%02d ' "$STAGE" "$name" "$index"; done) >"$STAGE/$name"
            ;;
        extra) [ -f "$STAGE/$name" ] || fail "missing $name: carry it with the last call" ;;
        *) continue ;;
        esac
        echo "$sha  $STAGE/$name" | sha256sum -c --quiet - || fail "$name: sha256 differs from manifest.txt"
        say "verified $name ($size bytes)"
    done <"$manifest"
}

install() {
    rm -rf "$SITE" && mkdir -p "$SITE"
    local wheels=()
    while read -r kind name _; do
        case "$kind" in wheel | extra) wheels+=("$STAGE/$name") ;; esac
    done <"$STAGE/manifest.txt"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}" ||
        fail "pip could not install the wheels into $SITE"
    # This checkout as the installed package (pyproject maps executors/ into it).
    cp -r src/clockwork_async "$SITE/clockwork_async"
    cp -r executors "$SITE/clockwork_async/executors"
    say "installed into $SITE: ${wheels[*]##*/} and clockwork_async"
}

case "${1:-}" in
stage)
    stage
    ;;
run)
    shift
    stage
    reassemble
    install
    export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
    mkdir -p "$OUT_DIR"
    "$PY" -c 'import onnxruntime as o, sys; print("onnxruntime", o.__version__, o.__file__, o.get_available_providers(), "python", sys.version.split()[0])'
    say "python -m benchmarks.gpu_check $* (limit ${LIMIT_S}s)"
    timeout --signal=INT --kill-after=10 "$LIMIT_S" "$PY" -m benchmarks.gpu_check --out "$OUT_DIR" --budget-s $((LIMIT_S - 25)) "$@"
    status=$?
    say "gpu_check exited $status"
    exit "$status"
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh stage|run [gpu_check args]" >&2
    exit 2
    ;;
esac
