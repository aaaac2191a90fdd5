"""The runtime run store: what a run writes and the locks that keep parallel jobs apart.

runs.py (RunStore: run directories, summary.csv, run ids), rows.py (summary rows), samples.py (per-sample
logs), provenance.py (commit and time), claims.py (one job per run), migrate.py (rebuild summary.csv).
The analysis of what is stored (tables, figures, verdicts) lives in toptheta.results, which reads this
package and is never read by it.
"""
