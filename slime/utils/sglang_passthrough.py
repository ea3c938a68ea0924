"""``--sglang-<server-arg>`` passthrough: pull those flags out of argv and map them onto SGLang's ServerArgs.

When sglang is importable, names and value types come from ``ServerArgs.add_cli_args`` (an unknown name is an
error naming it). When it is not (the embedded CPU path, where no SGLang server runs), names are checked against
the launch-parser options of the SGLang releases the project supports (``sglang_server_options.py``, generated
from SGLang's own files): an unknown one is an error with the closest known names, before Ray starts. Values are
then typed by shape (int, float, true/false, else str); the cluster path types them again when it builds
ServerArgs.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
import re
from typing import Any, Sequence

logger = logging.getLogger(__name__)

PREFIX = "--sglang-"

# ServerArgs fields slime sets itself from its own flags; passing them through would contradict those flags.
FIELDS_SET_BY_SLIME: dict[str, str] = {
    "model_path": "--hf-checkpoint",
    "tokenizer_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "host": "--engine-bind-host",
    "port": "the engine launcher",
    "nnodes": "the engine launcher",
    "node_rank": "the engine launcher",
    "dist_init_addr": "the engine launcher",
    "base_gpu_id": "the engine launcher",
    "gpu_id_step": "the engine launcher",
    "nccl_port": "the engine launcher",
    "enable_memory_saver": "--colocate / --offload-rollout",
    "random_seed": "--seed",
    "api_key": "--api-key",
}

# Flags with the --sglang- prefix that belong to slime itself (router/client), never to ServerArgs.
SLIME_OWN_SGLANG_DESTS = frozenset(
    {
        "sglang_router_ip",
        "sglang_router_port",
        "sglang_router_policy",
        "sglang_router_request_timeout_secs",
        "sglang_server_concurrency",
    }
)

_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class SGLangArgumentError(ValueError):
    """A --sglang-* flag that SGLang does not know or that slime sets itself."""


def registered_sglang_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    """--sglang-* option strings the main parser declares itself (they are parsed there, not passed through)."""
    return frozenset(s for s in parser._option_string_actions if s.startswith(PREFIX))


def _is_flag_token(token: str) -> bool:
    return token.startswith("--") or (token.startswith("-") and len(token) > 1 and not _NUMBER.match(token))


def split_passthrough(argv: Sequence[str], registered: frozenset[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Split argv into (argv for the main parser, [(flag, values)] of unregistered --sglang-* flags).

    A passthrough flag takes the following non-flag tokens as its values (none: a boolean switch).
    """
    remaining: list[str] = []
    passthrough: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, has_eq, inline_value = token.partition("=")
        if not flag.startswith(PREFIX) or flag in registered:
            remaining.append(token)
            i += 1
            continue
        values = [inline_value] if has_eq else []
        i += 1
        while not has_eq and i < len(argv) and not _is_flag_token(argv[i]):
            values.append(argv[i])
            i += 1
        passthrough.append((flag, values))
    return remaining, passthrough


@functools.lru_cache(maxsize=1)
def server_args_parser() -> argparse.ArgumentParser | None:
    """A parser holding SGLang's own ServerArgs flags, or None when sglang cannot be imported here."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # noqa: BLE001 - sglang on CPU can fail with ImportError, OSError or RuntimeError
        logger.info("sglang not importable (%s): --sglang-* names are checked against the supported releases' "
                    "launch parser (sglang_server_options.py), values typed by shape", exc)
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        action.required = False  # we parse a subset (e.g. no --model-path)
    return parser


def _coerce_scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def unknown_option_message(flag: str, known: Sequence[str]) -> str:
    """`flag` (a --sglang-* flag) names no known SGLang server argument: say so, with the closest names."""
    option = "--" + flag[len(PREFIX):]
    close = difflib.get_close_matches(option, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(PREFIX + c[2:] for c in close)}?" if close else ""
    return f"{flag}: SGLang has no server argument {option}{hint}"


def check_known_options(passthrough: list[tuple[str, list[str]]]) -> None:
    """Without sglang importable: each passthrough name must be an option of a supported SGLang release."""
    from slime.utils.sglang_server_options import SERVER_OPTIONS, VERSIONS

    unknown = [flag for flag, _ in passthrough if "--" + flag[len(PREFIX):] not in SERVER_OPTIONS]
    if unknown:
        lines = [unknown_option_message(flag, list(SERVER_OPTIONS)) for flag in unknown]
        raise SGLangArgumentError("; ".join(lines) + f" (checked against SGLang {' and '.join(VERSIONS)}'s "
                                  "launch parser)")


def _untyped_values(passthrough: list[tuple[str, list[str]]]) -> dict[str, Any]:
    check_known_options(passthrough)
    result: dict[str, Any] = {}
    for flag, values in passthrough:
        name = flag[len(PREFIX):].replace("-", "_")
        if not values:
            result[name] = True
        elif len(values) == 1:
            result[name] = _coerce_scalar(values[0])
        else:
            result[name] = [_coerce_scalar(v) for v in values]
    return result


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise SGLangArgumentError(message)


def _typed_values(passthrough: list[tuple[str, list[str]]], server_parser: argparse.ArgumentParser) -> dict[str, Any]:
    tokens: list[str] = []
    dests: list[str] = []
    for flag, values in passthrough:
        option = "--" + flag[len(PREFIX):]
        action = server_parser._option_string_actions.get(option)
        if action is None:
            known = [o for o in server_parser._option_string_actions if o.startswith("--")]
            raise SGLangArgumentError(unknown_option_message(flag, known) + " (see sglang's ServerArgs)")
        tokens += [option, *values]
        dests.append(action.dest)
    checker = _RaisingParser(parents=[server_parser], add_help=False, allow_abbrev=False)
    try:
        namespace = checker.parse_args(tokens)
    except SGLangArgumentError as exc:
        raise SGLangArgumentError(f"--sglang-* passthrough: {str(exc).replace('--', PREFIX)}") from None
    return {dest: getattr(namespace, dest) for dest in dests}


def _check_not_set_by_slime(server_args: dict[str, Any]) -> None:
    for name in server_args:
        if name in FIELDS_SET_BY_SLIME:
            raise SGLangArgumentError(
                f"--sglang-{name.replace('_', '-')} is set by slime from {FIELDS_SET_BY_SLIME[name]}; drop it"
            )


def resolve_server_args(args: argparse.Namespace, passthrough: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """ServerArgs overrides the user asked for: passthrough flags plus the declared --sglang-* flags they set.

    slime/config/parse.py's ``apply_sglang_server_args`` keeps them on ``args``.
    """
    server_parser = server_args_parser()
    values = _typed_values(passthrough, server_parser) if server_parser else _untyped_values(passthrough)
    for dest, value in vars(args).items():
        if dest.startswith("sglang_") and dest not in SLIME_OWN_SGLANG_DESTS and value is not None:
            values.setdefault(dest[len("sglang_"):], value)
    _check_not_set_by_slime(values)
    if server_parser is not None:
        try:
            values = apply_renames(values, server_parser)  # e.g. --sglang-cuda-graph-bs on SGLang >= 0.5.20
        except ValueError as exc:
            raise SGLangArgumentError(str(exc)) from None
        unknown = sorted(n for n in values if not any(a.dest == n for a in server_parser._actions))
        if unknown:
            raise SGLangArgumentError(f"SGLang ServerArgs has no field(s) {unknown} (from --sglang-* flags)")
    return dict(sorted(values.items()))


# Old ServerArgs field -> its replacement in newer SGLang (same meaning for what slime passes).
RENAMED_FIELDS: dict[str, str] = {
    "cuda_graph_bs": "cuda_graph_bs_decode",  # --cuda-graph-bs is gone since SGLang 0.5.20
}


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each field's own option (`--x-y` for x_y), not a deprecated alias that happens to share its dest."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings:
            continue
        canonical = "--" + action.dest.replace("_", "-") in action.option_strings
        if canonical or action.dest not in found:
            found[action.dest] = action
    return found


def apply_renames(server_args: dict[str, Any], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Fields the installed SGLang renamed, under their new name; a clear error where neither exists."""
    known = actions_by_dest(parser)
    result: dict[str, Any] = {}
    for name, value in server_args.items():
        new = RENAMED_FIELDS.get(name)
        if name not in known and new is not None:
            if new not in known:
                raise ValueError(f"SGLang here has neither --{name.replace('_', '-')} nor --{new.replace('_', '-')}")
            logger.info("ServerArgs field %s is called %s in this SGLang; passing it as such", name, new)
            name = new
        result[name] = value
    return result
