"""Answers compared as expressions, for grade_answer_sympy (upstream's lenient math grade), without running the text.

`plain_answer` turns a (LaTeX) answer into plain infix text as upstream's normalisation does: units, dollars and
percent signs dropped, `\\frac{a}{b}` -> `a/b`, `\\sqrt{x}` -> `sqrt(x)`, lower case. `equal_as_expressions` reads
two such answers with a whitelist parser (numbers, at most two one-letter unknowns, pi, + - * / ^, sqrt, implicit
products) into sympy objects and checks that their difference simplifies to 0. Nothing is evaluated as Python: the
text is parsed by `ast` and only the whitelisted nodes are turned into sympy objects.
"""
from __future__ import annotations

import ast
import re

from .math_utils import _canonical_frac

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")
_SCALES = {"million": "*10^6", "billion": "*10^9", "trillion": "*10^12"}
_SYMBOLS = {"\\cdot": "*", "\\times": "*", "\\pi": "pi", "\\infty": "inf", "\\cup": "U", "\\left": "", "\\right": "",
            "\\!": "", "\\,": "", "\\;": "", "\\tfrac": "\\frac", "\\dfrac": "\\frac"}
_INNER_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_INNER_SQRT = re.compile(r"\\sqrt\{([^{}]*)\}")
_SIMPLE = re.compile(r"-?[\w.]+")
_TUPLE_CHARS = "()[]"
_MAX_LENGTH = 200
_MAX_EXPONENT = 9  # upstream refuses two-digit exponents: sympy may take forever on them


def plain_answer(answer: str | None) -> str | None:
    if answer is None:
        return None
    text = str(answer)
    wrapped = re.fullmatch(r"\\text\{(.+?)\}", text)
    text = wrapped.group(1) if wrapped else text
    text = text.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    text = text.replace(" or ", " , ").replace(" and ", " , ")
    for word, scale in _SCALES.items():
        text = text.replace(word, scale)
    for unit in _UNITS:
        text = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", text)
    text = re.sub(r"\^ *\\circ", "", text)
    if len(text) > 1 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    text = re.sub(r",\\! *", "", text)
    if _as_integer(text) is not None:
        text = str(_as_integer(text))
    if "\\" in text:
        text = _latex_to_plain(text)
    text = re.sub(r"- *", "-", text)
    text = re.sub(r"([0-9]) +([0-9])", r"\1+\2", text)  # a mixed number: 7 3/4 is 7+3/4
    text = text.replace(" ", "").replace("{", "").replace("}", "").lower()
    integer = _as_integer(_without_thousands_commas(text))
    return str(integer) if integer is not None else text


def _latex_to_plain(text: str) -> str:
    for macro, plain in _SYMBOLS.items():
        text = text.replace(macro, plain)
    text = _canonical_frac(text)
    while True:
        changed = _INNER_FRAC.sub(_fraction, text)
        changed = _INNER_SQRT.sub(r"sqrt(\1)", changed)
        if changed == text:
            break
        text = changed
    return re.sub(r"\\[A-Za-z]+", "", text)


def _fraction(match: re.Match) -> str:
    num, den = match.group(1).strip(), match.group(2).strip()
    if _SIMPLE.fullmatch(num) and _SIMPLE.fullmatch(den):
        return f"{num}/{den}"
    return f"({num})/({den})"


def _without_thousands_commas(text: str) -> str:
    while True:
        stripped = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", text)
        if stripped == text:
            return text
        text = stripped


def _as_integer(text: str) -> int | None:
    try:
        value = float(text)
    except (ValueError, OverflowError):
        return None
    if value != value or abs(value) == float("inf") or abs(value - round(value)) > 1e-7:
        return None
    return int(round(value))


def split_elements(text: str) -> list[str]:
    """The elements of a tuple or interval `(a,b)` / `[a,b)` (thousands commas are not separators), else [text]."""
    text = _without_thousands_commas(text)
    if not text:
        return []
    if len(text) > 2 and text[0] in _TUPLE_CHARS and text[-1] in _TUPLE_CHARS \
            and not any(ch in text[1:-1] for ch in _TUPLE_CHARS):
        return [part.strip() for part in text[1:-1].split(",")]
    return [text]


def equal_as_expressions(truth: str, given: str) -> bool:
    """True when truth - given simplifies to 0; False when either is not a small arithmetic expression."""
    expr = f"({truth})-({given})"
    if len(expr) > _MAX_LENGTH or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    if len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}) > 2:
        return False
    try:
        tree = ast.parse(_python_syntax(expr), mode="eval")
        import sympy

        return sympy.simplify(_to_sympy(tree.body, sympy)) == 0
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError):
        return False


def _python_syntax(expr: str) -> str:
    """`^` as `**`, implicit products made explicit (`2x`, `x(y)`, `)(`, `xy`), words split into letters."""
    tokens = re.findall(r"sqrt|pi|\d+\.?\d*|\.\d+|[a-z]|\*\*|[-+*/^()]|\S", expr)
    out: list[str] = []
    for token in tokens:
        token = "**" if token == "^" else token
        if out and _ends_operand(out[-1]) and _starts_operand(token):
            out.append("*")
        out.append(token)
    return "".join(out)


def _ends_operand(token: str) -> bool:
    return token == ")" or token == "pi" or token[0].isdigit() or token[0] == "." or (len(token) == 1 and token.isalpha())


def _starts_operand(token: str) -> bool:
    return token in ("(", "sqrt", "pi") or token[0].isdigit() or token[0] == "." or (len(token) == 1 and token.isalpha())


def _to_sympy(node: ast.AST, sympy):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sympy.Rational(repr(node.value)) if isinstance(node.value, float) else sympy.Integer(node.value)
    if isinstance(node, ast.Name):
        return sympy.pi if node.id == "pi" else sympy.Symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _to_sympy(node.operand, sympy)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _to_sympy(node.left, sympy), _to_sympy(node.right, sympy)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right
        if isinstance(node.op, ast.Pow) and (right.is_Symbol or (right.is_Integer and abs(right) <= _MAX_EXPONENT)):
            return left ** right
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt" \
            and len(node.args) == 1 and not node.keywords:
        return sympy.sqrt(_to_sympy(node.args[0], sympy))
    raise ValueError(f"not an arithmetic expression: {ast.dump(node)[:80]}")
