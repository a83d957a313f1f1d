"""Write one GGUF file from an HF checkpoint with llama.cpp's own converter. Runs in the llamacpp runtime:
`python worker.py --spec SPEC.json` (tasks.events.ExportSpec, written by tasks.export.run). The converter and its gguf
writer lie in the runtime's share/llama.cpp, llama-quantize in its bin (infra/runtimes/llamacpp.post.sh): a spec with
`quantize` has the converter write f16 into scratch and llama-quantize turn that into the asked type.

Two adaptations, each recorded in the result's `notes`, neither touching the weights:
- a checkpoint saved by transformers 5 names its tokenizer class TokenizersBackend, which the converter's
  transformers 4.57 calls PreTrainedTokenizerFast: the converter reads a staged view of the folder (links to the
  files, the tokenizer_config.json rewritten);
- the converter recognises a BPE pre-tokenizer by hashing the ids of a test string, so a tokenizer trained for the run
  is unknown to it; when its tokenizer.json's pre-tokenizer is exactly GPT-2's (ByteLevel with GPT-2's regex) it is
  written as `gpt-2`, which is what it is. Any other unknown pre-tokenizer stays refused by the converter.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks import events

LLAMA_CPP = Path(sys.prefix) / "share" / "llama.cpp"
LLAMA_QUANTIZE = Path(sys.prefix) / "bin" / "llama-quantize"
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "use_regex": True}


def staged(src: Path, scratch: Path, notes: list[str]) -> Path:
    """src as the converter can read it: links to every file, tokenizer_config.json rewritten when it names
    transformers 5's TokenizersBackend."""
    view = scratch / "source"
    view.mkdir()
    for f in src.iterdir():
        if f.is_file():
            os.symlink(f.resolve(), view / f.name)
    cfg_path = src / "tokenizer_config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            (view / cfg_path.name).unlink()
            (view / cfg_path.name).write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
            notes.append("tokenizer_class TokenizersBackend read as PreTrainedTokenizerFast (transformers 4.57)")
    return view


def gpt2_pre_tokenizer(folder: Path) -> bool:
    try:
        pre = json.loads((folder / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return all(pre.get(k) == v for k, v in GPT2_PRE_TOKENIZER.items())


def recognise_gpt2_pre_tokenizer(text_model, notes: list[str]) -> None:
    original = text_model.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not gpt2_pre_tokenizer(self.dir_model):
                raise
            notes.append("an unlisted BPE tokenizer with GPT-2's byte-level pre-tokenizer written as tokenizer.ggml.pre "
                         "gpt-2")
            return "gpt-2"

    text_model.get_vocab_base_pre = get_vocab_base_pre


def convert(src: Path, out: Path, out_type: str, notes: list[str]) -> None:
    converter = LLAMA_CPP / "convert_hf_to_gguf.py"
    if not converter.exists():
        raise SystemExit(f"{converter}: missing; this worker runs in the llamacpp runtime (make runtimes)")
    sys.path.insert(0, str(LLAMA_CPP))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    recognise_gpt2_pre_tokenizer(TextModel, notes)
    with tempfile.TemporaryDirectory(prefix="baton-export-") as scratch:
        sys.argv = [str(converter), str(staged(src, Path(scratch), notes)), "--outfile", str(out),
                    "--outtype", out_type]
        with contextlib.redirect_stdout(sys.stderr):  # the converter's chatter is a log; stdout carries events
            convert_hf_to_gguf.main()


def quantize(f16: Path, out: Path, ggml_type: str) -> None:
    """llama-quantize's own mix for ggml_type, on every core; its log goes to stderr (stdout carries events)."""
    if not LLAMA_QUANTIZE.exists():
        raise SystemExit(f"{LLAMA_QUANTIZE}: missing; this worker runs in the llamacpp runtime (make runtimes)")
    subprocess.run([str(LLAMA_QUANTIZE), str(f16), str(out), ggml_type, str(os.cpu_count() or 1)], check=True,
                   stdout=sys.stderr, stdin=subprocess.DEVNULL)


def main() -> None:
    spec = events.read_typed_spec(events.ExportSpec)
    spec.out.parent.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    t0 = time.time()
    version = (LLAMA_CPP / "VERSION").read_text().strip()
    if spec.quantize:
        with tempfile.TemporaryDirectory(prefix="baton-export-f16-", dir=spec.out.parent) as scratch:
            f16 = Path(scratch) / "model-f16.gguf"
            convert(spec.src, f16, spec.out_type, notes)
            quantize(f16, spec.out, spec.quantize)
        wrote = f"{version}: convert_hf_to_gguf.py {spec.out_type}, llama-quantize {spec.quantize}"
    else:
        convert(spec.src, spec.out, spec.out_type, notes)
        wrote = f"{version}: convert_hf_to_gguf.py"
    events.result(events.ExportResult(seconds=round(time.time() - t0, 3), size=spec.out.stat().st_size,
                                      converter=wrote, notes=notes))


if __name__ == "__main__":
    with events.causes_announced():
        main()
