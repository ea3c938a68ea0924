"""MiMo (XiaomiMiMo/MiMo-7B, model_type "mimo"): Qwen2's decoder (bias on q/k/v) plus multi-token-prediction layers
under `model.mtp_layers.` (mtp.py). transformers ships no MiMo class; the names are those of the released
checkpoints' modeling_mimo.py, whose main model is Qwen2's (so is its config class)."""

from slime.models.hf_arch import sliding_windows
from slime.models.hf_fields import built, table
from slime.models.mtp import mimo_names
from slime.models.qwen import QWEN2_FIELDS
from slime.models.registry import ModelFamily, register

MIMO = register(ModelFamily(
    name="MiMo", model_types=("mimo",), hf_config_types={"mimo": "qwen2"}, qkv_bias=True, mtp_names=mimo_names,
    hf_fields=table(QWEN2_FIELDS, num_nextn_predict_layers=built("the MTP layers (--mtp-num-layers must agree)")),
    attention_windows=sliding_windows))
