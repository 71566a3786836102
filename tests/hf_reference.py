"""transformers as the oracle: greedy continuations and teacher-forced log-probabilities."""
from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy, running past eos like our ignore_eos (min_new_tokens would mask eos instead)."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-probabilities of the next token after each prefix: `[len(token_ids), vocab]`."""
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def check_close(ours: list[int], our_logprobs: list[dict[int, float]], theirs: list[int], model,
                prompt: list[int], k: int = 5, tol: float = 0.01) -> None:
    """vLLM's check: outputs agree token for token, or, at the first divergence, each token is in
    the other side's top-k and the two log-probabilities are close; after that they may differ."""
    for pos, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        hf_lp = hf_logprobs(model, prompt + theirs[:pos])[-1]
        hf_top = hf_lp.topk(k).indices.tolist()
        assert a in hf_top, f"position {pos}: our token {a} not in transformers' top-{k} {hf_top}"
        assert b in our_logprobs[pos], f"position {pos}: their token {b} not in our top-{k}"
        # A divergence is only acceptable at a near-tie, seen as one from both sides.
        assert our_logprobs[pos][a] - our_logprobs[pos][b] < tol, f"position {pos}: not a near-tie for us"
        assert float(hf_lp[b] - hf_lp[a]) < tol, f"position {pos}: not a near-tie for transformers"
        return
