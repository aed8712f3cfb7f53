"""The final answer of a worked solution, as MetaMathQA and GSM8K evaluations extract it.

Exact match compares final answers, not whole texts: a model that writes a different (right) derivation
but ends on the same number is right. The answer is, in this order: what follows MetaMathQA's
``The answer is:``, GSM8K's ``####``, the last ``\\boxed{...}`` (MATH), else the last number in the text,
else the whole text. Both sides are normalised the same way (whitespace, a trailing full stop, ``$``,
thousands separators), and two numbers are equal when their values are (``18.0`` is ``18``).
"""

from __future__ import annotations

import re

_ANSWER_IS = re.compile(r"The answer is:?\s*(.+)", re.IGNORECASE)
_GSM8K = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def normalize(answer: str) -> str:
    """Whitespace, a trailing full stop, ``$`` and thousands separators removed."""
    a = answer.strip().rstrip(".").strip().replace("$", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", a):
        a = a.replace(",", "")
    return a


def extract_answer(text: str) -> str:
    """The final answer of ``text`` (see the module docstring for the rules), normalised."""
    for pattern in (_ANSWER_IS, _GSM8K):
        found = pattern.findall(text)
        if found:
            return normalize(found[-1].splitlines()[0])
    boxed = _last_boxed(text)
    if boxed is not None:
        return normalize(boxed)
    numbers = _NUMBER.findall(text)
    if numbers:
        return normalize(numbers[-1])
    return normalize(text)


def same_answer(predicted: str, reference: str) -> bool:
    """Whether two texts end on the same final answer (numbers compared by value)."""
    a, b = extract_answer(predicted), extract_answer(reference)
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False
