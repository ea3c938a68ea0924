"""Upstream slime's launcher shapes parse here, or stop with the registry's reason (or, for a shape whose layout
this project refuses, e.g. an engine over several nodes, its named layout error): never at "unrecognized".

tests/upstream_launchers.json holds this project's own expansion of the flag sets upstream's scripts/*.sh and
examples/**/*.sh pass (model, parallel, MoE/MLA, FP8, MTP, spec plug-ins), with local paths and small batches.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from arg_testing import no_real_sglang, parse_quiet  # noqa: F401 (fixture)
from slime.utils.arguments import build_parser

LAUNCHERS = json.loads(Path(__file__).with_name("upstream_launchers.json").read_text())


def _argv(shape: dict, tmp_path: Path) -> list[str]:
    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "data.jsonl").write_text("")
    text = f"{LAUNCHERS['common']} {shape['argv']}".format(hf=tmp_path / "hf", data=tmp_path / "data.jsonl",
                                                           dir=tmp_path)
    return text.split()


@pytest.mark.parametrize("shape", LAUNCHERS["shapes"], ids=[s["name"] for s in LAUNCHERS["shapes"]])
def test_upstream_launcher_shape_parses_or_is_refused_with_its_reason(shape, tmp_path, capsys):
    try:
        args = parse_quiet(_argv(shape, tmp_path))
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert "unrecognized arguments" not in err, err
        if shape.get("stops_at"):  # a multi-node layout with upstream's node counts that is refused by name
            assert shape["stops_at"] in err, err
            return
        assert shape["may_refuse"], f"{shape['name']} must parse: {err}"
        assert "is not supported here" in err and any(flag in err for flag in shape["may_refuse"]), err
        return
    assert not shape.get("stops_at"), f"{shape['name']} parsed, but must stop at: {shape['stops_at']}"
    if shape["name"] == "glm4-9B":
        assert args.spec == ["slime_plugins.models.glm4", "get_glm_spec"] and args.rotary_interleaved
    if shape["name"] == "uneven-pipeline":
        assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (8, 6)


MULTI_NODE = [s for s in LAUNCHERS["shapes"] if "--colocate" in s["argv"] and "--actor-num-nodes" in s["argv"]]


def _flag(argv: list[str], name: str) -> int:
    return int(argv[len(argv) - 1 - argv[::-1].index(name) + 1])


@pytest.mark.parametrize("shape", MULTI_NODE, ids=[s["name"] for s in MULTI_NODE])
def test_upstream_multi_node_colocated_layout_parses_with_its_node_counts(shape, tmp_path):
    """Upstream's largest colocated launchers (scripts/run-deepseek-r1.sh, run-kimi-k2-*.sh,
    run-glm5-744B-A40B.sh) with their node counts and parallel layouts, engines within a node: PP stages and
    experts spanning nodes parse, and each node's engines get the stages it lacks over weight-update groups."""
    from slime.backends.weight_sync.node_routes import NodeGrid

    argv = _argv(shape, tmp_path)
    at = len(argv) - 1 - argv[::-1].index("--rollout-num-gpus-per-engine")
    argv[at + 1] = str(_flag(argv, "--actor-num-gpus-per-node"))  # one engine a node (upstream's span several)
    args = parse_quiet(argv)
    for name in ("--actor-num-nodes", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
                 "--context-parallel-size", "--tensor-model-parallel-size"):
        assert getattr(args, name[2:].replace("-", "_")) == _flag(argv, name)
    assert args.colocate and args.actor_num_nodes >= 16 and args.pipeline_model_parallel_size > 1
    assert args.rollout_num_gpus == args.actor_num_nodes * args.actor_num_gpus_per_node
    grid = NodeGrid.from_args(args)
    assert grid.stages_span_nodes and grid.nodes == args.actor_num_nodes


def test_refusals_and_no_effect_reasons_come_before_every_unknown_flag(tmp_path, capsys):
    argv = _argv(LAUNCHERS["shapes"][0], tmp_path) + ["--fp8-format", "e4m3", "--deterministic-mode",
                                                      "--q-lora-rnk", "8", "--tensor-paralel-size", "2"]
    with pytest.raises(SystemExit):
        parse_quiet(argv)
    lines = capsys.readouterr().err.splitlines()
    refused = next(i for i, line in enumerate(lines) if "refused: --fp8-format e4m3 is not supported here" in line)
    no_effect = next(i for i, line in enumerate(lines) if "accepted without effect: --deterministic-mode" in line)
    unknown = next(i for i, line in enumerate(lines) if "unrecognized arguments" in line)
    assert refused < unknown and no_effect < unknown
    assert "--q-lora-rnk (did you mean --q-lora-rank" in lines[unknown]
    assert "--tensor-paralel-size (did you mean --tensor-model-parallel-size" in lines[unknown]


def test_upstream_flag_list_is_read_from_the_parser_source_text():
    from slime.tools.upstream_flags import declared_flags, render

    source = ('parser.add_argument("--a-b", type=int)\nparser.add_argument(\n    "--save-hf",\n    "--save-hf-path",\n'
              '    default=None,\n)\nreset_arg(parser, "--lr", type=float)\nparser.add_argument("--a-b")\n'
              'x = "--not-a-flag"\ntemp_parser.add_argument("--debug-train-only", action="store_true")\n')
    assert declared_flags(source) == ["--a-b", "--save-hf", "--save-hf-path", "--lr", "--debug-train-only"]
    lines = Path(__file__).with_name("upstream_slime_flags.txt").read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    flags = [line for line in lines if line.startswith("--")]
    assert re.search(r"at [0-9a-f]{40}\)", header[0]) and len(flags) == len(set(flags)) > 200
    assert render(flags, "c").splitlines()[len(header):] == flags


LAUNCHER_FLAGS = Path(__file__).with_name("upstream_launcher_flags.txt")


def test_every_flag_upstreams_launchers_pass_is_accepted():
    """docs/coming-from-upstream.md's claim over upstream's own scripts/ and examples/ launchers (the list is
    extracted from their text by slime/tools/upstream_launcher_flags.py): each flag is one of this parser's, or a
    --sglang-* name of the supported SGLang releases' launch parser."""
    from slime.utils.sglang_passthrough import PREFIX, SGLangArgumentError, check_known_options

    lines = LAUNCHER_FLAGS.read_text().splitlines()
    assert re.search(r"THUDM/slime at [0-9a-f]{40}$", lines[1]), lines[1]
    listed = {line.split()[0]: line.split(" ", 1)[1] for line in lines if line.startswith("--")}
    assert len(listed) > 200 and {"--use-rope-scaling", "--optimizer-cpu-offload", "--sglang-mem-fraction-static",
                                  "--allgather-cp"} <= set(listed)
    options = set(build_parser()._option_string_actions)
    refused = []
    for flag, where in listed.items():
        if flag in options:
            continue
        try:
            assert flag.startswith(PREFIX)
            check_known_options([(flag, [])])
        except (AssertionError, SGLangArgumentError):
            refused.append(f"{flag} ({where})")
    assert refused == [], refused


def test_launcher_flags_are_read_from_the_train_command_and_the_arrays_it_expands(tmp_path):
    from slime.tools.upstream_launcher_flags import launcher_flags, render

    (tmp_path / "scripts" / "models").mkdir(parents=True)
    (tmp_path / "scripts" / "models" / "m.sh").write_text(
        "MODEL_ARGS=(\n   --num-layers $((A + B))\n   --swiglu  # trailing note\n   # --commented-out\n)\n")
    (tmp_path / "scripts" / "run.sh").write_text(
        'source "$(dirname $0)/models/m.sh"\nray start --head --num-gpus 8\nPERF_ARGS=(\n  --cp-size 2\n'
        '  --cuda-graph-bs 1 $(seq 16 8 64)\n  --after-subshell\n)\nPERF_ARGS+=(--appended)\n'
        'UNUSED_ARGS=(\n  --never-passed\n)\n'
        'ray job submit --address="http://x" -- python3 train.py \\\n   --colocate \\\n   ${MODEL_ARGS[@]} \\\n'
        '   "${PERF_ARGS[@]}"\npython -m sglang.launch_server --model-path /m\n')
    flags = launcher_flags(tmp_path)
    assert sorted(flags) == ["--after-subshell", "--appended", "--colocate", "--cp-size", "--cuda-graph-bs",
                             "--num-layers", "--swiglu"]
    assert flags["--swiglu"] == "scripts/run.sh (via scripts/models/m.sh)" and flags["--colocate"] == "scripts/run.sh"
    assert render(flags, "abc").splitlines()[1].endswith("THUDM/slime at abc")


SPANNING = [s for s in LAUNCHERS["shapes"] if s.get("stops_at") and "GPUs spans" in s["stops_at"]]


@pytest.mark.parametrize("shape", SPANNING, ids=[s["name"] for s in SPANNING])
def test_upstream_engines_larger_than_a_node_parse_and_place_on_gpus_of_their_own(shape, tmp_path):
    """scripts/run-deepseek-r1.sh, run-kimi-k2-*.sh, run-glm5-744B-A40B.sh ask for engines of 16-64 GPUs. As written
    (--colocate) they are refused by name (above); with the engines on GPUs of their own they parse, and on a
    simulated cluster of 8-GPU nodes each engine gets one SGLang process per node: node rank 0 on its first node
    (its URL), the same number of GPUs on each, --nnodes / --node-rank / --dist-init-addr in every launch."""
    from slime.backends.sglang_utils.launcher import EngineNodes, sglang_server_args_for_engine
    from slime.ray.driver.placement import BundleInfo, num_engines, plan_layout, total_bundles, trainer_ranks

    argv = [a for a in _argv(shape, tmp_path) if a != "--colocate"]
    trainer_gpus = _flag(argv, "--actor-num-nodes") * _flag(argv, "--actor-num-gpus-per-node")
    args = parse_quiet(argv + ["--rollout-num-gpus", str(trainer_gpus), "--rollout-backend", "sglang"])
    per_engine, per_node = args.rollout_num_gpus_per_engine, args.num_gpus_per_node
    assert per_engine == _flag(argv, "--rollout-num-gpus-per-engine") > per_node == 8 and not args.colocate
    nodes = total_bundles(args) // per_node
    infos = [BundleInfo(index=i, node_id=f"node{i // per_node:03d}", node_ip=f"10.0.{i // per_node // 256}."
                        f"{i // per_node % 256}", gpu_id=str(i % per_node)) for i in range(nodes * per_node)]
    layout = plan_layout(infos, trainer_ranks=trainer_ranks(args), num_engines=num_engines(args),
                         gpus_per_engine=per_engine, colocate=False)
    trainer_nodes = {b.node_id for b in layout.actor_bundles}
    assert len(layout.engines) == trainer_gpus // per_engine
    for engine in layout.engines:
        assert engine.nnodes == per_engine // per_node and len({p.node_id for p in engine.parts}) == engine.nnodes
        assert all(p.gpu_ids == tuple(str(g) for g in range(per_node)) for p in engine.parts)
        assert trainer_nodes.isdisjoint(p.node_id for p in engine.parts)
        address = f"{engine.node_ip}:29555"
        for part in engine.parts:
            fields = sglang_server_args_for_engine(args, engine.rank, [int(g) for g in part.gpu_ids], nodes=EngineNodes(
                nnodes=engine.nnodes, node_rank=part.node_rank, dist_init_addr=address))
            assert (fields["tp_size"], fields["base_gpu_id"], fields["nnodes"], fields["node_rank"],
                    fields["dist_init_addr"]) == (per_engine, 0, engine.nnodes, part.node_rank, address)
