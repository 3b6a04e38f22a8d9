#!/usr/bin/env bash
# Issue 40's one prepared GPU run (item 7), within 8 minutes: nvidia-smi, then bench/gpu.py at 150M
# and 1B in bf16 on one GPU, 20 timed steps after 5 warm-up: the trainer's own step (train_stage,
# run_loop, the real data path, compiled as the trainer's Speed says) beside the torchtitan-style
# reference loop, MFU both ways, peak allocated and reserved memory beside the planner's estimate.
# Results (JSON, log, nvidia-smi) go to "$OUT" when it is set (the device tool's folder that comes
# back), else to bench/. Record the figures in docs/benchmarks.md with the date and the card.
#
# Python: $PYTHON, else .venv/bin/python if its torch sees CUDA, else python3 (the GPU image's,
# which holds a CUDA torch). It installs nothing of its own; msgspec (from `make install`, needed by
# contracts/) is not on the GPU image and the machine has no network, so bring its wheel:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0
# and carry `.whl`: this script installs what is there into /tmp/site when msgspec is missing.
#   run: bash bench/gpu_device_check.sh   (carry: [".whl"], timeout_s: 600)
set -euo pipefail
cd "$(dirname "$0")/.."

dest=${OUT:-bench}
mkdir -p "$dest"
nvidia-smi | tee "$dest/nvidia_smi.txt"

py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=.venv/bin/python
  else
    py=python3
  fi
fi
if ! "$py" -c 'import msgspec' 2>/dev/null; then
  if compgen -G '.whl/*.whl' >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_device_check: $py has no msgspec and there is no .whl/ to install it from (see the header)" >&2
    exit 1
  fi
fi
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

# 4-6 minutes on one H100/H200 (two compiles per shape); the timeout leaves the 8 minutes' rest.
status=0
timeout 450 "$py" -m bench.gpu --shapes 150M,1B --steps 20 --warmup 5 --out "$dest/gpu_results.json" 2>&1 \
  | tee "$dest/gpu_bench.log" || status=$?
exit "$status"
