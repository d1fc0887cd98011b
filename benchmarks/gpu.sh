#!/usr/bin/env bash
# The GPU run of issue 42, ready before a GPU is lent (docs/benchmarks/gpu.md, "The GPU script").
#
#   bash benchmarks/gpu.sh prepare      here, with registry access: the wheels into .whl/
#   bash benchmarks/gpu.sh run          on the GPU host (the device tool, carry [".whl"])
#   bash benchmarks/gpu.sh run --smoke  the same steps on a tiny model with .venv, on a CPU
#
# run ends within 8 minutes of its start: the wheels' install, then benchmarks/gpu_suite.py
# with what is left (less a margin for stopping a step cut short). With $OUT set, the table,
# each step's log and this script's output are written there too.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.whl
TOTAL_S=480  # the issue's 8 minutes
MARGIN_S=20  # stopping a step that overran (SIGTERM, then SIGKILL) and printing the table
LIMIT_MIB=64 # what the device tool carries: the working tree and the wheels together
HEADROOM_MIB=16 # left for other engineers' files in the same checkout

prepare() {
    local python=.venv/bin/python platforms=() n
    for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2046  # one pin a word
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$WHEELS" $("$python" -m benchmarks.gpu_suite --pins) \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)  # this host's pip.conf
    "$python" -m benchmarks.gpu_suite --check-wheels "$WHEELS"
    local wheels tree
    wheels=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
    ls -S -l "$WHEELS" | awk 'NR > 1 {printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
    printf '%d wheels, %.1f MiB; working tree %.1f MiB; together %.1f of %d MiB\n' \
        "$(ls "$WHEELS" | wc -l)" "$(echo "$wheels / 1048576" | bc -l)" \
        "$(echo "$tree / 1048576" | bc -l)" "$(echo "($wheels + $tree) / 1048576" | bc -l)" "$LIMIT_MIB"
    if (( wheels + tree > (LIMIT_MIB - HEADROOM_MIB) * 1048576 )); then
        echo "error: wheels and tree exceed $((LIMIT_MIB - HEADROOM_MIB)) MiB (${HEADROOM_MIB} MiB" \
            "kept for the checkout's other files); drop a [carry] entry the image already has" \
            "at a version that works (benchmarks/gpu-wheels.txt)" >&2
        exit 1
    fi
}

run() {
    local started=$SECONDS python smoke=()
    if [[ "${1:-}" == --smoke ]]; then
        python=.venv/bin/python
        smoke=(--smoke)
    else
        if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
            echo "error: no wheels in $WHEELS/: run 'bash benchmarks/gpu.sh prepare' where a" \
                "registry is reachable, then name \".whl\" in the device call's carry" >&2
            exit 1
        fi
        python=python3  # the image's, with torch 2.11 for CUDA
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS"/*.whl
        # The installed compressflow, not this tree's compressflow/ folder, which lacks the
        # subpackages (flows/, tasks/, blocks/, demo/ are mapped in at install): no process may
        # put its working directory first on sys.path; benchmarks/ comes from this tree.
        export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
        # compressflow itself from this tree (never a stale wheel), then bytecode in parallel, so
        # no measured process compiles what it imports
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --no-cache-dir --upgrade --target /tmp/site .
        python3 -m compileall -q -j 0 /tmp/site > /dev/null || true
        echo "installed in $((SECONDS - started)) s"
    fi
    local budget=$((TOTAL_S - (SECONDS - started) - MARGIN_S))
    [[ ${#smoke[@]} -eq 0 ]] || budget=900  # a shared 2-core CPU: the schedule's smoke caps
    "$python" -m benchmarks.gpu_suite "${smoke[@]}" --budget-s "$budget" ${OUT:+--out "$OUT"}
}

main() {
    case "${1:-}" in
        prepare) prepare ;;
        run) shift; run "$@" 2>&1 | tee ${OUT:+"$OUT/gpu.log"} ;;
        *) echo "usage: bash benchmarks/gpu.sh prepare | run [--smoke]" >&2; exit 2 ;;
    esac
}

main "$@"; exit  # on one line: bash reads no more of this file, even if it changes meanwhile
