"""Tiny random-weight BERT GGUFs for the embeddings-only mode: an embedding model and a reranker (a rank head).

A `transformers` BertModel (or BertForSequenceClassification with one label) of 2 layers and 64 dimensions is
initialised from a seed and written to GGUF with the `gguf` package, under llama.cpp's names for its `bert`
architecture (gguf's own tensor name map), with a small WordPiece vocabulary in llama.cpp's phantom-space form
(a word-initial piece starts with U+2581, a continuation "##x" is written "x"). The reranker's rank head is BERT's
own pooler (dense + tanh on the [CLS] row) then its classifier, which is what llama.cpp's rank pooling computes
with `cls` and `cls.output`, so its scores are the transformers model's logits.

Built once per weights and cached under the test cache (contracts.cache), like the other fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(5)
WORDS = ("the a an and or of to in on at is was are be it this that with for as by from cat cats dog dogs kitten "
         "puppy sat sit sitting mat rug sofa chair floor house home garden tree sun rain weather cold warm hot day "
         "night tax taxes filing filings due april money bank loan interest quarterly report reports paris france "
         "capital city river bridge car train plane fast slow red blue green big small new old good bad what where "
         "when who how why which food bread cheese apple pie cook cooking recipe hello world there run running "
         "ran read reading book books").split()
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz0123456789")
PUNCTUATION = tuple(".,!?;:'\"()-")
HIDDEN, LAYERS, HEADS, FF, POSITIONS = 64, 2, 4, 128, 128
VERSION = 1  # bump when the file's layout changes: the cache key


def vocabulary() -> list[str]:
    """WordPiece vocabulary as BERT's vocab.txt lists it: specials, words, single characters, "##" continuations."""
    pieces = [*WORDS, *LETTERS, *PUNCTUATION, *(f"##{c}" for c in LETTERS), "##ing", "##ed"]
    return [*SPECIAL, *dict.fromkeys(pieces)]  # a one-letter word is its letter: each piece once


def bert_config(seed: int = 0):
    from transformers import BertConfig
    return BertConfig(vocab_size=len(vocabulary()), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, intermediate_size=FF, max_position_embeddings=POSITIONS,
                      type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      num_labels=1, pad_token_id=PAD)


def torch_model(kind: str, seed: int = 0):
    """The transformers model the GGUF holds (eval mode): kind "embed" (BertModel) or "rank" (one-label
    BertForSequenceClassification)."""
    import torch
    from transformers import BertForSequenceClassification, BertModel
    torch.manual_seed(seed)
    config = bert_config(seed)
    model = BertForSequenceClassification(config) if kind == "rank" else BertModel(config, add_pooling_layer=False)
    with torch.no_grad():  # BERT's own init (std 0.02) leaves every output alike; wider weights tell inputs apart
        for name, param in model.named_parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.15)
            elif "LayerNorm" not in name:
                param.normal_(0.0, 0.05)
    return model.eval()


def write_tiny_bert_gguf(path: Path, kind: str = "embed", seed: int = 0) -> Path:
    """kind "embed": mean pooling, no head; "rank": rank pooling with BERT's pooler and a one-label classifier."""
    model = torch_model(kind, seed)
    bert = model.bert if kind == "rank" else model
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, LAYERS)
    tensors = []
    for name, value in bert.state_dict().items():
        if name == "embeddings.position_ids" or name.startswith("pooler."):
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        tensors.append((mapped, value))
    if kind == "rank":  # llama.cpp's rank head: cls (dense, then tanh) is BERT's pooler, cls.output its classifier
        state = model.state_dict()
        tensors += [("cls.weight", state["bert.pooler.dense.weight"]), ("cls.bias", state["bert.pooler.dense.bias"]),
                    ("cls.output.weight", state["classifier.weight"]), ("cls.output.bias", state["classifier.bias"])]
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name(f"tiny-bert-{kind}")
    writer.add_context_length(POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_layer_norm_eps(model.config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK if kind == "rank" else gguf.PoolingType.MEAN)
    if kind == "rank":
        writer.add_classifier_output_labels(["LABEL_0"])
    writer.add_token_type_count(2)
    _write_vocab(writer)
    for name, value in tensors:
        writer.add_tensor(name, value.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_vocab(writer: gguf.GGUFWriter) -> None:
    tokens, types = [], []
    for token in vocabulary():
        if token in SPECIAL:
            tokens.append(token)
            types.append(gguf.TokenType.UNKNOWN if token == "[UNK]" else gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(CLS)
    writer.add_sep_token_id(SEP)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_mask_token_id(MASK)


def tiny_bert_gguf(kind: str = "embed", seed: int = 0) -> str:
    """The cached file (built on first use), under EDGE_LLM_CACHE's tests folder."""
    from contracts.cache import cache_root
    folder = cache_root() / "tests"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tiny-bert-{kind}-s{seed}-v{VERSION}.gguf"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.partial")
        write_tiny_bert_gguf(partial, kind, seed)
        os.replace(partial, path)  # a concurrent builder's file is as good
    return str(path)
