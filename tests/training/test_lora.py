"""LoRA on our Transformer: peft's math layer by layer, only adapters train, merging, adapter-only
checkpoints, and the PEFT-format export loaded by peft onto a Hugging Face model."""

import json
import math
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear
from safetensors.torch import load_file

from contracts.manifest import Lora
from contracts.models import MODEL_SHAPES, ModelShape
from contracts.runs import LogLine
from training.engine.checkpoint import Checkpointer, write_merged_checkpoint
from training.engine.checkpoint_dir import list_checkpoints
from training.engine.checkpoint_load import load_latest, load_weights
from training.engine.reporting import Recorder
from training.model import Transformer
from training.recipes.posttrain import PostConfig, train_dpo, train_sft
from training.weights import lora

SHAPE = ModelShape(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=97, max_seq_len=32)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OURS = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


def base_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(SHAPE)


def lora_model(cfg: Lora, seed: int = 0) -> Transformer:
    model = base_model(seed)
    lora.apply_lora(model, cfg)
    return model


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the adapted model is the base): give it values so the update shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)


def sgd_steps(model: torch.nn.Module, steps: int = 3, seed: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(lora.trainable_parameters(model), lr=0.5)
    for _ in range(steps):
        idx = torch.randint(0, SHAPE.vocab_size, (2, 12), generator=gen)
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()


# ---- one layer: exactly peft's LoraLayer -------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_is_peft_linear_init_forward_and_merge(bias):
    torch.manual_seed(3)
    ours_base, peft_base = torch.nn.Linear(24, 40, bias=bias), torch.nn.Linear(24, 40, bias=bias)
    peft_base.load_state_dict(ours_base.state_dict())
    torch.manual_seed(7)
    ours = lora.LoraLinear(ours_base, rank=4, alpha=12.0, dropout=0.0)
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=12.0, lora_dropout=0.0)
    theirs = PeftLinear(peft_base, "default", config, r=4, lora_alpha=12.0, lora_dropout=0.0)
    # The same draws in the same order: peft's init is ours bit for bit (A kaiming, B zero).
    assert torch.equal(ours.lora_A.weight, theirs.lora_A["default"].weight)
    assert torch.equal(ours.lora_B.weight, theirs.lora_B["default"].weight) and not ours.lora_B.weight.any()
    assert ours.scaling == theirs.scaling["default"] == 3.0
    with torch.no_grad():
        b = torch.randn(ours.lora_B.weight.shape)
        ours.lora_B.weight.copy_(b)
        theirs.lora_B["default"].weight.copy_(b)
    x = torch.randn(5, 24)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
    assert not torch.allclose(ours(x), ours_base(x))  # the update is there
    with lora.adapters_disabled(ours), _off(theirs):
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
        torch.testing.assert_close(ours(x), ours_base(x), rtol=0, atol=0)
    theirs.merge()
    torch.testing.assert_close(ours.weight + ours.delta_weight(), theirs.base_layer.weight, rtol=0, atol=1e-6)


class _off:
    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        self.layer.enable_adapters(False)

    def __exit__(self, *exc):
        self.layer.enable_adapters(True)


def test_dropout_is_on_the_input_of_a_only():
    torch.manual_seed(0)
    layer = lora.LoraLinear(torch.nn.Linear(16, 16, bias=False), rank=2, alpha=2.0, dropout=0.5)
    assert isinstance(layer.lora_dropout, torch.nn.Dropout) and layer.lora_dropout.p == 0.5
    x = torch.randn(4, 16)
    layer.train()
    with lora.adapters_disabled(layer):  # the base path never sees dropout
        assert torch.equal(layer(x), x @ layer.weight.T)
    layer.eval()
    torch.testing.assert_close(layer(x), x @ layer.weight.T)  # B = 0


# ---- the whole model ---------------------------------------------------------------------------------


def test_unknown_targets_are_refused_with_the_valid_names():
    model = base_model()
    with pytest.raises(ValueError) as err:
        lora.apply_lora(model, Lora(target_modules=["q_proj", "qkv_proj", "wq"]))
    message = str(err.value)
    assert "'qkv_proj'" in message and "'wq'" in message and "'q_proj'" not in message
    for name in ALL:
        assert name in message
    assert not any(isinstance(m, lora.LoraLinear) for m in model.modules())  # nothing half-applied


def test_apply_keeps_names_and_freezes_all_but_the_adapters():
    plain = base_model()
    names = set(plain.state_dict())
    model = lora_model(Lora(rank=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    state = model.state_dict()
    assert names <= set(state)  # wq.weight etc. are where they were
    adapters = {k for k in state if lora.is_adapter_key(k)}
    assert adapters == {
        f"blocks.{i}.{m}.{ab}.weight"
        for i in range(SHAPE.n_layer)
        for m in ("attn.wq", "attn.wv", "mlp.w_down")
        for ab in ("lora_A", "lora_B")
    }
    assert set(state) == names | adapters
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapters
    assert {id(p) for p in lora.trainable_parameters(model)} == {
        id(p) for n, p in model.named_parameters() if n in adapters
    }
    assert model.blocks[0].attn.wq.lora_A.weight.shape == (4, SHAPE.d_model)
    assert model.blocks[0].mlp.w_down.lora_B.weight.shape == (SHAPE.d_model, 4)
    assert isinstance(model.blocks[0].attn.wk, torch.nn.Linear) and not isinstance(
        model.blocks[0].attn.wk, lora.LoraLinear
    )
    # B = 0: the adapted model is the base, bit for bit.
    idx = torch.randint(0, SHAPE.vocab_size, (2, 9))
    assert torch.equal(model(idx)[0], plain(idx)[0])
    with pytest.raises(ValueError, match="already"):
        lora.apply_lora(model, Lora())


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL, ["o_proj", "down_proj", "o_proj"]])
def test_the_planners_adapter_count_is_the_built_models(targets):
    from services.scheduler.planning import lora_parameters

    cfg = Lora(rank=3, target_modules=targets)
    model = lora_model(cfg)
    assert sum(p.numel() for p in lora.trainable_parameters(model)) == lora_parameters(SHAPE, cfg)


def test_our_model_equals_peft_wrapping_our_own_modules():
    cfg = Lora(rank=4, alpha=8.0, target_modules=ALL)
    ours = lora_model(cfg)
    randomize_adapters(ours)
    theirs = get_peft_model(base_model(), LoraConfig(r=4, lora_alpha=8.0, target_modules=OURS))
    prefix = "base_model.model."
    their_state = theirs.state_dict()
    with torch.no_grad():
        for key, value in lora.adapter_state_dict(ours).items():
            name = prefix + key.replace(".lora_A.", ".lora_A.default.").replace(
                ".lora_B.", ".lora_B.default."
            )
            their_state[name].copy_(value)
    idx = torch.randint(0, SHAPE.vocab_size, (3, 11))
    torch.testing.assert_close(ours(idx)[0], theirs(idx)[0], rtol=0, atol=1e-5)
    with lora.adapters_disabled(ours), theirs.disable_adapter():
        torch.testing.assert_close(ours(idx)[0], theirs(idx)[0], rtol=0, atol=0)


def test_training_changes_only_the_adapters_and_merging_keeps_the_function():
    cfg = Lora(rank=4, alpha=16.0, target_modules=ALL)
    model = lora_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sgd_steps(model)
    after = model.state_dict()
    for key, value in after.items():
        if lora.is_adapter_key(key):
            if key.endswith("lora_B.weight"):
                assert not torch.equal(value, before[key]), f"{key} did not train"
        else:
            assert torch.equal(value, before[key]), f"the frozen {key} changed"
            assert model.get_parameter(key).grad is None
    idx = torch.randint(0, SHAPE.vocab_size, (2, 10))
    with torch.no_grad():
        adapted = model(idx)[0]
        with lora.adapters_disabled(model):
            torch.testing.assert_close(model(idx)[0], base_model()(idx)[0], rtol=0, atol=0)
    full = dict(model.state_dict())
    merged_state = lora.merge_state_dict(full, cfg)
    merged = lora.merge_lora(model)
    assert set(merged.state_dict()) == set(base_model().state_dict())
    assert not any(isinstance(m, lora.LoraLinear) for m in merged.modules())
    assert all(p.requires_grad for p in merged.parameters())
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, merged_state[key], rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(merged(idx)[0], adapted, rtol=0, atol=1e-5)
    fresh = base_model()
    fresh.load_state_dict(merged_state)  # the merged state loads into a plain model, strictly
    torch.testing.assert_close(fresh(idx)[0], adapted, rtol=0, atol=1e-5)


def test_inside_plain_linears_the_model_looks_unadapted_and_loads_its_base():
    cfg = Lora(rank=2, target_modules=["q_proj", "down_proj"])
    model = lora_model(cfg)
    randomize_adapters(model)
    adapters = lora.adapter_state_dict(model)
    source = base_model(seed=4).state_dict()
    with lora.plain_linears(model):
        assert set(model.state_dict()) == set(source)
        assert not any(isinstance(m, lora.LoraLinear) for m in model.modules())
        model.load_state_dict(source)  # strict: exactly the plain model's keys
    assert isinstance(model.blocks[0].attn.wq, lora.LoraLinear)
    assert torch.equal(model.blocks[1].attn.wq.weight, source["blocks.1.attn.wq.weight"])
    assert torch.equal(model.blocks[1].mlp.w_down.weight, source["blocks.1.mlp.w_down.weight"])
    assert all(torch.equal(lora.adapter_state_dict(model)[k], v) for k, v in adapters.items())
    assert not model.blocks[0].attn.wq.weight.requires_grad


def test_adapter_state_round_trip_and_its_checks():
    cfg = Lora(rank=2, target_modules=["q_proj", "up_proj"])
    trained = lora_model(cfg)
    sgd_steps(trained)
    state = lora.adapter_state_dict(trained)
    other = lora_model(cfg, seed=5)
    lora.load_adapter_state(other, state)
    assert all(torch.equal(v, lora.adapter_state_dict(other)[k]) for k, v in state.items())
    with pytest.raises(ValueError, match="missing"):
        lora.load_adapter_state(other, dict(list(state.items())[1:]))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.adapter_state_dict(base_model())


# ---- adapter-only checkpoints -------------------------------------------------------------------------


def _adam(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, SHAPE.vocab_size, (2, 12), generator=gen)
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()


def test_adapter_only_checkpoint_round_trip(tmp_path: Path):
    cfg = Lora(rank=4, alpha=8.0, target_modules=ALL)
    # The base: a whole-model checkpoint of a previous stage (saved with no filter, as today).
    previous = base_model(seed=11)
    prev_ckpt = Checkpointer(tmp_path / "previous")
    prev_ckpt.save(1, previous, torch.optim.AdamW(previous.parameters()))
    assert prev_ckpt.wait()[0].step == 1
    prev_ckpt.close()

    model = lora_model(cfg)
    assert load_weights(tmp_path / "previous", model, model_keys=lora.is_base_key) is not None
    assert torch.equal(model.blocks[1].attn.wq.weight, previous.blocks[1].attn.wq.weight)
    opt = _adam(model)
    _train(model, opt, 2, seed=3)
    ckpt = Checkpointer(tmp_path / "lora", model_keys=lora.is_adapter_key)
    ckpt.save(2, model, opt)
    [info] = ckpt.wait()
    ckpt.close()

    saved = dcp.FileSystemReader(info.path).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys == set(lora.adapter_state_dict(model))  # no base weight in the files
    moments = [
        k.removeprefix("optimizer.state.").rpartition(".")[0]
        for k in saved
        if k.startswith("optimizer.state.")
    ]
    assert moments and set(moments) == model_keys  # the optimizer's state is the adapters' alone
    full = Checkpointer(tmp_path / "whole")  # what the same model saves unfiltered, for scale
    full.save(2, model, opt)
    [whole] = full.wait()
    full.close()
    assert info.bytes < whole.bytes

    # Resume: the base from where the stage started, then the adapters and their optimizer state.
    resumed = lora_model(cfg, seed=99)
    load_weights(tmp_path / "previous", resumed, model_keys=lora.is_base_key)
    resumed_opt = _adam(resumed)
    state = load_latest(tmp_path / "lora", resumed, resumed_opt, model_keys=lora.is_adapter_key)
    assert state is not None and state.step == 2
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    # Both continue alike: the optimizer's moments came back too.
    _train(model, opt, 1, seed=4)
    _train(resumed, resumed_opt, 1, seed=4)
    for key, value in lora.adapter_state_dict(model).items():
        torch.testing.assert_close(lora.adapter_state_dict(resumed)[key], value, rtol=0, atol=0)


# ---- the PEFT export, loaded by peft onto a Hugging Face model ---------------------------------------


def _hf_qwen3(shape: ModelShape):
    """A tiny Qwen3 (QK-norm, no biases, untied): the Hugging Face family our current model is."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.d_model,
        intermediate_size=shape.d_ff,
        num_hidden_layers=shape.n_layer,
        num_attention_heads=shape.n_head,
        num_key_value_heads=shape.n_kv_head,
        head_dim=shape.d_model // shape.n_head,
        max_position_embeddings=shape.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_base},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


_HF_NAMES = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.w_gate": "mlp.gate_proj",
    "mlp.w_up": "mlp.up_proj",
    "mlp.w_down": "mlp.down_proj",
}


def _from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in hf_state.items():
        if key == "model.embed_tokens.weight":
            out["tok_emb.weight"] = value
        elif key == "model.norm.weight":
            out["norm.weight"] = value
        elif key == "lm_head.weight":
            out[key] = value
        else:
            _, _, i, rest = key.split(".", 3)
            module, _, param = rest.rpartition(".")
            ours = {v: k for k, v in _HF_NAMES.items()}[module]
            out[f"blocks.{i}.{ours}.{param}"] = value
    return out


def test_the_peft_export_loads_into_peft_and_merges_the_same(tmp_path: Path):
    cfg = Lora(
        rank=4,
        alpha=8.0,
        dropout=0.05,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    )
    hf = _hf_qwen3(SHAPE)
    ours = base_model()
    ours.load_state_dict(_from_hf(hf.state_dict()))
    idx = torch.randint(0, SHAPE.vocab_size, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, rtol=0, atol=1e-4)  # the same model
    lora.apply_lora(ours, cfg)
    sgd_steps(ours)
    ours.eval()
    files = lora.write_peft_adapter(ours, cfg, tmp_path / "adapter", base_model="tiny-qwen3")
    assert [f.path for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    for f in files:
        path = tmp_path / "adapter" / f.path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert f.bytes == path.stat().st_size and f.sha256.startswith("sha256:") and len(f.sha256) == 71
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["bias"]) == (
        4,
        8.0,
        0.05,
        "none",
    )
    assert config["base_model_name_or_path"] == "tiny-qwen3"
    assert sorted(config["target_modules"]) == sorted(cfg.target_modules)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in tensors
    assert len(tensors) == 2 * len(cfg.target_modules) * SHAPE.n_layer

    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours_logits = ours(idx)[0]
        torch.testing.assert_close(peft_model(idx).logits, ours_logits, rtol=0, atol=1e-4)
        with lora.adapters_disabled(ours), peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(idx).logits, ours(idx)[0], rtol=0, atol=1e-4)
    merged_hf = _from_hf(peft_model.merge_and_unload().state_dict())
    merged = lora.merge_lora(ours).state_dict()
    assert set(merged) == set(merged_hf)
    for key, value in merged.items():
        torch.testing.assert_close(value, merged_hf[key], rtol=0, atol=1e-6)


# ---- LoRA post-training stages (SFT, DPO) in one process ----------------------------------------------

PROBLEMS = [(f"{a}+{b}=", str(a + b)) for a in range(12) for b in range(12)]


def _previous_stage(directory: Path) -> Transformer:
    """A previous stage's final checkpoint (a whole model, as every stage saves today)."""
    torch.manual_seed(21)
    model = Transformer(MODEL_SHAPES["tiny"])
    ckpt = Checkpointer(directory)
    ckpt.save(1, model, torch.optim.AdamW(model.parameters()))
    ckpt.wait()
    ckpt.close()
    return model


def _post(stage: str, root: Path, tag: str, init_from: Path, steps: int = 6) -> PostConfig:
    return PostConfig(
        stage=stage,
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=PROBLEMS,
        steps=steps,
        batch_size=4,
        learning_rate=1e-2,
        seed=0,
        checkpoint_dir=str(root / tag),
        checkpoint_interval=1000,
        init_from=str(init_from),
        lora=Lora(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"]),
    )


class _StopAfter:
    def __init__(self, calls: int):
        self.calls = calls

    def __call__(self) -> bool:
        self.calls -= 1
        return self.calls < 0


def _never() -> bool:
    return False


def test_a_lora_sft_stage_trains_adapters_checkpoints_them_and_resumes_exactly(tmp_path: Path):
    previous = _previous_stage(tmp_path / "pre")
    alone = train_sft(_post("sft", tmp_path, "alone", tmp_path / "pre"), Recorder(), _never)
    assert alone.model is not None and alone.final_step == 6
    base = {k: v for k, v in alone.model.state_dict().items() if not lora.is_adapter_key(k)}
    assert all(torch.equal(v, previous.state_dict()[k]) for k, v in base.items())  # the incoming, frozen
    [info] = list_checkpoints(tmp_path / "alone")
    saved = dcp.FileSystemReader(info.path).read_metadata().state_dict_metadata
    assert {k.removeprefix("model.") for k in saved if k.startswith("model.")} == set(
        lora.adapter_state_dict(alone.model)
    )
    # Stopped after 3 steps (saved on stop), then resumed: the base again from init_from, the
    # adapters and their optimizer from the stage's own checkpoint, ending where one run ends.
    cfg = _post("sft", tmp_path, "resumed", tmp_path / "pre")
    first = train_sft(cfg, Recorder(), _StopAfter(3))
    assert first.stopped and 0 < first.final_step < 6
    report = Recorder()
    second = train_sft(cfg, report, _never)
    assert second.final_step == 6 and second.model is not None
    assert any("Resuming" in line.message for line in report.of(LogLine))
    for key, value in lora.adapter_state_dict(alone.model).items():
        torch.testing.assert_close(lora.adapter_state_dict(second.model)[key], value, rtol=0, atol=1e-6)


def test_the_merged_checkpoint_starts_a_following_full_stage(tmp_path: Path):
    _previous_stage(tmp_path / "pre")
    sft = train_sft(_post("sft", tmp_path, "sft", tmp_path / "pre", steps=3), Recorder(), _never)
    assert sft.model is not None
    cfg = _post("sft", tmp_path, "sft", tmp_path / "pre").lora
    assert cfg is not None
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        adapted = sft.model(idx)[0]
    write_merged_checkpoint(sft.model, cfg, tmp_path / "merged", step=3)
    [info] = list_checkpoints(tmp_path / "merged")
    assert info.step == 3
    # A full fine-tuning stage after it starts from the merged weights with load_weights, as usual.
    following = Transformer(MODEL_SHAPES["tiny"])
    assert load_weights(tmp_path / "merged", following) is not None
    with torch.no_grad():
        torch.testing.assert_close(following(idx)[0], adapted, rtol=0, atol=1e-5)


def test_a_lora_dpo_stage_uses_the_base_with_adapters_off_as_its_reference(tmp_path: Path):
    previous = _previous_stage(tmp_path / "pre")
    result = train_dpo(_post("dpo", tmp_path, "dpo", tmp_path / "pre", steps=3), Recorder(), _never)
    # B starts at zero, so the policy is the reference at the first step: the sigmoid loss is log 2.
    assert result.first_loss == pytest.approx(math.log(2), abs=1e-6)
    assert result.final_loss != pytest.approx(math.log(2), abs=1e-6)  # the policy moved off it
    assert result.model is not None
    assert any(v.any() for k, v in lora.adapter_state_dict(result.model).items() if "lora_B" in k)
    for key, value in result.model.state_dict().items():
        if not lora.is_adapter_key(key):
            assert torch.equal(value, previous.state_dict()[key]), key


# ---- a Hugging Face Llama loaded through hf_load: LoRA, the PEFT export, merge_and_unload --------------


def test_a_llama_base_adapted_here_is_what_peft_computes(tmp_path: Path):
    hf_load = pytest.importorskip("training.weights.hf_load", reason="the hfmodel helper's loader")
    from transformers import LlamaConfig, LlamaForCausalLM

    from domain.model_shapes import shape_from_hf_config

    config = LlamaConfig(
        vocab_size=SHAPE.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "base")
    shape = shape_from_hf_config(json.loads((tmp_path / "base" / "config.json").read_text())).shape
    assert not shape.qk_norm
    ours = Transformer(shape)
    hf_load.load_hf_weights(ours, tmp_path / "base")
    idx = torch.randint(0, SHAPE.vocab_size, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, rtol=0, atol=1e-4)
    base = {k: v.clone() for k, v in ours.state_dict().items()}

    cfg = Lora(rank=4, alpha=16.0, target_modules=ALL)
    lora.apply_lora(ours, cfg)
    sgd_steps(ours)
    ours.eval()
    for key, value in ours.state_dict().items():
        assert lora.is_adapter_key(key) or torch.equal(value, base[key]), f"the frozen {key} changed"
    # The sharded order (adapters on, then the base loaded, as a LoRA stage starting from a base
    # model does) gives the same base under untouched adapters.
    later = Transformer(shape)
    lora.apply_lora(later, cfg)
    adapters = lora.adapter_state_dict(later)
    assert load_weights(tmp_path / "base", later, model_keys=lora.is_base_key) is not None
    assert all(torch.equal(later.state_dict()[k], v) for k, v in base.items())
    assert all(torch.equal(lora.adapter_state_dict(later)[k], v) for k, v in adapters.items())

    lora.write_peft_adapter(ours, cfg, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(idx).logits, ours(idx)[0], rtol=0, atol=1e-4)
    merged_hf = peft_model.merge_and_unload().state_dict()
    merged = lora.merge_lora(ours).state_dict()
    for key, value in merged.items():
        hf_key = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(key)
        if hf_key is None and key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            module, _, param = rest.rpartition(".")
            hf_key = f"model.layers.{i}.{_HF_NAMES[module]}.{param}"
        torch.testing.assert_close(value, merged_hf[hf_key or key], rtol=0, atol=1e-6)


def test_a_lora_rlvr_stage_feeds_its_rollout_worker_merged_weights(tmp_path: Path):
    from contracts.manifest import RlvrStage
    from training.recipes.generation import Completion
    from training.recipes.rlvr import RlvrConfig, train_rlvr
    from training.recipes.rollout import RolloutBatch

    published: list[dict[str, torch.Tensor]] = []

    class Worker:
        """Fresh rollouts, alternately right and wrong (no group is uniform); keeps what it is sent."""

        def __init__(self, shape, rope_base, *, threads, device):
            self.version, self.pending = -1, {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def publish(self, version, state_dict):
            self.version = version
            published.append({k: v.clone() for k, v in state_dict.items()})

        def request(self, request):
            self.pending[request.request_id] = request

        def collect(self, request_id):
            request = self.pending.pop(request_id)
            groups = [
                [
                    Completion(tokens=list(t.encode()), logprobs=[-1.0] * len(t), finished=True)
                    for t in ("3\n" if i % 2 else "x\n" for i in range(request.group_size))
                ]
                for _ in request.prompts
            ]
            return RolloutBatch(
                request_id=request_id, version=self.version, prompts=request.prompts, groups=groups
            )

    previous = _previous_stage(tmp_path / "pre")
    cfg = Lora(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj", "up_proj"])
    rlvr = RlvrStage(max_response_tokens=8, overlong_buffer_tokens=3, prompts_per_step=2, group_size=4)
    config = RlvrConfig(
        stage="rlvr",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[("1+2=", "3")],
        steps=3,
        batch_size=8,
        learning_rate=1e-2,
        seed=0,
        checkpoint_dir=str(tmp_path / "rlvr"),
        checkpoint_interval=1000,
        init_from=str(tmp_path / "pre"),
        rlvr=rlvr,
        threads=1,
        lora=cfg,
    )
    result = train_rlvr(config, Recorder(), _never, worker_factory=Worker)
    assert result.final_step == 3 and result.model is not None
    plain = set(previous.state_dict())
    assert published and all(set(p) == plain for p in published)  # the plain model's names
    assert torch.equal(
        published[0]["blocks.0.attn.wq.weight"], previous.state_dict()["blocks.0.attn.wq.weight"]
    )
    # Later versions carry the trained adapters folded in; the policy's own base never moved.
    assert not torch.equal(published[-1]["blocks.0.attn.wq.weight"], published[0]["blocks.0.attn.wq.weight"])
    assert torch.equal(result.model.blocks[0].attn.wq.weight, previous.blocks[0].attn.wq.weight)
    [info] = list_checkpoints(tmp_path / "rlvr")
    saved = dcp.FileSystemReader(info.path).read_metadata().state_dict_metadata
    assert all(lora.is_adapter_key(k.removeprefix("model.")) for k in saved if k.startswith("model."))
