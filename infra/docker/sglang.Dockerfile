# GPU serving image for the serve stage's SGLang engine (the CPU path uses infra/runtimes/sglang.txt, the
# sgl_kernel stub and the torchvision patch instead; none of that is needed here: the real sgl-kernel is CUDA).
#   docker build -f infra/docker/sglang.Dockerfile -t baton-sglang .
#   runtimes: {sglang: {kind: container, image: baton-sglang}}   with serve.device: cuda
# baton starts `python -m sglang.launch_server --model-path <ckpt> ...` and runs tasks/serve/sgl_program.py (the
# frontend-program smoke check) with this image's python; mount the checkpoint.
ARG SGLANG_VERSION=v0.5.23
FROM lmsysorg/sglang:${SGLANG_VERSION}
COPY conversions /opt/baton/conversions
COPY tasks/serve/sgl_program.py /opt/baton/tasks/serve/sgl_program.py
ENV PYTHONPATH=/opt/baton HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["python3", "-m", "sglang.launch_server", "--help"]
