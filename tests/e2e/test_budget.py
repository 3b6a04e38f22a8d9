"""Cost as spent, end to end: a run whose metered spend would cross its budget cap is stopped by the
scheduler before it does, with a checkpoint committed, in state `budget_exhausted`, and says so.

One dedicated stack whose trainer takes longer per step than planned (the `trainer.slow_steps`
fault point): the estimate passes the cap at plan time, the spend would not.
"""

import pytest

from tests.support import confirm_and_train, run_state

pytestmark = pytest.mark.e2e
PRICE_H200 = 3.50  # services/scheduler/desk_prices.json: what one held GPU-second costs below
SLOW = {"ITO_FAULT_POINT": "trainer.slow_steps", "ITO_FAULT_STEP_DELAY_S": "0.5"}


def test_a_run_whose_spend_would_cross_its_cap_stops_at_the_cap_with_a_checkpoint(make_stack, manifest):
    stack = make_stack(env=SLOW)
    account, _, env = stack.account()
    booking = stack.booking(account)
    target = {
        "tokens": 80 * 8 * 32,
        "seq_len": 32,
        "batch_size": 8,
        "learning_rate": 0.003,
    }  # 80 steps, >= 40 s
    checkpoint = {"interval_steps": 1000, "keep_last": 2, "storage": "local"}  # only the stop's checkpoint
    probe = str(manifest(target=target, checkpoint=checkpoint))
    rc, planned = stack.ecc("plan", "--booking", booking, "--manifest", probe, env=env)
    assert rc == 0 and planned["ok"], planned
    estimate = planned["data"]["cost"]["total_usd"]
    cap = round(max(estimate * 1.2, 15 * PRICE_H200 / 3600), 6)  # above the estimate; ~15 s of one GPU
    m = str(manifest(target=target, checkpoint=checkpoint, budget_cap_usd=cap))
    train = confirm_and_train(stack, env, booking, m, "cap-1")
    run_id = train["data"]["run_id"]

    view = run_state(
        stack, env, run_id, {"budget_exhausted", "succeeded", "failed", "cancelled"}, timeout=150
    )
    assert view["state"] == "budget_exhausted", view
    assert "budget exhausted" in view["message"] and f"{cap:.4f}" in view["message"], view["message"]
    spend = view["spend"]
    assert 0 < spend["spent_usd"] <= cap, spend
    assert spend["limit_usd"] == pytest.approx(cap) and spend["held_gpus"] == 1, spend
    assert view["step"] < 80, view  # stopped before its end
    rc, listed = stack.ecc("checkpoints", run_id, env=env)
    assert rc == 0 and listed["data"]["checkpoints"], listed  # the stop's checkpoint, committed
    assert listed["data"]["checkpoints"][-1]["step"] == view["last_checkpoint_step"]
    # The plain status says the same sentence a person reads.
    proc = stack.run("ecc", "ito", "status", run_id, env=env)
    assert "budget_exhausted" in proc.stdout and "budget exhausted" in proc.stdout, proc.stdout
