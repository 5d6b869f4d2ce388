"""A character-level tokenizer for the tiny test models (no hub download)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = 0, 1, 2


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII, one token per character; ids 0-2 are <pad>, <s>, </s> (99 in all)."""
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
