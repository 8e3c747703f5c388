"""The character-level nanoGPT path: mode=train learns a text, the engine serves the checkpoint
through the GPT-2 family, and HF transformers reads the same checkpoint as the reference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_engine
from tests.numerics import assert_greedy_agreement, top2_margin
from tests.test_cli import run_cli
from toolkit.config import ModelConfig
from toolkit.data import passages
from toolkit.errors import ConfigError
from toolkit.models import load_model
from toolkit.models.loading import hf_reference_model, load_checkpoint
from toolkit.modes.train import train
from toolkit.sampling.params import SamplingParams

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, max_position_embeddings=32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "input.txt"
    text.write_text("\n".join(passages()) * 3)
    out = tmp_path_factory.mktemp("ckpt") / "nanogpt"
    result = train(
        dict(text=str(text), steps=120, batch_size=16, learning_rate=3e-3, eval_interval=60, seed=0),
        SMALL,
        out,
        log=lambda *_: None,
    )
    return out, result["history"]


def test_training_reduces_loss(trained):
    _, history = trained
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 1.0  # from ~ln(vocab) toward the bigram level
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5


@pytest.mark.native
@pytest.mark.numerics
def test_checkpoint_serves_like_hf_and_round_trips_text(trained):
    """Greedy tokens equal HF generate's on the trained checkpoint, but at a near-tie of HF's (the weights
    themselves are this CPU's training; the two implementations round apart by about 1e-6, the bound here is
    1e-3: tests/numerics.py)."""
    out, _ = trained
    cfg = ModelConfig(name="nanogpt", path=str(out))
    loaded = load_model(cfg)
    assert loaded.arch.family == "gpt2" and loaded.tokenizer is not None
    text = "The river\nbends, twice."
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
    prompts = ["The ", "In the\n", "A small"]
    engine = make_engine(loaded, num_kv_blocks=32, block_size=8, max_num_batched_tokens=16, max_num_seqs=3)
    ids = [
        engine.add_request(prompt=p, sampling_params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        for p in prompts
    ]
    while engine.has_unfinished():
        engine.step()
    hf = hf_reference_model(load_checkpoint(cfg))
    expected, margins, ours = {}, {}, {}
    for rid, p in zip(ids, prompts):
        prompt_ids = loaded.tokenizer.encode(p)
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        expected[rid] = out.sequences[0, len(prompt_ids) :].tolist()
        margins[rid] = [top2_margin(step[0]) for step in out.logits]
        ours[rid] = engine.requests[rid].token_ids[len(prompt_ids) :]
    assert assert_greedy_agreement(expected, margins, ours, window=24, near_tie=1e-3).checked


def test_bad_training_text_is_one_line_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="needs at least"):
        train(dict(text=str(short), steps=1, batch_size=2, learning_rate=1e-3, eval_interval=1), SMALL, tmp_path / "o")
    with pytest.raises(ConfigError, match="train.text must name a local text file"):
        train(
            dict(text=str(tmp_path / "missing.txt"), steps=1, batch_size=2, learning_rate=1e-3, eval_interval=1),
            SMALL,
            tmp_path / "o",
        )


@pytest.mark.native
def test_train_then_serve_from_the_command_line(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("\n".join(passages()))
    proc = run_cli(
        "mode=train",
        "model=nanogpt",
        f"train.text={text}",
        "train.steps=10",
        "train.eval_interval=5",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.max_position_embeddings=64",
        run_dir=tmp_path / "train",
    )
    assert proc.returncode == 0, proc.stderr
    assert "serve it: python run.py model=nanogpt" in proc.stdout
    proc = run_cli(
        "model=nanogpt",
        f"model.path={tmp_path / 'train' / 'nanogpt'}",
        "workload=text",
        "workload.num_requests=2",
        "workload.max_tokens=12",
        run_dir=tmp_path / "serve",
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "serve" / "samples.parquet").is_file() or any((tmp_path / "serve").rglob("samples*.parquet"))
    proc = run_cli("model=nanogpt", run_dir=tmp_path / "nopath")
    assert proc.returncode != 0 and "model=nanogpt needs model.path" in proc.stderr
