"""The pretraining data, Megatron's way: the data stage's jsonl corpus tokenized into an indexed dataset (.bin/.idx),
sampled into fixed-length sequences by GPTDataset. Part of the pretrain worker program (imported by worker.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

SPLITS = ("train", "heldout")


class HFTokenizer(MegatronLegacyTokenizer):
    """The data stage's Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) behind Megatron's tokenizer
    interface, through the `tokenizers` library (same ids as transformers, without importing it on every rank).
    Documents end with eos."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = json.loads((path / "tokenizer_config.json").read_text())
        self._eod = self._special_id(special, "eos_token")
        self._pad = self._special_id(special, "pad_token", default=self._eod)

    def _special_id(self, config: dict, name: str, default: int | None = None) -> int:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        tid = self.tok.token_to_id(token) if token else None
        if tid is None and default is None:
            raise ValueError(f"tokenizer: no {name} in tokenizer_config.json")
        return default if tid is None else tid

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.array(self.tok.encode(text, add_special_tokens=False).ids, dtype=numpy.int64)

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids))

    @property
    def vocab(self):
        return self.tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self):
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad


def build_indexed(jsonl: Path, prefix: Path, tokenizer: HFTokenizer) -> None:
    """Tokenize one jsonl file ({"text"} per line) into prefix.bin/.idx, written under temporary names then renamed."""
    tmp = prefix.with_name(prefix.name + ".tmp")
    builder = IndexedDatasetBuilder(str(tmp) + ".bin", dtype=numpy.int32)
    with open(jsonl) as f:
        for line in f:
            if line.strip():
                ids = tokenizer.tokenize(json.loads(line)["text"]).tolist() + [tokenizer.eod]
                builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(str(tmp) + ".idx")
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")  # last: its presence means the pair is complete


def prepare(data_dir: Path, out_dir: Path, tokenizer: HFTokenizer) -> dict[str, Path]:
    """Rank 0 tokenizes (once per work dir); every rank waits for it."""
    prefixes = {s: out_dir / f"{s}_text_document" for s in SPLITS}
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for split, prefix in prefixes.items():
            if not Path(str(prefix) + ".idx").exists():
                build_indexed(data_dir / "pretrain" / f"{split}.jsonl", prefix, tokenizer)
    dist.barrier()
    return prefixes


def build_datasets(prefixes: dict[str, Path], tokenizer: HFTokenizer, seq_length: int, seed: int,
                   train_samples: int, eval_samples: int, cache_dir: Path) -> tuple[GPTDataset, GPTDataset]:
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer,
        blend_per_split=[([str(prefixes["train"])], None), ([str(prefixes["heldout"])], None), None],
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,  # the causal mask is built inside attention
        path_to_cache=str(cache_dir), mmap_bin_files=True,
    )
    train, heldout, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, eval_samples, None], lambda: True, config).build()
    return train, heldout


def batch(ds: GPTDataset, indices, device) -> dict[str, torch.Tensor]:
    samples = [ds[int(i)] for i in indices]
    return {k: torch.stack([s[k] for s in samples]).to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")}


def microbatch_indices(step: int, micro: int, mbs: int, dp_size: int, dp_rank: int, gbs: int) -> range:
    """Samples a DP rank reads for one micro batch. A pure function of the step: resuming at step k reads exactly
    what the uninterrupted run would have read (the data position is the iteration)."""
    start = step * gbs + micro * mbs * dp_size + dp_rank * mbs
    return range(start, start + mbs)
