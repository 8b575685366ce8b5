"""The written prompts of scripts/drafter_data.py: templates x topics, general chat, code
tasks (chat and raw completion), and the follow-up user turns of multi-turn chats.
scripts/heldout_prompts.json is never among them (build_prompts drops any that match)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HELDOUT = Path(__file__).with_name("heldout_prompts.json")

TOPICS = [
    "black holes", "the French Revolution", "machine learning", "the water cycle", "volcanoes",
    "the human heart", "electric cars", "the Roman Empire", "coffee", "honey bees", "chess",
    "the stock market", "renewable energy", "the internet", "DNA", "earthquakes", "the Moon",
    "ancient Egypt", "jazz music", "meditation", "the immune system", "glaciers", "rainforests",
    "the printing press", "quantum computers", "solar panels", "the Great Wall of China",
    "antibiotics", "the Olympic Games", "tea", "dinosaurs", "the periodic table", "democracy",
    "credit cards", "the speed of light", "coral reefs", "the Renaissance", "composting",
    "public libraries", "marathon running", "origami", "the moon landing", "wind turbines",
    "cloud computing", "the Amazon river", "penguins", "nuclear energy", "the Silk Road",
    "bees and pollination", "time zones", "the theory of evolution", "chocolate", "rainbows",
    "electricity", "the human brain", "saving money", "public speaking", "learning a language",
    "the blockchain", "Mars", "tsunamis", "vitamins", "the Industrial Revolution", "whales",
    "operating systems", "encryption", "the Eiffel Tower", "recycling", "GPS", "sourdough",
    "video games", "the stomach", "lightning", "deserts", "democracy in ancient Athens",
    "open source software", "databases", "the Pythagorean theorem", "prime numbers",
    "climate change", "orchestras", "airplanes", "submarines", "the Sahara", "photography",
]
CHAT_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Tell me three interesting facts about {t}.",
    "Why is {t} important?", "Write a short paragraph about {t}.", "How does {t} work?",
    "Give me a brief history of {t}.", "What are the pros and cons of {t}?",
    "Explain {t} to a ten-year-old.", "Write a haiku about {t}.",
    "What are common misconceptions about {t}?", "Summarize the key ideas of {t} in a list.",
]
GENERAL_CHAT = [
    "How do I make a good cup of tea?", "Write a thank-you note to a teacher.",
    "What is the capital of Australia?", "How many continents are there? Name them.",
    "Give me a recipe for pancakes.", "What is 17 times 23?", "Translate 'good morning' into French and Spanish.",
    "Write a limerick about a programmer.", "How can I be more productive when working from home?",
    "What is the difference between a virus and a bacterium?", "Suggest five names for a pet dog.",
    "How do I change a flat tire?", "What does a CPU do?", "Write a short story about a robot who learns to paint.",
    "What is the tallest mountain in the world?", "Give me tips for a job interview.",
    "How do I write a good resume?", "What is the boiling point of water at sea level?",
    "Explain the rules of tic-tac-toe.", "What are good habits for learning to code?",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "How do I read a CSV file in Python?", "What is a Python decorator? Show an example.",
    "Explain what git is and why developers use it.", "What is the difference between SQL and NoSQL?",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "How do I handle exceptions in Python?", "What is object-oriented programming?",
    "Explain Big O notation with examples.", "What is a REST API?",
    "Write a JavaScript function that returns the largest number in an array.",
    "How do I create a virtual environment in Python?", "What is a linked list?",
    "Explain the difference between a process and a thread.", "What is an HTTP status code 404?",
]
CODE_TASKS = [  # (signature, docstring)
    ("is_prime(n)", "Return True if n is a prime number."),
    ("is_palindrome(s)", "Return True if s reads the same forwards and backwards."),
    ("sum_of_squares(numbers)", "Return the sum of the squares of numbers."),
    ("max_subarray(nums)", "Return the largest sum of a contiguous subarray of nums."),
    ("transpose(matrix)", "Return the transpose of a matrix given as a list of lists."),
    ("rotate_list(items, k)", "Rotate items to the right by k positions."),
    ("count_words(text)", "Return the number of words in text."),
    ("to_snake_case(name)", "Convert a CamelCase name to snake_case."),
    ("parse_date(text)", "Parse a date in YYYY-MM-DD format and return a datetime.date."),
    ("mean(values)", "Return the arithmetic mean of values."),
    ("variance(values)", "Return the population variance of values."),
    ("bubble_sort(items)", "Sort items in place with bubble sort and return them."),
    ("quicksort(items)", "Return a sorted copy of items using quicksort."),
    ("merge_sort(items)", "Return a sorted copy of items using merge sort."),
    ("find_max(items)", "Return the largest element of items without using max()."),
    ("digits_sum(n)", "Return the sum of the decimal digits of n."),
    ("power_set(items)", "Return all subsets of items as a list of lists."),
    ("permutations(items)", "Return all permutations of items."),
    ("lcm(a, b)", "Return the least common multiple of a and b."),
    ("is_leap_year(year)", "Return True if year is a leap year."),
    ("roman_to_int(s)", "Convert a Roman numeral to an integer."),
    ("int_to_binary(n)", "Return the binary representation of n as a string."),
    ("caesar_cipher(text, shift)", "Encrypt text with a Caesar cipher."),
    ("validate_email(address)", "Return True if address looks like a valid email address."),
    ("group_by_length(words)", "Group words into a dict keyed by their length."),
    ("second_largest(numbers)", "Return the second largest distinct number."),
    ("running_total(numbers)", "Return the list of running totals of numbers."),
    ("dot_product(a, b)", "Return the dot product of two equal-length vectors."),
    ("normalize(vector)", "Return vector scaled to unit length."),
    ("zip_to_dict(keys, values)", "Build a dict from parallel lists of keys and values."),
    ("invert_dict(d)", "Return a dict mapping each value of d to its key."),
    ("most_common(items)", "Return the most common element of items."),
    ("char_histogram(text)", "Return a dict counting each character in text."),
    ("is_balanced(expr)", "Return True if the brackets in expr are balanced."),
    ("levenshtein(a, b)", "Return the edit distance between strings a and b."),
    ("primes_up_to(n)", "Return all primes up to n using the sieve of Eratosthenes."),
    ("collatz_steps(n)", "Return how many Collatz steps it takes n to reach 1."),
    ("write_csv(path, rows)", "Write rows (a list of lists) to a CSV file at path."),
    ("fetch_json(url)", "Download url and return the parsed JSON body."),
    ("list_python_files(folder)", "Return the paths of all .py files under folder."),
    ("safe_divide(a, b)", "Return a / b, or None when b is zero."),
    ("clamp(x, low, high)", "Clamp x to the range [low, high]."),
    ("triangle_area(a, b, c)", "Return the area of a triangle with sides a, b and c."),
    ("is_sorted(items)", "Return True if items is sorted in ascending order."),
    ("pairwise_sums(nums, target)", "Return the pairs of numbers in nums that add up to target."),
    ("strip_html(text)", "Remove HTML tags from text."),
    ("camel_case(words)", "Join words into a camelCase identifier."),
    ("elapsed(start, end)", "Return the seconds between two datetime objects."),
]
CODE_FORMS = [
    'def {sig}:\n    """{doc}"""\n',
    'def {sig}:\n    """{doc}\n\n    Args and return value are documented above.\n    """\n',
    '# {doc}\ndef {sig}:\n',
    'from typing import List\n\n\ndef {sig}:\n    """{doc}"""\n',
    'import math\n\n\ndef {sig}:\n    """{doc}"""\n',
]
CODE_CHAT = ["Write a Python function `{sig}`: {doc}", "Implement `{sig}` in Python. {doc} Add a short example.",
             "Explain how to write `{sig}` in Python. {doc}"]
CLASS_PROMPTS = [
    'class {name}:\n    """{doc}"""\n\n    def __init__(self{args}):\n' for _ in range(1)
][0]
CLASSES = [("Queue", "A first-in first-out queue.", ""), ("BankAccount", "A bank account with a balance.", ", owner, balance=0"),
           ("Point", "A point in two dimensions.", ", x, y"), ("Counter", "Counts occurrences of items.", ""),
           ("Matrix", "A small dense matrix.", ", rows"), ("Timer", "Measures elapsed wall-clock time.", ""),
           ("LRUCache", "A least-recently-used cache with a fixed capacity.", ", capacity"),
           ("Node", "A node of a singly linked list.", ", value, next=None"),
           ("Inventory", "Tracks items and quantities in a shop.", ""),
           ("Rectangle", "A rectangle with a width and a height.", ", width, height")]


def build_prompts(seed: int) -> list[dict]:
    held = json.loads(HELDOUT.read_text())
    held_set = set(held["chat"]) | set(held["code"])
    rng = random.Random(seed)
    chat = [tmpl.format(t=t) for t in TOPICS for tmpl in CHAT_TEMPLATES]
    rng.shuffle(chat)
    chat = GENERAL_CHAT + chat[:360]
    chat += [form.format(sig=s, doc=d) for (s, d) in CODE_TASKS for form in CODE_CHAT[:1]]
    chat += [rng.choice(CODE_CHAT[1:]).format(sig=s, doc=d) for (s, d) in CODE_TASKS]
    code = [rng.choice(CODE_FORMS).format(sig=s, doc=d) for (s, d) in CODE_TASKS]
    code += [rng.choice(CODE_FORMS).format(sig=s, doc=d) for (s, d) in CODE_TASKS]
    code += [CLASS_PROMPTS.format(name=n, doc=d, args=a) for (n, d, a) in CLASSES]
    items = [{"kind": "chat", "prompt": p} for p in dict.fromkeys(chat) if p not in held_set]
    items += [{"kind": "code", "prompt": p} for p in dict.fromkeys(code) if p not in held_set]
    rng.shuffle(items)  # a time box cut keeps both kinds
    return items


def encode_prompt(tokenizer, item) -> list[int]:
    if item["kind"] == "chat":
        return list(tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                  add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(item["prompt"]))



FOLLOW_UPS = [  # a second user turn after the target's first answer (templated; {t}: nothing topical)
    "Can you give me a concrete example?", "Explain that more simply, please.",
    "Summarize your answer in one sentence.", "What is the most important point here?",
    "Can you go into more detail on the second point?", "Why does that matter in practice?",
    "What would be a common mistake here?", "Can you turn that into a short bulleted list?",
    "How would you explain this to a beginner?", "Is there anything you left out?",
    "Thanks! Can you write a short conclusion for it?", "What are the limitations of that?",
    "Can you compare it with an alternative?", "Give me three questions to check I understood.",
    "Rewrite your answer in a more formal tone.", "How could I learn more about this?",
    "What happens if we do the opposite?", "Can you make it shorter?",
    "Write a short quiz based on your answer.", "What is a real-world application of this?",
]
CODE_FOLLOW_UPS = [
    "Can you add type hints and a docstring?", "Write a few unit tests for it.",
    "What is the time complexity of your solution?", "How would you handle invalid input?",
    "Can you make it more efficient?", "Explain the code line by line.",
    "Rewrite it without using any imports.", "Show how to call it with an example.",
]


def follow_up_ids(tokenizer, item: dict, answer_ids: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """(the second user turn, the whole chat's prompt ids): question, the target's answer, a follow-up."""
    pool = CODE_FOLLOW_UPS if "`" in item["prompt"] or "Python" in item["prompt"] else FOLLOW_UPS
    follow = rng.choice(pool)
    chat = [{"role": "user", "content": item["prompt"]},
            {"role": "assistant", "content": tokenizer.decode(answer_ids)},
            {"role": "user", "content": follow}]
    return follow, list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
