"""Issue 40: the GRPO step's loss path reads nothing off the device. A value computed from the
model's weights and read on the host (`float`, `.item()`, `.tolist()`, `bool`) is a host sync on a
GPU: it drains the queue before the backward pass. The KL and clip fraction travel instead as the
loop's scalars, read with the loss in its one transfer, and reach the step's stats from there."""

import torch
from torch.overrides import TorchFunctionMode

from contracts.models import MODEL_SHAPES
from training.model import Transformer
from training.recipes import rlvr
from training.recipes.generation import Completion
from training.recipes.rlvr import Kept, RlvrConfig, StepStats, policy_loss

READS = {"item", "__float__", "__int__", "__bool__", "tolist"}


class DeviceReads(TorchFunctionMode):
    """Every host read of a value that depends on `params` (computed from them, however indirectly)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.tainted = {id(t) for t in params}
        self.kept: list[torch.Tensor] = list(params)  # alive while the probe is: ids stay unique
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        inputs += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
        derived = any(id(t) in self.tainted for t in inputs)
        name = getattr(func, "__name__", "")
        if derived and name in READS:
            self.reads.append(name)
        out = func(*args, **kwargs)
        if derived:
            for t in out if isinstance(out, list | tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    self.tainted.add(id(t))
                    self.kept.append(t)
        return out


def kept_batch() -> Kept:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (5,), generator=g).tolist() for _ in range(4)]
    completions = [
        Completion(
            tokens=torch.randint(0, 250, (6,), generator=g).tolist(), logprobs=[-1.5] * 6, finished=True
        )
        for _ in range(4)
    ]
    return Kept(
        prompts=prompts, completions=completions, rewards=[torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    )


def config() -> RlvrConfig:
    return RlvrConfig(
        stage="rlvr",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[("1+1=", "2")],
        steps=2,
        batch_size=2,
        learning_rate=1e-4,
        seed=0,
        checkpoint_dir="/nonexistent",
        device="cpu",
    )


def test_the_policy_loss_reads_no_device_value_and_hands_its_scalars_to_the_loop():
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES["tiny"])
    st = StepStats(step=1)
    probe = DeviceReads(list(model.parameters()))
    with probe:
        result = policy_loss(model, kept_batch(), config(), torch.device("cpu"), st)
    assert probe.reads == [], f"host reads of device values in the loss path: {probe.reads}"
    loss, _, scalars = result
    assert set(scalars) == {"kl", "clip_fraction"} and all(v.dim() == 0 for v in scalars.values())
    assert loss.requires_grad
    # What the loop reads off the device reaches the step's stats.
    rlvr.record_scalars(st, {name: float(v) for name, v in scalars.items()})
    assert st.kl == float(scalars["kl"]) and st.kl > 0 and 0.0 <= st.clip_fraction <= 1.0


def test_the_probe_sees_a_read_of_a_weight_derived_value():
    """The probe itself: a float() of a value computed from the weights is caught."""
    model = torch.nn.Linear(2, 1)
    probe = DeviceReads(list(model.parameters()))
    with probe:
        float(model(torch.ones(1, 2)).sum().detach())
    assert probe.reads == ["__float__"]


def per_row_batch(prompts: list[list[int]], completions: list[Completion]):
    """policy_batch as it was written before it was built in one tensor per field: row by row."""
    width = max(len(p) + len(c.tokens) for p, c in zip(prompts, completions, strict=True)) - 1
    inputs = torch.zeros((len(prompts), width), dtype=torch.long)
    targets = torch.zeros((len(prompts), width), dtype=torch.long)
    mask, old = torch.zeros((len(prompts), width)), torch.zeros((len(prompts), width))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor(p + c.tokens)
        n = len(seq) - 1
        inputs[i, :n], targets[i, :n] = seq[:-1], seq[1:]
        mask[i, len(p) - 1 : n] = 1.0
        old[i, len(p) - 1 : n] = torch.tensor(c.logprobs)
    return inputs, targets, mask, old


def test_the_padded_policy_batch_is_the_row_by_row_one_on_ragged_rows():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        rows = int(torch.randint(1, 7, (1,), generator=g))
        prompts = [
            torch.randint(1, 250, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows)
        ]
        completions = []
        for _ in range(rows):
            n = int(torch.randint(1, 12, (1,), generator=g))
            tokens = torch.randint(1, 250, (n,), generator=g).tolist()
            completions.append(
                Completion(tokens=tokens, logprobs=(-torch.rand(n, generator=g)).tolist(), finished=True)
            )
        for got, want in zip(
            rlvr.policy_batch(prompts, completions), per_row_batch(prompts, completions), strict=True
        ):
            assert got.dtype == want.dtype and torch.equal(got, want)
