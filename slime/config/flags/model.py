"""Flags of the model architecture (Megatron names): dense shape, MoE, model-family attention variants
and the other Megatron flags upstream's launchers pass. The model is built from the HF config; these must agree.
"""

from __future__ import annotations

import argparse

from slime.config.constants import ATTENTION_BACKENDS


def add_megatron_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron model", "architecture (Megatron-LM names; must agree with the HF config)")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="width of the residual stream")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="width of the MLP (default 4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, default=None, help="query heads per layer")
    g.add_argument("--group-query-attention", action="store_true", default=False,
                   help="grouped-query attention (fewer key/value heads than query heads)")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default: from the HF config)")
    g.add_argument("--kv-channels", type=int, default=None, help="dimension of each attention head")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="longest sequence the model supports")
    g.add_argument("--position-embedding-type", type=str, default=None,
                   choices=["learned_absolute", "rope", "mrope", "none"],
                   help="kind of position encoding (default: rope, the only one the model builder builds; any "
                        "other is refused)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", default=False,
                   help="older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=None, help="RoPE base frequency (default: from the HF config)")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="share of each head's dimensions rotated by RoPE (default: the HF config's)")
    g.add_argument("--normalization", type=str, default=None, choices=["LayerNorm", "RMSNorm"],
                   help="kind of layer normalisation (default: RMSNorm, the only one the model builder builds; "
                        "LayerNorm is refused)")
    g.add_argument("--norm-epsilon", type=float, default=None, help="epsilon of the norms (default: from the HF config)")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=False,
                   help="norm weights stored as offsets from 1 (zero-centred)")
    g.add_argument("--swiglu", action="store_true", default=False, help="SwiGLU-gated MLP")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no bias in the linear layers")
    g.add_argument("--add-qkv-bias", action="store_true", default=False, help="bias on the query/key/value projection")
    g.add_argument("--qk-layernorm", action="store_true", default=False, help="normalise queries and keys per head")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False,
                   help="separate input embedding and output (LM head) weights")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size before padding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--padded-vocab-size", type=int, default=None, help="explicit padded vocabulary size")
    g.add_argument("--seq-length", type=int, default=None, help="static sequence length (unused with packing)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the random weight initialisation")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout on attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout on the residual branches")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=False,
                   help="compute the attention softmax in fp32")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="do not fuse masking into the softmax kernel")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="do not fuse bias-add and dropout")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion", help="do not fuse RoPE kernels")
    g.add_argument("--attention-backend", type=str, default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention implementation")
    g.add_argument("--transformer-impl", type=str, default=None, choices=["local", "transformer_engine"],
                   help="layer spec (default: local, the path measured on H200s in benchmarks/RESULTS.md; "
                        "transformer_engine is opt-in, warned as unmeasured, and needs CUDA and TransformerEngine)")
    g.add_argument("--fused-kernels", type=str, default="auto", choices=["auto", "compile", "eager"],
                   help="local spec's RMSNorm, RoPE, SwiGLU, the log-prob/entropy head and megatron's own fused "
                        "functions (the attention output gate): compile (torch.compile, one kernel each), eager "
                        "(unfused, the reference), auto (compile on CUDA with Triton, else eager)")
    g.add_argument("--use-flash-attn", action="store_true", default=False, help="older Megatron flash-attention switch")
    g.add_argument("--attention-output-gate", "--use-gated-attention", dest="attention_output_gate",
                   action="store_true", default=False,
                   help="gated attention output (Qwen3-Next)")
    g.add_argument("--qwen-gdn-backend", type=str, default="fla", choices=["fla", "flashqla"],
                   help="kernel of Qwen linear-attention (GDN) layers")
    g.add_argument("--freeze-indexer", action="store_true", default=False,
                   help="keep the DeepSeek-sparse-attention indexer (GLM-5) frozen while the rest trains: what "
                        "happens here unless --dsa-indexer-loss-coeff trains it; refused beside that flag and on a "
                        "checkpoint without an indexer")
    g.add_argument("--allgather-cp", action="store_true", default=False,
                   help="context-parallel attention by all-gathering K/V (what this project always does)")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="multi-token-prediction layers the checkpoint carries (its num_nextn_predict_layers): built, "
                        "loaded and saved; trained only with --enable-mtp-training; never pushed to the engines")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.2, help="weight of the MTP loss (divided over the MTP layers) beside the main loss")
    g.add_argument("--enable-mtp-training", action="store_true", default=False, help="train the --mtp-num-layers layers with the MTP loss beside the main loss")
    g.add_argument("--bf16", action="store_true", default=False, help="bf16 parameters and compute (default fp32)")
    g.add_argument("--fp16", action="store_true", default=False, help="fp16 parameters and compute")
    add_linear_attention_arguments(parser)
    add_sparse_attention_arguments(parser)


def add_sparse_attention_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron sparse attention", "DeepSeek sparse attention (GLM-5): the indexer's "
                                  "shape comes from the HF config; its training loss is megatron-core's")
    g.add_argument("--dsa-indexer-loss-coeff", type=float, default=0.0,
                   help="weight of the indexer's KL loss towards the main attention (megatron-core's); 0: "
                        "the indexer is frozen, as in transformers")
    g.add_argument("--dsa-indexer-use-sparse-loss", action="store_true",
                   help="the indexer's KL loss over the keys it kept only (megatron-core's), not every causal key")


def add_linear_attention_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron linear attention", "gated delta-net layers of Qwen3.5 / Qwen3-Next "
                                  "(the layer pattern and head shapes come from the HF config's layer_types and "
                                  "linear_*; a flag given must agree with it)")
    g.add_argument("--experimental-attention-variant", type=str, default=None, choices=["gated_delta_net", "dsa"],
                   help="megatron's name for the hybrid layers' attention variant (must agree with the HF config)")
    g.add_argument("--linear-attention-freq", type=str, default=None,
                   help="which layers are linear attention: every N-th layer is full attention (an int N), or a "
                        "python list of 1 (linear) / 0 (full) per layer; must agree with the HF layer_types")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=None, help="width of the delta-net's causal conv")
    g.add_argument("--linear-key-head-dim", type=int, default=None, help="key/query head dimension of the delta net")
    g.add_argument("--linear-value-head-dim", type=int, default=None, help="value head dimension of the delta net")
    g.add_argument("--linear-num-key-heads", type=int, default=None, help="key/query heads of the delta net")
    g.add_argument("--linear-num-value-heads", type=int, default=None, help="value heads of the delta net")


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron moe", "mixture of experts (megatron-core's MoE layer; the expert "
                                  "count, top-k and widths come from the HF config, a flag must agree with it)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="MLP width of each expert")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="MLP width of the shared expert")
    g.add_argument("--moe-router-topk", type=int, default=None,
                   help="experts each token is routed to (default: the HF config's num_experts_per_tok)")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], help="expert load-balancing method")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss")
    g.add_argument("--moe-router-score-function", type=str, default=None, choices=["softmax", "sigmoid"],
                   help="router score function (default: the HF config's: softmax for Qwen-MoE, sigmoid for "
                        "DeepSeek-V3); must agree with it")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False, help="softmax before top-k")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="scale of the top-k weights (the HF config's routed_scaling_factor; must agree with it)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="expert groups of group-limited routing (the HF config's n_group; must agree with it)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="expert groups each token may use (the HF config's topk_group; must agree with it)")
    g.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"], help="router precision")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False,
                   help="auxiliary-loss-free balancing bias (DeepSeek-V3's e_score_correction_bias: on whenever the "
                        "HF config has it, refused where it has none)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="update rate of the expert bias after every step (0 keeps the checkpoint's bias)")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="alltoall",
                   choices=["allgather", "alltoall", "flex"],
                   help="how tokens reach their experts (flex: DeepEP where deep_ep is installed on CUDA, otherwise "
                        "alltoall with one warning; the routing is the same)")
    g.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="grouped experts: tokens sorted by expert once, every expert's GEMM in one grouped GEMM "
                        "(torch._grouped_mm for bf16 on Hopper+, else a loop over the same layout; the same "
                        "parameters and numbers as --no-moe-grouped-gemm, megatron's SequentialMLP). Default: on CUDA")
    g.add_argument("--moe-permute-fusion", action="store_true", default=False,
                   help="TransformerEngine's fused token permutation: not used here (a warning says so); tokens are "
                        "permuted once per layer with torch ops and the routing weights applied in the experts' "
                        "activation, same results")
    g.add_argument("--moe-layer-freq", type=str, default=None,
                   help="which layers are MoE (int or python list; default: the HF config's)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="expert capacity factor")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                   help="which tokens an over-full expert drops")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=False,
                   help="pad expert inputs to capacity")
    g.add_argument("--moe-shared-expert-overlap", action="store_true", default=False,
                   help="overlap the shared expert with dispatch")
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=False,
                   help="a sigmoid gate on the shared expert's output (must agree with the HF config: Qwen2-MoE has one)")
    g.add_argument("--moe-enable-deepep", action="store_true", default=False,
                   help="DeepEP's token dispatcher (megatron's flex dispatcher) where deep_ep is installed on CUDA; "
                        "otherwise alltoall with one warning (the routing is the same)")
    g.add_argument("--use-routing-replay", action="store_true", default=False,
                   help="training forwards route each token to the experts the old-policy log-prob pass chose")
    g.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                   help="log-prob and training forwards route each token to the experts the rollout engine chose")
    g.add_argument("--routing-replay-prefetch-microbatches", type=int, default=1,
                   help="micro-batches of routing data prefetched (routes are held in memory whole here)")


def add_model_family_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model families", "layer spec and attention shape (DeepSeek-V3 MLA, GLM-4 post norms); the model is built "
        "from the HF config and a flag given here must agree with it")
    g.add_argument("--spec", type=str, nargs=2, default=None, metavar=("MODULE", "FUNCTION"),
                   help="layer-spec plug-in: MODULE.FUNCTION(args, config, vp_stage) (or FUNCTION(args)) returns a "
                        "megatron ModuleSpec of one layer or a TransformerBlockSubmodules, e.g. "
                        "slime_plugins.models.glm4 get_glm_spec")
    g.add_argument("--multi-latent-attention", action="store_true", default=False,
                   help="multi-latent attention (DeepSeek-V2/V3, Kimi-K2 configs)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA query latent rank (HF q_lora_rank)")
    g.add_argument("--kv-lora-rank", type=int, default=None, help="MLA key/value latent rank (HF kv_lora_rank)")
    g.add_argument("--qk-head-dim", type=int, default=None,
                   help="MLA query/key head dimension without RoPE (HF qk_nope_head_dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=None,
                   help="MLA query/key RoPE head dimension (HF qk_rope_head_dim)")
    g.add_argument("--v-head-dim", type=int, default=None, help="MLA value head dimension (HF v_head_dim)")
    g.add_argument("--rotary-scaling-factor", type=float, default=None,
                   help="RoPE scaling factor (HF rope factor: YaRN's, or Llama-3's with --use-rope-scaling)")
    g.add_argument("--use-rope-scaling", action="store_true", default=False,
                   help="Llama-3.x RoPE scaling (Megatron's flag): read from config.json's rope parameters, so the "
                        "flag is checked against them (rope_type llama3) and refused on any other checkpoint")
    g.add_argument("--mscale", type=float, default=None, help="YaRN attention mscale (HF mscale)")
    g.add_argument("--mscale-all-dim", type=float, default=None, help="YaRN mscale_all_dim (HF mscale_all_dim)")
    g.add_argument("--rotary-interleaved", action="store_true", default=False,
                   help="RoPE rotates interleaved dimension pairs (GLM-4) instead of halves")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False,
                   help="a norm on the self-attention output before the residual add (GLM-4)")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False,
                   help="a norm on the MLP output before the residual add (GLM-4)")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned absolute position embedding (older Megatron spelling)")


def add_upstream_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron (more)", "other Megatron flags upstream's launchers pass")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (the others split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (the others split the rest evenly)")
    g.add_argument("--fp8-format", type=str, default=None, choices=["e4m3", "hybrid"],
                   help="FP8 number format of TransformerEngine's FP8 training")
    g.add_argument("--fp8-recipe", type=str, default=None, choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
                   help="FP8 scaling recipe of TransformerEngine's FP8 training")
    g.add_argument("--enable-experimental", action="store_true", default=False,
                   help="megatron-core's experimental features")
    g.add_argument("--deterministic-mode", action="store_true", default=False,
                   help="deterministic kernels and collectives")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="no fused weight-gradient accumulation kernel")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad", help="do not check the loss and gradients for NaN")
