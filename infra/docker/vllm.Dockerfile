# GPU serving image for the serve stage's vLLM engine (the CPU path uses infra/runtimes/vllm.txt instead).
#   docker build -f infra/docker/vllm.Dockerfile -t baton-vllm .
#   runtimes: {vllm: {kind: container, image: baton-vllm}}   with serve.device: cuda
# The official image already has the regular `vllm` package (CUDA torch, xgrammar, guidance). baton starts it as
# `python -m vllm.entrypoints.cli.main serve <ckpt> ...`, with the API key in VLLM_API_KEY; mount the checkpoint.
ARG VLLM_VERSION=v0.32.0
FROM vllm/vllm-openai:${VLLM_VERSION}
# baton's `conversions` package: what its workers import for the @@baton event lines.
COPY conversions /opt/baton/conversions
ENV PYTHONPATH=/opt/baton HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.cli.main", "--help"]
