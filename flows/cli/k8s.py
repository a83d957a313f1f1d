"""`baton k8s`: Kubernetes manifests for a config's training stages (the rendering is in k8s_manifests)."""
from __future__ import annotations

import sys
from pathlib import Path


def cmd_k8s(args) -> int:
    """Kubernetes manifests for the config's training stages (written, not applied)."""
    from flows.cli.k8s_manifests import Cluster, write_manifests
    from flows.config import ConfigError, load

    try:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        cfg = load(args.config, args.set, stages, host=False)  # the cluster's nodes host the ranks, not this machine
        cluster = Cluster(namespace=args.namespace, volume_claim=args.volume_claim, train_image=args.image_train or "",
                          orchestrator_image=args.image_orchestrator or "")
        written = write_manifests(cfg, Path(args.out or Path("infra") / "k8s" / cfg.name), cluster)
    except ConfigError as e:
        print(f"baton k8s: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def add_parsers(sub) -> None:
    k = sub.add_parser("k8s", help="write Kubernetes manifests (PyTorchJob, JobSet, RayJob, Prefect work pool)")
    k.add_argument("config")
    k.add_argument("--stages", help="comma-separated ordered subset, e.g. pretrain,finetune")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    k.add_argument("--out", help="output folder (default: infra/k8s/<config name>)")
    k.add_argument("--namespace", default="default")
    k.add_argument("--volume-claim", default="baton", help="ReadWriteMany PersistentVolumeClaim mounted at /baton")
    k.add_argument("--image-train", help="training image (default: the name infra/docker/train.Dockerfile builds)")
    k.add_argument("--image-orchestrator",
                   help="image of the Prefect work pool's flow runs (default: the training image)")
    k.set_defaults(fn=cmd_k8s)
