"""`python -m engine`: chat with the model in the terminal; `python -m engine "prompt"`: one reply.

Prompts go through the model's chat template as user messages (--raw sends a prompt as is).
In a chat, each turn's prompt starts with the whole conversation so far, which the prefix cache
still holds, so only the new message is computed: the status line shows how many tokens hit.
"""
from __future__ import annotations

import argparse
import sys

from engine.core.sampling_params import SamplingParams
from engine.runtime.llm_engine import LLMEngine


def stream_reply(engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams) -> str:
    engine.add_request(request_id, prompt, params)
    text = []
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            text.append(delta.text)
            if delta.usage:
                u = delta.usage
                rate = f"{u.decode_tokens_per_s or 0:.1f} tokens/s"
                print(f"\n[{u.completion_tokens} tokens, first after {u.ttft_s:.2f} s, {rate}; "
                      f"{u.cached_tokens} of {u.prompt_tokens} prompt tokens from the prefix cache; "
                      f"finish: {delta.finish_reason}]", file=sys.stderr)
    return "".join(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Chat with the engine in the terminal.")
    parser.add_argument("prompt", nargs="?", help="reply to this one prompt and exit (default: chat)")
    parser.add_argument("--model", default=None, help="hub id, folder, .gguf file or hub GGUF (user/repo:Q4_K_M) (default: $MODEL or SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    # One reply ends long before a compiled decode step could be built (minutes, in the
    # background): a build started for it would only be stopped again as the command exits.
    engine = LLMEngine(args.model, args.device, compile_decode=False if args.prompt is not None else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        prompt = args.prompt if args.raw else engine.apply_chat_template(
            messages + [{"role": "user", "content": args.prompt}])
        stream_reply(engine, "cli", prompt, params)
        return
    print(f"Chatting with {engine.model_name} on {engine.device} ({engine.config.scheduler.num_device_blocks} KV blocks). "
          "Empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in range(1_000_000):
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        print("bot> ", end="")
        reply = stream_reply(engine, f"turn-{turn}", engine.apply_chat_template(messages), params)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    main()
