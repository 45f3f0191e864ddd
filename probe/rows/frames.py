"""Tidy tables from result tensors with named axes: the ``to_pandas()`` of the intervention results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch


def grid_frame(axes: Sequence[str], columns: Mapping[str, torch.Tensor]) -> pd.DataFrame:
    """One row per cell of ``columns``' tensors, which broadcast to one shape with an axis per name
    in ``axes`` (``original[:, None, None]`` repeats a per-example value over layer and head): a
    column per axis (the cell's index along it, int64) then a column per tensor (floats as float64),
    in C order, the last axis fastest."""
    tensors = torch.broadcast_tensors(*(c.detach().cpu() for c in columns.values()))
    shape = tuple(tensors[0].shape)
    if len(shape) != len(axes):
        raise ValueError(f"{len(axes)} axes ({', '.join(axes)}) named for tensors of shape {list(shape)}")
    index = pd.MultiIndex.from_product([np.arange(n, dtype=np.int64) for n in shape], names=list(axes))
    values = {name: (t.double() if t.is_floating_point() else t).reshape(-1).numpy()
              for name, t in zip(columns, tensors)}
    return pd.DataFrame(values, index=index).reset_index()
