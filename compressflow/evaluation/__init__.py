"""Evaluation: the parameters and results of evaluate-model and sweep-recipe (the scoring runs in reporting/)."""
