#!/usr/bin/env bash
# SGLang 0.5.23 on CPU (see shared notes sglang-on-cpu.md). Usage: bash sglang.post.sh <venv>
# Re-run automatically when this file or sglang.txt changes; after editing infra/sgl_kernel_stub, bump STUB_REV.
set -euo pipefail
STUB_REV=1
VENV="$1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PIP=("$VENV/bin/python" -m pip install -q --no-deps)
# 1. The engine and the pieces whose declared dependencies are CUDA-only, without those dependencies.
"${PIP[@]}" sglang==0.5.23 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 triton==3.8.0 torchvision==0.28.0
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# 2. torchvision 0.28.0 from PyPI is a CUDA build: its fake-op registrations fail on CPU torch
#    ("operator torchvision::nms does not exist"); transformers imports it, so let that import fail softly.
"$VENV/bin/python" - "$SP/torchvision/__init__.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = ("try:  # baton: CUDA torchvision on CPU torch\n"
       "    from torchvision import _autograd_registrations, _meta_registrations\n"
       "except RuntimeError:\n    pass\nfrom torchvision import (\n")
if "baton: CUDA torchvision" not in src:
    assert old in src, "torchvision/__init__.py changed: update the patch in sglang.post.sh"
    open(path, "w").write(src.replace(old, new, 1))
PY
# 3. The import-only sgl_kernel stand-in (PyPI has no CPU sgl-kernel; see the docstring of infra/sgl_kernel_stub/sgl_kernel/__init__.py).
rm -rf "$SP/sgl_kernel"
cp -r "$HERE/../sgl_kernel_stub/sgl_kernel" "$SP/sgl_kernel"
echo "stub rev $STUB_REV" > "$SP/sgl_kernel/STUB_REV"
# Fail the build here, not at serve time.
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c 'import sglang, sglang.srt.server_args, sglang.srt.entrypoints.http_server, transformers; print("sglang", sglang.__version__, "transformers", transformers.__version__)'
