"""The sampling options an OpenAI client sends, through the whole engine (tiny model, greedy)."""
import pytest

from engine import LLM, SamplingParams

PROMPT = "Tell me about paged attention."


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=64)


def greedy(llm, **options):
    params = SamplingParams(temperature=0.0, **{"max_tokens": 12, **options})
    return llm.generate([PROMPT], params)[0].outputs[0]


def test_min_tokens_holds_back_stop_tokens_until_reached(llm):
    first = greedy(llm).token_ids[0]
    stopped = greedy(llm, stop_token_ids=[first])
    assert stopped.finish_reason == "stop" and stopped.token_ids == [first]  # it stops at once
    held = greedy(llm, stop_token_ids=[first], min_tokens=6, max_tokens=6)
    assert held.finish_reason == "length" and len(held.token_ids) == 6 and first not in held.token_ids


def test_min_tokens_holds_back_eos_even_when_eos_is_ignored(llm, monkeypatch):
    first = greedy(llm).token_ids[0]
    monkeypatch.setattr(llm.engine.core, "eos_token_id", first)  # the reply's first token is now eos
    assert greedy(llm).finish_reason == "stop"
    read_on = greedy(llm, ignore_eos=True, max_tokens=6)
    assert read_on.token_ids[0] == first and len(read_on.token_ids) == 6  # eos sampled, then read past
    held = greedy(llm, ignore_eos=True, min_tokens=6, max_tokens=6)  # as vLLM: never through an eos
    assert first not in held.token_ids and len(held.token_ids) == 6 and held.finish_reason == "length"


def test_min_tokens_holds_back_stop_strings_too(llm):
    text = greedy(llm, max_tokens=24, ignore_eos=True).text
    stop = text[1:4]  # found at once, in the output's first token or so
    assert stop.strip(), text
    assert greedy(llm, max_tokens=24, ignore_eos=True, stop=[stop]).finish_reason == "stop"
    late = greedy(llm, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=24)
    assert late.finish_reason == "length" and late.text == text  # no stop string counted before 24 tokens


def test_include_stop_str_in_output(llm):
    text = greedy(llm, max_tokens=24, ignore_eos=True).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.index(stop)
    assert greedy(llm, max_tokens=24, ignore_eos=True, stop=[stop]).text == text[:cut]
    kept = greedy(llm, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:cut + len(stop)] and kept.finish_reason == "stop"


def test_penalties_change_a_repetitive_greedy_output(llm):
    plain = greedy(llm, max_tokens=24, ignore_eos=True)
    assert len(set(plain.token_ids)) < len(plain.token_ids), "the tiny model repeats itself greedily"
    varied = greedy(llm, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(varied.token_ids)) > len(set(plain.token_ids))


def test_the_stop_token_that_ends_a_reply_is_not_in_its_text(llm):
    """As in vLLM: a stop token (eos, or one of stop_token_ids) ends the reply without its text,
    special or not, unless include_stop_str_in_output asks for it."""
    free = greedy(llm, max_tokens=8, ignore_eos=True)
    stop = free.token_ids[3]
    ended = greedy(llm, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], skip_special_tokens=False)
    assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[:4]
    kept = greedy(llm, max_tokens=8, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
    stop_text = llm.engine.tokenizer.decode([stop])
    assert kept.text.endswith(stop_text) and ended.text == kept.text[:len(kept.text) - len(stop_text)]
