"""`baton k8s`: the manifests it writes validate against the published schemas (tests/fixtures/k8s/), say what the
config says (nodes, ranks, GPUs, the stage's worker and spec), and the validator rejects broken manifests."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from flows.cli import main
from k8s_schemas import CORE, CRDS, FIXTURES, errors, validator

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
RECIPE_70B = REPO / "configs" / "recipes" / "llama3-70b-8x8xh100.yaml"
TINY = REPO / "configs" / "tiny.yaml"


def write(tmp_path: Path, config: Path, *extra: str) -> Path:
    out = tmp_path / "k8s"
    assert main(["k8s", str(config), "--out", str(out), *extra]) == 0
    return out


def load_all(out: Path) -> dict[str, dict]:
    return {p.relative_to(out).as_posix(): yaml.safe_load(p.read_text()) for p in sorted(out.rglob("*.yaml"))}


def assert_valid(docs: dict[str, dict]) -> None:
    problems = {name: errors(doc) for name, doc in docs.items()}
    assert not any(problems.values()), {k: v[:3] for k, v in problems.items() if v}


def work_pool_job(out: Path) -> dict:
    from flows.cli.k8s_manifests import render_work_pool_job

    template = json.loads((out / "prefect-work-pool.json").read_text())
    return render_work_pool_job(template, {"name": "baton-flow", "command": "prefect flow-run execute"})


def container(pod_template: dict) -> dict:
    return pod_template["spec"]["containers"][0]


def test_schema_fixtures_are_valid_schemas():
    for name in [*CRDS.values(), "core.json"]:
        data = json.loads((FIXTURES / name).read_text())
        assert data["source"]
    for key in [*CRDS, *CORE]:
        type(validator(*key)).check_schema(validator(*key).schema)


def test_70b_recipe_writes_valid_manifests_for_8_nodes_of_8_gpus(tmp_path):
    out = write(tmp_path, RECIPE_70B, "--namespace", "llm", "--image-train", "registry.example/baton-train:1")
    docs = load_all(out)
    assert sorted(docs) == ["pretrain/configmap.yaml", "pretrain/jobset.yaml", "pretrain/pytorchjob.yaml",
                            "pretrain/rayjob.yaml"]
    assert_valid(docs)

    spec = json.loads(docs["pretrain/configmap.yaml"]["data"]["worker_spec.json"])
    c = spec["config"]  # nnodes and nproc_per_node are the job's (below), not the worker's
    assert (c["tensor_parallel"], c["pipeline_parallel"]) == (8, 4)
    assert 8 * 8 // (c["tensor_parallel"] * c["pipeline_parallel"]) == 2 and c["global_batch_size"] == 512
    assert spec["device"] == "cuda" and spec["padded_vocab_size"] == 129024  # 128256 padded to 128 × TP8
    assert spec["data_dir"] == "/baton/llama3-70b-8x8xh100/data"
    assert spec["work_dir"] == "/baton/llama3-70b-8x8xh100/pretrain"

    ptj = docs["pretrain/pytorchjob.yaml"]
    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 8 and ptj["spec"]["nprocPerNode"] == "8"
    main_c = container(replicas["Master"]["template"])
    assert main_c["name"] == "pytorch" and main_c["image"] == "registry.example/baton-train:1"
    assert main_c["command"] == ["python", "-m", "torch.distributed.run", "--nnodes", "8", "--nproc-per-node", "8",
                                 "/opt/baton/tasks/pretrain/worker.py", "--spec", "/etc/baton/worker_spec.json"]
    assert main_c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    env = {e["name"]: e.get("value") for e in main_c["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    volumes = {v["name"]: v for v in replicas["Master"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert ptj["metadata"]["namespace"] == "llm"

    js = docs["pretrain/jobset.yaml"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert js["parallelism"] == js["completions"] == 8 and js["completionMode"] == "Indexed"
    assert container(js["template"])["command"] == main_c["command"]
    js_env = {e["name"]: e for e in container(js["template"])["env"]}
    assert "job-completion-index" in js_env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert js_env["PET_MASTER_ADDR"]["value"] == "llama3-70b-8x8xh100-pretrain-node-0-0.llama3-70b-8x8xh100-pretrain"

    ray = docs["pretrain/rayjob.yaml"]["spec"]
    workers = ray["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["replicas"] == 8 and container(workers["template"])["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert "--stages pretrain" in ray["entrypoint"]
    from importlib.metadata import version

    assert ray["rayClusterSpec"]["rayVersion"] == version("ray")  # the image's Ray is the main runtime's

    template = json.loads((out / "prefect-work-pool.json").read_text())
    Draft202012Validator.check_schema(template["variables"])  # the form Prefect shows for the work pool
    job = work_pool_job(out)
    assert errors(job) == []
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/baton-train:1" and job["metadata"]["namespace"] == "llm"


def test_tiny_config_chains_the_stages_through_the_volume(tmp_path):
    out = write(tmp_path, TINY)
    docs = load_all(out)
    assert {p.split("/")[0] for p in docs} == {"pretrain", "rlhf", "finetune"}
    assert_valid(docs)
    root = "/baton/tiny"
    rlhf_cmd = container(docs["rlhf/pytorchjob.yaml"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"])["command"]
    assert rlhf_cmd[rlhf_cmd.index("--spec") + 1] == "/etc/baton/rlhf_spec.json"  # the worker contract: one spec
    rlhf = json.loads(docs["rlhf/configmap.yaml"]["data"]["rlhf_spec.json"])
    assert rlhf["input"] == f"{root}/convert-megatron-to-hf/checkpoint"  # the planner's conversion
    assert rlhf["output"] == f"{root}/rlhf/checkpoint"
    ft = json.loads(docs["finetune/configmap.yaml"]["data"]["finetune_spec.json"])
    assert ft["input"] == f"{root}/rlhf/checkpoint" and ft["ds_config"] == "/etc/baton/ds_config.json"
    ds = json.loads(docs["finetune/configmap.yaml"]["data"]["ds_config.json"])
    assert ds["zero_optimization"]["stage"] == 2
    assert "Worker" not in docs["finetune/pytorchjob.yaml"]["spec"]["pytorchReplicaSpecs"]  # nnodes 1
    assert docs["finetune/pytorchjob.yaml"]["spec"]["nprocPerNode"] == "2"


def test_cpu_stage_requests_cores_not_gpus(tmp_path):
    out = write(tmp_path, TINY, "--stages", "finetune", "--set", "finetune.device=cpu", "--set", "finetune.nnodes=2")
    docs = load_all(out)
    assert_valid(docs)
    replicas = docs["finetune/pytorchjob.yaml"]["spec"]["pytorchReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 1
    assert container(replicas["Master"]["template"])["resources"] == {"requests": {"cpu": "2"}}
    spec = json.loads(docs["finetune/configmap.yaml"]["data"]["finetune_spec.json"])
    assert spec["device"] == "cpu" and spec["input"] == "/baton/tiny/input"  # first stage: its input's place


def test_validation_rejects_broken_manifests(tmp_path):
    docs = load_all(write(tmp_path, TINY, "--stages", "pretrain"))
    good = docs["pretrain/pytorchjob.yaml"]

    def broken(edit) -> list[str]:
        doc = copy.deepcopy(good)
        edit(doc)
        return errors(doc)

    master = lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]  # noqa: E731
    assert any("replicas" in e and "integer" in e for e in broken(lambda d: master(d).update(replicas="1")))
    assert any("imagePullPolicyy" in e for e in broken(
        lambda d: container(master(d)["template"]).update(imagePullPolicyy="Always")))
    assert any("sizeLimit" in e for e in broken(
        lambda d: master(d)["template"]["spec"]["volumes"][0]["emptyDir"].update(sizeLimit=["64Gi"])))
    assert any("nprocPerNode" in e for e in broken(lambda d: d["spec"].update(nprocPerNode=8)))
    assert any("metadata.name" in e for e in broken(lambda d: d["metadata"].update(name="Tiny_Pretrain")))

    cm = copy.deepcopy(docs["pretrain/configmap.yaml"])
    cm["data"]["steps"] = 60
    assert any("data.steps" in e for e in errors(cm))
    js = copy.deepcopy(docs["pretrain/jobset.yaml"])
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["completionMode"] = 3
    assert any("completionMode" in e for e in errors(js))


def test_names_stay_distinct_and_short():
    from flows.cli.k8s_manifests import k8s_name

    long = "a-very-long-config-name-for-a-seventy-billion-parameter-run"
    names = {k8s_name(long, s) for s in ("pretrain", "rlhf", "finetune")}
    assert len(names) == 3 and all(len(n) <= 40 and n.endswith(("pretrain", "rlhf", "finetune")) for n in names)
    assert k8s_name("Llama3_70B", "pretrain") == "llama3-70b-pretrain"


def test_refuses_what_it_cannot_write(tmp_path, capsys):
    out = str(tmp_path / "k8s")
    assert main(["k8s", str(TINY), "--stages", "data", "--out", out]) == 2
    assert "no training stage" in capsys.readouterr().err
    (tmp_path / "ray.sub").write_text("")  # a NeMo-RL checkout as the config check sees it, so ours is the refusal
    nemo_rl = ["rlhf.backend=nemo_rl", "runtimes.nemo_rl.kind=slurm", f"runtimes.nemo_rl.path={tmp_path}",
               "runtimes.nemo_rl.image=nemo-rl"]
    assert main(["k8s", str(TINY), "--stages", "rlhf", *[a for kv in nemo_rl for a in ("--set", kv)],
                 "--out", out]) == 2
    assert "rlhf.backend nemo_rl" in capsys.readouterr().err
