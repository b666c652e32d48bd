"""The default prompt generator's kinds (`prompts.PROMPT_KINDS`): code, math and chat requests, from templates filled
with our own vocabularies and random numbers. `pick` and the names list are shared with `task_prompts`.

Each builder takes a `random.Random` and returns one prompt; `prompts.training_prompts` calls them in turn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


# --------------------------------------------------------------------------------------------
# Prompt vocabularies. Each list is small on its own; templates x vocabularies x random numbers
# give thousands of distinct prompts with a realistic spread of response lengths.
# --------------------------------------------------------------------------------------------

NAMES = [
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


def pick(rng: random.Random, options: Sequence):
    return options[rng.randrange(len(options))]


def code_prompt(rng: random.Random) -> str:
    """One programming request: a function, a class, a file script, a concept, a bug or an output."""
    style = rng.randrange(6)
    if style == 0:
        task = pick(rng, _CODE_TASKS).format(k=rng.randint(2, 9), n=rng.randint(10, 500))
        verb = pick(rng, ["Write", "Implement", "Create", "Show me"])
        return f"{verb} a {pick(rng, _CODE_LANGUAGES)} function that {task}.{pick(rng, _CODE_EXTRAS)}"
    if style == 1:
        name, methods = pick(rng, _CODE_DATA_STRUCTURES)
        lang = pick(rng, ["Python", "Python", "Java", "C++", "TypeScript"])
        return f"Implement a {name} class in {lang} with the methods {methods}.{pick(rng, _CODE_EXTRAS)}"
    if style == 2:
        fmt, action = pick(rng, _CODE_FILE_FORMATS), pick(rng, _CODE_FILE_ACTIONS)
        stem = pick(rng, ["data", "sales", "users", "events", "measurements", "orders", "server"])
        ext = {"plain text": "txt", "log": "log"}.get(fmt, fmt.lower())
        return f"Write a Python script that reads a {fmt} file named `{stem}.{ext}` and {action}."
    if style == 3:
        a, b = pick(rng, _PYTHON_CONCEPT_PAIRS)
        ask = pick(rng, ["What is the difference between", "When should I use", "Explain"])
        joiner = " instead of " if ask == "When should I use" else " and "
        return f"{ask} {a}{joiner}{b} in Python? Give a short example.".replace("Explain", "Can you explain", 1)
    if style == 4:
        snippet = pick(rng, _BUGGY_SNIPPETS).format(f=pick(rng, _FUNCTION_NAMES))
        ask = pick(rng, ["Find and fix the bug in this Python function:",
                          "This Python code does not work as intended. What is wrong, and how do I fix it?",
                          "Review this function and correct any mistakes:"])
        return f"{ask}\n```python\n{snippet}\n```"
    # A small program with random constants: what does it print?
    xs = [rng.randint(-9, 20) for _ in range(rng.randint(3, 6))]
    k = rng.randint(2, 5)
    body = pick(rng, [
        f"xs = {xs}\nprint(sum(x * {k} for x in xs if x > 0))",
        f"xs = {xs}\nprint(sorted(xs)[-{min(k, len(xs))}:])",
        f"xs = {xs}\nprint([x % {k} for x in xs])",
        f"total = 0\nfor i in range({k}, {k + len(xs)}):\n    total += i * i\nprint(total)",
        f"s = '{''.join(pick(rng, 'abcdefgh') for _ in range(k + 3))}'\nprint(s[::{-1 if k % 2 else 2}])",
        f"d = {{x: x ** 2 for x in {xs}}}\nprint(len(d), max(d.values()))",
    ])
    return f"What does the following Python code print? Explain why.\n```python\n{body}\n```"


def math_prompt(rng: random.Random) -> str:
    """One math question with random quantities: word problems, algebra, geometry, statistics."""
    style = rng.randrange(14)
    name, other = rng.sample(NAMES, 2)
    suffix = pick(rng, ["", " Show your work.", " Explain your reasoning step by step.", " Explain briefly."])
    if style == 0:
        (_, items), count, price = pick(rng, _ITEMS), rng.randint(2, 12), rng.randint(50, 1500) / 100
        bill = next(b for b in (5, 10, 20, 50, 100, 200) if b > count * price)
        return (f"{name} buys {count} {items} at ${price:.2f} each and pays with a ${bill} bill. "
                f"How much change does {name} get?{suffix}")
    if style == 1:
        vehicle, dist, hours = pick(rng, _VEHICLES), rng.randint(20, 900), rng.randint(2, 9)
        more = rng.randint(30, 600)
        return (f"A {vehicle} travels {dist} km in {hours} hours. What is its average speed, and how long "
                f"would it take to travel {more} km at that speed?{suffix}")
    if style == 2:
        pct, price = pick(rng, [5, 10, 12, 15, 20, 25, 30, 35, 40, 60]), rng.randint(12, 900)
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
        shape = pick(rng, _SHAPES_2D)
        dims = {
            "rectangle": f"width {rng.randint(2, 40)} cm and length {rng.randint(2, 60)} cm",
            "right triangle": f"legs of {rng.randint(3, 24)} cm and {rng.randint(3, 24)} cm",
            "circle": f"radius {rng.randint(1, 30)} m",
            "square": f"side {rng.randint(2, 50)} inches",
            "trapezoid": f"parallel sides {rng.randint(3, 20)} m and {rng.randint(21, 40)} m and height {rng.randint(2, 15)} m",
            "parallelogram": f"base {rng.randint(3, 30)} cm and height {rng.randint(2, 20)} cm",
        }[shape]
        what = pick(rng, ["area", "perimeter", "area and perimeter"]) if shape != "trapezoid" else "area"
        return f"What is the {what} of a {shape} with {dims}?{suffix}"
    if style == 6:
        shape = pick(rng, _SHAPES_3D)
        r, h = rng.randint(1, 15), rng.randint(2, 30)
        dims = {"cube": f"edge {r} cm", "cylinder": f"radius {r} cm and height {h} cm",
                "sphere": f"radius {r} cm", "rectangular box": f"sides {r} cm, {h} cm and {rng.randint(2, 12)} cm",
                "cone": f"radius {r} cm and height {h} cm"}[shape]
        return f"Find the {pick(rng, ['volume', 'surface area'])} of a {shape} with {dims}.{suffix}"
    if style == 7:
        den = [rng.randint(2, 12), rng.randint(2, 12)]
        num = [rng.randint(1, d * 2) for d in den]
        op = pick(rng, ["add", "subtract", "multiply", "divide"])
        joiner = {"add": "and", "subtract": "from", "multiply": "by", "divide": "by"}[op]
        return f"{op.capitalize()} {num[0]}/{den[0]} {joiner} {num[1]}/{den[1]} and simplify the result.{suffix}"
    if style == 8:
        values = [rng.randint(1, 99) for _ in range(rng.randint(5, 9))]
        return f"Find the mean, median and range of these numbers: {', '.join(map(str, values))}.{suffix}"
    if style == 9:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        job = pick(rng, ["paint a fence", "mow a lawn", "fill a pool", "sort a pile of letters", "clean a house"])
        return (f"{name} can {job} in {a} hours and {other} can do it in {b} hours. How long does it take "
                f"if they work together?{suffix}")
    if style == 10:
        principal, rate, years = rng.randint(5, 200) * 100, pick(rng, [1.5, 2, 2.5, 3, 4, 5, 6, 7]), rng.randint(2, 15)
        how = pick(rng, ["compounded yearly", "with simple interest", "compounded monthly"])
        return f"How much is ${principal} worth after {years} years at {rate}% interest {how}?{suffix}"
    if style == 11:
        red, blue, green = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 8)
        event = pick(rng, ["a red marble", "two blue marbles in a row without replacement",
                            "a marble that is not blue", "one red and one blue marble in two draws with replacement"])
        bag = f"{red} red, {blue} blue" + (f" and {green} green" if green else "") + " marbles"
        return f"A bag contains {bag}. What is the probability of drawing {event}?{suffix}"
    if style == 12:
        total, a, b = rng.randint(3, 60) * 10, rng.randint(1, 7), rng.randint(1, 7)
        what = pick(rng, ["dollars", "stickers", "cookies", "hours of work", "liters of paint"])
        return f"Split {total} {what} between {name} and {other} in the ratio {a}:{b}. How much does each get?{suffix}"
    # Number theory and conversions.
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(6, 300), rng.randint(6, 300)
        return f"Find the greatest common divisor and the least common multiple of {a} and {b}.{suffix}"
    if kind == 1:
        return f"Write {rng.randint(30, 5000)} as a product of prime factors.{suffix}"
    if kind == 2:
        src, dst = pick(rng, _CONVERSIONS)
        return f"Convert {rng.randint(1, 500)} {src} to {dst}.{suffix}"
    start, step = rng.randint(-10, 30), rng.randint(2, 9)
    terms = ", ".join(str(start + i * step) for i in range(5))
    return f"What are the next two numbers in the sequence {terms}, ...? What is the 20th term?{suffix}"


def chat_prompt(rng: random.Random) -> str:
    """One general-assistant request: explanations, advice, how-tos, writing, planning."""
    style = rng.randrange(11)
    n = rng.randint(3, 7)
    if style == 0:
        return f"Explain {pick(rng, _CHAT_CONCEPTS)} to {pick(rng, _CHAT_AUDIENCES)}."
    if style == 1:
        return f"Give me {n} tips for {pick(rng, _CHAT_ACTIVITIES)}."
    if style == 2:
        return f"What are the pros and cons of {pick(rng, _CHAT_CHOICES)}?"
    if style == 3:
        return f"{pick(rng, ['How do I', 'What is the best way to', 'Can you tell me how to'])} {pick(rng, _CHAT_HOWTOS)}?"
    if style == 4:
        lines = pick(rng, ["", f" Keep it under {n * 20} words.", " Make it funny.", " Give it a hopeful tone."])
        return f"Write a {pick(rng, _CHAT_FORMS)} about {pick(rng, _CHAT_SUBJECTS)}.{lines}"
    if style == 5:
        a, b = pick(rng, _CHAT_COMPARE)
        return f"Compare {a} and {b}. Which would you recommend, and why?"
    if style == 6:
        return f"Summarize the key ideas of {pick(rng, _CHAT_CONCEPTS)} in {n} sentences."
    if style == 7:
        return (f"I'm feeling {pick(rng, _CHAT_FEELINGS)} about {pick(rng, _CHAT_SITUATIONS)}. "
                f"What advice would you give me?")
    if style == 8:
        to, about = pick(rng, _CHAT_EMAILS)
        return f"Write a {pick(rng, ['short', 'polite', 'friendly', 'formal'])} email to {to} {about}."
    if style == 9:
        return f"Plan a {rng.randint(2, 7)}-day trip to {pick(rng, _CHAT_PLACES)} for {pick(rng, _CHAT_TRAVELERS)}."
    return f"Suggest {n} creative names for a {pick(rng, _CHAT_NAMEABLES)} and explain each briefly."

