"""Entry point: ``python run.py model=... sparsifier=... comp=... task=...`` (see conf/ and README)."""

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from toptheta.pipeline import run

    run(cfg)


if __name__ == "__main__":
    main()
