"""Scaling laws: the IsoFLOP sweep, the fits, the model size they give."""
