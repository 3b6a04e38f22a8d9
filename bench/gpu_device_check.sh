#!/usr/bin/env bash
# One run of bench/gpu.py on a lent GPU machine (an H200), within about 8 minutes: nvidia-smi, then
# 150M and 1B for 30 timed steps on one GPU (bf16, torch.compile per block), then FSDP2 over every
# GPU when there is more than one. Results (JSON, log, nvidia-smi) go to "$OUT" when it is set (the
# device tool's folder that comes back), else to bench/. Record the figures in README.md's
# "GPU throughput" table with the date and the GPU.
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
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'

status=0
# About 3 minutes on one H200 (compilation included); the timeout keeps time for the FSDP2 run.
timeout 330 "$py" -m bench.gpu --shapes 150M,1B --steps 30 --out "$dest/gpu_results.json" 2>&1 \
  | tee "$dest/gpu_bench.log" || status=$?
if ((gpus > 1)); then
  timeout 240 "$py" -m bench.gpu --shapes 150M,1B --steps 30 --fsdp --out "$dest/gpu_results_fsdp.json" 2>&1 \
    | tee "$dest/gpu_bench_fsdp.log" || status=$?
else
  echo "gpu_device_check: one GPU, so no FSDP2 run"
fi
exit "$status"
