"""Training prompts that ship offline and never overlap the evaluation sets.

Seven sources, the first five mixed like the paper's data (conversation 18 %, math 39 %, code 39 %, instructions 4 %):
- chat: opening turns of human conversations from the `chitchat-dataset` package (MIT);
- assist: assistant requests in the kinds MT-Bench asks (writing, roleplay, extraction, reasoning, STEM and
  humanities), half of them with a follow-up turn, from templates and word lists;
- math: word problems and exercises generated from templates with random numbers;
- code: tasks built from the Python standard library's own functions and docstrings;
- library: the same kinds of tasks from the public functions of numpy, networkx and sympy (installed with dspark and
  torch), their docstrings cut to the summary and worked examples (a source apart, so that the prompt files of the
  other sources stay what they were for a given seed);
- instruct: short writing and explanation requests from templates;
- self: requests the target writes itself from its chat template (`self_prompts`; it needs the target loaded).
Every prompt is checked against the evaluation prompts (8-word shingles) and dropped on any overlap.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
from pathlib import Path

from dspark.errors import DSparkError
from dspark.fsutil import read_jsonl

MIX = {"chat": 0.08, "assist": 0.10, "math": 0.39, "code": 0.39, "instruct": 0.04, "library": 0.0, "self": 0.0}
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


# ---- chat --------------------------------------------------------------------------------------------------------
def chat_prompts(rng: random.Random) -> list[list[str]]:
    """User turns (1 or 2) from each chitchat conversation: one speaker's consecutive messages form a turn."""
    from dspark.extras import chitchat_conversations_file

    data = json.loads(chitchat_conversations_file().read_text())
    conversations = []
    for conv in data.values():
        groups = conv["messages"]
        if len(groups) < 3:
            continue
        first = groups[0][0]["sender"]
        turns = [" ".join(u["text"].strip() for u in g) for g in groups if g and g[0]["sender"] == first]
        turns = [t for t in turns if len(t.split()) >= 2][: rng.choice([1, 1, 2])]
        if turns:
            conversations.append(turns)
    rng.shuffle(conversations)
    return conversations


# ---- math --------------------------------------------------------------------------------------------------------
NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Ines", "Kofi", "Yuki", "Tom", "Sara", "Ivan"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells", "bottles", "stamps"]
PLACES = ["bakery", "library", "garden", "farm", "toy store", "school fair", "market", "museum shop"]


def _math_word(rng: random.Random) -> str:
    n, m = rng.sample(NAMES, 2)
    item, place = rng.choice(ITEMS), rng.choice(PLACES)
    a, b, c = rng.randint(3, 60), rng.randint(2, 15), rng.randint(2, 9)
    price = rng.choice([0.25, 0.5, 0.75, 1.25, 1.5, 2, 3, 4, 5, 7.5])
    pct = rng.choice([10, 15, 20, 25, 30, 40, 50, 60, 75])
    templates = [
        f"{n} buys {a} {item} at the {place} and gives {b} of them to {m}. Then {n} buys {c} more packs with {b} {item} in each. How many {item} does {n} have now?",
        f"At the {place}, {item} cost ${price} each. {n} buys {a} {item} and pays with a ${(int(a * price) // 10 + 1) * 10} bill. How much change does {n} get?",
        f"{n} reads {b} pages every weekday and {c} pages on each weekend day. How many pages does {n} read in {rng.randint(2, 6)} weeks?",
        f"A {place} sold {a * 10} {item} on Monday. On Tuesday it sold {pct}% more than on Monday. How many {item} did it sell on the two days together?",
        f"{n} is {a} years old. {m} is {c} years younger than twice {n}'s age. How old will {m} be in {b} years?",
        f"A train travels {a * 5} km in {c} hours. At the same speed, how far does it travel in {c + b} hours?",
        f"{n} saves ${b} every week. {m} saves ${c} more than {n} every week. After {a} weeks, how much have they saved together?",
        f"A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter as the rectangle. What is the area of the square?",
        f"{n} had ${a * 4}. {n} spent {pct}% of it on {item} and then half of what was left on lunch. How much money does {n} have left?",
        f"There are {a} students in a class. {pct}% of them play football, and {b} of the rest play chess. How many students play neither?",
        f"A recipe needs {c} cups of flour for every {b} cookies. How many cups of flour are needed for {b * a} cookies?",
        f"{n} runs {c} km every day for {b} days, then rests for {rng.randint(1, 3)} days, and repeats. How many km does {n} run in {b * 4 + 4} days?",
        f"A tank holds {a * 20} liters. It is {pct}% full. A pipe adds {b} liters per minute. How many minutes until the tank is full?",
        f"{n} and {m} share {a * c} {item} in the ratio {c}:{b}. How many {item} does {m} get?",
    ]
    return rng.choice(templates) + MATH_SUFFIX


def _math_exercise(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 19), rng.randint(2, 30), rng.randint(20, 120)
    p, q = rng.randint(12, 240), rng.randint(12, 240)
    templates = [
        f"Solve for $x$: ${a}x + {b} = {c}$.",
        f"What is the greatest common divisor of {p} and {q}?",
        f"What is the least common multiple of {a} and {b}?",
        f"Compute $\\binom{{{a + 3}}}{{{min(a, 4)}}}$.",
        f"Simplify $\\frac{{{p}}}{{{q}}}$.",
        f"What is the sum of all positive divisors of {p}?",
        f"Find the area of a circle whose circumference is ${2 * a}\\pi$.",
        f"Evaluate $\\sqrt{{{a * a * b}}}$ in simplest radical form.",
        f"What is the remainder when ${a}^{{{b}}}$ is divided by {rng.choice([5, 7, 9, 11, 13])}?",
        f"The sum of two numbers is {c} and their difference is {b}. What is the larger number?",
        f"Find all real $x$ such that $x^2 - {a + b}x + {a * b} = 0$.",
        f"How many positive integers less than {c * 3} are multiples of {a} but not of {b}?",
        f"What is the slope of the line through $({a}, {b})$ and $({c}, {p})$?",
        f"If $f(x) = {a}x^2 - {b}x + {c % 17}$, what is $f({rng.randint(-5, 6)})$?",
        f"What is ${p}\\%$ of ${q * 10}$?",
        f"A fair die is rolled {min(a, 4)} times. What is the probability that every roll shows an even number?",
        f"Convert ${p}$ from base 10 to base {rng.choice([2, 3, 5, 7, 8])}.",
        f"What is the sum of the interior angles of a polygon with {a + 3} sides?",
    ]
    return rng.choice(templates) + MATH_SUFFIX


def math_prompts(rng: random.Random, count: int) -> list[list[str]]:
    return [[(_math_word if rng.random() < 0.6 else _math_exercise)(rng)] for _ in range(count)]


# ---- code --------------------------------------------------------------------------------------------------------
STDLIB_MODULES = [
    "textwrap",
    "string",
    "posixpath",
    "shutil",
    "json",
    "csv",
    "fractions",
    "statistics",
    "heapq",
    "bisect",
    "random",
    "calendar",
    "collections",
    "functools",
    "difflib",
    "html",
    "urllib.parse",
    "base64",
    "ipaddress",
    "glob",
    "fnmatch",
    "shlex",
    "colorsys",
    "copy",
    "pprint",
    "re",
    "operator",
    "zipfile",
    "tarfile",
    "email.utils",
    "inspect",
    "keyword",
    "decimal",
    "secrets",
    "uuid",
    "datetime",
    "os",
    "tempfile",
    "gzip",
    "wave",
    "quopri",
    "uu",
    "mimetypes",
    "netrc",
    "filecmp",
    "linecache",
    "tokenize",
    "ast",
    "dis",
    "gettext",
    "locale",
    "codecs",
    "numbers",
    "enum",
    "dataclasses",
    "typing",
    "contextlib",
    "abc",
    "traceback",
    "warnings",
    "logging",
    "argparse",
    "getopt",
    "sched",
    "queue",
    "threading",
    "subprocess",
    "socket",
    "selectors",
    "http.cookies",
    "http.client",
    "urllib.request",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "plistlib",
    "configparser",
    "tomllib",
    "zlib",
    "hashlib",
    "hmac",
    "binascii",
    "struct",
    "array",
    "weakref",
    "types",
    "itertools",
    "math",
    "cmath",
    "pathlib",
    "ntpath",
    "stat",
    "fileinput",
    "imghdr",
    "sndhdr",
    "chunk",
    "graphlib",
    "reprlib",
    "string",
    "unicodedata",
]


def readable_signature(sig: str) -> str | None:
    """A signature as code would write it: object reprs in defaults become names (a repr like `<function f at 0x7f..>`
    would put a memory address, different in every process, into the prompt); None when one cannot be named."""
    sig = re.sub(r"<(?:function|built-in function) ([\w.]+) at 0x[0-9a-f]+>", r"\1", sig)
    sig = re.sub(r"<class '([\w.]+)'>", r"\1", sig)
    sig = sig.replace("=<no value>", "=None")  # numpy's marker for "not given"
    sig = re.sub(r"(, \*)?, backend=None, \*\*backend_kwargs", "", sig)  # networkx's dispatcher adds these
    return None if "<" in sig else sig


# Public functions of libraries every dspark install has (numpy; networkx and sympy come with torch): thousands more
# documented functions than the standard library, many with the worked examples a HumanEval prompt carries.
LIBRARY_MODULES = ["numpy", "numpy.linalg", "networkx", "sympy"]


def _documented_functions(module_names: list[str], library: bool = False) -> list[tuple[str, str, str, str | None]]:
    """(qualified name, signature, docstring, source or None) of the public documented functions (and, for the
    standard library, methods) of these modules. A library's namespace gathers functions from its submodules; those
    it re-exports from other packages, and its classes, are left out."""
    found, seen = [], set()
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        members = []
        for attr, obj in vars(module).items():
            if attr.startswith("_"):
                continue
            if library:
                own = (getattr(obj, "__module__", None) or "").split(".")[0] == name.split(".")[0]
                if own and inspect.isroutine(obj):
                    members.append((attr, obj))
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                members.append((attr, obj))
            elif inspect.isclass(obj) and getattr(obj, "__module__", "") == module.__name__:
                members += [
                    (f"{attr}.{m}", f) for m, f in vars(obj).items() if not m.startswith("_") and inspect.isfunction(f)
                ]
        for qual, obj in members:
            doc = inspect.getdoc(obj) or ""
            doc = _doc_digest(doc.strip()) if library else doc.strip()
            if len(doc.split()) < 6 or doc in seen:
                continue
            seen.add(doc)
            try:
                sig = readable_signature(str(inspect.signature(obj)))
            except (TypeError, ValueError):
                sig = "(*args)"
            if sig is None:
                continue
            try:
                src = inspect.getsource(obj) if inspect.isfunction(obj) else None
            except (OSError, TypeError):
                src = None
            found.append((f"{name}.{qual}", sig, doc, src))
    return found


SECTION_HEADER = re.compile(r"^[ \t]*\w[\w ]*\n[ \t]*(?:-{3,}|={3,})[ \t]*$", re.M)


THIRD_PERSON_VERBS = {
    "Returns",
    "Computes",
    "Finds",
    "Generates",
    "Checks",
    "Creates",
    "Tests",
    "Transforms",
    "Calculates",
    "Converts",
    "Determines",
    "Counts",
    "Adds",
    "Removes",
    "Gets",
    "Builds",
    "Constructs",
    "Evaluates",
    "Estimates",
    "Selects",
    "Draws",
    "Writes",
    "Reads",
    "Gives",
}


def _doc_digest(doc: str, max_example_lines: int = 8) -> str:
    """A numpydoc or sympy docstring (sections underlined with --- or ===) as a HumanEval prompt's docstring: the
    summary before the first section, then the first doctest examples (>>> lines and the output after them)."""
    header = SECTION_HEADER.search(doc)
    if header is None:
        return doc
    examples, in_example = [], False
    for line in doc[header.start() :].splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "...")):
            in_example = True
        elif not stripped:
            in_example = False
            continue
        if in_example:
            examples.append(stripped)
    summary = doc[: header.start()].strip()
    first, _, rest = summary.partition(" ")
    if first in THIRD_PERSON_VERBS:  # "Returns the ..." -> "Return the ...", as "Write a function to ..." needs
        summary = first[:-1] + " " + rest
    return summary + ("\n\n" + "\n".join(examples[:max_example_lines]) if examples else "")


def _first_sentence(doc: str) -> str:
    para = doc.split("\n\n")[0].replace("\n", " ").strip()
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).rstrip(".")


def _code_prompt(style: int, qual: str, sig: str, doc: str, src: str | None, rng: random.Random) -> str | None:
    short = qual.split(".")[-1]
    sentence = _first_sentence(doc)
    task = sentence[0].lower() + sentence[1:] if sentence else f"implement {short}"
    body = "\n".join("    " + line if line else "" for line in doc.split("\n")[:12])
    if style == 0:
        return f'{CODE_PREFIX}def {short}{sig}:\n    """\n{body}\n    """\n```'
    if style == 1:
        lead = rng.choice(["Write a python function to", "Write a function to", "Write a Python function that"])
        return f"{lead} {task}."
    if style == 2:
        return f"Implement `{short}{sig}` in Python without using the `{qual.split('.')[0]}` module. {sentence}."
    if style == 3:
        return f"Write pytest unit tests for a function `{short}{sig}` whose documentation says:\n{doc[:600]}"
    if src is None or len(src) > 1800:
        return None
    if style == 4:
        return f"Explain what the following Python function does, step by step:\n```python\n{src}```"
    if style == 5:
        return f"Rewrite the following Python function to make it shorter and easier to read:\n```python\n{src}```"
    if style == 6:
        return f"What is the time complexity of this function? Explain briefly.\n```python\n{src}```"
    return None


CODE_STYLES = 7


def code_prompts(rng: random.Random, count: int, functions=None) -> list[list[str]]:
    """Distinct (function, style) pairs of these functions (the standard library's by default), styles weighted
    towards writing code (as HumanEval/MBPP ask)."""
    functions = _documented_functions(STDLIB_MODULES) if functions is None else functions
    pairs = [(f, style) for f in functions for style in range(CODE_STYLES)]
    weights = [3, 3, 1, 1, 1, 1, 1]
    rng.shuffle(pairs)
    pairs.sort(key=lambda fs: rng.random() / weights[fs[1]])  # weighted shuffle: more of styles 0 and 1 first
    prompts = []
    for (qual, sig, doc, src), style in pairs:
        if len(prompts) >= count:  # checked first: a mix without code asks for none
            break
        text = _code_prompt(style, qual, sig, doc, src, rng)
        if text:
            prompts.append([text])
    return prompts


# ---- instructions ------------------------------------------------------------------------------------------------
TOPICS = [
    "the ocean",
    "autumn",
    "a city at night",
    "friendship",
    "learning to code",
    "a rainy day",
    "mountains",
    "coffee",
    "a lighthouse",
    "the first day of school",
    "space travel",
    "a small garden",
    "old books",
    "a train journey",
    "winter mornings",
    "a busy kitchen",
    "an abandoned house",
    "a desert",
    "the moon",
    "a music festival",
    "grandparents",
    "a lost key",
    "city parks",
    "a bakery at dawn",
    "robots",
]
ACTIVITIES = [
    "studying for exams",
    "saving money",
    "sleeping better",
    "learning a language",
    "running a meeting",
    "starting to exercise",
    "writing clean code",
    "cooking for a family",
    "moving to a new city",
]
CONCEPTS = [
    "photosynthesis",
    "inflation",
    "machine learning",
    "the water cycle",
    "gravity",
    "compound interest",
    "how vaccines work",
    "recursion",
    "supply and demand",
    "climate change",
    "the internet",
    "electricity",
]


def instruct_prompts(rng: random.Random, count: int) -> list[list[str]]:
    makers = [
        lambda: f"Write a short poem about {rng.choice(TOPICS)}.",
        lambda: f"Give me three practical tips for {rng.choice(ACTIVITIES)}.",
        lambda: f"Explain {rng.choice(CONCEPTS)} to a ten-year-old.",
        lambda: f"Write a short story opening set in {rng.choice(TOPICS)}.",
        lambda: f"Summarize the pros and cons of {rng.choice(ACTIVITIES)} in a few bullet points.",
        lambda: f"Write a friendly email inviting a colleague to a talk about {rng.choice(CONCEPTS)}.",
        lambda: f"What are common mistakes people make when {rng.choice(ACTIVITIES)}?",
        lambda: f"Write a haiku about {rng.choice(TOPICS)}.",
        lambda: f"Describe {rng.choice(TOPICS)} in three sentences for a travel magazine.",
        lambda: f"Compare {rng.choice(CONCEPTS)} and {rng.choice(CONCEPTS)} in a short paragraph.",
        lambda: f"Write a product description for a gadget that helps with {rng.choice(ACTIVITIES)}.",
    ]
    return [[rng.choice(makers)()] for _ in range(count)]


# ---- assistant requests (MT-Bench's kinds) ------------------------------------------------------------------------
FORMS = [
    "blog post",
    "persuasive essay",
    "formal email",
    "short speech",
    "product review",
    "cover letter",
    "newsletter intro",
    "short story",
    "limerick",
    "dialogue between two friends",
    "press release",
    "motivational letter",
    "restaurant review",
    "museum guide entry",
]
STYLES = [
    "in under 150 words",
    "with a catchy title",
    "for a teenage audience",
    "in a humorous tone",
    "using exactly three paragraphs",
    "with a surprising ending",
    "in a formal register",
    "as a numbered list",
]
PERSONAS = [
    "a pirate captain",
    "a 19th-century detective",
    "a tour guide in Kyoto",
    "a fitness coach",
    "a medieval blacksmith",
    "a patient customer support agent",
    "a famous pastry chef",
    "an astronaut on Mars",
    "a librarian who loves mysteries",
    "a wise old gardener",
    "a startup founder",
    "a marine biologist",
]
PERSONA_ASKS = [
    "What advice would you give to a beginner?",
    "Describe a typical day in your life.",
    "What was the hardest decision you ever made?",
    "How would you convince me to try your craft?",
    "What do people most often misunderstand about your work?",
    "Tell me about your favourite tool.",
]
FIELDS = {
    "physics": ["entropy", "superconductivity", "the photoelectric effect", "inertia", "wave interference"],
    "biology": ["natural selection", "cell respiration", "the immune response", "gene expression", "symbiosis"],
    "chemistry": ["chemical equilibrium", "catalysis", "oxidation", "covalent bonding", "pH buffers"],
    "economics": ["opportunity cost", "price elasticity", "comparative advantage", "monetary policy", "externalities"],
    "history": [
        "the printing press",
        "the Silk Road",
        "the industrial revolution",
        "the fall of Rome",
        "the Renaissance",
    ],
    "philosophy": ["utilitarianism", "stoicism", "the social contract", "free will", "the ship of Theseus"],
    "computer science": [
        "hash tables",
        "public-key cryptography",
        "garbage collection",
        "TCP congestion control",
        "dynamic programming",
    ],
}
FOLLOW_UPS = [
    "Now summarise your answer in one sentence.",
    "Rewrite your answer for a five-year-old.",
    "Can you give a concrete example?",
    "What are the main weaknesses of what you just said?",
    "Turn your answer into a short poem.",
    "Make it twice as short, keeping the key points.",
    "Translate the first sentence of your answer into French.",
    "Explain your reasoning step by step.",
]


def _writing(rng: random.Random) -> str:
    return f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS + CONCEPTS)}, {rng.choice(STYLES)}."


def _roleplay(rng: random.Random) -> str:
    opening = rng.choice(["Act as", "Imagine you are", "For this conversation, play"])
    return f"{opening} {rng.choice(PERSONAS)}. Stay in character. {rng.choice(PERSONA_ASKS)}"


def _extraction(rng: random.Random) -> str:
    people = rng.sample(NAMES, 3)
    lines = [
        f"{p} bought {rng.randint(2, 30)} {rng.choice(ITEMS)} at the {rng.choice(PLACES)} on "
        f"{rng.choice(['Monday', 'Tuesday', 'Friday', 'Sunday'])} for ${rng.randint(3, 90)}."
        for p in people
    ]
    ask = rng.choice(
        [
            "Return the purchases as a JSON list with keys name, count, item, place and price.",
            "Make a table of who bought what, and on which day.",
            "Who spent the most, and how much did all three spend together?",
        ]
    )
    return "Read the notes below.\n" + "\n".join(lines) + "\n" + ask


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    trait = rng.choice([("taller", "shortest"), ("older", "youngest"), ("faster", "slowest")])
    puzzles = [
        f"{a} is {trait[0]} than {b}, and {b} is {trait[0]} than {c}. Who is the {trait[1]}? Explain.",
        f"If today is {rng.choice(['Monday', 'Wednesday', 'Saturday'])}, what day will it be in "
        f"{rng.randint(10, 100)} days? Show how you worked it out.",
        f"{a} has twice as many {rng.choice(ITEMS)} as {b}. Together they have {3 * rng.randint(4, 30)}. "
        f"How many does each have? Is there only one answer?",
        f"A box holds red and blue balls. {a} says at least one is red; {b} says at most one is red; {c} says both "
        "statements are true. If the box holds three balls, what could it contain?",
    ]
    return rng.choice(puzzles)


def _question(rng: random.Random) -> str:
    field = rng.choice(list(FIELDS))
    x, y = rng.sample(FIELDS[field], 2)
    return rng.choice(
        [
            f"In {field}, what is {x}, and how does it relate to {y}?",
            f"Explain {x} to a first-year {field} student, with one everyday example.",
            f"What are the most common misconceptions about {x}?",
        ]
    )


ASSIST_KINDS = {
    "writing": _writing,
    "roleplay": _roleplay,
    "extraction": _extraction,
    "reasoning": _reasoning,
    "question": _question,
}


def assist_prompts(rng: random.Random, count: int) -> list[list[str]]:
    """Requests of MT-Bench's kinds in equal shares; half of them continue with a follow-up turn."""
    kinds = list(ASSIST_KINDS.values())
    prompts = []
    for i in range(count):
        turns = [kinds[i % len(kinds)](rng)]
        if rng.random() < 0.5:
            turns.append(rng.choice(FOLLOW_UPS))
        prompts.append(turns)
    rng.shuffle(prompts)
    return prompts


# ---- assembly ----------------------------------------------------------------------------------------------------
def _shingles(text: str, n: int = 8) -> set[str]:
    for fixed in (MATH_SUFFIX, CODE_PREFIX):
        text = text.replace(fixed, " ")
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlaps(text: str, forbidden: set[str]) -> bool:
    """Whether `text` shares an 8-word run with the evaluation prompts whose runs `eval_shingles` gave."""
    return bool(_shingles(text) & forbidden)


def eval_shingles(eval_dir: Path) -> set[str]:
    """8-word runs of every evaluation prompt. A missing or empty folder is an error: without it the contamination
    check would pass everything."""
    eval_dir = Path(eval_dir)
    files = sorted(eval_dir.glob("*.jsonl")) if eval_dir.is_dir() else []
    if not files:
        raise DSparkError(
            f"--eval-dir {eval_dir} holds no evaluation sets (*.jsonl); prompts are checked against them "
            'for overlap, so point it at the folder of {"turns": [...]} files'
        )
    shingles: set[str] = set()
    for path in files:
        for record in read_jsonl(path):
            for turn in record.get("turns", []):
                shingles |= _shingles(turn)
    return shingles


def build_prompts(
    count: int, seed: int, eval_dir: Path, mix: dict | None = None, write_self=None
) -> tuple[list[dict], dict]:
    """`count` prompt records in the given mix, shuffled; returns (records, report of counts and dropped overlaps).
    write_self(count, seed, forbidden) -> (prompts, report): the writer of the `self` source, needed only when the
    mix asks for it."""
    forbidden = eval_shingles(eval_dir)
    mix = mix or MIX
    unknown = set(mix) - set(MIX)
    if unknown:
        raise DSparkError(f"unknown prompt source(s) {', '.join(sorted(unknown))}; the sources are {', '.join(MIX)}")
    rng = random.Random(seed)
    want = {k: round(count * v) for k, v in mix.items()}
    pools = {
        "chat": chat_prompts(rng)[: want.get("chat", 0)],
        "assist": assist_prompts(rng, want.get("assist", 0)),
        "math": math_prompts(rng, want.get("math", 0)),
        "code": code_prompts(rng, want.get("code", 0)),
        "instruct": instruct_prompts(rng, want.get("instruct", 0)),
        # Last, and only when asked for, so that it draws nothing from rng otherwise: a seed keeps giving the files
        # it gave before this source existed.
        "library": code_prompts(rng, want["library"], _documented_functions(LIBRARY_MODULES, library=True))
        if want.get("library")
        else [],
        "self": [],
    }
    written = {}
    if want.get("self"):  # drawn from the target, not from rng: the other sources' files stay what they were
        if write_self is None:
            raise DSparkError("the 'self' source needs the target to write its prompts; none was given")
        pools["self"], written = write_self(want["self"], seed, forbidden)
    records, dropped, seen = [], {}, set()
    for source, prompts in pools.items():
        for turns in prompts:
            key = "\n".join(turns)
            if key in seen or any(overlaps(t, forbidden) for t in turns):
                dropped[source] = dropped.get(source, 0) + 1
                continue
            seen.add(key)
            # The id is the prompt's own digest: prompt files built with other seeds or mixes never reuse an id for
            # another prompt, so their answers can be appended to one training file.
            digest = hashlib.sha1(key.encode()).hexdigest()[:12]
            records.append(
                {
                    "id": f"{source}-{digest}",
                    "source": source,
                    "messages": [{"role": "user", "content": t} for t in turns],
                }
            )
    rng.shuffle(records)
    counts = {s: sum(r["source"] == s for r in records) for s in pools}
    report = {"requested": count, "counts": counts, "dropped_overlap_or_duplicate": dropped, "seed": seed}
    return records, report | ({"self_written": written} if written else {})


def drop_answered(records: list[dict], answered_files: list) -> list[dict]:
    """The records whose opening user turn none of these files (earlier regenerated sets) holds: the same opening
    is the same prompt to answer."""
    from dspark.records import read_records

    def opening(record):
        return next(m["content"].strip() for m in record["messages"] if m["role"] == "user")

    seen = {opening(r) for path in answered_files for r in read_records(path)}
    return [r for r in records if opening(r) not in seen]
