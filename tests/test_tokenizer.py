"""Tokenizer: llama.cpp's vocabulary suites, round trips, streaming, BOS/EOS and EOG rules."""

from __future__ import annotations

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k4.runtime.errors import TokenizerError
from k4.runtime.model import open_model
from k4.runtime.tokenizer import Tokenizer

VOCABS = ("llama-spm", "gpt-2", "falcon", "deepseek-llm")

@pytest.fixture(scope="module")
def vocab(data):
    """name -> Tokenizer for tests/data/vocab/ggml-vocab-{name}.gguf, "stories" for stories260K (opened once)."""

    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            path = data / "models" / "stories260K.gguf" if name == "stories" else data / "vocab" / f"ggml-vocab-{name}.gguf"
            cache[name] = Tokenizer.from_model(open_model(path, require_weights=False))
        return cache[name]

    return get


def read_suite(path):
    """(text, expected ids) pairs of a llama.cpp vocab test (.inp/.out, format in tests/data/README.md)."""
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""
    lines = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    expected = [[int(x) for x in line.split()] for line in lines[: len(texts) - 1]]
    return list(zip(texts[:-1], expected))


def write_vocab(path, tokens, types, model="gpt2", pre="gpt-2", merges=(), scores=None, space_prefix=None, add_eos=None,
                **ids):
    """A vocabulary-only GGUF; ids: bos/eos/eot = token id keys."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(list(merges))
    if scores is not None:
        w.add_token_scores(scores)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    for key, value in ids.items():
        getattr(w, f"add_{key}_token_id")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_model(path, require_weights=False)


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_suite_matches_llama_cpp(vocab, data, name):
    tok = vocab(name)
    cases = read_suite(data / "vocab" / f"ggml-vocab-{name}.gguf")
    assert len(cases) == 46
    wrong = [(text, got, ids) for text, ids in cases if (got := tok.encode(text, add_bos=False)) != ids]
    assert wrong == []


def test_vocab_metadata(vocab):
    spm, gpt2, falcon, deepseek = (vocab(n) for n in VOCABS)
    assert (spm.model, spm.n_vocab, spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == ("llama", 32000, 1, 2, True, False)
    assert (gpt2.model, gpt2.pre, gpt2.n_vocab, gpt2.bos_id, gpt2.add_bos) == ("gpt2", "gpt-2", 50257, 50256, False)
    assert (falcon.pre, falcon.eos_id, falcon.eos_text) == ("falcon", 11, "<|endoftext|>")
    assert (deepseek.pre, deepseek.bos_id, deepseek.add_bos) == ("deepseek-llm", 100000, True)
    assert spm.bos_text == "<s>" and spm.eos_text == "</s>"


def test_stories_once_upon_a_time(vocab):
    tok = vocab("stories")
    ids = tok.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    assert [tok.piece(i) for i in ids] == ["<s>", "▁Once", "▁upon", "▁a", "▁time"]
    assert tok.decode(ids, skip_special=True) == "Once upon a time"
    assert tok.decode(ids) == "<s>Once upon a time"
    assert tok.decode(ids[1:]) == "Once upon a time"


def test_add_bos_and_eos(vocab):
    tok = vocab("stories")
    assert tok.encode("Once")[0] == 1
    assert tok.encode("Once", add_bos=False) == [403]
    assert tok.encode("Once", add_bos=False, add_eos=True) == [403, 2]
    assert tok.encode("") == [1]
    gpt2, deepseek = vocab("gpt-2"), vocab("deepseek-llm")
    assert gpt2.encode("Hello") == [15496]
    assert gpt2.encode("Hello", add_bos=True) == [50256, 15496]
    assert deepseek.encode("Hello")[0] == 100000


def test_parse_special(vocab):
    gpt2 = vocab("gpt-2")
    assert gpt2.encode("a<|endoftext|>", parse_special=True) == [64, 50256]
    plain = gpt2.encode("a<|endoftext|>")
    assert 50256 not in plain and gpt2.decode(plain) == "a<|endoftext|>"
    spm = vocab("stories")
    # The space prefix is added after a special token too, as llama.cpp does.
    assert spm.encode("</s>Once", add_bos=False, parse_special=True) == [2, 403]
    assert 2 not in spm.encode("</s>Once", add_bos=False)


def test_decode_skip_special(vocab):
    gpt2 = vocab("gpt-2")
    ids = gpt2.encode("Hi there") + [50256]
    assert gpt2.decode(ids) == "Hi there<|endoftext|>"
    assert gpt2.decode(ids, skip_special=True) == "Hi there"


_TEXT = st.text(
    alphabet=st.characters(whitelist_categories=("L", "N", "P", "S", "Zs"), whitelist_characters="\n\t", blacklist_characters="\u2581\ufffd"),
    max_size=40,
)


@pytest.mark.parametrize("name", (*VOCABS, "stories"))
def test_round_trip_and_stream(vocab, name):
    tok = vocab(name)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_TEXT)
    def check(text):
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text
        stream = tok.stream_decoder(at_start=True)
        parts = [stream.add(i) for i in ids] + [stream.flush()]
        assert "".join(parts) == text
        assert not any("\ufffd" in p for p in parts)

    check()


def test_stream_spm_byte_fallback(vocab):
    tok = vocab("stories")
    ids = tok.encode("a ☃ b", add_bos=False)
    assert [tok.piece(i) for i in ids] == ["▁a", "▁", "<0xE2>", "<0x98>", "<0x83>", "▁b"]
    stream = tok.stream_decoder(at_start=True)
    assert [stream.add(i) for i in ids] == ["a", " ", "", "", "☃", " b"]
    assert stream.flush() == ""


def test_stream_byte_level_split_character(vocab):
    tok = vocab("gpt-2")
    ids = tok.encode("😀!")
    assert len(ids) >= 3
    stream = tok.stream_decoder()
    out = [stream.add(i) for i in ids]
    assert "".join(out) == "😀!" and out[0] == ""
    assert all(o in ("", "😀", "!", "😀!") for o in out)


def test_stream_flush_unfinished_character(vocab):
    tok = vocab("stories")
    stream = tok.stream_decoder()
    assert stream.add(tok.encode("☃", add_bos=False)[1]) == ""  # <0xE2> alone
    assert stream.flush() == "\ufffd"


def test_stream_continuation_keeps_the_space(vocab):
    tok = vocab("stories")
    ids = tok.encode("Once upon a time there was")
    prompt, rest = ids[:5], ids[5:]
    stream = tok.stream_decoder()
    continuation = "".join(stream.add(i) for i in rest) + stream.flush()
    assert continuation == " there was"
    assert tok.decode(prompt, skip_special=True) + continuation == "Once upon a time there was"
    skipping = tok.stream_decoder(skip_special=True, at_start=True)
    assert "".join(skipping.add(i) for i in ids) == "Once upon a time there was"


def test_eog(vocab):
    assert vocab("stories").is_eog(2) and not vocab("stories").is_eog(1)
    assert vocab("gpt-2").is_eog(50256)
    assert vocab("falcon").eog_ids == frozenset({11})
    assert vocab("deepseek-llm").is_eog(100001) and not vocab("deepseek-llm").is_eog(100000)


def test_eog_by_text_and_eot_key(tmp_path):
    tokens = ["a", "b", "ab", "<|im_end|>", "<|im_start|>", "<|eot_id|>", "<x>"]
    types = [1, 1, 1, 3, 3, 3, 4]
    mf = write_vocab(tmp_path / "v.gguf", tokens, types, merges=["a b"], bos=4, eos=6, eot=5)
    tok = Tokenizer.from_model(mf)
    assert tok.eog_ids == frozenset({3, 5, 6})
    assert (tok.bos_id, tok.add_bos, tok.bos_text) == (4, False, "<|im_start|>")
    # User-defined tokens match even without parse_special; control tokens only with it.
    assert tok.encode("ab<x>a<|im_end|>", parse_special=True) == [2, 6, 0, 3]
    assert tok.encode("ab<x>a<|im_end|>") == [2, 6, 0]
    assert tok.decode([2, 6, 3], skip_special=True) == "ab<x>"


def test_llama3_pre_adds_bos_by_default(tmp_path):
    mf = write_vocab(tmp_path / "v.gguf", ["a", "b", "ab", "<|begin_of_text|>"], [1, 1, 1, 3], pre="llama-bpe", merges=["a b"], bos=3)
    tok = Tokenizer.from_model(mf)
    assert tok.add_bos and tok.encode("ab") == [3, 2]


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("llama-bpe", [4, 4, 6]),  # digits in runs of up to 3
        ("qwen2", [0, 1, 2, 0, 1, 2, 6]),  # single digits
        ("smollm", [0, 1, 2, 0, 1, 2, 6]),
        ("gpt-2", [4, 4, 6]),  # one run of digits, then BPE
        ("default", [4, 4, 6]),
    ],
)
def test_pre_tokenizer_digit_rules(tmp_path, pre, expected):
    tokens = ["1", "2", "3", "12", "123", "x", "Ġx", "Ġ"]
    mf = write_vocab(tmp_path / "v.gguf", tokens, [1] * len(tokens), pre=pre, merges=["1 2", "12 3", "Ġ x"])
    assert Tokenizer.from_model(mf).encode("123123 x") == expected


SPM_TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "▁", "▁a", "▁b"]  # a tiny SentencePiece vocabulary: unk, BOS, EOS, pieces


@pytest.mark.parametrize(("space_prefix", "ids", "text"), [(None, [6, 7], "a b"), (True, [6, 7], "a b"), (False, [3, 7], "a b")])
def test_spm_space_prefix(tmp_path, space_prefix, ids, text):
    tokens = SPM_TOKENS
    mf = write_vocab(tmp_path / "v.gguf", tokens, [2, 3, 3, 1, 1, 1, 1, 1], model="llama", pre=None,
                     scores=[0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0], space_prefix=space_prefix)
    tok = Tokenizer.from_model(mf)
    assert tok.encode("a b", add_bos=False) == ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pre": "klingon"}, "pre-tokenizer 'klingon'"),
        ({"model": "bert"}, "tokenizer model 'bert'"),
        ({"model": None}, "no vocabulary"),
        ({"merges": ()}, "tokenizer.ggml.merges is missing"),
    ],
)
def test_tokenizer_errors_name_the_file(tmp_path, kwargs, message):
    args = {"merges": ["a b"], **kwargs}
    mf = write_vocab(tmp_path / "bad.gguf", ["a", "b", "ab"], [1, 1, 1], **args)
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_model(mf)
    assert message in str(err.value) and "bad.gguf" in str(err.value) and "\n" not in str(err.value)


def test_spm_without_scores_or_special_ids_takes_llama_cpps_defaults(tmp_path):
    """A "llama" vocabulary with no scores, BOS/EOS keys: scores 0 (ties by id), BOS 1, EOS 2,
    BOS added; a character it has no piece or byte for is its unknown token; add_eos_token adds
    EOS."""
    tokens = SPM_TOKENS
    types = [2, 3, 3, 1, 1, 1, 1, 1]
    tok = Tokenizer.from_model(write_vocab(tmp_path / "v.gguf", tokens, types, model="llama", pre=None))
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    assert tok.encode("a b") == [1, 6, 7]
    assert tok.encode("a c", add_bos=False) == [6, 5, 0]  # "c": no piece, no <0x63> byte token
    eos = Tokenizer.from_model(write_vocab(tmp_path / "eos.gguf", tokens, types, model="llama", pre=None, add_eos=True))
    assert eos.add_eos and eos.encode("a") == [1, 6, 2]


def test_spm_without_a_space_prefix_keeps_a_leading_space_when_decoding(tmp_path):
    tokens = SPM_TOKENS
    kinds = [2, 3, 3, 1, 1, 1, 1, 1]
    plain = Tokenizer.from_model(write_vocab(tmp_path / "p.gguf", tokens, kinds, model="llama", pre=None, space_prefix=False))
    prefixed = Tokenizer.from_model(write_vocab(tmp_path / "s.gguf", tokens, kinds, model="llama", pre=None, space_prefix=True))
    assert plain.decode([7, 6]) == " b a" and prefixed.decode([7, 6]) == "b a"


def test_bpe_merges_naming_missing_tokens_are_dropped(tmp_path):
    mf = write_vocab(tmp_path / "v.gguf", ["a", "b", "ab", "c"], [1, 1, 1, 1], merges=["x y", "a b", "c d", "b c"])
    assert Tokenizer.from_model(mf).encode("abc") == [2, 3]


def test_special_ids_must_name_a_token(tmp_path):
    """BOS/EOS ids are used when 0 <= id < n_vocab (0 included); an id past the vocabulary is
    treated as absent rather than indexing past it."""
    tokens, types = ["<s>", "a", "b", "ab"], [3, 1, 1, 1]
    tok = Tokenizer.from_model(write_vocab(tmp_path / "v.gguf", tokens, types, merges=["a b"], bos=0, eos=4))
    assert (tok.bos_id, tok.bos_text, tok.eos_id) == (0, "<s>", None)
    assert tok.encode("ab", add_bos=True) == [0, 3]


def test_llama3_pre_takes_a_whole_word_from_the_vocabulary_before_merging(tmp_path):
    """Llama 3's BPE (llama.cpp's ignore_merges) takes a word that is a token as that token; other
    pre-tokenizers build it by merges, which here reach only "ab" + "c"."""
    tokens, merges = ["a", "b", "c", "abc", "ab"], ["a b"]
    llama3 = Tokenizer.from_model(write_vocab(tmp_path / "l.gguf", tokens, [1] * 5, pre="llama-bpe", merges=merges))
    gpt2 = Tokenizer.from_model(write_vocab(tmp_path / "g.gguf", tokens, [1] * 5, pre="gpt-2", merges=merges))
    assert llama3.encode("abc", add_bos=False) == [3] and gpt2.encode("abc") == [4, 2]
