"""A vLLM-shaped entry point for Python users: `LLM(model=...)`, `llm.generate(...)`, `llm.chat(...)`.

    from toolkit import LLM, SamplingParams

    llm = LLM(model="smollm2", max_num_seqs=32)
    outputs = llm.generate(["The capital of France is", "Once upon a time"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text, llm.trace_dir)

Every call is a recorded run: its requests go through a fresh engine over the same loaded weights (so a
call never depends on an earlier one's cache, and replays alone), and its run directory (config,
manifest, requests.parquet, samples.parquet, summary) is written under `trace_root`; `llm.trace_dir` is
the latest call's, `llm.trace_dirs` all of them. `python run.py mode=replay replay.trace=<dir>` and
`mode=verify` take them as they take a CLI run's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig, from_mapping
from toolkit.engine.core import Engine, EngineRequest, derive_seed, load_for
from toolkit.engine.outputs import Logprob, RequestOutput, StepOutput
from toolkit.errors import ConfigError
from toolkit.runs.session import Progress, record
from toolkit.sampling.params import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]  # text, token ids, or {"prompt" | "prompt_token_ids": ...}
Conversation = Sequence[Mapping[str, Any]]  # chat messages: [{"role": ..., "content": ...}, ...]


def from_vllm(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with vLLM's LLM(...) options that have a meaning here said as EngineConfig's fields (its others
    stay unknown options, a ConfigError):

        tensor_parallel_size  1 only: the engine runs on one device
        enforce_eager         true: engine.cuda_graphs=off (no CUDA graph captured)
        swap_space            GiB of host memory for swapped-out KV: engine.swap_space_gb
        trust_remote_code     accepted and changes nothing: no checkpoint's own code runs here (known architectures)
    """
    out = dict(options)
    if out.get("tensor_parallel_size", 1) != 1:
        raise ConfigError(f"tensor_parallel_size={out['tensor_parallel_size']!r}: the engine runs on one device (1)")
    out.pop("tensor_parallel_size", None)
    out.pop("trust_remote_code", None)
    if out.pop("enforce_eager", False):
        out.setdefault("cuda_graphs", "off")
    if "swap_space" in out:
        out.setdefault("swap_space_gb", out.pop("swap_space"))
    return out


def checkpoint_dtype(directory: Path) -> str:
    """dtype="auto": the checkpoint's torch_dtype where it is bfloat16 or float16, else float32."""
    try:
        stored = json.loads((directory / "config.json").read_text()).get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        stored = None
    return stored if stored in ("bfloat16", "float16") else "float32"


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        *,
        dtype: str = "float32",
        generation_config: str = "auto",
        speculative: Mapping[str, Any] | None = None,
        trace: bool = True,
        trace_root: str | Path | None = None,
        **engine_options: Any,
    ):
        """`model`: "smollm2", "tiny" or a local HF checkpoint directory. `dtype`: float32, bfloat16, float16 or
        "auto" (a checkpoint's own torch_dtype where it is 16-bit, else float32). `engine_options`: EngineConfig's
        fields (max_num_seqs, max_num_batched_tokens, max_model_len, seed, enable_prefix_caching, ...;
        an unknown one is a one-line ConfigError), and vLLM's options that mean something here (from_vllm).
        `generation_config`: "auto" takes the model's own sampling defaults, "none" the library's.
        `trace_root`: where run directories go (default traces/<date>/<time>-llm-<n>)."""
        known = {"smollm2", "tiny"}
        if dtype == "auto":
            dtype = "float32" if model in known else checkpoint_dtype(Path(model))
        engine_options = from_vllm(engine_options)
        model_cfg = (
            ModelConfig(name=model, dtype=dtype, generation_config=generation_config)
            if model in known
            else ModelConfig(name="hf", path=str(model), dtype=dtype, generation_config=generation_config)
        )
        self.engine_cfg = from_mapping(EngineConfig, engine_options, section="engine")
        self.spec_cfg = from_mapping(SpeculativeConfig, dict(speculative or {}), section="speculative")
        self.loaded, self.default_sampling, self.model_sampling_defaults = load_for(model_cfg, self.engine_cfg, {})
        self.trace = trace
        self.trace_root = Path(trace_root) if trace_root is not None else Path("traces") / time.strftime("%Y-%m-%d")
        self.trace_dirs: list[Path] = []
        self.calls = 0  # generate / chat calls so far: each after the first samples afresh (_call_config)

    @classmethod
    def over(
        cls,
        loaded,
        engine_cfg: EngineConfig,
        *,
        default_sampling: SamplingParams | None = None,
        trace: bool = True,
        trace_root: str | Path | None = None,
    ) -> LLM:
        """An LLM over weights already loaded (the benchmark's, a test's): nothing is loaded again."""
        llm = cls.__new__(cls)
        llm.engine_cfg, llm.spec_cfg, llm.loaded = engine_cfg, SpeculativeConfig(), loaded
        llm.default_sampling, llm.model_sampling_defaults = default_sampling or SamplingParams(), {}
        llm.trace = trace
        llm.trace_root = Path(trace_root) if trace_root is not None else Path("traces") / time.strftime("%Y-%m-%d")
        llm.trace_dirs = []
        llm.calls = 0
        return llm

    @property
    def trace_dir(self) -> Path | None:
        """The latest call's run directory (None before the first call, or with trace=False)."""
        return self.trace_dirs[-1] if self.trace_dirs else None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without its own SamplingParams gets (vLLM's name): the model's defaults where it has
        them (generation_config="auto"), else the library's."""
        return self.default_sampling

    def get_tokenizer(self):
        """The model's tokenizer (encode, decode, apply_chat_template); None for a model without one."""
        return self.loaded.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. `sampling_params`: one for every prompt, or one each. `use_tqdm`: a
        progress line on a terminal (sequences done, tokens/s; nothing when stderr is not one). A request without its
        own seed samples afresh each call, as vLLM's do (the engine's seed of each call after the first is derived
        from `seed` and the call's number, and recorded), and a new LLM with the same `seed` repeats the calls in
        order; request ids are "0", "1", ... in every call, so two calls' traces join request by request."""
        if _is_array(prompts):  # as HF's tokenizers return ids: a row a prompt
            if prompts.ndim not in (1, 2):
                raise ConfigError(
                    f"an array of token ids has 1 dimension (a prompt) or 2 (prompts), got {prompts.ndim}"
                )
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        else:
            prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        return self._run([_prompt_request(p) for p in prompts], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per conversation (the tokenizer's chat template, generation prompt added). A message's content
        may be OpenAI's text parts ([{"type": "text", "text": ...}]), joined."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ConfigError(
                f"messages must be a list of {{role, content}} mappings (or of such lists), got {messages!r:.80}"
            )
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        return self._run([{"messages": _conversation(c)} for c in conversations], sampling_params, use_tqdm)

    def _run(
        self,
        requests: list[dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        params = _per_request(sampling_params, len(requests), self.default_sampling)
        engine_cfg, self.calls = _call_config(self.engine_cfg, self.calls), self.calls + 1
        engine = Engine(self.loaded, engine_cfg, self.default_sampling, self.spec_cfg)
        ids = [
            engine.add(EngineRequest(**r, sampling_params=p, request_id=f"{i}"))
            for i, (r, p) in enumerate(zip(requests, params))
        ]  # a bad request raises before anything runs
        logprobs = _Logprobs(
            engine,
            {i for i, p in zip(ids, params) if p.logprobs is not None},
            {i: p.prompt_logprobs for i, p in zip(ids, params) if p.prompt_logprobs is not None},
        )
        if not self.trace:
            progress = Progress(sum(len(engine.sequences(i)) for i in ids)) if use_tqdm else None
            while engine.has_unfinished():
                out = engine.step()
                logprobs.stepped(out)
                if progress is not None:
                    progress.update(out)
            if progress is not None:
                progress.close()  # the line ends, as record's does
            return [logprobs.attach(engine.output(i)) for i in ids]
        run_dir = _new_run_dir(self.trace_root, f"{time.strftime('%H-%M-%S')}-llm-{len(self.trace_dirs)}")
        config = {
            "model": dataclasses.asdict(self.loaded.config),
            "engine": dataclasses.asdict(engine_cfg),
            "speculative": dataclasses.asdict(self.spec_cfg),
            "mode": "run",
            "entry": "toolkit.LLM",
        }
        recorded = record(engine, ids, run_dir, config, on_step=logprobs.stepped, progress=use_tqdm)
        self.trace_dirs.append(recorded.run_dir)
        return [logprobs.attach(o) for o in recorded.outputs]


class _Logprobs:
    """vLLM's per-token logprobs of the requests that asked for them, read from each step's trace rows as the run
    goes: at each position the sampled token (its rank counted on the step's raw logits row), then the
    `logprobs` most likely (top_raw, ranks 1..k); the sum of the sampled tokens' log-probabilities beside. A
    request's `prompt_logprobs` come from one no-cache forward over its prompt (the server's echo scores)."""

    def __init__(self, engine: Engine, wanted: set[str], prompt_wanted: dict[str, int]):
        self.engine, self.tokenizer, self.wanted, self.prompt_wanted = engine, engine.tokenizer, wanted, prompt_wanted
        self.rows: dict[tuple[str, int], list[dict[int, Logprob]]] = {}

    def _text(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    def stepped(self, out: StepOutput) -> None:
        taken = [s for s in out.samples if s.request_id in self.wanted and s.token_id >= 0]
        if not taken:
            return
        rows = out.logits_RV[torch.tensor([s.logits_row for s in taken], device=out.logits_RV.device)]
        chosen = rows.gather(1, torch.tensor([[s.token_id] for s in taken], device=rows.device))
        ranks = ((rows > chosen).sum(1) + 1).tolist()  # the step's ranks in one pass (one device sync on a GPU)
        for s, rank in zip(taken, ranks):
            self.rows.setdefault((s.request_id, s.stream), []).append(
                self._entries(s.token_id, s.raw_logprob, rank, s.top_raw)
            )

    def _entries(self, token_id: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """One position's dict: its own token first, then the most likely (ranks 1..k) it is not one of."""
        entries = {token_id: Logprob(logprob, rank, self._text(token_id))}
        for r, (t, lp) in enumerate(top, 1):
            entries.setdefault(t, Logprob(lp, r, self._text(t)))
        return entries

    def attach(self, out: RequestOutput) -> RequestOutput:
        if out.request_id in self.prompt_wanted:
            out = dataclasses.replace(out, prompt_logprobs=self._prompt(out, self.prompt_wanted[out.request_id]))
        if out.request_id not in self.wanted:
            return out
        samples = []
        for c in out.outputs:
            rows = self.rows.get((out.request_id, c.index), [])
            cumulative = sum(row[t].logprob for row, t in zip(rows, c.token_ids))
            samples.append(dataclasses.replace(c, logprobs=rows, cumulative_logprob=cumulative))
        return dataclasses.replace(out, outputs=tuple(samples))

    def _prompt(self, out: RequestOutput, k: int) -> list[dict[int, Logprob] | None]:
        scored = self.engine.prompt_logprobs(out.prompt_token_ids, k)[1:]
        return [None] + [self._entries(token_id, logprob, rank, top) for token_id, logprob, top, rank in scored]


def _is_array(x: Any) -> bool:
    """A numpy array or a torch tensor (of token ids, where a prompt is expected)."""
    return hasattr(x, "tolist") and hasattr(x, "ndim")


def _ids(x: Any) -> Any:
    """One prompt's ids in a one-dimensional array as the list it holds; anything else as it is."""
    return x.tolist() if _is_array(x) and x.ndim == 1 else x


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Iterable):
        return True  # None, a number...: refused as one prompt (_prompt_request)
    return bool(prompts) and all(_is_token_id(t) for t in prompts)


def _is_token_id(t: Any) -> bool:
    """An integer (Python's or numpy's: a list of a tokenizer's np.int64), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def _prompt_request(prompt: Prompt) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown:
            raise ConfigError(f"a prompt mapping takes prompt or prompt_token_ids, not {', '.join(unknown)}")
        out = {k: _ids(v) if k == "prompt_token_ids" else v for k, v in prompt.items()}
        ids = out.get("prompt_token_ids")
        if isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)):
            out["prompt_token_ids"] = [int(t) if _is_token_id(t) else t for t in ids]
        return out
    prompt = _ids(prompt)
    if isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Sequence):
        raise ConfigError(
            f"a prompt is text, a list of token ids or a {{prompt | prompt_token_ids}} mapping, got {prompt!r:.80}"
        )
    return {"prompt_token_ids": [int(t) if _is_token_id(t) else t for t in prompt]}


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """A conversation's messages as plain dicts, OpenAI's text content parts joined (what the server does)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ConfigError(f"a conversation is a list of {{role, content}} mappings, got {messages!r:.80}")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ConfigError(f"a chat message is a {{role, content}} mapping, got {m!r:.80}")
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = m["content"]
            if not all(
                isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
            ):
                raise ConfigError(
                    f"a message's content parts must be text parts ({{type: text, text}}), got {parts!r:.80}"
                )
            m["content"] = "".join(p["text"] for p in parts)
        for name in ("tool_calls", "function_call", "audio"):  # a message an OpenAI client got back: null there
            if m.get(name) not in (None, []):
                raise ConfigError(f"a chat message's {name} is not supported (tool calling and audio are not)")
        if m.get("content") is None and isinstance(m.get("refusal"), str):
            m["content"] = m["refusal"]  # a refusal is the message's text, as the server reads it
        out.append(m)
    return out


def _call_config(engine_cfg: EngineConfig, call: int) -> EngineConfig:
    """The engine's config for an LLM's `call`-th call (from 0): the first runs with the LLM's own seed (the CLI's run
    with it, bit for bit); each later one with a seed derived from it and the call's number. An unseeded request's
    seed derives from the engine's seed and its id, and every call's ids are "0", "1", ... (so runs join request by
    request), so without this a second call repeated the first's samples, where vLLM's sample afresh; a fresh LLM
    repeats its calls in order, and each call's config records the seed it ran with (replay takes it)."""
    return (
        engine_cfg if call == 0 else dataclasses.replace(engine_cfg, seed=derive_seed(engine_cfg.seed, f"call-{call}"))
    )


def _per_request(sampling_params, n: int, default: SamplingParams) -> list[SamplingParams]:
    if sampling_params is None:
        return [default] * n
    if isinstance(sampling_params, (SamplingParams, Mapping)):
        return [_sampling(sampling_params)] * n
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Iterable):
        raise ConfigError(f"sampling_params must be SamplingParams (or a list of them), got {sampling_params!r:.80}")
    params = [_sampling(p) for p in sampling_params]
    if len(params) != n:
        raise ConfigError(f"{len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return params


def _sampling(params: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    """SamplingParams, or a mapping of its fields (unknown ones named)."""
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams.from_mapping(params)
    raise ConfigError(f"sampling_params must be SamplingParams (or a list of them), got {params!r:.80}")


def _new_run_dir(root: Path, stem: str) -> Path:
    """A directory made here under `root`: `stem`, or `stem-2`, `stem-3`, ... where that is taken. mkdir is atomic,
    so two LLMs (or processes) sharing a trace_root in one second never get one run directory (the second's call
    was refused: it already held a run)."""
    root.mkdir(parents=True, exist_ok=True)
    for k in itertools.count(1):
        path = root / (stem if k == 1 else f"{stem}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")
