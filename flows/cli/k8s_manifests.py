"""`baton k8s CONFIG`: Kubernetes manifests that run the training stages' workers on a cluster.

For each training stage in the config (pretrain, rlhf, finetune), a folder with
- `configmap.yaml`: the files baton writes into the stage folder before it launches the worker (`worker_spec.json`,
  `ds_config.json`, ...), built by the stage's own functions with the cluster's paths, and the resolved `config.yaml`;
- `pytorchjob.yaml` (Kubeflow Training Operator, kubeflow.org/v1) and `jobset.yaml` (jobset.x-k8s.io/v1alpha2): one pod
  per node (`nnodes`), each running `torchrun --nnodes N --nproc-per-node K worker.py ARGS` from the training image,
  node rank and rendezvous from the operator (PyTorchJob's PET_* variables) or the Job's completion index (JobSet);
- `rayjob.yaml` (KubeRay, ray.io/v1): a Ray cluster of `nnodes` nodes whose entrypoint runs the stage with `baton run`
  on the `ray` target (one torchrun per node through a placement group: the same worker, the same arguments).
Plus `prefect-work-pool.json`: prefect-kubernetes' own default base job template for the orchestrator's work pool, with
baton's image, namespace and volume.

The stages share one ReadWriteMany volume (a PersistentVolumeClaim) mounted at `/baton`: a stage works in
`/baton/<config name>/<step label>`, reads the data stage's output from `/baton/<config name>/data` and its input
from the previous step's `checkpoint/` (conversions run between stages as in `baton run`), or from
`/baton/<config name>/input` for the first stage.
"""
from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

import yaml

from conversions.manifest import Format
from flows import chain_planner as planning
from flows.config import ConfigError, PipelineConfig
from tasks import chat_template
from tasks.stage import REPO_ROOT, WORKER_QUIET_ENV, StageContext, training_engine_env
from tasks.registry import TRAINING_STAGES

IMAGE_ROOT = PurePosixPath("/opt/baton")  # WORKDIR of infra/docker/train.Dockerfile: this checkout inside the image
SPEC_DIR = PurePosixPath("/etc/baton")    # the stage's ConfigMap, mounted read-only
MASTER_PORT = 29500
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
MANIFESTS = ("configmap.yaml", "pytorchjob.yaml", "jobset.yaml", "rayjob.yaml")


def dockerfile_images(folder: Path = REPO_ROOT / "infra" / "docker") -> dict[str, str]:
    """Image names as each Dockerfile's build line gives them (`docker build -f X.Dockerfile -t NAME .`)."""
    images = {}
    for f in sorted(folder.glob("*.Dockerfile")):
        m = re.search(r"docker build .*-t (\S+)", f.read_text())
        if m:
            images[f.name.removesuffix(".Dockerfile")] = m.group(1)
    return images


@dataclass(frozen=True)
class Cluster:
    """Where the manifests run. The orchestrator runs baton's flows, so by default it uses the training image too."""

    namespace: str = "default"
    volume_claim: str = "baton"
    mount: str = "/baton"
    train_image: str = ""
    orchestrator_image: str = ""
    shm_size: str = "64Gi"
    interface: str = "eth0"  # the pod network's interface: NCCL and gloo bind to it

    def with_default_images(self) -> "Cluster":
        train = self.train_image or dockerfile_images().get("train", "baton-train")
        return replace(self, train_image=train, orchestrator_image=self.orchestrator_image or train)


@dataclass
class StageJob:
    """One training stage as the cluster runs it: the worker and its arguments, the files they read, the layout."""

    stage: str
    name: str
    nnodes: int
    nproc_per_node: int
    device: str
    worker: PurePosixPath
    args: list[str]
    files: dict[str, str]
    env: dict[str, str]
    timeout_s: int


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def k8s_name(config_name: str, label: str) -> str:
    """An RFC 1123 label short enough for the pod hostnames JobSet derives from it (<name>-node-<i>-<j> ≤ 63); the
    config's part is shortened, never the step's, so two stages never share a name."""
    label = _slug(label)
    base = _slug(config_name)[:max(1, 40 - len(label) - 1)].rstrip("-") or "baton"
    return f"{base}-{label}"


def image_path(local: Path) -> PurePosixPath:
    return IMAGE_ROOT / local.resolve().relative_to(REPO_ROOT).as_posix()


def cluster_device(cfg) -> str:
    """`auto` means the cluster's GPUs (this machine's have no say); only an explicit cpu runs without them."""
    return "cpu" if cfg.device == "cpu" else "cuda"


# --- the stages, through their own spec builders -------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    root: PurePosixPath  # /baton/<config name>

    def context(self, cfg: PipelineConfig, step: planning.Step, source: str | None) -> StageContext:
        work = Path(self.root / step.label)
        return StageContext(stage=step.name, run_id=cfg.name, run_dir=Path(self.root), work_dir=work,
                            model=chat_template.resolved(cfg.model.model_dump()), seed=cfg.seed,
                            data_dir=Path(self.root / "data"),
                            input=Path(self.root / source / "checkpoint") if source else Path(self.root / "input"),
                            input_format=step.consumes, runtimes={"main": {"python": "python"}})


def _base_env(device: str) -> dict[str, str]:
    return {"PYTHONPATH": str(IMAGE_ROOT), **WORKER_QUIET_ENV, **training_engine_env(device)}


def pretrain_job(cfg: PipelineConfig, ctx: StageContext) -> StageJob:
    from tasks.pretrain.task import WORKER, build_spec

    scfg = cfg.pretrain.model_copy(update={"device": cluster_device(cfg.pretrain)})
    ctx.input = None  # from scratch: a cluster run continuing a checkpoint is `baton run` on the ray target
    # The data stage trains its tokenizer to model.vocab_size; its exact size is only known once it ran.
    spec = build_spec(ctx, scfg, vocab=cfg.model.vocab_size)
    return StageJob("pretrain", "", scfg.nnodes, scfg.nproc_per_node, spec.device, image_path(WORKER),
                    ["--spec", str(SPEC_DIR / "worker_spec.json")],
                    {"worker_spec.json": _json(spec.model_dump(mode="json"))}, _base_env(spec.device),
                    int(scfg.timeout_s))


def finetune_job(cfg: PipelineConfig, ctx: StageContext) -> StageJob:
    from tasks.finetune import ds_config, engine_env
    from tasks.finetune.task import WORKER, worker_spec

    scfg = cfg.finetune.model_copy(update={"device": cluster_device(cfg.finetune)})
    spec = worker_spec(ctx, scfg, ctx.work_dir / "checkpoint", Path(SPEC_DIR / "ds_config.json"))
    # TORCH_EXTENSIONS_DIR names this machine's build cache; the image builds its ops in its own default place
    env = {k: v for k, v in engine_env.worker_env(spec.device).items() if k != "TORCH_EXTENSIONS_DIR"}
    return StageJob("finetune", "", scfg.nnodes, scfg.nproc_per_node, spec.device, image_path(WORKER),
                    ["--spec", str(SPEC_DIR / "finetune_spec.json")],
                    {"finetune_spec.json": _json(spec.model_dump(mode="json")),
                     "ds_config.json": _json(ds_config.build(scfg))},
                    {**_base_env(spec.device), **env}, int(scfg.timeout_s))


def rlhf_job(cfg: PipelineConfig, ctx: StageContext) -> StageJob:
    from tasks.rlhf.task import WORKER, worker_spec

    scfg = cfg.rlhf
    if scfg.backend == "nemo_rl":
        raise ConfigError("rlhf.backend nemo_rl: NeMo-RL runs on KubeRay from its own container and recipes; "
                          "`baton k8s` writes baton's TRL worker (rlhf.backend trl or auto)")
    spec = worker_spec(ctx, scfg, ctx.work_dir / "checkpoint")
    device = cluster_device(scfg)
    return StageJob("rlhf", "", scfg.nnodes, scfg.nproc_per_node, device, image_path(WORKER),
                    ["--spec", str(SPEC_DIR / "rlhf_spec.json")],
                    {"rlhf_spec.json": _json(spec.model_dump(mode="json"))}, _base_env(device), int(scfg.timeout_s))


BUILDERS = {"pretrain": pretrain_job, "rlhf": rlhf_job, "finetune": finetune_job}


def stage_jobs(cfg: PipelineConfig, root: PurePosixPath) -> list[StageJob]:
    """The planned training steps (the planner's labels and conversions), each with its input: the previous step's."""
    steps = planning.plan(cfg)
    layout, jobs, source = Layout(root), [], None
    for step in steps:
        if step.name in TRAINING_STAGES:
            try:
                job = BUILDERS[step.name](cfg, layout.context(cfg, step, source))
            except ConfigError:
                raise
            except ValueError as e:  # the stages' own input errors (e.g. PretrainInputError)
                raise ConfigError(f"{step.name}: {e}") from None
            job.name = k8s_name(cfg.name, step.label)
            jobs.append(job)
        if step.produces not in (None, Format.DATASET):
            source = step.label
    if not jobs:
        raise ConfigError(f"stages {cfg.stages}: no training stage ({', '.join(TRAINING_STAGES)}) "
                          "to write manifests for")
    return jobs


# --- the manifests -------------------------------------------------------------------------------------------------

def _json(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def _meta(job: StageJob, cluster: Cluster) -> dict:
    return {"name": job.name, "namespace": cluster.namespace, "labels": _labels(job)}


def _labels(job: StageJob) -> dict:
    return {"app.kubernetes.io/name": "baton", "app.kubernetes.io/component": job.stage, "baton/job": job.name}


CONFIGMAP_LIMIT = 1 << 20  # bytes the API server stores in one ConfigMap


def configmap(job: StageJob, cluster: Cluster, config_yaml: str) -> dict:
    data = {**job.files, "config.yaml": config_yaml}
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size > CONFIGMAP_LIMIT:
        raise ConfigError(f"{job.stage}: its files take {size} bytes, more than a ConfigMap holds ({CONFIGMAP_LIMIT})")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, cluster), "data": data}


def torchrun(job: StageJob) -> list[str]:
    """Node rank and rendezvous address come from torchrun's PET_* environment (set by the operator or the pod)."""
    return ["python", "-m", "torch.distributed.run", "--nnodes", str(job.nnodes), "--nproc-per-node",
            str(job.nproc_per_node), str(job.worker), *job.args]


def resources(job: StageJob, gpus: int | None = None) -> dict:
    gpus = job.nproc_per_node if gpus is None else gpus
    if job.device == "cuda" and gpus:
        return {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}
    return {"requests": {"cpu": str(job.nproc_per_node)}}


def _env_list(env: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in env.items()]


def network_env(cluster: Cluster) -> dict[str, str]:
    return {"NCCL_SOCKET_IFNAME": cluster.interface, "GLOO_SOCKET_IFNAME": cluster.interface, "NCCL_DEBUG": "WARN"}


def pod_spec(job: StageJob, cluster: Cluster, container: dict) -> dict:
    """Shared memory for NCCL and the data loaders, the runs volume, and the stage's files read-only."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "runs", "mountPath": cluster.mount}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
               {"name": "runs", "persistentVolumeClaim": {"claimName": cluster.volume_claim}},
               {"name": "stage-files", "configMap": {"name": job.name}}]
    mounts.append({"name": "stage-files", "mountPath": str(SPEC_DIR), "readOnly": True})
    container = {"image": cluster.train_image, "imagePullPolicy": "IfNotPresent", **container,
                 "volumeMounts": mounts}
    return {"restartPolicy": "Never", "containers": [container], "volumes": volumes}


def _worker_container(job: StageJob, cluster: Cluster, name: str, extra_env: list[dict]) -> dict:
    env = _env_list({**job.env, **network_env(cluster)}) + extra_env
    return {"name": name, "command": torchrun(job), "env": env, "resources": resources(job)}


def pytorchjob(job: StageJob, cluster: Cluster) -> dict:
    """Master plus nnodes-1 Workers; the operator sets PET_NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT for torchrun.
    The container must be called `pytorch`: that is the one the operator configures."""
    template = {"metadata": {"labels": _labels(job)},
                "spec": pod_spec(job, cluster, _worker_container(job, cluster, "pytorch", []))}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if job.nnodes > 1:
        replicas["Worker"] = {"replicas": job.nnodes - 1, "restartPolicy": "Never", "template": template}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(job, cluster),
            "spec": {"nprocPerNode": str(job.nproc_per_node),
                     "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None",
                                   "activeDeadlineSeconds": job.timeout_s},
                     "pytorchReplicaSpecs": replicas}}


def jobset(job: StageJob, cluster: Cluster) -> dict:
    """One indexed Job of nnodes pods; pod i is node rank i, and pod 0's stable DNS name is the rendezvous."""
    master = f"{job.name}-node-0-0.{job.name}"
    extra = [{"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
             {"name": "PET_MASTER_ADDR", "value": master}, {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)}]
    pod = {"metadata": {"labels": _labels(job)},
           "spec": pod_spec(job, cluster, _worker_container(job, cluster, "worker", extra))}
    node_job = {"parallelism": job.nnodes, "completions": job.nnodes, "completionMode": "Indexed",
                "backoffLimit": 0, "activeDeadlineSeconds": job.timeout_s, "template": pod}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(job, cluster),
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": job.name},
                     "failurePolicy": {"maxRestarts": 0},
                     "successPolicy": {"operator": "All", "targetReplicatedJobs": ["node"]},
                     "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": node_job}}]}}


def image_ray_version(requirements: Path = REPO_ROOT / "infra" / "runtimes" / "main.txt") -> str:
    """The Ray the training image installs (its pip list is the main runtime's): KubeRay starts that version."""
    m = re.search(r"^ray(\[[^\]]*\])?==([\w.]+)", requirements.read_text(), re.M)
    if not m:
        raise ConfigError(f"{requirements}: no pinned ray (ray==X.Y.Z) for the RayJob's rayVersion")
    return m.group(2)


def ray_entrypoint(job: StageJob) -> str:
    return (f"python -m flows.cli run {SPEC_DIR / 'config.yaml'} --stages {job.stage} "
            "--set runtimes.main.kind=ray")


def rayjob(job: StageJob, cluster: Cluster, root: PurePosixPath) -> dict:
    """A head that only coordinates (no GPUs, no tasks) and nnodes GPU workers; the entrypoint runs on the head."""
    env = _env_list({**job.env, **network_env(cluster), "BATON_HOME": str(root / "home")})
    head = {"name": "ray-head", "env": env, "resources": {"requests": {"cpu": "2"}}}
    worker = {"name": "ray-worker", "env": env, "resources": resources(job)}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _meta(job, cluster),
            "spec": {"entrypoint": ray_entrypoint(job), "shutdownAfterJobFinishes": True,
                     "ttlSecondsAfterFinished": 600, "activeDeadlineSeconds": job.timeout_s,
                     "rayClusterSpec": {
                         "rayVersion": image_ray_version(),
                         "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                                           "template": {"metadata": {"labels": _labels(job)},
                                                        "spec": pod_spec(job, cluster, head)}},
                         "workerGroupSpecs": [{
                             "groupName": "nodes", "replicas": job.nnodes, "minReplicas": job.nnodes,
                             "maxReplicas": job.nnodes, "rayStartParams": {},
                             "template": {"metadata": {"labels": _labels(job)},
                                          "spec": pod_spec(job, cluster, worker)}}]}}}


def work_pool_template(cluster: Cluster, root: PurePosixPath) -> dict:
    """prefect-kubernetes' own default base job template, with baton's image, namespace, volume and BATON_HOME."""
    from prefect_kubernetes.worker import KubernetesWorker

    t = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    props = t["variables"]["properties"]
    props["image"]["default"] = cluster.orchestrator_image
    props["namespace"]["default"] = cluster.namespace
    props["env"]["default"] = {"BATON_HOME": str(root / "home")}
    pod = t["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    for misplaced in ("completions", "parallelism"):  # Job fields in the pod spec: a strict API server rejects them
        pod.pop(misplaced, None)
    pod["containers"][0]["volumeMounts"] = [{"name": "runs", "mountPath": cluster.mount}]
    pod["volumes"] = [{"name": "runs", "persistentVolumeClaim": {"claimName": cluster.volume_claim}}]
    return t


def render_work_pool_job(template: dict, values: dict) -> dict:
    """The Job a Prefect Kubernetes worker submits from this template: the variables' defaults and `values` applied
    with Prefect's own templating; `env` (a dict) and `command` become the lists the worker makes of them."""
    from prefect.utilities.templating import apply_values

    props = template["variables"]["properties"]
    filled = {k: p["default"] for k, p in props.items() if p.get("default") is not None} | values
    filled["env"] = _env_list({k: str(v) for k, v in (filled.get("env") or {}).items()})
    if isinstance(filled.get("command"), str):
        filled["command"] = filled["command"].split()
    return apply_values(template["job_configuration"]["job_manifest"], filled)


# --- writing -------------------------------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # the Master and Worker pod templates are written out, not anchored
        return True


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def manifests(cfg: PipelineConfig, cluster: Cluster) -> dict[str, str]:
    """Relative path → file text, for every training stage in cfg.stages and the orchestrator's work pool."""
    cluster = cluster.with_default_images()
    root = PurePosixPath(cluster.mount) / cfg.name
    config_yaml = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    out = {}
    for job in stage_jobs(cfg, root):
        docs = {"configmap.yaml": configmap(job, cluster, config_yaml), "pytorchjob.yaml": pytorchjob(job, cluster),
                "jobset.yaml": jobset(job, cluster), "rayjob.yaml": rayjob(job, cluster, root)}
        out.update({f"{job.stage}/{name}": to_yaml(doc) for name, doc in docs.items()})
    out["prefect-work-pool.json"] = _json(work_pool_template(cluster, root))
    return out


def write_manifests(cfg: PipelineConfig, out_dir: Path, cluster: Cluster) -> list[Path]:
    files = manifests(cfg, cluster)
    written = []
    for rel, text in files.items():
        write_atomic(out_dir / rel, text)
        written.append(out_dir / rel)
    return written
