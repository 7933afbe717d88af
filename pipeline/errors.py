"""The failures a kiln command reports in one line, with exit 2 (`UserError`, bad input) or 1 (`StageError`, a
failure while working). Defined in `kiln.model.errors`, below the model layer's writer that raises them."""

from kiln.model.errors import KilnError, StageError, UserError

__all__ = ["KilnError", "StageError", "UserError"]
