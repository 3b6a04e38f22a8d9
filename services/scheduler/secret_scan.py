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
    ("a password in a URL", re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")),
    ("an assigned password or secret", re.compile(r"(?i)\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?key|token)\s*[:=]\s*\S{6,}")),
]
SECRET_FIELD_NAMES = re.compile(r"(?i)^(?:password|passwd|secret|api[_-]?key|access[_-]?key|secret[_-]?key|token|credentials?|private[_-]?key)$")


def _walk(node: Any, path: str):
    if isinstance(node, dict):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            yield child, str(key), True
            yield from _walk(value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node, False


def find_secret(document: Any) -> str | None:
    """A safe description of the first credential-like string, or None."""
    for path, text, is_key in _walk(document, ""):
        if is_key and SECRET_FIELD_NAMES.match(text):
            return f"field {path} is named like a credential"
        for kind, pattern in PATTERNS:
            if pattern.search(text):
                return f"{'the key of ' if is_key else ''}{path or 'the manifest'} looks like {kind}"
    return None
