"""The experts each position of a request was routed to, kept for SGLang's ``return_routed_experts``.

SGLang 0.5.23 answers ``meta_info["routed_experts"]``: the base64 of an int32 array of shape
``(positions, num_layers, top_k)`` in C order, over positions ``[routed_experts_start_len,
seqlen - 1)`` of prompt + output (the last token has not been through the model yet). A
position's row is the routing of the forward that last computed its KV: a request re-prefilled
after a weight update overwrites its rows with the new weights' routing.
"""
from __future__ import annotations

import base64

import torch


class RouteLog:
    """Rows ``[num_layers, top_k]`` per position, written as forwards compute them."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self._rows = torch.empty((0, num_layers, top_k), dtype=torch.int32)
        self.length = 0  # positions 0 .. length - 1 are recorded

    def write(self, start: int, rows_nLK: torch.Tensor) -> None:
        """Record positions ``start .. start + n - 1``; what came after ``start`` is dropped."""
        if start > self.length:
            raise ValueError(f"routes for positions from {start} but only {self.length} are recorded")
        end = start + rows_nLK.shape[0]
        if end > self._rows.shape[0]:  # grow by doubling: a decode step appends one row
            grown = torch.empty((max(end, 2 * self._rows.shape[0]), *self._rows.shape[1:]), dtype=torch.int32)
            grown[:self.length] = self._rows[:self.length]
            self._rows = grown
        self._rows[start:end] = rows_nLK
        self.length = end

    def copy_prefix(self, other: RouteLog, n: int) -> None:
        """Start from the first ``n`` positions of ``other`` (a request whose prompt KV was shared)."""
        self.length = 0
        self.write(0, other._rows[:n])

    def rows(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"positions {start}..{end} are outside the {self.length} recorded")
        return self._rows[start:end]


def encode_routes(rows: torch.Tensor) -> str:
    """SGLang's wire format: base64 of the int32 array's bytes (native, little-endian order)."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")

