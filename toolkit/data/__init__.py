"""Text the package ships: passages.txt, the paragraphs long chat prompts quote and KV scales are calibrated on."""

from importlib import resources


def passages() -> list[str]:
    """The passages, one a line, stripped."""
    text = resources.files("toolkit.data").joinpath("passages.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.splitlines() if p.strip()]
