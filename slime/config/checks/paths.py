"""Checks of what the flags point at, before Ray starts: files, directories, prompt rows and hook
functions and ``--spec`` (named in one line when their module raises at import).
"""

from __future__ import annotations

import argparse
import os
import traceback

from slime.config.constants import DEFAULT_DATA_SOURCE_PATH, DEFAULT_ROLLOUT_FUNCTION_PATH, FUNCTION_PATH_FLAGS
from slime.config.errors import MissingPathError, fail, require_path
from slime.config.launch import HF_CONFIG_FILE, check_hf_config
from slime.models.registry import spec_plugins
from slime.utils.misc import load_function, module_is_findable


def check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.hf_checkpoint is not None:
        require_path("--hf-checkpoint", args.hf_checkpoint, "directory")
        config_path = os.path.join(args.hf_checkpoint, HF_CONFIG_FILE)
        if os.path.isfile(config_path):  # its absence is check_launch_inputs' to name
            check_hf_config(args, config_path)
    if args.prompt_data is not None and not args.debug_train_only:
        require_path("--prompt-data", args.prompt_data, "file")
        if args.data_source_path == DEFAULT_DATA_SOURCE_PATH:
            _check_prompt_rows(args.prompt_data, "--prompt-data", args.input_key, args.label_key)
    eval_flag = "--eval-config" if args.eval_config else "--eval-prompt-data"
    for spec in args.eval_datasets:
        require_path(f"{eval_flag} {spec.name}", spec.path, "file")
        if args.eval_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:  # the keys as eval_prompt_specs reads them
            _check_prompt_rows(spec.path, f"{eval_flag} {spec.name}",
                               spec.input_key or args.eval_input_key or args.input_key,
                               spec.label_key or args.eval_label_key or args.label_key)
    if args.load_debug_rollout_data is not None:
        path = args.load_debug_rollout_data
        if "{rollout_id}" in path:  # a per-rollout template: its directory must exist
            require_path("--load-debug-rollout-data", os.path.dirname(path) or ".", "directory")
        else:
            require_path("--load-debug-rollout-data", path, "file")
    if args.ref_load is not None and (args.use_kl_loss or args.kl_coef != 0):
        require_path("--ref-load", args.ref_load, "checkpoint")
    for flag in (*FUNCTION_PATH_FLAGS, "--rollout-sample-hook-path"):
        dest = parser._option_string_actions[flag].dest
        value = getattr(args, dest)
        if value is None or value == parser.get_default(dest):
            continue
        for path in value if isinstance(value, list) else [value]:
            check_hook_path(flag, path)


# Upstream's layer-spec plug-ins whose layers this project does not have (a --spec naming one is refused).
UNSUPPORTED_SPEC_MODULES: dict[str, str] = {}


def check_spec(args: argparse.Namespace) -> None:
    """--spec MODULE FUNCTION must name a function now, not when the training ranks build the model."""
    if not args.spec:
        return
    module, function = args.spec
    if module in UNSUPPORTED_SPEC_MODULES:
        fail(f"--spec {module} {function} is not supported here: {UNSUPPORTED_SPEC_MODULES[module]}; the layer "
             "specs here are the built-in ones (dense, MoE, MLA, hybrid from the HF config) and the model families' "
             f"plug-ins: {', '.join(spec_plugins())} (docs/model-families.md)")
    check_hook_path("--spec", f"{module}.{function}")


def _check_prompt_rows(path: str, flag: str, input_key: str, label_key: str | None) -> None:
    """A JSONL prompt file: every line a JSON object holding --input-key (and --label-key when set); the first
    bad line is named by file and line number. Parquet files are checked when the data source loads them."""
    from slime.rollout.prompt_rows import check_prompt_rows

    try:
        check_prompt_rows(path, flag, input_key, label_key)
    except ValueError as exc:
        fail(str(exc))


def check_hook_path(flag: str, path: str) -> None:
    """A hook must resolve to a callable now, not in a Ray actor minutes after start-up."""
    try:
        findable = module_is_findable(path)
    except ValueError as exc:  # not of the form pkg.module.func / file.py:func
        fail(f"{flag}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a parent package that raised while it was imported
        fail(f"{flag}: importing the module of {path!r} failed: {import_failure(exc)}")
    if not findable:
        raise MissingPathError(f"{flag}: cannot find the module of {path!r} (expected 'pkg.module.func' or "
                               f"'file.py:func'); {missing_module_hint(path)}")
    try:
        hook = load_function(path)
    except AttributeError as exc:
        fail(f"{flag}: {exc}")
    except Exception as exc:  # noqa: BLE001 - whatever the module raised at import: one line, no traceback
        fail(f"{flag}: importing the module of {path!r} failed: {import_failure(exc)}")
    if not callable(hook):
        fail(f"{flag}: {path!r} is a value of type {type(hook).__name__}, not a function or class")


# Top-level packages of upstream slime's tree that plug-in paths name (examples.search-r1..., slime_plugins...).
UPSTREAM_PLUGIN_PACKAGES = ("examples", "slime_plugins")


def missing_module_hint(path: str) -> str:
    """What to do about a hook module that is not on the import path: a module of upstream's tree needs
    upstream's root on PYTHONPATH (its launchers ran from there); any other, the directory that holds it."""
    if path.endswith(".py") or ":" in path or os.sep in path:
        return "no such file"
    top = path.split(".", 1)[0]
    if top == "slime":
        return ("this project's slime package, which replaces upstream's, has no such module: check the name, or, "
                "for a module of upstream's slime, copy its code into a module of your own")
    if top in UPSTREAM_PLUGIN_PACKAGES:
        return (f"{top}.* is a package of upstream slime's tree, importable when upstream's root is on the import "
                "path (its launchers run python from there): run with PYTHONPATH=/path/to/upstream/slime")
    return ("modules are looked up in this project's root, $PYTHONPATH and the installed packages, not in the "
            "directory train.py is run from: add the directory that holds it to PYTHONPATH")


def import_failure(exc: BaseException) -> str:
    """'FILE:LINE: Type: message' of an exception raised while a hook module was imported: the line of the
    hook's own code (or of what it imported) that raised, not the import machinery's."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
              and os.path.abspath(f.filename) != os.path.abspath(__file__)
              and not f.filename.endswith(os.path.join("slime", "utils", "misc.py"))]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"
