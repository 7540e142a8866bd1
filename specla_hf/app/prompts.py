"""Prompt sets for ``specla bench`` and the demo's examples.

``SHIPPED`` is a small sample carried inside the package (an installed package has no access to the project's
shared data): first turns of MT-Bench questions (Apache-2.0, FastChat) and HumanEval problems (MIT, openai/human-eval).
AlpacaEval instructions are left out on purpose: they are CC BY-NC-4.0, the package is MIT.
"""
from __future__ import annotations

import json
from pathlib import Path

SHIPPED: list[tuple[str, str]] = [
    ("mt_bench/81", "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                    "experiences and must-see attractions."),
    ("mt_bench/101", "Imagine you are participating in a race with a group of people. If you have just overtaken the "
                     "second person, what's your current position? Where is the person you just overtook?"),
    ("mt_bench/121", "Develop a Python program that reads all the text files under a directory and returns top-5 "
                     "words with the most number of occurrences."),
    ("mt_bench/141", "In the field of quantum physics, what is superposition, and how does it relate to the "
                     "phenomenon of quantum entanglement?"),
    ("humaneval/53", 'def add(x: int, y: int):\n    """Add two numbers x and y\n    >>> add(2, 3)\n    5\n'
                     '    >>> add(5, 7)\n    12\n    """\n'),
    ("humaneval/55", 'def fib(n: int):\n    """Return n-th Fibonacci number.\n    >>> fib(10)\n    55\n'
                     '    >>> fib(1)\n    1\n    >>> fib(8)\n    21\n    """\n'),
    ("humaneval/23", "def strlen(string: str) -> int:\n    \"\"\" Return length of given string\n"
                     "    >>> strlen('')\n    0\n    >>> strlen('abc')\n    3\n    \"\"\"\n"),
    ("humaneval/34", 'def unique(l: list):\n    """Return sorted unique elements in a list\n'
                     '    >>> unique([5, 3, 5, 2, 3, 3, 9, 0, 123])\n    [0, 2, 3, 5, 9, 123]\n    """\n'),
]


def load_prompts(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(id, prompt) pairs from a JSON-lines file, or ``SHIPPED`` without a path.

    Each line's prompt is its ``turns[0]`` (MT-Bench), ``instruction`` (AlpacaEval), ``prompt`` (HumanEval) or
    ``text``; its id is ``question_id`` / ``task_id`` / ``id`` or the line number.
    """
    if path is None:
        return list(SHIPPED)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompts {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {path}, line {n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"--prompts {path}, line {n}: expected a JSON object")
        text = (row["turns"][0] if row.get("turns") else
                next((row[k] for k in ("instruction", "prompt", "text") if isinstance(row.get(k), str)), None))
        if not text:
            raise ValueError(f"--prompts {path}, line {n}: no 'turns', 'instruction', 'prompt' or 'text' field")
        pid = next((str(row[k]) for k in ("question_id", "task_id", "id") if k in row), f"{path.stem}:{n}")
        out.append((pid, text.lstrip("\n")))
    if not out:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return out
