"""Run by tests/test_finetune_engine_options.py under torchrun (2 ranks): the worker's ZeRO-3 loader for parameters on
NVMe (deepspeed_compat.load_with_params_on_nvme), exercised on ZeRO-3 with CPU offload (no async I/O op needed). Trains 2 steps, saves,
trains 3 more; a fresh engine loaded by the worker's loader and one loaded by engine.load_checkpoint train the same 3;
each rank prints one JSON line: the losses, whether the fp32 master partitions are bit-equal, lr and step counters."""
import json, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch, deepspeed, torch.distributed as dist
from tasks.finetune import deepspeed_compat, worker as W
from transformers import LlamaConfig, LlamaForCausalLM

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
      "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                            "offload_optimizer": {"device": "cpu", "pin_memory": False},
                            "offload_param": {"device": "cpu", "pin_memory": False}},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                                 "torch_adam": True}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_min_ratio": 0.0,
                    "warmup_num_steps": 1, "cos_min_ratio": 0.1, "warmup_type": "linear"}},
      "steps_per_print": 1 << 30}
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()

def make():
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=DS):
        m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    e, *_ = deepspeed.initialize(model=m, model_parameters=W.param_groups(m, 0.1), config=DS)
    return e

def train(e, a, b):
    out = []
    for s in range(a, b):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s * 10 + rank))
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss); e.step(); out.append(loss.item())
    return out

def snap(e):
    return [t.detach().clone() for t in e.optimizer.fp32_partitioned_groups_flat]

d = Path(sys.argv[1])
e1 = make(); train(e1, 0, 2)
e1.save_checkpoint(str(d), tag="t2", client_state={"baton_step": 2})
ref = train(e1, 2, 5); ref_w = snap(e1)
e2 = make(); client = deepspeed_compat.load_with_params_on_nvme(e2, d, "t2")
got = train(e2, 2, 5); got_w = snap(e2)
e3 = make(); _, c3 = e3.load_checkpoint(str(d), tag="t2"); std = train(e3, 2, 5); std_w = snap(e3)
same = all(torch.equal(a, b) for a, b in zip(ref_w, got_w))
same_std = all(torch.equal(a, b) for a, b in zip(ref_w, std_w))
line = json.dumps({"rank": rank, "flat_none": deepspeed_compat.params_off_flat_buffers(e2), "client": client.get("baton_step"),
                   "ref": ref, "ours": got, "deepspeed": std, "weights_equal_ours": same,
                   "weights_equal_deepspeed": same_std, "lr": [e1.get_lr(), e2.get_lr()],
                   "steps": [e1.global_steps, e2.global_steps]})
sys.stdout.flush()
os.write(1, (line + "\n").encode())  # one write (under PIPE_BUF): the two ranks' lines never interleave
