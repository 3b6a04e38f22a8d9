"""Tokenizers the trainer reads text with: UTF-8 bytes for the tiny demo, or a Hugging Face
`tokenizer.json` (the `tokenizers` library) with its `tokenizer_config.json` and chat template.

Both implement `Tokenizer`. `encode` never adds special tokens: whoever builds a sequence adds
them (token files put `bos_id`, when the tokenizer has one, before each document and `eos_id`
after it). `chat` renders a conversation and says which of its tokens the assistant wrote.

Chat templates are rendered as transformers renders them (`transformers.utils.chat_template_utils`):
jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
extension, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the
variables messages, tools, documents, add_generation_prompt and the named special tokens
(bos_token, eos_token, ...). The rendered text is encoded whole without special tokens, as
`apply_chat_template` does. The assistant mask comes from the template's {% generation %} blocks
when it has them (transformers' `return_assistant_tokens_mask`, mapped to tokens the same way);
otherwise from rendering the conversation prefix by prefix: assistant turn i is the text between
the render of messages[:i] with a generation prompt and the render of messages[:i+1].

No transformers import here: the trainer needs only `tokenizers` and `jinja2`.
"""

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

BYTE_VOCAB = 256
BYTE_EOS = 10  # "\n": a task answer ends with a newline, and generation stops at it (generation.END_TOKEN)
BYTE_PAD = 0  # NUL: never in the demo's text; padding is masked out of every loss
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, first one standard

Message = Mapping[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
    id: str  # "bytes", or "sha256:<hex>" (the store's digest, or `files_digest` of the files)
    vocab_size: int
    eos_id: int
    bos_id: int | None  # prepended to each document when the tokenizer adds one (Llama), else None
    pad_id: int
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]: ...


# --- bytes ---------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, every string round-trips. eos is byte 10 (the
    newline that ends every task answer), pad byte 0, no bos.

    Chat rendering (fixed, no template): each message is "{role}: {content}\\n"; the generation
    prompt is "assistant: "; the assistant mask covers an assistant message's content and its
    closing newline (the eos), so "user: 12+35=\\nassistant: 47\\n" trains on "47\\n"."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS
    bos_id: int | None = None
    pad_id = BYTE_PAD
    has_chat_template = False
    id = "bytes"  # the manifest's `tokenizer: bytes`

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """uint8 tensor of the text's bytes (copy of the buffer, so it is writable)."""
        data = bytearray(text.encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def decode(self, tokens: Sequence[int] | torch.Tensor) -> str:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        # A model can emit a byte sequence that is not valid UTF-8: show it, don't fail.
        return bytes(tokens).decode("utf-8", errors="replace")

    def chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for message in messages:
            head = self.encode(f"{message['role']}: ")
            body = self.encode(f"{message.get('content') or ''}\n")
            ids += head + body
            mask += [0] * len(head) + [int(message["role"] == "assistant")] * len(body)
        if add_generation_prompt:
            prompt = self.encode("assistant: ")
            ids += prompt
            mask += [0] * len(prompt)
        return ids, mask


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer applies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer_files() -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json of the byte tokenizer: transformers' AutoTokenizer /
    PreTrainedTokenizerFast load them and encode any UTF-8 string as its bytes (id == byte value).

    A BPE over the 256 ByteLevel characters with no merges. eos is id 10 and pad id 0, which are
    ordinary bytes, so the config sets `split_special_tokens`: without it transformers matches the
    eos's character ("Ċ") in the input as the special token. `decode(..., skip_special_tokens=True)`
    drops newlines and NULs; decode without it."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    raw = RawTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": chars[BYTE_EOS],
        "pad_token": chars[BYTE_PAD],
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    return {
        "tokenizer.json": raw.to_str().encode("utf-8"),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8"),
    }


# --- chat templates as transformers renders them -------------------------------------------------


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """The template compiled in transformers' environment, with a {% generation %} tag whose blocks'
    character spans are recorded while `render_tracked` runs."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tracker(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace()
    return env.from_string(template)


def _generation_tracker() -> type:
    """The extension behind {% generation %}: it records each block's character span in the
    rendered text while `render_chat` hands it lists to fill (jinja2 imported only when needed)."""
    import jinja2
    import jinja2.ext

    class GenerationTracker(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

        def __init__(self, environment: jinja2.Environment):
            super().__init__(environment)
            self.blocks: list[str] | None = None
            self.spans: list[tuple[int, int]] | None = None
            environment.extend(generation_tracker=self)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            if self.blocks is not None and self.spans is not None:
                start = len("".join(self.blocks))
                self.spans.append((start, start + len(text)))
            return str(text)

    return GenerationTracker


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without the type's attributes (as transformers limits it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> type:
    """jinja2's namespace refusing underscore-prefixed attributes (as transformers does)."""
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"A chat template cannot set {name!r} on a namespace.")

    return TemplateNamespace


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as apply_chat_template hands them to the template: None values dropped, reasoning
    also under `reasoning_content` and `thinking`."""
    out = []
    for message in messages:
        msg = {k: v for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render_chat(
    template: str,
    messages: Sequence[Message],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of its {% generation %} blocks)."""
    compiled = compile_chat_template(template)
    tracker = compiled.environment.generation_tracker
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    tracker.blocks, tracker.spans = blocks, spans
    try:
        for block in compiled.generate(
            messages=template_messages(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        ):
            blocks.append(block)
    finally:
        tracker.blocks, tracker.spans = None, None
    return "".join(blocks), spans


def has_generation_tags(template: str) -> bool:
    import re

    return re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None


# --- Hugging Face tokenizer files ----------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over the config's `chat_template` (as transformers loads them); a
    list of named templates gives its "default"."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HfTokenizer:
    """A `tokenizer.json` (the `tokenizers` library) with its tokenizer_config.json."""

    def __init__(
        self,
        raw: Any,
        config: Mapping[str, Any],
        *,
        chat_template: str | None = None,
        id: str = "",
    ):
        self.raw = raw
        self.id = id  # the store's digest "sha256:<hex>", else `files_digest` of its files
        self.vocab_size = int(raw.get_vocab_size(with_added_tokens=True))
        self.special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        if config.get("split_special_tokens"):
            raw.encode_special_tokens = True
        eos = self._id_of("eos_token")
        if eos is None:
            raise ValueError("The tokenizer has no eos token (eos_token in tokenizer_config.json).")
        self.eos_id = eos
        bos = self._id_of("bos_token")
        # Whether a document starts with bos is the post-processor's call: transformers (v5) ignores
        # the config's add_bos_token / add_eos_token when there is a tokenizer.json, and so do we.
        with_specials = raw.encode("a", add_special_tokens=True).ids
        self.bos_id = bos if bos is not None and with_specials[:1] == [bos] else None
        pad = self._id_of("pad_token")
        self.pad_id = pad if pad is not None else self.eos_id  # padding is masked out of every loss
        self.chat_template = chat_template
        self.has_chat_template = chat_template is not None

    def _id_of(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.raw.token_to_id(text)

    @classmethod
    def from_dir(cls, path: Path, *, id: str | None = None) -> "HfTokenizer":
        from tokenizers import Tokenizer as RawTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path} has no tokenizer.json.")
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            if (path / name).is_file():
                config.update(json.loads((path / name).read_text(encoding="utf-8")))
        return cls(
            RawTokenizer.from_file(str(file)),
            config,
            chat_template=_chat_template(path, config),
            id=id if id is not None else files_digest(tokenizer_files(path)),
        )

    def encode(self, text: str) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.raw.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return str(self.raw.decode(list(ids), skip_special_tokens=False))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        if self.chat_template is None:
            raise ValueError("The tokenizer has no chat template.")
        return render_chat(self.chat_template, messages, self.special_tokens, add_generation_prompt)[0]

    def chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """(ids, assistant mask) of the rendered conversation (see the module docstring)."""
        if self.chat_template is None:
            raise ValueError("The tokenizer has no chat template: chat data needs one.")
        text, spans = render_chat(self.chat_template, messages, self.special_tokens, add_generation_prompt)
        if not has_generation_tags(self.chat_template):
            spans = self._turn_spans(messages, text)
        encoding = self.raw.encode(text, add_special_tokens=False)
        ids = list(encoding.ids)
        mask = [0] * len(ids)
        for start, end in spans:
            if end <= start:
                continue
            first = encoding.char_to_token(start)
            last = encoding.char_to_token(end - 1)
            if first is None:
                break
            for t in range(first, last + 1 if last is not None else len(ids)):
                mask[t] = 1
        return ids, mask

    def _turn_spans(self, messages: Sequence[Message], text: str) -> list[tuple[int, int]]:
        """The character span of each assistant turn, from renders of the conversation's prefixes.
        A template that renders a last assistant turn differently from an earlier one (Qwen3 adds an
        empty think block) breaks the prefix rule: then the turn runs from its header to the end of
        its content, plus the eos token when that follows."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not text.startswith(head):
                raise ValueError(
                    "The chat template does not render a conversation's prefix as a prefix of it; "
                    "mark the assistant turns with {% generation %} tags."
                )
            if text.startswith(upto) and upto.startswith(head):
                spans.append((len(head), len(upto)))
                continue
            content = str(message.get("content") or "")
            at = text.find(content, len(head))
            if at < 0:
                raise ValueError("An assistant message's content is not in the rendered chat.")
            end = at + len(content)
            eos = self.special_tokens["eos_token"]
            spans.append((len(head), end + len(eos) if text.startswith(eos, end) else end))
        return spans


# --- which tokenizer a run reads -----------------------------------------------------------------


def files_digest(files: Mapping[str, bytes]) -> str:
    """sha256 over the tokenizer files, names and lengths included, in name order: the id of a
    tokenizer read from a model directory (token files record it)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(files):
        for part in (name.encode("utf-8"), files[name]):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return "sha256:" + h.hexdigest()


def tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The tokenizer files of a Hugging Face directory, by name, to copy into an export."""
    model_dir = Path(model_dir)
    return {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}


def load_tokenizer(spec: str | None, model_dir: Path | None, store_root: Path | None) -> Tokenizer:
    """The manifest's `tokenizer`: "bytes" -> ByteTokenizer; "sha256:<hex>" -> the model store's
    tokenizer entry `<store_root>/tokenizers/<hex>/`; None -> the base model's own (its directory),
    or bytes for a from-scratch run."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec is not None:
        algo, _, digest = spec.partition(":")
        if algo != "sha256" or not digest or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"A tokenizer is 'bytes' or 'sha256:<hex>', not {spec!r}.")
        if store_root is None:
            raise ValueError(f"The tokenizer {spec} needs the model store, and none is configured.")
        path = Path(store_root) / "tokenizers" / digest
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"The model store has no tokenizer {spec}.")
        return HfTokenizer.from_dir(path, id=spec)
    if model_dir is not None:
        return HfTokenizer.from_dir(Path(model_dir))
    return ByteTokenizer()
