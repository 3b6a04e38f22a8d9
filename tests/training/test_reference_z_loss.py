"""PaLM's z-loss, from the manifest to the loss: `target.z_loss` reaches every next-token stage, and
the model adds exactly z * mean(logsumexp(logits) ** 2) to the cross-entropy while training, and
nothing when it is evaluated (held-out loss means the same with z-loss on or off)."""

import msgspec
import pytest
import torch
import torch.nn.functional as F

from contracts.manifest import Manifest
from contracts.models import MODEL_SHAPES
from training.engine.reporting import Recorder
from training.model import Transformer
from training.recipes.pretrain import stage_config_from_manifest, train_stage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = MODEL_SHAPES["tiny"]
SEQ, BATCH = 32, 8
Z = 1e-2  # large enough that the term (~ Z * ln(256)^2 ~ 0.3 at init) is far above float noise


def manifest(*, steps: int = 1, z_loss: float | None = None) -> Manifest:
    target = {"tokens": 3 * steps * SEQ * BATCH, "seq_len": SEQ, "batch_size": BATCH}
    if z_loss is not None:
        target["z_loss"] = z_loss
    return msgspec.convert(
        {
            "name": "z-loss",
            "model": {"size": "tiny", "revision": "test"},
            "data": [{"name": "docs", "source": "builtin:pydoc_topics"}],
            "target": target,
            "stages": {
                "pretrain": {},
                "midtrain": {"tokens": steps * SEQ * BATCH},
                "long_context": {
                    "tokens": steps * 2 * SEQ * BATCH // 2,
                    "seq_len": 2 * SEQ,
                    "batch_size": BATCH // 2,
                },
            },
            "budget_cap_usd": 1.0,
        },
        Manifest,
    )


def palm_z_loss(logits: torch.Tensor, targets: torch.Tensor, z: float) -> torch.Tensor:
    """PaLM (Chowdhery et al., 2022): cross-entropy + z * log(Z)^2, Z the softmax normaliser,
    averaged over every position."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1)) + z * (torch.logsumexp(flat, dim=-1) ** 2).mean()


def test_z_loss_defaults_to_off_and_cannot_be_negative():
    assert manifest().target.z_loss == 0.0  # a manifest written before the field: same run as before
    assert manifest(z_loss=1e-4).target.z_loss == 1e-4
    with pytest.raises(msgspec.ValidationError, match="z_loss"):
        manifest(z_loss=-1e-4)


@pytest.mark.parametrize("z", [0.0, 1e-4, Z])
def test_the_model_adds_palms_z_loss_while_training_only(z):
    torch.manual_seed(0)
    model = Transformer(TINY, z_loss=z)
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, palm_z_loss(logits, targets, z))
    model.eval()
    _, held_out = model(idx, targets)
    torch.testing.assert_close(held_out, palm_z_loss(logits, targets, 0.0))


@pytest.mark.parametrize("stage", ["pretrain", "midtrain", "long_context"])
def test_every_next_token_stage_takes_z_loss_from_the_manifest(stage, tmp_path):
    assert stage_config_from_manifest(manifest(), tmp_path, stage).z_loss == 0.0
    assert stage_config_from_manifest(manifest(z_loss=Z), tmp_path, stage).z_loss == Z


def test_z_loss_from_the_manifest_changes_the_trained_loss_by_palms_term(tmp_path):
    # The first step's loss is computed on the initial weights: record that forward's logits and
    # targets, and the loss the stage reports must be their cross-entropy plus exactly Z * mean(lse^2).
    # (The training forward returns no logits: the loss is chunked. The hook recomputes them from the
    # same weights, before the optimizer steps.)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    busy: list[bool] = []

    def record(module, args, output):
        if isinstance(module, Transformer) and module.training and not seen and not busy:
            busy.append(True)
            with torch.no_grad():
                logits, _ = module(args[0])
            seen.append((logits, args[1]))

    cfg = stage_config_from_manifest(manifest(z_loss=Z), tmp_path)
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        result = train_stage(cfg, Recorder(), lambda: False)
    finally:
        handle.remove()
    logits, targets = seen[0]
    cross_entropy = palm_z_loss(logits, targets, 0.0).item()
    term = result.first_loss - cross_entropy
    assert term == pytest.approx(palm_z_loss(logits, targets, Z).item() - cross_entropy, rel=1e-4)
    assert term > 0.25  # ~ Z * ln(256)^2 at initialisation: the manifest's setting is not lost on the way
