"""Offline stand-ins for smoke tests: a small BPE tokenizer and a tiny random Llama.

Neither downloads anything. The tokenizer is trained in memory on the given text (a
byte-level BPE, so any text encodes); the model is a 2-layer Llama built from a config.
"""

from __future__ import annotations

from collections.abc import Iterable


def train_toy_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts`, with a BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def build_toy_llama(vocab_size: int = 512, *, hidden_size: int = 32, num_layers: int = 2,
                    max_position_embeddings: int = 8192, seed: int = 0):
    """A tiny random-weight `LlamaForCausalLM` (float32, CPU, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
