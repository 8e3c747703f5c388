"""What the text and stop-string work costs per token at the start and at the end of a long output.

A sequence's text is decoded incrementally (toolkit/sampling/stop.py): each token is decoded with a few
tokens of context, so the work per token should not grow with the output. This feeds one long
output (the model's own tokenizer: mixed scripts, multi-byte characters, emoji, code) to
`update_text` one token at a time, as the engine's commit does, with stop strings that never
match, and compares the median time per token over the first and the last `window` tokens. The
text it built is compared with a decode of the whole output (a speed-up that changed the text
would show there).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from toolkit.sampling.stop import StopState, update_text

_WORDS = (
    "the of and to in model token cache data return def class ( ) { } [ ] : , . \n 日本語 の テキスト "
    "καλημέρα κόσμε émigré naïve café Übergröße 🤖 🚀 ✓ → ½"
).split(" ")
STOPS = ("</answer>", "\n\nUser:", "STOP HERE")


def long_output(tokenizer, tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(" ".join(rng.choice(_WORDS) for _ in range(256)), add_special_tokens=False)
    return ids[:tokens]


def per_token_us(tokenizer, ids: list[int], prompt: list[int], stops=STOPS) -> tuple[list[float], str]:
    """Microseconds of `update_text` for each output token of `ids`, fed one at a time after the prompt's
    tokens (the sequence's token list, as the commit passes it), and the output text it built."""
    state, seen, out = StopState(), list(prompt), []
    decode = lambda xs: tokenizer.decode(xs, skip_special_tokens=True)  # noqa: E731
    for token in ids:
        seen.append(token)
        start = time.perf_counter_ns()
        update_text(decode, seen, stops, state, check_stops=True, include_stop=False, final=False, first=len(prompt))
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out, state.text


def measure(loaded, tokens: int = 4096, window: int = 256, repeats: int = 3) -> dict[str, Any]:
    if loaded.tokenizer is None:
        return {"skipped": "the model has no tokenizer"}
    ids, prompt = long_output(loaded.tokenizer, tokens), long_output(loaded.tokenizer, 128, seed=1)
    window = max(1, min(window, len(ids) // 4))  # the first and last windows do not overlap
    whole = loaded.tokenizer.decode(ids, skip_special_tokens=True)
    per_token_us(loaded.tokenizer, ids[:window], prompt)  # warm-up: the first timed tokens would pay for it
    runs = []
    for _ in range(repeats):
        t, text = per_token_us(loaded.tokenizer, ids, prompt)
        start, end = statistics.median(t[:window]), statistics.median(t[-window:])
        runs.append({"start_us": start, "end_us": end, "end_over_start": end / start, "same_text": text == whole})
    ratios = [r["end_over_start"] for r in runs]
    return {
        "tokens": len(ids),
        "window": window,
        "runs": runs,
        "same_text": all(r["same_text"] for r in runs),
        "end_over_start_range": [min(ratios), max(ratios)],
    }
