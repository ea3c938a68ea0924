"""Build the megatron-core GPT model, its DDP wrapper, optimizer and LR scheduler.

Leaf choice is made once here: megatron's local spec with our SP-capable norm and CP/THD-capable
core attention (slime/models; the HF config's family, from slime.models.registry, says what its layers
and TransformerConfig fields are), the path measured on CPU and GPUs; TransformerEngine's spec
only with `--transformer-impl transformer_engine`. Everything above this module is the same on both.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from argparse import Namespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from slime import patches

patches.apply_all()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

from slime.backends.megatron_utils import moe  # noqa: E402
from slime.backends.megatron_utils.adam_kernel import fused_adam_chosen, use_fused_adam  # noqa: E402
from slime.config.layout import virtual_pipeline_size  # noqa: E402
from slime.models import fused_kernels  # noqa: E402
from slime.models.hf_arch import arch_contradictions, hf_arch  # noqa: E402
from slime.models.local_spec import with_attention_window, with_moe_mlp  # noqa: E402
from slime.models.lora import LoraConfig, apply_lora  # noqa: E402
from slime.models.mtp import check_mtp_layers  # noqa: E402
from slime.models.mtp_model import MTPGPTModel, mtp_block_spec  # noqa: E402
from slime.models.registry import family_of  # noqa: E402
from slime.models.sp_norm import SequenceParallelNorm  # noqa: E402
from slime.models.vision_arch import VISION_ATTRIBUTE  # noqa: E402

logger = logging.getLogger(__name__)


# Logit given to padded vocabulary columns: exp() underflows to exactly 0 next to any real
# logit, yet it stays finite so p*log(p) (entropy) is 0, not NaN.
PADDED_VOCAB_LOGIT = -1.0e4


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """Smallest size >= vocab_size divisible by divisible_by * tp (megatron's padding rule)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def model_vocab_size(args: Namespace, hf_config: Any) -> int:
    """The (padded) vocabulary size of the megatron model built from these args
    (--make-vocab-size-divisible-by x --tensor-model-parallel-size)."""
    return padded_vocab_size(hf_config.vocab_size, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by)


def transformer_config_from_hf(hf_config: Any, args: Namespace) -> TransformerConfig:
    """TransformerConfig for an HF config of a registered family (slime/models), with parallelism and
    training knobs from args. fp32 unless args.bf16 (CPU runs use fp32). A flag the HF config contradicts is
    refused (slime.models.hf_arch: the same record and flag map as the pre-Ray check)."""
    arch = hf_arch(hf_config)
    family = family_of(hf_config)
    contradictions = arch_contradictions(arch, args, family)
    if contradictions:
        raise ValueError(contradictions[0].on_rank())
    check_mtp_layers(args.mtp_num_layers, hf_config, family.name, family.mtp_names is not None,
                     args.pipeline_model_parallel_size)
    config_class = MLATransformerConfig if arch.multi_latent_attention else TransformerConfig
    family_fields = dict(arch.family_fields)
    bf16 = bool(args.bf16)
    params_dtype = torch.bfloat16 if bf16 else torch.float32
    moe_fields = {"moe_token_dispatcher_type": "alltoall", **moe.moe_config_fields(hf_config, args)}
    if family_fields.get("dsa_indexer_topk"):  # the indexer's KL loss (megatron-core's fields)
        family_fields = dict(family_fields, dsa_indexer_loss_coeff=float(args.dsa_indexer_loss_coeff),
                             dsa_indexer_use_sparse_loss=bool(args.dsa_indexer_use_sparse_loss))
    # the generic layer (RMSNorm, bias-free SwiGLU); a family's config_fields say otherwise (gpt-oss's biases and
    # clamped gate)
    layer = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                 # megatron's SwiGLU is torch.compile'd (its jit_fuser) with --fused-kernels compile; the other fused
                 # kernels are CUDA-only and TE provides its own on the cluster path. The fused SwiGLU has no clamp
                 # (activation_func_clamp_value, DeepSeek-V4's swiglu_limit).
                 bias_activation_fusion=fused_kernel_impl(args) == "compile"
                 and family_fields.get("activation_func_clamp_value") is None)
    config = config_class(
        **arch.transformer_fields(),
        **{**layer, **family_fields},
        **moe_fields,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        expert_model_parallel_size=args.expert_model_parallel_size,
        calculate_per_token_loss=bool(args.calculate_per_token_loss),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=arch.initializer_range,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # dynamic batches: PP p2p shapes differ per micro-batch (megatron's allgather dispatcher refuses
        # it; moe.py allows that dispatcher only where no rank pair exchanges shapes)
        variable_seq_lengths=moe_fields["moe_token_dispatcher_type"] == "alltoall",
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
    )
    # every layer's kind, for a --spec plug-in that builds them by kind (no TransformerConfig field says it), and
    # every layer's sliding window (None: full attention), which the local layer specs build
    config.hf_layer_kinds = arch.layer_kinds
    config.hf_attention_windows = arch.attention_windows
    # the layer facts no TransformerConfig field holds, for a family's own layers (DeepSeek-V4's)
    config.hf_layer_config = family.layer_config(hf_config) if family.layer_config is not None else None
    if arch.rope.yarn is not None:  # GPTModel's YarnRotaryEmbedding reads them from the config
        for name, value in arch.rope.yarn.megatron_fields().items():
            setattr(config, name, value)
    return config


def fused_kernel_impl(args: Namespace) -> str:
    """"compile" or "eager": what --fused-kernels picks on this machine (slime/models/fused_kernels.py)."""
    choice = args.fused_kernels
    return fused_kernels.resolve(choice, "cuda" if torch.cuda.is_available() else "cpu")


def _use_transformer_engine(args: Namespace) -> bool:
    """The local spec + this project's attention unless TransformerEngine's spec is asked for by name.

    The local path is the one measured on GPUs (benchmarks/RESULTS.md); TransformerEngine's spec is opt-in
    until it has been measured too, even where TransformerEngine is installed (as in slime's own container).
    """
    if args.transformer_impl != "transformer_engine":
        return False
    if not torch.cuda.is_available():
        raise RuntimeError("--transformer-impl transformer_engine needs CUDA; leave it unset on CPU (local spec)")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        raise RuntimeError("--transformer-impl transformer_engine: TransformerEngine is not installed; "
                           "leave the flag unset for the local spec") from None
    logger.warning("--transformer-impl transformer_engine: TransformerEngine's layer spec has not been measured with "
                   "this project's fenced step; the default (local spec + the project's attention) is the measured path")
    return True


def spec_function(args: Namespace, hf_config: Any) -> Callable[..., Any] | None:
    """The layer-spec plug-in: --spec MODULE FUNCTION, else the HF family's own (GLM-4's), else None."""
    spec = args.spec
    if spec:
        module, function = spec
        return getattr(importlib.import_module(module), function)
    return family_of(hf_config).default_spec


def _plugin_spec(function: Callable[..., Any], args: Namespace, config: TransformerConfig, vp_stage: int | None):
    # upstream's two signatures: fn(args, config, vp_stage) and the older fn(args)
    if len(inspect.signature(function).parameters) == 1:
        return function(args)
    return function(args, config, vp_stage)


def _layer_spec(args: Namespace, hf_config: Any, config: TransformerConfig, vp_stage: int | None):
    function = spec_function(args, hf_config)
    transformer_engine = function is None and _use_transformer_engine(args)
    if transformer_engine and not family_of(hf_config).transformer_engine_spec:
        logger.warning("--transformer-impl transformer_engine: TransformerEngine's layer spec does not build %s "
                       "layers; the local spec is built", family_of(hf_config).name)
        transformer_engine = False
    if transformer_engine and config.hf_attention_windows is not None:
        logger.warning("--transformer-impl transformer_engine: the checkpoint has sliding-window layers, which the "
                       "local spec's attention builds; the local spec is built")
        transformer_engine = False
    if transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, \
            get_gpt_layer_with_transformer_engine_spec

        if config.num_moe_experts:
            return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm,
                                                          multi_latent_attention=config.multi_latent_attention)
    if function is not None:
        spec = _plugin_spec(function, args, config, vp_stage)
        if isinstance(spec, TransformerBlockSubmodules):
            return spec
        if not isinstance(spec, ModuleSpec):
            plugin = f"--spec {' '.join(args.spec)}" if args.spec else "the family's layer spec"
            raise TypeError(f"{plugin} returned {type(spec).__name__}; expected a megatron ModuleSpec (one layer) or "
                            "TransformerBlockSubmodules")
        layer_specs = [spec] * get_num_layers_to_build(config, vp_stage=vp_stage)
    elif family_of(hf_config).layer_kinds is not None:
        layer_specs = _hybrid_layer_specs(args, hf_config, config, vp_stage)
    elif config.num_moe_experts:
        dense = family_of(hf_config).layer_spec(config)
        moe.warn_unavailable_kernels(args)
        layer_specs = moe.moe_layer_specs(dense, with_moe_mlp(dense, config, moe.grouped_experts_enabled(args)),
                                           config, vp_stage)
    else:
        dense = family_of(hf_config).layer_spec(config)
        layer_specs = [dense] * get_num_layers_to_build(config, vp_stage=vp_stage)
    # A block spec so the final norm is ours too (the default one refuses SP).
    return TransformerBlockSubmodules(layer_specs=_windowed(layer_specs, config, vp_stage),
                                      layer_norm=SequenceParallelNorm)


def _windowed(layer_specs: list, config: TransformerConfig, vp_stage: int | None) -> list:
    """This stage's layer specs with each sliding layer's key window in its core attention (a --spec plug-in
    with sliding-window layers is refused: slime.models.hf_arch)."""
    windows = config.hf_attention_windows
    if windows is None:
        return layer_specs
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return [with_attention_window(spec, windows[offset + index]) for index, spec in enumerate(layer_specs)]


def _hybrid_layer_specs(args: Namespace, hf_config: Any, config: TransformerConfig, vp_stage: int | None) -> list:
    """This stage's layer specs of a family whose layers differ (ModelFamily.layer_kinds), MoE MLPs where
    the MoE layer pattern says so."""
    family = family_of(hf_config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    specs = [family.layer_spec_at(config, hf_config, layer) for layer in layers]
    if not config.num_moe_experts:
        return specs
    moe.warn_unavailable_kernels(args)
    grouped = moe.grouped_experts_enabled(args)
    return [with_moe_mlp(spec, config, grouped) if config.moe_layer_freq[layer] else spec
            for spec, layer in zip(specs, layers)]


def _mtp_layer_spec(args: Namespace, hf_config: Any, config: TransformerConfig) -> ModuleSpec:
    """The transformer layer of an MTP layer: the family's full-attention layer, with the MoE MLP in an MoE model
    (DeepSeek-V3's, GLM's and Qwen3-Next's MTP layers are MoE layers)."""
    family = family_of(hf_config)
    spec = family.kind_layer_spec(config, "full_attention") if family.layer_kinds else family.layer_spec(config)
    return with_moe_mlp(spec, config, moe.grouped_experts_enabled(args)) if config.num_moe_experts else spec


def _mtp_stage_spec(args: Namespace, hf_config: Any, config: TransformerConfig, vp_stage: int | None
                    ) -> ModuleSpec | None:
    """The MTP block's spec on the stage that builds it (megatron places it on the last pipeline stage), else None."""
    if not mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage):
        return None
    return mtp_block_spec(_mtp_layer_spec(args, hf_config, config), config.mtp_num_layers)


def build_gpt_model(
    args: Namespace, hf_config: Any, pre_process: bool = True, post_process: bool = True,
    vp_stage: int | None = None,
) -> GPTModel:
    """One GPTModel chunk (this PP stage's layers).

    Last stage output: logits [b, s_local, padded_vocab / tp] (vocab-parallel, sequence NOT
    split by SP: the output layer gathers it); padded columns hold PADDED_VOCAB_LOGIT.
    """
    config = transformer_config_from_hf(hf_config, args)
    arch = hf_arch(hf_config)
    model_class, mtp_fields = GPTModel, {}
    vision = getattr(hf_config, VISION_ATTRIBUTE, None)
    if vision is not None:  # the run trains on images: the vision tower in front of the text model
        if config.mtp_num_layers:
            raise ValueError(f"{vision.family} with images: --mtp-num-layers is not built beside the vision tower; "
                             "drop it")
        from slime.models.vision_language import VisionLanguageModel

        model_class, mtp_fields = VisionLanguageModel, dict(vision=vision)
    elif config.mtp_num_layers:
        model_class = MTPGPTModel
        mtp_fields = dict(mtp_block_spec=_mtp_stage_spec(args, hf_config, config, vp_stage),
                          train_mtp=bool(args.enable_mtp_training))
    model = model_class(
        **mtp_fields,
        config=config,
        transformer_layer_spec=_layer_spec(args, hf_config, config, vp_stage),
        vocab_size=model_vocab_size(args, hf_config),
        max_sequence_length=args.max_position_embeddings or arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="yarn" if arch.rope.yarn is not None else "rope",
        rotary_percent=arch.rope.percent,
        rotary_base=int(arch.rope.base),
        rope_scaling=arch.rope.type == "llama3",  # megatron's Llama-3 scaling (its other factors checked: hf_arch)
        rope_scaling_factor=arch.rope.llama3_factor or 8.0,
        vp_stage=vp_stage,
    )
    _mask_padded_vocab(model, hf_config.vocab_size)
    if family_of(hf_config).prepare_model is not None:
        family_of(hf_config).prepare_model(model)
    return model


def _mask_padded_vocab(model: GPTModel, vocab_size: int) -> None:
    """Make padded vocabulary columns impossible tokens, so log-probs and entropy computed over
    the (padded, vocab-parallel) logits equal HF's over the real vocabulary."""
    if not model.post_process or model.vocab_size == vocab_size:
        return
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = model.vocab_size // parallel_state.get_tensor_model_parallel_world_size()
    first_padded = vocab_size - tp_rank * local  # local column index of the first padded token
    if first_padded >= local:
        return  # this TP rank holds no padded columns

    def hook(module, inputs, output):
        logits, bias = output
        is_padded = torch.arange(local, device=logits.device) >= first_padded
        return logits.masked_fill(is_padded, PADDED_VOCAB_LOGIT), bias

    model.output_layer.register_forward_hook(hook)


_PROVIDER_CONTEXT: dict[str, Any] = {}


def model_provider_context() -> tuple[Namespace, Any]:
    """(args, hf_config) of the model being built: what a --custom-model-provider-path function reads
    (upstream providers call megatron.training.get_args(), which megatron-core does not ship)."""
    if not _PROVIDER_CONTEXT:
        raise RuntimeError("model_provider_context() is only available while the model is being built")
    return _PROVIDER_CONTEXT["args"], _PROVIDER_CONTEXT["hf_config"]


def _model_provider(args: Namespace, hf_config: Any):
    """`provider(pre_process, post_process, vp_stage)`: --custom-model-provider-path, else build_gpt_model."""
    path = args.custom_model_provider_path
    if path:
        from slime.utils.misc import load_function

        return load_function(path)
    return lambda pre_process, post_process, vp_stage=None: build_gpt_model(
        args, hf_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def _build_model_chunks(args: Namespace, hf_config: Any) -> list[GPTModel]:
    vpp = virtual_pipeline_size(args)
    stages = range(vpp) if vpp else [None]
    provider = _model_provider(args, hf_config)
    _PROVIDER_CONTEXT.update(args=args, hf_config=hf_config)
    try:
        return [provider(
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        ) for vp_stage in stages]
    finally:
        _PROVIDER_CONTEXT.clear()


def _wrap_ddp(args: Namespace, chunks: list[GPTModel]) -> list[DistributedDataParallel]:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
        overlap_grad_reduce=False,  # grads are reduced in finalize_model_grads, at a known place
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        wrapped.append(DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            # Only the first chunk's buckets may start reducing early (megatron's rule).
            disable_bucketing=index > 0,
        ))
    return wrapped


def _optimizer_config(args: Namespace, config: TransformerConfig) -> OptimizerConfig:
    """megatron's optimizer settings. --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer inside the
    distributed optimizer, its state precision-aware (the fp32 master weights held by it, on the host), the only
    combination whose loads it refreshes (the refusal in slime/config/registries.py says why); without offload,
    --use-precision-aware-optimizer has no effect (it needs TransformerEngine's FusedAdam)."""
    if args.optimizer != "adam":
        raise ValueError(f"--optimizer {args.optimizer} is not supported (adam only)")
    offload = bool(args.optimizer_cpu_offload)
    if offload and not (args.use_precision_aware_optimizer and args.use_distributed_optimizer):
        raise ValueError("--optimizer-cpu-offload needs --use-precision-aware-optimizer and --use-distributed-optimizer")
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=offload and bool(args.overlap_cpu_optimizer_d2h_h2d),
        use_precision_aware_optimizer=offload,
    )


def _lr_scheduler(args: Namespace, optimizer) -> OptimizerParamScheduler:
    total = args.lr_decay_iters or args.train_iters or 10**9
    warmup = args.lr_warmup_iters
    if not warmup and args.lr_warmup_fraction:
        warmup = int(args.lr_warmup_fraction * total)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,  # constant: no flag schedules the weight decay
        end_wd=args.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def freeze_parameters(chunks: list[GPTModel], only_train: list[str] | None, freeze: list[str] | None) -> int:
    """--only-train-params-name-list / --freeze-params-name-list: regexes (re.search) on megatron parameter
    names; frozen parameters get no gradient buffer and no optimizer state. Returns how many were frozen."""
    import re

    if not only_train and not freeze:
        return 0
    frozen = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            matched = any(re.search(p, name) for p in (only_train or freeze))
            if matched != bool(only_train):  # only-train: freeze the unmatched; freeze: the matched
                param.requires_grad_(False)
                frozen += 1
    if not any(p.requires_grad for chunk in chunks for p in chunk.parameters()):
        raise ValueError(f"--only-train-params-name-list {only_train} / --freeze-params-name-list {freeze} leave "
                         "no trainable parameter")
    return frozen


def lora_config(args: Namespace) -> LoraConfig:
    return LoraConfig(targets=tuple(args.lora_target_modules), rank=args.lora_rank, alpha=args.lora_alpha,
                      dropout=args.lora_dropout, seed=args.seed)


def build_model_and_optimizer(args: Namespace, hf_config: Any):
    """(DDP model chunks, megatron optimizer, LR scheduler) for this rank.

    Needs init_model_parallel(args) first. finalize_model_grads is NOT installed on the config:
    the training step calls it once itself (with the per-token denominator when enabled).
    """
    fused_kernels.configure(fused_kernel_impl(args))
    chunks = _build_model_chunks(args, hf_config)
    if args.enable_lora:  # LoRA freezes the base but --only-train-params-name-list (a PP stage may hold none)
        for chunk in chunks:
            apply_lora(chunk, lora_config(args), train_in_full=args.only_train_params_name_list)
    else:
        freeze_parameters(chunks, args.only_train_params_name_list, args.freeze_params_name_list)
    model = _wrap_ddp(args, chunks)
    if args.optimizer_cpu_offload:
        _check_offloadable(chunks)
    optimizer = get_megatron_optimizer(_optimizer_config(args, chunks[0].config), model)
    if fused_adam_chosen(_parameter_device(chunks)):
        use_fused_adam(optimizer, True)
    return model, optimizer, _lr_scheduler(args, optimizer)


def _check_offloadable(chunks: list[GPTModel]) -> None:
    """megatron's distributed optimizer hands the hybrid CPU optimizer a view of each fp32 parameter's shard, which
    a torch optimizer refuses ("can't optimize a non-leaf Tensor"): name such a parameter instead."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad and param.dtype == torch.float32:
                raise ValueError(f"--optimizer-cpu-offload: parameter {name} is trained in fp32; megatron-core's hybrid "
                                 "CPU optimizer holds 16-bit parameters only (train with --bf16)")


def _parameter_device(chunks: list[GPTModel]) -> torch.device:
    return next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
