"""LoRA under FSDP2 on 2 ranks (gloo): the frozen base shards and never changes, only adapters get
gradients, the step equals one process's, and an adapter-only checkpoint saves and reloads."""

import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.distributed import torchrun
from tests.distributed.lora_fsdp_probe import SHAPE
from training.engine.checkpoint_dir import list_checkpoints
from training.model import Transformer
from training.weights import lora

PROBE = Path(__file__).with_name("lora_fsdp_probe.py")


def _run(out: Path, ranks: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    result = torchrun.launch([str(PROBE), str(out)], ranks)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_lora_under_fsdp2_trains_only_adapters_and_checkpoints_them(tmp_path: Path):
    (alone,) = _run(tmp_path / "one", 1)
    gang = _run(tmp_path / "gang", 2)
    for facts in [alone, *gang]:
        assert facts["frozen_grads"] == [], facts  # nothing of the base to reduce
        assert facts["adapter_grads"] == 2 * 7 * 2
        assert facts["base_unchanged"] and facts["fresh_base_equal"]
        assert facts["reference_diff"] <= 1e-5 < facts["adapted_diff"], facts
        assert facts["merged_diff"] <= 1e-5, facts  # the merged checkpoint is the adapted model
        assert facts["committed"] == [1]
        assert facts["differs_before"] and facts["resumed_step"] == 1 and facts["pushed_equal"]
        assert facts["optimizer_steps"] == [1]
        if importlib.util.find_spec("training.weights.hf_load") is not None:
            assert facts["hf_base"] is True, facts
    assert all(f["world"] == 2 and f["sharded"] for f in gang)

    # The sharded step is the single process's step.
    one, two = (
        load_file(tmp_path / "one" / "adapters.safetensors"),
        load_file(tmp_path / "gang" / "adapters.safetensors"),
    )
    assert set(one) == set(two) and len(one) == 28
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-6)
    assert any(v.abs().sum() > 0 for k, v in two.items() if "lora_B" in k)  # B left zero: it trained
    reloaded = load_file(tmp_path / "gang" / "reloaded.safetensors")
    assert all(torch.equal(reloaded[k], two[k]) for k in two)
    # Merged from the gathered shards: the plain model's names, the single process's weights.
    merged_one = load_file(tmp_path / "one" / "merged.safetensors")
    merged_two = load_file(tmp_path / "gang" / "merged.safetensors")
    assert set(merged_two) == set(Transformer(SHAPE).state_dict()) == set(merged_one)
    for key in merged_one:
        torch.testing.assert_close(merged_two[key], merged_one[key], rtol=0, atol=1e-6)

    # The checkpoint the gang wrote holds adapters (and their moments) only.
    [info] = list_checkpoints(tmp_path / "gang" / "ckpt")
    saved = dcp.FileSystemReader(info.path).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys == set(two) and all(lora.is_adapter_key(k) for k in model_keys)
    assert (tmp_path / "gang" / "peft" / "adapter_model.safetensors").exists()
