"""RLVR's verifiers as tables (issue 41): each a pure function of (response, answer), `math` by the
math-verify library, `choice` by the last stand-alone letter, `regex` by a bounded pattern, and the
format reward's tag; a code-running verifier is refused by name at plan time (domain tests)."""

import threading

import pytest

from training.data.verifiers import (
    MAX_PATTERN_CHARS,
    MAX_RESPONSE_CHARS,
    choice_of,
    pattern_problem,
    tagged,
    verify,
)


@pytest.mark.parametrize(
    ("verifier", "response", "answer", "expected"),
    [
        ("exact", " yes ", "yes", True),
        ("exact", "Yes", "yes", False),
        ("number", "so 1,000 in all", "1000", True),
        ("number", "3.5", "3", False),
        # math: LaTeX and expression equivalence (open-r1's reason to move off string equality)
        ("math", "$\\frac{1}{2}$", "0.5", True),
        ("math", "The answer is 47", "47", True),
        ("math", "$(x+1)^2$", "$x^2+2x+1$", True),
        ("math", "\\boxed{\\sqrt{4}}", "2", True),
        ("math", "$\\frac{2}{4}$", "$\\frac{1}{2}$", True),
        ("math", "The answer is 48", "47", False),
        ("math", "no answer at all", "47", False),
        ("math", "47", "", False),  # a gold answer with nothing in it pays nothing
        # choice: the last stand-alone capital letter A-J
        ("choice", "The answer is (B).", "B", True),
        ("choice", "B", "(B)", True),
        ("choice", "Between A and C, I pick C.", "C", True),
        ("choice", "Between A and C, I pick C.", "A", False),
        ("choice", "Because", "B", False),  # a letter inside a word is no choice
        ("choice", "I choose K", "K", False),  # past J: not a choice
        ("choice", "A", "AB", False),
        # regex: the stripped response matches the pattern in full
        ("regex", " 2026-12-06 ", r"\d{4}-\d{2}-\d{2}", True),
        ("regex", "on 2026-12-06", r"\d{4}-\d{2}-\d{2}", False),
        ("regex", "aaaa", r"(a+)+", False),  # refused pattern: no reward, never run
        ("regex", "abc", r"[", False),
        ("regex", "x" * 1_001, r"x+", False),  # past the response bound
    ],
)
def test_verifiers(verifier, response, answer, expected):
    assert verify(verifier, response, answer) is expected


@pytest.mark.parametrize(
    ("response", "tag", "answer", "inner", "expected"),
    [
        ("thinking... <answer>42</answer>", "answer", "42", "42", True),
        ("<answer>1</answer> then <answer> 42 </answer>", "answer", "42", "42", True),  # the last one
        ("42", "answer", "42", None, False),  # right, but not inside the declared tag: no reward
        ("<answer>41</answer> 42", "answer", "42", "41", False),
        ("<final>42</final>", "answer", "42", None, False),
    ],
)
def test_the_format_reward_pays_only_an_answer_inside_the_declared_tag(
    response, tag, answer, inner, expected
):
    assert tagged(response, tag) == inner
    assert verify("number", response, answer, tag=tag) is expected


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        (r"\d+", None),
        (r"(ab)+c", None),
        (r"(a+)+", "may not repeat a group that itself repeats"),
        (r"(\w*)*x", "may not repeat a group that itself repeats"),
        (r"(x|y+){2,}", "may not repeat a group that itself repeats"),
        ("(", "is not a pattern"),
        ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS} characters"),
    ],
)
def test_regex_answers_are_bounded(pattern, problem):
    found = pattern_problem(pattern)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_choice_of_reads_the_last_standalone_letter():
    assert {t: choice_of(t) for t in ("(A) or (D)", "none", "A.", "I")} == {
        "(A) or (D)": "D",
        "none": None,
        "A.": "A",
        "I": "I",
    }


def test_a_long_response_is_judged_on_its_tail_and_an_unknown_verifier_is_refused():
    assert verify("number", "7 " + "x" * MAX_RESPONSE_CHARS + " 9", "9")
    assert not verify("number", "9 " + "x" * MAX_RESPONSE_CHARS, "9")  # the head is never read
    with pytest.raises(ValueError, match="unknown"):
        verify("fuzzy", "a", "a")


def test_math_verifies_off_the_main_thread_too():
    """math-verify's timeouts are signals, which only the main thread may set: a rollout thread
    still gets an answer (bounded by the inputs' lengths instead)."""
    results = []
    worker = threading.Thread(target=lambda: results.append(verify("math", "$\\frac{1}{2}$", "0.5")))
    worker.start()
    worker.join(timeout=60)
    assert results == [True]
