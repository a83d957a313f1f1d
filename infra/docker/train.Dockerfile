# Training image for GPU clusters: Megatron-Core pretraining, DeepSpeed ZeRO fine-tuning and TRL, plus baton itself.
# NVIDIA's PyTorch image brings CUDA, NCCL, Transformer Engine and apex; baton adds its pinned engines on top.
# Build: docker build -f infra/docker/train.Dockerfile -t baton-train .
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORKDIR /opt/baton
COPY infra/runtimes/main.txt /tmp/main.txt
# Keep the image's CUDA torch: install everything else from the pinned list.
RUN grep -v '^torch==' /tmp/main.txt > /tmp/main-gpu.txt \
 && pip install --no-cache-dir -r /tmp/main-gpu.txt \
 && pip install --no-cache-dir "megatron-core[mlm]==0.16.1"
COPY . /opt/baton
ENV PYTHONPATH=/opt/baton
# Workers run as e.g. `torchrun --nproc-per-node 8 tasks/pretrain/worker.py ...` (Slurm: srun per node; Kubernetes:
# a PyTorchJob / JobSet whose pods run this image).
CMD ["python", "-m", "flows.cli", "--help"]
