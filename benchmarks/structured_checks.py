"""Structured output and tool calls, checked through the official `openai` client against any
OpenAI-compatible server: does every reply keep the shape it was asked for?

    .venv/bin/python benchmarks/structured_checks.py --base-url http://127.0.0.1:8000/v1 --label ours
    bash benchmarks/peers/vllm_cpu.sh serve 8100 --enable-auto-tool-choice --tool-call-parser hermes &
    .venv/bin/python benchmarks/structured_checks.py --base-url http://127.0.0.1:8100/v1 --label vllm

The checks (each a row: passed / total, and why the others failed):

- `json_schema`: `response_format={"type": "json_schema", ...}` ("strict": true) on 24 prompts,
  each with its own schema among ten (strings, integers, numbers, booleans, nested objects,
  `required`, `enum`, arrays with `maxItems`/`minItems`, `additionalProperties: false`), at
  temperature 0.8 with room to finish (300 tokens): the reply parses and validates
  (benchmarks/schema_check.py);
- `json_object`: `response_format={"type": "json_object"}` on 10 prompts: a JSON object;
- `json_schema_stream`: one streamed json_schema reply: its joined deltas parse and validate;
- `tool_required` / `tool_named`: `tool_choice="required"`, and a named function, on 10 prompts
  each offering 2-3 tools: the reply has `tool_calls`, each call names a tool offered (the named
  one, when named) and its `arguments` parse and validate against that tool's parameters; the
  finish reasons are counted in the notes. `tool_required_strict` / `tool_named_strict`: the
  same with `"strict": true` in every function (OpenAI's flag for "arguments must follow the
  schema"; vLLM 0.32 pins the arguments to the schema only for such tools unless started with
  `--tool-strict-level parameter`);
- `tool_result`: a conversation [user, assistant with tool_calls and no content, tool message
  with its tool_call_id] gets an ordinary text reply;
- `choice` / `regex`: vLLM's `structured_outputs` extra (`extra_body`): the reply is exactly one
  of the choices, or fully matches the pattern (Python's `re.fullmatch`). A server that refuses
  `structured_outputs` (HTTP 4xx) is asked again with the older `guided_choice` / `guided_regex`;
  the notes say which name was used. (A server that ignores the field answers 200 with free
  text: that fails the check, it is not a refusal.)
- `broken_schema`: a schema that is not one (`{"type": "objec"}`, a `required` that is not a
  list) is answered with HTTP 400 whose message names the problem (the bad value, or "schema");
- `after_broken`: the request after each broken one is served as usual.

A failing reply, an HTTP error or a timeout is a failed case with its reason, never a crash.
Requests of one check go `--concurrency` at a time. Prints a table with the CPU model and the
server's label, then one JSON line with every figure and every failed case's reason.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import cpu_model  # noqa: E402
from schema_check import assert_readable, judge  # noqa: E402

TEMPERATURE = 0.8
MAX_TOKENS = 300


# ---- what is asked -----------------------------------------------------------------------------

def obj(properties: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    """An object schema: these properties, all required unless told, no others when `closed`."""
    schema = {"type": "object", "properties": properties,
              "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

SCHEMAS: dict[str, dict] = {
    "person": obj({"name": STRING, "age": INTEGER, "email": STRING}),
    "product": obj({"name": STRING, "price": NUMBER, "in_stock": BOOLEAN,
                    "tags": {"type": "array", "items": STRING, "maxItems": 3}}, ["name", "price", "in_stock"]),
    "weather": obj({"city": STRING, "temperature_c": NUMBER,
                    "condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]}}),
    "book": obj({"title": STRING, "author": obj({"first": STRING, "last": STRING}), "year": INTEGER,
                 "genres": {"type": "array", "maxItems": 2,
                            "items": {"type": "string", "enum": ["fiction", "history", "science", "poetry"]}}},
                ["title", "author", "year"]),
    "todo": obj({"tasks": {"type": "array", "maxItems": 4, "items": obj({"title": STRING, "done": BOOLEAN})}}),
    "sentiment": obj({"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                      "confidence": NUMBER}),
    "recipe": obj({"name": STRING, "servings": INTEGER, "vegetarian": BOOLEAN,
                   "ingredients": {"type": "array", "maxItems": 5, "items": obj({"item": STRING, "grams": NUMBER})}}),
    "event": obj({"title": STRING, "date": STRING, "location": obj({"city": STRING, "country": STRING}),
                  "attendees": {"type": "array", "items": STRING, "maxItems": 3}}, ["title", "date", "location"]),
    "verdict": obj({"answer": BOOLEAN, "reason": STRING}, closed=False),
    "color": obj({"name": STRING, "rgb": {"type": "array", "items": INTEGER, "minItems": 3, "maxItems": 3}}),
}

JSON_SCHEMA_CASES: list[tuple[str, str]] = [  # (schema name, prompt)
    ("person", "Invent a person who works as a lighthouse keeper. Reply in JSON."),
    ("person", "Describe a fictional chess champion as JSON."),
    ("person", "Give me a made-up contact for a bakery owner, as JSON."),
    ("product", "Describe a camping lantern for an online shop, in JSON."),
    ("product", "A product listing for a secondhand bicycle, as JSON."),
    ("product", "JSON for a box of green tea sold by a small shop."),
    ("weather", "What is the weather like in Lisbon today? Answer as JSON."),
    ("weather", "Report the weather in Oslo in winter as JSON."),
    ("book", "Describe a history book about the Roman empire as JSON."),
    ("book", "Invent a poetry book and give its details in JSON."),
    ("book", "A science fiction novel from 1965, as JSON."),
    ("todo", "Make a to-do list for moving house, as JSON."),
    ("todo", "My chores for Saturday as a JSON task list."),
    ("sentiment", "Classify the sentiment of: 'The soup was cold and the waiter was rude.' Reply in JSON."),
    ("sentiment", "Classify the sentiment of: 'Best concert of my life!' Reply in JSON."),
    ("recipe", "A simple pancake recipe as JSON."),
    ("recipe", "Give a vegetarian lentil soup recipe in JSON."),
    ("event", "Plan a birthday party in Paris and describe the event as JSON."),
    ("event", "A team meeting next Monday in Berlin, as JSON."),
    ("verdict", "Is the Earth round? Answer in JSON."),
    ("verdict", "Can penguins fly? Answer in JSON."),
    ("color", "Give me the colour of the sky at noon as a JSON object with its RGB values."),
    ("color", "Describe the colour of a ripe tomato as JSON, with RGB."),
    ("color", "What colour is fresh grass? JSON with its name and RGB."),
]

JSON_OBJECT_PROMPTS = [
    "Describe a cat as a JSON object.",
    "Give three facts about tides as a JSON object.",
    "List two European capitals with their countries, as a JSON object.",
    "Return a JSON object describing a sunny day.",
    "A JSON object with a username and a favourite number.",
    "Summarise the plot of Cinderella as a JSON object.",
    "Give a JSON object for a car with make, model and year.",
    "A JSON object describing the planet Mars.",
    "Describe your ideal breakfast as a JSON object.",
    "A JSON object mapping three colours to fruits of that colour.",
]

STREAM_CASE = ("recipe", "A recipe for tomato salad as JSON.")


def tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def strict(tool_: dict) -> dict:
    """The tool with `"strict": true`: its arguments must follow its parameters' schema."""
    return {**tool_, "function": {**tool_["function"], "strict": True}}


TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in (
    tool("get_weather", "Current weather for a city.",
         obj({"city": STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])),
    tool("search_web", "Search the web.", obj({"query": STRING, "max_results": INTEGER}, ["query"])),
    tool("send_email", "Send an email.", obj({"to": STRING, "subject": STRING, "body": STRING})),
    tool("convert_currency", "Convert an amount of money.", obj({"amount": NUMBER, "source": STRING, "target": STRING})),
    tool("set_reminder", "Set a reminder.", obj({"text": STRING, "minutes": INTEGER, "urgent": BOOLEAN}, ["text", "minutes"])),
    tool("add_to_cart", "Add an item to the shopping cart.",
         obj({"item": STRING, "quantity": INTEGER, "options": {"type": "array", "items": STRING, "maxItems": 3}},
             ["item", "quantity"])),
    tool("book_table", "Book a restaurant table.",
         obj({"restaurant": STRING, "people": INTEGER, "time": STRING, "outdoor": BOOLEAN}, ["restaurant", "people", "time"])),
)}

TOOL_CASES: list[tuple[str, list[str]]] = [  # (prompt, tools offered: the first one fits the prompt)
    ("What's the weather in Madrid right now?", ["get_weather", "search_web"]),
    ("Find me articles about volcanoes.", ["search_web", "get_weather", "send_email"]),
    ("Email Anna that the meeting moves to 3pm.", ["send_email", "set_reminder"]),
    ("How much is 120 US dollars in euros?", ["convert_currency", "search_web", "get_weather"]),
    ("Remind me to call the dentist in 30 minutes.", ["set_reminder", "send_email"]),
    ("Put two bags of coffee beans in my cart.", ["add_to_cart", "search_web", "convert_currency"]),
    ("Book a table for four at Luigi's at 8pm.", ["book_table", "set_reminder"]),
    ("Is it raining in Dublin? Use fahrenheit.", ["get_weather", "book_table", "add_to_cart"]),
    ("Convert 50 pounds to yen.", ["convert_currency", "send_email"]),
    ("Search for the best sourdough recipes, five results.", ["search_web", "add_to_cart", "set_reminder"]),
]

TOOL_CALL_ID = "call_weather_1"
TOOL_CONVERSATIONS: list[list[dict]] = [
    [{"role": "user", "content": question},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": TOOL_CALL_ID, "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
     {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": json.dumps(answer)}]
    for question, city, answer in (
        ("What's the weather in Paris?", "Paris", {"temperature_c": 18, "condition": "cloudy"}),
        ("Should I take an umbrella in London today?", "London", {"temperature_c": 12, "condition": "rain"}),
        ("Is it warm in Athens?", "Athens", {"temperature_c": 29, "condition": "sunny"}),
    )
]

CHOICE_CASES: list[tuple[str, list[str]]] = [
    ("Is this review positive, negative or neutral? 'Great food, slow service.'", ["positive", "negative", "neutral"]),
    ("Which colour is a banana?", ["red", "green", "blue", "yellow"]),
    ("Is water wet? Answer yes or no.", ["yes", "no"]),
    ("What is the capital of Italy?", ["Paris", "London", "Berlin", "Rome"]),
    ("Which animal barks?", ["cat", "dog", "fish"]),
]

REGEX_CASES: list[tuple[str, str]] = [
    ("Give me a phone number in the format 555-123-4567.", r"\d{3}-\d{3}-\d{4}"),
    ("When did the first moon landing happen? Give the date as YYYY-MM-DD.", r"\d{4}-\d{2}-\d{2}"),
    ("Invent an email address at example.com.", r"[a-z]{3,12}@example\.com"),
    ("Give a colour as a hex code.", r"#[0-9a-f]{6}"),
    ("Write a time of day as HH:MM.", r"([01]\d|2[0-3]):[0-5]\d"),
]

BROKEN_SCHEMAS: list[tuple[dict, str]] = [  # (schema, a word the error message should name)
    ({"type": "objec"}, "objec"),
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": "name"}, "required"),
]

for _schema in (*SCHEMAS.values(), *(t["function"]["parameters"] for t in TOOLS.values())):
    assert_readable(_schema)  # every schema asked for is one


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# ---- judging one reply (plain dicts: a reply's model_dump()) ----------------------------------

@dataclass
class Case:
    """One request's outcome: whether it passed, why not, and its finish reason."""
    passed: bool
    why: str = "ok"
    finish_reason: str | None = None
    detail: dict = field(default_factory=dict)


def judge_tool_calls(message: dict, offered: list[str], named: str | None = None) -> tuple[bool, str]:
    """Every call names an offered tool (the named one, when named) and its arguments validate."""
    calls = message.get("tool_calls") or []
    if not calls:
        return False, f"no tool_calls; content {str(message.get('content'))[:80]!r}"
    for call in calls:
        function = call.get("function") or {}
        name = function.get("name")
        if named is not None and name != named:
            return False, f"called {name!r}, not the named {named!r}"
        if name not in offered:
            return False, f"called {name!r}, not among {offered}"
        ok, why = judge(function.get("arguments"), TOOLS[name]["function"]["parameters"])
        if not ok:
            return False, f"{name} arguments: {why}"
    return True, "ok"


def judge_choice(text: str | None, choices: list[str]) -> tuple[bool, str]:
    if text in choices:
        return True, "ok"
    return False, f"{str(text)[:80]!r} is not one of {choices}"


def judge_regex(text: str | None, pattern: str) -> tuple[bool, str]:
    if text is not None and re.fullmatch(pattern, text):
        return True, "ok"
    return False, f"{str(text)[:80]!r} does not match {pattern}"


def judge_broken(status: int | None, message: str, word: str) -> tuple[bool, str]:
    """HTTP 400, and a message that names the problem: the bad word, or the word "schema"."""
    if status != 400:
        return False, f"HTTP {status}, not 400: {message[:120]!r}"
    if word.lower() not in message.lower() and "schema" not in message.lower():
        return False, f"400, but the message names neither {word!r} nor the schema: {message[:120]!r}"
    return True, "ok"


# ---- the requests --------------------------------------------------------------------------------

def error_text(error: Exception) -> tuple[int | None, str]:
    """An exception's HTTP status (None when there was no response) and its message."""
    status = getattr(error, "status_code", None)
    body = getattr(error, "body", None)
    message = body.get("message") if isinstance(body, dict) and body.get("message") else None
    if message is None and isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    return status, str(message or error)


def failed(error: Exception) -> Case:
    status, message = error_text(error)
    prefix = f"HTTP {status}" if status is not None else type(error).__name__
    return Case(False, f"{prefix}: {message[:160]}")


class Checker:
    """The checks, against one server through one `openai` client."""

    def __init__(self, client: Any, model: str, concurrency: int) -> None:
        self.client, self.model, self.concurrency = client, model, concurrency

    def create(self, messages: list[dict], max_tokens: int = MAX_TOKENS, **options: Any) -> dict:
        reply = self.client.chat.completions.create(model=self.model, messages=messages, temperature=TEMPERATURE,
                                                    max_tokens=max_tokens, **options)
        return reply.model_dump()

    def each(self, cases: list, one: Callable[[Any], Case]) -> list[Case]:
        """`one(case)` for every case, `concurrency` at a time; an exception is a failed case."""
        def guarded(case: Any) -> Case:
            try:
                return one(case)
            except Exception as error:  # a failing server is a finding, never a crash
                return failed(error)
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(guarded, cases))

    def json_schema(self) -> list[Case]:
        def one(case: tuple[str, str]) -> Case:
            name, prompt = case
            reply = self.create(user(prompt), response_format=schema_format(name, SCHEMAS[name]))
            choice = reply["choices"][0]
            return Case(*judge(choice["message"]["content"], SCHEMAS[name]), choice["finish_reason"])
        return self.each(JSON_SCHEMA_CASES, one)

    def json_object(self) -> list[Case]:
        def one(prompt: str) -> Case:
            reply = self.create(user(prompt), response_format={"type": "json_object"})
            choice = reply["choices"][0]
            text = choice["message"]["content"]
            ok, why = judge(text, {"type": "object"})
            return Case(ok, why, choice["finish_reason"])
        return self.each(JSON_OBJECT_PROMPTS, one)

    def json_schema_stream(self) -> list[Case]:
        def one(case: tuple[str, str]) -> Case:
            name, prompt = case
            stream = self.client.chat.completions.create(
                model=self.model, messages=user(prompt), temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                response_format=schema_format(name, SCHEMAS[name]), stream=True)
            pieces, chunks, finish = [], 0, None
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta and choice.delta.content:
                        pieces.append(choice.delta.content)
                        chunks += 1
                    finish = choice.finish_reason or finish
            return Case(*judge("".join(pieces), SCHEMAS[name]), finish, {"chunks": chunks})
        return self.each([STREAM_CASE], one)

    def tools(self, named: bool, strict_tools: bool = False) -> list[Case]:
        def one(case: tuple[str, list[str]]) -> Case:
            prompt, offered = case
            choice_of = {"type": "function", "function": {"name": offered[0]}} if named else "required"
            tools = [strict(TOOLS[n]) if strict_tools else TOOLS[n] for n in offered]
            reply = self.create(user(prompt), tools=tools, tool_choice=choice_of)
            choice = reply["choices"][0]
            ok, why = judge_tool_calls(choice["message"], offered, offered[0] if named else None)
            return Case(ok, why, choice["finish_reason"])
        return self.each(TOOL_CASES, one)

    def tool_result(self) -> list[Case]:
        def one(messages: list[dict]) -> Case:
            reply = self.create(messages, max_tokens=60)
            choice = reply["choices"][0]
            text = choice["message"]["content"]
            if not text or not text.strip():
                return Case(False, f"no text reply (tool_calls {choice['message'].get('tool_calls')})",
                            choice["finish_reason"])
            return Case(True, "ok", choice["finish_reason"])
        return self.each(TOOL_CONVERSATIONS, one)

    def structured_option(self, kind: str, cases: list[tuple[str, Any]],
                          judge_one: Callable[[str | None, Any], tuple[bool, str]]) -> tuple[list[Case], str | None]:
        """vLLM's `structured_outputs: {kind: ...}`; if the server refuses the field (4xx), the
        older `guided_<kind>`. Returns the cases and the field name that was used (None: neither
        was accepted)."""
        def ask(field_name: str, case: tuple[str, Any]) -> Case:
            prompt, value = case
            extra = {"structured_outputs": {kind: value}} if field_name == "structured_outputs" \
                else {f"guided_{kind}": value}
            reply = self.create(user(prompt), max_tokens=40, extra_body=extra)
            choice = reply["choices"][0]
            return Case(*judge_one(choice["message"]["content"], value), choice["finish_reason"])

        for field_name in ("structured_outputs", f"guided_{kind}"):
            try:  # the first case alone tells whether the field is taken
                first = ask(field_name, cases[0])
            except Exception as error:
                first = failed(error)
                status, _ = error_text(error)
                if status is not None and 400 <= status < 500:
                    continue  # refused: try the older name
            return [first] + self.each(cases[1:], lambda case: ask(field_name, case)), field_name
        return [first] + [Case(False, "both field names refused") for _ in cases[1:]], None

    def broken_schema(self) -> tuple[list[Case], list[Case]]:
        """Each broken schema must be refused with a 400 naming it; the request after it served."""
        refused, after = [], []
        for schema, word in BROKEN_SCHEMAS:
            try:
                reply = self.create(user("Describe a dog as JSON."), max_tokens=40,
                                    response_format=schema_format("broken", schema))
                refused.append(Case(False, f"HTTP 200: accepted, replied {str(reply['choices'][0]['message']['content'])[:60]!r}"))
            except Exception as error:
                status, message = error_text(error)
                refused.append(Case(*judge_broken(status, message, word), detail={"message": message[:300]}))
            try:
                reply = self.create(user("Say hello."), max_tokens=16)
                text = reply["choices"][0]["message"]["content"]
                after.append(Case(bool(text), "ok" if text else "empty reply", reply["choices"][0]["finish_reason"]))
            except Exception as error:
                after.append(failed(error))
        return refused, after

    def run(self) -> dict[str, dict]:
        """Every check, in order: {name: row} (see `row`)."""
        results: dict[str, dict] = {}

        def record(name: str, cases: list[Case], note: str = "") -> None:
            results[name] = row(cases, note)
            print(f"  {name}: {results[name]['passed']}/{results[name]['total']}", file=sys.stderr, flush=True)

        record("json_schema", self.json_schema())
        record("json_object", self.json_object())
        record("json_schema_stream", self.json_schema_stream())
        record("tool_required", self.tools(named=False))
        record("tool_named", self.tools(named=True))
        record("tool_required_strict", self.tools(named=False, strict_tools=True))
        record("tool_named_strict", self.tools(named=True, strict_tools=True))
        record("tool_result", self.tool_result())
        for kind, cases, judge_one in (("choice", CHOICE_CASES, judge_choice), ("regex", REGEX_CASES, judge_regex)):
            done, used = self.structured_option(kind, cases, judge_one)
            record(kind, done, f"field: {used or 'refused'}")
            results[kind]["field"] = used
        refused, after = self.broken_schema()
        record("broken_schema", refused, "messages: " + " | ".join(repr(c.detail.get("message", "")[:80]) for c in refused))
        record("after_broken", after)
        return results


# ---- the report ----------------------------------------------------------------------------------

def row(cases: list[Case], note: str = "") -> dict:
    """A check's figures: passed, total, finish reasons, failed cases' reasons (a reply cut off
    at max_tokens says so: the model ran on inside a string, or the server never closed it), and
    notes."""
    reasons = [("cut at max_tokens: " if case.finish_reason == "length" else "") + case.why
               for case in cases if not case.passed]
    cut = sum(not case.passed and case.finish_reason == "length" for case in cases)
    finishes = Counter(case.finish_reason for case in cases if case.finish_reason)
    parts = [note] if note else []
    if finishes:
        parts.append("finish " + ", ".join(f"{k} {v}" for k, v in sorted(finishes.items())))
    if cut:
        parts.append(f"{cut} of the failed cut at max_tokens")
    if reasons:
        parts.append(f"first failure: {reasons[0]}")
    return {"passed": sum(case.passed for case in cases), "total": len(cases), "finish_reasons": dict(finishes),
            "failed_cut_at_max_tokens": cut, "failures": reasons, "notes": "; ".join(parts)}


def render_table(results: dict[str, dict], label: str, model: str, base_url: str, cpu: str, wall_s: float,
                 notes_width: int = 110) -> str:
    lines = [f"structured output and tool calls — {label} ({model} at {base_url}) — {cpu}; {wall_s:.0f} s",
             f"{'check':<20} {'passed':>9}  notes"]
    for name, r in results.items():
        notes = r["notes"] if len(r["notes"]) <= notes_width else r["notes"][:notes_width - 1] + "…"
        lines.append(f"{name:<20} {r['passed']:>4}/{r['total']:<4}  {notes}")
    passed, total = sum(r["passed"] for r in results.values()), sum(r["total"] for r in results.values())
    lines.append(f"{'all':<20} {passed:>4}/{total:<4}")
    return "\n".join(lines)


def summary(results: dict[str, dict], label: str, model: str, base_url: str, cpu: str, wall_s: float) -> dict:
    return {"label": label, "model": model, "base_url": base_url, "cpu": cpu, "wall_s": round(wall_s, 1),
            "temperature": TEMPERATURE, "max_tokens": MAX_TOKENS,
            "passed": sum(r["passed"] for r in results.values()), "total": sum(r["total"] for r in results.values()),
            "checks": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the server's OpenAI-compatible /v1 URL")
    parser.add_argument("--model", default=None, help="the model id (default: the first /v1/models names)")
    parser.add_argument("--label", default="server", help="the server's name in the report (ours, vllm, ...)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--concurrency", type=int, default=8, help="requests of one check in flight at once")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="one request's limit")
    args = parser.parse_args()

    from openai import OpenAI  # here: the pure parts above import without it
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout_s, max_retries=0)
    model = args.model or client.models.list().data[0].id
    started = time.perf_counter()
    results = Checker(client, model, args.concurrency).run()
    wall = time.perf_counter() - started
    cpu = cpu_model()
    print(render_table(results, args.label, model, args.base_url, cpu, wall))
    print(json.dumps(summary(results, args.label, model, args.base_url, cpu, wall)))


if __name__ == "__main__":
    main()
