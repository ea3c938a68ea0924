"""The run's arguments are read, never patched, outside slime/config (docs/architecture.md, "The run's config").

After parse_args the namespace holds the flags as checked and the run config built from them; what the run learns
later (placement, hosts, the router's address, the resume position, restarts, the ledger dir) is a RunState
(slime/config/run_state.py), replaced and never mutated. Two ways back to a mutable bag are refused here, read
from the syntax tree:
- `args.x = ...` (or `setattr(args, ...)`) outside slime/config;
- `args.x or <literal>`: a second default beside the parser's, which drifts from it (the router timeout once had
  three); the parser's default, or a finalize step in slime/config, makes the value present.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _product_files():
    for top in ("slime", "slime_plugins"):
        for path in sorted((REPO / top).rglob("*.py")):
            if not path.relative_to(REPO).as_posix().startswith("slime/config/"):
                yield path
    yield from (REPO / "train.py", REPO / "train_async.py")


def _is_args(node: ast.AST) -> bool:
    """`args` or `self.args`: the run's namespace as the product's functions and objects name it."""
    if isinstance(node, ast.Name):
        return node.id == "args"
    return isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _is_args_field(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and _is_args(node.value)


def _is_literal(node: ast.AST) -> bool:
    """A number, string, None or bool; a display of literals ([], {}, (), {"a": 1}); a CONSTANT name."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_literal(k) and _is_literal(v) for k, v in zip(node.keys, node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_literal(node.operand)
    return isinstance(node, ast.Name) and node.id.isupper() and len(node.id) > 1


def _targets(node: ast.AST):
    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield from ast.walk(target)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        yield node.target


def writes_into_args(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if _is_args_field(target) and isinstance(target.ctx, ast.Store):
                found.append((node.lineno, ast.unparse(target)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and _is_args(node.args[0]):
            found.append((node.lineno, ast.unparse(node)))
    return found


def literal_fallbacks(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            for i, value in enumerate(node.values[:-1]):
                if _is_args_field(value) and any(_is_literal(v) for v in node.values[i + 1:]):
                    found.append((node.lineno, ast.unparse(node)))
                    break
    return found


@functools.cache
def _trees() -> tuple[tuple[Path, ast.AST], ...]:
    return tuple((path, ast.parse(path.read_text(), filename=str(path))) for path in _product_files())


def _scan(check) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {text}" for path, tree in _trees() for line, text in check(tree)]


def test_the_scanners_see_what_they_refuse():
    """The scanners themselves: each form they refuse, and the reads they leave alone."""
    refused = "args.x = 1\nself.args.y += 2\nargs.a, b = 1, 2\nsetattr(args, 'z', 3)\n"
    assert [line for line, _ in writes_into_args(ast.parse(refused))] == [1, 2, 3, 4]
    assert writes_into_args(ast.parse("x = args.y\nother.args.z = 1\nargs = make()\nargs[0] = 1\n")) == []
    fallbacks = ("a = args.x or 1\nb = self.args.y or 'k1'\nc = args.z or None\nd = args.w or []\ne = args.v or {}\n"
                 "f = args.u or ()\ng = args.t or args.s or 'input'\nh = args.r or DEFAULT_CONCURRENCY\n"
                 "i = args.q or -1.0\n")
    assert [line for line, _ in literal_fallbacks(ast.parse(fallbacks))] == list(range(1, 10))
    assert literal_fallbacks(ast.parse("a = args.x or args.y\nif args.x or args.y: pass\nb = x or 1\n"
                                       "c = args.x or compute(args)\nd = args.x and 1\n")) == []


def test_no_writes_into_args_outside_the_config_room():
    """Runtime facts go into the RunState (slime/config/run_state.py), flags are fixed by parse_args."""
    assert _scan(writes_into_args) == []


def test_no_literal_fallbacks_on_args_outside_the_config_room():
    """A flag's default is the parser's (or slime/config's finalize step): `args.x or <literal>` is a second one."""
    assert _scan(literal_fallbacks) == []
