"""Limits checked before any work: a request that can never fit the context is refused in O(1).

Contract:
- `PromptLimits(max_context, max_prompt_bytes)`: a prompt must tokenize to fewer than `max_context`
  tokens (one new token must fit). `max_prompt_bytes` is the most UTF-8 bytes a prompt that fits can
  have: (max_context - 1) tokens x the longest token's bytes x how much the tokenizer's normalizer can
  shrink text (`tokenizer_prompt_bytes`); None when the tokenizer can drop or absorb input (then only
  the message size bounds the text).
- `check(request_pb)` looks only at lengths: `prompt_token_ids` longer than the context, or `prompt`
  longer in bytes than `max_prompt_bytes`, raise InvalidRequest naming the field, before the ids are
  copied, validated or the text tokenized.
- `request_bytes()` is the largest request message a full context needs (ids or text, stop strings,
  sampling), the basis of the server's default receive limit.

Why a byte bound holds for a byte-level BPE tokenizer: its pre-tokenizer maps every input byte to
exactly one symbol and drops none, every symbol belongs to some token, and a token covers at most
`max_token_bytes` bytes; the normalizer runs first, and Unicode normalization shrinks text by at most
3x (NFC / NFD: a Hangul syllable from three 3-byte jamo) or 4x (NFKC / NFKD: a 4-byte mathematical
letter to one ASCII byte); tests/test_security_limits.py recomputes both factors over every code point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from service.types import MAX_STOP_LENGTH, MAX_STOP_STRINGS, InvalidRequest

# How many times fewer UTF-8 bytes a normalizer's output can have than its input.
NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4}
REQUEST_OVERHEAD_BYTES = 1024  # tags, lengths, sampling parameters, max_new_tokens
FALLBACK_REQUEST_BYTES = 1 << 20  # without a byte bound for text: the previous fixed default


def varint_bytes(value: int) -> int:
    """Bytes of `value` as a protobuf varint."""
    return max(1, (max(value, 1).bit_length() + 6) // 7)


@dataclass(frozen=True)
class PromptLimits:
    max_context: int
    max_prompt_bytes: int | None = None
    vocab_size: int = 1 << 31  # bounds the bytes one id takes on the wire

    def check(self, request_pb) -> None:
        ids = len(request_pb.prompt_token_ids)  # O(1): the repeated field's length
        if ids >= self.max_context:
            raise InvalidRequest("prompt_token_ids", f"{ids} tokens; the context holds {self.max_context} "
                                                     "including at least one new token")
        if self.max_prompt_bytes is not None and request_pb.prompt:
            size = len(request_pb.prompt.encode("utf-8"))
            if size > self.max_prompt_bytes:
                raise InvalidRequest("prompt", f"{size} bytes can never fit the context of {self.max_context} "
                                               f"tokens (at most {self.max_prompt_bytes} bytes for this tokenizer)")

    def request_bytes(self) -> int:
        """The largest request message a full context needs."""
        ids = (self.max_context - 1) * varint_bytes(self.vocab_size - 1)
        if self.max_prompt_bytes is None:
            return max(FALLBACK_REQUEST_BYTES, ids + REQUEST_OVERHEAD_BYTES)
        stop = MAX_STOP_STRINGS * (MAX_STOP_LENGTH * 4 + 2)  # 4 UTF-8 bytes per character at most
        return max(ids, self.max_prompt_bytes) + stop + REQUEST_OVERHEAD_BYTES


def default_request_limit(limits: PromptLimits) -> int:
    """The server's default largest request: twice what a full context needs (a margin for the
    framing), and never under 64 KiB."""
    return max(64 << 10, 2 * limits.request_bytes())


def tokenizer_prompt_bytes(tokenizer, max_context: int) -> int | None:
    """`max_prompt_bytes` for a `tokenizers.Tokenizer`, or None when no bound can be proven."""
    spec = json.loads(tokenizer.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _byte_level_keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    if spec.get("model", {}).get("type") != "BPE":
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = tokenizer.get_vocab(with_added_tokens=False)
    if not all(symbol in vocab for symbol in ByteLevel.alphabet()):
        return None  # a byte with no token of its own could be dropped
    longest = 1
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip"):
            return None  # such a token swallows any amount of whitespace beside it
        longest = max(longest, len(added["content"].encode("utf-8")))
    # Byte-level vocabulary entries spell one input byte per character.
    longest = max(longest, max((len(token) for token in vocab), default=1))
    return shrink * (max_context - 1) * longest


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    return NORMALIZER_SHRINK.get(normalizer.get("type"))  # anything else may remove text: no bound


def _byte_level_keeps_every_byte(pre: dict | None) -> bool:
    """A ByteLevel pre-tokenizer, alone or after Splits that keep what they split on."""
    if pre is None:
        return False
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if "ByteLevel" not in kinds:
        return False
    for part in parts:
        if part.get("type") == "Split" and part.get("behavior") == "Removed":
            return False
        if part.get("type") not in ("Split", "ByteLevel"):
            return False
    return True
