#!/usr/bin/env bash
# GPU validation in one prepared run: every GPU-marked test, then the GPU staging benchmark.
#
#   bash benchmarks/gpu_validate.sh [--dry-run] [--out DIR]
#
# Run from the repository root on a CUDA machine.  It finds a Python with torch (a CUDA build
# already installed is used as is), installs the project's other dependencies if missing (best
# effort: into that Python's own venv, else into .venv made with --system-site-packages so the
# machine's torch stays visible), runs `pytest -m gpu`, then `python -m benchmarks.bench_gpu`
# and `python -m benchmarks.bench_restore --gpu` (restore into CUDA tensors, ASTAGE_GPU_RESTORE_ARGS),
# and writes DIR/gpu-<date>.md (default DIR: benchmarks/results) with the machine, the test
# summary and the benchmark tables, plus the benchmark's JSON beside it.  The file is
# rewritten after every phase, so a phase that fails or times out still leaves what came
# before.  When $OUT is set, the files are copied there too.
#
# Every phase has its own timeout, and all of them fit in ASTAGE_GPU_BUDGET_S (default 450 s,
# under 8 minutes with start-up).  --dry-run skips the installation and runs the rest with the
# Python at hand: on a machine without CUDA it finishes in seconds and reports "no CUDA device".
#
# Knobs: PYTHON (the interpreter to use), ASTAGE_GPU_BUDGET_S, ASTAGE_GPU_TESTS (pytest
# arguments; default "tests"), ASTAGE_GPU_BENCH_ARGS (bench_gpu arguments; default none, i.e.
# full size; "--quick" for a smoke run).

set -uo pipefail

dry_run=0
out_dir="benchmarks/results"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --out) out_dir="$2"; shift ;;
        --out=*) out_dir="${1#--out=}" ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_validate.sh: unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

if [ ! -f pyproject.toml ] || [ ! -d astage ]; then
    echo "gpu_validate.sh: run it from the repository root" >&2
    exit 2
fi

budget="${ASTAGE_GPU_BUDGET_S:-450}"
today="$(date +%F)"
mkdir -p "$out_dir"
md="$out_dir/gpu-$today.md"
json="$out_dir/gpu-$today.json"
work="$(mktemp -d "${TMPDIR:-/tmp}/astage-gpu-validate.XXXXXX")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECONDS=0

# Phase records: status lines and log files, read back by write_md.
setup_status="not run"
tests_status="not run"
bench_status="not run"
restore_status="not run"
: > "$work/restore.log"
: > "$work/setup.log"
: > "$work/tests.log"
: > "$work/bench.log"

# Seconds a phase may take: its own cap, or what is left of the budget (at least 5 s).
phase_timeout() {
    local cap="$1" left=$((budget - SECONDS - 10))
    [ "$left" -lt 5 ] && left=5
    [ "$cap" -lt "$left" ] && echo "$cap" || echo "$left"
}

# Run a phase under `timeout`; sets the global `status` to ok / failed / timed out.
run_phase() {
    local seconds="$1" log="$2"
    shift 2
    timeout --kill-after=10 "$seconds" "$@" >> "$log" 2>&1
    local rc=$?
    if [ "$rc" -eq 0 ]; then
        status="ok"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="timed out after ${seconds} s"
    else
        status="failed (exit status $rc)"
    fi
    return "$rc"
}

fence() {  # a file's last lines in a Markdown code block
    echo '```'
    tail -n "$2" "$1"
    echo '```'
}

write_md() {
    {
        echo "# GPU validation, $today"
        echo
        if [ "$dry_run" -eq 1 ]; then mode="--dry-run, nothing installed"; else mode="full run"; fi
        echo "Written by \`benchmarks/gpu_validate.sh\` ($mode) after ${SECONDS} s of a ${budget} s budget."
        echo
        echo "## Machine"
        echo
        echo '```'
        if command -v nvidia-smi > /dev/null 2>&1; then
            timeout 20 nvidia-smi -L 2>&1
            timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
        else
            echo "nvidia-smi: not found"
        fi
        echo "host: $(uname -srm), $(nproc 2>/dev/null || echo '?') CPUs"
        echo "python: ${PY:-?} ($("${PY:-false}" --version 2>&1))"
        echo "torch: ${torch_info:-not importable}"
        if [ "${cuda_ok:-False}" = "True" ]; then
            echo "CUDA device: yes"
        else
            echo "CUDA device: no CUDA device (torch.cuda.is_available() is False)"
        fi
        echo '```'
        echo
        echo "## Environment setup: $setup_status"
        echo
        [ -s "$work/setup.log" ] && fence "$work/setup.log" 20 && echo
        echo "## GPU-marked tests (\`pytest -m gpu ${ASTAGE_GPU_TESTS:-tests}\`): $tests_status"
        echo
        summary="$(grep -E '(passed|failed|skipped|deselected|error|no tests ran)' "$work/tests.log" | tail -n 1)"
        echo "Summary: ${summary:-none (see the log)}"
        echo
        [ -s "$work/tests.log" ] && fence "$work/tests.log" 60 && echo
        echo "## GPU staging benchmark (\`python -m benchmarks.bench_gpu ${ASTAGE_GPU_BENCH_ARGS:-}\`): $bench_status"
        echo
        if grep -q "no CUDA device" "$work/bench.log"; then
            echo "no CUDA device: the benchmark did not run."
            echo
        fi
        [ -s "$work/bench.log" ] && fence "$work/bench.log" 200 && echo
        if [ -s "$json" ]; then
            echo "Every run's numbers and the loop-lag series: \`$(basename "$json")\`."
        fi
        echo
        echo "## GPU restore benchmark (\`python -m benchmarks.bench_restore --gpu ${ASTAGE_GPU_RESTORE_ARGS:-}\`): $restore_status"
        echo
        [ -s "$work/restore.log" ] && fence "$work/restore.log" 40 && echo
    } > "$md.tmp"
    mv "$md.tmp" "$md"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT" && cp "$md" "$OUT/" && { [ ! -s "$json" ] || cp "$json" "$OUT/"; }
    fi
}

finish() {
    write_md
    rm -rf "$work"
    echo "gpu_validate.sh: wrote $md (${SECONDS} s)"
}
trap finish EXIT

# -- phase 1: a Python with torch and the project's dependencies ------------------------------

deps_probe='
import importlib.util, sys
names = {"anyio": "anyio", "aiofiles": "aiofiles", "sniffio": "sniffio", "crc32c": "crc32c",
         "numpy": "numpy", "rich": "rich", "pytest": "pytest", "pytest_asyncio": "pytest-asyncio",
         "trio": "trio", "hypothesis": "hypothesis", "blockbuster": "blockbuster", "psutil": "psutil"}
print(" ".join(pip for mod, pip in names.items() if importlib.util.find_spec(mod) is None))
'
torch_probe='import torch; print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.is_available())'

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=".venv/bin/python"
else
    PY="$(command -v python3 || command -v python)"
fi

if [ "$dry_run" -eq 1 ]; then
    setup_status="skipped (dry run)"
else
    setup_status="ok"
    missing="$(timeout 60 "$PY" -c "$deps_probe" 2>> "$work/setup.log")"
    if ! timeout 120 "$PY" -c "import torch" >> "$work/setup.log" 2>&1; then
        missing="torch $missing"
    fi
    if [ -n "${missing// /}" ]; then
        echo "missing: $missing" >> "$work/setup.log"
        in_venv="$(timeout 60 "$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)' 2>&1)"
        if [ "$in_venv" != "True" ]; then
            # A venv that still sees the machine's packages (its CUDA torch, above all); a
            # venv's own Python is installed into directly, since a venv made from it would
            # see only the base interpreter's packages.
            timeout 60 "$PY" -m venv --system-site-packages .venv >> "$work/setup.log" 2>&1 \
                && PY=".venv/bin/python"
        fi
        # shellcheck disable=SC2086  # one argument per package
        run_phase "$(phase_timeout 90)" "$work/setup.log" "$PY" -m pip install --quiet --retries 1 --timeout 15 $missing \
            || setup_status="pip install $status: continuing with what is installed"
    fi
fi
write_md

torch_info="$(timeout 120 "$PY" -c "$torch_probe" 2>&1 | tail -n 1)"
cuda_ok="$(echo "$torch_info" | awk '{print $NF}')"
write_md

# -- phase 2: every GPU-marked test -----------------------------------------------------------

# shellcheck disable=SC2086  # pytest arguments, split on purpose
run_phase "$(phase_timeout 150)" "$work/tests.log" \
    "$PY" -m pytest -m gpu -ra -q -p no:cacheprovider ${ASTAGE_GPU_TESTS:-tests}
rc=$?
tests_status="$status"
[ "$rc" -eq 5 ] && tests_status="no GPU-marked test collected (exit status 5)"
write_md

# -- phase 3: the GPU staging benchmark -------------------------------------------------------

# shellcheck disable=SC2086  # benchmark arguments, split on purpose
run_phase "$(phase_timeout 230)" "$work/bench.log" \
    "$PY" -m benchmarks.bench_gpu --json "$json" ${ASTAGE_GPU_BENCH_ARGS:-}
bench_status="$status"
write_md

# -- phase 4: restore into CUDA tensors against a pinned copy_ ---------------------------------

# shellcheck disable=SC2086  # benchmark arguments, split on purpose
run_phase "$(phase_timeout 60)" "$work/restore.log" \
    "$PY" -m benchmarks.bench_restore --gpu ${ASTAGE_GPU_RESTORE_ARGS:-}
restore_status="$status"
exit 0
