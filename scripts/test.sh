#!/usr/bin/env bash
# All tests, on any machine (no GPU needed). NVRTC comes from PyPI (no CUDA toolkit) so that every
# CUDA kernel is compiled by the tests: a kernel that does not compile fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc_dir="$PWD/target/nvrtc"
if ! ls "$nvrtc_dir"/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$nvrtc_dir" \
    nvidia-cuda-nvrtc==13.0.88 \
    || echo "warning: could not install NVRTC from PyPI; CUDA kernels will not be compiled by this run" >&2
fi
if ls "$nvrtc_dir"/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
  export LD_LIBRARY_PATH="$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DRAMATIS_REQUIRE_NVRTC=1
fi
# A one-off build gains nothing from incremental state, which is a third of a clean build on disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --workspace --locked
# The CUDA build's host code too (the engine's GPU paths are behind the `cuda` feature; cudarc
# loads the driver at run time, so it compiles without a GPU or a CUDA toolkit).
exec cargo check --workspace --all-targets --locked --features dramatis/cuda
