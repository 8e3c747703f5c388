"""The run modes, one line each: what `python run.py --help` and `python -m toolkit --help` list (a leaf module,
so the help prints without loading torch or Hydra)."""

from __future__ import annotations

MODES = {
    "run": "serve the workload through the engine; every sampled token traced to Parquet (the default)",
    "serve": "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions), every request traced",
    "bench": "engine vs HF generate (and llama.cpp) on the same requests, side by side; the roofline",
    "scheduling": "the design documents' scheduler experiments: static vs continuous batching, chunked prefill",
    "replay": "re-run a trace and compare it bit for bit; names the first divergence (replay.trace=<dir>)",
    "verify": "teacher-forced recomputation of a trace: cached == recomputed logits (verify.trace=<dir>)",
    "compare": "many runs as one dataset: where their tokens and logprobs part (compare.runs=[...])",
    "audit": "recompute a foreign engine's transcript: flags per token, the detector, Ray sharding (audit.input=)",
    "soak": "random requests for soak.duration_s seconds: KV leaks, trace rows, RSS (soak.over=http: the server)",
    "train": "train the character-level GPT of the nanoGPT posts (model=nanogpt)",
    "kv_quantization": "KV-cache formats side by side: outputs kept, logprob drift, bytes",
    "precision": "model formats (fp32, bf16, fp16) side by side against HF and against each other",
    "report": "report.html of a run: its trace as a page with charts (report.run=<dir>)",
}


def usage() -> str:
    width = max(map(len, MODES))
    lines = [
        "usage: python run.py [mode=<mode>] [key=value ...]   (Hydra overrides; conf/ holds the defaults)",
        "",
        "modes:",
    ]
    lines += [f"  {name:<{width}}  {line}" for name, line in MODES.items()]
    lines += [
        "",
        "experiments: python run.py experiment=<name> (experiments/*.yaml); docs: README.md and docs/",
        "Hydra's own options: python run.py --hydra-help; the composed config: python run.py --cfg job",
    ]
    return "\n".join(lines)
