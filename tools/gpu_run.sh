#!/usr/bin/env bash
# On a lent GPU machine (the device tool), one command: unpack whatever bundles the call carried
# (tools/make_device_bundles.sh builds them into .gpu/) into /tmp/site, then run a check with
# its report under $OUT. /tmp/site stays while the machine is warm.
#
#   carry .gpu/fi_full.tar.xz and .gpu/apache_tvm_ffi-*.whl:
#     bash tools/gpu_run.sh check --sections rope,kv_write,overlap,quantized,sampling,profile,decode --batches-1.5b 64
#   carry .gpu/fi_jit.tar.xz too where an earlier machine exported it (bash tools/gpu_run.sh jit --export $OUT):
#   the kernels in it then need no compiling (bash tools/gpu_run.sh jit builds the others, in parallel).
#   Give every step its own limit (timeout 300 bash tools/gpu_run.sh check ...; jit stops at its
#   --deadline): in session 22 one FlashInfer build (radix top-k, since dropped) ran past 9 minutes,
#   and a command with no limit of its own lost the lease's 15 minutes to it.
#   carry .gpu/serve_deps.tar.xz and .gpu/nixl13.tar.xz:
#     bash tools/gpu_run.sh nixl && bash tools/gpu_run.sh serve
#   on the same warm machine as a FlashInfer call (its files stay in /tmp/site; all the bundles
#   together pass the 64 MiB a call carries): without FlashInfer the served actors attend through
#   SDPA, eagerly (the H200 serve of session 20: TPOT 68 ms; serve.json's "engines" and
#   "flashinfer" say which).
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/site
out=${OUT:-/tmp/out}
mkdir -p "$site" "$out"
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
# Each bundle once per machine (several checks chained in one command share the unpacking).
for wheel in .gpu/*.whl; do
  [ -e "$wheel" ] && [ ! -e "$site/.done-$(basename "$wheel")" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" && touch "$site/.done-$(basename "$wheel")"
done
for bundle in .gpu/*.tar.xz; do
  [ -e "$bundle" ] && [ ! -e "$site/.done-$(basename "$bundle")" ] || continue
  case "$bundle" in
    */fi_jit.tar.xz) continue ;;  # below, once FlashInfer itself is unpacked
    *) tar -xJf "$bundle" -C "$site" ;;
  esac
  touch "$site/.done-$(basename "$bundle")"
done
# FlashInfer's compiled kernels from an earlier machine (gpu_warm_jit.py --export), placed where
# FlashInfer loads ahead-of-time modules (flashinfer/data/aot/NAME/NAME.so) with no build: in its
# JIT cache ninja would rebuild a library that came without its objects and build log.
jit=.gpu/fi_jit.tar.xz
if [ -e "$jit" ] && [ -d "$site/flashinfer" ] && [ ! -e "$site/.done-fi_jit" ]; then
  unpacked=$(mktemp -d)
  tar -xJf "$jit" -C "$unpacked"
  for library in $(find "$unpacked" -name '*.so'); do
    name=$(basename "$library" .so)
    mkdir -p "$site/flashinfer/data/aot/$name" && mv "$library" "$site/flashinfer/data/aot/$name/"
  done
  rm -rf "$unpacked"
  touch "$site/.done-fi_jit"
fi
what=$1
shift
case "$what" in
  check) exec python3 tools/gpu_check.py --json "$out/gpu_check.json" "$@" ;;
  nixl) exec python3 tools/nixl_vram_check.py --json "$out/nixl.json" "$@" ;;
  serve) exec python3 tools/gpu_serve_check.py --json "$out/serve.json" "$@" ;;
  jit) exec python3 tools/gpu_warm_jit.py "$@" ;;
  *) echo "usage: bash tools/gpu_run.sh check|nixl|serve|jit [args]" >&2; exit 2 ;;
esac
