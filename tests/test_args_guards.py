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


SUB_CONFIGS = ("RunConfig", "LossConfig", "ValueLossConfig", "GroupSettings", "HealthConfig", "HealingPolicy",
               "DeltaOptions", "DeadlineModel")
"""The run config and its sub-configs (slime/config/run_config.py): built from the flags in slime/config alone."""
BUILDERS = ("build_run_config", "build_loss_config", "build_value_loss_config", "build_group_settings",
            "build_health_config", "build_healing_policy", "build_delta_options")


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def sub_configs_built(tree: ast.AST) -> list[tuple[int, str]]:
    """A sub-config made outside the builder: a builder called, a ``from_args`` of one, or one defined anew."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in SUB_CONFIGS:
            found.append((node.lineno, f"class {node.name}"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if _called_name(node) in BUILDERS or (isinstance(func, ast.Attribute) and func.attr == "from_args"
                                              and isinstance(func.value, ast.Name) and func.value.id in SUB_CONFIGS):
            found.append((node.lineno, ast.unparse(func)))
    return found


RUN_STATE_READERS = ("run_state_of", "advance")


def run_state_on_args(tree: ast.AST) -> list[tuple[int, str]]:
    """The run state read from (or replaced on) ``args``: the driver's alone; an actor has its own argument."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) in RUN_STATE_READERS:
            found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, ast.Attribute) and node.attr == "run_state" and _is_args(node.value):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_sub_config_and_run_state_scanners_see_what_they_refuse():
    built = ("a = LossConfig.from_args(args)\nb = build_loss_config(args)\nc = cfg.build_health_config(args, d)\n"
             "class HealthConfig: pass\ne = DeadlineModel.from_args(args)\n")
    assert sorted(line for line, _ in sub_configs_built(ast.parse(built))) == [1, 2, 3, 4, 5]
    assert sub_configs_built(ast.parse("a = run_loss(args)\nb = NodeGrid.from_args(args)\nc = args.run_config.loss\n"
                                       "d = HealthConfig(timeout_s=1.0)\n")) == []
    read = "a = run_state_of(args)\nb = advance(args, x=1)\nc = self.args.run_state\nd = args.run_state.ledger_dir\n"
    assert [line for line, _ in run_state_on_args(ast.parse(read))] == [1, 2, 3, 4]
    assert run_state_on_args(ast.parse("a = self.run_state.spans_nodes\nb = run_state.router_ip\n")) == []


def test_sub_configs_are_built_in_the_config_room_alone():
    """Each component takes its sub-config from the run config parse_args built (the critic's by the same builder,
    in slime/config/critic_role.py): one that derived it again from the flags could read another value than the
    run's (a flag a later step changed, a default). The deadline module defines its model beside the limits it
    derives (slime/utils/deadlines.py: run_deadlines, the run config's, or for arguments without a command line
    the model of their flags)."""
    deadline_module = "slime/utils/deadlines.py:"
    assert [hit for hit in _scan(sub_configs_built) if not hit.startswith(deadline_module)] == []


def test_only_the_driver_keeps_the_run_state_on_args():
    """The trainer ranks, the critic, the rollout manager and the engines receive the run state as an argument
    (their args come without it: run_state.actor_args); reading it from args there would fall back to the flags'
    initial state, silently (no restart count, no node hosts, no router)."""
    driver = ("slime/ray/driver/",)
    assert [hit for hit in _scan(run_state_on_args) if not hit.startswith(driver)] == []


def test_upstreams_published_names_are_written_in_one_place():
    """args.start_rollout_id, num_rollout, sglang_router_ip and sglang_router_port (upstream's plug-ins read them)
    are written by run_state.publish alone, in slime/config too."""
    from slime.config.run_state import PUBLISHED

    published = set(PUBLISHED.values())
    hits = []
    for path in sorted((REPO / "slime" / "config").rglob("*.py")):
        if path.name == "run_state.py":
            continue
        for line, text in writes_into_args(ast.parse(path.read_text())):
            if any(f".{name}" in text or f"'{name}'" in text or f'"{name}"' in text for name in published):
                hits.append(f"{path.relative_to(REPO)}:{line}: {text}")
    assert hits == []
