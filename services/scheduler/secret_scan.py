"""Find anything that looks like a credential in a manifest, without ever echoing the value.

Every string (keys and values, at any depth) is checked against patterns for the common credential
shapes. A finding names the JSON path and the kind of secret, never the text.
"""

import re
from typing import Any

PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[0-9A-Z]{16}\b")),
    ("an AWS secret access key", re.compile(r"(?i)aws.{0,20}(secret|key).{0,5}[:=]\s*[A-Za-z0-9/+=]{40}")),
    ("a GitHub token", re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr|github_pat)_[A-Za-z0-9_]{20,}")),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("an API key", re.compile(r"\b(?:sk|rk|pk)[-_](?:live|test|proj|ant)?[-_]?[A-Za-z0-9]{20,}")),
    ("an ito API key", re.compile(r"\bito_sk_[A-Za-z0-9_-]{16,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{16,}=*")),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    # bounded repetitions: an unbounded scheme or user part backtracks quadratically on long text
    ("a password in a URL", re.compile(r"\b[a-z][a-z0-9+.-]{0,31}://[^/\s:@]{1,256}:[^/\s@]{1,256}@")),
    (
        "an assigned password or secret",
        re.compile(r"(?i)\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|token)\s*[:=]\s*\S{6,}"),
    ),
]
SECRET_FIELD_NAMES = re.compile(
    r"(?i)^(?:password|passwd|secret|api[_-]?key|access[_-]?key|secret[_-]?key|token|credentials?|private[_-]?key)$"
)


MIN_MATCH_CHARS = 8  # no pattern above matches fewer characters ("a://b:c@"): shorter strings are skipped
MAX_DEPTH = 64  # deeper documents are refused before this scan (and no manifest needs it)


def _walk(node: Any, path: str, depth: int = 0):
    """(path, text, is_key) for every string. A key is yielded, as text, before the path that
    contains it, so a path named in a finding is made only of keys already found clean."""
    if depth > MAX_DEPTH:
        yield path, "", False
        return
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, str(key), True
            yield from _walk(value, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]", depth + 1)
    elif isinstance(node, str):
        yield path, node, False


def find_secret(document: Any) -> str | None:
    """A safe description of the first credential-like string, or None."""
    for path, text, is_key in _walk(document, ""):
        where = path or "the manifest"
        if is_key and SECRET_FIELD_NAMES.match(text):  # a known word: safe to name
            return f"field {path + '.' if path else ''}{text} is named like a credential"
        if len(text) < MIN_MATCH_CHARS:
            continue
        for kind, pattern in PATTERNS:
            if pattern.search(text):
                return f"a key under {where} looks like {kind}" if is_key else f"{where} looks like {kind}"
    return None
