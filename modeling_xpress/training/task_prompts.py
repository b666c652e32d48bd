"""Task-shaped prompts (`prompts.TASK_KINDS`): the request formats the default kinds lack. A function stub to complete
(signature, docstring, worked examples), and longer, specific requests: a role to play, a passage to extract from, a
puzzle to reason through, an essay with constraints. Still templates over our own vocabularies and random numbers.
"""

from __future__ import annotations

import random

from .general_prompts import NAMES, pick


# (name, parameters, return annotation, docstring, implementation, example-argument maker): examples in a stub's
# docstring are computed by the implementation, so they are right.
_STUBS = [
    ("count_vowels", "text: str", "int", "Return the number of vowels (a, e, i, o, u, either case) in text.",
     lambda t: sum(c in "aeiouAEIOU" for c in t), lambda r: (pick(r, _WORDS),)),
    ("reverse_words", "sentence: str", "str", "Return the words of sentence in reverse order, separated by single spaces.",
     lambda t: " ".join(t.split()[::-1]), lambda r: (" ".join(r.sample(_WORDS, 3)),)),
    ("running_sum", "numbers: List[int]", "List[int]", "Return the running sums of numbers: the i-th item is the sum of the first i + 1.",
     lambda xs: [sum(xs[: i + 1]) for i in range(len(xs))], lambda r: ([r.randint(-5, 9) for _ in range(r.randint(3, 5))],)),
    ("second_largest", "numbers: List[int]", "Optional[int]", "Return the second largest distinct value in numbers, or None if there is none.",
     lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, lambda r: ([r.randint(0, 9) for _ in range(r.randint(2, 6))],)),
    ("is_palindrome", "text: str", "bool", "Check whether text reads the same backwards, ignoring case and spaces.",
     lambda t: t.replace(" ", "").lower() == t.replace(" ", "").lower()[::-1], lambda r: (pick(r, ["level", "Step on no pets", "python", "abca", "Noon"]),)),
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
     lambda t: __import__("functools").reduce(lambda st, c: st + c if c in "([{" else (st[:-1] if st and "([{"[")]}".index(c)] == st[-1] else st + "!"), t, "") == "", lambda r: (pick(r, ["([]{})", "(]", "{[()]}", "((", "[()]{}"]),)),
    ("clamp_all", "numbers: List[float], low: float, high: float", "List[float]", "Limit every value of numbers to the range [low, high].",
     lambda xs, lo, hi: [min(max(x, lo), hi) for x in xs], lambda r: ([r.randint(-10, 10) for _ in range(4)], -3, 5)),
]
_WORDS = ["apple", "river", "planet", "quick", "garden", "music", "stone", "orange", "window", "silver", "echo", "idea"]
_STUB_ASKS = [
    "Complete the following Python function:", "Implement the body of this Python function:",
    "Finish this function so that it passes its docstring examples:", "Fill in the missing implementation:",
    "Write the code for this function:",
]


def stub_prompt(rng: random.Random) -> str:
    """A Python function stub to complete: imports, a typed signature, a docstring and worked examples."""
    code = stub_code(rng)
    return f"{pick(rng, _STUB_ASKS)}\n```python\n{code}```"


def stub_code(rng: random.Random) -> str:
    """The code of a stub (imports, typed signature, docstring with examples the implementation computed), no ask."""
    name, params, returns, doc, implementation, make_args = pick(rng, _STUBS)
    examples = []
    for _ in range(rng.randint(1, 3)):
        args = make_args(rng)
        examples.append(f"    >>> {name}({', '.join(repr(a) for a in args)})\n    {implementation(*args)!r}")
    typing = sorted({t for t in ("List", "Dict", "Optional", "Tuple") if t + "[" in params + returns})
    header = f"from typing import {', '.join(typing)}\n\n\n" if typing else ""
    body = f'def {name}({params}) -> {returns}:\n    """ {doc}\n' + "\n".join(examples) + '\n    """\n'
    return header + body


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


def roleplay_prompt(rng: random.Random) -> str:
    persona, own_task = pick(rng, _PERSONAS)
    task = own_task if rng.random() < 0.5 else pick(rng, _ROLE_TASKS)
    opening = pick(rng, ["Pretend you are", "Imagine you are", "Act as", "You are"])
    return f"{opening} {persona}. {task[0].upper()}{task[1:]}.{pick(rng, _ROLE_STYLES)}"


_PRODUCTS = ["wireless headphones", "a coffee grinder", "a hiking backpack", "a smart watch", "an electric kettle",
             "a desk lamp", "a yoga mat", "a board game", "a phone case", "running shoes"]
_REVIEW_WORDS = {1: ["broke after a week", "was a total disappointment"], 2: ["works but feels cheap", "was not worth the price"],
                 3: ["is okay for the price", "does the job, nothing more"], 4: ["works well with small flaws", "is a good buy"],
                 5: ["exceeded my expectations", "is the best I have owned"]}
_COMPANIES = ["Northwind", "Bluepeak", "Orbit Labs", "Greenfield Foods", "Lumen Energy", "Atlas Freight", "Cobalt Games"]
_CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Lyon", "Toronto", "Perth", "Bogotá", "Krakow", "Chennai"]


_EXTRACTION_ASKS = (
    ["Rate each review from 1 to 5 and return the result as a JSON list of numbers.",
     "For each review, give the reviewer's name and whether the review is positive, neutral or negative, as a table.",
     "Summarize the overall opinion of these reviews in two sentences."],
    ["Extract the company names, cities and revenues as a JSON object keyed by company.",
     "Which company grew the most, and which had the highest revenue? Answer in one line each.",
     "Turn this into a table with the columns company, city, revenue and change."],
    ["List every person with their city, sorted by age, as 'name - city - age'.",
     "Return a JSON array of objects with the keys name, age, city and job.",
     "Who is the oldest and who is the youngest? Explain how you found out."],
)


def extraction_prompt(rng: random.Random) -> str:
    """A short passage made here, and a request to pull structured facts out of it."""
    style = rng.randrange(3)
    if style == 0:
        product = pick(rng, _PRODUCTS)
        reviews = []
        for i in range(rng.randint(3, 4)):
            stars = rng.randint(1, 5)
            item = product.removeprefix("a ").removeprefix("an ")
            reviews.append(f"Review {i + 1} ({pick(rng, NAMES)}): My {item} {pick(rng, _REVIEW_WORDS[stars])}.")
        passage = f"Here are customer reviews of {product}:\n" + "\n".join(reviews)
    elif style == 1:
        lines = []
        for company in rng.sample(_COMPANIES, rng.randint(3, 4)):
            revenue, change = rng.randint(5, 900), rng.randint(-30, 45)
            lines.append(f"{company}, based in {pick(rng, _CITIES)}, reported revenue of ${revenue} million in "
                         f"{rng.randint(2015, 2024)}, {'up' if change >= 0 else 'down'} {abs(change)}% on the year before.")
        passage = "Read the following report:\n" + " ".join(lines)
    else:
        people = []
        for name in rng.sample(NAMES, rng.randint(3, 5)):
            people.append(f"{name} is {rng.randint(19, 70)} years old, lives in {pick(rng, _CITIES)} and works as a "
                          f"{pick(rng, ['nurse', 'teacher', 'pilot', 'designer', 'farmer', 'chemist', 'lawyer', 'baker'])}.")
        passage = "Here is some information:\n" + "\n".join(people)
    return passage + "\n\n" + pick(rng, _EXTRACTION_ASKS[style])


def reasoning_prompt(rng: random.Random) -> str:
    """A small logic puzzle with random names and numbers, to be reasoned through."""
    a, b, c, d = rng.sample(NAMES, 4)
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


def essay_prompt(rng: random.Random) -> str:
    topic, form = pick(rng, _ESSAY_TOPICS), pick(rng, _ESSAY_FORMS)
    constraints = " ".join(rng.sample(_ESSAY_CONSTRAINTS, rng.randint(1, 2)))
    style = rng.randrange(3)
    if style == 0:
        return f"Write {form} about {topic}. {constraints}"
    if style == 1:
        return (f"Discuss how {topic} changed everyday life. Describe the situation before, what changed, and what it "
                f"means for the future. {constraints}")
    return f"Why does {topic} matter? Explain its main effects, then give your own opinion. {constraints}"

