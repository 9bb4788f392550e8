"""A shard as a torch ``IterableDataset`` (``Shard.torch()``): imported only when asked, since
it imports torch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

if TYPE_CHECKING:
    import pyarrow as pa

    from nbdist.rank.shard import Shard


class ShardDataset(IterableDataset[Any]):
    """One item per batch of the shard: a dict of column → tensor, or with ``features`` the
    tensor of those columns side by side (and with ``label`` the pair ``(x, y)``). Each
    iteration reads the shard's next epoch; DataLoader workers take every k-th batch."""

    def __init__(self, shard: Shard, *, columns: Sequence[str] | None,
                 features: Sequence[str] | None, label: str | None, dtype: Any) -> None:
        self.shard = shard
        self.columns = list(columns) if columns is not None else None
        self.features = list(features) if features is not None else None
        self.label = label
        self.dtype = dtype if dtype is not None else torch.float32
        if self.features is None and label is not None:
            raise ValueError("torch(label=...) goes with features=[...]")

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        for i, batch in enumerate(self.shard):
            if info is not None and i % info.num_workers != info.id:
                continue
            yield self._item(batch)

    def _item(self, batch: pa.RecordBatch) -> Any:
        if self.features is None:
            names = self.columns if self.columns is not None else batch.schema.names
            return {name: _tensor(batch.column(name)) for name in names}
        x = torch.stack([_tensor(batch.column(f)).to(self.dtype) for f in self.features], 1)
        if self.label is None:
            return x
        return x, _tensor(batch.column(self.label))


def _tensor(column: pa.Array) -> torch.Tensor:
    return torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
