"""Training prompts made by our own code: templates, vocabularies and random numbers, or text mined from the standard
library installed here.

A drafter is trained on what *its target* answers (paper section 4.3; SPEC section 4), so the prompts only need to be
varied, not answered: :func:`training_prompts` builds a few thousand of them (code, math, chat; task-shaped kinds;
or kinds mined from the installed standard library's code and documentation). They never come from HumanEval or
MT-Bench, which are the evaluation sets (:mod:`modeling_xpress.assets`). The target's answers are made by
:func:`modeling_xpress.regeneration.regenerate_responses`.
"""

from __future__ import annotations

import ast
import copy
import functools
import random
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets

PROMPT_KINDS = ("code", "math", "chat")
# Task-shaped kinds (a function stub to complete; roles, passages, puzzles, essays): `training_prompts(kinds=TASK_KINDS)`
TASK_KINDS = ("stub", "roleplay", "extraction", "reasoning", "essay")
# Kinds mined from local text, the Python standard library installed here (`training_prompts(kinds=MINED_KINDS)`): its
# documented functions as stubs to complete or code to explain, its documentation's prose as passages to work from
MINED_KINDS = ("source_stub", "source_explain", "doc_passage")
# The three generators by the name scripts give them (`make_training_data.py --kinds`, `choose_draft_length.py --kinds`)
GENERATORS = {"default": PROMPT_KINDS, "task": TASK_KINDS, "mined": MINED_KINDS}

# --------------------------------------------------------------------------------------------
# Prompt vocabularies. Each list is small on its own; templates x vocabularies x random numbers
# give thousands of distinct prompts with a realistic spread of response lengths.
# --------------------------------------------------------------------------------------------

_NAMES = [
    "Alice", "Bob", "Carlos", "Dana", "Emeka", "Fatima", "Giulia", "Hiro", "Ines", "Jonas", "Kavya",
    "Liam", "Mei", "Noah", "Olga", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Victor",
    "Wen", "Ximena", "Yusuf", "Zoe",
]
_ITEMS = [
    ("notebook", "notebooks"), ("apple", "apples"), ("pencil", "pencils"), ("ticket", "tickets"),
    ("mug", "mugs"), ("book", "books"), ("plant", "plants"), ("candle", "candles"),
    ("sandwich", "sandwiches"), ("battery", "batteries"), ("shirt", "shirts"), ("lamp", "lamps"),
    ("cookie", "cookies"), ("towel", "towels"), ("marker", "markers"), ("bottle of juice", "bottles of juice"),
]
_VEHICLES = ["car", "train", "cyclist", "bus", "boat", "runner", "truck", "plane"]
_CONVERSIONS = [
    ("kilometers", "miles"), ("miles", "kilometers"), ("pounds", "kilograms"), ("kilograms", "pounds"),
    ("liters", "gallons"), ("degrees Celsius", "degrees Fahrenheit"), ("degrees Fahrenheit", "degrees Celsius"),
    ("inches", "centimeters"), ("feet", "meters"), ("hours", "seconds"), ("square meters", "square feet"),
]
_SHAPES_2D = ["rectangle", "right triangle", "circle", "square", "trapezoid", "parallelogram"]
_SHAPES_3D = ["cube", "cylinder", "sphere", "rectangular box", "cone"]

_CODE_TASKS = [
    "reverses a string without using slicing",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "returns the {k} largest numbers in a list",
    "counts how often each word appears in a text",
    "removes duplicates from a list while keeping the original order",
    "merges two sorted lists into one sorted list",
    "checks whether a number is prime",
    "returns the first {n} Fibonacci numbers",
    "computes the factorial of a number iteratively",
    "flattens a nested list of arbitrary depth",
    "finds the longest common prefix of a list of strings",
    "converts a Roman numeral to an integer",
    "converts an integer to its binary representation as a string",
    "groups a list of words into anagrams",
    "rotates a list to the right by {k} positions",
    "checks whether the brackets in a string are balanced",
    "returns the second smallest element of a list",
    "computes the running average of a list of numbers",
    "splits a list into chunks of size {k}",
    "finds all pairs of numbers in a list that add up to {n}",
    "transposes a matrix given as a list of lists",
    "computes the greatest common divisor of two integers",
    "capitalizes the first letter of every word in a sentence",
    "returns the most common character in a string",
    "validates an email address with a regular expression",
    "parses a date string in the format YYYY-MM-DD and returns the weekday",
    "computes the median of a list of numbers",
    "performs binary search on a sorted list",
    "sorts a list of dictionaries by the value of a given key",
    "counts the vowels in a string",
    "returns the sum of the digits of an integer",
    "checks whether two strings are anagrams of each other",
    "generates all permutations of a string",
    "generates all subsets of a list",
    "finds the missing number in a list containing 1 to {n} with one number missing",
    "compresses a string using run-length encoding",
    "decodes a run-length encoded string",
    "implements the sieve of Eratosthenes up to {n}",
    "computes the dot product of two vectors",
    "checks whether a year is a leap year",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the n-th triangular number",
    "finds the index of the first non-repeating character in a string",
    "removes all whitespace from a string",
    "counts the number of lines, words and characters in a file",
    "returns the intersection of two lists",
    "checks whether a list is sorted",
    "finds the maximum subarray sum (Kadane's algorithm)",
    "computes the Levenshtein distance between two strings",
    "returns the length of the longest increasing subsequence",
    "converts a snake_case string to camelCase",
    "converts a camelCase string to snake_case",
    "checks whether a number is a perfect square",
    "returns a dictionary that maps each value to the list of keys that had it",
    "computes the moving maximum over a window of size {k}",
    "shuffles a list in place using the Fisher-Yates algorithm",
    "truncates a string to {n} characters and adds an ellipsis",
    "counts the set bits in an integer",
    "checks whether a string contains only unique characters",
    "returns the prime factors of an integer",
    "computes the power set size and lists the subsets of size {k}",
    "validates a Sudoku row, column or box",
    "formats a number of seconds as HH:MM:SS",
    "finds the k-th smallest element of a list using a heap, with k = {k}",
    "computes the area of a polygon from its vertices",
    "parses a simple CSV line that may contain quoted fields",
    "evaluates a postfix (reverse Polish) expression",
    "returns the words of a sentence in reverse order",
    "checks whether a binary tree is balanced",
    "returns the depth of a nested dictionary",
    "interleaves two lists element by element",
    "computes the cumulative product of a list",
    "finds the mode of a list of integers",
]
_CODE_DATA_STRUCTURES = [
    ("stack", "push, pop and peek"), ("queue", "enqueue, dequeue and is_empty"),
    ("singly linked list", "append, prepend, delete and find"),
    ("binary search tree", "insert, search and in-order traversal"),
    ("min-heap", "push, pop and peek"), ("LRU cache", "get and put"),
    ("trie", "insert, search and starts_with"), ("circular buffer", "write, read and is_full"),
    ("priority queue", "add, pop_highest and __len__"), ("graph with an adjacency list", "add_edge, neighbors and bfs"),
    ("hash map with separate chaining", "set, get and delete"), ("bank account", "deposit, withdraw and balance"),
    ("inventory system", "add_item, remove_item and total_value"), ("to-do list", "add, complete and pending"),
    ("2D vector", "__add__, __mul__ and length"), ("matrix", "__add__, __matmul__ and transpose"),
    ("rate limiter", "allow_request and reset"), ("doubly linked list", "insert_after, remove and reverse"),
    ("union-find structure", "find, union and connected"), ("shopping cart", "add, remove and total"),
]
_CODE_LANGUAGES = ["Python", "Python", "Python", "Python", "JavaScript", "Java", "C", "Rust", "Go", "TypeScript"]
_CODE_EXTRAS = [
    "", "", " Include a docstring and type hints.", " Add a few example calls.",
    " Handle empty input gracefully.", " Explain the time complexity.", " Do not use any imports.",
    " Keep it short and readable.", " Add comments that explain each step.", " Write a unit test for it too.",
]
_CODE_FILE_FORMATS = ["CSV", "JSON", "plain text", "log", "TSV", "YAML"]
_CODE_FILE_ACTIONS = [
    "prints the number of records", "computes the average of a numeric column",
    "writes the records sorted by date to a new file", "counts the distinct values of one field",
    "finds the rows with missing values", "prints the ten most frequent words",
    "filters the entries that contain the word 'error'", "converts it to a list of dictionaries",
]
_PYTHON_CONCEPT_PAIRS = [
    ("a list", "a tuple"), ("`is`", "`==`"), ("a generator", "a list comprehension"),
    ("`deepcopy`", "`copy`"), ("a class method", "a static method"), ("`*args`", "`**kwargs`"),
    ("a set", "a frozenset"), ("threads", "processes"), ("`append`", "`extend`"),
    ("a module", "a package"), ("`__str__`", "`__repr__`"), ("`sort()`", "`sorted()`"),
    ("a dataclass", "a namedtuple"), ("`range`", "`enumerate`"), ("exceptions", "return codes"),
    ("an iterator", "an iterable"), ("`map`", "a for loop"), ("`async def`", "`def`"),
]
_BUGGY_SNIPPETS = [
    "def {f}(items):\n    total = 0\n    for i in range(1, len(items)):\n        total += items[i]\n    return total",
    "def {f}(n):\n    if n == 0:\n        return 0\n    return n * {f}(n - 1)",
    "def {f}(words):\n    result = {{}}\n    for w in words:\n        result[w] += 1\n    return result",
    "def {f}(a, b):\n    while b:\n        a = b\n        b = a % b\n    return a",
    "def {f}(xs):\n    for i in range(len(xs)):\n        if xs[i] > xs[i + 1]:\n            return False\n    return True",
    "def {f}(text):\n    return text.split(' ').reverse()",
    "def {f}(values, default=[]):\n    default.append(values)\n    return default",
    "def {f}(x):\n    if x % 2 == 1:\n        return 'even'\n    return 'odd'",
]
_FUNCTION_NAMES = [
    "process", "compute", "helper", "total", "check", "summarize", "count_items", "solve", "run",
    "calculate", "transform", "analyze",
]

_CHAT_CONCEPTS = [
    "photosynthesis", "inflation", "black holes", "the immune system", "machine learning",
    "compound interest", "climate change", "blockchain", "the water cycle", "supply and demand",
    "natural selection", "how vaccines work", "quantum entanglement", "the stock market",
    "plate tectonics", "how the internet works", "DNA replication", "the greenhouse effect",
    "opportunity cost", "neural networks", "how airplanes fly", "the theory of relativity",
    "recursion", "public-key cryptography", "how batteries store energy", "the placebo effect",
    "the French Revolution", "entropy", "how a bill becomes a law", "cloud computing",
    "the Pythagorean theorem", "interest rates", "how GPS works", "the carbon cycle", "tides",
    "cognitive biases", "how search engines rank pages", "the scientific method", "antibiotic resistance",
    "gravity", "how the heart pumps blood", "renewable energy", "the Renaissance", "sleep cycles",
    "how compilers work", "probability", "the Silk Road", "volcanoes", "game theory", "how memory works",
]
_CHAT_AUDIENCES = [
    "a ten-year-old", "a high school student", "someone with no technical background", "a busy manager",
    "a university student", "my grandmother", "a new employee", "a curious teenager",
]
_CHAT_ACTIVITIES = [
    "learning a new language", "running a first marathon", "saving money on groceries",
    "staying focused while working from home", "getting better sleep", "public speaking",
    "starting a vegetable garden", "preparing for a job interview", "learning to play the guitar",
    "traveling on a budget", "writing a cover letter", "keeping a houseplant alive", "studying for exams",
    "making friends in a new city", "reducing screen time", "cooking healthy meals quickly",
    "organizing a small closet", "taking better photos with a phone", "negotiating a salary",
    "training a puppy", "managing stress", "reading more books", "staying motivated at the gym",
    "hosting a dinner party", "learning to code", "writing a novel", "moving to a new apartment",
    "camping for the first time", "running an effective meeting", "building a morning routine",
]
_CHAT_CHOICES = [
    "working from home", "buying versus renting a home", "electric cars", "learning online",
    "living in a big city", "freelancing", "using a credit card", "homeschooling", "nuclear power",
    "social media for teenagers", "a four-day work week", "owning a dog", "studying abroad",
    "open-plan offices", "self-driving cars", "a gap year before university", "investing in index funds",
    "public transport", "smart home devices", "a vegetarian diet", "starting a small business",
    "remote teams", "e-books versus paper books", "solar panels at home", "tiny houses",
]
_CHAT_HOWTOS = [
    "change a flat tire", "make a simple budget", "brew good coffee at home", "write a haiku",
    "back up my computer", "remove a coffee stain from a shirt", "start meditating",
    "make bread without a bread machine", "prepare for a long hike", "set up a home Wi-Fi network safely",
    "give constructive feedback", "learn touch typing", "plan a birthday party", "care for a cast iron pan",
    "improve my handwriting", "write a good resume", "ask for a raise", "start journaling",
    "clean a laptop keyboard", "memorize a speech", "choose a good password", "repot a plant",
    "fold a fitted sheet", "make a paper airplane", "calm down before an exam", "sharpen a kitchen knife",
]
_CHAT_FORMS = [
    "poem", "short story", "haiku", "limerick", "product description", "thank-you note", "speech",
    "slogan", "dialogue between two friends", "diary entry", "news headline and first paragraph", "riddle",
]
_CHAT_SUBJECTS = [
    "a rainy afternoon", "a lost cat finding its way home", "the first day of spring", "a robot learning to paint",
    "an old lighthouse", "a reusable water bottle", "a small bakery", "the ocean at night", "a city bicycle",
    "friendship", "a mountain village", "a forgotten umbrella", "autumn leaves", "a busy train station",
    "a chess game", "a new smartphone app", "a garden in winter", "a dragon who is afraid of heights",
    "the moon", "a library at midnight", "a coffee shop", "a long road trip", "learning to swim",
]
_CHAT_COMPARE = [
    ("cats", "dogs as pets"), ("tea", "coffee"), ("Python", "JavaScript for beginners"),
    ("running", "swimming for fitness"), ("laptops", "desktop computers"), ("trains", "planes for travel in Europe"),
    ("stocks", "bonds"), ("reading", "listening to audiobooks"), ("SQL", "NoSQL databases"),
    ("baking", "frying"), ("a Kindle", "paper books"), ("yoga", "pilates"), ("summer", "winter holidays"),
    ("Linux", "Windows"), ("mountains", "beaches for a vacation"), ("email", "instant messaging at work"),
]
_CHAT_FEELINGS = ["nervous", "overwhelmed", "unsure", "excited but anxious", "stuck", "frustrated"]
_CHAT_SITUATIONS = [
    "starting a new job", "moving to another country", "a group project", "an upcoming exam",
    "learning to drive", "a disagreement with a friend", "choosing a university major",
    "giving my first presentation", "changing careers", "living alone for the first time",
]
_CHAT_EMAILS = [
    ("my landlord", "about a broken heater"), ("my team", "announcing a new weekly meeting"),
    ("a professor", "asking for an extension on an assignment"), ("a customer", "apologizing for a late delivery"),
    ("a colleague", "thanking them for their help"), ("a hiring manager", "following up after an interview"),
    ("my neighbors", "inviting them to a street party"), ("a client", "proposing a new project timeline"),
]
_CHAT_PLACES = [
    "Lisbon", "Kyoto", "Mexico City", "Iceland", "Cape Town", "Vienna", "Vancouver", "Marrakesh",
    "Seoul", "Edinburgh", "Buenos Aires", "the Swiss Alps", "Istanbul", "Prague", "New Zealand",
]
_CHAT_TRAVELERS = ["a family with two kids", "a solo traveler", "a couple", "students on a budget", "retirees"]
_CHAT_NAMEABLES = [
    "coffee shop", "podcast about science", "hiking club", "pet hamster", "board game", "bakery",
    "mobile app for tracking habits", "book club", "robot vacuum", "band", "newsletter about gardening",
]


def _pick(rng: random.Random, options: Sequence):
    return options[rng.randrange(len(options))]


def _code_prompt(rng: random.Random) -> str:
    """One programming request: a function, a class, a file script, a concept, a bug or an output."""
    style = rng.randrange(6)
    if style == 0:
        task = _pick(rng, _CODE_TASKS).format(k=rng.randint(2, 9), n=rng.randint(10, 500))
        verb = _pick(rng, ["Write", "Implement", "Create", "Show me"])
        return f"{verb} a {_pick(rng, _CODE_LANGUAGES)} function that {task}.{_pick(rng, _CODE_EXTRAS)}"
    if style == 1:
        name, methods = _pick(rng, _CODE_DATA_STRUCTURES)
        lang = _pick(rng, ["Python", "Python", "Java", "C++", "TypeScript"])
        return f"Implement a {name} class in {lang} with the methods {methods}.{_pick(rng, _CODE_EXTRAS)}"
    if style == 2:
        fmt, action = _pick(rng, _CODE_FILE_FORMATS), _pick(rng, _CODE_FILE_ACTIONS)
        stem = _pick(rng, ["data", "sales", "users", "events", "measurements", "orders", "server"])
        ext = {"plain text": "txt", "log": "log"}.get(fmt, fmt.lower())
        return f"Write a Python script that reads a {fmt} file named `{stem}.{ext}` and {action}."
    if style == 3:
        a, b = _pick(rng, _PYTHON_CONCEPT_PAIRS)
        ask = _pick(rng, ["What is the difference between", "When should I use", "Explain"])
        joiner = " instead of " if ask == "When should I use" else " and "
        return f"{ask} {a}{joiner}{b} in Python? Give a short example.".replace("Explain", "Can you explain", 1)
    if style == 4:
        snippet = _pick(rng, _BUGGY_SNIPPETS).format(f=_pick(rng, _FUNCTION_NAMES))
        ask = _pick(rng, ["Find and fix the bug in this Python function:",
                          "This Python code does not work as intended. What is wrong, and how do I fix it?",
                          "Review this function and correct any mistakes:"])
        return f"{ask}\n```python\n{snippet}\n```"
    # A small program with random constants: what does it print?
    xs = [rng.randint(-9, 20) for _ in range(rng.randint(3, 6))]
    k = rng.randint(2, 5)
    body = _pick(rng, [
        f"xs = {xs}\nprint(sum(x * {k} for x in xs if x > 0))",
        f"xs = {xs}\nprint(sorted(xs)[-{min(k, len(xs))}:])",
        f"xs = {xs}\nprint([x % {k} for x in xs])",
        f"total = 0\nfor i in range({k}, {k + len(xs)}):\n    total += i * i\nprint(total)",
        f"s = '{''.join(_pick(rng, 'abcdefgh') for _ in range(k + 3))}'\nprint(s[::{-1 if k % 2 else 2}])",
        f"d = {{x: x ** 2 for x in {xs}}}\nprint(len(d), max(d.values()))",
    ])
    return f"What does the following Python code print? Explain why.\n```python\n{body}\n```"


def _math_prompt(rng: random.Random) -> str:
    """One math question with random quantities: word problems, algebra, geometry, statistics."""
    style = rng.randrange(14)
    name, other = rng.sample(_NAMES, 2)
    suffix = _pick(rng, ["", " Show your work.", " Explain your reasoning step by step.", " Explain briefly."])
    if style == 0:
        (_, items), count, price = _pick(rng, _ITEMS), rng.randint(2, 12), rng.randint(50, 1500) / 100
        bill = next(b for b in (5, 10, 20, 50, 100, 200) if b > count * price)
        return (f"{name} buys {count} {items} at ${price:.2f} each and pays with a ${bill} bill. "
                f"How much change does {name} get?{suffix}")
    if style == 1:
        vehicle, dist, hours = _pick(rng, _VEHICLES), rng.randint(20, 900), rng.randint(2, 9)
        more = rng.randint(30, 600)
        return (f"A {vehicle} travels {dist} km in {hours} hours. What is its average speed, and how long "
                f"would it take to travel {more} km at that speed?{suffix}")
    if style == 2:
        pct, price = _pick(rng, [5, 10, 12, 15, 20, 25, 30, 35, 40, 60]), rng.randint(12, 900)
        return (f"A jacket costs ${price}. It is on sale for {pct}% off, and then a {rng.randint(3, 10)}% "
                f"sales tax is added. What is the final price?{suffix}")
    if style == 3:
        a, x, b = rng.randint(2, 15), rng.randint(-12, 25), rng.randint(-40, 40)
        return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}.{suffix}"
    if style == 4:
        x, y = rng.randint(-9, 12), rng.randint(-9, 12)
        a, b, c, d = (rng.randint(1, 7) for _ in range(4))
        if a * d == b * c:
            d += 1
        return (f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and "
                f"{c}x + {d}y = {c * x + d * y}.{suffix}")
    if style == 5:
        shape = _pick(rng, _SHAPES_2D)
        dims = {
            "rectangle": f"width {rng.randint(2, 40)} cm and length {rng.randint(2, 60)} cm",
            "right triangle": f"legs of {rng.randint(3, 24)} cm and {rng.randint(3, 24)} cm",
            "circle": f"radius {rng.randint(1, 30)} m",
            "square": f"side {rng.randint(2, 50)} inches",
            "trapezoid": f"parallel sides {rng.randint(3, 20)} m and {rng.randint(21, 40)} m and height {rng.randint(2, 15)} m",
            "parallelogram": f"base {rng.randint(3, 30)} cm and height {rng.randint(2, 20)} cm",
        }[shape]
        what = _pick(rng, ["area", "perimeter", "area and perimeter"]) if shape != "trapezoid" else "area"
        return f"What is the {what} of a {shape} with {dims}?{suffix}"
    if style == 6:
        shape = _pick(rng, _SHAPES_3D)
        r, h = rng.randint(1, 15), rng.randint(2, 30)
        dims = {"cube": f"edge {r} cm", "cylinder": f"radius {r} cm and height {h} cm",
                "sphere": f"radius {r} cm", "rectangular box": f"sides {r} cm, {h} cm and {rng.randint(2, 12)} cm",
                "cone": f"radius {r} cm and height {h} cm"}[shape]
        return f"Find the {_pick(rng, ['volume', 'surface area'])} of a {shape} with {dims}.{suffix}"
    if style == 7:
        den = [rng.randint(2, 12), rng.randint(2, 12)]
        num = [rng.randint(1, d * 2) for d in den]
        op = _pick(rng, ["add", "subtract", "multiply", "divide"])
        joiner = {"add": "and", "subtract": "from", "multiply": "by", "divide": "by"}[op]
        return f"{op.capitalize()} {num[0]}/{den[0]} {joiner} {num[1]}/{den[1]} and simplify the result.{suffix}"
    if style == 8:
        values = [rng.randint(1, 99) for _ in range(rng.randint(5, 9))]
        return f"Find the mean, median and range of these numbers: {', '.join(map(str, values))}.{suffix}"
    if style == 9:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        job = _pick(rng, ["paint a fence", "mow a lawn", "fill a pool", "sort a pile of letters", "clean a house"])
        return (f"{name} can {job} in {a} hours and {other} can do it in {b} hours. How long does it take "
                f"if they work together?{suffix}")
    if style == 10:
        principal, rate, years = rng.randint(5, 200) * 100, _pick(rng, [1.5, 2, 2.5, 3, 4, 5, 6, 7]), rng.randint(2, 15)
        how = _pick(rng, ["compounded yearly", "with simple interest", "compounded monthly"])
        return f"How much is ${principal} worth after {years} years at {rate}% interest {how}?{suffix}"
    if style == 11:
        red, blue, green = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 8)
        event = _pick(rng, ["a red marble", "two blue marbles in a row without replacement",
                            "a marble that is not blue", "one red and one blue marble in two draws with replacement"])
        bag = f"{red} red, {blue} blue" + (f" and {green} green" if green else "") + " marbles"
        return f"A bag contains {bag}. What is the probability of drawing {event}?{suffix}"
    if style == 12:
        total, a, b = rng.randint(3, 60) * 10, rng.randint(1, 7), rng.randint(1, 7)
        what = _pick(rng, ["dollars", "stickers", "cookies", "hours of work", "liters of paint"])
        return f"Split {total} {what} between {name} and {other} in the ratio {a}:{b}. How much does each get?{suffix}"
    # Number theory and conversions.
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(6, 300), rng.randint(6, 300)
        return f"Find the greatest common divisor and the least common multiple of {a} and {b}.{suffix}"
    if kind == 1:
        return f"Write {rng.randint(30, 5000)} as a product of prime factors.{suffix}"
    if kind == 2:
        src, dst = _pick(rng, _CONVERSIONS)
        return f"Convert {rng.randint(1, 500)} {src} to {dst}.{suffix}"
    start, step = rng.randint(-10, 30), rng.randint(2, 9)
    terms = ", ".join(str(start + i * step) for i in range(5))
    return f"What are the next two numbers in the sequence {terms}, ...? What is the 20th term?{suffix}"


def _chat_prompt(rng: random.Random) -> str:
    """One general-assistant request: explanations, advice, how-tos, writing, planning."""
    style = rng.randrange(11)
    n = rng.randint(3, 7)
    if style == 0:
        return f"Explain {_pick(rng, _CHAT_CONCEPTS)} to {_pick(rng, _CHAT_AUDIENCES)}."
    if style == 1:
        return f"Give me {n} tips for {_pick(rng, _CHAT_ACTIVITIES)}."
    if style == 2:
        return f"What are the pros and cons of {_pick(rng, _CHAT_CHOICES)}?"
    if style == 3:
        return f"{_pick(rng, ['How do I', 'What is the best way to', 'Can you tell me how to'])} {_pick(rng, _CHAT_HOWTOS)}?"
    if style == 4:
        lines = _pick(rng, ["", f" Keep it under {n * 20} words.", " Make it funny.", " Give it a hopeful tone."])
        return f"Write a {_pick(rng, _CHAT_FORMS)} about {_pick(rng, _CHAT_SUBJECTS)}.{lines}"
    if style == 5:
        a, b = _pick(rng, _CHAT_COMPARE)
        return f"Compare {a} and {b}. Which would you recommend, and why?"
    if style == 6:
        return f"Summarize the key ideas of {_pick(rng, _CHAT_CONCEPTS)} in {n} sentences."
    if style == 7:
        return (f"I'm feeling {_pick(rng, _CHAT_FEELINGS)} about {_pick(rng, _CHAT_SITUATIONS)}. "
                f"What advice would you give me?")
    if style == 8:
        to, about = _pick(rng, _CHAT_EMAILS)
        return f"Write a {_pick(rng, ['short', 'polite', 'friendly', 'formal'])} email to {to} {about}."
    if style == 9:
        return f"Plan a {rng.randint(2, 7)}-day trip to {_pick(rng, _CHAT_PLACES)} for {_pick(rng, _CHAT_TRAVELERS)}."
    return f"Suggest {n} creative names for a {_pick(rng, _CHAT_NAMEABLES)} and explain each briefly."


# --------------------------------------------------------------------------------------------
# Task-shaped prompts (`TASK_KINDS`): the request formats the first kinds lack. A function stub to complete (signature,
# docstring, worked examples), and longer, specific requests: a role to play, a passage to extract from, a puzzle to
# reason through, an essay with constraints. Still templates over our own vocabularies and random numbers.
# --------------------------------------------------------------------------------------------

# (name, parameters, return annotation, docstring, implementation, example-argument maker): examples in a stub's
# docstring are computed by the implementation, so they are right.
_STUBS = [
    ("count_vowels", "text: str", "int", "Return the number of vowels (a, e, i, o, u, either case) in text.",
     lambda t: sum(c in "aeiouAEIOU" for c in t), lambda r: (_pick(r, _WORDS),)),
    ("reverse_words", "sentence: str", "str", "Return the words of sentence in reverse order, separated by single spaces.",
     lambda t: " ".join(t.split()[::-1]), lambda r: (" ".join(r.sample(_WORDS, 3)),)),
    ("running_sum", "numbers: List[int]", "List[int]", "Return the running sums of numbers: the i-th item is the sum of the first i + 1.",
     lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))], lambda r: ([r.randint(-5, 9) for _ in range(r.randint(3, 5))],)),
    ("second_largest", "numbers: List[int]", "Optional[int]", "Return the second largest distinct value in numbers, or None if there is none.",
     lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, lambda r: ([r.randint(0, 9) for _ in range(r.randint(2, 6))],)),
    ("is_palindrome", "text: str", "bool", "Check whether text reads the same backwards, ignoring case and spaces.",
     lambda t: t.replace(" ", "").lower() == t.replace(" ", "").lower()[::-1], lambda r: (_pick(r, ["level", "Step on no pets", "python", "abca", "Noon"]),)),
    ("digit_sum", "n: int", "int", "Return the sum of the decimal digits of the non-negative integer n.",
     lambda n: sum(map(int, str(n))), lambda r: (r.randint(0, 99999),)),
    ("chunk", "items: List[int], size: int", "List[List[int]]", "Split items into consecutive chunks of length size; the last chunk may be shorter.",
     lambda xs, k: [xs[i : i + k] for i in range(0, len(xs), k)], lambda r: (list(range(r.randint(3, 8))), r.randint(2, 3))),
    ("count_words", "text: str", "Dict[str, int]", "Count how often each lowercase word occurs in text (words are separated by spaces).",
     lambda t: {w: t.lower().split().count(w) for w in dict.fromkeys(t.lower().split())}, lambda r: (" ".join(r.choice(_WORDS[:4]) for _ in range(4)),)),
    ("unique_in_order", "items: List[int]", "List[int]", "Remove duplicates from items, keeping the first occurrence of each value in order.",
     lambda xs: list(dict.fromkeys(xs)), lambda r: ([r.randint(1, 4) for _ in range(r.randint(4, 7))],)),
    ("gcd", "a: int, b: int", "int", "Return the greatest common divisor of two positive integers a and b.",
     lambda a, b: __import__("math").gcd(a, b), lambda r: (r.randint(2, 60), r.randint(2, 60))),
    ("is_prime", "n: int", "bool", "Return True if n is a prime number and False otherwise.",
     lambda n: n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)), lambda r: (r.randint(1, 50),)),
    ("fizzbuzz_line", "n: int", "str", "Return 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else str(n).",
     lambda n: "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n), lambda r: (r.randint(1, 30),)),
    ("rotate_left", "items: List[int], k: int", "List[int]", "Rotate items to the left by k positions.",
     lambda xs, k: xs[k % len(xs) :] + xs[: k % len(xs)] if xs else [], lambda r: (list(range(1, r.randint(3, 7))), r.randint(1, 4))),
    ("max_gap", "numbers: List[int]", "int", "Return the largest difference between two neighbouring values of the sorted numbers (0 for fewer than two).",
     lambda xs: max((b - a for a, b in zip(sorted(xs), sorted(xs)[1:])), default=0), lambda r: ([r.randint(0, 30) for _ in range(r.randint(2, 6))],)),
    ("title_case", "text: str", "str", "Capitalize the first letter of every word in text and lowercase the rest.",
     lambda t: " ".join(w.capitalize() for w in t.split()), lambda r: (" ".join(r.sample(_WORDS, 2)).upper(),)),
    ("pairs_with_sum", "numbers: List[int], target: int", "List[Tuple[int, int]]", "Return all pairs (a, b) with a < b taken from numbers, in order of first appearance, whose sum is target.",
     lambda xs, t: [(xs[i], xs[j]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[i] + xs[j] == t and xs[i] < xs[j]], lambda r: ([r.randint(0, 9) for _ in range(5)], r.randint(5, 12))),
    ("compress", "text: str", "str", "Run-length encode text: each run of a repeated character becomes the character followed by the run length.",
     lambda t: "".join(f"{c}{len(g)}" for c, g in __import__("itertools").groupby(t) for g in [list(g)]), lambda r: ("".join(c * r.randint(1, 3) for c in r.sample("abcde", 3)),)),
    ("mean_of_evens", "numbers: List[int]", "float", "Return the mean of the even values in numbers, or 0.0 if there are none.",
     lambda xs: (sum(e for e in xs if e % 2 == 0) / len([e for e in xs if e % 2 == 0])) if any(e % 2 == 0 for e in xs) else 0.0, lambda r: ([r.randint(1, 12) for _ in range(4)],)),
    ("flatten", "nested: List[List[int]]", "List[int]", "Flatten a list of lists into one list, keeping the order.",
     lambda xss: [x for xs in xss for x in xs], lambda r: ([[r.randint(0, 9) for _ in range(r.randint(0, 3))] for _ in range(3)],)),
    ("longest_word", "sentence: str", "str", "Return the longest word in sentence; on a tie, the first one.",
     lambda t: max(t.split(), key=len), lambda r: (" ".join(r.sample(_WORDS, 3)),)),
    ("to_binary", "n: int", "str", "Return the binary representation of the non-negative integer n without the '0b' prefix.",
     lambda n: bin(n)[2:], lambda r: (r.randint(0, 64),)),
    ("count_inversions", "numbers: List[int]", "int", "Count the pairs of positions i < j with numbers[i] > numbers[j].",
     lambda xs: sum(xs[i] > xs[j] for i in range(len(xs)) for j in range(i + 1, len(xs))), lambda r: ([r.randint(0, 9) for _ in range(r.randint(3, 6))],)),
    ("balanced", "brackets: str", "bool", "Check whether every opening bracket in brackets ('(', '[' or '{') is closed in the right order.",
     lambda t: __import__("functools").reduce(lambda st, c: st + c if c in "([{" else (st[:-1] if st and "([{"[")]}".index(c)] == st[-1] else st + "!"), t, "") == "", lambda r: (_pick(r, ["([]{})", "(]", "{[()]}", "((", "[()]{}"]),)),
    ("clamp_all", "numbers: List[float], low: float, high: float", "List[float]", "Limit every value of numbers to the range [low, high].",
     lambda xs, lo, hi: [min(max(x, lo), hi) for x in xs], lambda r: ([r.randint(-10, 10) for _ in range(4)], -3, 5)),
]
_WORDS = ["apple", "river", "planet", "quick", "garden", "music", "stone", "orange", "window", "silver", "echo", "idea"]
_STUB_ASKS = [
    "Complete the following Python function:", "Implement the body of this Python function:",
    "Finish this function so that it passes its docstring examples:", "Fill in the missing implementation:",
    "Write the code for this function:",
]


def _stub_prompt(rng: random.Random) -> str:
    """A Python function stub to complete: imports, a typed signature, a docstring and worked examples."""
    name, params, returns, doc, implementation, make_args = _pick(rng, _STUBS)
    examples = []
    for _ in range(rng.randint(1, 3)):
        args = make_args(rng)
        examples.append(f"    >>> {name}({', '.join(repr(a) for a in args)})\n    {implementation(*args)!r}")
    typing = sorted({t for t in ("List", "Dict", "Optional", "Tuple") if t + "[" in params + returns})
    header = f"from typing import {', '.join(typing)}\n\n\n" if typing else ""
    body = f'def {name}({params}) -> {returns}:\n    """ {doc}\n' + "\n".join(examples) + '\n    """\n'
    return f"{_pick(rng, _STUB_ASKS)}\n```python\n{header}{body}```"


_PERSONAS = [
    ("a ship's captain from the 1800s", "describe your most dangerous voyage"),
    ("a detective in a noir novel", "explain how you cracked your latest case"),
    ("a friendly museum guide", "introduce the museum's most famous painting to a school group"),
    ("a personal trainer", "design a beginner's weekly workout and motivate me to follow it"),
    ("a medieval blacksmith", "explain how you make a sword to an apprentice"),
    ("a travel agent", "convince me to spend my holiday somewhere I have never heard of"),
    ("a chef on a cooking show", "walk the audience through your signature dish"),
    ("an astronaut on the space station", "describe a normal day in orbit"),
    ("a startup founder", "pitch your product to investors in two minutes"),
    ("a patient math tutor", "help me understand why dividing by zero is undefined"),
    ("a sports commentator", "narrate the last minute of a tied championship game"),
    ("a librarian", "recommend three books to a teenager who says reading is boring"),
    ("a park ranger", "warn campers about the local wildlife"),
    ("a time traveler from the year 2300", "describe how people travel in your time"),
    ("a customer support agent", "help a customer whose order arrived broken"),
    ("a career counselor", "advise a graduate choosing between two job offers"),
]
_ROLE_STYLES = ["", " Stay in character throughout.", " Keep the answer under 200 words.",
                " Use vivid details.", " Speak in the first person and keep a warm tone."]


_ROLE_TASKS = [
    "describe a typical day in your life", "give advice to someone who wants to do your job",
    "tell a short story about the biggest mistake you ever made", "explain what you love most about your work",
    "answer a curious child who asks what you do all day", "describe the strangest thing that ever happened to you",
]


def _roleplay_prompt(rng: random.Random) -> str:
    persona, own_task = _pick(rng, _PERSONAS)
    task = own_task if rng.random() < 0.5 else _pick(rng, _ROLE_TASKS)
    opening = _pick(rng, ["Pretend you are", "Imagine you are", "Act as", "You are"])
    return f"{opening} {persona}. {task[0].upper()}{task[1:]}.{_pick(rng, _ROLE_STYLES)}"


_PRODUCTS = ["wireless headphones", "a coffee grinder", "a hiking backpack", "a smart watch", "an electric kettle",
             "a desk lamp", "a yoga mat", "a board game", "a phone case", "running shoes"]
_REVIEW_WORDS = {1: ["broke after a week", "was a total disappointment"], 2: ["works but feels cheap", "was not worth the price"],
                 3: ["is okay for the price", "does the job, nothing more"], 4: ["works well with small flaws", "is a good buy"],
                 5: ["exceeded my expectations", "is the best I have owned"]}
_COMPANIES = ["Northwind", "Bluepeak", "Orbit Labs", "Greenfield Foods", "Lumen Energy", "Atlas Freight", "Cobalt Games"]
_CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Lyon", "Toronto", "Perth", "Bogotá", "Krakow", "Chennai"]


def _extraction_prompt(rng: random.Random) -> str:
    """A short passage made here, and a request to pull structured facts out of it."""
    style = rng.randrange(3)
    if style == 0:
        product = _pick(rng, _PRODUCTS)
        reviews = []
        for i in range(rng.randint(3, 4)):
            stars = rng.randint(1, 5)
            item = product.removeprefix("a ").removeprefix("an ")
            reviews.append(f"Review {i + 1} ({_pick(rng, _NAMES)}): My {item} {_pick(rng, _REVIEW_WORDS[stars])}.")
        ask = _pick(rng, ["Rate each review from 1 to 5 and return the result as a JSON list of numbers.",
                          "For each review, give the reviewer's name and whether the review is positive, neutral or "
                          "negative, as a table.", "Summarize the overall opinion of these reviews in two sentences."])
        return "Here are customer reviews of " + product + ":\n" + "\n".join(reviews) + "\n\n" + ask
    if style == 1:
        lines = []
        for company in rng.sample(_COMPANIES, rng.randint(3, 4)):
            revenue, change = rng.randint(5, 900), rng.randint(-30, 45)
            lines.append(f"{company}, based in {_pick(rng, _CITIES)}, reported revenue of ${revenue} million in "
                         f"{rng.randint(2015, 2024)}, {'up' if change >= 0 else 'down'} {abs(change)}% on the year before.")
        ask = _pick(rng, ["Extract the company names, cities and revenues as a JSON object keyed by company.",
                          "Which company grew the most, and which had the highest revenue? Answer in one line each.",
                          "Turn this into a table with the columns company, city, revenue and change."])
        return "Read the following report:\n" + " ".join(lines) + "\n\n" + ask
    people = []
    for name in rng.sample(_NAMES, rng.randint(3, 5)):
        people.append(f"{name} is {rng.randint(19, 70)} years old, lives in {_pick(rng, _CITIES)} and works as a "
                      f"{_pick(rng, ['nurse', 'teacher', 'pilot', 'designer', 'farmer', 'chemist', 'lawyer', 'baker'])}.")
    ask = _pick(rng, ["List every person with their city, sorted by age, as 'name - city - age'.",
                      "Return a JSON array of objects with the keys name, age, city and job.",
                      "Who is the oldest and who is the youngest? Explain how you found out."])
    return "Here is some information:\n" + "\n".join(people) + "\n\n" + ask


def _reasoning_prompt(rng: random.Random) -> str:
    """A small logic puzzle with random names and numbers, to be reasoned through."""
    a, b, c, d = rng.sample(_NAMES, 4)
    style = rng.randrange(4)
    if style == 0:
        return (f"{a} is taller than {b}. {c} is shorter than {b} but taller than {d}. Who is the tallest and who is "
                f"the shortest? Explain your reasoning.")
    if style == 1:
        x, y = rng.randint(3, 15), rng.randint(2, 9)
        return (f"{a} has {x} marbles. {b} has {y} more than {a}, and {c} has twice as many as {b}. How many marbles do "
                f"they have together? Think step by step.")
    if style == 2:
        n = rng.randint(5, 12)
        return (f"In a race of {n} runners, {a} overtakes the person in second place. What position is {a} in now? "
                f"Then {a} is overtaken by {b}; what position is {a} in? Explain.")
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
    return (f"{a}, {b} and {c} each have a meeting on a different day of {', '.join(days[:3])}. {a}'s meeting is not "
            f"on {days[0]}, {b}'s meeting is the day after {c}'s, and {c}'s is not on {days[1]}. Which day is each "
            f"meeting on? Show how you worked it out.")


_ESSAY_TOPICS = [
    "the invention of the printing press", "the rise of social media", "urban green spaces", "remote work",
    "the history of the bicycle", "artificial intelligence in medicine", "space exploration", "the Industrial Revolution",
    "music education in schools", "the spread of coffee around the world", "renewable energy in small towns",
    "the role of museums today", "electric public transport", "video games as art", "the Olympic Games",
]
_ESSAY_FORMS = ["a short essay", "a blog post", "a persuasive speech", "an explanation for a general audience",
                "a newspaper opinion column", "a five-paragraph essay"]
_ESSAY_CONSTRAINTS = ["Include one historical example.", "End with a question for the reader.",
                      "Use three headings.", "Mention one argument against your view and answer it.",
                      "Keep it under 250 words.", "Start with a surprising fact.", "Use a friendly, simple tone."]


def _essay_prompt(rng: random.Random) -> str:
    topic, form = _pick(rng, _ESSAY_TOPICS), _pick(rng, _ESSAY_FORMS)
    constraints = " ".join(rng.sample(_ESSAY_CONSTRAINTS, rng.randint(1, 2)))
    style = rng.randrange(3)
    if style == 0:
        return f"Write {form} about {topic}. {constraints}"
    if style == 1:
        return (f"Discuss how {topic} changed everyday life. Describe the situation before, what changed, and what it "
                f"means for the future. {constraints}")
    return f"Why does {topic} matter? Explain its main effects, then give your own opinion. {constraints}"


# --------------------------------------------------------------------------------------------
# Prompts mined from local text: the Python standard library of the running interpreter. Its documented functions
# and methods become stubs to complete (signature and docstring) or code to explain, and the prose of its
# documentation (pydoc's topic texts, module and class docstrings) passages to summarize, explain or extract from. The
# templates above vary only over small vocabularies; this text is written by many people about many things. Which
# prompts come out depends on the Python version (`mined_corpus_version`), so a data set records it.
# --------------------------------------------------------------------------------------------

_SKIPPED_STDLIB_PARTS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                         "dist-packages", "pydoc_data", "__pycache__", "__phello__"}


def mined_corpus_version() -> str:
    """The interpreter whose standard library the mined prompts come from (recorded with a data set)."""
    return f"CPython {sys.version.split()[0]}" if sys.implementation.name == "cpython" else sys.version.split()[0]


def _stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted module name, file) of the standard library's Python files, skipped folders left out, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path.relative_to(root) for path in root.rglob("*.py")]
    files = sorted((path for path in files if not _SKIPPED_STDLIB_PARTS & set(path.parts)), key=Path.as_posix)
    return [(".".join(path.with_suffix("").parts).removesuffix(".__init__"), root / path) for path in files]


def _prose(text: str | None, min_chars: int = 300, max_chars: int = 1400) -> list[str]:
    """Passages of a documentation text: runs of plain paragraphs (no code, no tables, no doctest lines) cut to at
    most `max_chars`, keeping only those of at least `min_chars`."""
    if not text:
        return []
    passages, current = [], []
    for paragraph in text.split("\n\n"):
        lines = [line.strip() for line in paragraph.strip().splitlines()]
        plain = lines and not any(line.startswith((">>>", "...", "+", "|", "$", "%")) for line in lines)
        plain = plain and sum(c.isalpha() or c.isspace() for c in paragraph) > 0.85 * len(paragraph)
        if plain and sum(map(len, current)) + len(paragraph) <= max_chars:
            current.append(" ".join(lines))
            continue
        if sum(map(len, current)) >= min_chars:
            passages.append("\n\n".join(current))
        current = [" ".join(lines)] if plain and len(paragraph) <= max_chars else []
    if sum(map(len, current)) >= min_chars:
        passages.append("\n\n".join(current))
    return passages


@functools.lru_cache(maxsize=1)
def _stdlib_corpus() -> tuple[tuple, tuple, tuple]:
    """(stubs, sources, passages) of the standard library, in a fixed order: stubs are (module, class or None,
    signature-and-docstring source), sources (module, whole function source of 4..40 lines), passages (source name,
    text)."""
    stubs, sources, passages = [], [], []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # an interpreter built without pydoc's data; the docstrings remain
        topics = {}
    for name in sorted(topics):
        passages += [(f"the Python language reference, topic '{name}'", p) for p in _prose(topics[name])]
    for module, path in _stdlib_modules():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines()
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        passages += [(f"the documentation of the Python module {module}", p) for p in _prose(ast.get_docstring(tree))]
        owners = [(None, tree)] + [(node.name, node) for node in tree.body
                                   if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
        for owner, parent in owners:
            if owner is not None:
                passages += [(f"the documentation of {module}.{owner}", p) for p in _prose(ast.get_docstring(parent))]
            for node in parent.body:
                docstring = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
                if not docstring or node.name.startswith("_") or not 60 <= len(docstring) <= 1200:
                    continue
                length = node.end_lineno - node.lineno + 1
                if not 4 <= length <= 40 or len(node.body) < 2 or node.decorator_list:  # a body beyond the docstring
                    continue
                stub = copy.copy(node)
                stub.body = node.body[:1]  # the docstring
                stubs.append((module, owner, ast.unparse(stub)))
                sources.append((module, owner, textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))))
    return tuple(stubs), tuple(sources), tuple(passages)


_SOURCE_STUB_ASKS = [
    "Complete the following Python function:", "Implement this function from the Python standard library's {module} "
    "module:", "Write the body of this Python function so that it does what its docstring says:",
    "Here is a function signature with its docstring. Implement it in Python:",
    "Fill in the implementation, and explain briefly how it works:",
]
_SOURCE_EXPLAIN_ASKS = [
    "Explain what this Python function does, step by step:", "What does the following code from the {module} module "
    "do? Describe its inputs, its output and any edge cases.", "Review this Python function: is there anything you "
    "would improve?", "Write three example calls of this function and say what each returns:",
    "Explain this code to a beginner:", "Rewrite this function in a simpler style and explain the changes:",
]
_PASSAGE_ASKS = [
    "Summarize the passage above in three bullet points.", "Explain the passage above to someone new to programming.",
    "What are the key facts in the passage above? List them.", "Write a short example that illustrates the passage "
    "above.", "Turn the passage above into three quiz questions with their answers.",
    "Rewrite the passage above in plain English, in one paragraph.", "What is the most important point of the "
    "passage above, and why?",
]


def _source_stub_prompt(rng: random.Random) -> str:
    """A documented standard-library function (or method, inside its class) to implement from its docstring."""
    module, owner, stub = _pick(rng, _stdlib_corpus()[0])
    if owner is not None:
        stub = f"class {owner}:\n    ...\n\n" + "\n".join(f"    {line}" if line else line for line in stub.splitlines())
    return f"{_pick(rng, _SOURCE_STUB_ASKS).format(module=module)}\n```python\n{stub}\n```"


def _source_explain_prompt(rng: random.Random) -> str:
    module, owner, source = _pick(rng, _stdlib_corpus()[1])
    where = f"# from {module}" + (f", class {owner}" if owner else "")
    return f"{_pick(rng, _SOURCE_EXPLAIN_ASKS).format(module=module)}\n```python\n{where}\n{source}\n```"


def _doc_passage_prompt(rng: random.Random) -> str:
    source, passage = _pick(rng, _stdlib_corpus()[2])
    return f"The following passage is from {source}:\n\n{passage}\n\n{_pick(rng, _PASSAGE_ASKS)}"


_PROMPT_BUILDERS: dict[str, Callable[[random.Random], str]] = {
    "code": _code_prompt, "math": _math_prompt, "chat": _chat_prompt, "stub": _stub_prompt,
    "roleplay": _roleplay_prompt, "extraction": _extraction_prompt, "reasoning": _reasoning_prompt,
    "essay": _essay_prompt, "source_stub": _source_stub_prompt, "source_explain": _source_explain_prompt,
    "doc_passage": _doc_passage_prompt,
}


def training_prompts(n: int = 2400, seed: int = 0, kinds: Sequence[str] = PROMPT_KINDS) -> datasets.Dataset:
    """Build ``n`` distinct training prompts, an equal share of each of ``kinds`` (default: code, math and chat;
    ``TASK_KINDS``: function stubs, role play, extraction, reasoning puzzles and essays).

    The prompts come from templates filled with our own vocabularies and random numbers, never
    from an evaluation set. The same ``(n, seed, kinds)`` always gives the same prompts in the same order,
    and kinds are interleaved so any prefix is balanced too.

    Returns:
        A dataset with columns ``prompt`` (str) and ``kind`` (one of ``kinds``).
    """
    if n < 1:
        raise ValueError(f"n must be a positive number of prompts, got {n}.")
    unknown = [kind for kind in kinds if kind not in _PROMPT_BUILDERS]
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty list of {sorted(_PROMPT_BUILDERS)}, got {list(kinds)!r}")
    rng = random.Random(seed)
    prompts: list[str] = []
    kind_column: list[str] = []
    seen: set[str] = set()
    max_attempts = 50 * n  # the template space is far larger; running out means a broken vocabulary
    for attempt in range(max_attempts):
        if len(prompts) == n:
            break
        kind = kinds[len(prompts) % len(kinds)]
        prompt = _PROMPT_BUILDERS[kind](rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
            kind_column.append(kind)
    if len(prompts) < n:
        raise RuntimeError(
            f"Only {len(prompts)} distinct prompts after {max_attempts} attempts; ask for fewer than {n} "
            f"or add templates/vocabulary in modeling_xpress/prompts.py."
        )
    return datasets.Dataset.from_dict({"prompt": prompts, "kind": kind_column})
