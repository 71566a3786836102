"""The structured-output benchmarks' own logic, without a model or a server: the JSON Schema
validator they judge replies with, how they judge tool calls, choices, patterns and refusals, the
figures and goals from canned replies, and that each script, pointed at a port where nothing
listens, records failures and still ends with its table and JSON line."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import SchemaError

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import structured  # noqa: E402
import structured_checks as checks  # noqa: E402
from schema_check import assert_readable, judge, schema_errors  # noqa: E402

# ---- the validator ---------------------------------------------------------------------------------

VALID = {
    "person": {"name": "Ada", "age": 36, "email": "ada@example.com"},
    "product": {"name": "lamp", "price": 12.5, "in_stock": True, "tags": ["light", "camping"]},
    "weather": {"city": "Oslo", "temperature_c": -3, "condition": "snow"},
    "book": {"title": "SPQR", "author": {"first": "Mary", "last": "Beard"}, "year": 2015, "genres": ["history"]},
    "todo": {"tasks": [{"title": "pack", "done": False}]},
    "sentiment": {"sentiment": "neutral", "confidence": 1},
    "recipe": {"name": "pancakes", "servings": 4, "vegetarian": True, "ingredients": [{"item": "flour", "grams": 200}]},
    "event": {"title": "party", "date": "2025-06-01", "location": {"city": "Paris", "country": "France"}},
    "verdict": {"answer": True, "reason": "photos", "extra": "allowed: not closed"},
    "color": {"name": "red", "rgb": [255, 0, 0]},
}


def test_every_benchmark_schema_takes_a_valid_instance():
    assert set(VALID) == set(checks.SCHEMAS)
    for name, instance in VALID.items():
        assert schema_errors(instance, checks.SCHEMAS[name]) == [], name
        assert judge(json.dumps(instance), checks.SCHEMAS[name]) == (True, "ok")


@pytest.mark.parametrize("name, instance, expected", [
    ("person", {"name": "Ada", "age": "36", "email": "a@b"}, "$.age: '36' is not of type 'integer'"),
    ("person", {"name": "Ada", "age": True, "email": "a@b"}, "$.age: True is not of type 'integer'"),
    ("person", {"name": "Ada", "email": "a@b"}, "$: 'age' is a required property"),
    ("person", {"name": "Ada", "age": 3, "email": "a@b", "x": 1}, "('x' was unexpected)"),
    ("product", {"name": "a", "price": True, "in_stock": True}, "$.price: True is not of type 'number'"),
    ("product", {"name": "a", "price": 1, "in_stock": True, "tags": ["a", "b", "c", "d"]}, "$.tags: ['a', 'b', 'c', 'd'] is too long"),
    ("weather", {"city": "Oslo", "temperature_c": 1, "condition": "fog"}, "$.condition: 'fog' is not one of"),
    ("book", {"title": "t", "author": {"first": "a"}, "year": 1}, "$.author: 'last' is a required property"),
    ("book", {"title": "t", "author": {"first": "a", "last": "b"}, "year": 1, "genres": ["poetry", "jazz"]},
     "$.genres[1]: 'jazz' is not one of"),
    ("todo", {"tasks": [{"title": "a", "done": "no"}]}, "$.tasks[0].done: 'no' is not of type 'boolean'"),
    ("color", {"name": "red", "rgb": [255, 0]}, "$.rgb: [255, 0] is too short"),
    ("color", [255, 0, 0], "$: [255, 0, 0] is not of type 'object'"),
])
def test_the_validator_names_what_is_wrong(name, instance, expected):
    errors = schema_errors(instance, checks.SCHEMAS[name])
    assert any(expected in error for error in errors), errors
    assert judge(json.dumps(instance), checks.SCHEMAS[name])[0] is False


def test_json_numbers_and_enums_compare_as_json_does():
    assert schema_errors(3.0, {"type": "integer"}) == []  # an integral number is an integer
    assert schema_errors(3.5, {"type": "integer"}) != []
    assert schema_errors(True, {"enum": [1]}) != [] and schema_errors(1.0, {"enum": [1]}) == []
    assert schema_errors(None, {"type": ["string", "null"]}) == []


def test_text_that_is_not_json_fails_with_its_reason():
    assert judge('{"a": 1', None)[0] is False and "not JSON" in judge('{"a": 1', None)[1]
    assert judge("NaN", None)[0] is False  # Python reads it; JSON has no such value
    assert judge("", None) == (False, "empty reply") and judge(None, None) == (False, "empty reply")
    assert judge("[1]", {"type": "object"}) == (False, "$: [1] is not of type 'object'")


def test_a_schema_that_is_not_one_is_refused():
    with pytest.raises(SchemaError):
        assert_readable({"type": "objec"})
    assert_readable({"type": "array", "items": {"type": "integer", "minimum": 0}})


# ---- judging replies ---------------------------------------------------------------------------------

def call(name, arguments):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_calls_are_judged_by_name_and_by_their_arguments_schema():
    offered = ["get_weather", "search_web"]
    ok = {"content": None, "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}')]}
    assert checks.judge_tool_calls(ok, offered) == (True, "ok")
    assert checks.judge_tool_calls(ok, offered, named="get_weather") == (True, "ok")
    assert "not the named" in checks.judge_tool_calls(ok, offered, named="search_web")[1]
    assert "no tool_calls" in checks.judge_tool_calls({"content": "<tool_call>", "tool_calls": None}, offered)[1]
    assert "not among" in checks.judge_tool_calls({"tool_calls": [call("send_email", "{}")]}, offered)[1]
    # arguments that are JSON but not the parameters' object (a JSON string), and ones that break the schema
    assert "'Paris' is not of type 'object'" in checks.judge_tool_calls({"tool_calls": [call("get_weather", '"Paris"')]},
                                                                    offered)[1]
    assert "not one of" in checks.judge_tool_calls({"tool_calls": [call("get_weather", '{"city": "P", "unit": "K"}')]},
                                                   offered)[1]


def test_choice_regex_and_broken_schema_judges():
    assert checks.judge_choice("dog", ["cat", "dog"]) == (True, "ok")
    assert checks.judge_choice("dog.", ["cat", "dog"])[0] is False and checks.judge_choice(None, ["a"])[0] is False
    assert checks.judge_regex("555-123-4567", r"\d{3}-\d{3}-\d{4}") == (True, "ok")
    assert checks.judge_regex("call 555-123-4567", r"\d{3}-\d{3}-\d{4}")[0] is False  # a full match only
    assert checks.judge_broken(400, "Grammar error: Invalid type: objec", "objec") == (True, "ok")
    assert checks.judge_broken(400, "invalid json_schema", "objec") == (True, "ok")
    assert "names neither" in checks.judge_broken(400, "bad request", "objec")[1]
    assert "not 400" in checks.judge_broken(500, "Internal Server Error", "objec")[1]


def test_the_checks_table_and_json_from_canned_cases():
    results = {"json_schema": checks.row([checks.Case(True, "ok", "stop"),
                                          checks.Case(False, "not JSON: '{'", "length")]),
               "choice": checks.row([checks.Case(True, "ok", "stop")], "field: structured_outputs")}
    assert results["json_schema"]["failures"] == ["cut at max_tokens: not JSON: '{'"]
    assert results["json_schema"]["finish_reasons"] == {"stop": 1, "length": 1}
    assert results["json_schema"]["failed_cut_at_max_tokens"] == 1
    table = checks.render_table(results, "vllm", "smollm2", "http://h/v1", "Some CPU", 12.0)
    lines = table.splitlines()
    assert "vllm" in lines[0] and "Some CPU" in lines[0]
    assert lines[2].split()[:2] == ["json_schema", "1/2"] and "first failure: cut at max_tokens" in lines[2]
    assert lines[3].split()[:2] == ["choice", "1/1"] and "field: structured_outputs" in lines[3]
    assert lines[-1].split()[:2] == ["all", "2/3"]
    figures = json.loads(json.dumps(checks.summary(results, "vllm", "smollm2", "http://h/v1", "Some CPU", 12.0)))
    assert figures["passed"] == 2 and figures["total"] == 3 and figures["label"] == "vllm"


def test_the_checks_cover_what_they_promise():
    assert len(checks.JSON_SCHEMA_CASES) >= 20 and len(checks.JSON_OBJECT_PROMPTS) == 10
    assert len(checks.TOOL_CASES) >= 10 and all(2 <= len(tools) <= 3 for _, tools in checks.TOOL_CASES)
    keywords = json.dumps(checks.SCHEMAS)
    for keyword in ('"integer"', '"number"', '"boolean"', '"enum"', '"maxItems"', '"additionalProperties": false',
                    '"required"'):
        assert keyword in keywords


# ---- the speed benchmark's figures -----------------------------------------------------------------

def test_the_mixes_constrain_evenly_spread_requests_with_the_same_prompts():
    assert structured.constrained_indices(32, 16) == list(range(1, 32, 2))
    assert structured.constrained_indices(32, 0) == [] and structured.constrained_indices(32, 32) == list(range(32))
    half, free = structured.batch(32, 16), structured.batch(32, 0)
    assert [a.prompt for a in half] == [a.prompt for a in free] and len(set(a.prompt for a in free)) == 32
    assert {a.schema for a in half if a.constrained} == set(structured.SCHEMAS)
    body = structured.request_body("m", half[1], 64, exact=True)
    assert body["min_tokens"] == body["max_tokens"] == 64 and body["ignore_eos"] is True
    assert body["response_format"]["json_schema"]["schema"] == structured.SCHEMAS[half[1].schema]
    assert "response_format" not in structured.request_body("m", half[0], 64, exact=True)
    assert "ignore_eos" not in structured.request_body("m", half[0], 64, exact=False)


def canned(constrained: bool, tokens: int, gap_s: float, finish: str = "length", valid: bool = True):
    return structured.Reply(constrained, ok=True, tokens=tokens, chunks=tokens, gaps_s=[gap_s] * (tokens - 1),
                            finish_reason=finish, valid=valid if constrained else None)


def test_mix_figures_pool_rounds_and_split_the_tokens_by_kind():
    round1 = [canned(True, 40, 0.05, "stop"), canned(False, 64, 0.02)]
    round2 = [canned(True, 64, 0.05, valid=False), canned(False, 64, 0.02),
              structured.Reply(False, error="HTTP 500: boom")]
    f = structured.mix_figures(2, [(round1, 2.0), (round2, 2.0)])
    assert f["requests"] == 5 and f["done"] == 4 and f["failed"] == 1 and f["errors"] == ["HTTP 500: boom"]
    assert f["tokens"] == 232 and f["tok_s"] == 58.0
    assert f["constrained_tok_s"] == 26.0 and f["free_tok_s"] == 32.0  # shares of the same wall time
    assert f["constrained_tokens_per_reply"] == 52.0 and f["free_tokens_per_reply"] == 64.0
    assert f["itl_free_p99_ms"] == 20.0 and f["itl_constrained_p50_ms"] == 50.0
    assert f["finish_constrained"] == {"length": 1, "stop": 1} and f["finish_free"] == {"length": 2}
    assert f["constrained_valid"] == 1 and f["tokens_from"] == "usage"


def mixes(tok_s_free, tok_s_all, itl_free, itl_half, constrained_tok_s):
    def mix(n, tok_s, itl, c_tok_s):
        return {"constrained": n, "tok_s": tok_s, "itl_free_p99_ms": itl, "constrained_tok_s": c_tok_s}
    return {"mixes": {"0": mix(0, tok_s_free, itl_free, None), "16": mix(16, 300, itl_half, 150),
                      "32": mix(32, tok_s_all, None, constrained_tok_s)}}


def test_goals_are_met_not_met_or_not_run():
    ours = mixes(tok_s_free=400, tok_s_all=380, itl_free=100, itl_half=105, constrained_tok_s=380)
    goals = structured.goals({"ours": ours, "vllm": mixes(300, 200, 90, 95, 200)}, 32)
    assert [g["met"] for g in goals.values()] == [True, True, True]
    slow = mixes(tok_s_free=400, tok_s_all=300, itl_free=100, itl_half=150, constrained_tok_s=300)
    goals = structured.goals({"ours": slow, "vllm": mixes(300, 320, 90, 95, 320)}, 32)
    assert [g["met"] for g in goals.values()] == [False, False, False]
    goals = structured.goals({"ours": ours, "vllm": {"missing": "not set up"}}, 32)
    assert [g["met"] for g in goals.values()] == [True, True, None]


def test_the_report_and_json_from_canned_figures():
    f = structured.mix_figures(1, [([canned(True, 64, 0.05), canned(False, 64, 0.02)], 2.0)])
    targets = {"ours": {"url": "u", "model": "m", "mixes": {"1": f}}, "vllm": {"missing": "did not come up"}}
    settings = {"cpu": "Some CPU", "chats": 2, "mixes": [1], "rounds": 1, "max_tokens": 64, "exact": True,
                "dtype": "float32"}
    lines = structured.report(targets, settings).splitlines()
    assert "Some CPU" in lines[0] and "exactly 64" in lines[0] and lines[1] == structured.HEADER
    assert lines[2].split()[:5] == ["ours", "1", "2", "0", "64"] and lines[2].split()[-1] == "1/1"
    assert lines[3] == "vllm     not run: did not come up"
    assert sum(line.startswith("goal: ") for line in lines) == 3
    figures = json.loads(json.dumps(structured.summary(targets, settings)))
    assert figures["targets"]["ours"]["mixes"]["1"]["tok_s"] == 64.0 and len(figures["goals"]) == 3


# ---- the scripts, with nothing listening ------------------------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(*args):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_the_checks_record_an_unreachable_server_as_failures():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    lines, figures = run_script("benchmarks/structured_checks.py", "--base-url", url, "--model", "m", "--label", "ours")
    assert figures["passed"] == 0 and figures["total"] >= 70 and figures["label"] == "ours"
    assert all(check["failures"] for check in figures["checks"].values())
    assert "APIConnectionError" in figures["checks"]["json_schema"]["failures"][0]
    assert any(line.startswith("all ") for line in lines)


def test_the_speed_benchmark_reports_an_unreachable_server_as_not_run():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    lines, figures = run_script("benchmarks/structured.py", "--base-url", url, "--label", "ours", "--chats", "4")
    assert "URLError" in figures["targets"]["ours"]["missing"]
    assert [g["met"] for g in figures["goals"].values()] == [None, None, None]
    assert any(line.startswith("ours     not run") for line in lines)


def test_the_grammar_library_benchmark_measures_xgrammar():
    done = subprocess.run([sys.executable, "benchmarks/grammar_libraries.py", "--vocab", "49152"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    row = next(r for r in result["rows"] if r["library"] == "xgrammar")
    assert row["vocab"] == 49152 and row["compile_ms"] > 0 and row["mask_us_p50"] > 0 and row["reply_tokens"] > 20
