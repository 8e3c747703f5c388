"""A long prompt's prefill beside decoding streams, with engine.dynamic_chunking off and on (docs/serving.md).

Streams decode greedily; a prompt of `--prompt` random ids arrives; the engine steps until it samples its first
token. Each chunk's attention grows with its context, and every stream waits for the step it is in: the slowest
step is the streams' longest wait for a token, and the steps taken are the tokens each stream made meanwhile.

    python -m toolkit.bench.long_prefill                        # SmolLM2, 8 streams, 8,000 ids, the server's budget
    python -m toolkit.bench.long_prefill --repeats 3 --modes off auto 1500

Settings alternate within each repeat, one engine each; the machine is named beside the figures."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toolkit.bench.options import entry_point, positive_int
from toolkit.bench.precision import machine
from toolkit.config import EngineConfig, ModelConfig
from toolkit.engine.core import Engine
from toolkit.models import load_model
from toolkit.sampling.params import SamplingParams


def mode(text: str) -> str | int:
    """--modes: off, auto, or a context length (engine.dynamic_chunking's values)."""
    if text in ("off", "auto"):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be off, auto or a positive integer, got {text!r}") from None


def one_run(loaded, args: argparse.Namespace, dynamic: str | int) -> dict[str, float]:
    cfg = EngineConfig(
        max_num_batched_tokens=args.budget,
        max_chunk_tokens=args.chunk,
        scheduling_policy="priority",
        dynamic_chunking=dynamic,
        max_num_seqs=args.streams + 1,
        max_model_len=args.prompt + 64,
    )
    engine = Engine(loaded, cfg, SamplingParams(temperature=0.0))
    ids = torch.Generator().manual_seed(0)
    vocab = loaded.arch.vocab_size

    def random_ids(n: int) -> list[int]:
        return torch.randint(min(100, vocab - 1), vocab, (n,), generator=ids).tolist()

    streams = SamplingParams(temperature=0.0, max_tokens=args.prompt, ignore_eos=True)
    for _ in range(args.streams):
        engine.add_request(prompt_token_ids=random_ids(40), sampling_params=streams)
    for _ in range(5):  # the streams' prompts in, every stream decoding
        engine.step()
    long = engine.add_request(
        prompt_token_ids=random_ids(args.prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    )
    steps, start = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        out = engine.step()
        steps.append(time.perf_counter() - t)
        if any(s.request_id == long for s in out.samples):
            break
    return {
        "steps": len(steps),
        "ttft_s": time.perf_counter() - start,
        "step_p50_s": statistics.median(steps),
        "step_max_s": max(steps),
    }


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(prog="python -m toolkit.bench.long_prefill", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model name (model=...): smollm2 | tiny")
    parser.add_argument("--prompt", type=positive_int, default=8000, help="the long prompt's tokens")
    parser.add_argument("--streams", type=positive_int, default=8, help="streams decoding when it arrives")
    parser.add_argument("--budget", type=positive_int, default=512, help="engine.max_num_batched_tokens")
    parser.add_argument("--chunk", type=positive_int, default=256, help="engine.max_chunk_tokens (a server's: half)")
    parser.add_argument("--modes", type=mode, nargs="+", default=["off", "auto"], help="engine.dynamic_chunking's")
    parser.add_argument("--repeats", type=positive_int, default=1)
    args = parser.parse_args(argv)
    loaded = load_model(ModelConfig(name=args.model))
    print(
        f"{args.model}: {args.streams} streams decoding, then a prompt of {args.prompt} ids (budget {args.budget}, "
        f"chunks of {args.chunk} at most); {machine('cpu')}"
    )
    print(f"  {'dynamic_chunking':>16s} {'steps':>6s} {'first token':>12s} {'step p50':>9s} {'slowest':>8s}")
    result: dict[str, list[dict[str, float]]] = {str(m): [] for m in args.modes}
    for _ in range(args.repeats):
        for m in args.modes:
            run = one_run(loaded, args, m)
            result[str(m)].append(run)
            print(
                f"  {m!s:>16s} {run['steps']:6d} {run['ttft_s']:11.2f}s {run['step_p50_s']:8.3f}s "
                f"{run['step_max_s']:7.3f}s",
                flush=True,
            )
    return result


if __name__ == "__main__":
    raise SystemExit(entry_point(main))
