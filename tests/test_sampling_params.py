import math

import pytest

from engine import SamplingParams


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": 1e6}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": 0}, "n must"),
    ({"n": 1000}, "n must"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop strings"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_absurd_parameters_are_refused_with_the_limit(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(temperature=0, stop="###", stop_token_ids=(5,))
    assert params.greedy and params.stop == ["###"] and params.stop_token_ids == [5]
