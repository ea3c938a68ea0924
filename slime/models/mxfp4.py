"""MXFP4 checkpoints (config.json `quantization_config.quant_method: "mxfp4"`, gpt-oss's released experts),
dequantised on load.

The format (OCP Microscaling, MXFP4): a weight [..., out, in] is cut along `in` into blocks of 32 values; each value
is a 4-bit E2M1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two
to a byte, the lower nibble first; each block shares one E8M0 scale, a byte holding a power of two with bias 127.
The checkpoint stores `X_blocks` uint8 [..., out, in / 32, 16] and `X_scales` uint8 [..., out, in / 32] in place of
`X`, and its bf16 tensor `X` is the dequantised weight with its last two dimensions swapped ([..., in, out]: how
transformers' gpt-oss experts keep `gate_up_proj` and `down_proj`, and how its bf16 checkpoints store them).

`DequantisedView` makes a checkpoint's tensor list look like the bf16 checkpoint's: `X` in place of its blocks and
scales, read one expert at a time if asked (an expert's rows of the blocks and scales only). Importing this module
needs torch only when a tensor is dequantised.
"""

from __future__ import annotations

from typing import Any, Callable

QUANT_METHOD = "mxfp4"
BLOCK = 32
"""Values per block (one scale each)."""
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 codes of a 4-bit E2M1 value: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa."""
SCALE_BIAS = 127


def is_mxfp4(quantization_config: Any) -> bool:
    """Whether a config's quantization_config says MXFP4 (a dict in config.json, an object in transformers')."""
    if not quantization_config:
        return False
    method = (quantization_config.get("quant_method") if isinstance(quantization_config, dict)
              else getattr(quantization_config, "quant_method", None))
    return str(getattr(method, "value", method)).lower() == QUANT_METHOD


def dequantize(blocks, scales, dtype=None):
    """uint8 blocks [..., G, 16] and scales [..., G] -> the weight [..., G * 32] in `dtype` (default bf16): each
    byte's lower nibble is the earlier value, every value times 2 ** (scale - 127)."""
    import torch

    dtype = dtype or torch.bfloat16
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: blocks are "
                         f"[..., G, {BLOCK // 2}] for scales [..., G]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = table[codes].reshape(*blocks.shape[:-1], BLOCK)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).reshape(*scales.shape[:-1], -1).to(dtype)


def dequantized_weight(blocks, scales, dtype=None):
    """The checkpoint's bf16 tensor of one MXFP4 weight: dequantised, its last two dimensions swapped."""
    return dequantize(blocks, scales, dtype).transpose(-1, -2).contiguous()


class DequantisedView:
    """A checkpoint's tensors as the bf16 checkpoint holds them: every `X` whose `X_blocks` and `X_scales` are
    there, in their place. `read(name, index)` reads a tensor (index: one entry of its first dimension)."""

    def __init__(self, names: list[str], shape: Callable[[str], tuple[int, ...] | None],
                 read: Callable[[str, int | None], Any]):
        self._shape, self._read = shape, read
        self.quantized = {name[: -len(BLOCKS_SUFFIX)] for name in names if name.endswith(BLOCKS_SUFFIX)
                          and name[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in names}
        parts = {n + s for n in self.quantized for s in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
        self._names = [n for n in names if n not in parts] + sorted(self.quantized)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.quantized:
            return self._shape(name)
        *lead, out, groups, _ = self._shape(name + BLOCKS_SUFFIX)
        return (*lead, groups * BLOCK, out)

    def read(self, name: str, index: int | None = None):
        if name not in self.quantized:
            return self._read(name, index)
        return dequantized_weight(self._read(name + BLOCKS_SUFFIX, index), self._read(name + SCALES_SUFFIX, index))


def dequantising_load(model_path: str) -> dict[str, Any]:
    """from_pretrained's keyword arguments that make transformers dequantise an MXFP4 checkpoint to its dtype (it
    does so by itself without Triton's kernels; with them it would keep MXFP4 experts, which a weight push of
    trained bf16 experts cannot update); none for any other checkpoint."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    if not is_mxfp4(config.get("quantization_config")):
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def dequantised_config(config: dict) -> dict:
    """config.json of the bf16 checkpoint written from an MXFP4 one (save-hf): without its quantization_config,
    which would make transformers look for the experts' blocks and scales; any other config as it is."""
    if not is_mxfp4(config.get("quantization_config")):
        return config
    return {key: value for key, value in config.items() if key != "quantization_config"}
