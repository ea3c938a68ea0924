"""A multi-turn rollout with one tool call per sample: the tool's reply is context, not training signal.

    --custom-generate-function-path examples/multi_turn/tool_call.py:generate_with_tool
    --custom-rm-path examples/multi_turn/tool_call.py:reward

Each sample alternates model turns and tool replies in one token sequence:

    prompt | model turn | tool reply (loss mask 0) | model turn | ...

`Sample.append_response_tokens` keeps tokens, loss mask and log-probs aligned: model tokens carry the
engine's log-probs and mask 1; tool tokens get mask 0 and log-prob 0.0, so the trainer computes no loss on
them. A random tiny model never asks for a tool by itself, so this example drives the turns: after every
model turn it answers with the calculator's result for the prompt's arithmetic question, up to
`multi_turn_tool_calls` times (a --custom-config-path key, default 1). `multi_turn_turn_tokens` (default 8)
caps each model turn; --rollout-max-response-len caps the whole response, tool replies included.
"""
from __future__ import annotations

import operator
import re

from slime.rollout.rm_hub.math_utils import grade_math_response
from slime.rollout.sglang_rollout import GenerateState, generate_url, request_timeout
from slime.utils.http_utils import post
from slime.utils.types import Sample

QUESTION = re.compile(r"What is (-?\d+) ([+*-]) (-?\d+)\?")
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
TOOL_REPLY = "<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
IM_END = "<|im_end|>\n"


def calculator(prompt: str) -> str:
    """The tool: evaluates the prompt's arithmetic question."""
    match = QUESTION.search(prompt)
    if match is None:
        return "error: no arithmetic question found"
    a, op, b = match.groups()
    return str(OPERATIONS[op](int(a), int(b)))


def tool_reply_tokens(tokenizer, sample: Sample, result: str) -> list[int]:
    """The tool turn in the chat format, closing the model turn first when the model did not."""
    text = TOOL_REPLY.format(result=result)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not sample.tokens or sample.tokens[-1] != im_end:
        text = IM_END + text
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def _model_turn(args, sample: Sample, sampling_params: dict, max_tokens: int) -> None:
    params = {**sampling_params, "max_new_tokens": max_tokens}
    output = await post(generate_url(args), {"input_ids": sample.tokens, "sampling_params": params,
                                              "return_logprob": True}, timeout_s=request_timeout(args))
    meta = output["meta_info"]
    pairs = meta["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  trainable=True, meta_info=meta, text=output.get("text", ""))


async def generate_with_tool(args, sample: Sample, sampling_params: dict) -> Sample:
    """--custom-generate-function-path: model turn, tool reply, model turn, ... in one sample."""
    tokenizer = GenerateState(args).tokenizer
    if not sample.tokens:
        sample.tokens = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    budget = int(sampling_params["max_new_tokens"])
    turn_tokens = int(getattr(args, "multi_turn_turn_tokens", 8))
    tool_calls = int(getattr(args, "multi_turn_tool_calls", 1))
    sample.metadata["tool_replies"] = []
    for call in range(tool_calls + 1):
        await _model_turn(args, sample, sampling_params, min(turn_tokens, budget - sample.response_length))
        if call == tool_calls or sample.status == Sample.Status.ABORTED:
            break
        result = calculator(sample.prompt)
        reply = tool_reply_tokens(tokenizer, sample, result)
        if sample.response_length + len(reply) + 1 > budget:  # no room for the reply and another model turn
            break
        sample.metadata["tool_replies"].append({"start": sample.response_length, "length": len(reply),
                                                "result": result})
        sample.append_response_tokens(args, tokens=reply, trainable=False, text=tokenizer.decode(reply))
    return sample


async def reward(args, sample: Sample) -> float:
    """--custom-rm-path: 1 for the right final answer, plus a small confidence term (the mean log-prob of the
    last model turn) so that GRPO gets a signal while a random tiny model never answers right."""
    last_start = max([r["start"] + r["length"] for r in sample.metadata.get("tool_replies", [])], default=0)
    final_logprobs = (sample.rollout_log_probs or [])[last_start:]
    final_text = sample.response.rsplit("<|im_start|>assistant\n", 1)[-1]
    correct = 1.0 if grade_math_response(final_text, sample.label) else 0.0
    confidence = sum(final_logprobs) / len(final_logprobs) if final_logprobs else 0.0
    return correct + 0.01 * confidence
