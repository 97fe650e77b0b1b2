#!/usr/bin/env bash
# Source this on the GPU machine, from the repository root:  source benchmarks/device_setup.sh
# Sourcing it again in a shell that has it (PHLOEM_DEVICE_SETUP=done) does nothing.
# - installs the carried wheels (.whl/: flashinfer-python, apache-tvm-ffi) into /tmp/site;
# - points FlashInfer's JIT at the CUDA toolkit, the curand headers of torch's nvidia wheels and a
#   linkable libcuda, for Hopper only (FLASHINFER_CUDA_ARCH_LIST=9.0a);
# - restores Triton's kernel cache of an earlier run (.tcache/triton.tgz), `triton_pack_cache DIR`
#   tars the current one (with a listing of each kernel's name and compile time, triton_cache.txt);
# - restores modules built by an earlier run (.fiaot/fiaot.tgz) as FlashInfer AOT modules, so
#   nothing recompiles; after a run, `fi_pack_modules DIR` tars the JIT-built modules for reuse.
if [ "${PHLOEM_DEVICE_SETUP:-}" = done ]; then return 0; fi  # sourced already (parallel runs share it)
# Install the carried wheels once per machine: a later call on the same warm machine finds the
# same set installed (marker) and keeps it, so nothing FlashInfer built or restored under
# /tmp/site is overwritten (a reinstall there cost 74-96 s of module rebuilds, 2026-11-26g).
whl_set=$(ls .whl/*.whl | xargs -n1 basename | sort | md5sum | cut -c1-16)
if [ "$(cat /tmp/site/.phloem-wheels 2>/dev/null)" != "$whl_set" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    echo "$whl_set" > /tmp/site/.phloem-wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
if [ -z "${CUDA_HOME:-}" ]; then
    if command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    else CUDA_HOME=/usr/local/cuda; fi
fi
export CUDA_HOME PATH=$CUDA_HOME/bin:$PATH
SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $SITE/nvidia/cu13/include"
libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
if [ -n "$libcuda" ]; then
    mkdir -p /tmp/culib && ln -sf "$libcuda" /tmp/culib/libcuda.so
    export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/culib"
fi
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=${MAX_JOBS:-16}
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws
AOT=/tmp/site/flashinfer/data/aot
mkdir -p "$AOT"
if [ -f .fiaot/fiaot.tgz ]; then tar -xzf .fiaot/fiaot.tgz -C "$AOT" && echo "restored AOT modules: $(ls "$AOT")"; fi
# Triton's compiled kernels from an earlier run (.tcache/triton.tgz, `triton_pack_cache DIR`):
# entries whose kernel source, Triton version or target changed simply miss and recompile.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .tcache/triton.tgz ]; then
    tar -xzf .tcache/triton.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) kernels"
fi
export PHLOEM_DEVICE_SETUP=done
echo "CUDA_HOME=$CUDA_HOME nvcc=$(command -v nvcc) libcuda=$libcuda site=$SITE"

fi_pack_modules() {  # tar every JIT-built module (<name>/<name>.so) plus restored ones into $1
    local jit
    jit=$(python3 -c "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)")
    mkdir -p /tmp/fi_pack
    cp -r "$AOT"/. /tmp/fi_pack/ 2>/dev/null
    for so in "$jit"/*/*.so; do
        [ -f "$so" ] || continue
        name=$(basename "$(dirname "$so")")
        mkdir -p "/tmp/fi_pack/$name" && cp "$so" "/tmp/fi_pack/$name/"
    done
    tar -czf "$1/fiaot.tgz" -C /tmp/fi_pack . && ls -la "$1/fiaot.tgz"
}

triton_pack_cache() {  # tar Triton's cache into $1/triton.tgz; list its kernels (mtime, name)
    find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' -printf '%T@ %f %h\n' | sort -n \
        > "$1/triton_cache.txt"
    tar -czf "$1/triton.tgz" -C "$TRITON_CACHE_DIR" . && ls -la "$1/triton.tgz"
}
