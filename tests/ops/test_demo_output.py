"""`make demo` prints each thing once (issue: the desk's URL and the login line came twice, and a
summary repeated what `status --follow` had just printed). examples/demo.sh runs here against
stand-in `ito-training` and `ecc` commands that answer as the real ones do (the same lines, the same
JSON fields the script reads), so the script's own output is what is checked, in about a second;
the real commands' words are tested with the commands (tests/ecc/test_ecc_render.py, the e2e).
"""

import collections
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

FAKE_ITO = r"""#!/usr/bin/env bash
case "$1" in
  up) echo "desk: http://127.0.0.1:8765/ (operator token in $ITO_DATA_DIR/secrets/tokens/desk.token)" >&2
      echo '{"nats_url": "nats://127.0.0.1:1", "redis_url": "redis://127.0.0.1:2/0", "desk_url": "http://127.0.0.1:8765/"}' ;;
  accounts) echo '{"api_key": "SUAKEY"}' ;;
  simulate-booking) echo "published completed for booking demo-booking" ;;
  down) echo "stopped: everything" ;;
esac
"""

FAKE_ECC = r"""#!/usr/bin/env bash
shift  # "ito"
verb="$1"; shift
json=0; for a in "$@"; do [ "$a" = --json ] && json=1; done
case "$verb" in
  login) cat >/dev/null; echo "logged in as demo (key UK)" ;;
  auth) echo "logged in as demo (key UK)" ;;
  find) [ $json = 1 ] && echo '{"data": [{"booking_id": "demo-booking"}]}' || echo "demo-booking: completed, 1x8 H200" ;;
  plan) echo "strategy single, one process"; echo "estimate 0.026 USD (27 GPU-s at 3.50 USD per GPU-hour)" ;;
  confirm) if [ $json = 1 ]; then echo '{"data": {"confirmation_ref": "cf_REF"}}'
           else echo "confirmation_ref: cf_REF"; echo "  authorises: train on booking demo-booking, once"; fi ;;
  train) echo '{"data": {"run_id": "run_1"}}' ;;
  status) if [ $json = 1 ]; then
            echo '{"data": {"run_id": "run_1", "state": "succeeded", "stage": "pretrain", "step": 4, "total_steps": 4, "loss": 1.5, "message": "pretrain finished", "plan": {"strategy": "single", "booking_id": "demo-booking", "cost": {"total_usd": 0.026}}, "provenance": {"steps": []}, "gates": [{"stage": "pretrain", "passed": true, "metrics": [], "findings": []}]}}'
          else echo "run run_1: succeeded (stage pretrain, step 4/4, loss 1.5000)"; echo "  plan: single, estimate 0.026 USD"; fi ;;
esac
"""


def test_the_demo_prints_each_thing_once(tmp_path: pathlib.Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("ito-training", FAKE_ITO), ("ecc", FAKE_ECC)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "ITO_DATA_DIR": str(tmp_path / "ito"),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "demo.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    repeated = {ln: n for ln, n in collections.Counter(lines).items() if n > 1}
    assert repeated == {}, repeated  # every line once: the desk, the login, the run's end
    assert sum("8765" in ln for ln in lines) == 1  # the desk's address: `up` says it, nobody again
    assert sum("logged in as" in ln for ln in lines) == 1
    assert sum("estimate" in ln for ln in lines) == 2  # the plan's, and the run's end (its plan)
    assert "confirmation_ref: cf_REF" in lines and "authorises: train on booking demo-booking, once" in lines
