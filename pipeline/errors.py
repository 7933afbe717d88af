"""The failures a kiln command reports in one line, with exit 2 (`UserError`, bad input) or 1 (`StageError`, a
failure while working). Defined in `kiln.model.errors`, below the model layer's writer that raises them."""

import reprlib

from kiln.model.errors import KilnError, StageError, UserError

__all__ = ["KilnError", "StageError", "UserError", "shown"]


def shown(value, limit: int = 60) -> str:
    """A value as an error message quotes it: its repr, cut short, since a value from a file or a client may be
    any size (a YAML alias bomb expands to gigabytes when printed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length():,} bits>"  # repr would take long, or refuse past 4300 digits
    short = reprlib.Repr()  # attributes, not keywords: Python 3.11's Repr takes none
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, limit, limit, limit
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({type(value).__name__})"
