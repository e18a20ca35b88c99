#!/usr/bin/env bash
# Build the package bundles a lent GPU machine needs, into .gpu/ (git-excluded): that machine
# reaches no package index, has Python 3.12, torch with CUDA 13, grpcio and aiohttp but no Ray,
# NIXL or FlashInfer, and a call carries at most 64 MiB with the working tree.
#
#   bash tools/make_device_bundles.sh            # all three bundles
#
# .gpu/serve_deps.tar.xz  Ray (core only: no Java, RLlib, Serve, Data, Tune, Train, LLM or the
#                         dashboard's web client; binaries stripped), pydantic, llguidance,
#                         protobuf/grpcio at our versions, jsonschema: ~35 MB
# .gpu/nixl13.tar.xz      nixl-cu13 without its expert-parallel extension and headers, stripped: ~16 MB
# .gpu/fi_full.tar.xz     flashinfer-python's files without *.pyc and cake_sampling/generated,
#                         plus the apache-tvm-ffi wheel beside it: ~20 MB
#
# On the machine (carry the bundles a command needs; serve_deps + nixl13 fit one call, FlashInfer
# another; /tmp/site stays while the machine is warm):
#   mkdir -p /tmp/site && for b in .gpu/serve_deps.tar.xz .gpu/nixl13.tar.xz; do tar -xJf $b -C /tmp/site; done
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
#   python3 tools/nixl_vram_check.py --json $OUT/nixl.json; python3 tools/gpu_serve_check.py --json $OUT/serve.json
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

download() {  # wheels for CPython 3.12 on manylinux x86-64, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" "$@"
}

download ray==2.60.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 llguidance==1.9.1 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
mkdir "$work/serve"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/serve"; done
(cd "$work/serve/ray" && rm -rf jars rllib llm tune train serve data dashboard/client)
strip --strip-unneeded "$work/serve/ray/_raylet.so" "$work/serve/ray/core/src/ray/gcs/gcs_server" "$work/serve/ray/core/src/ray/raylet/raylet"
find "$work/serve" -name __pycache__ -prune -exec rm -rf {} +
tar -cJf .gpu/serve_deps.tar.xz -C "$work/serve" .

download nixl-cu13==1.5.1
mkdir "$work/nixl"
unzip -q "$work"/wheels/nixl_cu13-*.whl -d "$work/nixl"
rm -rf "$work/nixl/nixl_ep_cu13" "$work/nixl"/nixl_cu13-*.data/headers "$work/nixl/nixl_cu13.scripts"
find "$work/nixl" -name "*.so*" -type f -exec strip --strip-unneeded {} +
tar -cJf .gpu/nixl13.tar.xz -C "$work/nixl" .

download flashinfer-python==0.7.2 apache-tvm-ffi==0.1.15.post2
mkdir "$work/fi"
unzip -q "$work"/wheels/flashinfer_python-*.whl -d "$work/fi"
find "$work/fi" -name "*.pyc" -delete
rm -rf "$work/fi/flashinfer/cake_sampling/generated"
tar -cJf .gpu/fi_full.tar.xz -C "$work/fi" .
cp "$work"/wheels/apache_tvm_ffi-*.whl .gpu/
ls -la .gpu
