#!/usr/bin/env bash
# nbdist on a lent GPU machine, in one shot: the GPU tests and the GPU benchmark.
#
# That machine has torch, cloudpickle, psutil, pytest, tqdm, nvidia-ml-py and lightning, but no
# IPython, ipywidgets, pyspark or Java, and no network. So, in two steps:
#
#   1. here (with the network):  benchmarks/gpu_device_run.sh fetch
#      downloads the pure-Python wheels nbdist and its tests need there into .whl/ (the
#      versions of this checkout's .venv; ignored by git);
#   2. there, from the repository root, with .whl carried along:
#      OUT=/some/dir benchmarks/gpu_device_run.sh
#      installs those wheels with `pip install --target` into a folder of its own (the
#      machine's packages are left alone), runs `pytest -m gpu tests/gpu` and
#      `benchmarks/bench_gpu.py`, and writes under $OUT: card.txt (nvidia-smi), pytest.txt,
#      junit.xml, bench_gpu.txt, gpu.md and gpu.json. Exit status: the tests' (the benchmark's
#      is in bench_gpu.rc).
#
# Options through the environment: BENCH_ARGS (default "--reps 3"), PYTEST_ARGS (extra
# arguments for pytest), TESTS_TIMEOUT_S / BENCH_TIMEOUT_S (default 200 / 330 seconds: the two
# fit one 600 s command of a lent machine; the benchmark writes gpu.md and gpu.json after each
# scenario, so a run cut short keeps what it measured; `BENCH_ARGS="--only 3,4"` runs a part).
# NO_BENCH_GPU=1 skips bench_gpu.py. CPU_BENCHES=1 also runs, on that machine's many cores,
# `bench_session.py --only-trivial` and `bench_scale.py --ranks 64,256,1024 --seconds 10`
# (CPU_BENCH_TIMEOUT_S each, default 120 s) into session.txt and scale.txt.
set -u -o pipefail
cd "$(dirname "$0")/.."

WHEELS=(ipython ipython_pygments_lexers jedi parso matplotlib-inline pexpect ptyprocess
        prompt_toolkit wcwidth pygments stack_data asttokens executing pure_eval traitlets
        typing_extensions ipywidgets comm jupyterlab_widgets widgetsnbextension pytest-timeout
        threadpoolctl)

if [ "${1:-}" = "fetch" ]; then
    mkdir -p .whl
    pins=()
    for name in "${WHEELS[@]}"; do
        version=$(.venv/bin/pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        pins+=("$name${version:+==$version}")
    done
    exec .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --dest .whl "${pins[@]}"
fi

OUT=${OUT:?set OUT to the folder for the results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=$(mktemp -d)/site
trap 'rm -rf "$(dirname "$SITE")"' EXIT
nvidia-smi > "$OUT/card.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/card.txt" 2>&1
$PY -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda",
torch.version.cuda)' >> "$OUT/card.txt" 2>&1

if ls .whl/*.whl > /dev/null 2>&1; then
    if ! $PY -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl \
            > "$OUT/pip.txt" 2>&1; then
        # No pip there: a pure-Python wheel is a zip of what site-packages would hold.
        $PY -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$SITE" .whl/*.whl \
            || { echo "could not install the wheels: $OUT/pip.txt"; exit 3; }
    fi
else
    echo "no wheels in .whl/ (run 'benchmarks/gpu_device_run.sh fetch' where there is a network)"
fi
# The carried packages first, then this checkout (nbdist is not installed there), then the
# machine's own packages. Ranks and zygotes inherit PYTHONPATH.
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

timeout "${TESTS_TIMEOUT_S:-200}" $PY -m pytest -m gpu tests/gpu -v -p no:cacheprovider \
    --junitxml "$OUT/junit.xml" ${PYTEST_ARGS:-} > "$OUT/pytest.txt" 2>&1
tests=$?
tail -n 15 "$OUT/pytest.txt"

if [ -z "${NO_BENCH_GPU:-}" ]; then
    timeout "${BENCH_TIMEOUT_S:-330}" $PY benchmarks/bench_gpu.py ${BENCH_ARGS:---reps 3} \
        --out "$OUT" > "$OUT/bench_gpu.txt" 2>&1
    echo $? > "$OUT/bench_gpu.rc"
    tail -n 60 "$OUT/bench_gpu.txt"
fi
if [ -n "${CPU_BENCHES:-}" ]; then
    nproc > "$OUT/cpu.txt"; uptime >> "$OUT/cpu.txt"
    timeout "${CPU_BENCH_TIMEOUT_S:-120}" $PY benchmarks/bench_session.py --only-trivial \
        > "$OUT/session.txt" 2>&1
    timeout "${CPU_BENCH_TIMEOUT_S:-120}" $PY benchmarks/bench_scale.py --ranks 64,256,1024 \
        --seconds 10 > "$OUT/scale.txt" 2>&1
    tail -n 12 "$OUT/session.txt" "$OUT/scale.txt"
fi
exit $tests
