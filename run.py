"""Entry point: compose the config with Hydra, then run a mode (see conf/config.yaml)."""

import sys
from pathlib import Path

if __name__ == "__main__" and ("--help" in sys.argv[1:] or "-h" in sys.argv[1:]):
    from toolkit.modes import usage

    print(usage())
    sys.exit(0)

import hydra  # noqa: E402  (after the help, which needs neither Hydra nor torch)
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from toolkit.config import register_configs  # noqa: E402
from toolkit.modes.jobs import job_ended, sweep_exit_code  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from toolkit.modes.app import main as run_mode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    code = run_mode(cfg, run_dir)
    # a single run exits with its code; a sweep's job records it and returns, so the sweep runs every job
    job_ended(run_dir, code, hydra_cfg.mode == RunMode.MULTIRUN, hydra_cfg.job.get("num", 0), hydra_cfg.overrides.task)


if __name__ == "__main__":
    main()
    sys.exit(sweep_exit_code())  # a multirun's: 1 where a job failed (named on stderr)
