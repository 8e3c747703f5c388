"""Benchmark workloads: lists of greedy requests (prompt ids, max_tokens, arrival step).

Every workload is built from the same chat template and passages, deterministically
from a seed. `num_requests` and `max_tokens` shrink a workload for a quick run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from toolkit.config import is_int
from toolkit.data import passages
from toolkit.errors import ConfigError
from toolkit.runs.workload import CHAT_QUESTIONS


@dataclass(frozen=True)
class BenchRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0
    group: str = "main"  # e.g. "decode" / "long" in long_prompt


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    engine_overrides: dict = field(default_factory=dict)  # engine options this workload is meant to run with
    baseline_groups: tuple[str, ...] = ()  # long_prompt: also run these groups alone, for comparison
    description: str = ""


def _corpus_ids(tokenizer) -> list[int]:
    return tokenizer.encode(" ".join(passages()), add_special_tokens=False)


def _prompt_of_length(tokenizer, corpus: list[int], target: int, instruction: str, offset: int) -> list[int]:
    """A chat prompt of about `target` tokens: a short system line, an instruction, a slice of the passages."""
    system = {"role": "system", "content": "Be concise."}
    base = tokenizer.apply_chat_template([system, {"role": "user", "content": instruction}])
    room = max(0, target - len(base) - 2)
    piece = [corpus[(offset + i) % len(corpus)] for i in range(room)]
    content = instruction + ("\n\n" + tokenizer.decode(piece) if room else "")
    return tokenizer.apply_chat_template([system, {"role": "user", "content": content}])


def standard(tokenizer, num_requests: int = 64, max_tokens: int = 256, seed: int = 0) -> Workload:
    """Chat prompts of 16-512 tokens, max_tokens 32-256, staggered arrivals (one every other step)."""
    rnd = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    reqs = []
    for i in range(num_requests):
        target = rnd.randint(16, 512)
        ids = _prompt_of_length(tokenizer, corpus, target, rnd.choice(CHAT_QUESTIONS), rnd.randrange(len(corpus)))
        reqs.append(BenchRequest(f"std-{i}", ids, rnd.randint(min(32, max_tokens), max_tokens), arrival_step=i // 2))
    return Workload("standard", reqs, description="64 chat requests, prompts 16-512 tokens, 32-256 new tokens")


def long_prompt(tokenizer, num_requests: int = 24, max_tokens: int = 128, seed: int = 0) -> Workload:
    """16 decodes running, then 8 requests with 2,000-token prompts arrive: chunking keeps TPOT flat."""
    rnd = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    num_long = max(1, num_requests // 3)
    reqs = [
        BenchRequest(
            f"dec-{i}",
            tokenizer.apply_chat_template([{"role": "user", "content": rnd.choice(CHAT_QUESTIONS)}]),
            max_tokens,
            arrival_step=0,
            group="decode",
        )
        for i in range(num_requests - num_long)
    ]
    for j in range(num_long):
        ids = _prompt_of_length(tokenizer, corpus, 2000, "Summarize the following text.", 97 * j)
        reqs.append(BenchRequest(f"long-{j}", ids, 16, arrival_step=4 + 2 * j, group="long"))
    # budget 32 = 16 decodes + 16 prompt tokens per step: measured 1.46x TPOT p95 (budget 64: 2.90x)
    return Workload(
        "long_prompt",
        reqs,
        engine_overrides={"max_num_batched_tokens": 32, "max_num_seqs": 24},
        baseline_groups=("decode",),
        description="16 decodes + 8 prompts of 2,000 tokens arriving while they run (budget 32)",
    )


def shared_prefix(tokenizer, num_requests: int = 64, max_tokens: int = 64, seed: int = 0) -> Workload:
    """One long system prompt (a document) shared by every request, then a short question."""
    rnd = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    document = tokenizer.decode(corpus[:400])
    reqs = []
    for i in range(num_requests):
        ids = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "Answer using this document.\n\n" + document},
                {"role": "user", "content": rnd.choice(CHAT_QUESTIONS)},
            ]
        )
        reqs.append(BenchRequest(f"sp-{i}", ids, rnd.randint(min(16, max_tokens), max_tokens), arrival_step=i // 2))
    return Workload("shared_prefix", reqs, description="64 requests sharing a ~420-token system prompt")


def copy_heavy(tokenizer, num_requests: int = 16, max_tokens: int = 128, seed: int = 0) -> Workload:
    """Requests that quote a given passage back: most output tokens already appear in the prompt."""
    texts = passages()
    reqs = []
    for i in range(num_requests):
        text = texts[i % len(texts)]
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Repeat the following passage exactly, word for word:\n\n" + text}]
        )
        reqs.append(BenchRequest(f"copy-{i}", ids, max_tokens, arrival_step=i))
    return Workload("copy_heavy", reqs, description="quote a passage back (for speculative decoding)")


def long_among_short(tokenizer, num_requests: int = 18, max_tokens: int = 64, seed: int = 0) -> Workload:
    """The chunked-prefill lesson's case: 2 long prompts (about 2,000 tokens) arriving among short chat requests
    (one every step): do the short ones wait behind them (TTFT), do running decodes stall (TPOT)?"""
    rnd = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    num_short = max(1, num_requests - 2)
    reqs = [
        BenchRequest(
            f"short-{i}",
            tokenizer.apply_chat_template([{"role": "user", "content": rnd.choice(CHAT_QUESTIONS)}]),
            max_tokens,
            arrival_step=i,
            group="short",
        )
        for i in range(num_short)
    ]
    for j in range(min(2, num_requests - num_short)):
        ids = _prompt_of_length(tokenizer, corpus, 2000, "Summarize the following text.", 131 * j)
        reqs.append(BenchRequest(f"long-{j}", ids, 16, arrival_step=2 + 6 * j, group="long"))
    return Workload(
        "long_among_short",
        sorted(reqs, key=lambda r: r.arrival_step),
        description=f"{num_short} short chat requests (one a step) + 2 prompts of ~2,000 tokens "
        f"arriving at steps 2 and 8",
    )


WORKLOADS = {
    "standard": standard,
    "long_prompt": long_prompt,
    "shared_prefix": shared_prefix,
    "copy_heavy": copy_heavy,
    "long_among_short": long_among_short,
}


MIN_REQUESTS = {"long_prompt": 2}  # its decodes are a third of the requests' complement: one request is no decode


def workload_options(name: str, num_requests: int | None, max_tokens: int | None, section: str) -> None:
    """<section>.workload, .num_requests and .max_tokens checked (null: the workload's own count), naming the
    option: what make_workload builds from, and what a mode checks before its model loads."""
    if not isinstance(name, str) or name not in WORKLOADS:
        raise ConfigError(f"unknown {section}.workload {name!r}; known: {', '.join(WORKLOADS)}")
    least = MIN_REQUESTS.get(name, 1)
    if num_requests is not None and not (is_int(num_requests) and num_requests >= least):
        raise ConfigError(
            f"{section}.num_requests must be null or an integer of at least {least} ({name}), got {num_requests!r}"
        )
    if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
        raise ConfigError(f"{section}.max_tokens must be null or an integer of at least 1, got {max_tokens!r}")


def make_workload(
    name: str,
    tokenizer,
    num_requests: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    section: str = "bench",
) -> Workload:
    """Workload `name`, shrunk to `num_requests` / `max_tokens` where given; a bad value is a ConfigError naming
    <section>.workload / .num_requests / .max_tokens."""
    workload_options(name, num_requests, max_tokens, section)
    kwargs = {"seed": seed}
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    return WORKLOADS[name](tokenizer, **kwargs)
