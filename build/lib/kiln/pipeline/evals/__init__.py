"""Evaluation: the evaluate stage, task formats, scoring, sampling."""
