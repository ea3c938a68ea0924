"""MiMo (XiaomiMiMo/MiMo-7B, model_type "mimo"): Qwen2's decoder (bias on q/k/v) plus multi-token-prediction layers
under `model.mtp_layers.` (mtp.py). transformers ships no MiMo class; the names are those of the released
checkpoints' modeling_mimo.py, whose main model is Qwen2's."""

from slime.models.mtp import mimo_names
from slime.models.registry import ModelFamily, register

MIMO = register(ModelFamily(name="MiMo", model_types=("mimo",), qkv_bias=True, mtp_names=mimo_names))
