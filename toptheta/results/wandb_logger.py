"""Optional Weights & Biases logging: config, metrics, sparsity statistics, a table and plots.

Offline by default (``mode: offline``): this may run where there is no network; ``wandb sync``
uploads later. With ``logger=none`` nothing is imported.
"""

from __future__ import annotations


class NullLogger:
    def log_run(self, spec, rows, stats) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    def __init__(self, options: dict, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=options.get("project", "toptheta"), entity=options.get("entity"),
                              mode=options.get("mode", "offline"), group=options.get("group"),
                              tags=list(options.get("tags") or []), config=config, reinit="finish_previous")

    def log_run(self, spec, rows, stats) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import pandas as pd

        prefix = spec.label
        metrics = {f"{prefix}/{r['task']}/{r['metric']}": r["value"] for r in rows}
        metrics.update({f"{prefix}/stats/{k}": v for k, v in stats.summary().items() if v is not None})
        self.run.log(metrics)
        self.run.log({f"{prefix}/summary": self.wandb.Table(dataframe=pd.DataFrame(rows))})
        per_layer = pd.DataFrame(stats.per_layer())
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(per_layer["layer"], per_layer["kept_attention_fraction"], marker="o", label="kept attention")
        if per_layer["kept_vrow_fraction"].notna().any():
            ax.plot(per_layer["layer"], per_layer["kept_vrow_fraction"], marker="s", label="kept V rows")
        ax.set(xlabel="layer", ylabel="kept fraction", title=prefix)
        ax.legend()
        self.run.log({f"{prefix}/kept_per_layer": self.wandb.Image(fig)})
        plt.close(fig)

    def finish(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # stop wandb's background service: a finished pipeline leaves no process behind


def make_logger(options: dict, config: dict):
    if options.get("name", "none") == "none":
        return NullLogger()
    if options["name"] == "wandb":
        return WandbLogger(options, config)
    raise ValueError(f"logger={options['name']!r}; valid: none, wandb")
