"""Measure whether a model writes tool calls at all with the ``tools`` environment's opening
prompt, before any RL: GRPO can only reinforce a call format that some samples of a group use.

For each of ``--prompts`` reasoning-gym chain_sum questions (the docs' tool-use job: 2-4 terms of
2-3 digits), it renders the opening exactly as the ``tools`` environment does (the calculator's
schema and the call format in the system message, where the template has no tools section),
samples ``--samples`` first turns at temperature 1 (the rollout default), runs each through the
environment's parser and prints the counts: well-formed calls, malformed calls, final answers,
and how many first turns already contain the right answer.

    PYTHONPATH=. python scripts/tool_call_probe.py --prompts 6 --samples 4
    PYTHONPATH=. python scripts/tool_call_probe.py --system "Use the calculator. Example: ..."

Needs the real-model set-up (``scripts/setup.sh --real-model``). A measurement tool, not part of
the package; it asserts nothing.
"""

from __future__ import annotations

import argparse
import time

DEFAULT_SYSTEM = "Use the calculator for arithmetic. Put the final answer in \\boxed{}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a packaged model name or a directory")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--system", default=DEFAULT_SYSTEM, help="the job's system_prompt option")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args()

    import reasoning_gym as rg
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model_import import resolve_model_path
    from producers.envs import EnvContext
    from producers.tool_env import ToolEnv

    path = resolve_model_path(args.model)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    data = rg.create_dataset(
        "chain_sum", min_terms=2, max_terms=4, min_digits=2, max_digits=3, size=args.prompts, seed=args.seed
    )
    options = {"tools": ["calculator"], "system_prompt": args.system}
    counts = dict.fromkeys(("turns", "tool_calls", "malformed_tool_calls", "final_answers", "answer_in_turn"), 0)
    t0, example = time.time(), ""
    for i, item in enumerate(data):
        env = ToolEnv(options, EnvContext("reasoning_gym", "probe", tok))
        opening = env.reset({"text": item["question"]}, 0)
        ids = tok(opening, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(
                ids.repeat(args.samples, 1),
                attention_mask=torch.ones_like(ids).repeat(args.samples, 1),
                do_sample=True,
                temperature=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tok.eos_token_id,
            )
        for row in out[:, ids.shape[1] :]:
            turn = tok.decode(row, skip_special_tokens=False).split(tok.eos_token)[0] + tok.eos_token
            fresh = ToolEnv(options, EnvContext("reasoning_gym", "probe", tok))
            fresh.reset({"text": item["question"]}, 0)
            step = fresh.step(turn).info["counts"]
            counts["turns"] += 1
            for k in ("tool_calls", "malformed_tool_calls", "final_answers"):
                counts[k] += step[k]
            counts["answer_in_turn"] += str(item["answer"]) in turn
            example = example or turn
        print(f"prompt {i + 1}/{args.prompts}: {counts} ({time.time() - t0:.0f} s)", flush=True)
    print(f"first sampled turn: {example[:300]!r}")
    print(f"tool-call probe: {counts}")


if __name__ == "__main__":
    main()
