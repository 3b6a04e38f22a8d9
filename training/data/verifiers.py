"""RLVR's verifiers: pure functions of (response, answer) -> whether the response earns the reward,
declared by name on a data ref (domain/data_schemas.py VERIFIERS), never code from the tenant.

- `exact`: the stripped strings are equal.
- `number`: the last number in the response equals the answer's last number, exactly ("1,000" is
  "1000", "3.0" is "3").
- `math`: the `math-verify` library (Hugging Face's, as open-r1 moved to): LaTeX and expression
  equivalence ("$\\frac{1}{2}$" is "0.5", "$(x+1)^2$" is "$x^2+2x+1$", "The answer is 47" is "47").
- `choice`: multiple choice; the answer is one letter A-J, the response's choice is the last
  stand-alone capital letter A-J in it ("(B)", "B.", "The answer is B").
- `regex`: the answer is a pattern the stripped response must match in full; patterns and responses
  are bounded (`MAX_PATTERN_CHARS`, `MAX_REGEX_RESPONSE_CHARS`) and a pattern with a quantified group
  that itself repeats (the shape of catastrophic backtracking, "(a+)+") is refused.
Also the format reward: `tagged(response, tag)` is the text inside the last `<tag>...</tag>`, or None
when the response does not put its answer in the declared tag (DAPO's overlong penalty is
training/recipes/objectives.py `overlong_penalty`).

Every input is bounded in characters before any parsing: a response is judged on its last
`MAX_RESPONSE_CHARS` characters (where answers are written), an answer longer than `MAX_ANSWER_CHARS`
earns nothing.
"""

import re
import threading
from collections.abc import Callable
from fractions import Fraction

MAX_RESPONSE_CHARS = 4_000  # the tail of a response a verifier reads; answers come last
MAX_ANSWER_CHARS = 1_000
MAX_PATTERN_CHARS = 256  # a regex answer: a format, not a program
MAX_REGEX_RESPONSE_CHARS = 1_000
MATH_TIMEOUT_S = 5  # math-verify's own parse and compare limits (signals: the main thread only)
CHOICES = "ABCDEFGHIJ"

_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_CHOICE = re.compile(rf"(?<![A-Za-z])([{CHOICES}])(?![A-Za-z])")
# A group containing a quantifier, itself quantified: "(a+)+", "(\w*)*", "(x|y+){2,}".
_NESTED_QUANTIFIER = re.compile(r"\([^()]*[+*}][^()]*\)\s*[+*{]")


def last_number(text: str) -> Fraction | None:
    """The last number written in the text ("1,234.5", "-7", ".5"), exactly, or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return Fraction(found[-1].replace(",", ""))


def verify_exact(response: str, answer: str) -> bool:
    return response.strip() == answer.strip()


def verify_number(response: str, answer: str) -> bool:
    want, got = last_number(answer), last_number(response)
    return want is not None and got is not None and got == want


def verify_math(response: str, answer: str) -> bool:
    """math-verify's equivalence of the response's final answer with the gold answer. Its timeouts
    use SIGALRM, which only the main thread may set: elsewhere the bounded inputs are the limit."""
    from math_verify import parse, verify  # imported when first used: sympy is slow to import

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)  # None: no alarm
    if not gold:
        return False
    guess = parse(response, parsing_timeout=timeout)
    return bool(guess) and bool(verify(gold, guess, timeout_seconds=timeout))


def choice_of(response: str) -> str | None:
    """The last stand-alone capital letter A-J in the response: its multiple-choice answer."""
    found = _CHOICE.findall(response)
    return found[-1] if found else None


def verify_choice(response: str, answer: str) -> bool:
    want = answer.strip().strip("()").rstrip(".")
    return len(want) == 1 and want in CHOICES and choice_of(response) == want


def pattern_problem(pattern: str) -> str | None:
    """Why a regex answer cannot be used (too long, not a pattern, backtracking-prone), or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"a regex answer is at most {MAX_PATTERN_CHARS} characters; this one has {len(pattern)}"
    if _NESTED_QUANTIFIER.search(pattern):
        return "a regex answer may not repeat a group that itself repeats (e.g. (a+)+): it can take exponential time"
    try:
        re.compile(pattern)
    except re.error as e:
        return f"the regex answer is not a pattern: {e}"
    return None


def verify_regex(response: str, answer: str) -> bool:
    text = response.strip()
    if len(text) > MAX_REGEX_RESPONSE_CHARS or pattern_problem(answer) is not None:
        return False
    return re.fullmatch(answer, text) is not None


def tagged(response: str, tag: str) -> str | None:
    """The format reward's check: the text inside the last `<tag>...</tag>`, stripped; None when the
    response does not put an answer in the declared tag."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", response, flags=re.DOTALL)
    return found[-1].strip() if found else None


VERIFIER_FUNCTIONS: dict[str, Callable[[str, str], bool]] = {
    "exact": verify_exact,
    "number": verify_number,
    "math": verify_math,
    "choice": verify_choice,
    "regex": verify_regex,
}


def verify(verifier: str, response: str, answer: str, *, tag: str | None = None) -> bool:
    """Whether `response` earns the reward for `answer` under the named verifier; with `tag`, only
    an answer inside `<tag>...</tag>` counts (the format reward: no tag, no reward)."""
    try:
        check = VERIFIER_FUNCTIONS[verifier]
    except KeyError:
        raise ValueError(
            f"Verifier {verifier!r} is unknown: use one of {', '.join(VERIFIER_FUNCTIONS)}."
        ) from None
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    if tag is not None:
        inner = tagged(response, tag)
        if inner is None:
            return False
        response = inner
    return check(response[-MAX_RESPONSE_CHARS:], answer)
