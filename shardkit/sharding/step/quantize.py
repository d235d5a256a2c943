"""Block-quantized int8 payloads for the collectives that cross the slow link (ZeRO++ qwZ / qgZ).

A row of values is cut into blocks of `block` elements; each block is sent as int8 codes with
one fp32 scale (its largest magnitude / 127), so one absurd value spoils only its own block. A
payload is one byte tensor, codes first and then the scales' bytes, so a row travels as a
single collective of `payload_bytes(n, block)` bytes: n padded up to whole blocks, plus 4 bytes
per block. Every rank decodes the same bytes, its own row included, so replicas that dequantize
a gathered payload hold identical values.

Pure torch on any device (meta included, for the planner's rehearsal); nothing here talks to a
backend. Codes are rounded to nearest: the error of one element is at most half a step, i.e.
absmax(block) / 254.
"""

from __future__ import annotations

import torch

INT8_LEVELS = 127  # symmetric: -127..127, so 0 is exact and the range is the same both ways
SCALE_BYTES = 4  # one fp32 scale per block


def blocks_in(numel: int, block: int) -> int:
    """Blocks a row of `numel` elements is cut into (the last one padded with zeros)."""
    return -(-numel // block)


def payload_bytes(numel: int, block: int) -> int:
    """Bytes one quantized row of `numel` elements takes on the wire: codes plus scales."""
    blocks = blocks_in(numel, block)
    return blocks * block + blocks * SCALE_BYTES


def encode_rows(rows: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize each row of a 2-D float tensor into a (rows, payload_bytes) uint8 payload."""
    count, numel = rows.shape
    blocks = blocks_in(numel, block)
    padded = rows.float()
    if blocks * block != numel:
        padded = torch.nn.functional.pad(padded, (0, blocks * block - numel))
    padded = padded.view(count, blocks, block)
    scales = padded.abs().amax(dim=2) / INT8_LEVELS
    # An all-zero block keeps scale 0 (it decodes to zeros); dividing by 1 there avoids 0/0.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    # One fp32 temporary the size of the rows: divided, rounded and clamped in place.
    codes = padded.div(safe.unsqueeze(2)).round_().clamp_(-INT8_LEVELS, INT8_LEVELS)
    if out is None:
        out = torch.empty(count, payload_bytes(numel, block), dtype=torch.uint8,
                          device=rows.device)
    out = out.view(count, -1)
    out[:, :blocks * block].view(torch.int8).copy_(codes.view(count, -1))
    out[:, blocks * block:].copy_(scales.view(torch.uint8).view(count, -1))
    return out


def decode_rows(payload: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The (rows, numel) fp32 values a (rows, payload_bytes) uint8 payload encodes."""
    count = payload.numel() // payload_bytes(numel, block)
    payload = payload.view(count, -1)
    blocks = blocks_in(numel, block)
    codes = payload[:, :blocks * block].view(torch.int8).view(count, blocks, block)
    # The scales' bytes sit after the codes: a column slice, copied so it can be viewed as fp32.
    scales = payload[:, blocks * block:].contiguous().view(torch.float32).view(count, blocks, 1)
    return codes.float().mul_(scales).view(count, blocks * block)[:, :numel]
