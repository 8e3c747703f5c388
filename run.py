"""Entry point: compose the config with Hydra, then run a mode (see conf/config.yaml)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from toolkit.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from toolkit.app import main as run_mode

    code = run_mode(cfg, Path(HydraConfig.get().runtime.output_dir))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
