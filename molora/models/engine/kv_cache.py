"""RowKVCache: a static KV cache addressed by (row, position), for the serving engine.

Every row of the engine's batch owns one row of preallocated key/value tensors [rows, kv_heads, max_len,
head_dim] per layer, allocated once, so their addresses never change (a captured decode step stays valid).
Unlike transformers' StaticCache, which writes the whole batch at one shared `cache_position`, each row here
writes at its OWN positions: rows join and leave the running batch at any step, each at its own length.

Before each forward the engine says which rows the call covers and at which positions each token lands
(`address`); attention then reads those rows' whole buffers and the engine's 4-D mask hides every column a row
has not written (or wrote for an earlier request).  Row r's tokens are written with one `index_put_`, so the
update is a fixed-shape device op (no host sync, CUDA-graph safe).

A model spread over devices (accelerate's device_map) keeps each layer's K/V on that layer's device
(PlacedRowKVCache, `for_model(..., layer_devices=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache


class RowKVCache(Cache):
    """Preallocated K/V for `max_rows` rows of `max_len` positions in each of `num_layers` attention layers."""

    def __init__(self, num_layers: int, max_rows: int, max_len: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str,
                 layer_devices: Sequence[torch.device] | None = None) -> None:
        super().__init__(layers=[])
        shape = (max_rows, kv_heads, max_len, head_dim)
        devices = list(layer_devices) if layer_devices is not None else [device] * num_layers
        self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.max_rows, self.max_len = max_rows, max_len
        self._rows: torch.Tensor | None = None  # [n] long: the cache row of each batch row
        self._positions: torch.Tensor | None = None  # [n, T] long: where each new token is written
        self._row_column: torch.Tensor | None = None  # [n, 1]: _rows as the writes' index, made once a forward
        self._leading = 0  # > 0: the call covers rows [0, leading) in order, so reads need no gather
        self._length = max_len  # columns attention reads (every written position of the call's rows is below)
        self.live_rows: int | None = None  # a decode call's rows from here on are padding (None: none are)
        self.causal_rows = False  # True: each row's one query sees exactly its columns 0..its position

    @classmethod
    def for_model(cls, config: Any, max_rows: int, max_len: int, *, dtype: torch.dtype,
                  device: torch.device | str, layer_devices: Sequence[torch.device] | None = None) -> RowKVCache:
        """Sized from a transformers config (its text config for multimodal models). `layer_devices`: the device of
        each attention layer of a model spread over devices (each layer's K/V live there): a PlacedRowKVCache."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        num_layers = int(text.num_hidden_layers)
        if layer_devices is not None and {torch.device(d) for d in layer_devices} != {torch.device(device)}:
            if len(layer_devices) != num_layers:
                raise ValueError(f"{len(layer_devices)} layer devices for a model of {num_layers} attention layers")
            return PlacedRowKVCache(num_layers, max_rows, max_len, kv_heads, head_dim, dtype=dtype, device=device,
                                    layer_devices=layer_devices)
        return cls(num_layers, max_rows, max_len, kv_heads, head_dim, dtype=dtype, device=device)

    @staticmethod
    def planned_nbytes(config: Any, max_rows: int, max_len: int, dtype: torch.dtype) -> int:
        """What for_model would allocate, computed without allocating (a config may declare any length)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * int(text.num_hidden_layers) * max_rows * max_len * kv_heads * head_dim * item

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def nbytes_by_device(self) -> dict[torch.device, int]:
        sizes: dict[torch.device, int] = {}
        for t in (*self.keys, *self.values):
            sizes[t.device] = sizes.get(t.device, 0) + t.nbytes
        return sizes

    def address(self, rows: torch.Tensor, positions: torch.Tensor, *, leading: int = 0,
                length: int | None = None, live: int | None = None, causal: bool = False) -> None:
        """The next forward writes token t of batch row i at cache row rows[i], position positions[i, t].
        `leading=n` promises rows == arange(n) (the decode step), so attention reads a view, not a gather;
        `length` promises every position the rows hold is below it, so attention reads only those columns;
        `live` says batch rows from `live` on are padding, whose outputs nobody reads (`live_rows`);
        `causal` promises the mask is exactly "column <= the row's position" (a decode step), so attention may read
        each row's columns up to its position and skip the mask (`causal_rows`)."""
        self._rows, self._positions, self._leading = rows, positions, leading
        self._row_column = rows[:, None]  # the writes' index (rows, :, positions): advanced dims first, [n, T, H, D]
        self._length = length or self.max_len
        self.live_rows = live
        self.causal_rows = causal

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [n, H, T, D] new keys/values at the addressed places; return the rows' whole buffers."""
        return self.store(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))

    def store(self, layer_idx: int, keys_nthd: torch.Tensor, values_nthd: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for keys/values laid out [n, T, H, D] (the projections' own layout: no transposes); returns the
        rows' whole buffers [n, H, L, D]."""
        keys, values, rows, positions = self.write_places(layer_idx)
        write_rows(keys, values, rows, positions, keys_nthd, values_nthd)
        return self.rows_of(layer_idx)

    def write_places(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, rows [n, 1], positions [n, T]) of the next forward's writes into layer `layer_idx`, for a
        caller that writes them itself (write_rows; the engine's LeanDecoder, inside its compiled rotary piece)."""
        if self._rows is None:
            raise RuntimeError("RowKVCache.address(rows, positions) must be called before each forward")
        return self.keys[layer_idx], self.values[layer_idx], self._row_column, self._positions

    def rows_of(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's rows' whole buffers [n, H, L, D] of layer `layer_idx` (after its writes)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._leading:
            return keys[:self._leading, :, :self._length], values[:self._leading, :, :self._length]
        return keys[self._rows, :, :self._length], values[self._rows, :, :self._length]

    # --- what transformers' models ask of a cache -----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the engine's position_ids, never from the cache

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    @property
    def is_compileable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.keys)


def write_rows(keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               keys_nthd: torch.Tensor, values_nthd: torch.Tensor) -> None:
    """keys[rows[i], :, positions[i, t]] = keys_nthd[i, t] (and the values): one index_put_ each, a fixed-shape
    device op (RowKVCache.write_places gives the places)."""
    keys[rows, :, positions] = keys_nthd.to(keys.dtype)
    values[rows, :, positions] = values_nthd.to(values.dtype)


class PlacedRowKVCache(RowKVCache):
    """RowKVCache of a model spread over devices: layer i's K/V live on layer i's device, and the call's row and
    position indices are copied to each device once per forward (in `address`), not once per layer."""

    def address(self, rows: torch.Tensor, positions: torch.Tensor, **promises: Any) -> None:
        super().address(rows, positions, **promises)
        self._placed = {rows.device: (rows, positions)}
        for keys in self.keys:
            if keys.device not in self._placed:
                quiet = keys.device.type == "cuda"
                self._placed[keys.device] = (rows.to(keys.device, non_blocking=quiet),
                                             positions.to(keys.device, non_blocking=quiet))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            raise RuntimeError("RowKVCache.address(rows, positions) must be called before each forward")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, positions = self._placed[keys.device]
        index = (rows[:, None], slice(None), positions)
        keys[index] = key_states.transpose(1, 2).to(keys.device, keys.dtype)
        values[index] = value_states.transpose(1, 2).to(values.device, values.dtype)
        if self._leading:
            return keys[:self._leading, :, :self._length], values[:self._leading, :, :self._length]
        return keys[rows, :, :self._length], values[rows, :, :self._length]
