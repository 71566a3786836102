"""`python -m engine "prompt"`: stream one reply to the terminal.

The prompt is sent as a user message through the model's chat template (--raw sends it as is).
"""
from __future__ import annotations

import argparse
import sys

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Stream a reply from the engine.")
    parser.add_argument("prompt")
    parser.add_argument("--model", default=None, help="hub id or folder (default: $MODEL or SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    engine = LLMEngine(args.model, args.device)
    prompt = args.prompt
    if not args.raw:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.usage:
                u = delta.usage
                rate = u.completion_tokens / max(u.duration_s - u.ttft_s, 1e-9)
                print(f"\n\n[{u.completion_tokens} tokens, first after {u.ttft_s:.2f} s, "
                      f"{rate:.1f} tokens/s, finish: {delta.finish_reason}]", file=sys.stderr)


if __name__ == "__main__":
    main()
