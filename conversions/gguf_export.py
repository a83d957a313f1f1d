"""The gate of a GGUF export (`baton export`): the file llama.cpp's converter wrote, read back with baton's own
restricted reader (conversions.gguf: a bounds-checked structure walk before the gguf package's reader sees it), must
describe the HF checkpoint it came from — tensor types of the asked quantisation, the architecture's shape keys, the
same vocabulary, special-token ids and chat template — and its weights, dequantised into the source's architecture,
must give the source's logits within the type's tolerance (f16 tight, q8_0 looser, the llama-quantize types q4_0,
q4_K_M and q5_K_M looser still).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from . import gguf, vllm_quant
from .refusal import Refused
from .checks import check, report, timed

GGUF_NAME = "model.gguf"
PROBE_TOKENS = 48


class ExportError(Refused):
    pass


@dataclass(frozen=True)
class ExportType:
    """One output type, and what its gate accepts: the root mean square of the logit differences over the probe, in
    units of the source logits' standard deviation (the max over millions of logits is a poor statistic: it grows with
    the vocabulary). The argmax token must be the source's wherever the source's lead over the GGUF's pick is larger
    than that bound (a near-tie may flip, a real preference may not).

    The converter writes f16 and q8_0 itself; the others are llama-quantize's (`quantize`, its type name) from the
    converter's f16, and are a mix: llama.cpp gives some matrices a larger type (attn_v, ffn_down, output: Q6_K in
    Q4_K_M) and a row that is not a whole number of the type's blocks a fallback type (Q4_K -> Q5_0 -> F16, ...),
    so `mix` lists every type a matrix may get.

    `served_logit_gap`: how llama-server's greedy tokens on this file are held to HF's (tasks.serve.smoke). None: equal
    to HF generate's, token for token (f16). A number (nats): on a quantised type llama.cpp's CPU matmuls quantise the
    activations too (to Q8_0/Q8_1, ggml's vec_dot_type of the weight type), which the dequantised reference does not,
    so a near-tie may go the other way; each token llama-server picks must then have, under HF on the same weights
    fed the server's own tokens (teacher-forced), a logit within this of HF's largest (a log-probability within it of
    HF's greedy choice)."""
    ggml_type: str           # the type the large weights get (gguf.GGMLQuantizationType name)
    max_logit_rms: float
    quantize: str | None = None    # llama-quantize's type name; None: convert_hf_to_gguf.py writes it
    mix: frozenset[str] = frozenset()
    served_logit_gap: float | None = None


# Measured (docs/export.md): f16 5e-4 (tiny) and 2e-3 (SmolLM2-135M); q8_0 0.013 and 0.038. On the tiny model (rms,
# largest argmax lead lost): q4_K_M 0.097, 0.15 and q5_K_M 0.074, 0.18 (every matrix a fallback: its 128- and 344-wide
# rows are no whole number of the k-quants' 256-blocks); q4_0, really 4-bit there, 0.22, 0.52.
# served_logit_gap, measured on SmolLM2-135M (6 prompts x 32 llama-server tokens, docs/export.md): the largest gap
# q8_0 0.18, q4_K_M 0.53 (13 of 192 tokens not HF's pick); f16 one near-tie of 2.5e-3 (exact parity holds on the serve
# stage's 2 x 8). About 2.7x the largest seen; a token e^-1.5 as likely as HF's pick is still refused.
TYPES = {"f16": ExportType("F16", max_logit_rms=0.01),
         "q8_0": ExportType("Q8_0", max_logit_rms=0.1, served_logit_gap=0.5),
         "q4_0": ExportType("Q4_0", 0.6, quantize="Q4_0", mix=frozenset({"Q4_0", "Q4_1", "Q6_K", "Q8_0", "F16"}),
                            served_logit_gap=1.5),
         "q4_K_M": ExportType("Q4_K", 0.3, quantize="Q4_K_M",
                              mix=frozenset({"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "F16"}),
                              served_logit_gap=1.5),
         "q5_K_M": ExportType("Q5_K", 0.2, quantize="Q5_K_M", mix=frozenset({"Q5_K", "Q6_K", "Q5_1", "Q8_0", "F16"}),
                              served_logit_gap=1.5)}
# HF model_type -> the GGUF architecture llama.cpp's converter writes for it (others are recorded, not compared)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def export_type(name: str) -> ExportType:
    """The ExportType of an --type value; ExportError naming the known ones."""
    if name in TYPES:
        return TYPES[name]
    raise ExportError(f"--type {name}: not an export type (known: {', '.join(TYPES)}, and for vLLM "
                      f"{', '.join(vllm_quant.TYPES)}; llama.cpp's other quantisations are not gated here)")


def gate(gguf_path: Path, src: Path, type_name: str, max_logit_rms: float | None = None) -> dict:
    """verify.report of the GGUF file at gguf_path against the HF checkpoint src (max_logit_rms: another bound than
    the type's). Later checks stop at the first failed level: a file whose structure or header is wrong is not
    dequantised."""
    kind = export_type(type_name)
    if max_logit_rms is not None:
        kind = dataclasses.replace(kind, max_logit_rms=max_logit_rms)
    seconds: dict[str, float] = {}
    checks = timed(seconds, "structure", lambda: _structure(Path(gguf_path)))
    source = checks[-1].pop("source", None)
    if source is None:
        return report(checks, seconds)
    checks += timed(seconds, "header", lambda: header_checks(source, Path(gguf_path), Path(src), kind))
    if not all(c["passed"] for c in checks):
        return report(checks, seconds)
    checks += timed(seconds, "logits", lambda: [logits_check(source, Path(gguf_path), Path(src), kind)])
    return report(checks, seconds)


def _structure(path: Path) -> list[dict]:
    """The bounds-checked walk of conversions.gguf over the file (in place: it is the export's own output)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        source = gguf.check_structure(gguf.Source(path.resolve(), h.hexdigest(), path.stat().st_size), path)
    except (OSError, gguf.GGUFError) as e:
        return [check("gguf.structure", False, str(e))]
    ok = check("gguf.structure", True, f"GGUF v{source.version}, {source.tensor_count} tensors, {source.size} bytes, "
                                       f"types {source.tensor_types}")
    return [{**ok, "source": source}]


def header_checks(source: gguf.Source, path: Path, src: Path, kind: ExportType) -> list[dict]:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    fields = {name: f.contents() for name, f in GGUFReader(str(path)).fields.items()
              if not name.startswith("GGUF.")}
    config = AutoConfig.from_pretrained(str(src))
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    return [_tensor_types(source, kind), _shape_keys(fields, config), _vocabulary(fields, tokenizer, config),
            _special_tokens(fields, tokenizer), _chat_template(fields, tokenizer)]


def expected_type(shape: tuple[int, ...], kind: ExportType) -> str | frozenset[str]:
    """What llama.cpp writes a tensor as: vectors (norms, biases) F32; from the converter, matrices the asked type, or
    F16 where a row is not a whole number of the type's blocks (a 344-wide row cannot be cut into Q8_0's 32); from
    llama-quantize, matrices one of the type's mix."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) < 2:
        return "F32"
    if kind.quantize:
        return kind.mix
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind.ggml_type]][0]
    return kind.ggml_type if shape[-1] % block == 0 else "F16"


def _tensor_types(source: gguf.Source, kind: ExportType) -> dict:
    """Every tensor of its expected type, and some matrix quantised (not all fallen back to F16)."""
    from gguf import GGMLQuantizationType

    def fits(name: str, want) -> bool:
        return name in want if isinstance(want, frozenset) else name == want

    wrong = [f"{t.name} {name} (expected {_shown(want)})" for t in source.tensors
             if not fits(name := GGMLQuantizationType(t.ggml_type).name, want := expected_type(t.shape, kind))]
    quantised = kind.mix - {"F16"} if kind.quantize else {kind.ggml_type}
    passed = not wrong and bool(quantised & set(source.tensor_types))
    return check("gguf.tensor_types", passed, f"{source.tensor_types}" + (
        "" if passed else f"; {len(wrong)} tensor(s) of another type: "
                          f"{', '.join(wrong[:3]) or f'none of {_shown(frozenset(quantised))}'}"))


def _shown(want) -> str:
    return "|".join(sorted(want)) if isinstance(want, (set, frozenset)) else want


def _shape_keys(fields: dict, config) -> dict:
    arch = fields.get("general.architecture")
    want_arch = ARCHITECTURES.get(config.model_type)
    problems = [f"general.architecture {arch!r}, the source is {config.model_type} ({want_arch})"] \
        if want_arch and arch != want_arch else []
    text = config.get_text_config()
    expected = {"block_count": text.num_hidden_layers, "embedding_length": text.hidden_size,
                "feed_forward_length": text.intermediate_size, "attention.head_count": text.num_attention_heads,
                "attention.head_count_kv": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}
    for key, want in expected.items():
        got = fields.get(f"{arch}.{key}")
        if got != want:
            problems.append(f"{arch}.{key} {got!r}, the source's config says {want!r}")
    return check("gguf.metadata", not problems, "; ".join(problems) or f"{arch}: {', '.join(expected)} as the config")


def _vocabulary(fields: dict, tokenizer, config) -> dict:
    tokens = fields.get("tokenizer.ggml.tokens") or []
    want = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    vocab_size = config.get_text_config().vocab_size
    problems = []
    if len(tokens) != vocab_size:
        problems.append(f"{len(tokens)} tokens, the config's vocab_size is {vocab_size}")
    differ = [i for i, (a, b) in enumerate(zip(tokens, want)) if a != b]
    if differ:
        i = differ[0]
        problems.append(f"{len(differ)} token(s) differ from the tokenizer's, first id {i}: {tokens[i]!r} vs {want[i]!r}")
    return check("gguf.vocabulary", not problems, "; ".join(problems) or f"{len(want)} tokens as the tokenizer's")


def _special_tokens(fields: dict, tokenizer) -> dict:
    problems = []
    for name in ("bos", "eos"):
        want = getattr(tokenizer, f"{name}_token_id")
        got = fields.get(f"tokenizer.ggml.{name}_token_id")
        if want is not None and got != want:
            problems.append(f"tokenizer.ggml.{name}_token_id {got!r}, the tokenizer's is {want!r}")
    return check("gguf.special_tokens", not problems, "; ".join(problems) or
                 f"bos {tokenizer.bos_token_id}, eos {tokenizer.eos_token_id} as the tokenizer's")


def _chat_template(fields: dict, tokenizer) -> dict:
    want, got = tokenizer.chat_template, fields.get("tokenizer.chat_template")
    if not want:
        return check("gguf.chat_template", True, "the source has none")
    passed = got == want
    return check("gguf.chat_template", passed, f"the source's template ({len(want)} characters), byte for byte"
                 if passed else f"tokenizer.chat_template differs from the source's ({'missing' if got is None else f'{len(got)} vs {len(want)} characters'})")


def probe_ids(vocab_size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, PROBE_TOKENS), generator=g)


def dequantised_model(source: gguf.Source, path: Path, config):
    """A plain fp32 model of the source's config holding the GGUF file's weights, dequantised by the gguf package and
    un-permuted by transformers' GGUF tensor processors (conversions.gguf, the importer's own path)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gguf._fill(plain, gguf._dequantised(source, path, parsed, plain), path)
    return plain.eval()


def logits_check(source: gguf.Source, path: Path, src: Path, kind: ExportType) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(src))
    ids = probe_ids(config.get_text_config().vocab_size)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()(ids).logits.float()[0]
        got = dequantised_model(source, path, config)(ids).logits.float()[0]
    m = logit_measures(want, got)
    bound = kind.max_logit_rms
    passed = m["logit_rms"] <= bound and m["argmax_lead"] <= bound
    return {**check("gguf.logits", passed,
                    f"rms |Δlogit| {m['logit_rms']:.2e} of the source logits' std (bound {bound:g}); argmax the "
                    f"source's on {m['argmax_agreement']:.3f} of {PROBE_TOKENS} probe tokens, the largest lead lost "
                    f"{m['argmax_lead']:.2e} (bound {bound:g}); mean KL {m['mean_kl']:.1e}"), **m}


def logit_measures(want, got) -> dict:
    """How far the logits `got` are from `want` ([positions, vocabulary]), scaled by want's standard deviation:
    logit_rms, argmax_agreement, argmax_lead (the largest lead the source's argmax had over the token got picks
    instead), mean_kl (KL(want || got) per position, nats)."""
    std = want.std()
    picked = got.argmax(-1, keepdim=True)
    lead = (want.max(-1, keepdim=True).values - want.gather(-1, picked)) / std
    log_p, log_q = want.log_softmax(-1), got.log_softmax(-1)
    return {"logit_rms": ((got - want).pow(2).mean().sqrt() / std).item(),
            "argmax_agreement": (picked[:, 0] == want.argmax(-1)).float().mean().item(),
            "argmax_lead": lead.max().item(),
            "mean_kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()}


def verify_export(root: Path, against: Path | None = None) -> list[dict]:
    """`baton verify` of an export folder (after its L0): the gate again, against `against` or the parent recorded in
    its manifest when that folder is still there; else the structure walk alone."""
    from . import manifest as mf

    m = mf.read(root) or {}
    src = against or Path((m.get("parent") or {}).get("path") or "")
    type_name = (m.get("extra") or {}).get("gguf_type", "")
    path = Path(root) / GGUF_NAME
    if src != Path("") and (src / "config.json").exists() and type_name in TYPES:
        return gate(path, src, type_name)["checks"]
    checks = _structure(path)
    checks[-1].pop("source", None)
    return checks + [check("gguf.source", True, f"the parent checkpoint {str(src) or '(none recorded)'} is not here: "
                                                "the structure alone is checked")]
