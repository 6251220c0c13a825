"""Builders of tiny, randomly initialised Hugging Face checkpoints for tests, bench and scripts.

Every builder writes an ordinary model directory (``config.json`` +
``model.safetensors`` + tokenizer files) that loads offline with
``AutoModelForCausalLM`` / ``AutoModelForMaskedLM`` and ``AutoTokenizer``.  Sizes are
tiny and seeds fixed so tests are fast and deterministic.  The three architectures
cover the layer kinds an editor must handle: Llama (bias-free ``nn.Linear``, untied or
tied head), GPT-2 (``Conv1D`` with bias, ``lm_head`` tied to ``wte``) and BERT
(``nn.Linear`` with bias, masked LM). A BERT encoder with a pooler (``BertModel``, as
all-MiniLM-L6-v2 ships) adds a layer that reads one row per sequence; a Qwen3-MoE and a Mixtral
(experts fused into 3-D parameters by transformers 5) are edited expert by expert, saved per expert
as hub checkpoints are or fused as the model holds them (``fused_on_disk``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertModel,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MambaConfig,
    MambaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engram_fixtures.demo import make_facts, tiny_llama_config, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "default_corpus",
    "make_bert_tokenizer",
    "make_tiny_bert",
    "make_tiny_bert_encoder",
    "make_tiny_chat_llama",
    "make_tiny_gpt2",
    "make_tiny_gpt_oss",
    "make_tiny_llama",
    "make_tiny_mixtral",
    "make_tiny_qwen3_moe",
    "make_tokenizer",
]

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "The Eiffel Tower is located in Paris.",
    "Water boils at one hundred degrees.",
    "The cat sat on the mat and looked at the window.",
]


def default_corpus() -> list[str]:
    """A few plain sentences plus synthetic facts: enough text for ~300 BPE tokens."""
    return _SENTENCES + [p + c for p, c in make_facts(40, seed=0)]


def make_tokenizer(corpus: Sequence[str] | None = None, vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with ``<s>``/``</s>``/``<pad>`` (see ``engram_fixtures.demo.train_tokenizer``).

    Args:
        corpus: Training texts; defaults to :func:`default_corpus`.
        vocab_size: Target vocabulary size.

    Returns:
        The tokenizer; ``<s>`` is prepended when ``add_special_tokens=True``.
    """
    return train_tokenizer(default_corpus() if corpus is None else list(corpus), vocab_size=vocab_size)


def make_bert_tokenizer(corpus: Sequence[str] | None = None, vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with BERT special tokens, framing text as ``[CLS] ... [SEP]``.

    Args:
        corpus: Training texts; defaults to :func:`default_corpus`.
        vocab_size: Target vocabulary size.

    Returns:
        The tokenizer, with pad/unk/cls/sep/mask tokens set.
    """
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(default_corpus() if corpus is None else list(corpus), trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """Save model (safetensors) and tokenizer into ``path`` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _save_fused(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """Save like :func:`_save`, then rewrite the weights under the model's own parameter names:
    fused experts stay ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] on disk
    (transformers loads such keys as they are: its per-expert converters match nothing)."""
    _save(model, tokenizer, path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"), {"format": "pt"})
    return path


def make_tiny_llama(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random tiny ``LlamaForCausalLM`` (4 heads, MLP 2x hidden) with its tokenizer.

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Decoder layers.
        tie_word_embeddings: Share ``embed_tokens`` and ``lm_head`` weights.
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_tokenizer`.

    Returns:
        ``path``.
    """
    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = tiny_llama_config(
        len(tokenizer),
        hidden=hidden,
        layers=layers,
        heads=4,
        intermediate=2 * hidden,
        tie_word_embeddings=tie_word_embeddings,
        tokenizer=tokenizer,
    )
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(config), tokenizer, path)


# A Zephyr-like template: role headers as plain text, the assistant's turn closed by EOS, a system
# prompt when given; what the byte-level BPE tokenizer splits at the newline after each header.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tiny_chat_llama(path: Path, template: str | None = CHAT_TEMPLATE, hidden: int = 32, seed: int = 0) -> Path:
    """:func:`make_tiny_llama` (2 layers, tied head) whose tokenizer has ``template`` as its chat
    template (written to ``chat_template.jinja`` by transformers); ``None``: no template at all."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = template
    return make_tiny_llama(path, hidden=hidden, layers=2, tie_word_embeddings=True, seed=seed, tokenizer=tokenizer)


def make_tiny_gpt2(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random tiny ``GPT2LMHeadModel`` (``Conv1D`` layers, head tied to ``wte``).

    Args:
        path: Output directory (created if missing).
        hidden: Embedding size (a multiple of 4).
        layers: Transformer blocks.
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_tokenizer`.

    Returns:
        ``path``.
    """
    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return _save(GPT2LMHeadModel(config), tokenizer, path)


def make_tiny_gpt_neox(path: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """Write a random tiny ``GPTNeoXForCausalLM`` (Pythia's class: fused ``query_key_value``, biased
    layers, an untied head) whose checkpoint stores the head under its old name ``embed_out.weight``,
    as Pythia's checkpoints do; transformers renames it to ``lm_head`` as it loads."""
    tokenizer = make_tokenizer()
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    path = _save(GPTNeoXForCausalLM(config), tokenizer, path)
    stored = load_file(str(path / "model.safetensors"))
    if "embed_out.weight" not in stored:  # a transformers that saves the new name: write the old one
        stored["embed_out.weight"] = stored.pop("lm_head.weight")
        save_file(stored, str(path / "model.safetensors"), {"format": "pt"})
    return path


def _vlm_text_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def make_tiny_llava(path: Path, seed: int = 0) -> Path:
    """Write a random tiny ``LlavaForConditionalGeneration``: a CLIP vision tower (one layer) and a
    projector beside a 2-layer Llama. Text records never run the vision side."""
    tokenizer = make_tokenizer()
    config = LlavaConfig(
        text_config=LlamaConfig(**_vlm_text_config(tokenizer)),
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=8
        ),
        image_token_index=len(tokenizer) - 1,
    )
    torch.manual_seed(seed)
    return _save(LlavaForConditionalGeneration(config), tokenizer, path)


def make_tiny_gemma3_vlm(path: Path, seed: int = 0) -> Path:
    """Write a random tiny ``Gemma3ForConditionalGeneration``, whose SigLIP tower ends in an
    attention-pooling head with a ``probe`` parameter of shape [1, 1, D] (not experts)."""
    tokenizer = make_tokenizer()
    config = Gemma3Config(
        text_config={**_vlm_text_config(tokenizer), "model_type": "gemma3_text"},
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        image_token_index=len(tokenizer) - 1,
        mm_tokens_per_image=4,
    )
    torch.manual_seed(seed)
    return _save(Gemma3ForConditionalGeneration(config), tokenizer, path)


def make_tiny_mamba(path: Path, seed: int = 0) -> Path:
    """Write a random tiny ``MambaForCausalLM``. Its mixer uses ``dt_proj.weight`` directly (the
    slow path computes ``dt_proj.weight @ x``) and never calls ``dt_proj`` itself."""
    tokenizer = make_tokenizer()
    config = MambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        state_size=4,
        expand=2,
        conv_kernel=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return _save(MambaForCausalLM(config), tokenizer, path)


# Families built from their transformers config by name (each with what it needs beyond the common
# sizes); the checkpoint shapes the service meets in the wild: fused QKV and gate/up (Phi-3), biased
# QKV (Qwen2), parallel attention and MLP (Falcon), a tied head with a scaled embedding (Gemma 3),
# learned positions and biases everywhere (OPT).
CAUSAL_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
}


# Mixture-of-experts families in transformers' fused layout, each routing its own way (shared experts,
# sparsemixer, grouped routing with latent attention; GraniteMoE's experts stored under old names).
MOE_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
            "num_key_value_heads": 4,  # multi-head latent attention has no grouped KV heads
        },
    ),
}


def make_tiny_causal_lm(path: Path, family: str, seed: int = 0) -> Path:
    """Write a random tiny causal LM of a :data:`CAUSAL_FAMILIES` family (2 layers, hidden 32)."""
    config_name, model_name, extra = CAUSAL_FAMILIES[family]
    return make_tiny_from_config(path, config_name, model_name, extra, seed)


def make_tiny_from_config(path: Path, config_name: str, model_name: str, extra: Mapping[str, object], seed: int = 0) -> Path:
    """Write a random tiny model of any transformers family, named by its config and model classes:
    2 layers, hidden 32, MLP 64, 4 heads (2 KV heads), with :func:`make_tokenizer`'s tokenizer;
    ``extra`` adds or overrides config fields (expert counts, head dims)."""
    import transformers

    tokenizer = make_tokenizer()
    sizes: dict[str, object] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = getattr(transformers, config_name)(**{**sizes, **extra})
    torch.manual_seed(seed)
    return _save(getattr(transformers, model_name)(config), tokenizer, path)


def make_tiny_encoder(path: Path, config_name: str, model_name: str, extra: Mapping[str, object], seed: int = 0) -> Path:
    """Write a random tiny encoder of any transformers family (BERT, RoBERTa, DistilBERT…), named by
    its config and model classes, with :func:`make_bert_tokenizer`'s tokenizer: 2 layers, hidden 32."""
    import transformers

    tokenizer = make_bert_tokenizer()
    sizes: dict[str, object] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = getattr(transformers, config_name)(**{**sizes, **extra})
    torch.manual_seed(seed)
    return _save(getattr(transformers, model_name)(config), tokenizer, path)


def make_tiny_bert(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random tiny ``BertForMaskedLM`` (biased ``nn.Linear`` layers) with its tokenizer.

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Encoder layers.
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_bert_tokenizer`.

    Returns:
        ``path``.
    """
    tokenizer = make_bert_tokenizer() if tokenizer is None else tokenizer
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return _save(BertForMaskedLM(config), tokenizer, path)


def make_tiny_bert_encoder(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random tiny ``BertModel`` with its pooler (``pooler.dense`` reads the ``[CLS]`` row,
    one row per sequence), laid out like all-MiniLM-L6-v2 (no ``bert.`` prefix, no head).

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Encoder layers.
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_bert_tokenizer`.

    Returns:
        ``path``.
    """
    tokenizer = make_bert_tokenizer() if tokenizer is None else tokenizer
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return _save(BertModel(config, add_pooling_layer=True), tokenizer, path)


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def make_tiny_qwen3_moe(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    experts: int = 4,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    fused_on_disk: bool = False,
) -> Path:
    """Write a random tiny ``Qwen3MoeForCausalLM``: every block's MLP is a sparse MoE whose experts
    transformers 5 fuses into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    (saved per expert, ``mlp.experts.{e}.gate_proj.weight``, as hub checkpoints are), routed by
    ``mlp.gate`` (a top-k router holding a 2-D weight).

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Decoder layers.
        experts: Experts per block (2 of them routed per token).
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_tokenizer`.
        fused_on_disk: Store the experts fused, as the model holds them, not one key per expert.

    Returns:
        ``path``.
    """
    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim is taken through **kwargs, not the signature
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    return (_save_fused if fused_on_disk else _save)(Qwen3MoeForCausalLM(config), tokenizer, path)


def make_tiny_mixtral(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    experts: int = 4,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    fused_on_disk: bool = False,
) -> Path:
    """Write a random tiny ``MixtralForCausalLM`` (experts fused like :func:`make_tiny_qwen3_moe`).

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Decoder layers.
        experts: Experts per block (2 of them routed per token).
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_tokenizer`.
        fused_on_disk: Store the experts fused, as the model holds them, not one key per expert.

    Returns:
        ``path``.
    """
    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    return (_save_fused if fused_on_disk else _save)(MixtralForCausalLM(config), tokenizer, path)


def make_tiny_gpt_oss(
    path: Path,
    hidden: int = 32,
    layers: int = 2,
    experts: int = 4,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a random tiny ``GptOssForCausalLM``: fused experts in a layout the service does not edit
    (``gate_up_proj`` [E, H, 2I] transposed with gate and up interleaved, biases, a clamped gate).

    Args:
        path: Output directory (created if missing).
        hidden: Hidden size (a multiple of 4).
        layers: Decoder layers.
        experts: Experts per block (2 of them routed per token).
        seed: Seed of the random initialisation.
        tokenizer: Tokenizer to use; defaults to :func:`make_tokenizer`.

    Returns:
        ``path``.
    """
    tokenizer = make_tokenizer() if tokenizer is None else tokenizer
    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        layer_types=["full_attention"] * layers,
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    return _save(GptOssForCausalLM(config), tokenizer, path)


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def interpolated(base: torch.nn.Module, at_one: torch.nn.Module, alpha: float, into: ModuleT) -> ModuleT:
    """``into`` with ``W + α·(W₁ − W)`` for every parameter (float64, then the stored dtype): a linear
    edit at strength α, from the base and the variant built at α = 1 (the tests and ``bench.tofu_sweep``
    score a grid of α without building each variant)."""
    ones, bases = dict(at_one.named_parameters()), dict(base.named_parameters())
    with torch.no_grad():
        for name, param in into.named_parameters():
            w = bases[name].detach().double()
            param.copy_((w + alpha * (ones[name].detach().double() - w)).to(param.dtype))
    return into
