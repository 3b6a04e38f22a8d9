"""Cost as spent, end to end: a run whose metered spend would cross its budget cap, or the cost bound
its confirmation authorised, is stopped by the scheduler before it does, with a checkpoint
committed, in state `budget_exhausted`, and says so.

One dedicated stack whose trainer takes longer per step than planned (the `trainer.slow_steps`
fault point): the estimate passes the cap at plan time, the spend would not.
"""

import pytest

from tests.conftest import start_stack
from tests.support import confirm_and_train, run_state

pytestmark = pytest.mark.e2e
PRICE_H200 = 3.50  # services/scheduler/desk_prices.json: what one held GPU-second costs below
SLOW = {"ITO_FAULT_POINT": "trainer.slow_steps", "ITO_FAULT_STEP_DELAY_S": "0.5"}


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory):
    """One stack whose trainer is slow per step, for both stops (each test has its own account)."""
    s = start_stack(tmp_path_factory.mktemp("stack"), None, SLOW)
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


def test_a_run_whose_spend_would_cross_its_cap_stops_at_the_cap_with_a_checkpoint(slow_stack, manifest):
    stack = slow_stack
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


def test_a_run_whose_spend_would_cross_its_confirmations_bound_stops_at_the_bound(slow_stack, manifest):
    """The cap is far away; the person confirmed less (`ecc ito confirm --max-cost`): that is the limit."""
    stack = slow_stack
    account, _, env = stack.account()
    booking = stack.booking(account)
    target = {"tokens": 80 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    checkpoint = {"interval_steps": 1000, "keep_last": 2, "storage": "local"}
    m = str(manifest(target=target, checkpoint=checkpoint, budget_cap_usd=5.0))
    rc, planned = stack.ecc("plan", "--booking", booking, "--manifest", m, env=env)
    assert rc == 0 and planned["ok"], planned
    bound = round(max(planned["data"]["cost"]["total_usd"] * 1.2, 15 * PRICE_H200 / 3600), 6)
    train = confirm_and_train(stack, env, booking, m, "bound-1", max_cost=bound)
    view = run_state(
        stack,
        env,
        train["data"]["run_id"],
        {"budget_exhausted", "succeeded", "failed", "cancelled"},
        timeout=150,
    )
    assert view["state"] == "budget_exhausted", view
    assert f"{bound:.4f}" in view["message"], view["message"]
    assert view["spend"]["limit_usd"] == pytest.approx(bound) and 0 < view["spend"]["spent_usd"] <= bound
    assert view["step"] < 80, view
