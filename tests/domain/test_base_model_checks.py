"""The plan-time checks of a manifest's inputs as tables (domain/plan_inputs.py): each
refusal's stable code and the field path its sentence starts with; the curriculum's data rules for
post-training on files; the plan priced from the exact parameter count and LoRA's smaller state."""

import msgspec
import pytest

from contracts.errors import ErrorCode
from contracts.manifest import DataFormat, DataRef, Lora, Manifest, ModelSpec
from contracts.models import MODEL_SHAPES, BaseModel, ModelShape
from domain import plan_inputs as pi
from domain.curriculum import curriculum_of
from domain.model_shapes import count_parameters
from services.scheduler import planning

SHAPE = ModelShape(
    n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=320, max_seq_len=128, qk_norm=False
)
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


def base(**changes) -> BaseModel:
    entry = BaseModel(
        name="tiny-llama",
        digest=DIGEST,
        family="llama",
        architecture="LlamaForCausalLM",
        shape=SHAPE,
        parameters=count_parameters(SHAPE),
        tokenizer_vocab=300,
    )
    return msgspec.structs.replace(entry, **changes)


def spec(**fields) -> ModelSpec:
    return msgspec.convert({"revision": DIGEST, **fields}, ModelSpec)


BASE_SPEC = spec(base="tiny-llama")


@pytest.mark.parametrize(
    "facts, code, starts",
    [
        (pi.ModelFacts(entry=None), ErrorCode.model_not_found, "model.base: no model 'tiny-llama'"),
        (pi.ModelFacts(entry=base(digest=OTHER)), ErrorCode.model_digest_mismatch, "model.revision: "),
        (
            pi.ModelFacts(entry=base(), unsupported=("model_type", "model_type 'gpt2' is not supported")),
            ErrorCode.model_unsupported,
            "model.base: 'tiny-llama''s config.json key model_type",
        ),
        (pi.ModelFacts(entry=base(), changed=True), ErrorCode.model_digest_mismatch, "model.base: "),
        (pi.ModelFacts(entry=base()), None, None),
    ],
)
def test_model_refusals(facts, code, starts):
    refused = pi.model_refusal(BASE_SPEC, facts)
    if code is None:
        assert refused is None
    else:
        assert refused is not None and refused[0] is code and refused[1].startswith(starts), refused


@pytest.mark.parametrize(
    "model, shape, entry, stored, code, words",
    [
        # a base model's own tokenizer
        (BASE_SPEC, SHAPE, base(), None, None, None),
        (
            BASE_SPEC,
            SHAPE,
            base(tokenizer_vocab=None),
            None,
            ErrorCode.tokenizer_mismatch,
            "no tokenizer.json",
        ),
        (
            BASE_SPEC,
            SHAPE,
            base(tokenizer_vocab=321),
            None,
            ErrorCode.tokenizer_mismatch,
            "more than its 320",
        ),
        (BASE_SPEC, SHAPE, base(tokenizer_vocab=320), None, None, None),
        (
            spec(base="tiny-llama", tokenizer="bytes"),
            SHAPE,
            base(),
            None,
            ErrorCode.tokenizer_mismatch,
            "tiny demo",
        ),
        (
            spec(base="tiny-llama", tokenizer=OTHER),
            SHAPE,
            base(),
            200,
            None,
            None,
        ),  # a base may keep spare rows
        (
            spec(base="tiny-llama", tokenizer=OTHER),
            SHAPE,
            base(),
            400,
            ErrorCode.tokenizer_mismatch,
            "more than",
        ),
        # from scratch: bytes only on the tiny size's 256 rows
        (spec(size="tiny"), MODEL_SHAPES["tiny"], None, None, None, None),
        (spec(size="tiny", tokenizer="bytes"), MODEL_SHAPES["tiny"], None, None, None, None),
        (
            spec(size="1B"),
            MODEL_SHAPES["1B"],
            None,
            None,
            ErrorCode.tokenizer_mismatch,
            "256 of the 1B's 128,256",
        ),
        (
            spec(size="150M", tokenizer="bytes"),
            MODEL_SHAPES["150M"],
            None,
            None,
            ErrorCode.tokenizer_mismatch,
            "only for the tiny size",
        ),
        # from scratch with a stored tokenizer: fits, and fills the rows (max(128, 1%) spare)
        (spec(size="150M", tokenizer=OTHER), MODEL_SHAPES["150M"], None, 32_000, None, None),
        (
            spec(size="150M", tokenizer=OTHER),
            MODEL_SHAPES["150M"],
            None,
            31_680,
            None,
            None,
        ),  # 320 = 1% spare
        (
            spec(size="150M", tokenizer=OTHER),
            MODEL_SHAPES["150M"],
            None,
            31_679,
            ErrorCode.tokenizer_mismatch,
            "would never train",
        ),
        (
            spec(size="150M", tokenizer=OTHER),
            MODEL_SHAPES["150M"],
            None,
            256,
            ErrorCode.tokenizer_mismatch,
            "31,744 would never train",
        ),
        (
            spec(size="tiny", tokenizer=OTHER),
            MODEL_SHAPES["tiny"],
            None,
            128,
            None,
            None,
        ),  # 128 spare: allowed
        (
            spec(size="tiny", tokenizer=OTHER),
            MODEL_SHAPES["tiny"],
            None,
            127,
            ErrorCode.tokenizer_mismatch,
            "never train",
        ),
        (
            spec(size="150M", tokenizer=OTHER),
            MODEL_SHAPES["150M"],
            None,
            32_001,
            ErrorCode.tokenizer_mismatch,
            "more than",
        ),
        (
            spec(size="150M", tokenizer=OTHER),
            MODEL_SHAPES["150M"],
            None,
            None,
            ErrorCode.tokenizer_mismatch,
            "no tokenizer",
        ),
        (
            spec(size="150M", tokenizer="gpt2"),
            MODEL_SHAPES["150M"],
            None,
            None,
            ErrorCode.tokenizer_mismatch,
            "neither",
        ),
    ],
)
def test_tokenizer_refusals(model, shape, entry, stored, code, words):
    refused = pi.tokenizer_refusal(model, shape, entry, stored)
    if code is None:
        assert refused is None, refused
    else:
        assert refused is not None and refused[0] is code, refused
        assert refused[1].startswith("model.tokenizer: ") and words in refused[1], refused


def test_the_unused_row_allowance_is_128_or_one_percent():
    assert [pi.max_unused_rows(n) for n in (256, 12_800, 32_000, 128_256)] == [128, 128, 320, 1282]


CHAT = ("messages",)
PREFS = ("preference",)


def ref(path="file:/d/chat.jsonl", **fields) -> DataRef:
    return msgspec.convert({"name": "r", "source": path, "digest": DIGEST, **fields}, DataRef)


def facts(digest=DIGEST, kinds=(), **more) -> pi.FileFacts:
    return pi.FileFacts(digest, kinds=kinds, columns=more.pop("columns", ()), **more)


UPLOAD = "upload:file-" + "0a" * 12


@pytest.mark.parametrize(
    "data, readers, facts, code, starts",
    [
        (ref(), ["sft"], facts(kinds=CHAT), None, None),
        (ref(digest=None), ["sft"], facts(kinds=CHAT), ErrorCode.data_digest_mismatch, "data[3].digest: "),
        (ref(), ["sft"], facts(OTHER, CHAT), ErrorCode.data_digest_mismatch, "data[3].digest: "),
        (ref(), ["sft"], facts(kinds=PREFS), ErrorCode.data_schema_invalid, "data[3]: sft reads"),
        (ref(), ["dpo"], facts(kinds=PREFS), None, None),
        (ref(), ["dpo"], facts(kinds=("verifiable",)), ErrorCode.data_schema_invalid, "data[3]: dpo reads"),
        (ref(), ["pretrain"], facts(kinds=("text",)), None, None),
        (ref(), ["eval"], facts(kinds=CHAT), None, None),  # a chat eval split
        (
            ref(),
            ["eval"],
            facts(kinds=PREFS, columns=("prompt", "chosen", "rejected")),
            ErrorCode.data_schema_invalid,
            "data[3]: the held-out eval (text, or messages for a chat split) reads",
        ),
        (ref(), ["rlvr"], facts(kinds=("verifiable",)), ErrorCode.data_schema_invalid, "data[3].verifier: "),
        (ref(verifier="number"), ["rlvr"], facts(kinds=("verifiable",)), None, None),
        (ref(verifier="math"), ["rlvr"], facts(kinds=("verifiable",)), None, None),  # issue 41
        (ref(verifier="choice"), ["rlvr"], facts(kinds=("verifiable",)), None, None),
        (ref(verifier="regex"), ["rlvr"], facts(kinds=("verifiable",)), None, None),
        (  # tenant code never runs in the trainer: refused in a sentence, not as an unknown name
            ref(verifier="unit_tests"),
            ["rlvr"],
            facts(kinds=("verifiable",)),
            ErrorCode.data_schema_invalid,
            "data[3].verifier: verifier 'unit_tests' would run the tenant's code inside the trainer",
        ),
        (
            ref(path="file:/d/c.parquet"),
            ["sft"],
            facts(None, unreadable="the check of the file failed"),
            ErrorCode.data_schema_invalid,
            "data[3]: the check of the file failed",
        ),
        (  # every problem the check found, each at its line (issue 39)
            ref(),
            ["sft"],
            facts(kinds=CHAT, problems=("line 14: messages[0].role is 'wizard'", "line 15: not valid JSON")),
            ErrorCode.data_schema_invalid,
            "data[3]: 2 problems in the file:\n- line 14: messages[0].role is 'wizard'\n- line 15",
        ),
        # a text file: its digest only when declared; no columns, but its problems
        (ref(path="file:/d/notes.txt", digest=None), ["pretrain"], facts(kinds=("text",)), None, None),
        (
            ref(path="file:/d/notes.txt"),
            ["pretrain"],
            facts(OTHER, ("text",)),
            ErrorCode.data_digest_mismatch,
            "data[3].digest: ",
        ),
        (
            ref(path="file:/d/notes.txt", digest=None),
            ["pretrain"],
            facts(problems=("line 2: not UTF-8 text (byte 0xff at column 10)",)),
            ErrorCode.data_schema_invalid,
            "data[3]: 1 problem in the file:\n- line 2: not UTF-8",
        ),
        # an upload: its digest is its record's; its format its record's
        (ref(path=UPLOAD, digest=None), ["sft"], facts(kinds=CHAT), None, None),
        (
            ref(path=UPLOAD, digest=None, format="jsonl"),
            ["sft"],
            facts(kinds=CHAT, format=DataFormat.parquet),
            ErrorCode.data_schema_invalid,
            "data[3].format: the upload is parquet",
        ),
    ],
)
def test_data_refusals(data, readers, facts, code, starts):
    refused = pi.data_refusal(3, data, readers, facts)
    if code is None:
        assert refused is None, refused
    else:
        assert refused is not None and refused[0] is code and refused[1].startswith(starts), refused


def manifest(recipe, data, model=None, lora=None, **extra) -> Manifest:
    post = {"recipe": recipe}
    if lora:
        post |= {stage: {"lora": lora, "data": names} for stage, names in extra.pop("stage_data", {}).items()}
    elif "stage_data" in extra:
        post |= {stage: {"data": names} for stage, names in extra.pop("stage_data").items()}
    doc = {
        "name": "m",
        "model": model or {"size": "tiny", "revision": "r"},
        "data": data,
        "target": {"tokens": 10_000, "seq_len": 32, "batch_size": 8},
        "budget_cap_usd": 1.0,
        "post_training": post,
        **extra,
    }
    return msgspec.convert(doc, Manifest)


FILES = [
    {"name": "chat", "source": "file:/d/chat.jsonl", "digest": DIGEST},
    {"name": "prefs", "source": "file:/d/prefs.parquet", "digest": DIGEST},
]


def test_post_training_reads_jsonl_and_parquet_files():
    m = manifest(
        ["sft", "dpo"], FILES, stages={"pretrain": None}, stage_data={"sft": ["chat"], "dpo": ["prefs"]}
    )
    plan = curriculum_of(m)
    assert [(s.name, s.data) for s in plan.stages] == [("sft", ("chat",)), ("dpo", ("prefs",))]


@pytest.mark.parametrize(
    "data, words",
    [
        ([{"name": "notes", "source": "file:/d/notes.txt"}], "JSONL/Parquet files"),
        ([{"name": "docs", "source": "builtin:pydoc_topics"}], "verifiable tasks"),
        ([{"name": "docs", "source": "builtin:pydoc_topics", "format": "jsonl"}], "data[0].format is jsonl"),
    ],
)
def test_post_training_still_refuses_what_it_cannot_read(data, words):
    with pytest.raises(ValueError, match=r".") as refused:
        curriculum_of(manifest(["sft"], data, stages={"pretrain": None}))
    assert words in str(refused.value)


def test_a_base_model_plan_is_priced_from_its_exact_parameter_count():
    entry = base()
    m = manifest(
        ["sft"], FILES[:1], model={"base": "tiny-llama", "revision": DIGEST}, stages={"pretrain": None}
    )
    assert curriculum_of(m, entry).shape == SHAPE
    assert planning.parameter_count(SHAPE) == count_parameters(SHAPE) == entry.parameters


def test_lora_prices_adapter_state_and_adapter_checkpoints():
    shape = MODEL_SHAPES["8B"]
    lora = {"rank": 16, "target_modules": ["q_proj", "v_proj"]}
    full = manifest(
        ["sft"],
        FILES[:1],
        model={"size": "8B", "revision": "r"},
        stages={"pretrain": None},
        stage_data={"sft": ["chat"]},
    )
    adapted = manifest(
        ["sft"],
        FILES[:1],
        model={"size": "8B", "revision": "r"},
        lora=lora,
        stages={"pretrain": None},
        stage_data={"sft": ["chat"]},
    )
    params = count_parameters(shape)
    hd = shape.d_model // shape.n_head
    adapters = (
        shape.n_layer * 16 * ((shape.d_model + shape.n_head * hd) + (shape.d_model + shape.n_kv_head * hd))
    )
    assert planning.lora_parameters(shape, msgspec.convert(lora, Lora)) == adapters
    assert planning.training_state_bytes(full, shape) == params * planning.BYTES_PER_PARAM_TRAINING
    assert planning.training_state_bytes(adapted, shape) == params * 2 + adapters * 16
    assert planning.checkpoint_bytes(full, shape) == params * 12
    assert planning.checkpoint_bytes(adapted, shape) == adapters * 12
    with_pretrain = msgspec.structs.replace(
        adapted, stages=full.stages.__class__()
    )  # pretrain trains everything
    assert planning.checkpoint_bytes(with_pretrain, shape) == params * 12
