"""The demo family's `calculator` tool: a small, bounded arithmetic parser (no Python `eval`).

A policy calls this tool with text it generated, so the tool must be safe and fast on any input: docs/warm-start.md
records that an evaluated `9**9**9` hung a prototype. Grammar (usual precedence, `**` right-associative and
binding tighter than unary minus, as in Python):

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | '//' | '%') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom ('**' unary)?
    atom   := NUMBER | '(' expr ')'

Integers are exact; `/` gives an int when the division is exact, else a float. Bounds: the expression's
length, the nesting depth, and the size of every value (`MAX_DIGITS` decimal digits), checked BEFORE a
power or product is computed. `calculator(expression)` returns the value as text or `"error: ..."`.
"""

from __future__ import annotations

import math
import re

__all__ = ["CALCULATOR_TOOL", "CALCULATOR_TOOL_SPEC", "CalculatorError", "calculator", "call", "evaluate_expression"]

MAX_LENGTH = 200  # characters of an expression
MAX_DEPTH = 32  # nested parentheses and unary signs
MAX_DIGITS = 100  # decimal digits of any integer value (floats: finite)

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
"""The tool schema, key for key the one in the tiny model's corpus (gyre/models/corpus/tool_calls.txt), so
the rendered `<tools>` block is text the tokenizer was trained on."""

CALCULATOR_TOOL_SPEC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
"""The same tool in the form the builtin harness's `--tools` file takes (name, description, input_schema)."""

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(\*\*|//|[-+*/%()]))")


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the policy sees after `error: `."""


def _tokens(expression: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = expression.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise CalculatorError(f"unexpected character {text[pos:].lstrip()[:1]!r} at position {pos}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def _digits(value: int) -> int:
    return len(str(abs(value))) if value else 1


def _check(value: int | float) -> int | float:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("result is not a finite number")
    elif _digits(value) > MAX_DIGITS:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero")
    if isinstance(base, int) and isinstance(exp, int) and exp >= 0:
        # Estimate the result's size before computing it: 9**9**9 would take hours and gigabytes.
        if abs(base) > 1 and exp * math.log10(abs(base)) > MAX_DIGITS:
            raise CalculatorError(f"exponent too large (result would exceed {MAX_DIGITS} digits)")
        return base**exp
    try:
        value = float(base) ** float(exp)
    except OverflowError:
        raise CalculatorError("result too large") from None
    if isinstance(value, complex):
        raise CalculatorError("result is not a real number")
    return value


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")

    def expr(self) -> int | float:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term()
            value = _check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> int | float:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, rhs = self.take(), self.unary()
            if op != "*" and rhs == 0:
                raise CalculatorError("division by zero")
            if op == "*":
                if isinstance(value, int) and isinstance(rhs, int) and _digits(value) + _digits(rhs) > MAX_DIGITS + 1:
                    raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
                value = value * rhs
            elif op == "/":
                exact = isinstance(value, int) and isinstance(rhs, int) and value % rhs == 0
                value = value // rhs if exact else value / rhs
            else:
                value = value // rhs if op == "//" else value % rhs
            value = _check(value)
        return value

    def unary(self) -> int | float:
        if self.peek() in ("+", "-"):
            op = self.take()
            self.nest()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> int | float:
        base = self.atom()
        if self.peek() == "**":
            self.take()
            self.nest()
            exp = self.unary()
            self.depth -= 1
            return _check(_power(base, exp))
        return base

    def atom(self) -> int | float:
        token = self.peek()
        if token is None:
            raise CalculatorError("unexpected end of expression")
        self.take()
        if token == "(":
            self.nest()
            value = self.expr()
            if self.peek() != ")":
                raise CalculatorError("missing ')'")
            self.take()
            self.depth -= 1
            return value
        if token[0].isdigit() or token[0] == ".":
            if len(token.replace(".", "")) > MAX_DIGITS:
                raise CalculatorError(f"number too long (more than {MAX_DIGITS} digits)")
            return float(token) if "." in token else int(token)
        raise CalculatorError(f"unexpected {token!r}")


def evaluate_expression(expression: str) -> int | float:
    """The value of `expression`; raises `CalculatorError` for anything the grammar or the bounds refuse."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expected an expression string, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression too long (more than {MAX_LENGTH} characters)")
    tokens = _tokens(expression)
    if not tokens:
        raise CalculatorError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r}")
    return value


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator(expression: str) -> str:
    """The tool: the value as text, or `error: <why>` (never raises for any input string)."""
    try:
        return format_value(evaluate_expression(expression))
    except CalculatorError as e:
        return f"error: {e}"


def call(name: str, arguments: dict, workspace: object = None) -> str:
    """The builtin harness's task-tool plug-in (`--tools-impl gyre.tasks.demo.calculator:call`)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return "error: missing argument 'expression' (a string)"
    return calculator(expression)
