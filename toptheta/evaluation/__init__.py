"""Evaluation: lm-eval tasks and adapter, generation tasks, the HumanEval sandbox."""
