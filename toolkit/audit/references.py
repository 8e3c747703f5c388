"""The audit's references: what a claim is recomputed with. `ours` / `hf` (float64 textbook forward, HF
transformers) or either in a stated format (`ours@bfloat16`: our engine's own forward of the model in bf16;
`hf@float16`: HF's model cast), and our engine's packed recomputation (EngineForward)."""

from __future__ import annotations

import dataclasses

import torch

from toolkit.audit.checks import Forward
from toolkit.engine.runner import recompute_logits, recompute_many
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.reproduce.verify import reference_forward

REFERENCES = ("ours", "hf")


STATED_DTYPES = ("float64", "float32", "bfloat16", "float16")  # the formats an audit reference may be stated in


def _references(a: dict) -> list[str]:
    """ours | hf | both, or a list of them, each optionally in a stated format: ours@bfloat16 (our engine's
    own forward of the model in bf16), hf@bfloat16 (HF's model cast to bf16), ours@float64 (= ours)."""
    references = a.get("reference", "ours")
    references = [references] if isinstance(references, str) else list(references)
    if references == ["both"]:
        references = list(REFERENCES)

    def ok(r) -> bool:
        name, _, dtype = str(r).partition("@")
        return name in REFERENCES and (not dtype or dtype in STATED_DTYPES)

    if not references or not all(ok(r) for r in references):
        raise ConfigError(
            f"audit.reference must be ours, hf, both or a list of them, each optionally @<dtype> "
            f"({', '.join(STATED_DTYPES)}), got {a.get('reference')!r}"
        )
    return [str(r) for r in references]


def stated_reference(loaded, reference: str):
    """ids -> logits for an audit reference: `ours` / `hf` (toolkit.reproduce.verify.reference_forward), or one in a
    stated format: ours@float64 is the float64 textbook forward; ours@<float32 | bfloat16 | float16> is our
    engine's own forward (one no-cache prefill, the native kernels where they run) of the model loaded in that
    format, the recomputation a claim from an engine running that format is checked against; hf@<dtype> is HF
    transformers' model cast to it."""
    name, _, dtype = reference.partition("@")
    if not dtype or (name, dtype) == ("ours", "float64"):
        return reference_forward(loaded, name)

    if name == "ours":
        same = str(loaded.model.embed.dtype).removeprefix("torch.") == dtype
        model = loaded.model if same else load_model(dataclasses.replace(loaded.config, dtype=dtype)).model
        return EngineForward(model)

    hf = hf_reference_model(load_checkpoint(loaded.config)).to(getattr(torch, dtype))

    @torch.inference_mode()
    def forward(ids: list[int]) -> torch.Tensor:
        return hf(torch.tensor([ids])).logits[0].double()

    return forward


def _forward(loaded, reference: str, memo: dict[str, Forward] | None) -> Forward:
    """stated_reference, made once per reference where a memo is kept (a 16-bit model loaded once a run)."""
    if memo is None:
        return stated_reference(loaded, reference)
    if reference not in memo:
        memo[reference] = stated_reference(loaded, reference)
    return memo[reference]


class EngineForward:
    """Our engine's own forward as an audit reference: one sequence (`forward(ids)`), or many packed into
    prefills of up to `max_tokens` computed tokens, a prompt's blocks shared within a pack (`many`), bit for bit
    the same (toolkit.engine.runner.recompute_many). `counts`: the tokens `many` read and those it ran."""

    def __init__(self, model, max_tokens: int = 2048):
        self.model, self.max_tokens = model, max_tokens
        self.counts = {"tokens": 0, "computed": 0}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        return recompute_logits(self.model, ids).double()

    def many(self, sequences: list[list[int]], last: list[int]) -> list[torch.Tensor]:
        """fp32 logits of the last `last[i]` positions of each sequence (the caller widens one at a time)."""
        return recompute_many(self.model, sequences, last, max_tokens=self.max_tokens, counts=self.counts)


def _atol(a: dict) -> float:
    atol = a.get("atol", 1e-4)
    if not (isinstance(atol, (int, float)) and not isinstance(atol, bool) and atol > 0):
        raise ConfigError(f"audit.atol must be a positive number, got {atol!r}")
    return float(atol)
