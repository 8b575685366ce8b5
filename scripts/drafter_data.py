"""Token data for training drafters of the embedded target (SmolLM2-135M-Instruct).

Writes to build/drafters/data/ (resumable: a chunk already saved is skipped):
- text.npz: teacher-forcing text present on every machine (the Python standard library's
  sources, Debian's plain-text docs under /usr/share/doc, .gz decompressed), tokenized
  and cut into sequences of --seq tokens;
- gen_NNNN.json: the target's own greedy answers (mlx-lm batch_generate, temperature 0)
  to prompts built here from templates x topics: chat questions (ChatML template) and
  raw Python completion prompts. scripts/heldout_prompts.json is never trained on.
- magpie.json + gen_mNNNN.json: user questions the target writes itself (Magpie: sample
  the user turn after the chat template's pre-query prefix at temperature 1), filtered,
  then answered greedily like the templated ones. Templates x topics cover few shapes of
  question; these cover the target's own spread of them. Chunks alternate templated and
  self-written so a time box keeps both.

    python -m specbatch.blas scripts/drafter_data.py --minutes 14
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "drafters" / "data"
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


def text_files(rng: random.Random) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    py = [p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts]
    docs = [p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and not p.is_symlink()
            and (p.suffix in ("", ".txt", ".gz", ".md", ".rst") or p.name.lower().startswith(("readme", "changelog", "news")))
            and p.stat().st_size < 2_000_000]
    rng.shuffle(py)
    rng.shuffle(docs)
    return py + docs


def read_text(path: Path) -> str | None:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text if text.strip() and "\x00" not in text else None


def make_text(tokenizer, seed: int, seq: int, max_tokens: int) -> None:
    out = OUT / "text.npz"
    if out.exists():
        print(f"{out} exists: skipping text")
        return
    rng = random.Random(seed)
    files = text_files(rng)
    # alternate stdlib and docs so any prefix is a mix
    py = [f for f in files if f.suffix == ".py"]
    docs = [f for f in files if f.suffix != ".py"]
    order = [f for pair in zip(py, docs) for f in pair] + py[len(docs):] + docs[len(py):]
    seqs, sources, total = [], [], 0
    bar = tqdm(total=max_tokens, desc="text tokens", unit="tok")
    for f in order:
        text = read_text(f)
        if text is None:
            continue
        ids = tokenizer.encode(text[:200_000])
        for i in range(0, len(ids) - seq // 4, seq):  # drop short tails
            piece = ids[i:i + seq]
            if len(piece) < seq:
                piece = ids[-seq:] if len(ids) >= seq else None
            if piece is None:
                break
            seqs.append(piece)
            sources.append(0 if f.suffix == ".py" else 1)
            total += seq
            bar.update(seq)
        if total >= max_tokens:
            break
    bar.close()
    np.savez(out, tokens=np.array(seqs, dtype=np.int32), source=np.array(sources, dtype=np.int8))
    print(f"text: {len(seqs)} sequences x {seq} tokens ({sum(sources)} from docs)")


def make_magpie(target, n: int, seed: int, deadline: float, max_tokens: int = 72) -> list[dict]:
    """Questions the target writes itself after its chat template's pre-query prefix."""
    path = OUT / "magpie.json"
    if path.exists():
        return json.loads(path.read_text())
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler
    tok = target.tokenizer
    marker = "XQZMARK"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    prefix = tok.encode(text[:text.index(marker)], add_special_tokens=False)
    held = json.loads(HELDOUT.read_text())
    seen = {p.strip().lower() for p in held["chat"] + held["code"]}
    mx.random.seed(seed)
    sampler = make_sampler(temp=1.0, top_p=0.95)
    out: list[dict] = []
    bar = tqdm(total=n, desc="self-written questions")
    while len(out) < n and time.time() < deadline:
        res = batch_generate(target.model, tok, [prefix] * 32, max_tokens=max_tokens,
                             return_token_ids=True, sampler=sampler)
        for ids in res.token_ids:
            ids = [int(t) for t in ids]
            if not 4 <= len(ids) < max_tokens:  # the stop token is not returned: full length = cut off
                continue
            q = tok.decode(ids).strip()
            if len(q) < 12 or q.lower() in seen or "<|im_" in q:
                continue
            seen.add(q.lower())
            out.append({"kind": "chat", "prompt": q, "source": "magpie"})
            bar.update(1)
    bar.close()
    path.write_text(json.dumps(out, indent=0))
    print(f"{len(out)} self-written questions")
    return out


def generation_plan(items: list[dict], magpie: list[dict], chunk: int) -> list[tuple[Path, list[dict]]]:
    """(output file, prompts) per chunk, templated and self-written chunks alternating."""
    plain = [(OUT / f"gen_{c:04d}.json", items[c * chunk:(c + 1) * chunk]) for c in range(0, (len(items) + chunk - 1) // chunk)]
    mag = [(OUT / f"gen_m{c:04d}.json", magpie[c * chunk:(c + 1) * chunk]) for c in range(0, (len(magpie) + chunk - 1) // chunk)]
    todo_plain = [pc for pc in plain if not pc[0].exists()]
    order = [pc for pc in plain if pc[0].exists()]
    for i in range(max(len(todo_plain), len(mag))):
        order += todo_plain[i:i + 1] + mag[i:i + 1]
    return order


def make_generations(target, plan: list[tuple[Path, list[dict]]], max_tokens: int, deadline: float) -> None:
    from mlx_lm.generate import batch_generate
    tok = target.tokenizer
    done = sum(path.exists() for path, _ in plan)
    bar = tqdm(total=len(plan), initial=done, desc="generation chunks")
    for path, part in plan:
        if path.exists():
            continue
        if time.time() > deadline:
            print("time box reached: stopping generation")
            break
        prompts = [encode_prompt(tok, it) for it in part]
        t0 = time.time()
        res = batch_generate(target.model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
        n = sum(len(a) for a in res.token_ids)
        rows = [{**it, "prompt_ids": p, "answer_ids": [int(t) for t in a]} for it, p, a in zip(part, prompts, res.token_ids)]
        path.write_text(json.dumps({"rows": rows, "seconds": time.time() - t0, "tokens": n}))
        bar.update(1)
        bar.set_postfix(tok_s=f"{n / (time.time() - t0):.0f}")
    bar.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=13.0, help="time box for the whole script")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=512, help="teacher-forcing sequence length")
    ap.add_argument("--text-tokens", type=int, default=1_500_000, help="text tokens to keep")
    ap.add_argument("--chunk", type=int, default=24, help="prompts per batch_generate call")
    ap.add_argument("--magpie", type=int, default=640, help="self-written questions to answer")
    ap.add_argument("--magpie-minutes", type=float, default=6.0, help="time box for writing them")
    ap.add_argument("--max-tokens", type=int, default=224, help="answer length cap")
    args = ap.parse_args()
    deadline = time.time() + args.minutes * 60
    OUT.mkdir(parents=True, exist_ok=True)
    from specbatch.kernels.models import demo_pair, load
    target = load(demo_pair()["target"])
    items = build_prompts(args.seed)
    (OUT / "prompts.json").write_text(json.dumps(items, indent=0))
    print(f"{len(items)} training prompts ({sum(i['kind'] == 'code' for i in items)} code)")
    make_text(target.tokenizer, args.seed, args.seq, args.text_tokens)
    magpie = make_magpie(target, args.magpie, args.seed, time.time() + args.magpie_minutes * 60)
    make_generations(target, generation_plan(items, magpie, args.chunk), args.max_tokens, deadline)


if __name__ == "__main__":
    main()
