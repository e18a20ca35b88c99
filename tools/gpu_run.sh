#!/usr/bin/env bash
# On a lent GPU machine (the device tool), one command: unpack whatever bundles the call carried
# (tools/make_device_bundles.sh builds them into .gpu/) into /tmp/site, then run a check with
# its report under $OUT. /tmp/site stays while the machine is warm.
#
#   carry .gpu/fi_full.tar.xz and .gpu/apache_tvm_ffi-*.whl:
#     bash tools/gpu_run.sh check --sections rope,kv_write,overlap,quantized,sampling,profile,decode --batches-1.5b 64
#   carry .gpu/serve_deps.tar.xz and .gpu/nixl13.tar.xz:
#     bash tools/gpu_run.sh nixl && bash tools/gpu_run.sh serve --async-scheduling
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/site
out=${OUT:-/tmp/out}
mkdir -p "$site" "$out"
for wheel in .gpu/*.whl; do
  [ -e "$wheel" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
done
for bundle in .gpu/*.tar.xz; do
  [ -e "$bundle" ] && tar -xJf "$bundle" -C "$site"
done
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
what=$1
shift
case "$what" in
  check) exec python3 tools/gpu_check.py --json "$out/gpu_check.json" "$@" ;;
  nixl) exec python3 tools/nixl_vram_check.py --json "$out/nixl.json" "$@" ;;
  serve) exec python3 tools/gpu_serve_check.py --json "$out/serve.json" "$@" ;;
  *) echo "usage: bash tools/gpu_run.sh check|nixl|serve [args]" >&2; exit 2 ;;
esac
