"""Workloads: the requests a run serves, from a JSONL file or built in.

A JSONL line is one JSON object with exactly one of `prompt` (text), `messages` (chat;
the tokenizer's chat template is applied) or `prompt_token_ids`, and optionally `id`,
`max_tokens`, `arrival_step` (admitted no earlier than that engine step) and `sampling`
(per-request overrides of the `sampling` config group). A bad line is reported with its
line number; the other lines still run. The file is UTF-8 (a byte order mark at its start is
dropped), its lines end at a line feed (CRLF too): a raw U+2028 or U+0085 in a JSON string
is the string's, not a line break. A file that is no UTF-8 is one WorkloadError naming the line.
"""

from __future__ import annotations

import inspect
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from toolkit.data import passages
from toolkit.engine.request import EngineRequest
from toolkit.errors import RequestError, WorkloadError, json_past_limits


class AcceptsRequests(Protocol):
    """What add_specs needs of an engine (toolkit.engine.core.Engine is one): a request in, its id out."""

    def add(self, request: EngineRequest) -> str: ...


REQUEST_KEYS = {"id", "prompt", "messages", "prompt_token_ids", "max_tokens", "arrival_step", "sampling", "priority"}


@dataclass(frozen=True)
class RequestSpec:
    """One request as the user wrote it (validated later, as an EngineRequest, by `Engine.add`)."""

    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    arrival_step: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    source: str = ""  # where it came from, for error messages ("requests.jsonl line 3")

    def engine_request(self) -> EngineRequest:
        return EngineRequest(
            prompt=self.prompt,
            messages=self.messages,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling,
            request_id=self.id,
            arrival_step=self.arrival_step,
            priority=self.priority,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        for key in ("prompt", "messages", "prompt_token_ids"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["arrival_step"] = self.arrival_step
        if self.sampling:
            out["sampling"] = self.sampling
        return out


@dataclass(frozen=True)
class Rejected:
    source: str
    reason: str


def parse_request(obj: Any, *, default_id: str, source: str) -> RequestSpec:
    """Turn one decoded JSON value into a RequestSpec; raise WorkloadError naming the problem."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - REQUEST_KEYS)
    if unknown:
        raise WorkloadError(
            f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(REQUEST_KEYS))}"
        )
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if obj.get(k) is not None]
    if len(given) != 1:
        raise WorkloadError(
            f"{source}: give exactly one of prompt, messages or prompt_token_ids (got {given or 'none'})"
        )
    sampling = obj.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise WorkloadError(f"{source}: sampling must be an object of SamplingParams fields")
    sampling = dict(sampling)
    if "max_tokens" in obj:
        sampling["max_tokens"] = obj["max_tokens"]
    arrival = obj.get("arrival_step", 0)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
        raise WorkloadError(f"{source}: arrival_step must be a non-negative integer, got {arrival!r}")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise WorkloadError(f"{source}: priority must be an integer, got {priority!r}")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise WorkloadError(f"{source}: id must be a string, got {rid!r}")
    return RequestSpec(
        id=str(rid),
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        prompt_token_ids=obj.get("prompt_token_ids"),
        arrival_step=arrival,
        sampling=sampling,
        priority=priority,
        source=source,
    )


def load_requests(path: str | Path) -> tuple[list[RequestSpec], list[Rejected]]:
    """Read a requests JSONL file. Unreadable file (or not UTF-8): WorkloadError. Bad lines: returned as Rejected."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WorkloadError(f"requests file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise WorkloadError(f"cannot read requests file {str(path)!r}: {exc}") from None
    specs, rejected = [], []
    seen: set[str] = set()
    for number, line in enumerate(request_lines(path, data), start=1):
        if not line.strip(JSON_SPACE):
            continue
        source = f"{path.name} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            rejected.append(Rejected(source, f"{source}: malformed JSON ({exc.msg} at column {exc.colno})"))
            continue
        except (ValueError, RecursionError) as exc:
            rejected.append(Rejected(source, f"{source}: malformed JSON ({json_past_limits(exc)})"))
            continue
        try:
            spec = parse_request(obj, default_id=f"line-{number}", source=source)
            if spec.id in seen:
                raise WorkloadError(f"{source}: duplicate request id {spec.id!r}")
        except WorkloadError as exc:
            rejected.append(Rejected(source, str(exc)))
            continue
        seen.add(spec.id)
        specs.append(spec)
    if not specs and not rejected:
        raise WorkloadError(f"requests file {str(path)!r} holds no requests")
    return specs, rejected


JSON_SPACE = " \t\r"  # what JSON takes as whitespace on a line (str.strip() drops U+2028, U+0085, ... too)


def request_lines(path: Path, data: bytes) -> list[str]:
    """The file's lines as they are numbered in it: split at line feeds only (str.splitlines() also split inside a
    line at U+2028, U+0085, form feeds, U+001C-U+001E ..., which a JSON string may hold raw, and so numbered lines
    that are not there), one carriage return before each dropped (CRLF endings), and a UTF-8 byte order mark at the
    start of the file dropped. A line that is no UTF-8 is a WorkloadError naming it: the file is in another
    encoding, and its lines' text would be guessed."""
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            out.append(line.removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise WorkloadError(
                f"requests file {str(path)!r} line {number} is not UTF-8 text (its byte {exc.start + 1}, "
                f"0x{line[exc.start]:02x}): save the file as UTF-8"
            ) from None
    return out


# --------------------------------------------------------------------------- built-in workloads

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old in two sentences.",
    "List three tips for staying focused while studying.",
    "What is the difference between weather and climate?",
    "Give me a short recipe for a vegetable soup.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "Suggest a name for a friendly robot.",
    "How do plants make their food?",
    "What are the planets of the solar system?",
    "Translate 'good morning' into Spanish and French.",
]

PASSAGE_TASKS = [
    "Summarize the following passage in two sentences.",
    "List the main facts in the following passage as bullet points.",
    "Write three questions a teacher could ask about the following passage.",
    "Rewrite the following passage for a young reader.",
]


def chat_workload(
    num_requests: int = 10,
    seed: int = 0,
    min_tokens: int = 16,
    max_tokens: int = 64,
    arrival_every: int = 3,
    long_every: int = 3,
    passages_per_long: int = 1,
) -> list[RequestSpec]:
    """Chat requests with mixed lengths and staggered arrivals.

    Every `long_every`-th request asks a task about 1..`passages_per_long` passages (prompts
    of about 200-550 tokens); the others are short questions (about 40 tokens). Request i arrives at step
    i * arrival_every // 2 so prefills overlap running decodes.
    """
    for name, value in (
        ("num_requests", num_requests),
        ("min_tokens", min_tokens),
        ("max_tokens", max_tokens),
        ("passages_per_long", passages_per_long),
    ):
        if not isinstance(value, int) or value < 1:
            raise WorkloadError(f"workload.{name} must be a positive integer, got {value!r}")
    if min_tokens > max_tokens:
        raise WorkloadError(f"workload.min_tokens ({min_tokens}) must be <= workload.max_tokens ({max_tokens})")
    if not isinstance(arrival_every, int) or arrival_every < 0 or not isinstance(long_every, int) or long_every < 0:
        raise WorkloadError("workload.arrival_every and workload.long_every must be non-negative integers")
    rnd = random.Random(seed)
    texts = passages()
    specs = []
    for i in range(num_requests):
        if long_every and i % long_every == long_every - 1:
            k = rnd.randint(1, min(passages_per_long, len(texts)))
            chosen = rnd.sample(texts, k=k)
            content = rnd.choice(PASSAGE_TASKS) + "\n\n" + "\n\n".join(chosen)
        else:
            content = rnd.choice(CHAT_QUESTIONS)
        specs.append(
            RequestSpec(
                id=f"chat-{i}",
                messages=[{"role": "user", "content": content}],
                arrival_step=(i * arrival_every) // 2,
                sampling={"max_tokens": rnd.randint(min_tokens, max_tokens)},
                source=f"chat workload #{i}",
            )
        )
    return specs


EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 30},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "occupation", "age", "city", "skills"],
}

_FIRST = ["Maria", "Kenji", "Amara", "Lukas", "Priya", "Tomás", "Ingrid", "Omar", "Chen", "Zoe", "Rafael", "Aiko"]
_LAST = [
    "Silva",
    "Tanaka",
    "Okafor",
    "Becker",
    "Sharma",
    "García",
    "Larsen",
    "Haddad",
    "Wei",
    "Martin",
    "Costa",
    "Mori",
]
_JOBS = [
    ("baker", ["bread", "pastry"]),
    ("nurse", ["triage", "wound care"]),
    ("carpenter", ["joinery", "roofing"]),
    ("teacher", ["algebra", "history"]),
    ("pilot", ["navigation", "night flying"]),
    ("chemist", ["titration", "spectroscopy"]),
    ("gardener", ["pruning", "composting"]),
    ("programmer", ["Python", "databases"]),
]
_CITIES = ["Lisbon", "Osaka", "Lagos", "Hamburg", "Pune", "Valencia", "Bergen", "Beirut", "Chengdu", "Lyon"]


def extraction_workload(num_requests: int = 12, seed: int = 0, max_tokens: int = 160) -> list[RequestSpec]:
    """Short biographies; each request extracts one record constrained by EXTRACTION_SCHEMA."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise WorkloadError(f"workload.num_requests must be a positive integer, got {num_requests!r}")
    rnd = random.Random(seed)
    specs = []
    for i in range(num_requests):
        name = f"{rnd.choice(_FIRST)} {rnd.choice(_LAST)}"
        job, skills = rnd.choice(_JOBS)
        age, city = rnd.randint(22, 70), rnd.choice(_CITIES)
        text = (
            f"{name} is a {age}-year-old {job} who lives in {city}. Colleagues praise {name.split()[0]}'s "
            f"skill at {skills[0]} and {skills[1]}."
        )
        specs.append(
            RequestSpec(
                id=f"extract-{i}",
                messages=[
                    {
                        "role": "user",
                        "content": "Extract a JSON record (name, occupation, age, city, skills) "
                        f"from this text:\n\n{text}",
                    }
                ],
                arrival_step=i,
                sampling={"max_tokens": max_tokens, "structured_outputs": {"json": EXTRACTION_SCHEMA}},
                source=f"extraction workload #{i}",
            )
        )
    return specs


def text_workload(
    num_requests: int = 8, seed: int = 0, max_tokens: int = 200, prompt_chars: int = 24
) -> list[RequestSpec]:
    """Plain-text completions (no chat template): each prompt is the opening of a passage, for
    base models and the character-level nanoGPT of mode=train."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise WorkloadError(f"workload.num_requests must be a positive integer, got {num_requests!r}")
    rnd = random.Random(seed)
    texts = passages()
    return [
        RequestSpec(
            id=f"text-{i}",
            prompt=rnd.choice(texts)[:prompt_chars],
            arrival_step=i,
            sampling={"max_tokens": max_tokens},
            source=f"text workload #{i}",
        )
        for i in range(num_requests)
    ]


BUILTIN = {"chat": chat_workload, "extraction": extraction_workload, "text": text_workload}


def builtin_workload(name: str, **kwargs: Any) -> list[RequestSpec]:
    if name not in BUILTIN:
        raise WorkloadError(f"unknown built-in workload {name!r}; known: {', '.join(BUILTIN)}")
    make = BUILTIN[name]
    known = set(inspect.signature(make).parameters)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise WorkloadError(
            f"unknown workload option(s) {', '.join(unknown)} for {name!r}; known: {', '.join(sorted(known))}"
        )
    return make(**kwargs)


def workload_specs(cfg: Any) -> tuple[list[RequestSpec], list[Rejected]]:
    """The requests of a composed config's `workload` section: its file, or a built-in workload."""
    w = OmegaConf.to_container(cfg.workload, resolve=True)
    assert isinstance(w, dict)
    if w.get("requests"):
        return load_requests(w["requests"])
    name = w.pop("name", "chat")
    w.pop("requests", None)
    return builtin_workload(name, **w), []


def add_specs(engine: AcceptsRequests, specs: list[RequestSpec]) -> tuple[list[str], list[Rejected]]:
    """Add every spec; a bad request is rejected with its source and does not stop the others."""
    ids, rejected = [], []
    for spec in specs:
        try:
            ids.append(engine.add(spec.engine_request()))
        except RequestError as exc:
            rejected.append(Rejected(spec.source, f"{spec.source}: {exc}"))
    return ids, rejected
