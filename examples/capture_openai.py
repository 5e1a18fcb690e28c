"""Train on rollouts written with the openai client, served by grooves.

The rollout code is plain OpenAI-client code. A Recorder captures each call's exact token
ids and logprobs from `grooves serve`, the trainer updates the adapter from those groups
and writes a checkpoint, and the server, asked for `capture@latest`, samples the next
step from the new adapter without a restart. Trajectories more than one update old are
left out (max_staleness=1).

    python examples/capture_openai.py                      # the bundled model, 8 steps
    python examples/capture_openai.py --model tiny --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import openai

import grooves as gr
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.serve.capture import Recorder

TOPICS = ["colour", "fruit", "animal", "country", "metal", "planet", "tree", "river"]


def one_word(completion: str) -> float:
    """The verifier: the reply should be a single word."""
    words = completion.strip().split()
    return 1.0 if len(words) == 1 else 1.0 / (1 + len(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runs", type=Path, default=None, help="runs root (default: a temporary folder)")
    args = parser.parse_args()

    run_dir = (args.runs or Path(tempfile.mkdtemp())) / "capture"
    policy = gr.Policy.load(args.model, lora=gr.LoRA(rank=8))
    trainer = gr.Trainer(policy, gr.algorithms.grpo(), gr.training.OptimConfig(learning_rate=5e-4),
                         max_completion_length=args.max_tokens, max_staleness=1)
    trainer.save(run_dir)  # step 0, so the server has an adapter to serve
    reward = gr.Reward([gr.Component("one_word", one_word)])

    server = build_server(args.model, runs=run_dir.parent)
    try:
        with ServerThread(create_app(server)) as http:
            client = openai.OpenAI(base_url=http.base_url, api_key="local")
            for step in range(args.steps):
                groups = []
                for topic in TOPICS[step % len(TOPICS) :][:2]:
                    recorder = Recorder(client)
                    recorder.create(model="capture@latest", n=args.group_size, max_tokens=args.max_tokens,
                                    messages=[{"role": "user", "content": f"Name a {topic}."}])
                    groups.append(recorder.group({"id": topic}))
                reward.score(groups)
                metrics = trainer.train_step(groups)
                trainer.save(run_dir)
                mean = statistics.fmean(t.reward for g in groups for t in g.trajectories)
                print(f"step {step + 1}: reward {mean:.3f}, stale {metrics['train/trajectories_stale']:.0f}, "
                      f"served capture@{groups[0].trajectories[0].metadata['policy_step']}", flush=True)
    finally:
        server.engine.stop()
    print(f"checkpoints in {run_dir}/checkpoints")


if __name__ == "__main__":
    main()
