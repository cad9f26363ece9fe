#!/bin/bash
# gpu-proxy.sh MINUTES [train.py flags...]: one proxy stage on a lent GPU, from the bundled proxy, in one call.
#
# Prepared in session 54 (no GPU has been lent since session 49); run it as the device tool's one command.
# A session has 15 minutes of device time, the machine's start included, and 10 per command: MINUTES 7 leaves
# room for the start, the final monitor and the copy back. Here, first (the device image has transformers
# 5.17; the checkpoints are written with the pinned 5.23.0):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl transformers==5.23.0
# then: run(command="bash samples/wip/gpu-proxy.sh 7 --seed NNN [flags]", carry=[".whl"], timeout_s=600).
# The flags after MINUTES are added to the bundled stage's command (its train_state.json) with --out, --best,
# --minutes, --threads and --device replaced; a later flag overrides an earlier one (argparse keeps the last).
# What comes back under $OUT: train.log and the run directory as run.tar.00, .01, ... (15 MiB pieces: a file
# over 16 MiB does not come back). Here: cat FILES_AT/run.tar.* | tar x -C /work/runs.
# DEVICE=cpu WORKERS=1 runs the same script here, as a check of everything but CUDA.
set -euo pipefail
MINUTES=${1:?usage: gpu-proxy.sh MINUTES [train.py flags...]}
shift
OUT=${OUT:-/tmp/gpu-proxy-out}
DEVICE=${DEVICE:-cuda}
WORKERS=${WORKERS:-14}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if [ -x .venv/bin/python ]; then  # here (the device gets no .venv: it is not carried)
  PY=.venv/bin/python
else  # there: python3 holds torch; transformers at the pinned version from the carried wheel
  PY=python3
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
$PY - "$DEVICE" <<'EOF'
import sys, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, flush=True)
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device"
    print(torch.cuda.get_device_name(), flush=True)
EOF
RUN=/tmp/gpu-proxy-run
rm -rf "$RUN" && cp -r samples/models/qwen2_5_vl-proxy "$RUN"
BASE=$($PY -c "import json; print(json.load(open('$RUN/train_state.json'))['command'])")
# drop what this call sets itself: the stage's own --out / --best / --minutes / --threads / --device / --seed
ARGS=$($PY - "$BASE" <<'EOF'
import shlex, sys
words = shlex.split(sys.argv[1])[2:]  # without "python samples/train.py"
out, skip = [], {"--out", "--best", "--minutes", "--threads", "--device", "--seed", "--workers"}
i = 0
while i < len(words):
    if words[i] in skip:
        i += 2
        continue
    out.append(words[i])
    i += 1
print(shlex.join(out))
EOF
)
echo "base: $ARGS" | tee "$OUT/train.log"
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 timeout $(( ${MINUTES%.*} * 60 + 150 )) \
  $PY samples/train.py $ARGS --out "$RUN" --minutes "$MINUTES" --threads 2 --device "$DEVICE" \
  --workers "$WORKERS" --seed 0 "$@" 2>&1 | grep --line-buffered -v "Loading weights\|Writing model" | tee -a "$OUT/train.log"
(cd /tmp && tar cf - "$(basename "$RUN")" | split -b 15m -d - "$OUT/run.tar.")
ls -la "$OUT"
