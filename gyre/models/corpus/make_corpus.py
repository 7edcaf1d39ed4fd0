"""Regenerate the bundled tokenizer corpus: `python gyre/models/corpus/make_corpus.py`.

Writes english.txt, code.txt, shell.txt, arithmetic.txt and tool_calls.txt next to this file. All text is
written for gyre (hand-written passages below, the rest from templates with a fixed seed), so the corpus
carries no third-party copyright and regenerating it gives the same bytes. Not imported at run time:
`gyre.models.tokenizer` reads the .txt files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gyre.models.chat_template import render_chat

HERE = Path(__file__).parent

ENGLISH = """\
An agent is a program that reads an observation, decides what to do, and acts. A language model becomes an
agent when its text is read as actions: a shell command to run, a file to edit, a tool to call with some
arguments. The environment answers, the answer is appended to the conversation, and the model speaks again.
The episode ends when the task is solved, when the model gives up, or when a time limit is reached.

Reinforcement learning improves the agent from its own attempts. Several attempts at the same task form a
group; each attempt receives a reward, and the advantage of an attempt is its reward minus the mean reward of
its group. Attempts that did better than their siblings are made more likely, attempts that did worse are
made less likely. No value network is needed, only a fair comparison between siblings.

Long tasks are uneven. Most episodes finish in a minute, a few run for an hour. A trainer that waits for the
slowest episode of every batch wastes its accelerators; a trainer that never waits learns from stale data.
The scheduler decides, at every moment, how many machines generate text and how many compute gradients.
When the queue of finished episodes is short, more machines generate; when it is long, more machines train.

A tokenizer turns text into a sequence of integers. A byte-level tokenizer can represent any string, because
every byte has a token of its own; merges learned from a corpus join frequent pairs into longer tokens. Digits
are kept apart, one token per digit, so that the model sees numbers the same way whatever their length. The
chat template marks who is speaking: the system, the user, the assistant, or a tool.

The calculator tool takes an expression and returns its value. The model learns when to call it: a sum of two
small numbers it can do alone, a product of two large numbers it should hand to the tool. At first it rarely
calls the tool; after a few dozen steps of reinforcement learning it calls the tool whenever that pays.

Please read the file, find the failing test, and fix the bug. Run the tests again before you answer. If a
command fails, read the error message carefully: it usually says what went wrong and where. Keep changes
small, explain why they are needed, and do not remove a test to make the suite pass.

The weather was mild this morning. We walked along the river, counted the boats, and stopped for tea at the
corner shop. The shop keeper told us the bridge would be closed on Sunday for repairs, so we planned to take
the ferry instead. In the evening we cooked rice with vegetables and wrote down the plan for the next day.
"""

_COMMON_WORDS_TEXT = """
about above across act action add after again against age ago agree air all allow almost alone along already also
although always among amount and animal another answer any appear apply area argue arm around arrive art article as
ask at attack author available avoid away baby back bad bag ball bank base be beat beautiful because become bed
before begin behavior behind believe best better between beyond big bill bird bit black blood blue board body book
born both box boy break bring brother budget build building business but buy by call camera campaign can capital car
card care career carry case catch cause cell center central century certain chair challenge chance change character
charge check child choice choose church city civil claim class clear close coach cold collection college color come
common community company compare computer concern condition consider contain continue control cost could country
couple course court cover create crime cultural culture cup current customer cut dark data daughter day dead deal
death debate decade decide decision deep defense degree describe design despite detail determine develop difference
different difficult dinner direction director discover discuss disease do doctor dog door down draw dream drive drop
during each early east easy eat economic economy edge education effect effort eight either election else employee
end energy enjoy enough enter entire environment especially establish even evening event ever every evidence exactly
example executive exist expect experience expert explain eye face fact factor fail fall family far fast father fear
feel feeling few field fight figure fill film final finally financial find fine finger finish fire firm first fish
five floor fly focus follow food foot for force foreign forget form former forward four free friend from front full
fund future game garden gas general generation get girl give glass go goal good government great green ground group
grow growth guess gun guy hair half hand hang happen happy hard have head health hear heart heat heavy help her here
herself high him himself his history hit hold home hope hospital hot hotel hour house how however huge human hundred
husband idea identify if image imagine impact important improve in include including increase indeed indicate
individual industry information inside instead institution interest interesting international interview into
investment involve issue it item its itself job join just keep key kid kill kind kitchen know knowledge land
language large last late later laugh law lawyer lay lead leader learn least leave left leg legal less let letter
level lie life light like likely line list listen little live local long look lose loss lot love low machine
magazine main maintain major majority make man manage management manager many market marriage material matter may
maybe me mean measure media medical meet meeting member memory mention method middle might military million mind
minute miss mission model modern moment money month more morning most mother mouth move movement movie much music
must my myself name nation national natural nature near nearly necessary need network never new news newspaper next
nice night no none nor north not note nothing notice now number occur of off offer office officer official often oil
ok old on once one only onto open operation opportunity option or order organization other others our out outside
over own owner page pain painting paper parent part participant particular particularly partner party pass past
patient pattern pay peace people per perform performance perhaps period person personal phone physical pick picture
piece place plan plant play player point police policy political politics poor popular population position positive
possible power practice prepare present president pressure pretty prevent price private probably problem process
produce product production professional professor program project property protect prove provide public pull purpose
push put quality question quickly quite race radio raise range rate rather reach read ready real reality realize
really reason receive recent recently recognize record red reduce reflect region relate relationship religious
remain remember remove report represent require research resource respond response responsibility rest result return
reveal rich right rise risk road rock role room rule run safe same save say scene school science scientist score sea
season seat second section security see seek seem sell send senior sense series serious serve service set seven
several shake share she shoot short shot should shoulder show side sign significant similar simple simply since sing
single sister sit site situation six size skill skin small smile so social society soldier some somebody someone
something sometimes son song soon sort sound source south southern space speak special specific speech spend sport
spring staff stage stand standard star start state statement station stay step still stock stop store story strategy
street strong structure student study stuff style subject success successful such suddenly suffer suggest summer
support sure surface system table take talk task tax teach teacher team technology television tell ten tend term
test than thank that the their them themselves then theory there these they thing think third this those though
thought thousand threat three through throughout throw thus time to today together tonight too top total tough
toward town trade traditional training travel treat treatment tree trial trip trouble true truth try turn two type
under understand unit until up upon us use usually value various very victim view violence visit voice vote wait
walk wall want war watch water way we weapon wear week weight well west western what whatever when where whether
which while white who whole whom whose why wide wife will win wind window wish with within without woman wonder word
work worker world worry would write writer wrong yard yeah year yes yet you young your yourself
"""
COMMON_WORDS = _COMMON_WORDS_TEXT.split()

SUBJECTS = ["The model", "The agent", "The user", "The scheduler", "The trainer", "A worker", "The tool", "The test"]
VERBS = ["reads", "writes", "returns", "checks", "updates", "sends", "loads", "saves", "computes", "waits for"]
OBJECTS = ["the file", "the answer", "a result", "the weights", "the request", "the batch", "the log", "a message"]
ENDINGS = [
    "before the step ends",
    "after the tool responds",
    "when the queue is empty",
    "on every turn",
    "within the time limit",
    "and then stops",
    "without an error",
    "in the next episode",
]

CODE = '''\
def mean(values: list[float]) -> float:
    """Return the arithmetic mean of a non-empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def group_advantages(rewards: list[float]) -> list[float]:
    baseline = mean(rewards)
    return [reward - baseline for reward in rewards]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int = 1) -> int:
        self.count += n
        return self.count


def parse_args(argv: list[str]) -> dict[str, str]:
    options = {}
    for item in argv:
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        options[key.strip()] = value.strip()
    return options


import json
import os
from pathlib import Path


def read_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    config = read_config(os.environ.get("CONFIG", "config.json"))
    for name, value in sorted(config.items()):
        print(f"{name} = {value}")


if __name__ == "__main__":
    main()
'''

FUNC_NAMES = ["add", "scale", "clip", "total", "count_words", "is_even", "first", "last", "flatten", "merge"]
VAR_NAMES = ["x", "y", "n", "i", "value", "items", "result", "total", "text", "data", "path", "line"]

SHELL_CMDS = [
    "ls -la {d}",
    "cd {d} && ls",
    "cat {f}",
    "grep -n {w} {f}",
    "python {f}",
    "pytest -q tests/{f}",
    "mkdir -p {d}",
    "rm -f {f}",
    "cp {f} {d}/",
    "head -n {n} {f}",
    "tail -n {n} {f}",
    "wc -l {f}",
    "git status",
    "git diff {f}",
    "echo $(( {n} + {m} ))",
    "find {d} -name '*.py'",
    "sed -n {n},{m}p {f}",
    "python -c 'print({n} * {m})'",
    "du -sh {d}",
    "pip install {w}",
]
DIRS = ["src", "tests", "data", "logs", "/tmp/run", "build", "docs", "configs"]
FILES = ["main.py", "test_main.py", "README.md", "config.json", "train.log", "utils.py", "model.py", "notes.txt"]
WORDS = ["error", "TODO", "def", "import", "loss", "reward", "numpy", "requests", "torch", "step"]

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def _english(rng: random.Random) -> str:
    lines = [ENGLISH]
    for _ in range(900):
        lines.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}.")
    for _ in range(1200):  # word salad: spreads merges over many English words
        words = [rng.choice(COMMON_WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ","]))
    return "\n".join(lines) + "\n"


def _code(rng: random.Random) -> str:
    chunks = [CODE]
    for _ in range(300):
        f, a, b = rng.choice(FUNC_NAMES), rng.choice(VAR_NAMES), rng.choice(VAR_NAMES)
        if rng.random() < 0.5:  # snake_case identifiers from English words
            f = f"{rng.choice(COMMON_WORDS)}_{rng.choice(COMMON_WORDS)}"
        k = rng.randint(0, 99)
        chunks.append(
            f"def {f}_{k}({a}, {b}={k}):\n    if {a} is None:\n        return {b}\n    return {a} + {b} * {k}\n\n"
            f"{rng.choice(VAR_NAMES)} = {f}_{k}({rng.randint(0, 999)})\n"
            f'assert {f}_{k}(0) == {k * k}, "{f}_{k} failed"\n'
            f'print({{"name": "{f}", "value": {k}}})\n'
        )
    return "\n".join(chunks)


def _shell(rng: random.Random) -> str:
    lines = []
    for _ in range(2500):
        cmd = rng.choice(SHELL_CMDS).format(
            d=rng.choice(DIRS), f=rng.choice(FILES), w=rng.choice(WORDS), n=rng.randint(1, 200), m=rng.randint(1, 200)
        )
        lines.append(f"$ {cmd}")
    return "\n".join(lines) + "\n"


def _arith(rng: random.Random) -> str:
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(rng.choice([f"{a} {op} {b} = {value}", f"What is {a} {op} {b}? {value}", f"{a}{op}{b}={value}"]))
    return "\n".join(lines) + "\n"


def _episodes(rng: random.Random) -> str:
    episodes = []
    for k in range(400):
        a, b = rng.randint(2, 9999), rng.randint(2, 9999)
        op = rng.choice("+-*")
        expr = f"{a} {op} {b}"
        value = str(eval(expr))  # two integer literals and one operator: safe
        if k % 3 == 2:
            cmd = f"echo $(( {a} {op} {b} ))"
            messages = [
                {"role": "user", "content": f"Use the shell to compute {expr}."},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "bash", "arguments": {"command": cmd}}]},
                {"role": "tool", "content": value},
                {"role": "assistant", "content": f"The result is {value}."},
            ]
            tools = [BASH_TOOL] if k % 10 == 2 else None
        elif k % 3 == 1:
            messages = [
                {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
                {"role": "user", "content": f"What is {expr}?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"name": "calculator", "arguments": {"expression": expr}}],
                },
                {"role": "tool", "content": value},
                {"role": "assistant", "content": value},
            ]
            tools = [CALC_TOOL] if k % 10 == 1 else None
        else:
            messages = [
                {"role": "user", "content": f"Compute {expr}."},
                {"role": "assistant", "reasoning_content": f"{expr} is {value}.", "content": value},
            ]
            tools = None
        episodes.append(render_chat(messages, tools=tools, add_generation_prompt=False))
        episodes.append(json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n")
    return "".join(episodes)


def main() -> None:
    rng = random.Random(20251130)
    for name, make in [
        ("english", _english),
        ("code", _code),
        ("shell", _shell),
        ("arithmetic", _arith),
        ("tool_calls", _episodes),
    ]:
        (HERE / f"{name}.txt").write_text(make(rng), encoding="utf-8")


if __name__ == "__main__":
    main()
