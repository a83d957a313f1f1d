"""Random-init HF checkpoints the way any HF user makes them (save_pretrained), for tests and benchmarks. Nothing
here touches the process's environment, so a benchmark may import it (conftest sets a test Prefect home)."""
from __future__ import annotations

from pathlib import Path


def make_hf_checkpoint(dest: Path, arch: dict, tokenizer_dir: Path, seed: int = 0, tie: bool | None = None) -> Path:
    """A random-init LlamaForCausalLM saved the way any HF user would (save_pretrained), plus tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from conversions import hf

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    arch = dict(arch)
    if tie is not None:
        arch["tie_word_embeddings"] = tie
    config = hf.llama_config(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return dest


def make_qwen2_checkpoint(dest: Path, arch: dict, tokenizer_dir: Path, seed: int = 0, tie: bool = True) -> Path:
    """A random-init Qwen2ForCausalLM of baton's architecture dict (GQA, tied embeddings by default, as the small
    Qwen2 models have), configured with transformers' own Qwen2Config. Its q/k/v biases are random too (transformers
    starts them at zero, where a conversion that dropped them would still pass)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=arch["hidden_size"], intermediate_size=arch["ffn_hidden_size"],
                         num_hidden_layers=arch["num_layers"], num_attention_heads=arch["num_attention_heads"],
                         num_key_value_heads=arch["num_query_groups"], max_position_embeddings=arch["seq_length"],
                         rms_norm_eps=arch["norm_eps"], rope_parameters={"rope_type": "default",
                                                                         "rope_theta": arch["rope_theta"]},
                         tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return dest
