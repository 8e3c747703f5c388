"""Entry point: compose the config with Hydra, then run a mode (see conf/config.yaml)."""

import sys
from pathlib import Path

if __name__ == "__main__" and ("--help" in sys.argv[1:] or "-h" in sys.argv[1:]):
    from toolkit.modes import usage

    print(usage())
    sys.exit(0)

import hydra  # noqa: E402  (after the help, which needs neither Hydra nor torch)
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from toolkit.config import register_configs  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from toolkit.modes.app import main as run_mode

    code = run_mode(cfg, Path(HydraConfig.get().runtime.output_dir))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
