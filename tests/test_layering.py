"""The house's rooms and the direction of its imports (docs/architecture.md, "Rooms").

A room may import the rooms listed before it in ROOMS, never one after it: the parse-time checks, the trainer
and the rollout side build on the models, and the models on nothing of theirs. Every import counts, one inside
a function too. And no module takes a private name from another package.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Lowest first; each room is a set of module prefixes, and a module belongs to its longest matching prefix.
ROOMS = [
    ("slime",),  # the package itself (empty)
    ("slime.utils",),
    ("slime.algorithms",),  # the estimators and their maths: torch and the leaves above only
    ("slime.config",),  # the flags, their defaults and the parallel layout: read by every room above
    ("slime.distributed",),
    ("slime.checkpoint",),
    ("slime.models",),
    ("slime.patches",),  # runtime patches of megatron-core and Ray, one module per library
    ("slime.router",),
    ("slime.rollout",),
    ("slime.backends.sglang_utils",),  # SGLang's launcher and HTTP client, the engines' wire formats
    # the weight sync, trainer -> engines: plan, transports (full, delta, per node), the proof; the trainer calls it
    ("slime.backends.weight_sync",),
    ("slime.backends",),  # the megatron trainer and the embedded engine
    # the parse-time checks ask the rooms below whether a run's inputs are usable, before Ray starts; the critic's
    # view of the flags asks the checkpoint where the critic resumes
    ("slime.config.checks", "slime.config.validate", "slime.config.launch", "slime.config.parse",
     "slime.config.critic_role"),
    ("slime.ray.common",),  # what every Ray-side process shares: its node, its GPUs, an engine's slot
    # the trainer ranks', the engines' and the rollout manager's processes: they never import the driver's room
    ("slime.ray",),
    ("slime.ray.driver",),  # the driver process: it places, starts and waits on all of the above
    ("slime.utils.arguments",),  # upstream's import path of the parser: re-exports the config room
    ("slime.utils.ppo_utils",),  # upstream's import path of the PPO maths: re-exports slime.algorithms
    ("slime_plugins",),  # upstream's plug-in paths: aliases of slime.models modules
    ("slime.tools",),
]
RANK = {prefix: rank for rank, prefixes in enumerate(ROOMS) for prefix in prefixes}


def _room(module: str) -> str | None:
    matches = [p for p in RANK if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def _modules():
    for top in ("slime", "slime_plugins"):
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, tuple(a.name for a in node.names)


def test_every_module_is_in_a_room():
    assert [m for m, _ in _modules() if _room(m) is None] == []


def _module_graph(prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules it imports (every import, one inside a function too), among modules under prefixes."""
    modules = {module: path for module, path in _modules() if module.startswith(prefixes)}
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        for _, target, names in _imports(path):
            for imported in (target, *(f"{target}.{name}" for name in names)):
                if imported in modules and imported != module:
                    graph[module].add(imported)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the path that closes it (depth first)."""
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                found.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return found


def test_the_weight_sync_and_the_trainer_have_no_import_circle():
    """The weight sync's transports are chosen in one factory above them (a delta push wraps the distributed one),
    so no module of the weight sync or the trainer imports one that imports it back."""
    assert _circles(_module_graph(("slime.backends.weight_sync", "slime.backends.megatron_utils"))) == []


def test_the_circle_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_room_imports_a_room_above_it():
    upward = []
    for module, path in _modules():
        here = _room(module)
        for line, target, _ in _imports(path):
            there = _room(target)
            if there is not None and RANK[there] > RANK[here]:
                upward.append(f"{path.relative_to(REPO)}:{line} ({here}) imports {target} ({there})")
    assert upward == []


def test_no_private_name_crosses_packages():
    crossing = []
    for module, path in _modules():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, target, names in _imports(path):
            if _room(target) is None or target == package or target.startswith(package + "."):
                continue
            crossing += [f"{path.relative_to(REPO)}:{line} imports {n} from {target}" for n in names
                         if n.startswith("_") and not n.startswith("__")]
    assert crossing == []


def test_the_rules_see_an_upward_import_and_a_private_name(tmp_path):
    """The checks above find what they look for: an import of a higher room and a private name."""
    path = tmp_path / "probe.py"
    path.write_text("from slime.ray.driver import session\nfrom slime.rollout.data_source import _hidden\n")
    imports = list(_imports(path))
    assert [RANK[_room(t)] > RANK[_room("slime.models.qwen")] for _, t, _ in imports] == [True, True]
    assert [n for _, _, names in imports for n in names if n.startswith("_")] == ["_hidden"]


def test_the_ray_processes_other_than_the_driver_may_import_the_common_room_never_the_driver():
    """The trainer ranks, the engines and the rollout manager run in processes of their own: what they share is in
    slime/ray/common/, and the driver's modules (cluster, placement, the loop's proxies) are above all of them."""
    driver, common = RANK[_room("slime.ray.driver.placement")], RANK[_room("slime.ray.common.node")]
    for process in ("slime.ray.trainer.rank_actor", "slime.ray.engines.actor", "slime.ray.rollout_manager.manager"):
        assert common < RANK[_room(process)] < driver, process


def test_the_drawing_of_the_rooms_in_the_docs_is_what_the_imports_give_now():
    """docs/architecture.md's drawing and tables are generated from these ROOMS and the imports of today's code."""
    from slime.tools import draw_rooms

    assert draw_rooms.rooms() == [tuple(room) for room in ROOMS]
    assert draw_rooms.main(["--check"]) == 0, "the rooms drawing is stale: run python -m slime.tools.draw_rooms"


def test_the_drawing_names_who_imports_whom():
    """The generated tables follow the imports: the driver reaches the Ray processes' rooms, they never the driver's."""
    from slime.tools import draw_rooms

    rows = {line.split(" | ")[0].strip("| `"): line for line in draw_rooms.render().splitlines() if line.startswith("| ")}
    assert "`slime/ray/`" in rows["slime/ray/driver/"] and "slime/ray/driver/" not in rows["slime/ray/"]
    for process in ("trainer rank", "rollout manager", "engine (Ray actor, embedded engine server)"):
        assert "`slime/ray/common/`" in rows[process] and "slime/ray/driver/" not in rows[process], process
    assert "slime/backends/" not in rows["slime router"]
    assert draw_rooms.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
