"""Checks and derived values of the model: what the builder builds (norm, position embedding), the
shape against TP and the pipeline split of the layers.
"""

from __future__ import annotations

import argparse

from slime.config.constants import BUILT_NORMALIZATION, BUILT_POSITION_EMBEDDING
from slime.config.errors import derive, fail, flag_name
from slime.models.registry import model_names


def resolve_architecture_kinds(args: argparse.Namespace) -> None:
    """--normalization / --position-embedding-type describe the model: a value the builder would not build is
    refused; left out, they say what it builds (plug-ins read them)."""
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in (None, BUILT_POSITION_EMBEDDING):
            fail(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                 f"{args.position_embedding_type}; drop one")
        args.position_embedding_type = BUILT_POSITION_EMBEDDING
    if args.normalization not in (None, BUILT_NORMALIZATION):
        fail(f"--normalization {args.normalization}: the model builder builds {BUILT_NORMALIZATION} layers only "
             f"(the norm of every supported family's HF config); pass --normalization {BUILT_NORMALIZATION} or "
             "drop the flag")
    if args.position_embedding_type not in (None, BUILT_POSITION_EMBEDDING):
        fail(f"--position-embedding-type {args.position_embedding_type}: the model builder builds rotary position "
             f"embeddings (RoPE, from the HF config's rope parameters) only; pass --position-embedding-type "
             f"{BUILT_POSITION_EMBEDDING} or drop the flag")
    if args.normalization is None:
        derive(args, "normalization", BUILT_NORMALIZATION, "what the model builder builds")
    if args.position_embedding_type is None:
        derive(args, "position_embedding_type", BUILT_POSITION_EMBEDDING, "what the model builder builds")


def resolve_model_defaults(args: argparse.Namespace) -> None:
    resolve_architecture_kinds(args)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.bf16 and args.fp16:
        fail("--bf16 and --fp16 are mutually exclusive; pass one")
    if args.eps_clip_high is None:
        derive(args, "eps_clip_high", args.eps_clip, f"--eps-clip {args.eps_clip}")
    if args.padded_vocab_size is not None and args.vocab_size is not None and args.padded_vocab_size < args.vocab_size:
        fail(f"--padded-vocab-size {args.padded_vocab_size} is smaller than --vocab-size {args.vocab_size}")
    if args.model_name is not None and args.model_name.lower() not in model_names():
        fail(f"--model-name {args.model_name} is not supported; the model builder converts {', '.join(model_names())}")


def check_mtp(args: argparse.Namespace) -> None:
    """Multi-token prediction: --enable-mtp-training trains the layers --mtp-num-layers builds. Context parallelism
    works (the MTP layers' shifted tokens come with the packed batch), and so does pipeline parallelism (the MTP
    layers sit on the last stage beside a copy of the embedding, kept equal to the first stage's by the step's
    embedding-group grad all-reduce)."""
    layers = args.mtp_num_layers
    if args.enable_mtp_training and not layers:
        fail("--enable-mtp-training trains the multi-token-prediction layers --mtp-num-layers builds; pass "
             "--mtp-num-layers N (the checkpoint's num_nextn_predict_layers)")
    if layers is None:
        return
    if layers < 1:
        fail(f"--mtp-num-layers {layers} must be >= 1 (drop it for none)")
    for dest in ("use_routing_replay", "use_rollout_routing_replay"):
        if getattr(args, dest):
            fail(f"--mtp-num-layers {layers} with {flag_name(dest)} is not supported here: the replayed routes cover "
                 "the decoder's MoE layers, not the MTP layers' routers; drop one of them")


def check_recompute(args: argparse.Namespace) -> None:
    """--recompute-granularity full re-runs groups of --recompute-num-layers layers, chosen by --recompute-method:
    megatron-core refuses it without both (on the ranks, after Ray started), so the parser names them here."""
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        fail("--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers N "
             "(the layers re-run together)")


def check_model_shape(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads is not None and args.num_attention_heads % tp:
        fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.group_query_attention and args.num_query_groups is not None:
        if args.num_attention_heads is not None and args.num_attention_heads % args.num_query_groups:
            fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups "
                 f"{args.num_query_groups}")
        if args.num_query_groups % tp:
            fail(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    check_pipeline_layers(args)


def check_pipeline_layers(args: argparse.Namespace) -> None:
    """The layers the middle stages split evenly: --num-layers minus the first/last stage's own counts."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if (first is not None or last is not None) and pp == 1:
        fail("--decoder-first/last-pipeline-num-layers set the layers of pipeline stages: add "
             "--pipeline-model-parallel-size > 1 or drop them")
    if layers is None:
        return
    middle, stages = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if middle < 0 or (stages == 0 and middle) or (stages and middle % stages):
        given = " ".join(f"{flag_name(d)} {getattr(args, d)}" for d in
                         ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers") if getattr(args, d))
        fail(f"--num-layers {layers} does not split over --pipeline-model-parallel-size {pp}"
             f"{' with ' + given if given else ''}: the remaining {middle} layers must divide evenly over the "
             f"other {stages} stage(s)")
