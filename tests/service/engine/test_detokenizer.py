"""Incremental detokenization gives, piece by piece, exactly what decoding the whole sequence gives.

Checked on two real tokenizers with different decoders: the byte-level BPE the test models use (characters split
across tokens) and a SentencePiece-style Metaspace BPE (the leading space depends on what came before). Both the
DecodeStream path and the fallback are held to the same reference, and to each other piece by piece.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from service.engine.detokenizer import OffsetDetokenizer, StreamDetokenizer, make_detokenizer, stream_decodable
from service.model.corpus_tokenizer import corpus_text, make_tokenizer

TEXTS = [
    "Slow and steady wins the race.",
    "café naïve — 🦊 über ¿qué? 東京",
    "  two  spaces\nand a newline\t tab",
]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-like BPE ("▁" for spaces, byte fallback off) trained on the bundled text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request):
    return make_tokenizer() if request.param == "byte_level" else metaspace_tokenizer()


def pieces(detok, ids: list[int]) -> list[str]:
    return [detok.push(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]


@pytest.mark.parametrize("text", TEXTS)
def test_both_paths_rebuild_the_whole_decode_and_agree_piece_by_piece(tokenizer, text: str):
    prompt = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    generated = tokenizer(" " + text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    expected = tokenizer.decode(prompt + generated, skip_special_tokens=True)[
        len(tokenizer.decode(prompt, skip_special_tokens=True)) :
    ]
    stream = make_detokenizer(tokenizer, prompt)
    fallback = make_detokenizer(tokenizer, prompt, streaming=False)
    assert isinstance(stream, StreamDetokenizer) and isinstance(fallback, OffsetDetokenizer)
    from_stream, from_fallback = pieces(stream, generated), pieces(fallback, generated)
    assert "".join(from_stream) == expected
    assert from_stream == from_fallback
    assert not any("\ufffd" in p for p in from_stream)


def test_the_prompt_gives_the_first_token_its_leading_space():
    tok = metaspace_tokenizer()
    prompt = tok("The fox", add_special_tokens=False)["input_ids"]
    word = tok(" ran", add_special_tokens=False)["input_ids"]
    assert tok.decode(word) == "ran"  # alone, Metaspace drops the space the word carries
    for streaming in (True, False):
        assert "".join(pieces(make_detokenizer(tok, prompt, streaming=streaming), word)) == " ran"


def test_a_character_split_across_tokens_is_held_back_until_complete():
    tok = make_tokenizer()
    fox = tok("🦊", add_special_tokens=False)["input_ids"]
    assert len(fox) > 1, "the emoji must span tokens for this test to mean anything"
    for streaming in (True, False):
        detok = make_detokenizer(tok, [], streaming=streaming)
        out = [detok.push(t) for t in fox]
        assert out[:-1] == [""] * (len(fox) - 1) and out[-1] == "🦊"


def test_a_sequence_ending_mid_character_flushes_its_bytes_on_the_last_token():
    tok = make_tokenizer()
    fox = tok("🦊", add_special_tokens=False)["input_ids"]
    whole = tok.decode(fox[:-1], skip_special_tokens=True)
    assert whole and set(whole) == {"\ufffd"}
    for streaming in (True, False):
        assert "".join(pieces(make_detokenizer(tok, [], streaming=streaming), fox[:-1])) == whole


def test_ids_past_the_vocabulary_decode_to_nothing_and_do_not_stall_the_stream():
    tok = make_tokenizer()
    ids = tok(" and so on", add_special_tokens=False)["input_ids"]
    for streaming in (True, False):
        detok = make_detokenizer(tok, [], streaming=streaming)
        assert detok.push(len(tok) + 3) == ""
        assert "".join(pieces(detok, ids)) == " and so on"


def test_tokenizers_that_clean_up_spaces_take_the_fallback():
    tok = make_tokenizer()
    assert stream_decodable(tok)
    tok.clean_up_tokenization_spaces = True
    assert not stream_decodable(tok)
    assert isinstance(make_detokenizer(tok, []), OffsetDetokenizer)
    assert not stream_decodable(object())
