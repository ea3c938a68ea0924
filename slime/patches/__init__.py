"""Runtime patches of third-party libraries, one module per library.

`apply_all()` is the single entry point. The THD RoPE patch (no host-device sync per layer), grad
clipping's norm (no sync per parameter), MLA's TransformerEngine check, the MoE router's missing TE
name (where TE is absent) and its padding mask, the MoE dispatcher's identity re-sort at EP1 (skipped)
and its sync-free permute, the distributed optimizer's batched copies and the save's in-process results queue
apply on every machine; the rest only where a library cannot run as designed (no CUDA), so cluster runs execute
upstream code apart from those.
"""


def apply_all() -> None:
    """Apply every patch this machine needs. Idempotent; call before building a model."""
    import torch  # here, not at the top: slime.patches.ray is imported by processes that never load torch

    from slime.patches import megatron_core

    megatron_core.apply_thd_rope()
    megatron_core.apply_grad_norm_without_host_sync()
    megatron_core.apply_mla_without_te()
    megatron_core.define_missing_te_gemm()
    megatron_core.apply_te_version_checks_without_te()
    megatron_core.apply_hybrid_optimizer_state_devices()
    megatron_core.apply_fresh_optimizer_state_dict()
    megatron_core.apply_moe_identity_sort()
    megatron_core.apply_router_padding_mask()
    megatron_core.apply_batched_optimizer_copies()
    megatron_core.apply_permute_without_host_sync()
    megatron_core.apply_in_process_save_results()
    if not torch.cuda.is_available():
        megatron_core.apply()
