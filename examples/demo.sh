#!/usr/bin/env bash
# The main job, end to end on embedded infra: up (with the desk's dashboard) -> account -> booking
# -> plan -> confirm -> train -> follow to `succeeded` -> down. Run it with `make demo`;
# `make demo DEMO_ARGS=--keep` (or ITO_DEMO_KEEP=1) leaves everything up to look at the dashboard.
# `make demo DEMO_ARGS=--finetune` then brings a model in and takes it out: a tiny Hugging Face base
# model and chat JSONL uploaded by the account (`ecc ito models upload`, `ecc ito files upload`),
# SFT -> DPO on them (examples/manifests/finetune.json), export and download of the result as a
# directory transformers loads.
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP="${ITO_DEMO_KEEP:-0}"
FINETUNE="${ITO_DEMO_FINETUNE:-0}"
for arg in "$@"; do
  case "$arg" in
    --keep) KEEP=1 ;;
    --finetune) FINETUNE=1 ;;
    *) echo "usage: examples/demo.sh [--keep] [--finetune]" >&2; exit 2 ;;
  esac
done

export ITO_DATA_DIR="${ITO_DATA_DIR:-$PWD/.ito}"
export ECC_CONFIG_DIR="${ECC_CONFIG_DIR:-$ITO_DATA_DIR/ecc-demo}"
MANIFEST="$PWD/examples/manifests/tiny.json"
BOOKING="demo-booking"
KEY="demo-$(date +%s)-$$"
json() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

echo "== 1. infra and services"
UP_ARGS=(--detach --json --desk)
# ITO_CLUSTER=1: a 3-node NATS cluster (streams R3) and two instances of every service
if [ "${ITO_CLUSTER:-0}" = 1 ]; then UP_ARGS+=(--cluster); fi
UP=$(ito-training up "${UP_ARGS[@]}")
if [ "$KEEP" = 1 ]; then
  trap 'echo "== left up (--keep): the dashboard stays at $DESK_URL; \`ito-training down\` (or \`make down\`) stops it all"' EXIT
else
  trap 'echo "== shutting down"; ito-training down' EXIT
fi
export ITO_NATS_URL=$(echo "$UP" | json '["nats_url"]')
export ITO_REDIS_URL=$(echo "$UP" | json '["redis_url"]')
DESK_URL=$(echo "$UP" | json '["desk_url"]')
TOKEN_FILE="${ITO_SECRETS_DIR:-$ITO_DATA_DIR/secrets}/tokens/desk.token"
if [ -t 1 ]; then  # a person's terminal, not a log file: the one link that logs in (the token rides
  # in the fragment, which the browser never sends to the server); `up` printed the desk's address
  echo "   open the desk's dashboard: ${DESK_URL}login#token=$(cat "$TOKEN_FILE")"
fi

echo "== 2. an account, and a login (the key goes through stdin, never an argument)"
ito-training accounts create demo --json | json '["api_key"]' | ecc ito login --account demo

echo "== 3. ito-compute completes a booking: 1 node x 8 H200, InfiniBand, 24 h"
ito-training simulate-booking --account demo --booking "$BOOKING" --event completed \
  --nodes 1 --gpus-per-node 8 --gpu-model H200 --fabric infiniband --hours 24
for _ in $(seq 50); do ecc ito find --json | grep -q "$BOOKING" && break; sleep 0.1; done
ecc ito find

echo "== 4. plan (creates nothing)"
ecc ito plan --booking "$BOOKING" --manifest "$MANIFEST"

echo "== 5. confirm: a separate, explicit step; shows what it authorises, returns an opaque reference"
CONFIRMED=$(ecc ito confirm --action train --booking "$BOOKING" --manifest "$MANIFEST")
echo "$CONFIRMED"
REF=$(echo "$CONFIRMED" | sed -n 's/^confirmation_ref: //p')

echo "== 6. train"
RUN=$(ecc ito train --booking "$BOOKING" --manifest "$MANIFEST" --confirmation-ref "$REF" \
  --idempotency-key "$KEY" --json | json '["data"]["run_id"]')
echo "run: $RUN (idempotency key $KEY)"

echo "== 7. follow"
ecc ito status "$RUN" --follow

# `--follow` printed the run's end (state, gates, data prep, plan); the demo only checks it succeeded
STATE=$(ecc ito status "$RUN" --json | json '["data"]["state"]')
[ "$STATE" = succeeded ] || { echo "run $RUN ended $STATE" >&2; exit 1; }

if [ "$FINETUNE" = 1 ]; then
  ASSETS="$ITO_DATA_DIR/finetune-demo"
  echo "== 8. bring a model and data: a tiny Llama checkpoint (HF layout) and chat JSONL, built locally and uploaded"
  python examples/finetune_assets.py "$ASSETS" >/dev/null
  DIGEST=$(ecc ito models upload "$ASSETS/base" --name tiny-llama --json | json '["data"]["model"]["digest"]')
  CHAT=$(ecc ito files upload "$ASSETS/sft.jsonl" --json | json '["data"]["file"]["source"]')
  PREFS=$(ecc ito files upload "$ASSETS/dpo.jsonl" --json | json '["data"]["file"]["source"]')
  EVAL=$(ecc ito files upload "$ASSETS/eval.jsonl" --purpose eval --json | json '["data"]["file"]["source"]')
  python examples/finetune_assets.py "$ASSETS" --revision "$DIGEST" --source "chat=$CHAT" \
    --source "prefs=$PREFS" --source "chat-eval=$EVAL" --manifest-out "$ASSETS/finetune.json" >/dev/null
  ecc ito models
  ecc ito files list
  FT_MANIFEST="$ASSETS/finetune.json"
  ecc ito plan --booking "$BOOKING" --manifest "$FT_MANIFEST"
  REF=$(ecc ito confirm --action train --booking "$BOOKING" --manifest "$FT_MANIFEST" --json | json '["data"]["confirmation_ref"]')
  FT_RUN=$(ecc ito train --booking "$BOOKING" --manifest "$FT_MANIFEST" --confirmation-ref "$REF" \
    --idempotency-key "$KEY-ft" --json | json '["data"]["run_id"]')
  echo "fine-tune run: $FT_RUN"
  ecc ito status "$FT_RUN" --follow
  echo "== 9. try it, and take it home"
  ecc ito sample "$FT_RUN" --prompt "What is 2+3?" --chat --max-new-tokens 4
  for _ in $(seq 120); do
    STATE=$(ecc ito export "$FT_RUN" --json | json '["data"]["state"]')
    [ "$STATE" = ready ] && break
    [ "$STATE" = failed ] && { ecc ito export "$FT_RUN"; exit 1; }
    sleep 1
  done
  ecc ito export "$FT_RUN"
  ecc ito download "$FT_RUN" --to "$ASSETS/model-out"
  echo "   load it: transformers.AutoModelForCausalLM.from_pretrained('$ASSETS/model-out')"
fi
