"""The analysis of the results store: tables, figures and verdicts from summary.csv and the run directories.

What a run writes (the run store, summary rows, claims) is toptheta.store; this package only reads it.
"""
