"""Write the bf16 checkpoint of an MXFP4 one (gpt-oss's released experts), for engines that must load bf16 experts.

    python -m slime.tools.dequantize_mxfp4 SRC DST

Every `X_blocks` / `X_scales` pair becomes the bf16 tensor `X` (slime/models/mxfp4.py: the transformers layout),
in the shard that held the blocks; every other tensor is copied as it is; config.json loses its
quantization_config; the tokenizer and other small files are copied. SGLang then builds bf16 experts, which the
weight push of the trained experts updates (the trainer dequantises an MXFP4 checkpoint on load by itself).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from slime.models import mxfp4

INDEX = "model.safetensors.index.json"


def _weight_map(src: Path) -> dict[str, str]:
    if (src / INDEX).exists():
        return json.loads((src / INDEX).read_text())["weight_map"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}


def _read(src: Path, weight_map: dict[str, str], name: str):
    with safe_open(str(src / weight_map[name]), framework="pt") as f:
        return f.get_tensor(name)


def dequantize_checkpoint(src: Path, dst: Path) -> list[str]:
    """Write the bf16 checkpoint of `src` to `dst`; the names of the tensors dequantised."""
    config = json.loads((src / "config.json").read_text())
    if not mxfp4.is_mxfp4(config.get("quantization_config")):
        raise SystemExit(f"{src}/config.json has no MXFP4 quantization_config: nothing to dequantise")
    weight_map = _weight_map(src)
    view = mxfp4.DequantisedView(list(weight_map), lambda n: None,
                                 lambda name, index: _read(src, weight_map, name))
    dst.mkdir(parents=True, exist_ok=True)
    new_map = {}
    for shard in sorted(set(weight_map.values())):
        tensors = {}
        for name in (n for n in view.names() if weight_map.get(n, weight_map.get(n + mxfp4.BLOCKS_SUFFIX)) == shard):
            tensors[name] = view.read(name).contiguous()
            new_map[name] = shard
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    if (src / INDEX).exists():
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = dict(sorted(new_map.items()))
        index.get("metadata", {}).pop("total_size", None)
        (dst / INDEX).write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(mxfp4.dequantised_config(config), indent=2))
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in ("config.json", INDEX):
            shutil.copyfile(path, dst / path.name)
    return sorted(view.quantized)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the MXFP4 checkpoint directory")
    parser.add_argument("dst", type=Path, help="where the bf16 checkpoint is written")
    args = parser.parse_args(argv)
    done = dequantize_checkpoint(args.src, args.dst)
    print(f"{args.dst}: {len(done)} MXFP4 tensors written in bf16")


if __name__ == "__main__":
    main()
