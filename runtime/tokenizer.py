"""Tokenizers built from a GGUF file's vocabulary, on Hugging Face `tokenizers`.

The vocabulary lives in the GGUF metadata (keys as gguf-py's `Keys.Tokenizer` names them):
`tokenizer.ggml.tokens` (token texts), `tokenizer.ggml.token_type` (gguf `TokenType`: 1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), `tokenizer.ggml.scores` and
`tokenizer.ggml.merges`. `tokenizer.ggml.model` names the algorithm:

- "llama": SentencePiece BPE. Spaces become U+2581 and, with `tokenizer.ggml.add_space_prefix`
  (default true), one is put before the text and after every special token. Adjacent pieces merge
  best score first, as llama.cpp's llm_tokenizer_spm does; here the scores become a merge list
  for the `tokenizers` BPE model. Characters outside the vocabulary fall back to the `<0xXX>`
  byte tokens.
- "gpt2": byte-level BPE with the ranked `tokenizer.ggml.merges`, after splitting the text with
  the regular expressions that `tokenizer.ggml.pre` names. The lists in PRE_TOKENIZERS are those
  of llama.cpp's llama-vocab.cpp (llm_tokenizer_bpe); each expression splits every piece the
  previous one left into its matches and the text between them.

Control, unknown and user-defined tokens are added tokens: user-defined ones always match their
text in the input, control and unknown ones only when `parse_special` is set (llama.cpp's rule).

Decoding follows llama.cpp's token_to_piece: a normal token gives its text (U+2581 -> space for
"llama", byte-level characters -> bytes for "gpt2"), a byte token its byte, a user-defined token
its text, and a control, unknown or unused token its text unless special tokens are skipped. The
bytes are joined and read as UTF-8, with U+FFFD for invalid sequences.
"""

from __future__ import annotations

import bisect
import codecs
import re
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from .errors import TokenizerError

if TYPE_CHECKING:
    from .model import ModelFile

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# The word regex of GPT-2; llama.cpp's "gpt-2", "mpt" and part of several other lists.
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's regex with the case-insensitive group spelled out, as llama.cpp writes it.
_LLAMA3_WORDS = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: Llama 3's with single digits.
_QWEN2_WORDS = _LLAMA3_WORDS.replace(r"\p{N}{1,3}", r"\p{N}")
_STARCODER = (r"\p{N}", _GPT2_WORDS)
_CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)

# tokenizer.ggml.pre -> the regular expressions applied in order (llama.cpp llama-vocab.cpp).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2_WORDS,),
    "mpt": (_GPT2_WORDS,),
    "llama-bpe": (_LLAMA3_WORDS,),
    "llama3": (_LLAMA3_WORDS,),
    "llama-v3": (_LLAMA3_WORDS,),
    "qwen2": (_QWEN2_WORDS,),
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]",
        _DEEPSEEK_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_RUNS,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUNS, r"\p{N}"),
}
# Pre-tokenizers for which llama.cpp takes a whole word that is a token as is (ignore_merges)
# and adds BOS unless the file says otherwise.
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})

# Texts of the tokens llama.cpp treats as end of generation whatever their id (llama-vocab.cpp).
EOG_TEXTS = frozenset({
    "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "_<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
})

_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Longest normal token (characters) k4 reads: SentencePiece's pieces are at most 16 by default
# (max_sentencepiece_length), byte-level BPE tokens rarely pass 128. The bound keeps building the
# merge list linear in the vocabulary's size (each token is cut at most once per length).
MAX_TOKEN_CHARS = 1024


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE character of each byte value (GPT-2's bytes_to_unicode, in OpenAI's
    encoder.py): printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 on,
    in byte order. Returns character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary (see the module docstring for the algorithms).

    Attributes: n_vocab (number of tokens), model ("llama" or "gpt2"), pre (the pre-tokenizer
    name, "default" for "llama"), bos_id / eos_id (None when the vocabulary has none), add_bos /
    add_eos (whether encode adds them by default), bos_text / eos_text (their texts, "" when
    absent), eog_ids (every id that ends generation), tokens / types (text and gguf TokenType of
    each id), strips_first_space (a "llama" vocabulary with add_space_prefix).
    """

    def __init__(self, tokens: list[str], types: list[int], hf: HFTokenizer, model: str, pre: str,
                 bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool, eog_ids: frozenset[int],
                 add_space_prefix: bool):
        self.tokens = tokens
        self.types = types
        self.model = model
        self.pre = pre
        self.n_vocab = len(tokens)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and eos_id is not None
        self.bos_text = tokens[bos_id] if bos_id is not None else ""
        self.eos_text = tokens[eos_id] if eos_id is not None else ""
        self.eog_ids = eog_ids
        self.strips_first_space = model == "llama" and add_space_prefix
        self._hf = hf

    @classmethod
    def from_model(cls, mf: "ModelFile") -> "Tokenizer":
        """Build the tokenizer of an open GGUF (a vocabulary-only file will do).

        Defaults for absent keys are llama.cpp's: "llama" has BOS 1, EOS 2 and adds BOS; "gpt2"
        adds no BOS unless its pre-tokenizer is Llama 3's, and has no BOS/EOS unless the file
        names them (llama.cpp would guess id 11, Falcon's). Raises TokenizerError, naming the file,
        when the vocabulary is missing or inconsistent, or its model or pre-tokenizer is unknown.
        """
        where = str(mf.path)
        model = mf.meta(Keys.Tokenizer.MODEL)
        tokens = mf.meta(Keys.Tokenizer.LIST)
        if model is None or not tokens:
            raise TokenizerError(f"{where}: no vocabulary (tokenizer.ggml.model/tokens missing); convert the model with its tokenizer")
        n_vocab = len(tokens)
        types = [int(t) for t in mf.meta(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * n_vocab]
        if len(types) != n_vocab:
            raise TokenizerError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens; the file is corrupt")
        _check_tokens(where, tokens, types)

        if model == "llama":
            scores = mf.meta(Keys.Tokenizer.SCORES) or [0.0] * n_vocab
            if len(scores) != n_vocab:
                raise TokenizerError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n_vocab} tokens; the file is corrupt")
            pre = "default"
            add_space_prefix = bool(mf.meta(Keys.Tokenizer.ADD_PREFIX, True))
            hf = _spm_tokenizer(tokens, types, scores, add_space_prefix)
            bos_default, eos_default, add_bos_default = 1, 2, True
        elif model == "gpt2":
            pre = mf.meta(Keys.Tokenizer.PRE) or "default"
            if pre not in PRE_TOKENIZERS:
                raise TokenizerError(f"{where}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; k4 knows {', '.join(sorted(PRE_TOKENIZERS))}")
            merges = mf.meta(Keys.Tokenizer.MERGES)
            if not merges:
                raise TokenizerError(f"{where}: tokenizer.ggml.merges is missing; a gpt2 vocabulary needs its merges, re-convert the model")
            add_space_prefix = False
            hf = _bpe_tokenizer(tokens, merges, pre)
            bos_default, eos_default, add_bos_default = None, None, pre in _LLAMA3_PRE
        else:
            raise TokenizerError(f"{where}: tokenizer model {model!r} is not supported; k4 reads 'llama' (SentencePiece) and 'gpt2' (byte-level BPE)")
        _add_special_tokens(hf, tokens, types)

        def token_id(key: str, default: int | None) -> int | None:
            value = mf.meta(key, default)
            return int(value) if value is not None and 0 <= int(value) < n_vocab else None

        bos_id = token_id(Keys.Tokenizer.BOS_ID, bos_default)
        eos_id = token_id(Keys.Tokenizer.EOS_ID, eos_default)
        ends = {token_id(Keys.Tokenizer.EOT_ID, None), token_id(Keys.Tokenizer.EOM_ID, None), eos_id}
        ends |= {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
        ends.discard(None)
        return cls(
            tokens, types, hf, model, pre, bos_id, eos_id,
            bool(mf.meta(Keys.Tokenizer.ADD_BOS, add_bos_default)), bool(mf.meta(Keys.Tokenizer.ADD_EOS, False)),
            frozenset(ends), add_space_prefix,
        )

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`.

        add_bos / add_eos: put BOS first / EOS last (None: the model's add_bos / add_eos flag; no
        effect when the vocabulary has no such token). parse_special: text of control tokens in
        the input (e.g. "<|im_start|>") becomes those tokens; otherwise it is tokenized as text.
        """
        self._hf.encode_special_tokens = not parse_special
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`, as if they began a text: for "llama" with add_space_prefix, the
        space that encoding puts before the text is dropped, so decode(encode(s)) == s for text
        the vocabulary covers. skip_special drops control, unknown and unused tokens."""
        stream = self.stream_decoder(skip_special=skip_special, at_start=True)
        return "".join(stream.add(i) for i in ids) + stream.flush()

    def piece(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. "▁Once", "Ġthe", "<0x0A>")."""
        return self.tokens[token_id]

    def is_eog(self, token_id: int) -> bool:
        """Whether the token ends generation: EOS, EOT, EOM, or one of EOG_TEXTS."""
        return token_id in self.eog_ids

    def stream_decoder(self, skip_special: bool = True, at_start: bool = False) -> "StreamDecoder":
        """A StreamDecoder for ids that follow a prompt (at_start False: each token's text as
        is, e.g. " there" after "Once upon a time") or that begin the text (at_start True: the
        same text as decode)."""
        return StreamDecoder(self, skip_special, at_start)

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes a token contributes to the text (llama.cpp token_to_piece); b"" for a special
        token when skip_special."""
        if skip_special and self.types[token_id] in _SPECIAL_TYPES:
            return b""
        return self._token_bytes[token_id]

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Per id, the bytes of its text (built on first use: ~0.1 s for 150k tokens)."""
        if self.model == "llama":
            normal = [t.replace(SPM_SPACE, " ").encode() for t in self.tokens]
        else:
            alphabet = byte_level_alphabet()
            to_latin1 = str.maketrans({c: chr(b) for c, b in alphabet.items()})
            normal = [_byte_level_bytes(t, to_latin1) for t in self.tokens]
        out = []
        for text, data, ttype in zip(self.tokens, normal, self.types):
            if ttype == TokenType.NORMAL:
                out.append(data)
            elif ttype == TokenType.BYTE:
                out.append(bytes([int(text[3:-1], 16)]))
            else:
                out.append(text.encode())
        return out


class StreamDecoder:
    """Text from token ids fed one at a time, for streaming output.

    `add(token_id)` returns the text that is complete so far and not yet returned: a character
    split over several tokens (byte-fallback `<0xXX>` tokens, byte-level pieces) comes out whole
    with its last token, never half. `flush()` returns what is left (an unfinished UTF-8 sequence
    becomes U+FFFD). With at_start, the first token after an optional BOS loses the leading space
    that a "llama" tokenizer adds, so the concatenated output equals Tokenizer.decode(ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool, at_start: bool):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._strip_space = at_start and tokenizer.strips_first_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one id; returns the newly completed text ("" while a character is unfinished)."""
        data = self._tok.token_bytes(token_id, self._skip_special)
        if self._strip_space and token_id != self._tok.bos_id:
            self._strip_space = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The rest of the text: U+FFFD for an unfinished character, else ""."""
        return self._utf8.decode(b"", final=True)


def _check_tokens(where: str, tokens: list[str], types: list[int]) -> None:
    """Raise TokenizerError for a byte token whose text is not `<0xXX>` or a normal token longer
    than MAX_TOKEN_CHARS characters."""
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype == TokenType.BYTE and not _BYTE_TOKEN.fullmatch(text):
            raise TokenizerError(f"{where}: token {i} has type BYTE but text {text[:20]!r}; byte tokens are written <0xXX>, the file is corrupt")
        if ttype == TokenType.NORMAL and len(text) > MAX_TOKEN_CHARS:
            raise TokenizerError(f"{where}: token {i} is {len(text):,} characters long; k4 reads tokens of at most {MAX_TOKEN_CHARS:,}")


def _byte_level_bytes(text: str, to_latin1: dict[int, str]) -> bytes:
    """Bytes of a byte-level BPE token text; characters outside the alphabet stay as UTF-8."""
    mapped = text.translate(to_latin1)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        return b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode() for c in mapped)


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as a ranked merge list: every (left, right) pair of vocabulary pieces
    whose join is a normal, user-defined or unused token, best-scored join first (ties: lower
    id). llama.cpp's llm_tokenizer_spm repeatedly merges the adjacent pair whose join scores
    best, which is what the `tokenizers` BPE model does with these ranks."""
    known = set(tokens)
    lengths = sorted({len(t) for t in known if 0 < len(t) <= MAX_TOKEN_CHARS})  # a join's halves have these lengths
    mergeable = (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED)
    order = sorted((i for i, t in enumerate(types) if t in mergeable and 1 < len(tokens[i]) <= 2 * MAX_TOKEN_CHARS),
                   key=lambda i: (-scores[i], i))
    merges = []
    for i in order:
        text = tokens[i]
        cuts = (k for k in lengths[:bisect.bisect_left(lengths, len(text))])
        merges.extend((text[:k], text[k:]) for k in cuts if text[:k] in known and text[k:] in known)
    return merges


def _spm_tokenizer(tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool) -> HFTokenizer:
    """The `tokenizers` pipeline of a "llama" vocabulary: spaces -> U+2581 (one added in front
    when add_space_prefix), then BPE with byte fallback."""
    vocab = {text: i for i, text in enumerate(tokens)}
    unk = next((tokens[i] for i, t in enumerate(types) if t == TokenType.UNKNOWN), None)
    hf = HFTokenizer(BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores), unk_token=unk, byte_fallback=True, fuse_unk=True))
    escape = normalizers.Replace(" ", SPM_SPACE)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape]) if add_space_prefix else escape
    return hf


def _bpe_tokenizer(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    """The `tokenizers` pipeline of a "gpt2" vocabulary: the pre-tokenizer regexes, bytes ->
    byte-level characters, then BPE with the file's ranked merges (merges naming a token the
    vocabulary lacks are dropped)."""
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1:]
        if cut > 0 and left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    hf = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return hf


def _add_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (matched only when parsing
    special text), user-defined ones plain added tokens (always matched), both on raw text."""
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if t and ty in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if t and ty == TokenType.USER_DEFINED]
    hf.add_special_tokens(special)
    hf.add_tokens(user)
