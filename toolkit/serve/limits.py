"""What one request may ask of a server (serve.max_*): past a limit it is refused with a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.serve.protocol import FieldError, SamplingFields
from toolkit.serve.shapes import json_shape, schema_pattern_cost, schema_text


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (serve.max_*): past a limit a request is refused, the field named. Each bounds a
    cost on the server: the engine thread's work per token (stop strings, bad words), a grammar's compilation (the
    schema's depth, size, text and patterns), what the trace keeps (user, metadata)."""

    max_body_mb: float = 8.0  # a larger body: 413
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_sequences: int = 256  # sequences one request makes: its prompts times n
    max_stop: int = 32  # stop strings (and stop_token_ids)
    max_stop_chars: int = 4096  # characters of all stop strings together (matched against every new token)
    max_bad_words: int = 256
    max_logit_bias: int = 1024  # logit_bias entries
    max_user_chars: int = 256  # `user`: an end-user id
    max_metadata: int = 16  # `metadata` pairs (OpenAI's limits: 16 pairs, keys <= 64 and values <= 512 chars)
    max_schema_depth: int = 64  # nesting of response_format's JSON schema (a grammar's compile time grows with it)
    max_schema_nodes: int = 10000  # objects, arrays and values in that schema
    max_schema_chars: int = 16384  # characters of its property names, enum and const values and patterns
    max_schema_pattern_cost: int = 4000  # its patterns' compile, about in ms (toolkit.serve.shapes.pattern_cost)
    grammar_timeout_s: float = 10.0  # compiling a request's grammar past this: 400
    max_unread_mb: float = 4.0  # a request's output its client has not read yet, past which it is aborted
    max_response_mb: float = 64.0  # an answer not streamed, held until whole (text, logprob rows): past it, a 400
    stream_write_timeout_s: float = 30.0  # a stream whose client takes no bytes for this long: requests aborted
    client_body_timeout_s: float = 30.0  # a body of which no byte comes for this long: 408 (nginx's name)
    # prompt tokens one echo + logprobs request has scored: a forward over all of them, off the cache, whose time
    # grows faster than their count (SmolLM2, AMD EPYC (avx2 avx512f ): 2.5 s for 1,000 tokens, 16 s for 4,000,
    # 51 s for 8,000)
    max_scored_tokens: int = 4096

    def __post_init__(self) -> None:
        value = self.max_scored_tokens
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"serve.max_scored_tokens must be a positive integer, got {value!r}")

    def check_scored(self, tokens: int) -> None:
        """A FieldError (the prompt) where echo with logprobs would score more prompt tokens than one request may:
        each costs the forward's fp32 logits and time, on a thread one request holds at once."""
        if tokens > self.max_scored_tokens:
            raise FieldError(
                "prompt",
                f"prompt: echo with logprobs would score {tokens} prompt tokens, more than this server scores in "
                f"one request (serve.max_scored_tokens={self.max_scored_tokens})",
            )

    def check(self, req: SamplingFields, prompts: int) -> None:
        """A FieldError naming the first field past its limit."""
        stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
        for name, count, knob in (
            ("prompt", prompts, "max_prompts"),
            ("stop", len(stop), "max_stop"),
            ("stop_token_ids", len(req.stop_token_ids or ()), "max_stop"),
            ("bad_words", len(req.bad_words or ()), "max_bad_words"),
            ("logit_bias", len(req.logit_bias or {}), "max_logit_bias"),
            ("metadata", len(req.metadata or {}), "max_metadata"),
        ):
            if count > getattr(self, knob):
                raise FieldError(
                    name, f"{name}: {count} entries, more than this server takes (serve.{knob}={getattr(self, knob)})"
                )
        if prompts * req.n > self.max_sequences:
            raise FieldError(
                "n",
                f"n: {prompts} prompt(s) with n={req.n} are {prompts * req.n} sequences, more than this server runs "
                f"for one request (serve.max_sequences={self.max_sequences})",
            )
        for name, chars, knob in (
            ("stop", sum(map(len, stop)), "max_stop_chars"),
            ("bad_words", sum(map(len, req.bad_words or ())), "max_stop_chars"),
            ("user", len(req.user or ""), "max_user_chars"),
        ):
            if chars > getattr(self, knob):
                raise FieldError(
                    name,
                    f"{name}: {chars} characters, more than this server takes (serve.{knob}={getattr(self, knob)})",
                )
        for key, value in (req.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise FieldError(
                    "metadata",
                    f"metadata: keys are at most 64 characters and values at most 512 "
                    f"(the key {key[:64]!r}... is past it)",
                )
        schema = req.structured_outputs()
        if schema is not None:
            depth, nodes = json_shape(schema["json"], self.max_schema_depth, self.max_schema_nodes)
            for what, value, knob in (
                ("nested", depth, "max_schema_depth"),
                ("large", nodes, "max_schema_nodes"),
                ("long", schema_text, "max_schema_chars"),  # walked once depth and size are known to be bounded
                ("costly (its patterns' repeats)", schema_pattern_cost, "max_schema_pattern_cost"),
            ):
                value = value(schema["json"]) if callable(value) else value
                if value > getattr(self, knob):
                    raise FieldError(
                        "response_format.json_schema.schema",
                        f"response_format.json_schema.schema is too {what} to compile: {value} "
                        f"(serve.{knob}={getattr(self, knob)})",
                    )
