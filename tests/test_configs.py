"""Every config group option and every experiment composes, and what it composes instantiates;
a joblib multirun writes one trace per job, mode=compare reads them, wandb logs offline."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from tests.conftest import BATCH_INVARIANT_OVERRIDE, NATIVE_OFF
from toolkit.config import EngineConfig, ModelConfig, SpeculativeConfig, from_mapping, register_configs
from toolkit.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = [
    "model",
    "engine",
    "sampling",
    "processors",
    "structured_outputs",
    "speculative",
    "workload",
    "trace",
    "logger",
    "bench",
]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))

register_configs()


def _compose(overrides: list[str], *, hydra_node: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_node)


def _instantiate(cfg) -> None:
    """Build what a run builds from the composed config (no model weights are loaded)."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    from_mapping(EngineConfig, plain["engine"], section="engine")
    from_mapping(ModelConfig, plain["model"], section="model")
    SamplingParams.from_mapping(plain["sampling"])
    from_mapping(SpeculativeConfig, plain["speculative"], section="speculative")
    assert plain["logger"]["backend"] in ("none", "wandb")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_and_instantiates(group, option):
    overrides = [f"{group}={option}"] + (["model.path=/some/checkpoint"] if (group, option) == ("model", "hf") else [])
    cfg = _compose(overrides)
    _instantiate(cfg)


def test_groups_are_all_present():
    assert all(_options(g) for g in GROUPS), [g for g in GROUPS if not _options(g)]
    assert set(EXPERIMENTS) >= {
        "json_extraction",
        "preemption_invariance",
        "chunk_size_sweep",
        "sampling_policy_ablation",
        "speculative_acceptance",
    }


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_with_each_swept_value(name):
    cfg = _compose([f"experiment={name}"], hydra_node=True)
    _instantiate(cfg)
    text = (ROOT / "experiments" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_") and f"experiment={name}" in text  # usage line
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    for key, values in params.items():
        for value in str(values).split(","):
            _instantiate(_compose([f"experiment={name}", f"{key}={value}"]))


@pytest.mark.native
def test_preemption_invariance_preempts_and_every_request_fits_its_small_pool(tmp_path):
    """Before, the experiment's 32-block pool held 512 tokens and its chat-5 needs 583: the small-pool jobs
    refused that request instead of preempting anything for it, so the sweep did not answer its question."""
    cfg = _compose(["experiment=preemption_invariance"], hydra_node=True)
    (pool,) = [v for v in str(cfg.hydra.sweeper.params["engine.num_kv_blocks"]).split(",") if v != "null"]
    run_dir = tmp_path / "run"
    args = ["experiment=preemption_invariance", "model=tiny", BATCH_INVARIANT_OVERRIDE, f"engine.num_kv_blocks={pool}"]
    proc = _run(
        [*args, "print_outputs=false", "plots=false", "report.auto=false", f"hydra.run.dir={run_dir}"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["requests"], summary["rejected"]) == (cfg.workload.num_requests, 0), summary.get(
        "rejected_requests"
    )
    assert summary["num_preemptions"] > 0


def test_a_typo_or_a_mistyped_value_is_refused_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(["engine.max_num_seq=4"])
    with pytest.raises(ConfigCompositionException):
        _compose(["engine.max_num_seqs=many"])


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.native
def test_joblib_multirun_writes_a_trace_per_job_and_compare_reads_them(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _run(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "model=tiny",
            BATCH_INVARIANT_OVERRIDE,
            "engine.max_num_seqs=4",
            "engine.max_num_batched_tokens=8,64",
            "workload.num_requests=3",
            "workload.max_tokens=20",
            "print_outputs=false",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Joblib.Parallel" in proc.stdout + proc.stderr
    runs = sorted(p for p in sweep.iterdir() if (p / "samples.parquet").exists())
    assert len(runs) == 2
    for run in runs:
        assert (run / "timeline.png").stat().st_size > 0 and (run / "latency.png").exists()
    proc = _run(["mode=compare", f"compare.runs=[{sweep}/*]", f"hydra.run.dir={tmp_path / 'cmp'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(reference)" in proc.stdout
    if not NATIVE_OFF:  # batch-invariant (the kernels'): the same tokens and logits at either budget
        assert "identical (" in proc.stdout
    assert (tmp_path / "cmp" / "compare.png").exists() and (tmp_path / "cmp" / "compare.parquet").exists()


@pytest.mark.native
def test_compare_names_the_first_divergence(tmp_path):
    from toolkit.reproduce.compare import compare

    runs = []
    for i, temperature in enumerate([1.0, 1.5]):
        proc = _run(
            [
                "model=tiny",
                "workload.num_requests=2",
                "workload.max_tokens=16",
                "print_outputs=false",
                f"sampling.temperature={temperature}",
                f"hydra.run.dir={tmp_path / str(i)}",
            ],
            tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(str(tmp_path / str(i)))
    result = compare(runs, out_dir=tmp_path / "cmp")
    assert "rows differ; first" in result.rows[1]["divergence"]
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="matches no run directory"):
        compare([str(tmp_path / "nothing*")])


def test_compare_keys_runs_by_directory_and_counts_missing_rows_and_sequences(tmp_path):
    """Before, compare grouped sample rows by run_id, so an edited copy of a run (same run_id) was merged into the
    first run and reported "identical"; and it counted only the rows both runs hold, so a run cut short, or missing
    a whole sequence, was "identical (N rows)" too."""
    from toolkit.reproduce.compare import compare

    source = ROOT / "tests" / "data" / "traces" / "v7-file"
    (part,) = (source / "samples.parquet").glob("part-*.parquet")
    table = pq.read_table(part)
    rows = table.to_pylist()
    last = max(r["position"] for r in rows if r["request_id"] == "chat-0")
    edits = {
        "copy": rows,
        "edited": [
            {**r, "token_id": r["token_id"] + 1} if (r["request_id"], r["position"]) == ("chat-0", last) else r
            for r in rows
        ],
        "cut": [r for r in rows if r["request_id"] == "chat-0" and r["position"] != last],  # chat-1 gone whole
    }
    runs = []
    for name, edited in edits.items():
        shutil.copytree(source, tmp_path / name)
        pq.write_table(
            pa.Table.from_pylist(edited, schema=table.schema), tmp_path / name / "samples.parquet" / part.name
        )
        if name == "edited":  # its request row spells the edited token too: compare refuses a trace that disagrees
            path = tmp_path / name / "requests.parquet"
            for p in sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]:
                req = pq.read_table(p).to_pylist()
                for r in req:
                    if r["request_id"] == "chat-0":
                        r["output_token_ids"][-1] += 1
                pq.write_table(pa.Table.from_pylist(req, schema=pq.read_schema(p)), p)
        if name == "cut":  # a run killed before it closed (no summary.json): its rows stop short
            (tmp_path / name / "summary.json").unlink()
        runs.append(str(tmp_path / name))
    result = compare([str(source), *runs], out_dir=tmp_path / "cmp")
    copy, edited, cut = result.rows[1:]
    assert copy["divergence"] == f"identical ({len(rows)} rows)"
    assert edited["divergence"] == f"1/{len(rows)} rows differ; first chat-0 position {last}"
    assert cut["divergence"].startswith("the 4 shared rows agree; 6 rows only in the first run (")
    assert f"chat-0 from position {last}" in cut["divergence"] and "chat-1 missing from this run" in cut["divergence"]
    written = pq.read_table(tmp_path / "cmp" / "compare.parquet").to_pylist()[3]
    assert (written["rows_only_first_run"], written["sequences_only_first_run"]) == (6, ["chat-1"])
    # two runs that agree: the agreement columns keep their types (null and list<null> before), one schema for all
    compare([str(source), runs[0]], out_dir=tmp_path / "agree")
    schema = pq.read_schema(tmp_path / "agree" / "compare.parquet")
    assert schema.field("first_differing").type == pa.string()
    assert schema.field("sequences_only_this_run").type == pa.list_(pa.string())
    assert schema.field("rows_only_first_run").type == pa.int64()


@pytest.mark.native
def test_wandb_offline_run_logs_config_steps_requests_summary_and_trace_artifact(tmp_path):
    from toolkit.runs.loggers import read_offline_run

    proc = _run(
        [
            "model=tiny",
            "logger=wandb",
            "workload.num_requests=2",
            "workload.max_tokens=20",
            "print_outputs=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    logged = read_offline_run(Path(files[0]))
    assert {"engine", "model", "sampling", "workload"} <= logged["config"]
    assert {"step/batch_size", "step/decode_tokens", "step/prefill_tokens", "step/kv_utilization"} <= logged["history"]
    assert logged["history_rows"] >= 5
    assert {"output_tok_per_s", "ttft_p50_s", "tpot_p50_s", "run_id"} <= logged["summary"]
    kinds = {a["type"]: a["files"] for a in logged["artifacts"]}
    assert "run_table" in kinds  # per-request TTFT/TPOT table
    assert "summary.json" in kinds["trace"]
    for name in ("samples", "requests", "steps"):
        assert any(f.startswith(f"{name}.parquet/part-") for f in kinds["trace"]), name


@pytest.mark.native
def test_the_models_generation_config_fills_the_sampling_defaults(tmp_path):
    """vLLM's generation_config="auto": a checkpoint's generation_config.json sets the sampling fields the run
    leaves at the library's default; a field the run sets keeps its value; model.generation_config=none
    keeps the library's defaults; SmolLM2 (no generation config in its GGUF) takes its model card's."""
    import json
    import shutil

    from tests.families import checkpoint_dir
    from toolkit.engine.core import Engine
    from toolkit.models.loading import SMOLLM2_GENERATION, generation_defaults

    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("llama"), model)
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "do_sample": True, "bos_token_id": 1})
    )
    assert generation_defaults(model) == {"temperature": 0.6, "top_k": 20}
    cfg = {"model": {"name": "hf", "path": str(model)}, "sampling": {"top_p": 0.5, "top_k": 7}}
    engine = Engine.from_config(cfg)
    p = engine.default_sampling
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 7, 0.5)
    assert engine.model_sampling_defaults == {"temperature": 0.6}
    library = Engine.from_config({**cfg, "model": {**cfg["model"], "generation_config": "none"}}).default_sampling
    assert (library.temperature, library.top_k, library.top_p) == (1.0, 7, 0.5)
    assert SMOLLM2_GENERATION == {"temperature": 0.2, "top_p": 0.9}
