"""GGUF (llama.cpp's single-file format) → a Hugging Face safetensors folder.

A GGUF file is untrusted bytes. It is copied once into a private file while hashing (what is hashed is what is read:
the original may change afterwards without effect), its structure is walked with bounds checks before any other
reader sees it (`check_structure`), and only then is that private copy read: transformers' GGUF support (the `gguf`
package's reader: a numpy memmap, no pickle, no code) parses it once for the config, its tokenizer path reads the
vocabulary, and the weights are taken from the blocks at the offsets the walk checked, dequantised by the `gguf`
package. The walk refuses what a reader would otherwise follow blindly: a string or array longer than the rest of the
file, an array of billions of empty elements (the reader loops over every one), a tensor whose data lies outside the
file.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .refusal import Refused

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_FILE_BYTES = 64 << 30          # larger than any model this CPU lane could dequantise in memory
MAX_DIMS = 4                       # GGML_MAX_DIMS
MAX_ARRAY_ITEMS = 1 << 24          # tokenizer vocabularies and merges are at most a few hundred thousand
MAX_NESTING = 4
MAX_KEY_BYTES = 1 << 16
DEFAULT_ALIGNMENT = 32
# GGUF value types: scalars by size; 8 = string, 9 = array (gguf.constants.GGUFValueType)
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
RECORDED_KEYS = ("general.architecture", "general.name", "general.file_type", "general.alignment")


class GGUFError(Refused):
    pass


@dataclass(frozen=True)
class Tensor:
    """One entry of the tensor table as the structure walk read it; its bytes lie at data_start + offset."""
    name: str
    shape: tuple[int, ...]  # torch order (the file lists the fastest-moving dimension first)
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class Source:
    """The GGUF file as imported: where it came from, its digest, and what its header says."""
    path: Path
    sha256: str
    size: int
    version: int = 0
    tensor_count: int = 0
    metadata: dict = field(default_factory=dict)     # the RECORDED_KEYS the header has
    tensor_types: dict = field(default_factory=dict)  # quantisation type name → number of tensors
    tensors: list = field(default_factory=list, repr=False)  # Tensor entries, checked to lie inside the file
    data_start: int = 0

    def describe(self) -> dict:
        return {"format": "gguf", "path": str(self.path), "sha256": self.sha256, "size": self.size,
                "gguf_version": self.version, "tensor_count": self.tensor_count, "metadata": self.metadata,
                "tensor_types": self.tensor_types}


def private_copy(src: Path, work: Path, limit: int = MAX_FILE_BYTES) -> Source:
    """Copy src into work (a folder only this process writes) while hashing it; GGUFError past `limit` bytes."""
    src = Path(src)
    if not src.is_file():
        raise GGUFError(f"{src}: not a file")
    digest, size, dst = hashlib.sha256(), 0, Path(work) / "model.gguf"
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(8 << 20):
            size += len(chunk)
            if size > limit:
                raise GGUFError(f"{src}: larger than {limit} bytes, the import limit")
            digest.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return Source(src.resolve(), digest.hexdigest(), size)


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> bytes:
        """The next n bytes (GGUFError when the file has fewer)."""
        self.skip(n, what)
        return self.data[self.pos - n:self.pos]

    def skip(self, n: int, what: str) -> None:
        left = len(self.data) - self.pos
        if n < 0 or n > left:
            raise GGUFError(f"{self.path}: {what} at byte {self.pos} needs {n} bytes, the file has {left} left")
        self.pos += n

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.u64(what)
        if limit is not None and n > limit:
            raise GGUFError(f"{self.path}: {what} at byte {self.pos} is {n} bytes long (the limit is {limit})")
        return self.take(n, what)


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0):
    """Skip one value of type vtype; return it when it is a scalar or a string (arrays: None)."""
    if vtype in SCALAR_BYTES:
        raw = cur.take(SCALAR_BYTES[vtype], key)
        return struct.unpack("<I", raw)[0] if vtype == UINT32 else None
    if vtype == STRING:
        return cur.string(key).decode("utf-8", "replace")
    if vtype != ARRAY:
        raise GGUFError(f"{cur.path}: {key}: unknown value type {vtype}")
    if depth >= MAX_NESTING:
        raise GGUFError(f"{cur.path}: {key}: arrays nested deeper than {MAX_NESTING}")
    itype, n = cur.u32(key), cur.u64(key)
    if n > MAX_ARRAY_ITEMS:
        raise GGUFError(f"{cur.path}: {key}: an array of {n} items (the limit is {MAX_ARRAY_ITEMS})")
    if itype in SCALAR_BYTES:
        cur.skip(n * SCALAR_BYTES[itype], key)
        return None
    for _ in range(n):  # strings or arrays: each item is at least 8 bytes, so the file's size bounds the loop
        _value(cur, itype, key, depth + 1)
    return None


def check_structure(source: Source, path: Path) -> Source:
    """Walk the header of the GGUF file at path (the private copy) with bounds checks; fill source's header fields.
    GGUFError naming the file, the key or tensor, and the byte offset on anything out of bounds."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

    if source.size < 24:
        raise GGUFError(f"{source.path}: {source.size} bytes, too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cur = _Cursor(data, source.path)
        if cur.take(4, "magic") != MAGIC:
            raise GGUFError(f"{source.path}: not a GGUF file (its first bytes are not {MAGIC!r})")
        source.version = cur.u32("version")
        if source.version not in VERSIONS:
            raise GGUFError(f"{source.path}: GGUF version {source.version} (readable: {VERSIONS})")
        tensor_count, kv_count = cur.u64("tensor count"), cur.u64("key count")
        if kv_count > len(data) // 12 or tensor_count > len(data) // 24:
            raise GGUFError(f"{source.path}: the header claims {kv_count} keys and {tensor_count} tensors, more "
                            f"than {len(data)} bytes can hold")
        for _ in range(kv_count):
            key = cur.string("a key", MAX_KEY_BYTES).decode("utf-8", "replace")
            value = _value(cur, cur.u32(key), key)
            if key in RECORDED_KEYS and value is not None:
                source.metadata[key] = value
        infos = [_tensor_info(cur, GGML_QUANT_SIZES) for _ in range(tensor_count)]
        alignment = source.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{source.path}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        for t in infos:
            if data_start + t.offset + t.nbytes > len(data):
                raise GGUFError(f"{source.path}: tensor {t.name}: its {t.nbytes} bytes at offset {t.offset} lie "
                                f"past the end of the file")
            kind = GGMLQuantizationType(t.ggml_type).name
            source.tensor_types[kind] = source.tensor_types.get(kind, 0) + 1
        source.tensor_count, source.tensors, source.data_start = tensor_count, infos, data_start
    if source.metadata.get("general.file_type") in {t.value for t in LlamaFileType}:
        source.metadata["file_type_name"] = LlamaFileType(source.metadata["general.file_type"]).name
    return source


def _tensor_info(cur: _Cursor, quant_sizes: dict) -> Tensor:
    name = cur.string("a tensor name", MAX_KEY_BYTES).decode("utf-8", "replace")
    n_dims = cur.u32(name)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{cur.path}: tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = [cur.u64(name) for _ in range(n_dims)]
    ttype, offset = cur.u32(name), cur.u64(name)
    if ttype not in quant_sizes:
        raise GGUFError(f"{cur.path}: tensor {name}: unknown data type {ttype}")
    block, type_bytes = quant_sizes[ttype]
    elements = 1
    for d in dims:
        elements *= d
    if dims[0] % block:
        raise GGUFError(f"{cur.path}: tensor {name}: row of {dims[0]} is not a whole number of {block}-blocks")
    return Tensor(name, tuple(reversed(dims)), ttype, offset, elements // block * type_bytes)


def to_hf(source: Source, gguf_path: Path, dest: Path) -> None:
    """Dequantise the GGUF file at gguf_path (the private copy, its structure checked into source) into dest:
    config.json, generation_config.json, fp32 safetensors, the tokenizer with its chat template."""
    from transformers.integrations.gguf import is_gguf_arch_supported

    if is_gguf_arch_supported(source.metadata.get("general.architecture")):
        plain, tokenizer = _through_from_pretrained(gguf_path)  # transformers' newer path reads the header once
    else:
        plain, tokenizer = _parsed_once(source, gguf_path)
    Path(dest).mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))


def _parsed_once(source: Source, gguf_path: Path) -> tuple:
    """(model, tokenizer) with transformers' full GGUF parse (the gguf package's reader, which decodes every token
    string: ~20 s of CPU for Gemma's 262,144) run once, for the config, where `from_pretrained(gguf_file=...)` runs it
    three times (tokenizer, config, weights). The tokenizer comes from transformers' GGUF tokenizer path, the weights
    from the blocks where the structure walk found them, through transformers' tensor processors (llama.cpp's q/k
    permutation undone, Gemma's 1 + w norms less one): the bits `from_pretrained` gives, in a plain model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    config = AutoConfig.for_model(**parsed["config"])
    tokenizer = _tokenizer_class(config).from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    with no_init_weights():  # every weight is overwritten (a missing one is refused), so no random init
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill(plain, _dequantised(source, gguf_path, parsed["config"], plain), gguf_path)
    return plain, tokenizer


def _through_from_pretrained(gguf_path: Path) -> tuple:
    """(model, tokenizer) by `from_pretrained(gguf_file=...)`. transformers cannot save a model it loaded from GGUF
    (it counts as quantised), so the dequantised weights go into a plain model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(gguf_path).parent), Path(gguf_path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill(plain, loaded.state_dict(), gguf_path)
    return plain, tokenizer


def _fill(plain, weights: dict, gguf_path: Path) -> None:
    """Load weights into plain, tying its output to its embedding where the config says so; GGUFError when any
    other weight is missing or one is left over."""
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if plain.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise GGUFError(f"{gguf_path}: the dequantised weights do not fit {type(plain).__name__}: missing "
                        f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    plain.tie_weights()


def _tokenizer_class(config):
    """The class AutoTokenizer picks for a GGUF file (which has no tokenizer files to name one): the config's.
    Taken here because AutoTokenizer would parse the whole file again to learn that config."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return TokenizersBackend if cls is None or cls.__name__ == "MistralCommonBackend" else cls


def _value_dtypes() -> dict:
    """ggml types the gguf package's reader hands over as values rather than bytes (GGUFReader._build_tensors)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    return {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
            T.I32: np.int32, T.I64: np.int64}


def _dequantised(source: Source, gguf_path: Path, config: dict, model) -> dict:
    """{HF name: fp32 tensor} as transformers' GGUF loader builds them (modeling_gguf_pytorch_utils
    .load_gguf_checkpoint): each tensor's bytes, shaped as the gguf package's reader shapes them, dequantised by that
    package, passed through the architecture's tensor processor with the parsed config, renamed by the model's GGUF
    name map."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, dequantize, quant_shape_to_byte_shape
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(source.metadata["general.architecture"], TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    parsed = {"tensors": {}}  # a processor that splits or stores a tensor itself writes here, as in the loader
    data, values = np.memmap(str(gguf_path), mode="r", dtype=np.uint8), _value_dtypes()
    for t in source.tensors:
        kind = GGMLQuantizationType(t.ggml_type)
        raw = data[source.data_start + t.offset:source.data_start + t.offset + t.nbytes]
        blocks = (raw.view(values[kind]).reshape(t.shape) if kind in values
                  else raw.reshape(quant_shape_to_byte_shape(t.shape, kind)))
        result = processor.process(weights=dequantize(blocks, kind), name=t.name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            parsed["tensors"][names[result.name]] = torch.from_numpy(np.copy(result.weights)).to(torch.float32)
    return parsed["tensors"]
