import random

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer

EOS = 2  # <|im_end|>

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "code": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n    return a + b\n\n\nclass X:\n\tpass\n",
    "multilingual": "Hi 👋 日本語のテキスト, café naïve Ünïcödé 🇫🇷 👨‍👩‍👧 中文，很好。 한국어 😀😀",
}


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(tokenizer):
    return encode(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def stream(tokenizer, ids, prompt=(), **kwargs):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    deltas = [detok.add(token_id) for token_id in ids]
    return detok, deltas, detok.flush()


@pytest.mark.parametrize("name", TEXTS)
def test_deltas_concatenate_to_the_full_decode_and_never_split_a_character(tokenizer, name):
    ids = encode(tokenizer, TEXTS[name])
    detok, deltas, tail = stream(tokenizer, ids, prompt=chat_prompt(tokenizer))
    assert "".join(deltas) + tail == tokenizer.decode(ids) == TEXTS[name]
    assert detok.text == TEXTS[name]
    assert not any("\ufffd" in delta for delta in deltas + [tail])
    assert not detok.stopped and detok.stop_string is None


def test_characters_spread_over_several_tokens_wait_until_complete(tokenizer):
    ids = encode(tokenizer, "日本 👋")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case under test occurs
    _, deltas, tail = stream(tokenizer, ids)
    assert [d for d in deltas if d] == ["日", "本", " ", "👋"] and tail == ""


def test_first_token_keeps_its_leading_space(tokenizer):
    _, deltas, _ = stream(tokenizer, encode(tokenizer, " Sure, here it is."), prompt=chat_prompt(tokenizer))
    assert deltas[0] == " Sure"


def test_random_token_ids_match_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 6))]
        _, deltas, tail = stream(tokenizer, ids, prompt=prompt)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_several_tokens_is_cut_out(tokenizer):
    ids = encode(tokenizer, "The answer is 42.\nUser: thanks")
    assert not any("\nUser:" in tokenizer.decode([i]) for i in ids)
    detok, deltas, tail = stream(tokenizer, ids, stop=["\nUser:"])
    assert detok.text == "".join(deltas) + tail == "The answer is 42."
    assert detok.stopped and detok.stop_string == "\nUser:"
    assert detok.add(encode(tokenizer, " more")[0]) == "" and detok.text == "The answer is 42."


def test_stop_string_inside_one_token_keeps_the_text_before_it(tokenizer):
    ids = encode(tokenizer, "Hello world")
    assert tokenizer.decode([ids[0]]) == "Hello"
    detok, deltas, tail = stream(tokenizer, ids, stop=["zzz", "ll"])
    assert deltas == ["He", ""] and tail == ""
    assert detok.text == "He" and detok.stopped and detok.stop_string == "ll"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok, _, _ = stream(tokenizer, encode(tokenizer, "a ### b ## c"), stop=["###", "b"])
    assert detok.text == "a " and detok.stop_string == "###"


def test_partial_stop_string_is_held_back_and_flushed_when_it_never_completes(tokenizer):
    ids = encode(tokenizer, "The value is </ans")
    detok, deltas, tail = stream(tokenizer, ids, stop=["</answer>"])
    assert "".join(deltas) == "The value is "  # "</ans" could still become "</answer>"
    assert tail == "</ans" and detok.text == "The value is </ans" and not detok.stopped


def test_held_back_text_is_released_once_it_cannot_be_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["</answer>"])
    released = [detok.add(i) for i in encode(tokenizer, "The value is </answers")]
    assert released[-2:] == [" ", "</answers"] and detok.flush() == ""  # " </" showed only " "


def test_stop_string_can_be_found_in_the_flushed_tail(tokenizer):
    ids = encode(tokenizer, "x 日")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["\ufffd"])
    assert "".join(detok.add(i) for i in ids[:-1]) == "x "  # the last byte of 日 never arrives
    assert detok.flush() == "" and detok.stopped and detok.text == "x "


@pytest.mark.parametrize("skip, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_special_tokens_are_hidden_unless_asked_for(tokenizer, skip, expected):
    ids = encode(tokenizer, "Hi there") + [EOS]
    detok, deltas, tail = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == detok.text == expected == tokenizer.decode(ids, skip_special_tokens=skip)


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded_lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def decode_work_per_token(tokenizer, ids):
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, chat_prompt(tokenizer))
    counting.decoded_lengths.clear()
    for token_id in ids:
        detok.add(token_id)
    return max(counting.decoded_lengths), sum(counting.decoded_lengths) / len(ids)


def test_cost_per_token_does_not_grow_with_output_length(tokenizer):
    ids = encode(tokenizer, (TEXTS["english"] + " " + TEXTS["multilingual"] + "\n") * 60)[:2000]
    assert len(ids) == 2000
    short_max, short_work = decode_work_per_token(tokenizer, ids[:200])
    long_max, long_work = decode_work_per_token(tokenizer, ids)
    assert short_max == long_max <= 8
    assert long_work <= 1.2 * short_work


def test_include_stop_keeps_the_stop_string_and_ends_there(tokenizer):
    ids = encode(tokenizer, "The answer is 42.\nUser: thanks")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["\nUser:"], include_stop=True)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == detok.text == "The answer is 42.\nUser:" and detok.stopped


def test_no_stop_string_counts_while_check_stop_is_off(tokenizer):
    ids = encode(tokenizer, "Stop here. Then stop here again.")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["here"])
    first = len(encode(tokenizer, "Stop here."))
    text = "".join(detok.add(token, check_stop=i >= first) for i, token in enumerate(ids)) + detok.flush()
    assert text == "Stop here. Then stop " and detok.stopped  # the first "here" was before min_tokens
