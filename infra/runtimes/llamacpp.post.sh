#!/usr/bin/env bash
# Puts llama.cpp into the runtime, from the llama-cpp-python sdist (hash-checked): the HF -> GGUF converter
# (<venv>/share/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/}) and two compiled programs,
# <venv>/bin/llama-quantize (k-quants) and <venv>/bin/llama-server (serve.engine llamacpp), built from its
# vendor/llama.cpp once per runtime digest. Usage: bash llamacpp.post.sh <venv>
# (--no-binary for the sdist alone: its build backend, fetched to read its metadata, comes as wheels; with :all: pip
# builds that backend and its own backends from source, minutes.)
set -euo pipefail
VENV="$1"
SDIST_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "llama-cpp-python==$SDIST_VERSION --hash=sha256:$SDIST_SHA256" > "$TMP/req.txt"
"$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python --require-hashes -r "$TMP/req.txt" -d "$TMP"
tar -xzf "$TMP/llama_cpp_python-$SDIST_VERSION.tar.gz" -C "$TMP" --wildcards "*/vendor/llama.cpp/*"
SRC="$TMP/llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp"
DEST="$VENV/share/llama.cpp"
rm -rf "$DEST" && mkdir -p "$DEST"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$SRC/LICENSE" "$DEST/"
echo "llama-cpp-python $SDIST_VERSION" > "$DEST/VERSION"

# The two programs only, statically linked against llama/ggml: no tests, examples, web UI, HTTPS or downloads.
# GGML_NATIVE off: the default x86-64 build with AVX2/FMA/F16C (not this machine's -march=native), so a cache built
# here runs on CI's machine; ccache off so a cold build is what CI pays (docs/export.md has the time).
t0=$(date +%s)
cmake -S "$SRC" -B "$TMP/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
  -DGGML_CCACHE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
ninja -C "$TMP/build" -j "$(nproc)" llama-quantize llama-server >/dev/null
install -m 0755 "$TMP/build/bin/llama-quantize" "$TMP/build/bin/llama-server" "$VENV/bin/"
echo "llamacpp: llama-quantize and llama-server built in $(( $(date +%s) - t0 ))s"
# Fail the build here, not at export or serve time.
"$VENV/bin/python" "$DEST/convert_hf_to_gguf.py" --help >/dev/null
"$VENV/bin/llama-server" --version
"$VENV/bin/llama-quantize" --help >/dev/null 2>&1 || [ $? -eq 1 ]  # its usage exits 1
"$VENV/bin/python" -c 'import transformers, torch; print("llamacpp: transformers", transformers.__version__, "torch", torch.__version__)'
