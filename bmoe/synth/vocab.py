"""A small byte-level SentencePiece vocabulary that llama.cpp accepts for every architecture.

llama.cpp's SPM tokenizer ("llama" model) falls back to ``<0xNN>`` byte tokens for any character
it has no piece for, so 256 byte tokens make every UTF-8 string tokenizable; a few hundred normal
pieces on top keep prompts short and give the random model a spread of outputs to choose from.
The ids of ``<unk>``, ``<s>`` and ``</s>`` are SPM's defaults (0, 1, 2), so nothing depends on
the explicit id keys being read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gguf import GGUFWriter, TokenType

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
CONTROL_IDS: tuple[int, ...] = (UNK_ID, BOS_ID, EOS_ID)

SPACE = "\u2581"  # SentencePiece's visible space; llama.cpp maps " " to it before lookup

# Frequent English pieces, most useful first: SPM merges by the score of the merged piece, and
# scores fall with the position in this list. Each longer piece can be built from two shorter
# ones already in the vocabulary, otherwise the merge could never be reached.
_PIECES = (
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of",
    "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le",
    "ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne", "ea", "ra", "ce", "li", "ch", "ll",
    "be", "ma", "si", "om", "ur", "the", "ing", "ion", "and", "ent", "her", "for", "tha", "ter",
    "hat", "ere", "ate", "his", "con", "res", "ver", "all", "ons", "nce", "men",
)
_SPACE_PIECES = ("the", "and", "of", "to", "in", "is", "it", "that", "for", "on")


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)


@lru_cache(maxsize=1)
def byte_vocab() -> Vocab:
    """The vocabulary every tiny model uses (built once; it never depends on the spec)."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256

    normal = [SPACE]
    normal += [chr(c) for c in range(0x21, 0x7F)]
    normal += [SPACE + chr(c) for c in range(ord("a"), ord("z") + 1)]
    normal += [SPACE + chr(c) for c in range(ord("A"), ord("Z") + 1)]
    normal += list(_PIECES)
    normal += [SPACE + w for w in _SPACE_PIECES]
    # llama.cpp aborts the process (GGML_ASSERT) on a duplicated token text.
    assert len(set(normal)) == len(normal)

    n_special = len(tokens)
    tokens += normal
    types += [TokenType.NORMAL] * len(normal)
    # Control and byte tokens score 0 (never merge targets); normal pieces rank by position.
    scores = [0.0] * n_special + [-float(i) for i in range(len(normal))]
    return Vocab(tuple(tokens), tuple(scores), tuple(int(t) for t in types))


def write_tokenizer(writer: GGUFWriter, vocab: Vocab) -> None:
    """Add the tokenizer keys; BOS is prepended on tokenize, EOS never appended."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_scores(list(vocab.scores))
    writer.add_token_types(list(vocab.types))
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
