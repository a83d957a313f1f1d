#!/usr/bin/env bash
# Puts llama.cpp's HF -> GGUF converter into the runtime, from the llama-cpp-python sdist (hash-checked), compiling
# nothing: <venv>/share/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/}. Usage: bash llamacpp.post.sh <venv>
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
DEST="$VENV/share/llama.cpp"
rm -rf "$DEST" && mkdir -p "$DEST"
tar -xzf "$TMP/llama_cpp_python-$SDIST_VERSION.tar.gz" -C "$TMP" --wildcards \
  "*/vendor/llama.cpp/convert_hf_to_gguf.py" "*/vendor/llama.cpp/conversion/*" "*/vendor/llama.cpp/gguf-py/*" \
  "*/vendor/llama.cpp/LICENSE"
cp -r "$TMP/llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp/." "$DEST/"
echo "llama-cpp-python $SDIST_VERSION" > "$DEST/VERSION"
# Fail the build here, not at export time.
"$VENV/bin/python" "$DEST/convert_hf_to_gguf.py" --help >/dev/null
"$VENV/bin/python" -c 'import transformers, torch; print("llamacpp: transformers", transformers.__version__, "torch", torch.__version__)'
