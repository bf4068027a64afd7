"""Online prediction of what a training loop launches next and what it touches.

DeepUM-style tables learned across iterations (:mod:`umrt.predict.tables`)
and stable keys for objects whose ids change every iteration.
"""
from __future__ import annotations

from umrt.predict.tables import (
    START,
    CorrelationTable,
    DataRow,
    DataTable,
    ObjectKeys,
    VariantTable,
    carried_key,
    persistent_key,
)

__all__ = [
    "START",
    "CorrelationTable",
    "DataRow",
    "DataTable",
    "ObjectKeys",
    "VariantTable",
    "carried_key",
    "persistent_key",
]
