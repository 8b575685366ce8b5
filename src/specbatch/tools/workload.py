"""The prompts benchmarks and calibration decode: chat questions and raw code completions.

For an instruct model (a tokenizer with a chat template) each question becomes one user
turn in that template; code prompts stay raw completions either way. None of these is in
the drafters' training data (``scripts/drafter_prompts.py`` keeps its own prompts).
"""

from __future__ import annotations

QUESTIONS = [
    "Explain in a short paragraph how a bicycle gear system makes climbing hills easier.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
    "Write a Python function that returns the n-th triangular number.",
    "Give me four ideas for a rainy Sunday afternoon at home.",
    "How does a hash table handle collisions?",
    "Summarise the plot of a typical detective story in three sentences.",
    "What should I check before buying a used car?",
    # more (calibration measures 12 and confirms a winner on 12 others); topics kept out of
    # the drafters' training templates
    "How do I politely decline a meeting invitation at work? Give an example message.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Why does bread go stale, and how can I keep it fresh longer?",
    "Compare walking and cycling as ways to commute five kilometres to work.",
    "What is the difference between a virus and a bacterium?",
    "Plan a simple three-day menu for someone learning to cook.",
    "How do noise-cancelling headphones work?",
    "Explain what a Python decorator is and show a small example.",
    "What are good habits for keeping a houseplant alive?",
    "Describe how a bill becomes a law in a parliamentary system.",
    "Write a short cover letter opening for a junior data analyst job.",
    "Why do cats purr?",
    "How should I prepare for a job interview the night before?",
    "Explain the difference between latency and throughput with an everyday analogy.",
    "What causes the seasons on Earth?",
    "Give three tips for writing clear email subject lines.",
]

CODE = [
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\ndef walk_files(root: str):\n    \"\"\"Yield every file path under root.\"\"\"\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=",
]


def texts(tokenizer, n: int, questions: list[str] = QUESTIONS) -> list[str]:
    """``n`` prompt texts, chat ``questions`` and code completions alternating."""
    from ..kernels.models import chat_prompt
    out = []
    for i in range(n):
        if i % 2 == 0:
            question = questions[(i // 2) % len(questions)]
            out.append(chat_prompt(tokenizer, question) or question)
        else:
            out.append(CODE[(i // 2) % len(CODE)])
    return out


def prompts(tokenizer, n: int, questions: list[str] = QUESTIONS) -> list[list[int]]:
    """``n`` prompts as token ids (see ``texts``)."""
    return [list(tokenizer.encode(t)) for t in texts(tokenizer, n, questions)]
