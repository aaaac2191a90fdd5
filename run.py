"""Entry point: ``python run.py model=... sparsifier=... comp=... task=...`` (see conf/ and README)."""

import hydra
from omegaconf import DictConfig

from toptheta.config import register

register()  # the typed schema (toptheta/config.py) that conf/config.yaml composes into


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from toptheta.pipeline import run

    run(cfg)


if __name__ == "__main__":
    main()
