"""What a request does to its logits before its token is chosen (OpenAI's and vLLM's
sampling extras), on rank 0's full logits [V] of that request:

    repetition_penalty r   every token of the prompt and the answer so far:
                           a logit l > 0 becomes l / r, else l * r (vLLM's, CTRL's rule)
    frequency_penalty  f   l -= f * c,  c: the times the token was generated so far
    presence_penalty   p   l -= p * (c > 0)          (OpenAI's formula, both)
    logit_bias         b   l += b[token]             (-100 bans it, +100 forces it)
    min_tokens         m   end-of-sequence tokens get -inf until m tokens were generated

in that order; the chosen token is then greedy or sampled as without them (temperature,
top-k, top-p). A request that asks for none of them keeps its logits untouched (the
same tensor: its tokens are bit for bit those of before). Log-probabilities stay the
model's own, before these (vLLM's default, `raw_logprobs`).
"""

from __future__ import annotations

import torch

from tpkit.serve.params import SamplingParams


def shaped(params: SamplingParams) -> bool:
    """Does `params` change a request's logits here? (A grammar's mask does not count: it
    masks every rank's shard, greedy or not: `serve.masks`.)"""
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias
                or params.repetition_penalty != 1.0 or params.min_tokens)


def process(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
            tokens: list[int], eos: set[int]) -> torch.Tensor:
    """`logits` [V] as `params` shape them (the module's table), given the prompt and the
    tokens generated so far; `logits` itself when they ask for nothing."""
    if not shaped(params):
        return logits
    x = logits.float().clone()  # [V]
    vocab = x.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *tokens}), dtype=torch.long)
        r, v = params.repetition_penalty, x[seen]
        x[seen] = torch.where(v > 0, v / r, v * r)
    if tokens and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[list(ids)] += torch.tensor(bias, dtype=x.dtype)
    if len(tokens) < params.min_tokens and eos:
        x[sorted(eos)] = float("-inf")
    return x
