"""Moved to :mod:`probe.rows.target` (the row layer below explain and intervene). This name is
the same module object, so existing imports (and monkeypatches) keep working."""

import sys

from probe.rows import target as _moved

sys.modules[__name__] = _moved
