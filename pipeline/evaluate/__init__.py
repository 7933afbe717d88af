"""Evaluation: the evaluate stage, scoring, generative tasks, pass@k and the report."""
